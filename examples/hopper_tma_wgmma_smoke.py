"""Hopper smoke kernel: TMA loads on an mbarrier, WGMMA m64n64k16 steps, f32 result.

One CTA of 128 threads (one warp group) computes ``C = A @ B`` for A: 64 x 64 bf16 and
B: 64 x 64 bf16 (row-major, N contiguous), C: 64 x 64 f32:

1. thread 0 initialises an mbarrier, announces the bytes both TMA boxes will deliver and issues
   the two TMA loads into 128B-swizzled shared tiles;
2. every thread waits on the mbarrier (phase 0);
3. the warp group issues four ``wgmma.mma_async.m64n64k16`` steps over K (``kiln.wgmma.mma_async``
   with both operands read through shared-memory descriptors: A K-major, B MN-major), commits
   them as one group, waits, and writes the f32 accumulator to C through its fragment layout.

Run on an H100: ``python examples/hopper_tma_wgmma_smoke.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import kiln
from kiln import mbarrier, tma, wgmma
from kiln.nvidia.sync import fence_mbarrier_init

M, N, K = 64, 64, 64
SWIZZLE = 128  # bytes: one 64-element bf16 row, the layout WGMMA reads without bank conflicts
SWIZZLE_ALIGN = 1024  # 128B-swizzled tiles must start on a 1024-byte boundary


@kiln.kernel
def tma_wgmma_smoke(a_map: kiln.TensorMap[kiln.bf16, (M, K), SWIZZLE],
                    b_map: kiln.TensorMap[kiln.bf16, (K, N), SWIZZLE],
                    c: kiln.Tensor[kiln.f32]):
    """c[0:M, 0:N] = A @ B for the boxes of A and B at (0, 0)."""
    a_smem = kiln.shared((M, K), kiln.bf16, align=SWIZZLE_ALIGN)
    b_smem = kiln.shared((K, N), kiln.bf16, align=SWIZZLE_ALIGN)
    leader = kiln.thread_id(0) == 0

    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=1, predicate=leader)
    fence_mbarrier_init()
    kiln.barrier()  # every thread must see the initialised barrier before waiting on it

    tma.prefetch_descriptor(a_map, predicate=leader)
    tma.prefetch_descriptor(b_map, predicate=leader)
    bars.arrive_expect_tx(0, tma.box_bytes(a_map) + tma.box_bytes(b_map), predicate=leader)
    tma.load(a_map, a_smem, (0, 0), bars, 0, predicate=leader)  # coords: (k, m), innermost first
    tma.load(b_map, b_smem, (0, 0), bars, 0, predicate=leader)  # coords: (n, k)
    bars.try_wait(0, phase=0)

    # A: 64 rows of 128 bytes along K; a k16 step is 32 bytes (2 descriptor units) further.
    a = wgmma.smem_descriptor(a_smem, leading_bytes=16, stride_bytes=1024)
    # B is stored K x N with N contiguous (MN-major): a k16 step is 16 rows of 128 bytes.
    b = wgmma.smem_descriptor(b_smem, leading_bytes=K * SWIZZLE, stride_bytes=1024)
    acc = wgmma.fragment_zeros(N)
    wgmma.fence()
    for k in kiln.static_range(K // 16):
        acc = wgmma.mma_async(acc, a + 2 * k, b + 128 * k, dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    wgmma.wait_group(0)
    tid = kiln.thread_id(0)
    for i in kiln.static_range(N // 2):  # register i of thread tid is C[acc.layout(tid, i)]
        c[acc.layout(tid, i)] = acc.element(i)


def reference_inputs(seed: int = 0):
    """Random bf16 A, B and a NaN-poisoned f32 C (so unwritten elements fail the check)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((K, N)).astype(ml_dtypes.bfloat16)
    c = np.full((M, N), np.nan, dtype=np.float32)
    return a, b, c


def relative_error(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    expected = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.linalg.norm(c - expected) / np.linalg.norm(expected))


def main() -> None:
    a, b, c = reference_inputs()
    tma_wgmma_smoke[(1, 1, 1)](a, b, c, target="sm_90a", num_warps=4)
    error = relative_error(c, a, b)
    print(f"relative error {error:.2e}: {'PASS' if error < 1e-2 else 'FAIL'}")


if __name__ == "__main__":
    main()
