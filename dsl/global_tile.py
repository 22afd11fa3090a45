"""Global-memory tiles: a static-shape window of a 2-D ``kiln.Tensor`` at a traced offset.

``GlobalTile(t, (BM, BK), (row0, col0))`` views ``t[row0:row0+BM, col0:col0+BK]``. Rows at or
past ``row_end`` (default: none) are masked: loads return zeros there, stores skip them. This is
how ragged / variable-length batches are read: :meth:`GlobalTile.ragged` views tile ``index``
of the rows ``[start, start + length)`` of a packed tensor (e.g. one sequence of a varlen
attention batch), so the last tile's rows past the sequence read as 0.

Example::

    q = kiln.tiles.GlobalTile.ragged(q_packed, (64, 128), start=seq_start, length=seq_len,
                                     index=kiln.block_id(0))
    v = q.load(r, c, width=8)            # vector<8xbf16>, zeros where the row is past the end
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import scf, vector

from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .tensor import TensorRef, to_index
from .values import Value, constant


class GlobalTile:
    """A ``shape`` window of 2-D tensor ``tensor`` at ``origin``, rows ``>= row_end`` masked."""

    def __init__(self, tensor: TensorRef, shape: tuple[int, int], origin: tuple[Any, Any] = (0, 0),
                 *, row_end: Any = None):
        if not isinstance(tensor, TensorRef) or tensor.rank != 2:
            raise KilnTypeError(f"GlobalTile needs a 2-D kiln.Tensor, got {tensor!r}",
                                fix="declare the parameter as kiln.Tensor[dtype, 2]")
        shape = tuple(shape)
        if len(shape) != 2 or any(not isinstance(s, int) or s <= 0 for s in shape):
            raise KilnValueError(f"a GlobalTile shape is (rows, cols) of positive ints, got "
                                 f"{shape!r}", fix="use compile-time constants, e.g. (64, 32)")
        self.tensor, self.shape, self.origin, self.row_end = tensor, shape, tuple(origin), row_end

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

    def indices(self, row: Any, col: Any) -> tuple[Any, Any]:
        """Tensor indices of tile element ``(row, col)``."""
        return self.origin[0] + row, self.origin[1] + col

    def load(self, row: Any, col: Any, *, width: int = 1) -> Value:
        """``width`` elements from ``(row, col)`` along the row; zeros when the row is masked."""
        vtype = ir.VectorType.get([width], self.dtype.mlir_type())
        idx = [to_index(i) for i in self.indices(row, col)]
        valid = self.row_valid(row)
        if valid is None:
            return Value(vector.load(vtype, self.tensor.ir, idx), self.dtype)
        if_op = scf.IfOp(valid.ir, [vtype], has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            scf.YieldOp([vector.load(vtype, self.tensor.ir, idx)])
        with ir.InsertionPoint(if_op.else_block):
            scf.YieldOp([constant(0, self.dtype, (width,)).ir])
        return Value(if_op.results[0], self.dtype)

    def store(self, row: Any, col: Any, value: Value) -> None:
        """Store a vector along the row at ``(row, col)``; skipped when the row is masked."""
        if not isinstance(value, Value) or value.dtype is not self.dtype or not value.shape:
            raise KilnTypeError(f"GlobalTile of {self.dtype} stores vectors of {self.dtype}, got "
                                f"{value!r}", fix=f"kiln.cast to kiln.{self.dtype}")
        idx = [to_index(i) for i in self.indices(row, col)]
        valid = self.row_valid(row)
        if valid is None:
            vector.store(value.ir, self.tensor.ir, idx)
            return
        if_op = scf.IfOp(valid.ir, [], has_else=False)
        with ir.InsertionPoint(if_op.then_block):
            vector.store(value.ir, self.tensor.ir, idx)
            scf.YieldOp([])
