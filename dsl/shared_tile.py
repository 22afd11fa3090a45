"""Shared-memory tiles: a ``rows x cols`` matrix in shared memory (LDS) with a layout and swizzle.

Element ``(r, c)`` lives at element offset ``swizzle(layout((r, c)))`` of a 1-D
``kiln.shared`` buffer. ``layout`` is a :class:`~kiln.layout.Layout` over ``(row, col)``
(default: row-major), ``swizzle`` a :class:`~kiln.swizzle.Swizzle`/``ComposedSwizzle`` on
*element* offsets (``Swizzle.sw128b(2)`` for 2-byte elements) or None. :meth:`offset` is the
one address function: kernels call it on traced values, tests on numpy arrays.

Example (a 64x32 bf16 tile in the 64-byte swizzle, loaded 8 elements at a time)::

    a_s = kiln.tiles.SharedTile((64, 32), kiln.bf16, swizzle=Swizzle.sw64b(2))
    a_s.store(r, c, v8)                  # vector<8xbf16>, c a multiple of 8
    frag = a_s.load_fragments(kiln.layout.mma_m16n8k16_a(), (1, 2), (row0, 0))
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import memref, vector

from . import builder, ops
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .layout import Layout, ThreadValueLayout, concat_modes, make_layout
from .reg_tile import RegTile, _concat
from .shared import STATIC_SHARED_BYTES, dynamic_shared, shared
from .swizzle import ComposedSwizzle, Swizzle
from .tensor import numel_bytes, to_index
from .values import Value


def _injective(offsets: np.ndarray) -> bool:
    """Whether no two elements share an offset: one pass marking each (``np.unique`` sorted
    or hashed the 32k offsets of a large tile for milliseconds)."""
    flat = offsets.ravel()
    if flat.size == 0 or int(flat.min()) < 0:
        return len(np.unique(flat)) == flat.size
    seen = np.zeros(int(flat.max()) + 1, dtype=bool)
    seen[flat] = True
    return int(np.count_nonzero(seen)) == flat.size


class SharedTile:
    """A 2-D tile in shared memory: ``.buffer`` (the 1-D ``SharedTensor``), ``.shape``,
    ``.dtype``, ``.layout``, ``.swizzle``."""

    def __init__(self, shape: tuple[int, int], dtype, layout: Layout | None = None,
                 swizzle: Swizzle | ComposedSwizzle | None = None, *, align: int = 128):
        offsets = self._describe(shape, dtype, layout, swizzle)
        size = (int(offsets.max()) + 1,)
        state = builder.current()
        # PTX caps static .shared at 48 KB: larger tiles (a 32k-column f32 row) go dynamic
        big = state.target.is_nvidia and \
            state.shared_bytes + numel_bytes(size, self.dtype) + align > STATIC_SHARED_BYTES
        self.buffer = (dynamic_shared if big else shared)(size, self.dtype, align=align)

    def _describe(self, shape, dtype, layout, swizzle) -> np.ndarray:
        """Check and set shape, dtype, layout and swizzle; returns every element's offset."""
        shape = tuple(shape)
        if len(shape) != 2 or any(not isinstance(s, int) or s <= 0 for s in shape):
            raise KilnValueError(f"a SharedTile shape is (rows, cols) of positive ints, got "
                                 f"{shape!r}", fix="use compile-time constants, e.g. (64, 32)")
        self.shape, self.dtype = shape, dt.dtype(dtype)
        self.layout = make_layout(shape) if layout is None else layout
        self.swizzle = swizzle
        if not isinstance(self.layout, Layout) or self.layout.size() != shape[0] * shape[1]:
            raise KilnValueError(f"SharedTile layout {self.layout} does not cover a {shape} tile",
                                 fix="pass a Layout over (row, col) with rows*cols elements")
        if swizzle is not None and not isinstance(swizzle, (Swizzle, ComposedSwizzle)):
            raise KilnTypeError(f"swizzle must be a kiln.swizzle.Swizzle, got {swizzle!r}",
                                fix="pass e.g. Swizzle.sw128b(elem_bytes) or None")
        offsets = self.offsets()
        if not _injective(offsets):
            raise KilnValueError(f"SharedTile layout {self.layout} with swizzle {swizzle} maps "
                                 "two elements to one address",
                                 fix="use an injective layout and a swizzle whose span divides it")
        return offsets

    @classmethod
    def view(cls, buffer, shape: tuple[int, int], layout: Layout | None = None,
             swizzle: Swizzle | ComposedSwizzle | None = None) -> "SharedTile":
        """A SharedTile over an existing 1-D shared buffer (no allocation), e.g. a TMA ring in
        dynamic shared memory seen through ``DynamicSharedTensor.reinterpret``. The swizzle acts
        on offsets from the buffer's start, so the buffer must be aligned to its span.

        Example: ``k_s = SharedTile.view(ring.reinterpret((n,), kiln.bf16), (64, 64),
        swizzle=Swizzle.sw128b(2))``.
        """
        tile = cls.__new__(cls)
        tile._describe(shape, buffer.dtype, layout, swizzle)
        if len(buffer.shape) != 1 or tile.offsets().max() >= buffer.shape[0]:
            raise KilnValueError(f"a {shape} SharedTile (layout {tile.layout}) does not fit the "
                                 f"1-D view of {buffer.shape} elements",
                                 fix="view a flat buffer holding every offset of the layout")
        tile.buffer = buffer
        return tile

    @property
    def T(self) -> "SharedTile":  # noqa: N802 - the matrix transpose, as in numpy
        """The same memory read as the transposed matrix (no copy): element ``(c, r)`` of the
        view is element ``(r, c)`` of this tile. ``kiln.gemm(q_s, k_s.T, acc)`` multiplies by
        ``K^T`` where ``k_s`` holds ``K`` row-major (``ldmatrix`` without ``.trans`` on NVIDIA).
        """
        view = SharedTile.view(self.buffer, self.shape[::-1],
                               concat_modes(self.layout[1], self.layout[0]), self.swizzle)
        # WGMMA reads the transpose of an A-laid tile as a K-major B (kiln.tile_gemm_wgmma)
        view.wgmma_operand = "b_kmajor" if getattr(self, "wgmma_operand", None) == "a" else None
        return view

    def offset(self, row: Any, col: Any) -> Any:
        """Element offset of ``(row, col)``: ``swizzle(layout((row, col)))`` for ints, numpy
        arrays or traced values."""
        off = self.layout((row, col))
        return off if self.swizzle is None else self.swizzle(off)

    def offsets(self) -> np.ndarray:
        """``[rows, cols]`` array of every element's offset (for tests and width checks)."""
        r = np.arange(self.shape[0], dtype=np.int64)[:, None]
        c = np.arange(self.shape[1], dtype=np.int64)[None, :]
        return np.broadcast_to(np.asarray(self.offset(r, c)), self.shape).astype(np.int64)

    def contiguous_width(self, width: int) -> bool:
        """True when every ``width``-aligned run of a row is ``width`` consecutive, aligned
        elements in memory (so one vector access moves it)."""
        if self.shape[1] % width:
            return False
        runs = self.offsets().reshape(self.shape[0], -1, width)
        return bool(np.all(runs == runs[..., :1] + np.arange(width))
                    and np.all(runs[..., 0] % width == 0))

    def _check_width(self, width: int) -> None:
        if not self.contiguous_width(width):
            raise KilnValueError(f"{width}-wide accesses are not contiguous in this SharedTile "
                                 f"(layout {self.layout}, swizzle {self.swizzle})",
                                 fix="use a narrower width, or a swizzle that keeps "
                                     f"{width}-element chunks together")

    def _index(self, row: Any, col: Any) -> ir.Value:
        return to_index(self.offset(row, col))

    def load(self, row: Any, col: Any, *, width: int = 1) -> Value:
        """``width`` elements of ``row`` from ``col`` (``col % width == 0``) as a vector
        (``vector.load``); a scalar (``memref.load``) for ``width=1``."""
        if width == 1:
            return Value(memref.load(self.buffer.ir, [self._index(row, col)]), self.dtype)
        self._check_width(width)
        return self._vector_load(row, col, width)

    def _vector_load(self, row: Any, col: Any, width: int) -> Value:
        vtype = ir.VectorType.get([width], self.dtype.mlir_type())
        return Value(vector.load(vtype, self.buffer.ir, [self._index(row, col)]), self.dtype)

    def store(self, row: Any, col: Any, value: Value) -> None:
        """Store a vector (or scalar) at ``(row, col..)``: ``vector.store``."""
        if not isinstance(value, Value) or value.dtype is not self.dtype:
            raise KilnTypeError(f"SharedTile of {self.dtype} cannot store {value!r}",
                                fix=f"kiln.cast the value to kiln.{self.dtype}")
        if not value.shape:
            memref.store(value.ir, self.buffer.ir, [self._index(row, col)])
            return
        self._check_width(value.shape[0])
        # the run is width-aligned in the buffer; without the alignment NVPTX splits the store
        vector.store(value.ir, self.buffer.ir, [self._index(row, col)],
                     alignment=value.shape[0] * self.dtype.itemsize)

    def fragment_width(self, tv: ThreadValueLayout) -> int:
        """The widest vector (power of two) each lane can load its fragment values with when the
        fragment sits at any multiple of its own size in this tile."""
        rows, cols = tv.coords()
        fr, fc = tv.tile
        width = tv.num_values
        while width > 1:
            if width & (width - 1) == 0 and self._runs_contiguous(rows, cols, fr, fc, width):
                return width
            width //= 2
        return 1

    def _runs_contiguous(self, rows, cols, fr, fc, width) -> bool:
        offsets = self.offsets()
        for r0 in range(0, self.shape[0] - fr + 1, fr):
            for c0 in range(0, self.shape[1] - fc + 1, fc):
                runs = offsets[r0 + rows, c0 + cols].reshape(rows.shape[0], -1, width)
                if not (np.all(runs == runs[..., :1] + np.arange(width))
                        and np.all(runs[..., 0] % width == 0)):
                    return False
        return True

    def load_fragments(self, tv: ThreadValueLayout, grid: tuple[int, int],
                       origin: tuple[Any, Any] = (0, 0), *, lane: Any = None) -> RegTile:
        """Load a ``grid`` of ``tv`` fragments whose top-left is ``origin`` (a multiple of the
        fragment size) into a RegTile, with the vector width :meth:`fragment_width` allows.

        ``lane`` defaults to ``kiln.lane_id() % tv.num_threads``. Example:
        ``a = a_s.load_fragments(mma_m16n8k16_a(), (2, 2), (tm.warp_origin()[0], 0))``.
        """
        if lane is None:
            lane = ops.lane_id() % tv.num_threads
        width = self.fragment_width(tv)
        fr, fc = tv.tile
        frags = []
        for i in range(grid[0]):
            for j in range(grid[1]):
                pieces = []
                for v in range(0, tv.num_values, width):
                    r, c = tv(lane, v)
                    pieces.append(self._vector_load(origin[0] + i * fr + r,
                                                    origin[1] + j * fc + c, width).ir)
                frags.append(Value(_concat(pieces), self.dtype))
        return RegTile(frags, tv, grid)
