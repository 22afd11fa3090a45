"""Global-memory tiles: a static-shape window of a 2-D ``kiln.Tensor`` at a traced offset.

``GlobalTile(t, (BM, BK), (row0, col0))`` views ``t[row0:row0+BM, col0:col0+BK]``. Rows at or
past ``row_end`` and columns at or past ``col_end`` (default: none) are masked: loads return
``fill`` (default 0) there and read nothing, stores skip them. Both dimensions may be ragged at
once (the last tile of a GEMM with ragged M and N). A load or store whose chunk is wholly inside
is one ``vector.load``/``vector.store``; one that straddles ``col_end`` is a
``vector.maskedload``/``maskedstore`` (the branch between them is uniform for most chunks).
Ragged / variable-length batches are read with :meth:`GlobalTile.ragged` views tile ``index``
of the rows ``[start, start + length)`` of a packed tensor (e.g. one sequence of a varlen
attention batch), so the last tile's rows past the sequence read as 0.

Example::

    q = kiln.tiles.GlobalTile.ragged(q_packed, (64, 128), start=seq_start, length=seq_len,
                                     index=kiln.block_id(0))
    v = q.load(r, c, width=8)            # vector<8xbf16>, zeros where the row is past the end

    x = kiln.tiles.GlobalTile(x_t, (1, 1024), (row, 0), col_end=n, fill=-float("inf"))
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import arith, scf, vector

from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .tensor import TensorRef, to_index
from .values import Value, broadcast, constant, to_value


class GlobalTile:
    """A ``shape`` window of 2-D tensor ``tensor`` at ``origin``; tensor rows ``>= row_end``
    and columns ``>= col_end`` are masked (loads give ``fill``, stores skip them). A 1-D
    tensor is one row: ``GlobalTile(x, (1, BLOCK), (0, start), col_end=n)``; a taller tile of
    it reads that row in every row (a bias broadcast down a GEMM tile). ``col_multiple=8``
    promises that ``col_end`` is a multiple of 8: an aligned chunk of up to 8 elements is then
    wholly inside or wholly masked, and ``cp.async`` copies it with a 0-or-16-byte source
    size (a predicated copy, no partial zero fill)."""

    def __init__(self, tensor: TensorRef, shape: tuple[int, int], origin: tuple[Any, Any] = (0, 0),
                 *, row_end: Any = None, col_end: Any = None, fill: float = 0,
                 align: int | None = None, col_multiple: int = 1):
        if not isinstance(tensor, TensorRef) or tensor.rank not in (1, 2):
            raise KilnTypeError(f"GlobalTile needs a 1-D or 2-D kiln.Tensor, got {tensor!r}",
                                fix="declare the parameter as kiln.Tensor[dtype, 2]")
        shape = tuple(shape)
        if len(shape) != 2 or any(not isinstance(s, int) or s <= 0 for s in shape):
            raise KilnValueError(f"a GlobalTile shape is (rows, cols) of positive ints, got "
                                 f"{shape!r}", fix="use compile-time constants, e.g. (64, 32)")
        if isinstance(fill, bool) or not isinstance(fill, (int, float)):
            raise KilnTypeError(f"GlobalTile fill must be a Python number, got {fill!r}",
                                fix='pass e.g. fill=0.0 or fill=-float("inf")')
        self.tensor, self.shape, self.origin, self.row_end = tensor, shape, tuple(origin), row_end
        if align is not None and (isinstance(align, bool) or not isinstance(align, int)
                                  or align <= 0 or align & (align - 1)):
            raise KilnValueError(f"GlobalTile align must be a power-of-two byte count, got "
                                 f"{align!r}", fix="e.g. align=16 when rows start 16-byte aligned")
        if isinstance(col_multiple, bool) or not isinstance(col_multiple, int) \
                or col_multiple <= 0:
            raise KilnValueError(f"GlobalTile col_multiple must be a positive int, got "
                                 f"{col_multiple!r}", fix="e.g. col_multiple=8 when col_end "
                                                          "is a multiple of 8")
        self.col_end, self.fill, self.align = col_end, fill, align
        self.col_multiple = col_multiple

    @classmethod
    def ragged(cls, tensor: TensorRef, shape: tuple[int, int], *, start: Any, length: Any,
               index: Any, col: Any = 0) -> "GlobalTile":
        """Tile ``index`` (of ``shape[0]`` rows each) of rows ``[start, start + length)``;
        rows past ``start + length`` are masked."""
        return cls(tensor, shape, (start + index * shape[0], col), row_end=start + length)

    @property
    def dtype(self) -> dt.DType:
        return self.tensor.dtype

    def row_valid(self, row: Any) -> Value | None:
        """i1: tile row ``row`` is inside the view (None when nothing is masked)."""
        if self.row_end is None:
            return None
        return (self.origin[0] + row) < self.row_end

    def col_mask(self, row: Any, col: Any, width: int) -> tuple[Value, Value] | None:
        """``(mask, whole)`` for the ``width`` elements from tile ``(row, col)``: the i1 vector
        of elements inside the view and the i1 scalar "all of them are" (None when columns are
        unmasked)."""
        if self.col_end is None:
            return None
        first = to_value(self.origin[1] + col, dt.i32)
        vtype = ir.VectorType.get([width], dt.i32.mlir_type())
        lanes = Value(arith.constant(vtype, ir.DenseElementsAttr.get(
            np.arange(width, dtype=np.int32), type=vtype)), dt.i32)
        mask = (broadcast(first, (width,)) + lanes) < self.col_end
        whole = (first + width) <= self.col_end
        valid = self.row_valid(row)
        if valid is not None:
            mask = mask & broadcast(valid, (width,))
            whole = whole & valid
        return mask, whole

    def whole_chunks(self, width: int) -> bool:
        """An access of ``width`` elements at a column multiple of ``width`` is wholly inside
        ``col_end`` or wholly past it: ``col_multiple`` is a multiple of ``width`` and ``align``
        keeps the tile's columns ``width``-aligned (a straddling chunk needs no lane mask)."""
        return self.col_multiple % width == 0 and self.align is not None \
            and self.align >= width * self.dtype.itemsize

    def _alignment(self, width: int) -> ir.IntegerAttr | None:
        """The byte alignment ``align`` promises for a ``width``-element access (None: the
        element's own, which LLVM splits a vector access into scalars for)."""
        if self.align is None:
            return None
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                  min(self.align, width * self.dtype.itemsize))

    def indices(self, row: Any, col: Any) -> tuple[Any, Any]:
        """Tensor indices of tile element ``(row, col)`` (the column alone for a 1-D tensor)."""
        if self.tensor.rank == 1:
            return (self.origin[1] + col,)
        return self.origin[0] + row, self.origin[1] + col

    def load(self, row: Any, col: Any, *, width: int = 1) -> Value:
        """``width`` elements from ``(row, col)`` along the row; ``fill`` where masked."""
        vtype = ir.VectorType.get([width], self.dtype.mlir_type())
        idx = [to_index(i) for i in self.indices(row, col)]
        masks = self.col_mask(row, col, width)
        align = self._alignment(width)
        if masks is not None:
            part = (lambda m: self._fill(width).ir) if self.whole_chunks(width) else \
                (lambda m: vector.maskedload(vtype, self.tensor.ir, idx, m.ir,
                                             self._fill(width).ir, alignment=align))
            return self._masked(masks, lambda: vector.load(vtype, self.tensor.ir, idx,
                                                           alignment=align), part, vtype)
        valid = self.row_valid(row)
        if valid is None:
            return Value(vector.load(vtype, self.tensor.ir, idx, alignment=align), self.dtype)
        if_op = scf.IfOp(valid.ir, [vtype], has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            scf.YieldOp([vector.load(vtype, self.tensor.ir, idx, alignment=align)])
        with ir.InsertionPoint(if_op.else_block):
            scf.YieldOp([self._fill(width).ir])
        return Value(if_op.results[0], self.dtype)

    def _fill(self, width: int) -> Value:
        return constant(self.fill, self.dtype, (width,))

    def _masked(self, masks: tuple[Value, Value], whole, part, vtype=None) -> Value | None:
        """``whole()`` when every element is inside, else ``part(mask)``: one ``scf.if``."""
        mask, inside = masks
        if_op = scf.IfOp(inside.ir, [] if vtype is None else [vtype], has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            result = whole()
            scf.YieldOp([] if vtype is None else [result])
        with ir.InsertionPoint(if_op.else_block):
            result = part(mask)
            scf.YieldOp([] if vtype is None else [result])
        return None if vtype is None else Value(if_op.results[0], self.dtype)

    def store(self, row: Any, col: Any, value: Value) -> None:
        """Store a vector along the row at ``(row, col)``; masked elements are skipped."""
        if not isinstance(value, Value) or value.dtype is not self.dtype or not value.shape:
            raise KilnTypeError(f"GlobalTile of {self.dtype} stores vectors of {self.dtype}, got "
                                f"{value!r}", fix=f"kiln.cast to kiln.{self.dtype}")
        if self.tensor.rank == 1 and self.shape[0] > 1:
            raise KilnValueError(f"a {self.shape} GlobalTile of a 1-D tensor repeats one row; "
                                 "storing to it would write each element once per row",
                                 fix="store through a (1, cols) GlobalTile of the 1-D tensor")
        idx = [to_index(i) for i in self.indices(row, col)]
        masks = self.col_mask(row, col, value.shape[0])
        align = self._alignment(value.shape[0])
        if masks is not None:
            part = (lambda m: None) if self.whole_chunks(value.shape[0]) else \
                (lambda m: vector.maskedstore(self.tensor.ir, idx, m.ir, value.ir,
                                              alignment=align))
            self._masked(masks, lambda: vector.store(value.ir, self.tensor.ir, idx,
                                                     alignment=align), part)
            return
        valid = self.row_valid(row)
        if valid is None:
            vector.store(value.ir, self.tensor.ir, idx, alignment=align)
            return
        if_op = scf.IfOp(valid.ir, [], has_else=False)
        with ir.InsertionPoint(if_op.then_block):
            vector.store(value.ir, self.tensor.ir, idx, alignment=align)
            scf.YieldOp([])
