"""Shared memory: static ``kiln.shared(shape, dtype, align=16)`` and ``kiln.dynamic_shared``.

Each call adds a ``memref.global`` in workgroup memory (address space 3) to the kernel's
``gpu.module`` and returns a :class:`SharedTensor` indexed like a tensor::

    tile = kiln.shared((64, 64), kiln.f16)
    tile[r, c] = x[row, col]
    kiln.barrier()
    v = tile.load(r, 0, width=8)

The total is checked against the target's shared-memory limit when the buffer is created, so
the ``ResourceError`` names the allocation that went over.

PTX caps static ``.shared`` at 48 KB per kernel, so deep pipelines use :func:`dynamic_shared`:
buffers carved out of the kernel's dynamic shared memory (``gpu.dynamic_shared_memory`` +
``memref.view``), whose size the launch requests (``KernelSignature.dynamic_shared_bytes``).
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import arith, gpu, memref

from . import builder
from .core import dtypes as dt
from . import pyhints
from .core.errors import KilnValueError, ResourceError, checked_call
from .nvidia.sync import as_index
from .tensor import TensorRef, numel_bytes
from .values import Value


class SharedTensor(TensorRef):
    """A shared-memory buffer: ``.ir`` (``memref<shape x T, 3>``), ``.shape`` (Python ints),
    ``.dtype``; indexing, ``load``/``store`` as for tensors."""
    def __init__(self, ir_value: ir.Value, dtype: dt.DType, shape: tuple[int, ...], name: str):
        super().__init__(ir_value, dtype, name)
        self.static_shape = shape

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.static_shape


@checked_call
def shared(shape: Any, dtype: Any, *, align: int = 16) -> SharedTensor:
    """Allocate a static shared-memory buffer of ``shape`` (Python ints) and ``dtype``.

    Example: ``acc = kiln.shared((BLOCK,), kiln.f32)``.
    """
    state = builder.current()
    shape, elem = _check_request(shape, dtype, align, "kiln.shared")
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
    mtype = ir.MemRefType.get(list(shape), elem.storage.mlir_type(), memory_space=space)
    name = state.unique_symbol("kiln_shared")
    with ir.InsertionPoint.at_block_begin(state.gpu_module_block):
        memref.GlobalOp(name, mtype, sym_visibility="private", initial_value=ir.UnitAttr.get(),
                        alignment=align)
    return SharedTensor(memref.get_global(mtype, name), elem, shape, name)


#: PTX's cap on a kernel's static ``.shared`` bytes (SharedTiles past it go dynamic)
STATIC_SHARED_BYTES = 48 * 1024

# The strictest alignment a buffer may ask for (128B-swizzled TMA/WGMMA tiles). The dynamic
# region's start is only 16-byte aligned, so the kernel rounds its base up at run time and the
# launch requests this much slack.
DYNAMIC_BASE_ALIGN = 1024


@checked_call
def dynamic_shared(shape: Any, dtype: Any, *, align: int = 16) -> SharedTensor:
    """Carve a ``shape`` x ``dtype`` buffer out of dynamic shared memory (any size up to the
    chip's opt-in limit, 227 KB on H100); the launch requests the total automatically.

    Buffers are laid out in call order at offsets rounded up to ``align`` (a power of two up to
    1024). Example: ``a_tiles = kiln.dynamic_shared((STAGES, 128, 64), kiln.bf16, align=1024)``.
    """
    state = builder.current()
    shape, elem = _check_request(shape, dtype, align, "kiln.dynamic_shared")
    if align > DYNAMIC_BASE_ALIGN:
        raise KilnValueError(f"dynamic shared buffers can be aligned to at most "
                             f"{DYNAMIC_BASE_ALIGN} bytes, got align={align}",
                             fix=f"use align={DYNAMIC_BASE_ALIGN} or less")
    used = max(state.dynamic_shared_bytes - DYNAMIC_BASE_ALIGN, 0)
    offset = -(-used // align) * align
    nbytes = numel_bytes(shape, elem)
    requested = DYNAMIC_BASE_ALIGN + offset + nbytes
    limit = state.target.max_shared_bytes
    if requested + state.shared_bytes > limit:
        raise ResourceError(
            f"kiln.dynamic_shared{shape} of {elem} needs {nbytes} bytes; the kernel would use "
            f"{requested + state.shared_bytes} bytes of shared memory (with {DYNAMIC_BASE_ALIGN} "
            f"bytes of alignment slack) but {state.target.name} allows {limit} per block",
            fix="use smaller tiles, fewer stages or a narrower dtype")
    state.dynamic_shared_bytes = requested
    raw, base = _dynamic_base(state)
    byte_shift = arith.addi(base, arith.constant(ir.IndexType.get(), offset))
    view_type = ir.MemRefType.get(list(shape), elem.storage.mlir_type(),
                                  memory_space=_workgroup_space())
    view = _tagged_view(view_type, raw, byte_shift, offset)
    return DynamicSharedTensor(view, elem, shape, f"dynamic_shared@{offset}", raw, byte_shift,
                               offset)


# Each view of dynamic shared memory names its allocation (``kiln.buffer = <byte offset>``), so
# the wait passes tell allocations apart (they share one base pointer).
BUFFER_ATTR = "kiln.buffer"


def _tagged_view(view_type, raw: ir.Value, shift: ir.Value, offset: int) -> ir.Value:
    view = memref.view(view_type, raw, shift, [])
    view.owner.attributes[BUFFER_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                            offset)
    return view


class DynamicSharedTensor(SharedTensor):
    """A :func:`dynamic_shared` buffer; :meth:`tile` views one slice of its first dimension."""
    def __init__(self, ir_value, dtype, shape, name, raw: ir.Value, byte_shift: ir.Value,
                 offset: int):
        super().__init__(ir_value, dtype, shape, name)
        self._raw, self._byte_shift, self._offset = raw, byte_shift, offset

    def tile(self, i) -> SharedTensor:
        """Slice ``i`` (int or traced) of the first dimension as a buffer of ``shape[1:]`` with
        an identity layout (what TMA and WGMMA descriptors need), e.g. one pipeline stage.

        Example: ``kiln.tma.load(a_map, a_tiles.tile(stage), (k0, m0), full, stage)``.
        """
        if len(self.shape) < 2:
            raise KilnValueError(f"tile() needs a buffer of rank >= 2, {self.name} has shape "
                                 f"{self.shape}", fix="index rank-1 buffers element-wise")
        if isinstance(i, int) and not 0 <= i < self.shape[0]:
            raise KilnValueError(f"tile index {i} is out of range for {self.shape[0]} tiles",
                                 fix=f"use 0 <= i < {self.shape[0]}")
        inner = self.shape[1:]
        slice_bytes = numel_bytes(inner, self.dtype)
        index = ir.IndexType.get()
        offset = arith.muli(as_index(i, "tile index"), arith.constant(index, slice_bytes))
        shift = arith.addi(self._byte_shift, offset)
        view_type = ir.MemRefType.get(list(inner), self.dtype.storage.mlir_type(),
                                      memory_space=_workgroup_space())
        return SharedTensor(_tagged_view(view_type, self._raw, shift, self._offset), self.dtype,
                            inner, f"{self.name}[tile]")

    def reinterpret(self, shape: Any, dtype: Any) -> "DynamicSharedTensor":
        """The same bytes as a ``shape`` x ``dtype`` buffer (no copy): e.g. a TMA ring viewed
        as one flat buffer for ``SharedTile.view``, or reused as f32 scratch after its last load.

        Example: ``flat = ring.reinterpret((ring_elems,), kiln.bf16)``.
        """
        shape, elem = _check_request(shape, dtype, 16, "reinterpret")
        have, want = numel_bytes(self.shape, self.dtype), numel_bytes(shape, elem)
        if want > have:
            raise KilnValueError(f"cannot view the {have} bytes of {self.name} as {shape} of "
                                 f"{elem} ({want} bytes)",
                                 fix="allocate the buffer with the larger of the two sizes")
        view_type = ir.MemRefType.get(list(shape), elem.storage.mlir_type(),
                                      memory_space=_workgroup_space())
        view = _tagged_view(view_type, self._raw, self._byte_shift, self._offset)
        return DynamicSharedTensor(view, elem, shape, f"{self.name} as {elem}", self._raw,
                                   self._byte_shift, self._offset)


def _check_request(shape: Any, dtype: Any, align: int, what: str):
    shape = (shape,) if isinstance(shape, (int, Value)) else tuple(shape)
    traced = next((s for s in shape if isinstance(s, Value)), None)
    if traced is not None:
        name = pyhints.local_name(traced)
        which = f"'{name}' is" if name else "an entry is"
        raise KilnValueError(f"{what} needs a shape of positive Python ints, got {shape!r}: "
                             f"{which} a traced value (shapes are fixed at compile time)",
                             fix=f"declare the parameter as `{name or 'BLOCK'}: kiln.constexpr` "
                                 "so it is a Python int while tracing (each value compiles "
                                 "its own kernel)")
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in shape):
        raise KilnValueError(f"{what} needs a shape of positive Python ints, got {shape!r}",
                             fix="use constants or kiln.constexpr values for the shape")
    builder.current_target().check_align(align, what)
    return shape, dt.dtype(dtype)


def _workgroup_space() -> ir.Attribute:
    # No typed getter exists for #gpu.address_space; the registered builder parses it.
    return ir.AttrBuilder.get("GPU_AddressSpaceAttr")(gpu.AddressSpace.Workgroup,
                                                       ir.Context.current)


def _dynamic_base(state) -> tuple[ir.Value, ir.Value]:
    """The kernel's dynamic shared region and the byte offset of its first 1024-aligned byte,
    built once in the entry block so every buffer (inside any ``if``/``for``) can use them."""
    if state.dynamic_shared_base is None:
        index = ir.IndexType.get()
        with builder.entry_point(state):
            raw_type = ir.MemRefType.get([ir.ShapedType.get_dynamic_size()],
                                         ir.IntegerType.get_signless(8),
                                         memory_space=_workgroup_space())
            raw = gpu.dynamic_shared_memory(raw_type)
            address = memref.extract_aligned_pointer_as_index(raw)
            mask = arith.constant(index, DYNAMIC_BASE_ALIGN - 1)
            # (-address) mod 1024: bytes up to the next 1024-byte boundary.
            pad = arith.andi(arith.subi(arith.constant(index, 0), address), mask)
        state.dynamic_shared_base = (raw, pad)
    return state.dynamic_shared_base
