"""The Hopper GEMM (TMA ring, warp-specialised producer/consumers, raw wgmma descriptors)
through the CPU interpreter: ``kiln.kernels.gemm.matmul(..., backend="interpret")``."""

import ml_dtypes
import numpy as np
import pytest

from kiln.kernels.gemm import matmul

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


@pytest.mark.parametrize("m, n, k, trans_b, dtype, out_dtype", [
    (200, 264, 136, False, "bf16", "f32"),  # ragged in every dimension, 2 x 2 tiles, 3 K steps
    (130, 70, 72, True, "bf16", "bf16"),  # B stored N x K (K-major wgmma operand)
    (64, 256, 320, False, "f16", "f16"),  # 5 K steps: the 4-stage ring wraps around
])
def test_matmul_matches_float64(m, n, k, trans_b, dtype, out_dtype):
    rng = np.random.default_rng()
    a = rng.standard_normal((m, k)).astype(DTYPES[dtype])
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(DTYPES[dtype])
    c = matmul(a, b, trans_b=trans_b, out_dtype=out_dtype, target="sm_90a", backend="interpret")
    b64 = b.astype(np.float64)
    expected = a.astype(np.float64) @ (b64.T if trans_b else b64)
    assert c.shape == (m, n)
    error = np.linalg.norm(c.astype(np.float64) - expected) / np.linalg.norm(expected)
    assert error < (1e-6 if out_dtype == "f32" else 5e-3)


@pytest.mark.parametrize("feed", ["registers", "dma"])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_gfx950_gemm_matches_float64(feed, b_layout):
    """The AMD GEMM (buffer views, LDS DMA or ds_write, ds_read / ds_read_tr, MFMA 32x32x16,
    s_waitcnt + s_barrier) on ragged shapes: no AMD GPU needed."""
    from kiln.kernels.gemm.gfx950 import GemmConfig, make_kernel

    cfg = GemmConfig(feed=feed, b_layout=b_layout, out_dtype="f32")
    rng = np.random.default_rng()
    m, n, k = 200, 136, 72
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k) if b_layout == "nk" else (k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n),)
    make_kernel("bf16", cfg).interpret[grid](a, b, c, m, n, k, target="gfx950",
                                             num_warps=cfg.num_warps)
    b64 = b.astype(np.float64)
    expected = a.astype(np.float64) @ (b64.T if b_layout == "nk" else b64)
    assert np.linalg.norm(c - expected) / np.linalg.norm(expected) < 1e-6


@pytest.mark.parametrize("trans_b", [True, False])
def test_matmul_interpret_gfx950(trans_b):
    """``matmul(..., target="gfx950", backend="interpret")`` runs the AMD kernel on the CPU."""
    rng = np.random.default_rng()
    m, n, k = 70, 136, 40
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(ml_dtypes.bfloat16)
    c = matmul(a, b, trans_b=trans_b, out_dtype="f32", target="gfx950", backend="interpret")
    b64 = b.astype(np.float64)
    expected = a.astype(np.float64) @ (b64.T if trans_b else b64)
    assert c.shape == (m, n)
    assert np.linalg.norm(c - expected) / np.linalg.norm(expected) < 1e-6
