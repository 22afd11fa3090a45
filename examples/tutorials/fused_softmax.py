"""Tutorial 2: fused row softmax: each row read once and written once.

``y[i] = exp(x[i] - max(x[i])) / sum(exp(x[i] - max(x[i])))`` for every row of an
``M x N`` float32 matrix. A block holds a row in registers (a :func:`kiln.layout.blocked`
tile of ``BLOCK >= N`` columns, 16-byte accesses), so the row crosses DRAM once each way.
Columns past ``N`` load as ``-inf`` (the GlobalTile's ``fill``), which leaves the max unchanged
and adds ``exp(-inf) = 0`` to the sum.

Rows of up to 8192 columns take a block each: several blocks an SM keep DRAM busy between
them. On sm_90+ a longer row is split over a thread-block cluster of ``SPLIT`` blocks, each
holding 8192 of its columns (``kiln.cluster_rank``), and the two reductions go on across the
cluster (``kiln.reduce(..., cluster=True)``: distributed shared memory and a cluster barrier),
so a 32k-column row is four 8k-column blocks on four SMs. Where clusters are missing (sm_80,
AMD) long rows (``STREAM``) leave room for one block an SM, so each block of a persistent grid
walks rows ``block, block + grid, ...`` and streams them through a shared tile: ``kiln.copy``
global -> shared runs asynchronously (``cp.async`` on NVIDIA, buffer -> LDS DMA on gfx950),
and the next row's copy starts as soon as every thread holds its part of this one; shared
memory holds zeros past ``N``, so ``kiln.where`` on ``kiln.tiles.mask`` puts the ``-inf`` back.

``kiln.reduce`` does the cross-thread work: registers, then XOR shuffles inside each warp
(32 lanes on NVIDIA, 64 on AMD: read from the target), then one shared-memory stage across
the warps (and the cluster exchange). ``kiln-insert-waits`` places the copy's wait; the kernel
has no shuffle, wait or shared-memory indexing code.

Run: ``python examples/tutorials/fused_softmax.py``.
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln import f32, i32
from kiln.core.targets import get_target
from kiln.kernel import default_target
from kiln.runtime.cuda import cuda_available, driver


@kiln.kernel(num_threads="THREADS")
def softmax_kernel(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                   BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr,
                   STREAM: kiln.constexpr, SPLIT: kiln.constexpr):
    part = BLOCK // SPLIT   # the columns of each row this block holds
    first = kiln.cluster_rank(SPLIT) * part
    tv = kiln.layout.blocked((1, part), THREADS, vec=4)
    row_s = kiln.SharedTile((1, part), f32) if STREAM else None

    def row_tile(t, row, fill=0.0):
        return kiln.GlobalTile(t, (1, part), (row, first), col_end=n, fill=fill, align=ALIGN,
                               col_multiple=ALIGN // 4)

    if STREAM:
        kiln.copy(row_tile(x, kiln.block_id(0) // SPLIT), row_s)
    for row in kiln.range(kiln.block_id(0) // SPLIT, m, grid // SPLIT):
        if STREAM:   # the row arrived in shared memory while the previous one was reduced
            kiln.barrier()
            t = kiln.where(kiln.tiles.mask(row_tile(x, row), tv), kiln.load(row_s, tv),
                           -float("inf"))
            kiln.barrier()   # every thread holds its part: copy the next row (cp.async / DMA)
            if row + grid // SPLIT < m:
                kiln.copy(row_tile(x, row + grid // SPLIT), row_s)
        else:   # columns past n read as -inf: the max keeps, exp adds 0
            t = kiln.load(row_tile(x, row, -float("inf")), tv)
        p = kiln.exp(t - kiln.reduce(t, "max", axis=1, cluster=True))
        p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1, cluster=True))
        kiln.copy(p, row_tile(y, row))


# rows from this many columns stream through shared memory (STREAM) over a persistent grid of
# BLOCKS_PER_SM blocks an SM, where they cannot be split over a cluster (before sm_90, AMD)
STREAM_FROM = 16384
BLOCKS_PER_SM = 1
# on sm_90+ a row of more columns than this is split over a cluster of blocks (SPLIT), each
# holding PART_COLUMNS of it in registers (measured: bench/tutorials_rows.py)
PART_COLUMNS = 8192


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int, target: str | None = None) -> dict:
    """The kernel's block sizes for rows of ``n`` columns on ``target`` (None: Kiln's default):
    the row rounded up to a power of two (``BLOCK``, at least 512) over ``SPLIT`` blocks of a
    cluster, 16 columns per thread between 128 and 512 threads (64 at 32768 columns on one
    block: within 128 registers, no spills); ``STREAM`` rows over a persistent grid where they
    are long and cannot be split, else a row (a cluster) a block."""
    block = max(512, 1 << (n - 1).bit_length())
    split = max(block // PART_COLUMNS, 1) if get_target(target or default_target()).has("sm90") \
        else 1
    return dict(BLOCK=block, THREADS=min(512, max(128, block // split // 16)),
                STREAM=split == 1 and block >= STREAM_FROM, SPLIT=split)


def softmax(x, y, *, backend: str = "gpu", target: str | None = None):
    """``y = softmax(x, axis=1)`` for 2-D float32 arrays with up to 32768 columns."""
    m, n = x.shape
    cfg = config(n, target)
    sms = driver().multiprocessor_count() if backend == "gpu" else 2
    grid = max(1, min(m, sms * BLOCKS_PER_SM)) if cfg["STREAM"] else max(m, 1) * cfg["SPLIT"]
    launch = softmax_kernel.interpret[(grid,)] if backend == "interpret" \
        else softmax_kernel[(grid,)]
    extra = {"target": target} if target else {}
    launch(x, y, m, n, grid, ALIGN=alignment(n, x, y), **cfg, **extra)
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
