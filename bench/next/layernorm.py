"""Tutorial 3: layer-norm forward, each row read once.

``y = (x - mean) * rstd * w + b`` with ``rstd = 1 / sqrt(var + eps)`` over each row of an
``M x N`` float32 matrix; ``mean`` and ``rstd`` are written too (the backward pass needs them).
The row stays in registers between the two reductions, so ``x`` is read once: the mean
(``kiln.reduce`` sum; columns past ``N`` read as 0), then the variance of the centred row,
two-pass as in float64 references (columns past ``N`` are zeroed with ``kiln.where`` on
``kiln.tiles.mask``, since ``x - mean`` is not 0 there; the mask is one compare per 16-byte
chunk, not per element). Rows are held as ``CHUNK``-column tiles (a Python list), summed
elementwise before each reduction (one cross-warp stage per statistic). ``col_multiple``
promises a 16-byte chunk is wholly inside the row or wholly past it, so the ragged edge needs
no per-element masks.

As in the softmax tutorial, each block of a persistent grid walks rows ``block, block + grid,
...`` with the next row's loads in flight (a second set of registers) while this one is
normalised. Every row reads all of ``w`` and ``b``: each block copies them into shared memory
once (``kiln.copy``, ``cp.async`` / buffer -> LDS DMA) instead of reading them from L2 for every
row. MEASURED

Rows too long for that (32768 columns: two rows in registers and ``w``/``b`` in shared memory
do not fit one block): on sm_90a a cluster of ``SPLIT`` blocks shares each row (each holds
``BLOCK // SPLIT`` columns, its slices of ``w``/``b``, and ``kiln.reduce(..., cluster=True)``
combines the blocks' sums through distributed shared memory); elsewhere (``STREAM``) the next
row streams into shared tiles (the next row's ``kiln.copy`` runs while this one is
normalised) and ``w``/``b`` are read per row.

Run: ``python examples/tutorials/layernorm.py``.
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln import f32, i32
from kiln.kernel import default_target
from kiln.runtime.cuda import cuda_available, driver


@kiln.kernel(num_threads="THREADS")
def layernorm_kernel(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                     y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                     rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                     BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                     ALIGN: kiln.constexpr, STREAM: kiln.constexpr, SPLIT: kiln.constexpr = 1):
    part = BLOCK // SPLIT   # SPLIT blocks (a cluster) share a row, `part` columns each
    rank = kiln.cluster_rank(SPLIT)
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    start, step, tiles = kiln.block_id(0) // SPLIT, grid // SPLIT, part // CHUNK
    inv_n = 1.0 / kiln.cast(n, f32)

    def row_tiles(t, row, row_end=None):   # this block's part of row `row`, CHUNK-column tiles
        return [kiln.GlobalTile(t, (1, CHUNK), (row, rank * part + c * CHUNK), row_end=row_end,
                                col_end=n, align=ALIGN, col_multiple=ALIGN // 4)
                for c in range(tiles)]

    # STREAM: the next row's tiles; else w's and b's, copied once
    shared = [kiln.SharedTile((1, CHUNK), f32) for _ in range(tiles if STREAM else 2 * tiles)]

    def fetch(sources):   # asynchronous (cp.async / LDS DMA), waited for where shared is read
        for g, s in zip(sources, shared):
            kiln.copy(g, s)

    fetch(row_tiles(x, start) if STREAM else row_tiles(w, 0) + row_tiles(b, 0))
    if not STREAM:
        kiln.barrier()
        xs = [kiln.load(g, tv) for g in row_tiles(x, start, m)]
    for row in kiln.range(start, m, step):
        if STREAM:   # the row arrived in shared memory while the previous one was normalised
            kiln.barrier()
            xs = [kiln.load(s, tv) for s in shared]
            kiln.barrier()   # every thread holds its part: fetch the next row
            if row + step < m:
                fetch(row_tiles(x, row + step))
        else:   # the next row's loads are in flight while this one is normalised
            xs_next = [kiln.load(g, tv) for g in row_tiles(x, row + step, m)]
        mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1, cluster=True) * inv_n
        xcs = [kiln.where(kiln.tiles.mask(g, tv), t - mean, 0.0)
               for g, t in zip(row_tiles(x, row), xs)]
        rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                      axis=1, cluster=True) * inv_n + eps)
        for c, xc in enumerate(xcs):
            gamma, beta = (kiln.load(t[c], tv) for t in (row_tiles(w, 0), row_tiles(b, 0))) \
                if STREAM else (kiln.load(shared[c], tv), kiln.load(shared[tiles + c], tv))
            kiln.copy(xc * rstd * gamma + beta, row_tiles(y, row)[c])
        if (kiln.thread_id(0) == 0) & (rank == 0):
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()
        if not STREAM:
            xs = xs_next


# (threads, blocks per SM of the persistent grid) by row length (the row rounded up to a power
# of two), and the cluster size sm_90a splits the longest rows over; 4k-32k measured on an H200
# with bench/tutorials_rows.py
SHAPES = {512: (128, 8), 1024: (128, 8), 2048: (256, 4), 4096: (512, 2), 8192: (512, 2),
          16384: (1024, 1), 32768: (512, 1)}
SPLIT_SM90 = {32768: 2}


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int, target: str | None = None) -> dict:
    """The launch of rows of ``n`` columns on ``target`` (None: Kiln's default): ``BLOCK``
    (the row rounded up to a power of two, at least 512), ``CHUNK`` (its tiles: at most 4096
    columns), ``THREADS`` and ``PER_SM`` (blocks per SM of the persistent grid) from
    :data:`SHAPES`, ``SPLIT`` (a cluster a row, sm_90a: :data:`SPLIT_SM90`) and ``STREAM``
    (rows through shared memory where a block cannot hold ``w``/``b`` there and two rows in
    registers: 32768 columns without a cluster)."""
    block = max(512, 1 << (n - 1).bit_length())
    threads, per_sm = SHAPES[block]
    split = SPLIT_SM90.get(block, 1) if (target or default_target()) == "sm_90a" else 1
    return {"BLOCK": block, "CHUNK": min(block // split, 4096), "THREADS": threads,
            "PER_SM": per_sm, "SPLIT": split, "STREAM": block // split > 16384}


def layernorm(x, w, b, y, mean, rstd, eps: float = 1e-5, *, backend: str = "gpu",
              target: str | None = None):
    """Layer norm of each row of 2-D float32 ``x`` (up to 32768 columns) into ``y``."""
    m, n = x.shape
    if n > 32768:
        raise kiln.KilnValueError(f"layernorm takes rows of up to 32768 columns, got {n}",
                                  fix="normalise longer rows in chunks (Welford merges)")
    cfg = config(n, target)
    per_sm, split = cfg.pop("PER_SM"), cfg["SPLIT"]
    sms = driver().multiprocessor_count() if backend == "gpu" else 2
    grid = max(1, min(m, sms * per_sm // split)) * split
    kernel = layernorm_kernel.interpret[(grid,)] if backend == "interpret" \
        else layernorm_kernel[(grid,)]
    extra = {"target": target} if target else {}
    kernel(x, w, b, y, mean, rstd, m, n, grid, eps, ALIGN=alignment(n, x, y, w, b), **cfg,
           **extra)
    return y


def reference(x, w, b, eps=1e-5):
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x64 - mean) ** 2).mean(axis=1, keepdims=True) + eps)
    return (x64 - mean) * rstd * w + b, mean[:, 0], rstd[:, 0]


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    m, n = 29, 1000
    x = rng.standard_normal((m, n), np.float32) * 3 + 1
    w, b = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    y = np.full_like(x, np.nan)
    mean, rstd = np.full(m, np.nan, np.float32), np.full(m, np.nan, np.float32)
    backend = "gpu" if cuda_available() else "interpret"
    layernorm(x, w, b, y, mean, rstd, backend=backend)
    y_ref, mean_ref, rstd_ref = reference(x, w, b)
    err = np.abs(y - y_ref).max()
    assert err < 1e-4 and np.allclose(mean, mean_ref, atol=1e-5) and np.allclose(rstd, rstd_ref)
    print(f"layernorm of {x.shape} ({backend}): max error {err:.2e}")
