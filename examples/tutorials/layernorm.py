"""Tutorial 3: layer-norm forward, one row per block.

``y = (x - mean) * rstd * w + b`` with ``rstd = 1 / sqrt(var + eps)`` over each row of an
``M x N`` float32 matrix; ``mean`` and ``rstd`` are written too (the backward pass needs them).
The row stays in registers between the two reductions, so ``x`` is read once: the mean
(``kiln.reduce`` sum), then the variance of the centred row, two-pass as in float64
references (columns past ``N`` are zeroed with ``kiln.where`` on the tile's column
coordinates, since ``x - mean`` is not 0 there). Rows longer than 4096 are held as several
4096-column tiles (a Python list): they are summed elementwise before each reduction (one
cross-warp stage per statistic), and ``w``/``b`` are loaded one tile at a time, which keeps a
32768-column row within the 64 registers a thread of a 1024-thread block has.

Run: ``python examples/tutorials/layernorm.py``.
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln import f32, i32
from kiln.runtime.cuda import cuda_available


@kiln.kernel(num_threads="THREADS")
def layernorm_kernel(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                     y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                     rstd_out: kiln.Tensor[f32], n: i32, eps: f32,
                     BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                     ALIGN: kiln.constexpr):
    row = kiln.block_id(0)
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    _, cols = kiln.tiles.coords(tv)
    xs = [kiln.load(kiln.GlobalTile(x, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN), tv)
          for c in range(BLOCK // CHUNK)]
    inv_n = 1.0 / kiln.cast(n, f32)
    mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
    xcs = [kiln.where(cols + c * CHUNK < n, t - mean, 0.0) for c, t in enumerate(xs)]
    rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                  axis=1) * inv_n + eps)
    for c, xc in enumerate(xcs):   # w and b a chunk at a time: fewer live registers
        gamma = kiln.load(kiln.GlobalTile(w, (1, CHUNK), (0, c * CHUNK), col_end=n,
                                          align=ALIGN), tv)
        beta = kiln.load(kiln.GlobalTile(b, (1, CHUNK), (0, c * CHUNK), col_end=n,
                                         align=ALIGN), tv)
        kiln.copy(xc * rstd * gamma + beta, kiln.GlobalTile(y, (1, CHUNK), (row, c * CHUNK),
                                                            col_end=n, align=ALIGN))
    if kiln.thread_id(0) == 0:
        mean_out[row] = mean.item()
        rstd_out[row] = rstd.item()


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int) -> tuple[int, int]:
    """``(BLOCK, THREADS)``: the row rounded up to a power of two (at least 512), 16 columns
    per thread between 128 and 1024 threads."""
    block = max(512, 1 << (n - 1).bit_length())
    return block, min(1024, max(128, block // 16))


def layernorm(x, w, b, y, mean, rstd, eps: float = 1e-5, *, backend: str = "gpu",
              target: str | None = None):
    """Layer norm of each row of 2-D float32 ``x`` (up to 32768 columns) into ``y``."""
    m, n = x.shape
    block, threads = config(n)
    kernel = layernorm_kernel.interpret[(m,)] if backend == "interpret" \
        else layernorm_kernel[(m,)]
    extra = {"target": target} if target else {}
    kernel(x, w, b, y, mean, rstd, n, eps, BLOCK=block, CHUNK=min(block, 4096),
           THREADS=threads, ALIGN=alignment(n, x, y, w, b), **extra)
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
