"""Static shared memory: ``kiln.shared(shape, dtype, align=16)``.

Each call adds a ``memref.global`` in workgroup memory (address space 3) to the kernel's
``gpu.module`` and returns a :class:`SharedTensor` indexed like a tensor::

    tile = kiln.shared((64, 64), kiln.f16)
    tile[r, c] = x[row, col]
    kiln.barrier()
    v = tile.load(r, 0, width=8)

The total is checked against the target's shared-memory limit when the buffer is created, so
the ``ResourceError`` names the allocation that went over.
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import memref

from . import builder
from . import dtypes as dt
from .errors import KilnValueError, ResourceError
from .tensor import TensorRef, numel_bytes


class SharedTensor(TensorRef):
    """A shared-memory buffer: ``.ir`` (``memref<shape x T, 3>``), ``.shape`` (Python ints),
    ``.dtype``; indexing, ``load``/``store`` as for tensors."""

    def __init__(self, ir_value: ir.Value, dtype: dt.DType, shape: tuple[int, ...], name: str):
        super().__init__(ir_value, dtype, name)
        self.static_shape = shape

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.static_shape


def shared(shape: Any, dtype: Any, *, align: int = 16) -> SharedTensor:
    """Allocate a static shared-memory buffer of ``shape`` (Python ints) and ``dtype``.

    Example: ``acc = kiln.shared((BLOCK,), kiln.f32)``.
    """
    state = builder.current()
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in shape):
        raise KilnValueError(f"kiln.shared needs a shape of positive Python ints, got {shape!r}",
                             fix="use constants or kiln.constexpr values for the shape")
    if align <= 0 or align & (align - 1):
        raise KilnValueError(f"align={align} is not a power of two",
                             fix="use align=16 (1024 for 128-byte swizzled TMA tiles)")
    elem = dt.dtype(dtype)
    nbytes = numel_bytes(shape, elem)
    padded_start = -(-state.shared_bytes // align) * align
    total = padded_start + nbytes
    limit = state.target.max_shared_bytes
    if total > limit:
        raise ResourceError(
            f"kiln.shared{shape} of {elem} needs {nbytes} bytes; with earlier buffers the kernel "
            f"uses {total} bytes but {state.target.name} allows {limit} per block",
            fix="use smaller tiles, fewer stages or a narrower dtype")
    state.shared_bytes = total
    space = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), builder.SHARED_MEMORY_SPACE)
    mtype = ir.MemRefType.get(list(shape), elem.mlir_type(), memory_space=space)
    name = state.unique_symbol("kiln_shared")
    with ir.InsertionPoint.at_block_begin(state.gpu_module_block):
        memref.GlobalOp(name, mtype, sym_visibility="private", initial_value=ir.UnitAttr.get(),
                        alignment=align)
    return SharedTensor(memref.get_global(mtype, name), elem, shape, name)
