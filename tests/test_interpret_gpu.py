"""The interpreter and a CUDA GPU agree on the same kernels and inputs (marker ``gpu``).

Each kernel runs twice on copies of fresh random inputs (the ``rng`` fixture's seed), once with
``kernel.interpret[grid]`` and once with ``kernel[grid]`` on the device; the outputs must match
to rounding, and the GPU's must match an independent float64 reference where the kernel has
one (the interpreter shares the kernels' layout and swizzle code, so agreement alone could hide
a bug in both).
"""

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

from kiln.runtime.cuda import cuda_available

import test_interpret_async as async_kernels
import test_interpret_kernels as kernels
from sample_kernels import saxpy, scale_rows
from source_modules import load_example

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]


def run_both(kernel, grid, args, **options):
    """Outputs of the interpreter and of the GPU, each from its own copy of ``args``."""
    cpu = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    gpu = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    kernel.interpret[grid](*cpu, **options)
    kernel[grid](*gpu, target="sm_90a", **options)
    return cpu, gpu


def test_saxpy_and_branches(rng):
    n = 4099
    x, y = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    cpu, gpu = run_both(saxpy, ((n + 255) // 256,), [x, y, n, 2.5], BLOCK=256,
                        num_warps=8)
    np.testing.assert_allclose(cpu[1], gpu[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gpu[1], 2.5 * x.astype(np.float64) + y, rtol=1e-6, atol=1e-6)
    out = np.full(102, np.nan, np.float32)
    cpu, gpu = run_both(kernels.branches, (2,), [x[:97].copy(), out, 97], num_warps=2)
    np.testing.assert_allclose(cpu[1], gpu[1], rtol=1e-6)


def test_rms_norm_and_strided_bf16(rng):
    demo = load_example("demo")
    rows, cols = 300, 257
    x, w, y = demo.random_inputs(rng, rows, cols)
    cpu, gpu = run_both(demo.rms_norm, (3,), [x, w, y, rows, cols, 1e-6], BLOCK=128)
    np.testing.assert_allclose(cpu[2], gpu[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gpu[2], demo.reference(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    base = rng.standard_normal((33, 140)).astype(ml_dtypes.bfloat16)
    out = np.full((33, 70), np.nan, np.float32)
    cpu_out, gpu_out = out.copy(), out.copy()
    scale_rows.interpret[(33,)](base[:, ::2], cpu_out, 33, 70, num_warps=2)
    scale_rows[(33,)](base[:, ::2], gpu_out, 33, 70, num_warps=2, target="sm_90a")
    np.testing.assert_array_equal(cpu_out, gpu_out)
    np.testing.assert_array_equal(gpu_out, base[:, ::2].astype(np.float64)
                                  * np.arange(1, 34)[:, None])


def test_hopper_kernels(rng):
    smoke = load_example("hopper_tma_wgmma_smoke")
    a, b, c = smoke.reference_inputs(seed=int(rng.integers(1 << 30)))
    cpu, gpu = run_both(smoke.tma_wgmma_smoke, (1,), [a, b, c], num_warps=4)
    np.testing.assert_allclose(cpu[2], gpu[2], rtol=1e-5, atol=1e-5)
    assert_matmul_close(gpu[2], a, b)
    x = rng.standard_normal((11, 44)).astype(np.float32)  # 176-byte rows: TMA needs 16-byte strides
    out = np.full((async_kernels.ROWS, async_kernels.COLS), np.nan, np.float32)
    for swizzle in (0, 128):
        cpu, gpu = run_both(async_kernels.make_box_reader(swizzle), (1,), [x, out, 6, 20],
                            num_warps=8)
        np.testing.assert_array_equal(cpu[1], gpu[1])
    cpu, gpu = run_both(kernels.producer_consumer, (1,),
                        [x[0, :].repeat(3)[:128].copy(), np.zeros(128, np.float32)], num_warps=8)
    np.testing.assert_array_equal(cpu[1], gpu[1])


def test_raw_wgmma_and_mma_sync_gemm(rng):
    a = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    c = np.full((64, 64), np.nan, np.float32)
    cpu, gpu = run_both(async_kernels.make_wgmma_kernel(True), (1,), [a, b, c], num_warps=4)
    np.testing.assert_allclose(cpu[2], gpu[2], rtol=1e-5, atol=1e-4)
    assert_matmul_close(gpu[2], a, b)
    gemm = load_example("mma_sync_gemm")
    a, b, c = gemm.reference_inputs(200, 128, 96, seed=int(rng.integers(1 << 30)))
    cpu, gpu = run_both(gemm.mma_sync_gemm, (4, 2, 1), [a, b, c, 200, 96], BM=gemm.BLOCK_M,
                        BN=gemm.BLOCK_N, BK=gemm.BLOCK_K, num_warps=gemm.NUM_WARPS)
    np.testing.assert_allclose(cpu[2], gpu[2], rtol=1e-5, atol=1e-4)
    assert_matmul_close(gpu[2], a, b)


def test_hopper_gemm(rng):
    from kiln.kernels.gemm import matmul

    a = rng.standard_normal((200, 136)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((136, 264)).astype(ml_dtypes.bfloat16)
    cpu = matmul(a, b, out_dtype="f32", target="sm_90a", backend="interpret")
    gpu = matmul(a, b, out_dtype="f32", target="sm_90a")
    np.testing.assert_allclose(cpu, gpu, rtol=1e-5, atol=1e-4)
    assert_matmul_close(gpu, a, b)
