"""Layout algebra: functions from (nested) coordinates to memory offsets, CuTe style.

:class:`Layout` and the operations on it (:func:`coalesce`, :func:`composition`,
:func:`complement`, the divides and products, :func:`right_inverse`); ``kiln.layout`` is the
public home of these names and its docstring walks through the semantics.
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
