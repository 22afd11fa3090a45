"""Hopper GEMM tiles of 96, 160 and 224 columns (odd multiples of 32; B stored N x K): their
bf16/f16 C is staged in 32-column tiles under the 64-byte swizzle. Interpreter runs on odd
shapes against float64 with NaN-poisoned outputs, the PTX, the config checks, and a GPU run
(``gpu``)."""

import re

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close, check_config_on_gpu

import kiln
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul_config
from kiln.kernels.gemm.hopper import make_kernel
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
C = HopperGemmConfig
CONFIGS = {
    "128x160": C(block_n=160),
    "128x96": C(block_n=96, stages=6),
    "64x224": C(block_m=64, block_n=224, stages=4),
    # 224 columns next to 4 stages leave room for one 32-column staging tile per round
    "128x224_rounds": C(block_n=224, stages=4),
    "128x160_pair": C(block_n=160, cluster_m=2),
    "128x160_stream_k": C(block_n=160, stream_k=True),
    "128x160_split3_fused": C(block_n=160, split_k=3, fused_reduce=True),
}
# M and N off the tile grid (a ragged last column tile: N = 330 is 2 tiles of 160 and 10
# columns), K = 520: 9 K steps (uneven stream-K / split-K pieces)
SHAPES = [(130, 330, 520), (256, 200, 72), (1, 100, 136)]


# make test runs four configs on the first shape; the slow tier, which CI also runs, the rest.
FAST_CONFIGS = ("128x160", "128x96", "128x160_pair", "128x160_split3_fused")


@pytest.mark.parametrize("name,shape", [
    pytest.param(name, shape, id=f"{'x'.join(map(str, shape))}-{name}",
                 marks=() if shape == SHAPES[0] and name in FAST_CONFIGS else pytest.mark.slow)
    for name in CONFIGS for shape in SHAPES])
def test_interpreted_odd_width_tiles_match_float64(name, shape, rng):
    config = CONFIGS[name]
    m, n, k = shape
    if config.cluster_m == 2 and -(-m // config.block_m) % 2:
        m = 256  # the interpreter launches one CTA per tile: whole pairs
    dtype, out = (np.float16, "f16") if m % 2 else (ml_dtypes.bfloat16, "bf16")
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k)).astype(dtype)
    # numpy outputs start as NaN: an element never stored fails the check
    c = matmul_config(a, b, config, trans_b=True, out_dtype=out, target="sm_90a",
                      backend="interpret")
    assert c.dtype == dtype
    assert_matmul_close(c, a, b.T)


def test_interpreted_odd_width_f32_output_keeps_128_byte_staging(rng):
    a = rng.standard_normal((70, 136)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((150, 136)).astype(ml_dtypes.bfloat16)
    c = matmul_config(a, b, C(block_n=160), trans_b=True, out_dtype="f32", target="sm_90a",
                      backend="interpret")
    assert_matmul_close(c, a, b.T)


@pytest.mark.lower
@pytest.mark.parametrize("block_n", [96, 160, 224])
def test_ptx_runs_one_wgmma_of_the_tile_width(block_n):
    ptx = compile_matmul("bf16", target="sm_90a", trans_b=True, block_n=block_n,
                         stages=3).asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)) == \
        {f"m64n{block_n}k16"}


def test_staging_tiles_and_c_map_swizzle():
    assert C(block_n=160).staging_columns(2) == 32
    assert C(block_n=160).staging_columns(4) == 32  # f32: 128-byte rows already
    assert C(block_n=192).staging_columns(2) == 64
    assert C(block_n=224, stages=4).epilogue_columns(2) == 32  # one tile per round
    c_map = make_kernel("bf16", "bf16", "k", C(block_n=160)).params[2].spec
    assert (c_map.box, c_map.swizzle) == ((64, 32), 64)
    c_map = make_kernel("bf16", "bf16", "k", C(block_n=192)).params[2].spec
    assert (c_map.box, c_map.swizzle) == ((64, 64), 128)


def test_odd_widths_need_k_major_b_and_32_column_steps():
    HopperGemmConfig(block_n=96)  # a valid config; the B layout is checked at compile time
    with pytest.raises(kiln.UnsupportedError, match="block_n=160 needs B stored N x K"):
        compile_matmul("bf16", target="sm_90a", block_n=160)
    with pytest.raises(kiln.UnsupportedError, match="multiple of 32"):
        HopperGemmConfig(block_n=80)
    with pytest.raises(kiln.UnsupportedError, match="block_n=32"):
        HopperGemmConfig(block_n=32)  # whole-tile C needs 64 columns at least


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["128x160", "128x96", "128x224_rounds", "128x160_pair"])
# run_hopper takes TMA-aligned operands (rows of 16 bytes: N and K multiples of 8); 344
# columns are two tiles of 160 and 24 columns
@pytest.mark.parametrize("shape", [(256, 10240, 1000), (1000, 1000, 520), (100, 344, 72)],
                         ids=lambda s: "x".join(map(str, s)))
def test_odd_width_tiles_on_the_gpu(name, shape, rng):
    pytest.importorskip("torch")
    check_config_on_gpu(CONFIGS[name], shape, rng)
