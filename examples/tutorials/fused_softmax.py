"""Tutorial 2: fused row softmax: each row read once and written once.

``y[i] = exp(x[i] - max(x[i])) / sum(exp(x[i] - max(x[i])))`` for every row of an
``M x N`` float32 matrix. A block holds a whole row in registers (a
:func:`kiln.layout.blocked` tile of ``BLOCK >= N`` columns, 16-byte accesses), so the row
crosses DRAM once each way. Columns past ``N`` load as ``-inf`` (the GlobalTile's ``fill``),
which leaves the max unchanged and adds ``exp(-inf) = 0`` to the sum; no mask is held in
registers (40 instead of 64 registers at 8192 columns: 3 blocks an SM; on an H200, 2048 x 8192:
0.92 of copy bandwidth and 1.07x Triton, where a mask per element gave 0.83 and 0.99x).

Rows of up to 16384 columns take a block each: several blocks per SM keep DRAM busy between
them. At 16384 columns (32 per thread) that needs a register cap on NVIDIA (``maxnreg=64``:
two blocks an SM, a few bytes spill; on an H200, 1024 x 16384 at 3584 GB/s, 1.00x Triton,
where one block an SM streaming the rows gave 3437). Rows of 32768 columns (``STREAM``) leave
room for one block per SM, so each block of a persistent grid walks rows ``block, block +
grid, ...`` and streams them through a shared tile: ``kiln.copy`` global -> shared runs
asynchronously (``cp.async`` on NVIDIA, buffer -> LDS DMA on gfx950), and the next row's copy
starts as soon as every thread holds its part of this one, so DRAM reads the next row while
this one is reduced and written. Shared memory holds zeros past ``N``: ``kiln.where`` on
``kiln.tiles.mask`` (one compare per 16-byte chunk) puts the ``-inf`` back.

``kiln.reduce`` does the cross-thread work: registers, then XOR shuffles inside each warp
(32 lanes on NVIDIA, 64 on AMD: read from the target), then one shared-memory stage across
the warps. ``kiln-insert-waits`` places the copy's wait; the kernel has no shuffle, wait or
shared-memory indexing code.

Run: ``python examples/tutorials/fused_softmax.py``.
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln import f32, i32
from kiln.kernel import default_target
from kiln.runtime.cuda import cuda_available, driver


@kiln.kernel(num_threads="THREADS")
def softmax_kernel(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                   BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr,
                   STREAM: kiln.constexpr):
    tv = kiln.layout.blocked((1, BLOCK), THREADS, vec=4)
    row_s = kiln.SharedTile((1, BLOCK), f32) if STREAM else None

    def row_tile(t, row, fill=0.0):
        return kiln.GlobalTile(t, (1, BLOCK), (row, 0), col_end=n, fill=fill, align=ALIGN,
                               col_multiple=ALIGN // 4)

    if STREAM:
        kiln.copy(row_tile(x, kiln.block_id(0)), row_s)
    for row in kiln.range(kiln.block_id(0), m, grid):
        if STREAM:   # the row arrived in shared memory while the previous one was reduced
            kiln.barrier()
            t = kiln.where(kiln.tiles.mask(row_tile(x, row), tv), kiln.load(row_s, tv),
                           -float("inf"))
            kiln.barrier()   # every thread holds its part: copy the next row (cp.async / DMA)
            if row + grid < m:
                kiln.copy(row_tile(x, row + grid), row_s)
        else:   # columns past n read as -inf: the max keeps, exp adds 0
            t = kiln.load(row_tile(x, row, -float("inf")), tv)
        p = kiln.exp(t - kiln.reduce(t, "max", axis=1))
        p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1))
        kiln.copy(p, row_tile(y, row))


# rows from this many columns stream through shared memory (STREAM), blocks per SM of that
# persistent grid, and (NVIDIA) the registers a thread may take so that two blocks of
# 16384-column rows share an SM (measured: bench/tutorials_rows.py)
STREAM_FROM = 32768
BLOCKS_PER_SM = {32768: 1}
MAX_REGISTERS = {16384: 64}


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int) -> tuple[int, int, int, bool]:
    """``(BLOCK, THREADS, BLOCKS_PER_SM, STREAM)`` for rows of ``n`` columns: the row rounded
    up to a power of two (at least 512), 16 columns per thread between 128 and 512 threads (64
    at 32768 columns: within 128 registers, no spills); rows from :data:`STREAM_FROM` columns
    stream through shared memory over a persistent grid, shorter ones take a block each (on
    NVIDIA at most :data:`MAX_REGISTERS` registers a thread)."""
    block = max(512, 1 << (n - 1).bit_length())
    stream = block >= STREAM_FROM
    return block, min(512, max(128, block // 16)), BLOCKS_PER_SM.get(block, 1), stream


def softmax(x, y, *, backend: str = "gpu", target: str | None = None):
    """``y = softmax(x, axis=1)`` for 2-D float32 arrays with up to 32768 columns."""
    m, n = x.shape
    block, threads, per_sm, stream = config(n)
    sms = driver().multiprocessor_count() if backend == "gpu" else 2
    grid = max(1, min(m, sms * per_sm)) if stream else max(m, 1)
    launch = softmax_kernel.interpret[(grid,)] if backend == "interpret" \
        else softmax_kernel[(grid,)]
    extra = {"target": target} if target else {}
    if backend == "gpu" and block in MAX_REGISTERS and (target or default_target()) \
            .startswith("sm_"):
        extra["maxnreg"] = MAX_REGISTERS[block]
    launch(x, y, m, n, grid, BLOCK=block, THREADS=threads, ALIGN=alignment(n, x, y),
           STREAM=stream, **extra)
    return y


def reference(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


if __name__ == "__main__":
    x = np.random.default_rng(0).standard_normal((37, 1531), np.float32)
    y = np.full_like(x, np.nan)
    backend = "gpu" if cuda_available() else "interpret"
    softmax(x, y, backend=backend)
    err = np.abs(y - reference(x)).max()
    assert err < 1e-6, err
    print(f"softmax of {x.shape} ({backend}): max error {err:.2e}")
