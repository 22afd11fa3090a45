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
:func:`right_inverse`) follows CuTe's definitions and lives in :mod:`kiln.layout_algebra`
(re-exported here); docs/layouts.md has worked examples.

:class:`ThreadValueLayout` describes how a 2-D tile is split over threads: which thread holds
which element in which of its registers. :func:`partition_tile` builds one for plain tiled
copies; the named constructors give the accumulator fragments of NVIDIA ``mma.sync`` and
``wgmma`` and AMD MFMA instructions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import builder
from .core.errors import KilnValueError
from .layout_algebra import (  # noqa: F401 (re-exported: kiln.layout is the public home)
    IntTuple, Layout, Tiler, blocked_product, coalesce, complement, composition, concat_modes,
    flatten, left_inverse, logical_divide, logical_product, make_layout, product, raked_product,
    right_inverse, zipped_divide)
from .layout_algebra import _is_tuple, _normalize, _unflatten


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
        # Sizes read per register by the tiles (thousands of times a trace): computed once.
        object.__setattr__(self, "_sizes", (self.layout[0].size(), self.layout[1].size()))
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
        return self._sizes[0]

    @property
    def num_values(self) -> int:
        """Values (registers) per thread."""
        return self._sizes[1]

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


@functools.lru_cache(maxsize=None)  # immutable; every atom and tile asks again
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
    return _wgmma_m64_accumulator(n)


@functools.lru_cache(maxsize=None)  # immutable, and built for every WGMMA of a trace
def _wgmma_m64_accumulator(n: int) -> ThreadValueLayout:
    threads = Layout((4, 8, 4), (2, n, 16 * n))
    values = Layout((2, 2, n // 8), (1, 8 * n, 8))
    return ThreadValueLayout(concat_modes(threads, values), (64, n))


@functools.lru_cache(maxsize=None)  # immutable; every atom and tile asks again
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


@functools.lru_cache(maxsize=None)  # immutable; every atom and tile asks again
def mfma_16x16_accumulator() -> ThreadValueLayout:
    """The C/D fragment of AMD ``v_mfma_f32_16x16x*`` (CDNA3/CDNA4, one block, wave64).

    64 lanes hold 4 values each: lane ``l`` owns column ``l % 16``; value ``v`` is row
    ``4 * (l // 16) + v``; e.g. lane 37, v2 is row 10, column 5. Same references as
    :func:`mfma_32x32_accumulator`.
    """
    lanes = Layout((16, 4), (1, 4 * 16))
    values = Layout(4, 16)
    return ThreadValueLayout(concat_modes(lanes, values), (16, 16))


@functools.lru_cache(maxsize=None)  # immutable; every atom and tile asks again
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


@functools.lru_cache(maxsize=None)  # immutable; every atom and tile asks again
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


def blocked(tile: tuple[int, int], threads: int | None = None, vec: int = 4
            ) -> ThreadValueLayout:
    """A block-wide register layout for elementwise work and reductions (Triton's "blocked"
    layout): each thread owns runs of ``vec`` consecutive columns; threads sweep the columns
    first, then the rows, and the pattern repeats over the tile (more values per thread).
    Consecutive threads touch consecutive ``vec``-wide chunks of a row, so global loads of a
    row-major tensor coalesce, and :func:`kiln.reduce` along a row stays inside as few warps
    as the row allows.

    ``threads=None`` (inside a kernel) spreads the tile over the block's threads, whatever the
    launch or the vendor makes them: ``kiln.layout.blocked((1, BLOCK))``.

    Example: a 4 x 2048 tile over 256 threads, 4-wide::

        >>> tv = blocked((4, 2048), 256, vec=4)
        >>> tv.num_values, tv(1, 0), tv(1, 4)       # thread 1: columns 4..7, then 1028..
        (32, (0, 4), (0, 1028))
    """
    if threads is None:
        threads = builder.current().block[0]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
               for x in (*tile, threads, vec)) or len(tile) != 2:
        raise KilnValueError(f"blocked(tile={tile!r}, threads={threads!r}, vec={vec!r}) needs "
                             "positive ints", fix="e.g. blocked((4, 1024), 256, vec=4)")
    rows, cols = tile
    if cols % vec:
        raise KilnValueError(f"vec={vec} does not divide the tile's {cols} columns",
                             fix="use a power-of-two tile width and vec")
    t_cols = min(threads, cols // vec)
    if threads % t_cols or rows % (threads // t_cols):
        raise KilnValueError(f"{threads} threads cannot spread evenly over a {rows}x{cols} tile "
                             f"in {vec}-wide runs ({t_cols} per row, {threads // t_cols} rows "
                             "at once)", fix="use power-of-two tile sizes with rows * cols / vec "
                                             ">= threads, or fewer threads")
    return partition_tile((rows, cols), (threads // t_cols, t_cols), (1, vec))
