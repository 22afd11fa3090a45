"""Tutorial 2: fused row softmax, one row per block, read once and written once.

``y[i] = exp(x[i] - max(x[i])) / sum(exp(x[i] - max(x[i])))`` for every row of an
``M x N`` float32 matrix. A block loads its whole row into registers (a
:func:`kiln.layout.blocked` tile of ``BLOCK >= N`` columns, 16-byte loads), so the row crosses
DRAM once each way, the bound a softmax cannot beat. Columns past ``N`` load as ``-inf`` (the
GlobalTile's ``fill``), which leaves the max unchanged and adds ``exp(-inf) = 0`` to the sum.

``kiln.reduce`` does the cross-thread work: registers, then XOR shuffles inside each warp
(32 lanes on NVIDIA, 64 on AMD: read from the target), then one shared-memory stage across
the warps. The kernel has no shuffle, barrier or shared-memory code.

Run: ``python examples/tutorials/fused_softmax.py``.
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln import f32, i32
from kiln.runtime.cuda import cuda_available


@kiln.kernel(num_threads="THREADS")
def softmax_kernel(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], n: i32,
                   BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr):
    row = kiln.block_id(0)
    tv = kiln.layout.blocked((1, BLOCK), THREADS, vec=4)
    t = kiln.load(kiln.GlobalTile(x, (1, BLOCK), (row, 0), col_end=n, fill=-float("inf"),
                                  align=ALIGN), tv)
    p = kiln.exp(t - kiln.reduce(t, "max", axis=1))
    p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1))
    kiln.copy(p, kiln.GlobalTile(y, (1, BLOCK), (row, 0), col_end=n, align=ALIGN))


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


def config(n: int) -> tuple[int, int]:
    """``(BLOCK, THREADS)`` for rows of ``n`` columns: the row rounded up to a power of two
    (at least 512), and 16 columns per thread between 128 and 1024 threads."""
    block = max(512, 1 << (n - 1).bit_length())
    return block, min(1024, max(128, block // 16))


def softmax(x, y, *, backend: str = "gpu", target: str | None = None):
    """``y = softmax(x, axis=1)`` for 2-D float32 arrays with up to 32768 columns."""
    m, n = x.shape
    block, threads = config(n)
    launch = softmax_kernel.interpret[(m,)] if backend == "interpret" else softmax_kernel[(m,)]
    extra = {"target": target} if target else {}
    launch(x, y, n, BLOCK=block, THREADS=threads, ALIGN=alignment(n, x, y), **extra)
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
