"""TMA (Tensor Memory Accelerator, sm_90+): bulk tensor copies between global and shared memory.

Thin wrappers over upstream ``nvgpu.tma.*``. The descriptor (a ``CUtensorMap``) is built on the
host from a kernel argument annotated ``kiln.TensorMap[dtype, box, swizzle]``; in the kernel it
is a handle whose ``.ir`` has type ``!nvgpu.tensormap.descriptor<...>``. Loads complete on an
mbarrier, which must expect the loaded bytes (:func:`box_bytes`).

Example::

    bars.arrive_expect_tx(0, kiln.tma.box_bytes(a_map), predicate=leader)
    kiln.tma.load(a_map, a_smem, (k0, m0), bars, 0, predicate=leader)   # coords innermost first

Coordinates are in elements, innermost dimension first (TMA's order, the reverse of the
tensor's index order).
"""

from __future__ import annotations

import math

from mlir import ir
from mlir.dialects import arith, builtin, llvm, nvgpu, nvvm

from ..core.dtypes import dtype as as_dtype
from ..core.errors import KilnTypeError, KilnValueError
from ..core.ops import MBARRIER, Effects, constant_int, declare
from .sync import EVICTION_POLICIES, as_index, as_predicate, current_target, ir_value

SHARED_MEMORY_SPACE = 3
# nvgpu.tma.async.load has no cache-hint operand, and convert-nvgpu-to-nvvm keeps an op's
# location but not its other attributes: a hinted load's location is named this prefix plus
# the policy, and the kiln-tma-l2-hints pass turns the name into the nvvm op's operand.
L2_HINT_LOCATION = "kiln.l2."
SWIZZLE_KINDS = {0: nvgpu.TensorMapSwizzleKind.SWIZZLE_NONE,
                 32: nvgpu.TensorMapSwizzleKind.SWIZZLE_32B,
                 64: nvgpu.TensorMapSwizzleKind.SWIZZLE_64B,
                 128: nvgpu.TensorMapSwizzleKind.SWIZZLE_128B}
MAX_BOX_DIM = 256  # cuTensorMapEncodeTiled limit per box dimension


def _load_barrier(op) -> tuple:
    view = op.opview
    return (view.barriers, constant_int(view.mbarId))


# A load writes its shared tile behind the program's back and completes a transaction on its
# mbarrier; only a wait on that mbarrier retires it. Stores (bulk async groups) are not tracked.
LOAD = declare("nvidia.tma.load", feature="tma", mlir_names=("nvgpu.tma.async.load",),
               effects=Effects(counter=MBARRIER, writes=lambda op: (op.operands[0],),
                               mbarrier=_load_barrier,
                               ring=lambda op: ("fill", op.opview.barriers, op.opview.mbarId,
                                                None)))
STORE = declare("nvidia.tma.store", feature="tma", mlir_names=("nvgpu.tma.async.store",))
PREFETCH = declare("nvidia.tma.prefetch", feature="tma",
                   mlir_names=("nvvm.cp.async.bulk.tensor.prefetch",))
PREFETCH_DESCRIPTOR = declare("nvidia.tma.prefetch_descriptor", feature="tma",
                              mlir_names=("nvgpu.tma.prefetch.descriptor",))
COMMIT_GROUP = declare("nvidia.tma.commit_group", feature="tma",
                       mlir_names=("nvvm.cp.async.bulk.commit.group",))
WAIT_GROUP = declare("nvidia.tma.wait_group", feature="tma",
                     mlir_names=("nvvm.cp.async.bulk.wait_group",))


def descriptor_type(dtype, box, swizzle: int = 0, *, oob_fill_nan: bool = False) -> ir.Type:
    """``!nvgpu.tensormap.descriptor`` for a ``box`` of ``dtype`` with ``swizzle`` bytes.

    Validates what ``cuTensorMapEncodeTiled`` would reject later: 1-5 box dims of 1..256 and,
    with swizzle, an innermost box row of at most ``swizzle`` bytes.
    Example: ``descriptor_type(kiln.bf16, (64, 64), 128)``.
    """
    dt = as_dtype(dtype)
    box = tuple(box)
    if not 1 <= len(box) <= 5 or not all(isinstance(d, int) and 1 <= d <= MAX_BOX_DIM
                                         for d in box):
        raise KilnValueError(f"TMA box {box} must have 1-5 dimensions of 1..{MAX_BOX_DIM}",
                             fix="tile the copy into boxes of at most 256 per dimension")
    if swizzle not in SWIZZLE_KINDS:
        raise KilnValueError(f"TMA swizzle must be one of 0, 32, 64, 128 bytes, got {swizzle!r}",
                             fix="use 128 for WGMMA operands whose rows are 128 bytes")
    if swizzle and box[-1] * dt.itemsize > swizzle:
        raise KilnValueError(f"TMA box row of {box[-1]} x {dt} = {box[-1] * dt.itemsize} bytes "
                             f"exceeds the {swizzle}-byte swizzle span",
                             fix=f"use an innermost box dim of {swizzle // dt.itemsize} or less")
    space = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), SHARED_MEMORY_SPACE)
    tile = ir.MemRefType.get(list(box), dt.mlir_type(), memory_space=space)
    oob = nvgpu.TensorMapOOBKind.OOB_NAN if oob_fill_nan else nvgpu.TensorMapOOBKind.OOB_ZERO
    return nvgpu.TensorMapDescriptorType.get(
        tile, SWIZZLE_KINDS[swizzle], nvgpu.TensorMapL2PromoKind.L2PROMO_NONE, oob,
        nvgpu.TensorMapInterleaveKind.INTERLEAVE_NONE)


class TensorMapDescriptor:
    """A TMA descriptor in a kernel: ``.ir`` (``!nvgpu.tensormap.descriptor``) plus the
    ``dtype``, ``box`` and ``swizzle`` it was declared with, so helpers can check and size it."""

    def __init__(self, value: ir.Value, dtype, box: tuple[int, ...], swizzle: int):
        self.ir, self.dtype, self.box, self.swizzle = value, as_dtype(dtype), tuple(box), swizzle

    def __kiln_flatten__(self):
        return [self.ir], (self.dtype, self.box, self.swizzle)

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0], *aux)


def descriptor_from_pointer(pointer, dtype, box, swizzle: int = 0, *,
                            oob_fill_nan: bool = False) -> TensorMapDescriptor:
    """View a ``!llvm.ptr`` kernel argument (device copy of a ``CUtensorMap``) as a descriptor.

    ``convert-gpu-to-nvvm`` cannot convert a ``gpu.func`` whose signature holds
    ``!nvgpu.tensormap.descriptor``, so the kernel takes a plain pointer and this cast, which
    ``convert-nvgpu-to-nvvm`` + ``reconcile-unrealized-casts`` fold away, gives the typed view.
    """
    value = ir_value(pointer, "tensor map pointer")
    if not isinstance(value.type, llvm.PointerType):
        raise KilnTypeError(f"tensor map argument must be an !llvm.ptr, got {value.type}",
                            fix="declare the kernel argument as kiln.TensorMap[...]")
    target_type = descriptor_type(dtype, box, swizzle, oob_fill_nan=oob_fill_nan)
    cast = ir.Operation.create("builtin.unrealized_conversion_cast", results=[target_type],
                               operands=[value])
    return TensorMapDescriptor(cast.result, dtype, box, swizzle)


def box_bytes(tensor_map) -> int:
    """Bytes one TMA copy of ``tensor_map``'s box moves: the mbarrier transaction count.

    Accepts a :class:`TensorMapDescriptor`, a :class:`~kiln.signature.TensorMapParam`,
    any object with ``box`` and ``dtype`` (or a ``param`` holding one), or the static
    shared-memory tile being filled.
    Example: ``box_bytes(TensorMapParam("a", "bf16", 2, (64, 64), 128)) == 8192``.
    """
    spec = getattr(tensor_map, "param", tensor_map)
    if hasattr(spec, "box") and hasattr(spec, "dtype"):
        return math.prod(spec.box) * as_dtype(spec.dtype).itemsize
    value = getattr(tensor_map, "ir", tensor_map)
    if isinstance(value, ir.Value) and isinstance(value.type, ir.MemRefType) \
            and value.type.has_static_shape:
        element_bits = _element_bits(value.type.element_type)
        return math.prod(value.type.shape) * element_bits // 8
    raise KilnTypeError(f"cannot tell the TMA box size of {type(tensor_map).__name__}",
                        fix="pass the kiln.TensorMap argument or the shared tile it fills")


def load(tensor_map, dst, coords, barriers, index=0, *, multicast_mask=None,
         predicate=None, eviction_policy: str | None = None) -> None:
    """Start an async copy of the box at ``coords`` into shared tile ``dst``
    (``nvgpu.tma.async.load``); completion is signalled on ``barriers[index]``.

    ``coords``: 1-5 element coordinates, innermost first (ints or traced integers).
    ``multicast_mask``: 16-bit CTA mask to broadcast the box to several CTAs of a cluster.
    ``predicate``: issue from the threads where it is true (typically one elected thread).
    ``eviction_policy``: L2 priority of the lines the copy reads, as Triton's ``tl.load``
    takes it: ``"evict_first"`` for data read once (a KV cache streamed by decode, so it does
    not push out the page table and the other small data every CTA reads), ``"evict_last"``
    for data many CTAs re-read, ``"evict_normal"``; None leaves the copy without a hint.

    Example: ``kiln.tma.load(k_map, k_tile, (0, row), bars, 0, predicate=leader,
    eviction_policy="evict_first")``.
    """
    LOAD.require(current_target(), "kiln.tma.load")
    if eviction_policy is not None and eviction_policy not in EVICTION_POLICIES:
        raise KilnValueError(f"TMA eviction_policy {eviction_policy!r} is not one of "
                             f"{', '.join(EVICTION_POLICIES)}",
                             fix='pass eviction_policy="evict_first" (read once), '
                                 '"evict_last" (re-read) or leave it None')
    desc = ir_value(tensor_map, "tensor map")
    dst_value = _shared_tile(dst, "TMA load destination")
    coord_values = _coords(coords, dst_value.type.rank)
    mask = None
    if multicast_mask is not None:
        if isinstance(multicast_mask, int) and not 0 < multicast_mask < 2**16:
            raise KilnValueError(f"TMA multicast mask {multicast_mask:#x} must fit 16 bits and "
                                 "name at least one CTA", fix="set one bit per CTA of the cluster")
        i16 = ir.IntegerType.get_signless(16)
        mask = arith.constant(i16, multicast_mask) if isinstance(multicast_mask, int) \
            else arith.trunci(i16, ir_value(multicast_mask, "multicast mask"))
    location = ir.Location.current if eviction_policy is None else \
        ir.Location.name(L2_HINT_LOCATION + eviction_policy, childLoc=ir.Location.current)
    with location:
        nvgpu.tma_async_load(dst_value, ir_value(barriers, "mbarrier group"), desc,
                             coord_values, as_index(index, "mbarrier index"),
                             multicast_mask=mask, predicate=as_predicate(predicate))


def store(src, tensor_map, coords, *, predicate=None) -> None:
    """Start an async copy of shared tile ``src`` to the box at ``coords``
    (``nvgpu.tma.async.store``). Call :func:`kiln.nvidia_asm.fence_proxy_async` after the
    threads' shared-memory writes, then :func:`commit_group` / :func:`wait_group`."""
    STORE.require(current_target(), "kiln.tma.store")
    src_value = _shared_tile(src, "TMA store source")
    nvgpu.tma_async_store(src_value, ir_value(tensor_map, "tensor map"),
                          _coords(coords, src_value.type.rank), predicate=as_predicate(predicate))


def prefetch(tensor_map, coords) -> None:
    """Prefetch the box at ``coords`` (innermost first) into L2
    (``cp.async.bulk.prefetch.tensor``): no shared memory, no barrier, no completion to wait
    for; a later :func:`load` of the box reads it from L2. A prefetch changes no value a
    thread can see, so a kernel may issue one before
    :func:`kiln.nvidia_asm.grid_dependency_wait`, while the kernel before it still runs.

    Example: ``kiln.tma.prefetch(k_map, (0, row))``.
    """
    PREFETCH.require(current_target(), "kiln.tma.prefetch")
    desc = ir_value(tensor_map, "tensor map")
    if not hasattr(tensor_map, "box"):
        raise KilnTypeError(f"kiln.tma.prefetch takes a tensor map descriptor, got "
                            f"{type(tensor_map).__name__}",
                            fix="pass the kernel's kiln.TensorMap argument")
    i32 = ir.IntegerType.get_signless(32)
    coord_values = [arith.index_cast(i32, c) for c in _coords(coords, len(tensor_map.box))]
    # NVVM's prefetch takes the descriptor as the pointer that convert-nvgpu-to-nvvm makes of
    # it; the cast is reconciled away once the descriptor type is converted.
    pointer = builtin.unrealized_conversion_cast([llvm.PointerType.get()], [desc])
    nvvm.cp_async_bulk_tensor_prefetch(pointer, coord_values, [])


def prefetch_descriptor(tensor_map, *, predicate=None) -> None:
    """Prefetch the ``CUtensorMap`` into the descriptor cache (``prefetch.tensormap``)."""
    PREFETCH_DESCRIPTOR.require(current_target(), "kiln.tma.prefetch_descriptor")
    nvgpu.tma_prefetch_descriptor(ir_value(tensor_map, "tensor map"),
                                  predicate=as_predicate(predicate))


def commit_group() -> None:
    """Close the current group of TMA stores (``cp.async.bulk.commit_group``)."""
    COMMIT_GROUP.require(current_target(), "kiln.tma.commit_group")
    nvvm.cp_async_bulk_commit_group()


def wait_group(pending: int = 0, *, read: bool = False) -> None:
    """Wait until at most ``pending`` TMA store groups are in flight. ``read=True`` only waits
    until their shared-memory sources may be overwritten."""
    WAIT_GROUP.require(current_target(), "kiln.tma.wait_group")
    if not isinstance(pending, int) or pending < 0:
        raise KilnValueError(f"pending must be an int >= 0, got {pending!r}",
                             fix="use 0 to wait for every committed store")
    nvvm.cp_async_bulk_wait_group(pending, read=True if read else None)


def _shared_tile(tile, what: str) -> ir.Value:
    value = ir_value(tile, what)
    memref_type = value.type
    if not isinstance(memref_type, ir.MemRefType) or not _is_shared(memref_type):
        raise KilnTypeError(f"{what} must be a shared-memory tile, got {memref_type}",
                            fix="allocate it with kiln.shared(box, dtype, align=1024)")
    return value


def _is_shared(memref_type: ir.MemRefType) -> bool:
    space = memref_type.memory_space
    if space is None:
        return False
    if isinstance(space, ir.IntegerAttr):
        return space.value == SHARED_MEMORY_SPACE
    return "workgroup" in str(space)


def _coords(coords, rank: int) -> list[ir.Value]:
    coords = list(coords) if isinstance(coords, (tuple, list)) else [coords]
    if len(coords) != rank or not 1 <= rank <= 5:
        raise KilnValueError(f"TMA needs {rank} coordinates (one per box dimension, innermost "
                             f"first), got {len(coords)}",
                             fix="pass one coordinate per dimension of the shared tile")
    return [as_index(c, "TMA coordinate") for c in coords]


def _element_bits(element_type: ir.Type) -> int:
    if isinstance(element_type, (ir.IntegerType, ir.FloatType)):
        return element_type.width
    raise KilnTypeError(f"unsupported TMA element type {element_type}",
                        fix="use an integer or floating-point tile")
