"""The Hopper GEMM (TMA ring, warp-specialised producer/consumers, raw wgmma descriptors)
through the CPU interpreter: ``kiln.kernels.gemm.matmul(..., backend="interpret")``."""

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

from kiln.kernels.gemm import matmul

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


@pytest.mark.parametrize("m, n, k, trans_b, dtype, out_dtype", [
    (200, 264, 136, False, "bf16", "f32"),  # ragged in every dimension, 2 x 2 tiles, 3 K steps
    (130, 70, 72, True, "bf16", "bf16"),  # B stored N x K (K-major wgmma operand)
    (64, 256, 320, False, "f16", "f16"),  # 5 K steps: the 4-stage ring wraps around
])
def test_matmul_matches_float64(m, n, k, trans_b, dtype, out_dtype, rng):
    a = rng.standard_normal((m, k)).astype(DTYPES[dtype])
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(DTYPES[dtype])
    c = matmul(a, b, trans_b=trans_b, out_dtype=out_dtype, target="sm_90a", backend="interpret")
    assert_matmul_close(c, a, b.T if trans_b else b)


@pytest.mark.parametrize("feed", ["registers", "dma"])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_gfx950_gemm_matches_float64(feed, b_layout, rng):
    """The AMD GEMM (buffer views, LDS DMA or ds_write, ds_read / ds_read_tr, MFMA 32x32x16,
    s_waitcnt + s_barrier) on ragged shapes: no AMD GPU needed."""
    from kiln.kernels.gemm.gfx950 import GemmConfig, make_kernel

    cfg = GemmConfig(feed=feed, b_layout=b_layout, out_dtype="f32")
    m, n, k = 200, 136, 72
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k) if b_layout == "nk" else (k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n),)
    make_kernel("bf16", cfg).interpret[grid](a, b, c, m, n, k, target="gfx950",
                                             num_warps=cfg.num_warps)
    assert_matmul_close(c, a, b.T if b_layout == "nk" else b)


@pytest.mark.parametrize("trans_b", [True, False])
def test_matmul_interpret_gfx950(trans_b, rng):
    """``matmul(..., target="gfx950", backend="interpret")`` runs the AMD kernel on the CPU."""
    m, n, k = 70, 136, 40
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(ml_dtypes.bfloat16)
    c = matmul(a, b, trans_b=trans_b, out_dtype="f32", target="gfx950", backend="interpret")
    assert_matmul_close(c, a, b.T if trans_b else b)
