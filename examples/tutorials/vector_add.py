"""Tutorial 1: vector add, one tile per block.

Each block adds one ``BLOCK``-element tile of ``x`` and ``y``. The tile lives in registers in a
:func:`kiln.layout.blocked` layout: every thread owns runs of 4 consecutive elements, so each
load and store is one 16-byte vector access and a warp's accesses coalesce. The last tile is
ragged: ``col_end=n`` masks the elements past the end (masked loads read nothing, masked
stores write nothing). ``align=16`` tells the compiler the 4-element runs are 16-byte aligned
(the arrays start aligned), which is what lets LLVM keep them single vector accesses. The block
size is declared once (``num_threads="THREADS"``), so the same kernel launches 256 threads on
NVIDIA (8 warps of 32) and on AMD (4 wavefronts of 64).

Run: ``python examples/tutorials/vector_add.py`` (GPU if there is one, else the interpreter).
"""

from __future__ import annotations

import numpy as np

import kiln
from kiln.runtime.cuda import cuda_available
from kiln import f32, i32

BLOCK, THREADS = 2048, 256


def alignment(n: int, *arrays) -> int:
    """Bytes every 4-element chunk is aligned to: 16 when rows of ``n`` float32 keep the
    arrays' (device) starting alignment, else 4 (LLVM then splits the vector accesses)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if n % 4 == 0 and all(p % 16 == 0 for p in pointers) else 4


@kiln.kernel(num_threads="THREADS")
def add_kernel(x: kiln.Tensor[f32], y: kiln.Tensor[f32], out: kiln.Tensor[f32], n: i32,
               BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr):
    start = kiln.block_id(0) * BLOCK
    tv = kiln.layout.blocked((1, BLOCK), THREADS, vec=4)
    a = kiln.load(kiln.GlobalTile(x, (1, BLOCK), (0, start), col_end=n, align=ALIGN), tv)
    b = kiln.load(kiln.GlobalTile(y, (1, BLOCK), (0, start), col_end=n, align=ALIGN), tv)
    kiln.copy(a + b, kiln.GlobalTile(out, (1, BLOCK), (0, start), col_end=n, align=ALIGN))


def add(x, y, out, *, backend: str = "gpu", target: str | None = None):
    """``out = x + y`` for 1-D float32 arrays (numpy, torch or cupy on the GPU backend)."""
    n = x.shape[0]
    grid = ((n + BLOCK - 1) // BLOCK,)
    launch = add_kernel.interpret[grid] if backend == "interpret" else add_kernel[grid]
    extra = {"target": target} if target else {}
    launch(x, y, out, n, BLOCK=BLOCK, THREADS=THREADS, ALIGN=alignment(0, x, y, out), **extra)
    return out


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    n = 98_432 + 17
    x, y = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    out = np.full(n, np.nan, np.float32)
    backend = "gpu" if cuda_available() else "interpret"
    add(x, y, out, backend=backend)
    assert np.array_equal(out, x + y)
    print(f"vector add of {n} elements ({backend}): ok")
