"""Prefill at every head dim (multiples of 8 up to 256, V's head dim apart from Q/K's) and with
Gemma-2 soft-capping: interpreter runs against the float64 reference, input checks, compile
checks, and GPU runs held to FlashAttention's acceptance rule (error at most twice a bf16
PyTorch implementation's)."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import (assert_attention_close, attention_reference, poison_cuda_pool,
                                 random_qkv, visible_keys)
from kiln.kernels.attention.prefill import compile_prefill, prefill
from kiln.kernels.attention.prefill_config import SHARED_BUDGET, HopperPrefillConfig
from kiln.nvidia.fastmath import TANH_APPROX_REL_ERROR
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
TARGETS = ("sm_90a", "gfx950")


def _check(rng, target, *, d, dv=None, sq, sk, hq=2, hkv=1, softcap=None, batch=1, ragged=None,
           **mask):
    lengths_q, lengths_k = ragged if ragged else (None, None)
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=batch, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=dv,
                                     ragged_q=lengths_q, ragged_k=lengths_k)
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    o, lse = prefill(q, k, v, softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                     return_lse=True, backend="interpret", target=target, **mask)
    assert o.shape == (*q.shape[:-1], v.shape[-1]) and o.dtype == q.dtype
    assert_attention_close(o, q, k, v, lse=lse, softcap=softcap, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, **mask)
    return q, k, v, o


# (d, dv, mask): odd widths (8 mod 16, below one box, past one box), DeepSeek's 192/128, V
# wider than Q/K.
DIM_CASES = {
    "d8": (8, None, dict(causal=True)),
    "d40_window": (40, None, dict(window=(20, 7))),
    "d72_gqa": (72, None, dict(causal=True)),
    "d96": (96, None, dict()),
    "d96_causal": (96, None, dict(causal=True)),  # sm_90a: 64-key tiles, skip_masked_tiles
    "d136_chunk": (136, None, dict(chunk=33)),
    "d192_v128_causal": (192, 128, dict(causal=True)),
    "d64_v104": (64, 104, dict(causal=True, window=(30, -1))),
}


# Each case runs on one target in the fast tier (alternating; DeepSeek's shape on both) and on
# the other in the slow tier.
FAST_DIM_CASES = {("d8", "sm_90a"), ("d40_window", "gfx950"), ("d72_gqa", "sm_90a"),
                  ("d96", "gfx950"), ("d96_causal", "sm_90a"), ("d136_chunk", "gfx950"),
                  ("d192_v128_causal", "sm_90a"), ("d192_v128_causal", "gfx950"),
                  ("d64_v104", "sm_90a")}


@pytest.mark.parametrize("name,target", [
    pytest.param(name, target, id=f"{name}-{target}",
                 marks=() if (name, target) in FAST_DIM_CASES else pytest.mark.slow)
    for name in DIM_CASES for target in TARGETS])
def test_head_dims_match_the_reference(name, target, rng):
    d, dv, mask = DIM_CASES[name]
    _check(rng, target, d=d, dv=dv, sq=37, sk=75, hq=4, hkv=2, **mask)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("d,dv", [(24, None), (120, 56), (200, None), (256, 8), (248, 248)])
def test_more_head_dims_match_the_reference(d, dv, target, rng):
    _check(rng, target, d=d, dv=dv, sq=300, sk=301, hq=2, hkv=1, causal=True, window=(150, 3))
    _check(rng, target, d=d, dv=dv, sq=None, sk=None, hq=3, hkv=1,
           ragged=([1, 130, 67], [200, 1, 99]), batch=3)


# One cap and head dim per target here; the crossed pairs (2-3 s each) in the slow tier.
@pytest.mark.parametrize("softcap,d,target", [
    (3.0, 64, "sm_90a"), (1.5, 96, "gfx950"),
    pytest.param(3.0, 64, "gfx950", marks=pytest.mark.slow),
    pytest.param(1.5, 96, "sm_90a", marks=pytest.mark.slow)])
def test_softcap_matches_the_reference(softcap, d, target, rng):
    q, k, v, o = _check(rng, target, d=d, sq=29, sk=91, hq=2, hkv=1, softcap=softcap,
                        causal=True, scale=0.5)
    # The cap changes the result by far more than the tolerance: without it, it would fail.
    uncapped = attention_reference(q, k, v, causal=True, scale=0.5)
    assert np.abs(o.astype(np.float64) - uncapped).max() > 0.05


@pytest.mark.parametrize("softcap", [0.0, None])
def test_softcap_off_is_the_plain_kernel(softcap, rng):
    _check(rng, "sm_90a", d=64, sq=20, sk=40, softcap=softcap)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "3", True, [2.0]])
def test_bad_softcap_is_refused(bad):
    x = np.zeros((1, 4, 1, 64), ml_dtypes.bfloat16)
    with pytest.raises(kiln.KilnValueError, match="softcap"):
        prefill(x, x, x, softcap=bad, backend="interpret")


@pytest.mark.parametrize("shapes,match", [
    (((1, 4, 1, 100), (1, 4, 1, 100), (1, 4, 1, 100)), "multiple of 8"),
    (((1, 4, 1, 264), (1, 4, 1, 264), (1, 4, 1, 264)), "multiple of 8"),
    (((1, 4, 1, 64), (1, 4, 1, 96), (1, 4, 1, 64)), "head dim"),
    (((1, 4, 1, 64), (1, 4, 1, 64), (1, 5, 1, 64)), "differ"),
])
def test_bad_head_dims_are_refused(shapes, match):
    q, k, v = (np.zeros(s, ml_dtypes.bfloat16) for s in shapes)
    with pytest.raises(kiln.KilnError, match=match):
        prefill(q, k, v, backend="interpret")


def test_every_head_dim_pair_has_a_config_that_fits():
    for d in range(8, 257, 8):
        for dv in range(8, 257, 8):
            cfg = HopperPrefillConfig.for_head_dim(d, dv)
            assert cfg.shared_bytes() <= SHARED_BUDGET and cfg.block_n >= 64
            assert cfg.qk_width >= d and cfg.v_width >= dv and cfg.qk_steps * 16 >= d
    assert HopperPrefillConfig.for_head_dim(192, 128).block_n == 128
    assert HopperPrefillConfig.for_head_dim(96) .block_n == 128
    assert HopperPrefillConfig.for_head_dim(128, 128) == HopperPrefillConfig.for_head_dim(128)


@pytest.mark.lower
@pytest.mark.slow
@pytest.mark.parametrize("d,dv,softcap", [(96, None, 0.0), (192, 128, 0.0), (192, None, 0.0),
                                          (40, None, 0.0), (128, None, 30.0), (136, 72, 0.0),
                                          (256, 64, 0.0), (8, 256, 5.0), (248, None, 0.0)])
def test_sm90_no_spills(d, dv, softcap):
    ck = compile_prefill("bf16", target="sm_90a", head_dim=d, head_dim_v=dv, causal=True,
                         group=4, return_lse=True, softcap=softcap)
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
    assert ck.metadata["wgmma_serialized"] is None


# ---------------------------------------------------------------------------------------------
# On a GPU: FlashAttention's acceptance rule against a bf16 PyTorch implementation
# ---------------------------------------------------------------------------------------------

def _torch_bf16_attention(torch, q, k, v, *, causal, softcap, scale):
    """FlashAttention's ``attention_ref`` without upcasting: every step in bf16."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    visible = torch.from_numpy(visible_keys(q.shape[1], k.shape[1], causal=causal)).cuda()
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1).to(v.dtype), v)


GPU_CASES = {
    "d96_causal_gqa": dict(d=96, dv=None, causal=True, hq=8, hkv=2, sq=1000, sk=1000),
    # Up to 512 keys: the persistent kernel with skip_masked_tiles.
    "d96_causal_short": dict(d=96, dv=None, causal=True, hq=8, hkv=2, sq=500, sk=500),
    "d192_v128_causal": dict(d=192, dv=128, causal=True, hq=8, hkv=8, sq=777, sk=1500),
    "d192": dict(d=192, dv=None, causal=False, hq=4, hkv=1, sq=513, sk=700),
    "d40": dict(d=40, dv=None, causal=True, hq=4, hkv=2, sq=300, sk=300),
    "d136_v72": dict(d=136, dv=72, causal=False, hq=2, hkv=1, sq=129, sk=4000),
    "d128_softcap": dict(d=128, dv=None, causal=True, hq=4, hkv=4, sq=1024, sk=1024,
                         softcap=30.0),
    "d256_softcap": dict(d=256, dv=None, causal=False, hq=2, hkv=1, sq=257, sk=1100,
                         softcap=5.0),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_fa_acceptance_on_gpu(case, rng):
    import torch

    case = dict(case)
    softcap = case.pop("softcap", None)
    d, dv, causal = case.pop("d"), case.pop("dv"), case.pop("causal")
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in
               random_qkv(rng, batch=2, d=d, dv=dv, **case)[:3])
    dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16) for x in (q, k, v)]
    poison_cuda_pool(torch, 2 * q.nbytes)
    o = prefill(*dev, causal=causal, softcap=softcap)
    want = attention_reference(q, k, v, causal=causal, softcap=softcap)
    pt = _torch_bf16_attention(torch, *dev, causal=causal, softcap=softcap, scale=d ** -0.5)
    got_err = np.abs(o.float().cpu().numpy() - want).max()
    pt_err = np.abs(pt.float().cpu().numpy() - want).max()
    noise = 2 * np.abs((torch.from_numpy(want).cuda().bfloat16().float().cpu().numpy())
                       - want).max()
    assert got_err <= 2 * pt_err + noise, (got_err, pt_err, noise)
    assert_attention_close(o, q, k, v, causal=causal, softcap=softcap,
                           score_error=_tanh_approx_score_error(q, k, softcap))


def _tanh_approx_score_error(q, k, softcap):
    """The most a capped score errs on NVIDIA (tanh.approx.f32: relative 2**-11 of the capped
    score, which is at most softcap and at most the raw scaled score); 0 without a cap."""
    if not softcap:
        return 0.0
    scale = q.shape[-1] ** -0.5
    group = q.shape[2] // k.shape[2]
    q32 = np.asarray(q, np.float32).transpose(0, 2, 1, 3)  # [b, h, q, d]
    k32 = np.asarray(np.repeat(k, group, axis=2), np.float32).transpose(0, 2, 3, 1)
    largest = np.abs(q32 @ k32).max() * scale
    return TANH_APPROX_REL_ERROR * min(softcap, largest)


@pytest.mark.lower
def test_sm90_softcap_is_one_sfu_op_per_score():
    """On NVIDIA the cap is one tanh.approx.f32 per score: the capped kernel runs exactly the
    uncapped kernel's ex2 (the softmax's) and no rcp (the exp2/rcp tanh's second op)."""
    ptx = {cap: compile_prefill("bf16", target="sm_90a", head_dim=128, causal=True,
                                softcap=cap).asm["ptx"] for cap in (0.0, 30.0)}
    scores = ptx[30.0].count("tanh.approx.f32")
    assert scores > 0 and ptx[0.0].count("tanh.approx.f32") == 0
    assert ptx[30.0].count("ex2.approx") == ptx[0.0].count("ex2.approx") < 2 * scores
    assert "rcp.approx" not in ptx[30.0]


@pytest.mark.lower
@pytest.mark.slow
@pytest.mark.parametrize("d,dv,softcap,masks", [
    (96, None, 0.0, dict(causal=True)), (192, 128, 0.0, dict(causal=True)),
    (256, None, 0.0, dict(window=(1, 1))), (40, None, 0.0, dict(chunk=1)),
    (64, 104, 0.0, dict(causal=True, sinks=True)), (128, None, 30.0, dict(causal=True))])
def test_gfx950_assembly_has_no_scratch_and_verified_waits(d, dv, softcap, masks):
    from kiln.kernels.attention.prefill_gfx950 import PrefillGfx950Config, compile_prefill_gfx950
    from kiln.lowering.isa_amdgpu import parse, verify_waits
    from kiln.lowering.verify_schedule import verify_schedule

    ck = compile_prefill_gfx950(head_dim=d, head_dim_v=dv, softcap=softcap, **masks)
    config = PrefillGfx950Config(head_dim=d, head_dim_v=dv)
    assert ck.metadata["scratch_bytes"] == 0
    # 8 waves: two per SIMD, 256 registers each; 4 waves (a 256-wide operand): one, 512.
    budget = 256 if config.waves == 8 else 512
    assert ck.metadata["vgpr_count"] + ck.metadata["agpr_count"] <= budget
    program = parse(ck.asm["amdgcn"], "prefill_gfx950")
    verify_waits(program)
    assert verify_schedule(program, ck.recipes, "prefill_gfx950", strict=True) == []


def test_gfx950_widths_and_waves():
    from kiln.kernels.attention.prefill_gfx950 import PrefillGfx950Config

    for d in range(8, 257, 8):
        for dv in range(8, 257, 8):
            cfg = PrefillGfx950Config(head_dim=d, head_dim_v=dv)
            assert cfg.qk_width >= d and cfg.v_width >= dv
            assert min(cfg.dmas_per_tile) >= 1 and cfg.lds_bytes <= 64 * 1024
    assert PrefillGfx950Config(head_dim=192, head_dim_v=128).waves == 4
    assert PrefillGfx950Config(head_dim=96).waves == 8
