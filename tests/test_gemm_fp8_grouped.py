"""Grouped (MoE) FP8 GEMM: the sm_90a and gfx950 kernels in the interpreter against float64 on
the dequantised operands for each scale kind (ragged and empty groups, odd N and K), input
errors, PTX / ISA checks and GPU runs."""

import re

import numpy as np
import pytest
from fp8_reference import assert_fp8_close, dequantized, quantized

import kiln
from kiln.kernels.gemm import compile_grouped_matmul, grouped_matmul
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
# scale kind -> (A's kind, each expert's B kind, how scale_b is passed)
KINDS = {"tensor": ("tensor", "tensor", "one"), "expert": ("tensor", "tensor", "per_expert"),
         "row_col": ("row", "col", "stack"), "block": ("block", "block", "stack")}


def _problem(rng, sizes, n, k, kind, dtype="f8e4m3"):
    """FP8 a, b ``[G, N, K]``, offsets, scales and the float64 dequantised operands."""
    a_kind, b_kind, passed = KINDS[kind]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a, sa = quantized(rng, int(offsets[-1]), k, a_kind, dtype)
    experts = [quantized(rng, n, k, b_kind, dtype, rows_per_block=128) for _ in sizes]
    if passed == "one":
        experts = [(b, experts[0][1]) for b, _ in experts]
        sb = experts[0][1]
    else:
        sb = np.array([s for _, s in experts], np.float32)
    b64 = [dequantized(b, s, b_kind, rows_per_block=128) for b, s in experts]
    b = np.stack([b for b, _ in experts])
    return a, b, offsets, sa, sb, dequantized(a, sa, a_kind), b64


def _check(c, offsets, a64, b64):
    assert not np.isnan(np.asarray(c, np.float64)).any()
    for g, bg in enumerate(b64):
        assert_fp8_close(c[offsets[g]:offsets[g + 1]], a64[offsets[g]:offsets[g + 1]], bg)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("sizes, n, k", [((0, 37, 130, 3), 203, 300), ((70, 64), 136, 128)])
def test_interpreter_matches_float64(kind, sizes, n, k, rng):
    a, b, offsets, sa, sb, a64, b64 = _problem(rng, sizes, n, k, kind)
    c = grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, scale_b=sb, out_dtype="f32",
                       target="sm_90a", backend="interpret")
    assert c.dtype == np.float32
    _check(c, offsets, a64, b64)


# make test runs each scale kind on one tile shape; the slow tier, which CI also runs, the rest.
@pytest.mark.parametrize("kind,block_m,block_n", [
    pytest.param(kind, *tile, id=f"{tile[0]}-{tile[1]}-{kind}",
                 marks=() if i == j else pytest.mark.slow)
    for i, kind in enumerate(["tensor", "row_col", "block"])
    for j, tile in enumerate([(64, 128), (64, 256), (128, 128)])])
def test_split_n_tiles_match_float64(kind, block_m, block_n, rng):
    """``split_n``: both consumers on a 64-row tile, each on half its columns (with block scales
    one B block each at 256 columns, both in one at 128); at ``block_m=128`` only the tail
    tiles of at most 64 rows (1 row, and 130 = 128 + 2), the 70-row tile split by rows: groups
    of 1..130 rows, an empty one, N not a multiple of the tile, 3 K steps; two CTAs walk all
    the tiles."""
    from kiln.kernels.gemm.fp8_grouped import grouped_fp8_constexprs, make_grouped_fp8_kernel
    from kiln.kernels.gemm.fp8_grouped_api import _grouped_scales
    from kiln.kernels.gemm.fp8_hopper import Fp8GemmConfig
    from kiln.kernels.gemm.grouped import table_size

    config = Fp8GemmConfig(block_m=block_m, block_n=block_n, stages=3, split_n=True)
    sizes, n, k = (70, 0, 1, 130), 392, 384
    a, b, offsets, sa, sb, a64, b64 = _problem(rng, sizes, n, k, kind)
    mode, sa_k, sb_k = _grouped_scales(sa, sb, len(sizes), int(offsets[-1]), n, k, a)
    c = np.full((int(offsets[-1]), n), np.nan, np.float32)
    make_grouped_fp8_kernel("f8e4m3", "f32", mode, config).interpret[(2,)](
        a, b.reshape(len(sizes) * n, k), c, c, offsets, sa_k, sb_k, len(sizes), c.shape[0], n,
        k, n, target="sm_90a", num_warps=config.num_warps,
        **grouped_fp8_constexprs(config, table_size(len(sizes))))
    _check(c, offsets, a64, b64)


def test_split_n_is_refused_where_it_has_no_code():
    from kiln.kernels.gemm.fp8_grouped import make_grouped_fp8_kernel
    from kiln.kernels.gemm.fp8_hopper import Fp8GemmConfig, make_fp8_kernel

    with pytest.raises(kiln.KilnValueError, match="split_n takes block_m=64"):
        Fp8GemmConfig(block_n=192, split_n=True)
    with pytest.raises(kiln.UnsupportedError, match="grouped-GEMM config"):
        make_fp8_kernel("f8e4m3", "bf16", ("tensor", "tensor"),
                        Fp8GemmConfig(block_m=64, block_n=256, split_n=True))
    with pytest.raises(kiln.UnsupportedError, match="one B scale block"):
        make_grouped_fp8_kernel("f8e4m3", "bf16", ("block", "block"),
                                Fp8GemmConfig(block_n=192))


def test_interpreter_e5m2_bf16_output(rng):
    a, b, offsets, sa, sb, a64, b64 = _problem(rng, (5, 60), 72, 160, "block", "f8e5m2")
    c = grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, scale_b=sb, target="sm_90a",
                       backend="interpret")
    assert c.dtype == kiln.bf16.numpy
    _check(c, offsets, a64, b64)


def test_bad_fp8_grouped_requests_raise_kiln_errors(rng):
    a, b, offsets, sa, sb, *_ = _problem(rng, (3, 5), 16, 32, "row_col")
    call = dict(target="sm_90a", backend="interpret")
    with pytest.raises(kiln.KilnValueError, match="FP8 inputs require scale_b"):
        grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, **call)
    with pytest.raises(kiln.KilnValueError, match="trans_b=True"):
        grouped_matmul(a, b.transpose(0, 2, 1), offsets, scale_a=sa, scale_b=sb, **call)
    with pytest.raises(kiln.KilnValueError, match="scale_b has shape"):
        grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, scale_b=sb[:, :3], **call)
    with pytest.raises(kiln.KilnValueError, match="block scales apply to both"):
        grouped_matmul(a, b, offsets, trans_b=True, scale_a=np.ones((8, 1), np.float32),
                       scale_b=sb, **call)
    with pytest.raises(kiln.UnsupportedError, match="gfx942 lacks"):
        grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, scale_b=sb, target="gfx942",
                       backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="cannot run gfx950 kernels"):
        grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, scale_b=sb, target="gfx950")
    with pytest.raises(kiln.KilnValueError, match="group_offsets decreases"):
        grouped_matmul(a, b, np.array([0, 6, 5], np.int32), trans_b=True, scale_a=1.0,
                       scale_b=1.0, **call)


@pytest.mark.parametrize("kind", ["tensor", "row_col", "block"])
def test_gfx950_interpreter_matches_float64(kind, rng):
    a, b, offsets, sa, sb, a64, b64 = _problem(rng, (0, 37, 130, 3), 203, 300, kind)
    c = grouped_matmul(a, b, offsets, trans_b=True, scale_a=sa, scale_b=sb, out_dtype="f32",
                       target="gfx950", backend="interpret")
    _check(c, offsets, a64, b64)


@pytest.mark.lower
@pytest.mark.parametrize("scales", [("row", "col"), ("block", "block")])
def test_gfx950_grouped_double_rate_mfma_no_scratch_waits_verified(scales):
    from kiln.lowering.isa_amdgpu import parse, verify_waits

    ck = compile_grouped_matmul("f8e4m3", target="gfx950", trans_b=True, groups=16,
                                scales=scales)
    asm = ck.asm["amdgcn"]
    assert ck.metadata["scratch_bytes"] == 0
    assert asm.count("v_mfma_f32_32x32x64_f8f6f4") == 8
    verify_waits(parse(asm, ck.name), ck.name)


@pytest.mark.lower
@pytest.mark.parametrize("scales", [("tensor", "tensor"), ("row", "col"), ("block", "block")])
def test_ptx_issues_fp8_wgmma_without_spills(scales):
    """128 x 128 tiles for every scale kind, promoted after each 128-K block (no WGMMA group
    kept in flight)."""
    ck = compile_grouped_matmul("f8e4m3", target="sm_90a", trans_b=True, groups=64,
                                scales=scales)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ck.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" not in re.sub(r"\s+", " ", ck.asm["ptx"])
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
    assert "setmaxnreg.inc.sync.aligned.u32 232" in re.sub(r"\s+", " ", ck.asm["ptx"])


def _torch_fp8(x, torch):
    fp8 = torch.float8_e4m3fn if x.dtype == kiln.f8e4m3.numpy else torch.float8_e5m2
    return torch.from_numpy(x.view(np.uint8)).to("cuda").view(fp8)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_matches_float64(kind, rng):
    torch = pytest.importorskip("torch")
    sizes = tuple(int(s) for s in rng.multinomial(3000, np.full(8, 1 / 8)))
    a, b, offsets, sa, sb, a64, b64 = _problem(rng, (0,) + sizes, 1000, 520, kind)
    scale = (lambda s: s if isinstance(s, float) else torch.from_numpy(s).to("cuda"))
    torch.empty(3000 * 1000, device="cuda").fill_(float("nan"))  # poison C's pool
    c = grouped_matmul(_torch_fp8(a, torch), _torch_fp8(b, torch),
                       torch.from_numpy(offsets).to("cuda"), trans_b=True, scale_a=scale(sa),
                       scale_b=scale(sb), out_dtype="f32")
    _check(c.cpu().numpy(), offsets, a64, b64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["expert", "row_col", "block"])
@pytest.mark.parametrize("block_m, block_n", [(64, 256), (128, 128)])
def test_gpu_split_n_tiles_match_float64(kind, block_m, block_n, rng):
    """``split_n`` tiles on the GPU: 64 x 256 (each consumer one B scale block with block
    scales) and 128 x 128 (tails of <= 64 rows split), ragged groups with an empty one,
    N = 1000 ending in a consumer's half."""
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm.fp8_grouped_api import _grouped_scales, run_grouped_fp8
    from kiln.kernels.gemm.fp8_hopper import Fp8GemmConfig

    sizes = (0,) + tuple(int(s) for s in rng.multinomial(3000, np.full(8, 1 / 8)))
    n, k = 1000, 512
    a, b, offsets, sa, sb, a64, b64 = _problem(rng, sizes, n, k, kind)
    mode, sa_k, sb_k = _grouped_scales(sa, sb, len(sizes), 3000, n, k, a)
    device = (lambda x: torch.from_numpy(np.ascontiguousarray(
        np.reshape(x, np.shape(x) or (1,)), np.float32)).to("cuda"))
    c = torch.full((3000, n), float("nan"), device="cuda", dtype=torch.float32)
    run_grouped_fp8(_torch_fp8(a, torch), _torch_fp8(b, torch).reshape(len(sizes) * n, k), c,
                    torch.from_numpy(offsets).to("cuda"), device(sa_k), device(sb_k), mode=mode,
                    k=k, config=Fp8GemmConfig(block_m=block_m, block_n=block_n, stages=4,
                                              split_n=True))
    _check(c.cpu().numpy(), offsets, a64, b64)
