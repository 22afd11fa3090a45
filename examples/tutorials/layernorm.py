"""Tutorial 3: layer-norm forward, each row read once.

``y = (x - mean) * rstd * w + b`` with ``rstd = 1 / sqrt(var + eps)`` over each row of an
``M x N`` float32 matrix; ``mean`` and ``rstd`` are written too (the backward pass needs them).
The row stays in registers between the two reductions, so ``x`` is read once: the mean
(``kiln.reduce`` sum; columns past ``N`` read as 0), then the variance of the centred row,
two-pass as in float64 references (columns past ``N`` are zeroed with ``kiln.where`` on
``kiln.tiles.mask``, since ``x - mean`` is not 0 there; the mask is one compare per 16-byte
chunk, not per element). Rows longer than 4096 are held as several 4096-column tiles (a Python
list): they are summed elementwise before each reduction (one cross-warp stage per statistic),
and ``w``/``b`` are loaded one tile at a time after them (a row of one tile loads them before
the reductions, which then hide their latency: 0.87 instead of 0.83 of copy bandwidth at 4096
columns on an H200). ``col_multiple`` promises a 16-byte chunk is wholly inside the row or
wholly past it, so the ragged edge needs no per-element masks.

As in the softmax tutorial, short rows take a block each and long rows (``STREAM``) stream
through shared tiles over a persistent grid: ``kiln.load(tiles, tv, via=row_s, refill=...)``
reads the row from the shared tiles and refills each with the next row's tile (``kiln.copy``:
``cp.async`` / buffer -> LDS DMA; masked past ``m``) as soon as every thread has read it, so
the next row is copied while this one is normalised, with no barrier or wait in the kernel
(on an H200, level with one barrier pair a row, three runs: +0.3 / +1.3 / +1.0% at 16k
columns, +0.3 / -0.7 / +1.1% at 32k; 6 lines shorter). Every row reads all of ``w`` and ``b``
(from L2): a streamed row loads tile ``c + 1``'s before it stores tile ``c``, since a load
after a store it may alias waits for that store; one L2 round trip a tile then overlaps the
previous tile's work (on an H200, 1024 x 16384: 0.81 instead of 0.76 of copy bandwidth,
512 x 32768: 0.75 instead of 0.68).

Run: ``python examples/tutorials/layernorm.py``.
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln import f32, i32
from kiln.runtime.cuda import cuda_available, driver


@kiln.kernel(num_threads="THREADS")
def layernorm_kernel(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                     y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                     rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                     BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                     ALIGN: kiln.constexpr, STREAM: kiln.constexpr):
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(BLOCK // CHUNK)] if STREAM else []
    inv_n = 1.0 / kiln.cast(n, f32)

    def row_tiles(t, row, row_end=None):   # row ``row`` of ``t`` as CHUNK-column tiles
        return [kiln.GlobalTile(t, (1, CHUNK), (row, c * CHUNK), row_end=row_end, col_end=n,
                                align=ALIGN, col_multiple=ALIGN // 4)
                for c in range(BLOCK // CHUNK)]

    def weights(c):   # w's and b's tile c (none past the row's last tile)
        return [kiln.load(row_tiles(t, 0)[c], tv) for t in (w, b)] \
            if c < BLOCK // CHUNK else None

    for s, first in zip(row_s, row_tiles(x, kiln.block_id(0))):   # cp.async / DMA
        kiln.copy(first, s)
    for row in kiln.range(kiln.block_id(0), m, grid):
        if STREAM:   # each tile is refilled with the next row's (masked past m) once read
            xs = kiln.load(row_tiles(x, row), tv, via=row_s, refill=row_tiles(x, row + grid, m))
        else:
            xs = [kiln.load(g, tv) for g in row_tiles(x, row)]
        # w and b: a one-tile row's before the reductions, which hide their latency
        wb = [weights(0)] if BLOCK == CHUNK else []
        mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
        xcs = [kiln.where(kiln.tiles.mask(g, tv), t - mean, 0.0)   # streamed: masked as copied
               for g, t in zip(row_tiles(x, row, m if STREAM else None), xs)]
        wb += [weights(0)] if STREAM else []
        rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                      axis=1) * inv_n + eps)
        for c, xc in enumerate(xcs):
            if STREAM:   # tile c + 1's before tile c's store (a load after it would wait for it)
                wb.append(weights(c + 1))
            gamma, beta = wb[c] if wb else weights(c)   # else a tile at a time: fewer registers
            kiln.copy(xc * rstd * gamma + beta, row_tiles(y, row)[c])
        if kiln.thread_id(0) == 0:
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()


# rows from this many columns stream through shared memory (STREAM), and blocks per SM of
# that persistent grid (measured: bench/tutorials_rows.py)
STREAM_FROM = 16384
BLOCKS_PER_SM = {16384: 1, 32768: 1}


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int) -> tuple[int, int, int, bool]:
    """``(BLOCK, THREADS, BLOCKS_PER_SM, STREAM)``: the row rounded up to a power of two (at
    least 512), 16 columns per thread between 128 and 512 threads (64 at 32768 columns: within
    128 registers, no spills); rows from :data:`STREAM_FROM` columns stream through shared
    memory over a persistent grid, shorter ones take a block each."""
    block = max(512, 1 << (n - 1).bit_length())
    stream = block >= STREAM_FROM
    return block, min(512, max(128, block // 16)), BLOCKS_PER_SM.get(block, 1), stream


def layernorm(x, w, b, y, mean, rstd, eps: float = 1e-5, *, backend: str = "gpu",
              target: str | None = None):
    """Layer norm of each row of 2-D float32 ``x`` (up to 32768 columns) into ``y``."""
    m, n = x.shape
    block, threads, per_sm, stream = config(n)
    sms = driver().multiprocessor_count() if backend == "gpu" else 2
    grid = max(1, min(m, sms * per_sm)) if stream else max(m, 1)
    kernel = layernorm_kernel.interpret[(grid,)] if backend == "interpret" \
        else layernorm_kernel[(grid,)]
    extra = {"target": target} if target else {}
    kernel(x, w, b, y, mean, rstd, m, n, grid, eps, BLOCK=block, CHUNK=min(block, 4096),
           THREADS=threads, ALIGN=alignment(n, x, y, w, b), STREAM=stream, **extra)
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
