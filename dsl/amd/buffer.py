"""AMD data movement: bounds-checked buffer views and global -> LDS DMA (gfx942, gfx950).

A **buffer view** (:func:`buffer`) re-addresses a global tensor through a buffer resource
(``amdgpu.fat_raw_buffer_cast``). Loads and stores on it are ordinary tensor indexing, but
become ``buffer_load_*``/``buffer_store_*`` whose hardware range check makes an out-of-range
load return 0 and drops an out-of-range store, so tile edges need no masks::

    a_buf = kiln.amd_buffer.buffer(a)                 # a: kiln.Tensor[bf16, 2]
    v = a_buf.load(row, col, width=8)                 # zeros past the end of a

**DMA** (:func:`copy_to_lds`) copies global memory straight into LDS without passing through
registers (``global_load_lds_dword*`` from a tensor, ``buffer_load_dword* ... lds`` from a buffer
view). It is asynchronous: it returns an :class:`~kiln.amd_asm.AsyncToken` on ``vmcnt``, and the
LDS data may be read only after an ``s_waitcnt vmcnt`` that covers it::

    token = kiln.amd_buffer.copy_to_lds(a_buf, (row, col), tile, (0, 0), width=8)
    kiln.amd_asm.s_waitcnt(vmcnt=0, waits_for=[token])
    kiln.amd_asm.s_barrier()

Per-lane semantics (for the interpreter): a buffer-view load reads element ``idx`` of the source
when its byte offset ``(offset + sum(idx * strides)) * itemsize`` (plus the access size) lies
below the buffer's ``valid_bytes`` (default: the tensor's extent), else yields 0; a store past it
does nothing. ``amdgpu.gather_to_lds src[i], dst[j] : T`` over a wave: lane ``l`` reads one ``T``
(4 or 16 bytes) at its own ``src[i]`` and the wave writes them contiguously in lane order starting
at ``dst[j]`` as given by the first active lane (``j`` must be wave-uniform).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import amdgpu

from ..core import dtypes as dt
from ..core.ops import VMCNT, Effects, declare, shared_operands
from ..nvidia.sync import current_target
from .sched import AsyncToken, mark_async
from ..core.errors import KilnTypeError, KilnValueError, UnsupportedError
from ..shared import SharedTensor
from ..tensor import TensorRef, to_index
from ..values import cast, to_value

#: Bytes one lane may move per DMA instruction: dword on every GFX9 chip, dwordx4 on gfx950
#: (1- and 2-byte transfers are padded to 4 in LDS and 12-byte ones to 16, so Kiln leaves
#: them out: with 4 and 16, lane ``l``'s data always lands at ``dst + l * bytes``).
DMA_BYTES = {"gfx942": (4,), "gfx950": (4, 16)}


class BufferTensor(TensorRef):
    """A global tensor seen through a raw buffer resource: indexing, ``load`` and ``store`` as for
    tensors, with out-of-range loads returning 0 (see the module docstring)."""

    def __init__(self, ir_value: ir.Value, dtype: dt.DType, name: str):
        super().__init__(ir_value, dtype, name)


# LDS DMA (global -> LDS without registers): vmcnt events that write their LDS operand.
GATHER_TO_LDS = declare("amd.lds_dma.gather_to_lds", feature="gfx9",
                        mlir_names=("amdgpu.gather_to_lds",),
                        effects=Effects(counter=VMCNT, writes=shared_operands))
LOAD_TO_LDS = declare("amd.lds_dma.load_to_lds", feature="gfx9",
                      mlir_names=("rocdl.global.load.lds", "rocdl.load.to.lds",
                                  "rocdl.raw.ptr.buffer.load.lds"),
                      effects=Effects(counter=VMCNT, writes=shared_operands))
BUFFER_VIEW = declare("amd.buffer.view", feature="gfx9", mlir_names=("amdgpu.fat_raw_buffer_cast",))
# Buffer loads into registers: vmcnt events their consumers read.
BUFFER_LOAD = declare("amd.buffer.load", feature="gfx9",
                      mlir_names=("rocdl.raw.ptr.buffer.load", "amdgpu.raw_buffer_load"),
                      effects=Effects(counter=VMCNT))

def buffer(tensor: TensorRef, *, valid_bytes=None) -> BufferTensor:
    """A bounds-checked buffer view of global tensor ``tensor`` (``amdgpu.fat_raw_buffer_cast``).

    ``valid_bytes`` (an int or integer Value) limits the readable range, counted from the tensor's
    first element; by default it is the tensor's extent. Example: ``b = buffer(x)``.
    """
    BUFFER_VIEW.require(current_target(), "kiln.amd_buffer.buffer")
    if not isinstance(tensor, TensorRef) or isinstance(tensor, (SharedTensor, BufferTensor)):
        raise KilnTypeError(f"kiln.amd_buffer.buffer needs a global kiln.Tensor parameter, got "
                            f"{tensor!r}", fix="pass a kernel argument annotated kiln.Tensor[...]")
    limit = None
    if valid_bytes is not None:
        limit_value = to_value(valid_bytes, dt.i64)
        if not limit_value.dtype.is_int or limit_value.dtype.kind == "bool" \
                or limit_value.shape:
            raise KilnTypeError(f"valid_bytes must be a scalar integer, got {limit_value!r}",
                                fix="pass an int or an i32/i64 value such as n * 2")
        limit = cast(limit_value, dt.i64).ir
    # reset_offset folds the tensor's offset into the base so indices start at its first element.
    view = amdgpu.fat_raw_buffer_cast(tensor.ir, valid_bytes=limit, reset_offset=True)
    return BufferTensor(view, tensor.dtype, f"buffer({tensor.name})")


def copy_to_lds(src: TensorRef, src_index, dst: SharedTensor, dst_index, *,
                width: int = 1) -> AsyncToken:
    """Asynchronously copy ``width`` elements per lane from ``src[src_index]`` (this lane's own
    global position) into LDS: the wave's pieces land contiguously, in lane order, from
    ``dst[dst_index]`` (wave-uniform). ``width * itemsize`` must be 4 bytes, or 16 on gfx950.

    Returns the copy's :class:`~kiln.amd_asm.AsyncToken` (counter ``vmcnt``). Example::

        t = copy_to_lds(a_buf, (row0 + lane // 8, (lane % 8) * 8), tile, (0, 0), width=8)
    """
    target = GATHER_TO_LDS.require(current_target(), "kiln.amd_buffer.copy_to_lds")
    if not isinstance(src, TensorRef) or isinstance(src, SharedTensor):
        raise KilnTypeError(f"copy_to_lds reads global memory, got {src!r}",
                            fix="pass a kiln.Tensor parameter or a kiln.amd_buffer.buffer view")
    if not isinstance(dst, SharedTensor):
        raise KilnTypeError(f"copy_to_lds writes LDS, got {dst!r}",
                            fix="pass a kiln.shared(...) buffer as dst")
    if src.dtype is not dst.dtype:
        raise KilnTypeError(f"copy_to_lds copies {src.dtype} into a {dst.dtype} buffer",
                            fix="use an LDS buffer of the source's dtype")
    nbytes = width * src.dtype.itemsize if isinstance(width, int) else None
    allowed = DMA_BYTES[target.name]
    if isinstance(width, bool) or nbytes not in allowed:
        sizes = " or ".join(f"{b // src.dtype.itemsize}" for b in allowed
                            if b % src.dtype.itemsize == 0)
        raise UnsupportedError(
            f"copy_to_lds of width={width!r} {src.dtype} ({nbytes} bytes per lane) is not a "
            f"{target.name} DMA size", fix=f"use width={sizes} ({' or '.join(map(str, allowed))} "
                                           f"bytes per lane on {target.name})")
    elem = src.dtype.mlir_type()
    transfer = elem if width == 1 else ir.VectorType.get([width], elem)
    op = amdgpu.GatherToLDSOp(src.ir, _indices(src, src_index), dst.ir, _indices(dst, dst_index),
                              transfer)
    return mark_async(op, "vmcnt")


def _indices(tensor: TensorRef, index) -> list[ir.Value]:
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != tensor.rank:
        raise KilnValueError(f"{tensor.name} has rank {tensor.rank} but got {len(index)} indices",
                             fix=f"pass a tuple of {tensor.rank} indices")
    return [to_index(i) for i in index]

