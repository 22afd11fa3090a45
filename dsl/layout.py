"""Layout algebra: functions from (nested) coordinates to memory offsets, CuTe style.

A :class:`Layout` is a shape and a stride, both (possibly nested) tuples of integers with the
same nesting ("congruent"). It maps a coordinate to ``sum(coord_i * stride_i)``::

    >>> L = Layout((4, 8), (8, 1))          # a row-major 4x8 tile
    >>> L((2, 3))                            # row 2, column 3
    19

A single integer is also a coordinate: it is split over the modes *colexicographically*
(first mode fastest, as in CuTe and Fortran), so ``L(1) == L((1, 0))`` and ``L(4) == L((0, 1))``.
Past ``size()`` the last mode keeps counting, which is what :func:`composition` relies on.

Evaluation uses only ``+ * // %`` on the coordinates, so the same layout evaluates Python ints,
numpy integer arrays (vectorised over many coordinates) and traced Kiln values alike.

The algebra (:func:`coalesce`, :func:`composition`, :func:`complement`, the divides and products,
:func:`right_inverse`) follows CuTe's definitions; docs/layouts.md has worked examples.

:class:`ThreadValueLayout` describes how a 2-D tile is split over threads: which thread holds
which element in which of its registers. :func:`partition_tile` builds one for plain tiled
copies; the named constructors give the accumulator fragments of NVIDIA ``mma.sync`` and
``wgmma`` and AMD MFMA instructions.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from .core.errors import KilnValueError

IntTuple = Union[int, tuple]


# ----------------------------------------------------------------------------- int tuples


def _is_tuple(x: Any) -> bool:
    return isinstance(x, tuple)


def _normalize(x: Any, what: str, *, minimum: int) -> IntTuple:
    """Lists become tuples, numpy ints become ints; every leaf must be an int >= ``minimum``."""
    if isinstance(x, (tuple, list)):
        if len(x) == 0:
            raise KilnValueError(f"a layout {what} cannot contain an empty tuple",
                                 fix="give every mode an extent, e.g. (4, 8) or ((2, 2), 8)")
        return tuple(_normalize(e, what, minimum=minimum) for e in x)
    if isinstance(x, bool):
        raise KilnValueError(f"layout {what} entries must be integers, got {x!r}",
                             fix="use plain Python integers")
    try:
        value = operator.index(x)
    except TypeError:
        raise KilnValueError(f"layout {what} entries must be integers, got {x!r}",
                             fix="use plain Python integers (layouts are compile-time data)") from None
    if value < minimum:
        bound = "positive" if minimum == 1 else "non-negative"
        raise KilnValueError(f"layout {what} entries must be {bound}, got {value}",
                             fix=f"use {bound} {what} entries")
    return value


def flatten(t: IntTuple) -> tuple:
    """The leaves of a nested int tuple, left to right: ``flatten(((2, 3), 4)) == (2, 3, 4)``."""
    if _is_tuple(t):
        return tuple(leaf for e in t for leaf in flatten(e))
    return (t,)


def product(t: IntTuple) -> int:
    """The product of all leaves of a nested int tuple."""
    result = 1
    for leaf in flatten(t):
        result *= leaf
    return result


def _congruent(a: IntTuple, b: IntTuple) -> bool:
    if _is_tuple(a) != _is_tuple(b):
        return False
    return not _is_tuple(a) or (len(a) == len(b) and all(map(_congruent, a, b)))


def _compact_strides(shape: IntTuple, order: str, start: int = 1) -> IntTuple:
    """Strides of a compact layout of ``shape``: first leaf fastest ("col") or last ("row")."""
    leaves = flatten(shape)
    strides = [0] * len(leaves)
    current = start
    positions = range(len(leaves)) if order == "col" else reversed(range(len(leaves)))
    for i in positions:
        strides[i] = current
        current *= leaves[i]
    return _unflatten(tuple(strides), shape)


def _unflatten(leaves: tuple, like: IntTuple) -> IntTuple:
    """Rebuild ``leaves`` with the nesting of ``like``."""
    it = iter(leaves)

    def build(t):
        return tuple(build(e) for e in t) if _is_tuple(t) else next(it)

    return build(like)


# ----------------------------------------------------------------------------- generic evaluation


def _scaled(x: Any, k: int) -> Any:
    return x if k == 1 else x * k


def _index_to_offset(coord: Any, shape: IntTuple, stride: IntTuple) -> Any:
    """Offset of ``coord``: an int-like, or a tuple matching the top-level nesting of ``shape``.

    An int-like is split over the sub-modes colexicographically; the last sub-mode takes the
    remainder unreduced (the parent already bounded it, or it is the outermost mode, which
    keeps counting past ``size()``). Returns None for a contribution that is identically zero,
    so traced callers do not get ``x * 0`` ops.
    """
    if _is_tuple(coord):
        if not _is_tuple(shape) or len(coord) != len(shape):
            raise KilnValueError(f"coordinate {coord!r} does not match layout shape {shape!r}",
                                 fix="pass one coordinate per mode, or a single linear index")
        return _sum([_index_to_offset(c, s, d) for c, s, d in zip(coord, shape, stride)])
    if not _is_tuple(shape):
        return None if stride == 0 else _scaled(coord, stride)
    terms = []
    rest = coord
    for i, (s, d) in enumerate(zip(shape, stride)):
        size = product(s)
        if i == len(shape) - 1:
            terms.append(_index_to_offset(rest, s, d))
        elif size != 1:
            terms.append(_index_to_offset(rest % size, s, d))
            rest = rest // size
    return _sum(terms)


def _sum(terms: list) -> Any:
    total = None
    for t in terms:
        if t is not None:
            total = t if total is None else total + t
    return total


# ----------------------------------------------------------------------------- Layout


@dataclass(frozen=True)
class Layout:
    """A map from coordinates to offsets: ``offset = sum(coord_i * stride_i)``.

    ``shape`` and ``stride`` are congruent (possibly nested) tuples of ints, or single ints.
    Extents are positive and strides non-negative. ``stride`` defaults to the compact
    column-major strides (so ``Layout(n)`` is the identity on ``range(n)``).

    Example::

        >>> Layout((2, 3), (3, 1)).offsets()     # linear index is colexicographic
        array([0, 3, 1, 4, 2, 5])
    """

    shape: IntTuple
    stride: IntTuple = None  # type: ignore[assignment]

    def __post_init__(self):
        shape = _normalize(self.shape, "shape", minimum=1)
        stride = (_compact_strides(shape, "col") if self.stride is None
                  else _normalize(self.stride, "stride", minimum=0))
        if not _congruent(shape, stride):
            raise KilnValueError(
                f"layout shape {shape!r} and stride {stride!r} do not have the same nesting",
                fix="give exactly one stride per extent, nested the same way as the shape")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "stride", stride)

    # --- queries

    @property
    def rank(self) -> int:
        """Number of top-level modes (an int shape has rank 1)."""
        return len(self.shape) if _is_tuple(self.shape) else 1

    def size(self) -> int:
        """Number of coordinates in the domain."""
        return product(self.shape)

    def cosize(self) -> int:
        """One past the largest offset: the span of memory the layout touches."""
        return sum((s - 1) * d for s, d in zip(flatten(self.shape), flatten(self.stride))) + 1

    def __getitem__(self, mode: int) -> "Layout":
        """The sub-layout of top-level mode ``mode``."""
        if not _is_tuple(self.shape):
            if mode in (0, -1):
                return self
            raise KilnValueError(f"mode {mode} out of range for a rank-1 layout", fix="use mode 0")
        return Layout(self.shape[mode], self.stride[mode])

    def modes(self) -> tuple["Layout", ...]:
        """The top-level modes as layouts."""
        return tuple(self[i] for i in range(self.rank))

    def __len__(self) -> int:
        return self.rank

    # --- evaluation

    def __call__(self, coord: Any) -> Any:
        """The offset of ``coord``: a linear index or a coordinate tuple (ints, arrays or values).

        Example: ``Layout((4, 8), (8, 1))((2, 3)) == 19``; with numpy arrays the result is an
        array of offsets.
        """
        offset = _index_to_offset(coord, self.shape, self.stride)
        if offset is None:  # every contributing stride is 0
            return _any_leaf(coord) * 0
        return offset

    def offsets(self) -> np.ndarray:
        """``[self(i) for i in range(self.size())]`` as an int64 numpy array."""
        return np.asarray(self(np.arange(self.size(), dtype=np.int64)), dtype=np.int64)

    def is_injective(self) -> bool:
        """True when no two coordinates share an offset (checked by enumeration)."""
        offs = self.offsets()
        return len(np.unique(offs)) == len(offs)

    def __str__(self) -> str:
        return f"{self.shape}:{self.stride}"


def _any_leaf(coord: Any) -> Any:
    while _is_tuple(coord):
        coord = coord[0]
    return coord


def make_layout(shape: IntTuple, order: str = "row") -> Layout:
    """A compact layout of ``shape``: ``order="row"`` (last mode fastest, numpy's C order) or
    ``"col"`` (first mode fastest, Fortran order).

    Example: ``make_layout((4, 8))((2, 3)) == 19`` and ``make_layout((4, 8), "col")((2, 3)) == 14``.
    """
    if order not in ("row", "col"):
        raise KilnValueError(f"unknown layout order {order!r}", fix='use order="row" or "col"')
    shape = _normalize(shape, "shape", minimum=1)
    return Layout(shape, _compact_strides(shape, order))


def concat_modes(*layouts: Layout) -> Layout:
    """A layout whose top-level modes are ``layouts``: ``concat_modes(A, B)((a, b)) == A(a) + B(b)``."""
    if not layouts:
        raise KilnValueError("concat_modes needs at least one layout", fix="pass one or more layouts")
    return Layout(tuple(l.shape for l in layouts), tuple(l.stride for l in layouts))


def _as_layout(x: Union[Layout, int]) -> Layout:
    return x if isinstance(x, Layout) else Layout(x)


# ----------------------------------------------------------------------------- algebra


def coalesce(layout: Layout) -> Layout:
    """The same function of the linear index with the fewest modes (flat; size-1 modes dropped,
    ``(s0, s1):(d0, s0*d0)`` merged to ``s0*s1:d0``).

    Example: ``coalesce(Layout((2, (1, 4)), (1, (7, 2)))) == Layout(8, 1)``.
    """
    shapes: list[int] = []
    strides: list[int] = []
    for s, d in zip(flatten(layout.shape), flatten(layout.stride)):
        if s == 1:
            continue
        if shapes and strides[-1] * shapes[-1] == d:
            shapes[-1] *= s
        else:
            shapes.append(s)
            strides.append(d)
    if not shapes:
        return Layout(1, 0)
    if len(shapes) == 1:
        return Layout(shapes[0], strides[0])
    return Layout(tuple(shapes), tuple(strides))


def _compose_leaf(a: Layout, shape: int, stride: int) -> Layout:
    """``a ∘ (shape:stride)`` for an integer (single-mode) right operand."""
    if stride == 0:
        return Layout(shape, 0)
    flat = coalesce(a)
    a_shapes, a_strides = flatten(flat.shape), flatten(flat.stride)
    out_shapes: list[int] = []
    out_strides: list[int] = []
    rest_shape, rest_stride = shape, stride
    for s, d in zip(a_shapes[:-1], a_strides[:-1]):
        if s % rest_stride and rest_stride % s:
            raise KilnValueError(
                f"cannot compose {a} with {shape}:{stride}: stride {rest_stride} and extent {s} "
                "do not divide one another",
                fix="pick tile strides that are products of the outer layout's extents")
        new_shape = min(max(1, s // rest_stride), rest_shape)
        if rest_shape % new_shape:
            raise KilnValueError(
                f"cannot compose {a} with {shape}:{stride}: extent {rest_shape} is not a "
                f"multiple of {new_shape}",
                fix="pick tile extents that divide the outer layout's modes")
        if new_shape != 1:
            out_shapes.append(new_shape)
            out_strides.append(rest_stride * d)
        rest_shape //= new_shape
        rest_stride = -(-rest_stride // s)
    if rest_shape != 1 or not out_shapes:
        out_shapes.append(rest_shape)
        out_strides.append(rest_stride * a_strides[-1])
    if len(out_shapes) == 1:
        return Layout(out_shapes[0], out_strides[0])
    return Layout(tuple(out_shapes), tuple(out_strides))


def _compose_layout(a: Layout, b: Layout) -> Layout:
    if _is_tuple(b.shape):
        return concat_modes(*(_compose_layout(a, mode) for mode in b.modes()))
    return _compose_leaf(a, b.shape, b.stride)


Tiler = Union[Layout, int, tuple]


def composition(a: Layout, b: Tiler) -> Layout:
    """``a ∘ b``: the layout ``c`` with ``c(i) == a(b(i))`` and the shape of ``b``.

    ``b`` may also be a tuple "tiler" (one layout or int extent per mode of ``a``); then each
    mode of ``a`` is composed with its entry and the remaining modes are kept.

    Example: picking every other column of a row-major 4x8 tile::

        >>> composition(make_layout((4, 8)), (4, Layout(4, 2)))((1, 3))  # row 1, column 6
        14
    """
    if isinstance(b, Layout):
        return _compose_layout(a, b)
    if _is_tuple(b):
        if len(b) > a.rank:
            raise KilnValueError(f"tiler {b!r} has more modes than layout {a}",
                                 fix="give at most one tile entry per mode")
        composed = [composition(a[i], t) for i, t in enumerate(b)]
        return concat_modes(*composed, *a.modes()[len(b):])
    return _compose_layout(a, _as_layout(b))


def complement(layout: Layout, cotarget: int | None = None) -> Layout:
    """The layout that enumerates the offsets ``layout`` skips, up to ``cotarget``.

    ``concat_modes(layout, complement(layout, n))`` is a bijection onto ``range(n)`` when
    ``layout`` is injective and ``n`` a multiple of what it spans.

    Example: ``complement(Layout(4, 2), 16) == Layout((2, 2), (1, 8))``.
    """
    cotarget = layout.cosize() if cotarget is None else cotarget
    pairs = sorted((d, s) for s, d in zip(flatten(layout.shape), flatten(layout.stride))
                   if s != 1 and d != 0)
    shapes: list[int] = []
    strides: list[int] = []
    current = 1
    for d, s in pairs:
        if d % current:
            raise KilnValueError(
                f"layout {layout} has no complement: stride {d} is not a multiple of {current}",
                fix="use a layout whose sorted strides divide one another (no overlapping modes)")
        shapes.append(d // current)
        strides.append(current)
        current = s * d
    shapes.append(-(-cotarget // current))
    strides.append(current)
    return coalesce(Layout(tuple(shapes), tuple(strides)))


def _per_mode(a: Layout, tiler: Tiler, op) -> Layout:
    if _is_tuple(tiler):
        if len(tiler) > a.rank:
            raise KilnValueError(f"tiler {tiler!r} has more modes than layout {a}",
                                 fix="give at most one tile entry per mode")
        return concat_modes(*(op(a[i], _as_layout(t)) for i, t in enumerate(tiler)),
                            *a.modes()[len(tiler):])
    return op(a, _as_layout(tiler))


def _divide(a: Layout, tile: Layout) -> Layout:
    return composition(a, concat_modes(tile, complement(tile, a.size())))


def logical_divide(a: Layout, tiler: Tiler) -> Layout:
    """Split ``a`` into tiles: mode 0 walks inside a tile, mode 1 over the tiles.

    With a tuple tiler each mode of ``a`` is divided by its entry: the result's mode ``i`` is
    ``(tile_i, rest_i)``.

    Example: ``logical_divide(Layout(16), 4) == Layout((4, 4), (1, 4))``.
    """
    return _per_mode(a, tiler, _divide)


def zipped_divide(a: Layout, tiler: Tiler) -> Layout:
    """Like :func:`logical_divide` with a tuple tiler, but gathered as ``((tiles...), (rests...))``:
    mode 0 indexes inside one tile, mode 1 picks the tile.

    Example: the 4x4 tiles of a row-major 8x8 matrix::

        >>> Z = zipped_divide(make_layout((8, 8)), (4, 4))
        >>> Z(((1, 2), (1, 0)))     # element (1, 2) of the tile in tile-row 1, tile-column 0
        42
    """
    divided = logical_divide(a, tiler)
    if not _is_tuple(tiler):
        return divided
    n = len(tiler)
    modes = divided.modes()
    tiles = concat_modes(*(modes[i][0] for i in range(n)))
    rests = concat_modes(*(modes[i][1] for i in range(n)), *modes[n:])
    return concat_modes(tiles, rests)


def logical_product(a: Layout, b: Layout) -> Layout:
    """``(a, b')``: ``b`` copies of ``a``, where ``b`` indexes in units of ``a``'s span.

    Example: ``logical_product(Layout(2), Layout(3)) == Layout((2, 3), (1, 2))``.
    """
    b = _as_layout(b)
    return concat_modes(a, composition(complement(a, a.size() * b.cosize()), b))


def _zip_product(a: Layout, b: Layout, block_first: bool) -> Layout:
    if a.rank != b.rank:
        raise KilnValueError(f"product operands {a} and {b} have different ranks",
                             fix="give the block and the tiler the same number of modes")
    prod = logical_product(a, b)
    block, tiles = prod[0], prod[1]
    if a.rank == 1:
        return concat_modes(block, tiles) if block_first else concat_modes(tiles, block)
    pairs = [(block[i], tiles[i]) if block_first else (tiles[i], block[i]) for i in range(a.rank)]
    return concat_modes(*(concat_modes(x, y) for x, y in pairs))


def blocked_product(block: Layout, tiler: Layout) -> Layout:
    """Repeat ``block`` over the grid ``tiler``, mode by mode: result mode ``i`` is
    ``(block_i, tiler_i)``, so each block stays contiguous in coordinates.

    Example: ``blocked_product(make_layout((2, 2)), make_layout((1, 3)))`` is a 2x6 layout made
    of three 2x2 blocks side by side.
    """
    return _zip_product(block, _as_layout(tiler), block_first=True)


def raked_product(block: Layout, tiler: Layout) -> Layout:
    """Like :func:`blocked_product` but interleaved: result mode ``i`` is ``(tiler_i, block_i)``."""
    return _zip_product(block, _as_layout(tiler), block_first=False)


def right_inverse(layout: Layout) -> Layout:
    """The largest compact ``r`` with ``layout(r(i)) == i`` for ``i < r.size()``.

    Example: ``right_inverse(make_layout((4, 8)))`` maps a row-major offset back to the
    colexicographic index of its coordinate.
    """
    leaves_shape, leaves_stride = flatten(layout.shape), flatten(layout.stride)
    index_strides = flatten(_compact_strides(tuple(leaves_shape), "col"))
    shapes: list[int] = []
    strides: list[int] = []
    current = 1
    for d, s, r in sorted(zip(leaves_stride, leaves_shape, index_strides)):
        if s == 1 or d == 0:
            continue
        if d != current:
            break
        shapes.append(s)
        strides.append(r)
        current = s * d
    if not shapes:
        return Layout(1, 0)
    return coalesce(Layout(tuple(shapes), tuple(strides)))


def left_inverse(layout: Layout) -> Layout:
    """``r`` with ``r(layout(i)) == i`` for every ``i < layout.size()`` (``layout`` injective)."""
    return right_inverse(concat_modes(layout, complement(layout)))


# ----------------------------------------------------------------------------- thread-value layouts


@dataclass(frozen=True)
class ThreadValueLayout:
    """How a ``rows x cols`` tile is spread over threads: ``layout((thread, value))`` is the
    row-major position ``row * cols + col`` of the element that ``thread`` holds as its
    ``value``-th register.

    Invariant: every element of the tile is held exactly once (checked on construction).

    Example (the ``mma.sync`` m16n8 accumulator)::

        >>> tv = mma_m16n8_accumulator()
        >>> tv(5, 2)            # lane 5, register c2
        (9, 2)
    """

    layout: Layout
    tile: tuple[int, int]

    def __post_init__(self):
        tile = _normalize(self.tile, "tile", minimum=1)
        if not _is_tuple(tile) or len(tile) != 2 or any(_is_tuple(t) for t in tile):
            raise KilnValueError(f"a thread-value tile must be (rows, cols), got {self.tile!r}",
                                 fix="pass tile=(rows, cols)")
        object.__setattr__(self, "tile", tile)
        if self.layout.rank != 2:
            raise KilnValueError(f"a thread-value layout needs modes (thread, value), got {self.layout}",
                                 fix="build it with concat_modes(thread_layout, value_layout)")
        rows, cols = tile
        offsets = self.layout.offsets()
        counts = np.bincount(offsets, minlength=rows * cols)
        if len(counts) != rows * cols or not np.all(counts == 1):
            raise KilnValueError(
                f"thread-value layout {self.layout} does not cover the {rows}x{cols} tile exactly "
                f"once ({int(np.sum(counts[:rows * cols] == 0))} elements missed, "
                f"{int(np.sum(counts > 1))} held twice, {int(np.sum(offsets >= rows * cols))} "
                "outside)", fix="make threads x values equal the tile and the strides disjoint")

    @property
    def num_threads(self) -> int:
        return self.layout[0].size()

    @property
    def num_values(self) -> int:
        """Values (registers) per thread."""
        return self.layout[1].size()

    def __call__(self, thread: Any, value: Any) -> tuple[Any, Any]:
        """``(row, col)`` of ``thread``'s ``value``-th element (ints, arrays or traced values)."""
        offset = self.layout((thread, value))
        cols = self.tile[1]
        return offset // cols, offset % cols

    def offsets(self) -> np.ndarray:
        """Row-major tile positions as a ``[num_threads, num_values]`` int64 array."""
        threads = np.arange(self.num_threads, dtype=np.int64)[:, None]
        values = np.arange(self.num_values, dtype=np.int64)[None, :]
        offsets = self.layout((threads, values))
        return np.broadcast_to(offsets, (self.num_threads, self.num_values)).astype(np.int64)

    def coords(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, cols)`` arrays of shape ``[num_threads, num_values]``."""
        offsets = self.offsets()
        return offsets // self.tile[1], offsets % self.tile[1]


def partition_tile(tile: tuple[int, int], threads: tuple[int, int],
                   values: tuple[int, int] = (1, 1)) -> ThreadValueLayout:
    """Split a row-major tile over a ``threads`` grid, each thread owning ``values`` blocks.

    Thread ``t`` sits at grid position ``(t // threads[1], t % threads[1])``; it owns a
    ``values``-shaped block there, and the grid is stamped over the tile as often as needed
    (the repeats become more values per thread). Within a thread, values run row-major through
    the block, then over the repeats (column repeats first).

    Example: 128 threads copying a 64x64 tile with 4-wide vectors::

        >>> tv = partition_tile((64, 64), threads=(8, 16), values=(1, 4))
        >>> tv.num_values, tv(17, 0), tv(17, 4)      # 8 rows apart per repeat
        (32, (1, 4), (9, 4))
    """
    tile = _normalize(tile, "tile", minimum=1)
    threads = _normalize(threads, "thread grid", minimum=1)
    values = _normalize(values, "value block", minimum=1)
    for name, t in (("tile", tile), ("threads", threads), ("values", values)):
        if not _is_tuple(t) or len(t) != 2 or any(_is_tuple(e) for e in t):
            raise KilnValueError(f"partition_tile {name} must be a pair of ints, got {t!r}",
                                 fix=f"pass {name}=(rows, cols)")
    (rows, cols), (t_rows, t_cols), (v_rows, v_cols) = tile, threads, values
    if rows % (t_rows * v_rows) or cols % (t_cols * v_cols):
        raise KilnValueError(
            f"a {t_rows}x{t_cols} thread grid with {v_rows}x{v_cols} values per thread does not "
            f"tile {rows}x{cols} evenly",
            fix="choose threads * values that divide the tile in each dimension")
    rep_rows, rep_cols = rows // (t_rows * v_rows), cols // (t_cols * v_cols)
    thread_layout = Layout((t_cols, t_rows), (v_cols, v_rows * cols))
    value_layout = Layout((v_cols, v_rows, rep_cols, rep_rows),
                          (1, cols, t_cols * v_cols, t_rows * v_rows * cols))
    return ThreadValueLayout(concat_modes(thread_layout, value_layout), (rows, cols))


def mma_m16n8_accumulator() -> ThreadValueLayout:
    """The C/D fragment of NVIDIA ``mma.sync.m16n8k{8,16,32}`` with 32-bit accumulators.

    32 lanes hold 4 values each. With ``group = lane // 4`` and ``pair = lane % 4``, register
    ``c[v]`` holds row ``group + 8 * (v // 2)``, column ``2 * pair + v % 2``; e.g. lane 5 holds
    (1, 2), (1, 3), (9, 2), (9, 3). See PTX ISA, "Matrix Fragments for mma.m16n8k16 with
    floating point type": https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float
    """
    lanes = Layout((4, 8), (2, 8))
    values = Layout((2, 2), (1, 64))
    return ThreadValueLayout(concat_modes(lanes, values), (16, 8))


def wgmma_m64_accumulator(n: int) -> ThreadValueLayout:
    """The D fragment of NVIDIA ``wgmma.mma_async.m64nNk*`` with 32-bit accumulators.

    128 threads (a warpgroup) hold ``n // 2`` values each. Warp ``w = thread // 32`` owns rows
    ``16w .. 16w+15``; inside, each 8-column slab repeats the ``mma.sync`` m16n8 pattern:
    register ``d[v]`` of lane ``l`` holds row ``16w + l // 4 + 8 * (v // 2 % 2)``, column
    ``8 * (v // 4) + 2 * (l % 4) + v % 2``; e.g. thread 37, d[5] is (17, 11). See PTX ISA,
    "Register Fragments, Matrix D" for wgmma .m64nNk16:
    https://docs.nvidia.com/cuda/parallel-thread-execution/#wgmma-64n16-d
    """
    n = _normalize(n, "wgmma N", minimum=8)
    if n % 8 or n > 256:
        raise KilnValueError(f"wgmma N must be a multiple of 8 in 8..256, got {n}",
                             fix="use N in (8, 16, 24, ..., 256)")
    threads = Layout((4, 8, 4), (2, n, 16 * n))
    values = Layout((2, 2, n // 8), (1, 8 * n, 8))
    return ThreadValueLayout(concat_modes(threads, values), (64, n))


def mfma_32x32_accumulator() -> ThreadValueLayout:
    """The C/D fragment of AMD ``v_mfma_f32_32x32x*`` (CDNA3/CDNA4, one block, wave64).

    64 lanes hold 16 values each: lane ``l`` owns column ``l % 32``; value ``v`` is row
    ``8 * (v // 4) + 4 * (l // 32) + v % 4``; e.g. lane 33, v5 is row 13, column 1. See the AMD
    Matrix Instruction Calculator (``-a CDNA3 -i v_mfma_f32_32x32x8_f16 -D``):
    https://github.com/ROCm/amd_matrix_instruction_calculator and the CDNA3 ISA guide, section
    "Dependent Arithmetic Instructions / MFMA".
    """
    lanes = Layout((32, 2), (1, 4 * 32))
    values = Layout((4, 4), (32, 8 * 32))
    return ThreadValueLayout(concat_modes(lanes, values), (32, 32))


def mfma_16x16_accumulator() -> ThreadValueLayout:
    """The C/D fragment of AMD ``v_mfma_f32_16x16x*`` (CDNA3/CDNA4, one block, wave64).

    64 lanes hold 4 values each: lane ``l`` owns column ``l % 16``; value ``v`` is row
    ``4 * (l // 16) + v``; e.g. lane 37, v2 is row 10, column 5. Same references as
    :func:`mfma_32x32_accumulator`.
    """
    lanes = Layout((16, 4), (1, 4 * 16))
    values = Layout(4, 16)
    return ThreadValueLayout(concat_modes(lanes, values), (16, 16))


def mma_m16n8k16_a() -> ThreadValueLayout:
    """The A fragment (16 x 16, row = m, col = k) of NVIDIA ``mma.sync.m16n8k16`` for f16/bf16.

    32 lanes hold 8 values (four ``.f16x2`` registers). With ``group = lane // 4`` and
    ``pair = lane % 4``, value ``a[v]`` holds row ``group + 8 * (v // 2 % 2)``, column
    ``2 * pair + v % 2 + 8 * (v // 4)``; e.g. lane 5, a[6] is (9, 10). See PTX ISA, "Matrix
    Fragments for mma.m16n8k16 with floating point type".
    """
    lanes = Layout((4, 8), (2, 16))
    values = Layout((2, 2, 2), (1, 8 * 16, 8))
    return ThreadValueLayout(concat_modes(lanes, values), (16, 16))


def mma_m16n8k16_b() -> ThreadValueLayout:
    """The B fragment (16 x 8, row = k, col = n) of NVIDIA ``mma.sync.m16n8k16`` for f16/bf16.

    32 lanes hold 4 values (two ``.f16x2`` registers): value ``b[v]`` of lane ``l`` holds row
    ``2 * (l % 4) + v % 2 + 8 * (v // 2)``, column ``l // 4``; e.g. lane 5, b[3] is (11, 1).
    Same reference as :func:`mma_m16n8k16_a`.
    """
    lanes = Layout((4, 8), (2 * 8, 1))
    values = Layout((2, 2), (8, 8 * 8))
    return ThreadValueLayout(concat_modes(lanes, values), (16, 8))


def transpose(tv: ThreadValueLayout) -> ThreadValueLayout:
    """The same registers read as the transposed tile: ``transpose(tv)(t, v) == tv(t, v)[::-1]``.

    Zero-cost re-tagging of a fragment (e.g. an MFMA accumulator computed as ``S^T`` read as
    ``S``). Each leaf stride must move along rows only or columns only, which holds for every
    hardware fragment layout.

    Example: ``transpose(mfma_32x32_accumulator())(33, 5) == (1, 13)``.
    """
    rows, cols = tv.tile

    def leaf(shape: int, stride: int) -> int:
        if stride % cols == 0:
            return stride // cols
        if stride * (shape - 1) < cols:
            return stride * rows
        raise KilnValueError(f"layout {tv.layout} mixes rows and columns in one mode "
                             f"({shape}:{stride}); it cannot be transposed by re-tagging",
                             fix="transpose fragments whose modes each walk rows or columns")

    shapes, strides = flatten(tv.layout.shape), flatten(tv.layout.stride)
    new_strides = _unflatten(tuple(leaf(s, d) for s, d in zip(shapes, strides)), tv.layout.shape)
    result = ThreadValueLayout(Layout(tv.layout.shape, new_strides), (cols, rows))
    row, col = tv.coords()
    if not np.array_equal(result.offsets(), col * rows + row):
        raise KilnValueError(f"layout {tv.layout} cannot be transposed by re-tagging",
                             fix="transpose fragments whose modes each walk rows or columns")
    return result
