"""The FP8 GEMM (sm_90a WGMMA e4m3/e5m2; scales of kiln.kernels.gemm.scales): compile-only
checks, the interpreter against float64 on the dequantised operands, input errors, GPU runs."""

import re

import numpy as np
import pytest
from fp8_reference import assert_fp8_close, dequantized, fp8_tolerance, quantized

import kiln
from kiln.kernels.gemm import compile_matmul, matmul
from kiln.kernels.gemm.fp8_api import BLOCK_CONFIGS, SCALED_CONFIGS, run_fp8
from kiln.kernels.gemm.fp8_hopper import Fp8GemmConfig
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
# (scale_a kind, scale_b kind) -> how B's scale is drawn (rows per block)
MODES = {"tensor": ("tensor", "tensor"), "row_col": ("row", "col"),
         "tensor_col": ("tensor", "col"), "block": ("block", "block")}


def _operands(rng, m, n, k, modes, dtype="f8e4m3"):
    a, sa = quantized(rng, m, k, modes[0], dtype)
    b, sb = quantized(rng, n, k, modes[1], dtype, rows_per_block=128)
    a64 = dequantized(a, sa, modes[0])
    b64 = dequantized(b, sb, modes[1], rows_per_block=128)
    return a, b, sa, sb, a64, b64


def _interpret_f32_output(rng, m, n, k, scales, config):
    """The FP8 kernel of ``config`` in the interpreter on four CTAs, f32 output NaN-poisoned,
    against float64 of the dequantised operands."""
    from kiln.kernels import runtime
    from kiln.kernels.gemm.fp8_hopper import fp8_constexprs, make_fp8_kernel

    a, b, sa, sb, a64, b64 = _operands(rng, m, n, k, scales)
    sa = np.array([sa], np.float32) if isinstance(sa, float) else sa
    sb = np.array([sb], np.float32) if isinstance(sb, float) else sb
    c = np.full((m, n), np.nan, np.float32)
    runtime.interpret(make_fp8_kernel("f8e4m3", "f32", scales, config), (4, 1, 1),
                      [a, b, c, sa, sb, m, n, k], target="sm_90a", num_warps=config.num_warps,
                      **fp8_constexprs(config))
    assert_fp8_close(c, a64, b64)


@pytest.mark.lower
@pytest.mark.parametrize("dtype", ["f8e4m3", "f8e5m2"])
@pytest.mark.parametrize("scales", [("tensor", "tensor"), ("block", "block")])
def test_ptx_issues_fp8_wgmma_without_spills(dtype, scales):
    """The default config of each scale kind (the tuner's first): its WGMMA width, TMA loads,
    consumer registers, and no spills."""
    from kiln.kernels.gemm.fp8_api import default_config

    config = default_config(scales)
    ck = compile_matmul(dtype, target="sm_90a", trans_b=True, scales=scales)
    ptx = ck.asm["ptx"]
    kind = dtype[2:]
    assert f"wgmma.mma_async.sync.aligned.m64n{config.block_n}k32.f32.{kind}.{kind}" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 {config.consumer_registers}" in \
        re.sub(r"\s+", " ", ptx)
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0


@pytest.mark.lower
@pytest.mark.parametrize("scales, config", [
    (("tensor", "col"), Fp8GemmConfig(cluster_m=2)),
    (("block", "block"), Fp8GemmConfig(block_n=128, stages=5, cluster_m=2))],
    ids=["col", "block"])
def test_interpreter_cta_pairs_multicast_b(scales, config, rng):
    """2-CTA clusters (B halves multicast, stages released on both CTAs) on 2 pair tiles of
    rows, the second pair partly past M; NaN-poisoned C."""
    m, n, k = 300, 208, 272
    _interpret_f32_output(rng, m, n, k, scales, config)
    ptx = compile_matmul("f8e4m3", target="sm_90a", trans_b=True, scales=scales,
                         **vars(config)).asm["ptx"]
    assert ".multicast::cluster" in ptx and "mapa" in ptx


@pytest.mark.lower
@pytest.mark.parametrize("scales, overlap, tile_n", [
    pytest.param(("block", "block"), 4, 128, marks=pytest.mark.slow),  # block2n192 is fast
    (("tensor", "col"), 8, 128),
    (("row", "tensor"), 2, 128),
    (("block", "block"), 2, 192),
    pytest.param(("tensor", "col"), 4, 192, marks=pytest.mark.slow)],
    ids=["block4", "col8", "row2", "block2n192", "col4n192"])
def test_interpreter_two_accumulator_groups(scales, overlap, tile_n, rng):
    """``overlap_steps`` groups on two accumulators (two half-width ones on 192 columns): 10
    K steps (the last partial) are whole groups and a one-accumulator remainder (2 for groups
    of 4 and 8, none for 2); a second tile row past M; NaN-poisoned C. The PTX keeps every
    WGMMA asynchronous (no ptxas serialisation: nothing is in flight across the loop's back
    edge)."""
    m, n, k = 190, 136 if tile_n == 128 else 424, 1168
    config = Fp8GemmConfig(block_n=tile_n, stages=4, overlap_steps=overlap,
                           **({} if tile_n == 128 else dict(producer_registers=24,
                                                            consumer_registers=240)))
    _interpret_f32_output(rng, m, n, k, scales, config)
    ck = compile_matmul("f8e4m3", target="sm_90a", trans_b=True, scales=scales, **vars(config))
    if tile_n == 128 or overlap == 2 and scales[0] != "block":  # else ptxas spills a little
        assert ck.metadata["spill_bytes"] == 0
    assert "wgmma.wait_group.sync.aligned 1;" in re.sub(r"[ \t]+", " ", ck.asm["ptx"])


@pytest.mark.lower
@pytest.mark.parametrize("config", [  # n192 and n64: the slow tier, which CI also runs
    pytest.param(Fp8GemmConfig(block_n=192, stages=4, producer_registers=24,
                               consumer_registers=240), marks=pytest.mark.slow),
    pytest.param(Fp8GemmConfig(block_n=64, stages=4, overlap_steps=2), marks=pytest.mark.slow),
    Fp8GemmConfig(block_n=192, stages=3, cluster_m=2, producer_registers=24,
                  consumer_registers=240),
    Fp8GemmConfig(block_m=192, block_n=128, stages=4, producer_registers=24,
                  consumer_registers=160)], ids=["n192", "n64", "n192pair", "m192"])
def test_interpreter_block_scales_on_tiles_straddling_b_blocks(config, rng):
    """Block scales on tiles whose columns straddle two 128-column B scale blocks (tiles at
    N 0, 192 and 384 start on either half of a block; N ends mid-block) and on three consumer
    warp groups; NaN-poisoned C against float64, and no spills (pairs spill a little)."""
    m, n, k = 200, 424, 400
    scales = ("block", "block")
    _interpret_f32_output(rng, m, n, k, scales, config)
    ck = compile_matmul("f8e4m3", target="sm_90a", trans_b=True, scales=scales, **vars(config))
    if config.cluster_m == 1:  # a pair's multicast addresses push 192 columns past 240
        assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0


@pytest.mark.lower
@pytest.mark.parametrize("scales", [("block", "block"), ("tensor", "tensor"), ("row", "col")])
@pytest.mark.parametrize("overlap", [1, 2])
def test_every_scale_kind_promotes_after_each_k_block(scales, overlap):
    """Hopper's FP8 tensor cores accumulate with ~14 mantissa bits, so every scale kind waits
    for each 128-K step's WGMMAs, the first of the four starting a fresh accumulator, and adds
    them to an f32 register total: with one accumulator none is kept in flight (wait_group 0;
    four WGMMAs in the loop); with two, a group of steps keeps the next step in flight while
    promoting (wait_group 1; four WGMMAs per step of the group and of the remainder loop)."""
    config = dict(block_n=128, stages=6, overlap_steps=overlap)
    ptx = re.sub(r"\s+", " ", compile_matmul("f8e4m3", target="sm_90a", trans_b=True,
                                             scales=scales, **config).asm["ptx"])
    assert ("wgmma.wait_group.sync.aligned 1;" in ptx) == (overlap > 1)
    assert "wgmma.wait_group.sync.aligned 0;" in ptx
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n") == 4 * (overlap + (overlap > 1))


class _OutOfRange:
    """An rng whose normals are 10 and whose scales are the smallest drawn (0.01): every
    ``x / s = 1000`` lies past e4m3's largest finite value (448)."""

    def standard_normal(self, shape):
        return np.full(shape, 10.0)

    def uniform(self, low, high, size=None):
        return low if size is None else np.full(size, low)


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_quantized_operands_saturate_instead_of_nan(mode):
    """The GPU's NaN rows/columns of C came from the test operands: a plain cast of
    ``|x / s| > 448`` to e4m3 (no infinity) is NaN, which the GEMM spreads over a row of C."""
    a, sa = quantized(_OutOfRange(), 3, 200, mode, "f8e4m3")
    assert (a.astype(np.float64) == 448).all()
    assert not np.isnan(dequantized(a, sa, mode)).any()


def test_error_model_catches_a_dropped_block_a_wrong_scale_and_a_shifted_tile(rng):
    """fp8_tolerance (the tensor core's ~14-bit in-block accumulation) is loose enough for the
    hardware yet flags most elements of each typical bug."""
    a, b, sa, sb, a64, b64 = _operands(rng, 200, 150, 1000, ("row", "col"))
    want = a64 @ b64.T
    tolerance = fp8_tolerance(want, a64, b64, "float32")
    wrong = {"dropped K block": want - a64[:, 128:256] @ b64[:, 128:256].T,
             "scale of the next row": dequantized(a, np.roll(sa, 1), "row") @ b64.T,
             "tile shifted a row": np.roll(want, 1, axis=0)}
    for what, c in wrong.items():
        assert (np.abs(c - want) > tolerance).mean() > 0.5, what
    assert (np.abs(a64.astype(np.float32) @ b64.astype(np.float32).T - want) <= tolerance).all()


def test_config_refuses_block_n_past_the_register_budget():
    with pytest.raises(kiln.KilnValueError, match="up to 192"):
        Fp8GemmConfig(block_n=256)
    with pytest.raises(kiln.KilnValueError, match="overlap_steps=3 must be 1, 2, 4 or 8"):
        Fp8GemmConfig(block_n=128, overlap_steps=3)
    with pytest.raises(kiln.KilnValueError, match="exceed the 65536 registers"):
        Fp8GemmConfig(block_m=192, block_n=128)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", [(130, 203, 300), (64, 72, 128), (7, 264, 520)])
def test_interpreter_matches_float64(mode, shape, rng):
    m, n, k = shape
    a, b, sa, sb, a64, b64 = _operands(rng, m, n, k, MODES[mode])
    c = matmul(a, b, scale_a=sa, scale_b=sb, trans_b=True, out_dtype="f32", target="sm_90a",
               backend="interpret")
    assert c.dtype == np.float32  # NaN-poisoned by the entry point: every element written
    assert_fp8_close(c, a64, b64)


@pytest.mark.parametrize("dtype", ["f8e4m3", "f8e5m2"])
def test_interpreter_bf16_output_and_e5m2(dtype, rng):
    a, b, sa, sb, a64, b64 = _operands(rng, 100, 136, 260, ("block", "block"), dtype)
    c = matmul(a, b, scale_a=sa, scale_b=sb, trans_b=True, target="sm_90a",
               backend="interpret")
    assert c.dtype == kiln.bf16.numpy
    assert_fp8_close(c, a64, b64)


def test_scalar_scales_as_zero_d_arrays(rng):
    a, b, sa, sb, a64, b64 = _operands(rng, 65, 64, 160, ("tensor", "tensor"))
    c = matmul(a, b, scale_a=np.float32(sa).reshape(()), scale_b=np.array([sb], np.float32),
               trans_b=True, out_dtype="f32", target="sm_90a", backend="interpret")
    assert_fp8_close(c, a64, b64)


def test_bad_fp8_requests_raise_kiln_errors(rng):
    a, b, sa, sb, *_ = _operands(rng, 130, 200, 300, ("row", "col"))
    with pytest.raises(kiln.KilnValueError, match="FP8 inputs require scale_a"):
        matmul(a, b, trans_b=True, backend="interpret", target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="trans_b=True"):
        matmul(a, b.T, scale_a=sa, scale_b=sb, backend="interpret", target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="trans_b=True"):
        compile_matmul("f8e4m3", target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="scale_b has shape"):
        matmul(a, b, scale_a=sa, scale_b=sb[:-1], trans_b=True, backend="interpret",
               target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="float32"):
        matmul(a, b, scale_a=sa.astype(np.float64), scale_b=sb, trans_b=True,
               backend="interpret", target="sm_90a")
    block_a = np.ones((130, 3), np.float32)
    with pytest.raises(kiln.KilnValueError, match="block scales apply to both"):
        matmul(a, b, scale_a=block_a, scale_b=sb, trans_b=True, backend="interpret",
               target="sm_90a")
    with pytest.raises(kiln.UnsupportedError, match="cannot write f16"):
        matmul(a, b, scale_a=sa, scale_b=sb, trans_b=True, out_dtype="f16",
               backend="interpret", target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="share an FP8 dtype"):
        matmul(a, b.astype(np.float32), scale_a=sa, scale_b=sb, trans_b=True,
               backend="interpret", target="sm_90a")
    bf16 = np.ones((4, 8), kiln.bf16.numpy)
    with pytest.raises(kiln.KilnValueError, match="apply to FP8 inputs"):
        matmul(bf16, bf16, scale_a=1.0, scale_b=1.0, trans_b=True, backend="interpret",
               target="sm_90a")


def test_k_zero_gives_zeros_without_a_launch():
    a = np.zeros((5, 0), kiln.f8e4m3.numpy)
    b = np.zeros((6, 0), kiln.f8e4m3.numpy)
    c = matmul(a, b, scale_a=1.0, scale_b=1.0, trans_b=True, backend="interpret",
               target="sm_90a")
    assert c.shape == (5, 6) and not c.astype(np.float32).any()


# ---- GPU ------------------------------------------------------------------------------------

def _to_torch(x, torch):
    """A numpy array (FP8 through its bytes) as a CUDA tensor."""
    if isinstance(x, float):
        return x
    if x.dtype.itemsize == 1:
        fp8 = torch.float8_e4m3fn if x.dtype == kiln.f8e4m3.numpy else torch.float8_e5m2
        return torch.from_numpy(x.view(np.uint8)).to("cuda").view(fp8)
    return torch.from_numpy(x).to("cuda")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (257, 517, 136), (4096, 4096, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_gpu_matches_float64(mode, shape, out, rng):
    torch = pytest.importorskip("torch")
    m, n, k = shape
    a, b, sa, sb, a64, b64 = _operands(rng, m, n, k, MODES[mode])
    torch.empty(m * n, device="cuda").fill_(float("nan"))  # poison the pool C comes from
    c = matmul(*(_to_torch(x, torch) for x in (a, b)), scale_a=_to_torch(sa, torch),
               scale_b=_to_torch(sb, torch), trans_b=True, out_dtype=out)
    assert_fp8_close(c, a64, b64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("scales,config", [
    *((scales, c) for c in SCALED_CONFIGS for scales in (("tensor", "col"), ("row", "tensor"))),
    *((("block", "block"), c) for c in BLOCK_CONFIGS)],
    ids=lambda x: f"{x.block_m}x{x.block_n}s{x.stages}c{x.cluster_m}o{x.overlap_steps}"
    if hasattr(x, "stages") else x[0])
def test_gpu_each_config_with_poisoned_output(scales, config, rng):
    torch = pytest.importorskip("torch")
    m, n, k = 777, 1000, 1040
    a, b, sa, sb, a64, b64 = _operands(rng, m, n, k, scales)
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
    args = [_to_torch(x, torch) for x in (a, b)]
    sa_t, sb_t = (torch.tensor([s], device="cuda", dtype=torch.float32)
                  if isinstance(s, float) else _to_torch(s, torch) for s in (sa, sb))
    run_fp8(*args, c, sa_t, sb_t, m, n, k, dtype="f8e4m3", out="f32", mode=scales,
            target="sm_90a", config=config)
    assert_fp8_close(c, a64, b64)


@pytest.mark.gpu
@needs_gpu
def test_gpu_per_tensor_agrees_with_torch_scaled_mm(rng):
    """cuBLAS (``use_fast_accum=False``) promotes the tensor-core accumulator too: both lie
    within the FP8 error model of the float64 result, within twice it of each other, and ours
    is on average about as accurate (an unpromoted K loop errs several times more)."""
    torch = pytest.importorskip("torch")
    a, b, sa, sb, a64, b64 = _operands(rng, 2048, 1536, 1024, ("tensor", "tensor"))
    a_t, b_t = _to_torch(a, torch), _to_torch(b, torch)
    sa_t, sb_t = (torch.tensor(s, device="cuda", dtype=torch.float32) for s in (sa, sb))
    ours = matmul(a_t, b_t, scale_a=sa_t, scale_b=sb_t, trans_b=True, out_dtype="f32")
    theirs = torch._scaled_mm(a_t, b_t.t(), scale_a=sa_t, scale_b=sb_t,
                              out_dtype=torch.float32)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs  # (out, amax) before torch 2.5
    ours, theirs = assert_fp8_close(ours, a64, b64), assert_fp8_close(theirs, a64, b64)
    want = a64 @ b64.T
    assert (np.abs(ours - theirs) <= 2 * fp8_tolerance(want, a64, b64, "float32")).all()
    assert np.abs(ours - want).mean() <= 2 * np.abs(theirs - want).mean() + 1e-6


# ---- gfx950 (MFMA f8f6f4): ISA checks and the interpreter -----------------------------------

def _k_loop(asm: str, mnemonic: str) -> str:
    """The one backward-branching block range that holds ``mnemonic`` (the K loop)."""
    loops = []
    for label in re.findall(r"^(\.LBB\d+_\d+):", asm, re.M):
        start = asm.index(label + ":")
        back = re.search(rf"s_c?branch\w* {re.escape(label)}\n", asm[start:])
        if back and mnemonic in asm[start:start + back.end()]:
            loops.append(asm[start:start + back.end()])
    assert len(loops) == 1, f"{len(loops)} loops issue {mnemonic}"
    return loops[0]


@pytest.mark.lower
@pytest.mark.parametrize("scales", [("tensor", "tensor"), ("row", "col"), ("block", "block")])
@pytest.mark.parametrize("dtype", ["f8e4m3", "f8e5m2"])
def test_gfx950_double_rate_mfma_no_scratch_waits_verified(scales, dtype):
    from kiln.lowering.isa_amdgpu import parse, verify_waits

    ck = compile_matmul(dtype, target="gfx950", trans_b=True, scales=scales)
    asm = ck.asm["amdgcn"]
    assert ck.metadata["scratch_bytes"] == 0
    assert re.search(r"\.private_segment_fixed_size:\s+0\b", asm)
    mfma = "v_mfma_f32_32x32x64_f8f6f4"
    loop = _k_loop(asm, mfma)
    # 128 x 128 x 128 per K step over 2 x 2 waves: 2 x 2 tiles x 2 k64 steps, all in the loop
    assert loop.count(mfma) == asm.count(mfma) == 8
    assert loop.count("ds_read_b128") == 2 * 2 * (2 + 2)  # two 16-byte halves per fragment
    assert "s_barrier" in loop and "s_setprio 1" in loop
    verify_waits(parse(asm, ck.name), ck.name)


@pytest.mark.parametrize("mode", list(MODES))
def test_gfx950_interpreter_matches_float64(mode, rng):
    m, n, k = 133, 140, 300
    a, b, sa, sb, a64, b64 = _operands(rng, m, n, k, MODES[mode])
    c = matmul(a, b, scale_a=sa, scale_b=sb, trans_b=True, out_dtype="f32", target="gfx950",
               backend="interpret")
    assert_fp8_close(c, a64, b64)


def test_gfx950_e5m2_bf16_output(rng):
    a, b, sa, sb, a64, b64 = _operands(rng, 70, 200, 136, ("block", "block"), "f8e5m2")
    c = matmul(a, b, scale_a=sa, scale_b=sb, trans_b=True, target="gfx950",
               backend="interpret")
    assert c.dtype == kiln.bf16.numpy
    assert_fp8_close(c, a64, b64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("scales", [("tensor", "tensor"), ("block", "block")], ids=str)
def test_gpu_repeat_call_takes_the_bound_plan(scales, rng):
    """The second call of a shape class (fresh operands and scales) is a bound launch."""
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm import fp8_api

    m, n, k = 384, 520, 384
    results = []
    for _ in range(2):
        a, b, sa, sb, a64, b64 = _operands(rng, m, n, k, scales)
        sa_t, sb_t = (torch.tensor(s, device="cuda", dtype=torch.float32)
                      if isinstance(s, float) else _to_torch(s, torch) for s in (sa, sb))
        builds = fp8_api._PLANS.builds
        torch.empty(m * n, device="cuda").fill_(float("nan"))
        c = matmul(_to_torch(a, torch), _to_torch(b, torch), scale_a=sa_t, scale_b=sb_t,
                   trans_b=True)
        results.append(fp8_api._PLANS.builds - builds)
        assert_fp8_close(c, a64, b64)
    assert results == [1, 0]
