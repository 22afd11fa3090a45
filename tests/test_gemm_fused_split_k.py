"""Split-K reduced inside the Hopper GEMM kernel (``fused_reduce``; every slice publishes its
partial and draws a ticket, the last sums them: ``kiln.kernels.gemm.epilogue.finish_fused``)
on the GPU (``gpu``) with more work units than SMs, so that a CTA runs several, launch after
launch of one bound plan (tickets only grow); the interpreter's checks are in
test_gemm_small_m.py."""

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

from kiln.kernels.gemm import HopperGemmConfig
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
C = HopperGemmConfig
CONFIGS = {
    "bm128_bn192_split2": C(block_n=192, split_k=2, fused_reduce=True, pdl=True),
    "bm128_bn256_split3": C(split_k=3, fused_reduce=True),
    "swap32_split2": C(block_n=32, stages=8, swap_ab=True, split_k=2, fused_reduce=True,
                       pdl=True),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_fused_split_k_over_waves_and_launches(name, rng):
    torch = pytest.importorskip("torch")
    from kiln.kernels import gemm

    config = CONFIGS[name]
    # 517 x 3000: 5 x 16 tiles of 128 x 192 in 2 slices (160 units), 5 x 12 of 128 x 256 in
    # 3 (180); 30 x 9000: 71 swap-AB tiles of C.T in 2 (142); K = 1032: 17 K steps, uneven
    m, n, k = (30, 9000, 1032) if config.swap_ab else (517, 3000, 1032)
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    plan = gemm._bind(x, w, c, True, "sm_90a", config)
    for _ in range(3):  # fresh operands in place: the plan's pointers stay valid
        a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        b = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        for dst, src in ((x, a), (w, b)):
            dst.copy_(torch.from_numpy(src.astype(np.float32)).to("cuda", torch.bfloat16))
        c.fill_(float("nan"))
        plan.bound(x.data_ptr(), w.data_ptr(), c.data_ptr())
        assert_matmul_close(c, a, b.T)
