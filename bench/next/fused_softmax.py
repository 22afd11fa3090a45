"""Tutorial 2: fused row softmax: each row read once and written once.

``y[i] = exp(x[i] - max(x[i])) / sum(exp(x[i] - max(x[i])))`` for every row of an
``M x N`` float32 matrix. A block holds a whole row in registers (a
:func:`kiln.layout.blocked` tile of ``BLOCK >= N`` columns, 16-byte accesses), so the row
crosses DRAM once each way. Columns past ``N`` load as ``-inf`` (the GlobalTile's ``fill``),
which leaves the max unchanged and adds ``exp(-inf) = 0`` to the sum; no mask is held in
registers.

Each block of a persistent grid (a few blocks per SM) walks rows ``block, block + grid, ...``
as a software pipeline: row ``i + 1``'s loads go into a second set of registers before row
``i``'s reductions, so DRAM reads the next row while this one is reduced and written (a load
stalls only where its registers are first used, the next iteration). Rows past ``M`` are
masked by the tile's ``row_end``. MEASURED

Rows too long for two copies in a block's registers (32768 columns): on sm_90a a thread-block
cluster of ``SPLIT`` blocks shares each row, ``BLOCK // SPLIT`` columns each, and
``kiln.reduce(..., cluster=True)`` combines the blocks' partials through distributed shared
memory; elsewhere (``STREAM``) the next row streams into a shared tile instead: ``kiln.copy``
global -> shared runs asynchronously (``cp.async`` on NVIDIA, buffer -> LDS DMA on gfx950) and
starts once every thread holds its part of this row. Shared memory holds zeros past ``N``:
``kiln.where`` on ``kiln.tiles.mask`` (one compare per 16-byte chunk) puts the ``-inf`` back.

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
                   STREAM: kiln.constexpr, SPLIT: kiln.constexpr = 1):
    part = BLOCK // SPLIT   # SPLIT blocks (a cluster) share a row, `part` columns each
    first = kiln.cluster_rank(SPLIT) * part
    tv = kiln.layout.blocked((1, part), THREADS, vec=4)
    row_s = kiln.SharedTile((1, part), f32) if STREAM else None
    start, step = kiln.block_id(0) // SPLIT, grid // SPLIT

    def row_tile(t, row, fill=0.0, row_end=None):
        return kiln.GlobalTile(t, (1, part), (row, first), row_end=row_end, col_end=n,
                               fill=fill, align=ALIGN, col_multiple=ALIGN // 4)

    if STREAM:
        kiln.copy(row_tile(x, start), row_s)
    else:   # columns past n (and rows past m) read as -inf: the max keeps, exp adds 0
        t = kiln.load(row_tile(x, start, -float("inf"), m), tv)
    for row in kiln.range(start, m, step):
        if STREAM:   # the row arrived in shared memory while the previous one was reduced
            kiln.barrier()
            t = kiln.where(kiln.tiles.mask(row_tile(x, row), tv), kiln.load(row_s, tv),
                           -float("inf"))
            kiln.barrier()   # every thread holds its part: copy the next row (cp.async / DMA)
            if row + step < m:
                kiln.copy(row_tile(x, row + step), row_s)
        else:   # the next row's loads are in flight while this one is reduced and stored
            t_next = kiln.load(row_tile(x, row + step, -float("inf"), m), tv)
        p = kiln.exp(t - kiln.reduce(t, "max", axis=1, cluster=True))
        p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1, cluster=True))
        kiln.copy(p, row_tile(y, row))
        if not STREAM:
            t = t_next


# (threads, blocks per SM of the persistent grid) by row length (the row rounded up to a power
# of two), and the cluster size sm_90a splits the longest rows over; 4k-32k measured on an H200
# with bench/tutorials_rows.py
SHAPES = {512: (128, 8), 1024: (128, 8), 2048: (256, 4), 4096: (512, 3), 8192: (512, 2),
          16384: (1024, 1), 32768: (512, 1)}
SPLIT_SM90 = {32768: 2}


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int, target: str | None = None) -> dict:
    """The launch of rows of ``n`` columns on ``target`` (None: Kiln's default): ``BLOCK``
    (the row rounded up to a power of two, at least 512), ``THREADS`` and ``PER_SM`` (blocks
    per SM of the persistent grid) from :data:`SHAPES`, ``SPLIT`` (a cluster a row, sm_90a:
    :data:`SPLIT_SM90`) and ``STREAM`` (rows through shared memory where two would not fit
    one block's registers: 32768 columns without a cluster)."""
    block = max(512, 1 << (n - 1).bit_length())
    threads, per_sm = SHAPES[block]
    split = SPLIT_SM90.get(block, 1) if (target or default_target()) == "sm_90a" else 1
    return {"BLOCK": block, "THREADS": threads, "PER_SM": per_sm, "SPLIT": split,
            "STREAM": block // split > 16384}


def softmax(x, y, *, backend: str = "gpu", target: str | None = None):
    """``y = softmax(x, axis=1)`` for 2-D float32 arrays with up to 32768 columns."""
    m, n = x.shape
    if n > 32768:
        raise kiln.KilnValueError(f"softmax takes rows of up to 32768 columns, got {n}",
                                  fix="split longer rows (an online softmax over chunks)")
    cfg = config(n, target)
    per_sm, split = cfg.pop("PER_SM"), cfg["SPLIT"]
    sms = driver().multiprocessor_count() if backend == "gpu" else 2
    grid = max(1, min(m, sms * per_sm // split)) * split
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
