"""The decode GEMVs (``kiln.kernels.gemm.gemv``, ``HopperGemmConfig(gemv=True)``; the
tensor-core one of ``.gemv_mma`` at M of 5..16): interpreter runs on odd shapes against float64
with NaN-poisoned outputs, their variants, the PTX (16-byte loads, mma.sync, no spills), the
refusals, and GPU runs (``gpu``)."""

import re

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close, check_config_on_gpu

import kiln
from kiln.kernels import runtime
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul_config
from kiln.kernels.gemm import gemv_mma
from kiln.kernels.gemm.gemv import MAX_ROWS, WARPS, gemv_kernel, grid
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
GEMV = HopperGemmConfig(gemv=True)
# K: one unrolled round and a tail (2056), tail only (100: padded to 104), one vector (8);
# N: rows past the last warp's (70, 33, 9 of 16 per CTA)
SHAPES = [(1, 70, 2056), (2, 33, 100), (3, 9, 8), (4, 129, 1032)]
# the tensor-core GEMV: one n-half (5, 8) and two (9, 16); K: two CTA rounds of 512 and a
# partial block (1048), one partial round (520), one vector (8); N: a partial 16-row tile
MMA_SHAPES = [(5, 70, 1048), (8, 16, 520), (9, 33, 8), (16, 129, 1048)]


# M of 1..4 runs the CUDA-core GEMV, 5..16 the tensor-core one (the shape lists above)
@pytest.mark.parametrize("shape", SHAPES + MMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype, out", [(ml_dtypes.bfloat16, None), (np.float16, "f32")])
def test_interpreted_gemv_matches_float64(shape, dtype, out, rng):
    m, n, k = shape
    a = rng.standard_normal((m, k)).astype(dtype)
    w = rng.standard_normal((n, k)).astype(dtype)
    # numpy outputs start as NaN: a row never stored fails the check
    c = matmul_config(a, w, GEMV, trans_b=True, out_dtype=out, target="sm_90a",
                      backend="interpret")
    assert c.dtype == (dtype if out is None else np.float32)
    assert_matmul_close(c, a, w.T)


@pytest.mark.parametrize("warps, unroll, tiles", [(4, 4, 1), (16, 1, 1), (8, 2, 2), (4, 1, 4)])
def test_mma_gemv_variants_match_float64(warps, unroll, tiles, rng):
    m, n, k = 13, 37, 2056  # 37 rows: the last CTA's row tiles partly or wholly past N
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    runtime.interpret(gemv_mma.mma_gemv_kernel("bf16", "f32", 2, warps, unroll, tiles),
                      gemv_mma.grid(n, tiles), [a, w, c, m, n, k], target="sm_90a",
                      num_warps=warps)
    assert_matmul_close(c, a, w.T)


@pytest.mark.lower
@pytest.mark.parametrize("m", [8, 16])
def test_mma_gemv_ptx_loads_16_bytes_into_mma_sync(m):
    from kiln.kernels.gemm.gemv import compile_gemv

    ck = compile_gemv("bf16", "bf16", target="sm_90a", m=m)
    ptx = ck.asm["ptx"]
    assert set(re.findall(r"ld\.global[.\w]*", ptx)) == {"ld.global.v4.b32"}
    # per warp and round: 2 blocks x 2 k16 steps x the n-halves of M
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == 4 * (m // 8)
    assert "wgmma" not in ptx and ck.metadata["spill_bytes"] == 0


@pytest.mark.parametrize("rows, unroll", [(1, 8), (4, 4)])
def test_gemv_variants_match_float64(rows, unroll, rng):
    m, n, k = 1, 37, 2064
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    runtime.interpret(gemv_kernel("bf16", "f32", m, rows, unroll), grid(n, rows),
                      [a, w, c, n, k], target="sm_90a", num_warps=WARPS)
    assert_matmul_close(c, a, w.T)


@pytest.mark.lower
def test_ptx_streams_16_byte_loads_without_spills():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True, gemv=True)
    ptx = ck.asm["ptx"]
    assert set(re.findall(r"ld\.global[.\w]*", ptx)) == {"ld.global.v4.b32"}
    assert "wgmma" not in ptx and ck.metadata["spill_bytes"] == 0


def test_gemv_refuses_what_it_has_no_code_for():
    a = np.ones((gemv_mma.MAX_ROWS + 1, 8), ml_dtypes.bfloat16)
    with pytest.raises(kiln.UnsupportedError, match="M of 1..16"):
        matmul_config(a, np.ones((8, 8), ml_dtypes.bfloat16), GEMV, trans_b=True,
                      target="sm_90a", backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="N x K"):
        matmul_config(a[:1], np.ones((8, 8), ml_dtypes.bfloat16), GEMV, target="sm_90a",
                      backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="gemv"):
        HopperGemmConfig(gemv=True, split_k=2)
    from kiln.kernels.gemm.gemv import compile_gemv

    with pytest.raises(kiln.UnsupportedError, match="NVIDIA"):
        compile_gemv("bf16", "bf16", target="gfx950")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(1, 6144, 4096), (4, 1000, 1032), (1, 70, 8),
                                   (16, 6144, 4096), (11, 1000, 1032), (8, 70, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemv_on_the_gpu(shape, rng):
    pytest.importorskip("torch")
    check_config_on_gpu(GEMV, shape, rng)
