"""gfx950 MFMA GEMM: no scratch, exactly the MFMAs per K step that the tile shape implies (all
inside the K loop), config invariants, and results in Kiln's interpreter (no AMD GPU here)."""

import re

import numpy as np
import pytest
from gemm_reference import assert_matmul_close

import kiln
from kiln.kernels.gemm.gfx950 import GemmConfig, compile_gfx950, make_kernel


def _loop_bodies(asm: str) -> list[str]:
    """Text of each backward-branching block range ``.LBB_x: ... s_cbranch/s_branch .LBB_x``."""
    bodies = []
    for label in re.findall(r"^(\.LBB\d+_\d+):", asm, re.M):
        start = asm.index(label + ":")
        back = re.search(rf"s_c?branch\w* {re.escape(label)}\n", asm[start:])
        if back:
            bodies.append(asm[start:start + back.end()])
    return bodies


CONFIGS = [GemmConfig(), GemmConfig(feed="dma"), GemmConfig(b_layout="kn"),
           GemmConfig(b_layout="kn", feed="dma", block_n=64, warps_n=1),
           GemmConfig(block_m=128, block_n=128, warps_m=4, warps_n=2),
           GemmConfig(block_m=256, block_n=128, warps_m=4, warps_n=2, out_dtype="f32")]


@pytest.mark.lower
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.slow
def test_gemm_has_no_scratch_and_the_implied_mfma_count(dtype, config):
    compiled = compile_gfx950(dtype, config=config)
    asm = compiled.asm["amdgcn"]
    assert compiled.metadata["scratch_bytes"] == 0
    assert re.search(r"\.private_segment_fixed_size:\s+0\b", asm)
    mfma = f"v_mfma_f32_32x32x16_{dtype}"
    implied = (config.block_m // 32) * (config.block_n // 32) * (config.block_k // 16) \
        // config.num_warps
    assert config.mfmas_per_k_step == implied
    loops = [body for body in _loop_bodies(asm) if mfma in body]
    assert len(loops) == 1, "all MFMAs belong to one K loop"
    assert loops[0].count(mfma) == implied == asm.count(mfma)
    assert compiled.metadata["lds_bytes"] == config.lds_bytes
    pieces_per_step = (config.block_m + config.block_n) // (8 * config.num_warps)
    if config.feed == "dma":  # the prologue's and the loop's prefetch (in a branch of the loop)
        assert len(re.findall(r"buffer_load_dwordx4 .* lds\n", asm)) == 2 * pieces_per_step
    else:
        assert loops[0].count("ds_write_b128") == pieces_per_step
    assert "s_setprio 1" in loops[0] and "s_barrier" in loops[0]
    wave_tiles_n = config.block_n // config.warps_n // 32
    reads_per_step = (config.block_k // 16) * wave_tiles_n * 2  # two tr16 halves per fragment
    assert loops[0].count("ds_read_b64_tr_b16") == (reads_per_step if config.b_layout == "kn"
                                                     else 0)


def test_config_invariants():
    with pytest.raises(kiln.KilnValueError, match="block_k=32 must be 64"):
        GemmConfig(block_k=32)
    with pytest.raises(kiln.KilnValueError, match="multiple of warps_m"):
        GemmConfig(block_m=96)
    with pytest.raises(kiln.KilnValueError, match="feed='tma'"):
        GemmConfig(feed="tma")
    with pytest.raises(kiln.KilnValueError, match="b_layout='mn'"):
        GemmConfig(b_layout="mn")
    with pytest.raises(kiln.KilnValueError, match="block_n=1024 must divide 512"):
        GemmConfig(block_n=1024, warps_n=4, b_layout="kn")
    with pytest.raises(kiln.KilnValueError, match="LDS exceed"):
        GemmConfig(block_m=512, block_n=512, warps_m=4, warps_n=4)


def test_compile_rejects_unsupported_inputs():
    with pytest.raises(kiln.UnsupportedError, match="does not support f32"):
        compile_gfx950("f32")
    with pytest.raises(kiln.UnsupportedError, match="gfx942 lacks"):
        compile_gfx950("bf16", target="gfx942")


@pytest.mark.parametrize("config", CONFIGS[:4], ids=repr)
def test_gemm_matches_numpy_in_the_interpreter(config, rng):
    """Shapes off the tile grid; bf16 inputs, f64 reference; NaN-poisoned output."""
    m, n, k = 133, 144 if config.b_layout == "kn" else 140, 200
    a = rng.standard_normal((m, k)).astype(kiln.bf16.numpy)
    b_nk = rng.standard_normal((n, k)).astype(kiln.bf16.numpy)
    b = b_nk if config.b_layout == "nk" else np.ascontiguousarray(b_nk.T)
    c = np.full((m, n), np.nan, np.float32).astype(kiln.bf16.numpy)
    grid = (-(-m // config.block_m) * -(-n // config.block_n),)
    make_kernel("bf16", config).interpret[grid](a, b, c, m, n, k, num_warps=config.num_warps,
                                                target="gfx950")
    assert_matmul_close(c, a, b_nk.T)
