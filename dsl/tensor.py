"""Tensors in kernels: the ``kiln.Tensor[dtype]`` annotation and the traced :class:`TensorRef`.

A ``kiln.Tensor[f32]`` (or ``kiln.Tensor[f32, 2]`` to fix the rank) parameter becomes a
``memref<?x..xf32, strided<[?, .., 1], offset: ?>, 1>`` argument (innermost stride 1 when the
array passed is contiguous along it, else dynamic). In the body::

    v = x[i]                      # memref.load (indices are i32/i64/index Values or ints)
    y[i, j] = v                   # memref.store; the value must have y's dtype (or be a literal)
    n = x.shape[0]                # memref.dim, as an i32 Value
    s = x.stride(0)               # from memref.extract_strided_metadata, as an i32 Value
    v4 = x.load(i, width=4)       # vector.load of 4 consecutive elements along the last dim
                                  # (at most the target's max_vector_bytes, 1 KB)
    x.store(i, v4)                # vector.store
    v = x.load(i, mask=i < n, other=0.0)   # masked scalar load (scf.if)
    old = c.atomic_add(i, 1)      # memref.atomic_rmw: returns the value before the add

Shared-memory buffers from ``kiln.shared`` index the same way. Tensors of ``kiln.i1`` (numpy
``bool`` arrays) are stored as bytes: loads give ``x != 0``, stores write 0 or 1.
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import arith, memref, scf, vector

from . import builder
from .core import dtypes as dt
from .builder import GLOBAL_MEMORY_SPACE
from .core.dtypes import DType
from .core.errors import KilnTypeError, KilnValueError, UnsupportedError, checked_call
from .values import Value, cast, constant, is_literal, to_value


class TensorSpec:
    """The annotation object ``kiln.Tensor[dtype]`` / ``kiln.Tensor[dtype, rank]``."""

    __slots__ = ("dtype", "rank")

    def __init__(self, dtype: DType, rank: int | None):
        self.dtype = dtype
        self.rank = rank

    def __repr__(self):
        return f"kiln.Tensor[{self.dtype}{', ' + str(self.rank) if self.rank else ''}]"


class Tensor:
    """Annotation for a global-memory tensor parameter: ``x: kiln.Tensor[kiln.f32]``.

    ``kiln.Tensor[f32, 2]`` also checks the rank. Any numpy array, torch/cupy CUDA tensor is
    accepted at launch.
    """

    def __class_getitem__(cls, params) -> TensorSpec:
        if not isinstance(params, tuple):
            params = (params,)
        if len(params) not in (1, 2) or (len(params) == 2 and not isinstance(params[1], int)):
            raise KilnTypeError(f"kiln.Tensor{list(params)} is not a valid annotation",
                                fix="write kiln.Tensor[dtype] or kiln.Tensor[dtype, rank]")
        return TensorSpec(dt.dtype(params[0]), params[1] if len(params) == 2 else None)


def memref_type(dtype: DType, rank: int, contiguous: bool) -> ir.MemRefType:
    """The kernel ABI type of a tensor parameter (see ``kiln.signature``)."""
    dyn = ir.ShapedType.get_dynamic_stride_or_offset()
    strides = [dyn] * (rank - 1) + [1 if contiguous else dyn]
    layout = ir.StridedLayoutAttr.get(dyn, strides)
    space = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), GLOBAL_MEMORY_SPACE)
    return ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * rank,
                             dtype.storage.mlir_type(), layout=layout, memory_space=space)


def to_index(i: Any) -> ir.Value:
    if isinstance(i, Value):
        if not i.dtype.is_int or i.dtype.kind == "bool" or i.shape:
            raise KilnTypeError(f"a tensor index must be a scalar integer, got {i!r}",
                                fix="kiln.cast the index to kiln.i32")
        return cast(i, dt.index).ir
    if isinstance(i, int) and not isinstance(i, bool):
        return constant(i, dt.index).ir
    raise KilnTypeError(f"a tensor index must be an integer, got {type(i).__name__} {i!r}",
                        fix="index with ints or integer Values (slices are not supported)")


class TensorRef:
    """A traced tensor (a memref value): global ``Tensor`` parameters and shared buffers.

    ``.ir`` is the memref, ``.dtype`` the element DType, ``.rank`` the number of dimensions.
    """

    def __init__(self, ir_value: ir.Value, dtype: DType, name: str = "tensor"):
        self.ir = ir_value
        self.dtype = dtype
        self.rank = ir.MemRefType(ir_value.type).rank
        self.name = name

    def __repr__(self):
        return f"kiln.TensorRef({self.name}: {self.ir.type})"

    def _indices(self, idx) -> list[ir.Value]:
        if not isinstance(idx, tuple):
            idx = (idx,)
        if len(idx) != self.rank:
            raise KilnValueError(f"{self.name} has rank {self.rank} but was indexed with "
                                 f"{len(idx)} indices",
                                 fix=f"pass exactly {self.rank} indices, e.g. "
                                     f"{self.name}[{', '.join(f'i{k}' for k in range(self.rank))}]")
        return [to_index(i) for i in idx]

    def __getitem__(self, idx) -> Value:
        return Value(self._from_storage(memref.load(self.ir, self._indices(idx))), self.dtype)

    def _from_storage(self, loaded: ir.Value) -> ir.Value:
        """A loaded scalar or vector as ``self.dtype`` (i1 elements are bytes in memory)."""
        if self.dtype.kind != "bool":
            return loaded
        zero = arith.constant(loaded.type, _zero_attr(loaded.type))
        return arith.cmpi(arith.CmpIPredicate.ne, loaded, zero)

    def _to_storage(self, value: ir.Value) -> ir.Value:
        """A scalar or vector of ``self.dtype`` as stored (i1 becomes a 0/1 byte)."""
        if self.dtype.kind != "bool":
            return value
        byte = ir.IntegerType.get_signless(8)
        if isinstance(value.type, ir.VectorType):
            byte = ir.VectorType.get(ir.VectorType(value.type).shape, byte)
        return arith.extui(byte, value)

    def element_address(self, *idx) -> ir.Value:
        """The i64 address of element ``idx`` (base + (offset + sum of index * stride) *
        element bytes), for inline PTX that takes a pointer, e.g.
        :func:`kiln.nvidia_asm.wait_for_count`."""
        index = ir.IndexType.get()
        meta = memref.ExtractStridedMetadataOp(self.ir)
        linear = meta.offset
        for i, stride in zip(self._indices(idx), meta.strides):
            linear = arith.addi(linear, arith.muli(i, stride))
        address = arith.addi(memref.extract_aligned_pointer_as_index(self.ir),
                             arith.muli(linear, arith.constant(index, self.dtype.itemsize)))
        return arith.index_cast(ir.IntegerType.get_signless(64), address)

    def __setitem__(self, idx, value) -> None:
        memref.store(self._to_storage(self._coerce(value, ()).ir), self.ir, self._indices(idx))

    def _coerce(self, value: Any, shape: tuple[int, ...]) -> Value:
        if is_literal(value):
            return constant(value, self.dtype)
        v = to_value(value)
        if v.dtype is not self.dtype:
            raise KilnTypeError(f"cannot store a {v.dtype} value into {self.name} "
                                f"(a tensor of {self.dtype})",
                                fix=f"convert first, e.g. kiln.cast(value, kiln.{self.dtype})")
        if v.shape != shape:
            what = f"vector of {v.shape[0]}" if v.shape else "scalar"
            raise KilnTypeError(f"expected a {'vector of ' + str(shape[0]) if shape else 'scalar'}"
                                f" value for {self.name}, got a {what}",
                                fix="use t[i] = scalar or t.store(i, vector)")
        return v

    @property
    def shape(self) -> tuple[Value, ...]:
        """Sizes as i32 Values (``memref.dim``)."""
        return tuple(cast(Value(memref.dim(self.ir, constant(d, dt.index).ir), dt.index), dt.i32)
                     for d in range(self.rank))

    def stride(self, d: int) -> Value:
        """Stride of dimension ``d`` in elements, as an i32 Value."""
        if not 0 <= d < self.rank:
            raise KilnValueError(f"{self.name} has no dimension {d} (rank {self.rank})",
                                 fix=f"use 0 <= d < {self.rank}")
        meta = memref.extract_strided_metadata(self.ir)
        return cast(Value(list(meta)[2 + self.rank + d], dt.index), dt.i32)

    def _require_unit_inner_stride(self, what: str) -> None:
        layout = ir.MemRefType(self.ir.type).layout
        if isinstance(layout, ir.StridedLayoutAttr) and layout.strides[-1] != 1:
            raise KilnValueError(f"a {what} on {self.name} needs consecutive elements, but the "
                                 "kernel was specialised for a tensor whose last stride is not 1",
                                 fix="pass a contiguous tensor (x.contiguous() / "
                                     "np.ascontiguousarray(x)), or use scalar loads")

    @checked_call
    def load(self, *idx, width: int = 1, mask: Any = None, other: Any = 0,
             align: int | None = None) -> Value:
        """Load one element, or ``width`` consecutive elements along the last dim as a vector;
        with ``mask`` (scalar loads only) returns ``other`` where the mask is false.
        ``align`` (bytes) promises the vector's address is that aligned, so it becomes one
        wide load (e.g. ``ld.global.v4.f32``) instead of ``width`` scalar loads."""
        target = builder.current_target()
        target.check_vector(width, self.dtype.itemsize, f"{self.name}.load")
        alignment = _alignment(align, f"{self.name}.load")
        if width != 1:
            if mask is not None:
                raise UnsupportedError("masked vector loads are not supported",
                                       fix="load scalars with mask=, or guard the load with if")
            self._require_unit_inner_stride("vector load")
            vtype = ir.VectorType.get([width], self.dtype.storage.mlir_type())
            loaded = vector.load(vtype, self.ir, self._indices(idx), alignment=alignment)
            return Value(self._from_storage(loaded), self.dtype)
        if mask is None:
            return self[idx]
        m = to_value(mask)
        if m.dtype is not dt.i1:
            raise KilnTypeError(f"mask must be an i1 comparison result, got {m.dtype}",
                                fix="pass a comparison such as mask=i < n")
        fallback = other if isinstance(other, Value) else None
        if fallback is not None and fallback.dtype is not self.dtype:
            raise KilnTypeError(f"other= has dtype {fallback.dtype}, {self.name} holds "
                                f"{self.dtype}",
                                fix=f"kiln.cast(other, kiln.{self.dtype})")
        indices = self._indices(idx)
        if_op = scf.IfOp(m.ir, [self.dtype.mlir_type()], has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            scf.YieldOp([self._from_storage(memref.load(self.ir, indices))])
        with ir.InsertionPoint(if_op.else_block):
            scf.YieldOp([(fallback if fallback is not None else constant(other, self.dtype)).ir])
        return Value(if_op.results[0], self.dtype)

    @checked_call
    def store(self, *args, align: int | None = None) -> None:
        """``t.store(i, ..., value)``: store a scalar or a vector along the last dimension
        (``align`` as for :meth:`load`)."""
        if not args:
            raise KilnValueError(f"{self.name}.store takes the indices and then the value",
                                 fix=f"e.g. {self.name}.store(i, value)")
        *idx, value = args
        v = to_value(value) if not is_literal(value) else constant(value, self.dtype)
        alignment = _alignment(align, f"{self.name}.store")
        if not v.shape:
            self[tuple(idx)] = v
            return
        self._require_unit_inner_stride("vector store")
        v = self._coerce(v, v.shape)
        vector.store(self._to_storage(v.ir), self.ir, self._indices(tuple(idx)),
                     alignment=alignment)

    @checked_call
    def atomic_add(self, *args) -> Value:
        """``t.atomic_add(i, ..., value)``: add ``value`` to one element atomically (across the
        whole GPU) and return the element's previous value. Integer or float elements.

        The update is atomic but orders no other memory operation: to publish a CTA's stores
        with it (a split-K or "last CTA finishes" counter), put ``kiln.barrier()`` and
        ``kiln.fence("gpu")`` before it, and let the CTA that reads them fence after it.
        Example::

            if kiln.thread_id(0) == 0:
                kiln.fence("gpu")                       # this CTA's stores, then the ticket
                ticket = counters.atomic_add(tile, 1)   # 0, 1, ... in arrival order
        """
        return self._atomic("add", args)

    @checked_call
    def atomic_max(self, *args) -> Value:
        """Like :meth:`atomic_add` with ``max`` (signed for integers, NaN-propagating for
        floats); returns the previous value. Example: ``best.atomic_max(0, score)``."""
        return self._atomic("max", args)

    @checked_call
    def atomic_min(self, *args) -> Value:
        """Like :meth:`atomic_add` with ``min``; returns the previous value.
        Example: ``first.atomic_min(0, index)``."""
        return self._atomic("min", args)

    @checked_call
    def atomic_exchange(self, *args) -> Value:
        """Store ``value`` atomically and return the previous value.
        Example: ``old = lock.atomic_exchange(0, 1)``."""
        return self._atomic("exchange", args)

    def _atomic(self, op: str, args: tuple) -> Value:
        if not args:
            raise KilnValueError(f"atomic_{op} takes the indices and then the value",
                                 fix=f"e.g. {self.name}.atomic_{op}(i, value)")
        *idx, value = args
        if self.dtype.kind not in ("float", "int") or self.dtype.itemsize not in (4, 8):
            raise KilnTypeError(f"atomic_{op} needs 32- or 64-bit int or float elements, but "
                                f"{self.name} holds {self.dtype}",
                                fix="keep counters and atomically updated values in i32/f32")
        v = self._coerce(value, ())
        float_kind, int_kind = _ATOMIC_KINDS[op]
        kind = float_kind if self.dtype.is_float else int_kind
        return Value(memref.atomic_rmw(kind, v.ir, self.ir, self._indices(tuple(idx))),
                     self.dtype)


# Atomic read-modify-write kind by operation: (float elements, integer elements).
_ATOMIC_KINDS = {
    "add": (arith.AtomicRMWKind.addf, arith.AtomicRMWKind.addi),
    "max": (arith.AtomicRMWKind.maximumf, arith.AtomicRMWKind.maxs),
    "min": (arith.AtomicRMWKind.minimumf, arith.AtomicRMWKind.mins),
    "exchange": (arith.AtomicRMWKind.assign, arith.AtomicRMWKind.assign),
}


def _alignment(align: int | None, what: str):
    if align is None:
        return None
    builder.current_target().check_align(align, what)
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), align)


def _zero_attr(t: ir.Type) -> ir.Attribute:
    if isinstance(t, ir.VectorType):
        return ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(t.element_type, 0))
    return ir.IntegerAttr.get(t, 0)


def numel_bytes(shape: tuple[int, ...], dtype: DType) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize

