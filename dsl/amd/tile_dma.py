"""``kiln.copy(GlobalTile, SharedTile)`` on gfx942/gfx950: buffer -> LDS DMA, no registers.

Every thread of the block takes ``width``-element chunks in row-major order (thread ``t``: chunks
``t, t + threads, ...``), so the 64 lanes of a wave take 64 consecutive chunks; one
``buffer_load_dword[x4] ... lds`` per step moves them, and the wave writes them contiguously in
lane order from the LDS offset of its first chunk. That needs the SharedTile to hold those 64
chunks back to back (a row-major tile does; a swizzled one does not, and keeps the vector
loads and stores). Masked chunks (rows past ``row_end``, columns past ``col_end``) read from
one row past the tensor's end: the buffer's range check returns 0 there, which is the
GlobalTile's ``fill`` (the path is taken only for ``fill=0``). A chunk is masked whole or not at
all: 16-byte chunks need ``col_multiple`` to promise it, 4-byte chunks of 4-byte elements
always are.

Buffer offsets are 32-bit: the source tensor must be under 4 GB (as for
:func:`kiln.amd_buffer.buffer`). The waits come from ``kiln-insert-waits`` (``s_waitcnt vmcnt``
before the first LDS read of the tile); a ``kiln.barrier()`` is still needed before reading
chunks that other waves copied, as with every shared-memory copy.

Example (what ``kiln.copy`` emits for a 1 x 4096 f32 row, 256 threads, on gfx950)::

    kiln.copy(kiln.GlobalTile(x, (1, 4096), (row, 0), col_end=n, align=16, col_multiple=4), s)
    # 4 x buffer_load_dwordx4 ... lds per thread; s_waitcnt vmcnt(0) before s is read
"""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import scf

from .. import ops
from ..core.targets import Target
from ..global_tile import GlobalTile
from ..shared_tile import SharedTile
from .buffer import DMA_BYTES, buffer, copy_to_lds
from .sched import AsyncToken


def dma_width(src: GlobalTile, dst: SharedTile, threads: int, target: Target) -> int | None:
    """The chunk width (elements) of a DMA copy of ``src`` into ``dst``, or None when the
    copy must go through registers: a chip without LDS DMA, a non-zero fill, a 1-D source,
    no ``align`` promise, partial warps, or a ``dst`` whose waves' chunks are not contiguous."""
    wave = target.warp_size
    if target.name not in DMA_BYTES or src.fill != 0 or src.align is None \
            or src.tensor.rank != 2 or threads % wave:
        return None
    item = src.dtype.itemsize
    for nbytes in sorted(DMA_BYTES[target.name], reverse=True):
        width = nbytes // item
        if nbytes % item or nbytes > src.align or src.shape[1] % width:
            continue
        if width > 1 and src.col_end is not None and src.col_multiple % width:
            continue  # a chunk could straddle col_end: the range check is per access
        if _lane_contiguous(dst, src.shape, width, wave):
            return width
    return None


def _lane_contiguous(dst: SharedTile, shape: tuple[int, int], width: int, wave: int) -> bool:
    """Every run of ``wave`` consecutive row-major chunks of the ``shape`` corner of ``dst``
    is ``wave * width`` consecutive elements of its buffer, in chunk order."""
    chunks = shape[0] * shape[1] // width
    first = dst.offsets()[:shape[0], :shape[1]].reshape(-1)[::width]
    if chunks % wave:
        first = np.concatenate([first, first[-1] + width * np.arange(1, wave - chunks % wave + 1)])
    runs = first.reshape(-1, wave)
    return bool(np.all(runs == runs[:, :1] + width * np.arange(wave)))


def dma_copy(src: GlobalTile, dst: SharedTile, *, threads: int, width: int,
             wave: int) -> list[AsyncToken]:
    """Issue the DMA copy of ``src`` into ``dst`` (``width`` from :func:`dma_width`); returns
    the copies' tokens (counter ``vmcnt``)."""
    rows, cols = src.shape
    per_row = cols // width
    chunks = rows * per_row
    view = buffer(src.tensor)
    past_end = src.tensor.shape[0]  # the first row past the tensor: the range check gives 0
    tid = ops.thread_id(0) % threads
    wave_first = tid - tid % wave
    tokens = []
    for step in range(-(-chunks // threads)):
        chunk = tid + step * threads
        first = wave_first + step * threads
        r, c = chunk // per_row, (chunk % per_row) * width
        row, col = src.indices(r, c)
        inside = [v for v in (src.row_valid(r),
                              None if src.col_end is None else col < src.col_end)
                  if v is not None]
        if inside:
            row = ops.where(inside[0] & inside[1] if len(inside) == 2 else inside[0], row, past_end)
        lds = dst.offset(first // per_row, (first % per_row) * width)
        if (step + 1) * threads > chunks:  # the last, partial step: lanes past the end idle
            guard = scf.IfOp((chunk < chunks).ir, [], has_else=False)
            with ir.InsertionPoint(guard.then_block):
                tokens.append(copy_to_lds(view, (row, col), dst.buffer, (lds,), width=width))
                scf.YieldOp([])
        else:
            tokens.append(copy_to_lds(view, (row, col), dst.buffer, (lds,), width=width))
    return tokens
