"""FP8 (e4m3) attention prefill on Hopper (``prefill`` with f8e4m3 q/k/v and descales): the
interpreter against the float64 reference of the dequantised inputs, the checks, the PTX, and
the same on a GPU.

Two kinds of inputs:

- *exact P*: q rows hold two ones, k entries are -1/0/1, the softmax scale is ``ln 2`` and
  the q descales powers of two, so every scaled score is an integer number of log2 units and
  every P the kernel rounds to e4m3 is a power of two it holds exactly: the output may err only
  by bf16's rounding, so a key in the wrong order, a mask off by one or a wrong descale fails;
- *random*: randn inputs quantised to e4m3 with per-(batch, head) descales, checked within
  FP8's bound: P rounded to e4m3 (relative ``2**-4``, or ``2**-10`` absolute below its
  smallest normal ``2**-6``), O to bf16.
"""

import dataclasses
import math
import re
from unittest import mock

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import (assert_attention_close, attention_reference, poison_cuda_pool,
                                 visible_keys)
from kiln.kernels.attention.prefill import compile_prefill, prefill
from kiln.kernels.attention.prefill_hopper_fp8_config import HopperFp8PrefillConfig
from kiln.runtime.cuda import cuda_available

E4M3 = ml_dtypes.float8_e4m3fn
LN2 = math.log(2.0)
needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")


def _token_batches(cu, total):
    """The sequence index of each of ``total`` ragged rows."""
    return np.repeat(np.arange(len(cu) - 1), np.diff(cu))[:total]


def _dequantised(x8, descale, cu=None):
    """``x8 * descale`` in float64 (descale ``[B, H]``, per token's sequence when ragged)."""
    x = x8.astype(np.float64)
    if cu is None:
        return x * descale[:, None, :, None]
    return x * descale[_token_batches(cu, x.shape[0])][:, :, None]


def exact_problem(rng, *, batch, sq, sk, hq, hkv, d, dv=None, ragged_q=None, ragged_k=None):
    """FP8 q/k/v, descales and cu_seqlens whose every P is a power of two (module docstring)."""
    dv = d if dv is None else dv
    if ragged_q is None:
        q_shape, k_shape, cu_q, cu_k = (batch, sq, hq, d), (batch, sk, hkv, d), None, None
    else:
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
                      for n in (ragged_q, ragged_k))
        batch = len(ragged_q)
        q_shape, k_shape = (int(cu_q[-1]), hq, d), (int(cu_k[-1]), hkv, d)
    q = np.zeros(q_shape, np.float32)
    rows = q.reshape(-1, d)
    for r in range(rows.shape[0]):  # two ones: scores in -4..4 log2 units after descale 2,
        rows[r, rng.choice(d, 2, replace=False)] = 1.0  # so every P is >= 2**-8: no flush
    k = rng.integers(-1, 2, k_shape).astype(np.float32)
    v = rng.standard_normal(k_shape[:-1] + (dv,)).astype(np.float32)
    descales = dict(descale_q=rng.choice([1.0, 2.0], (batch, hq)).astype(np.float32),
                    descale_k=np.ones((batch, hkv), np.float32),
                    descale_v=rng.uniform(0.5, 2.0, (batch, hkv)).astype(np.float32))
    return [x.astype(E4M3) for x in (q, k, v)], descales, cu_q, cu_k


def _check_exact(o, lse, q8, k8, v8, descales, cu_q=None, cu_k=None, *, hardware=False,
                 **kwargs):
    """``o`` and ``lse`` of exact-P inputs against the reference. On ``hardware`` FP8 WGMMA
    adds each k32 instruction's products with ~14 mantissa bits (tests/fp8_reference.py):
    allow ``2**-14`` of the row's ``sum_j P_j |v_j|`` per P V instruction of the longest row
    (4 per 128 keys), passed as the equivalent score error."""
    ragged = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) if cu_q is not None else {}
    qf, kf, vf = (_dequantised(x, descales[n], c) for x, n, c in
                  ((q8, "descale_q", cu_q), (k8, "descale_k", cu_k), (v8, "descale_v", cu_k)))
    keys = int(np.diff(cu_k).max()) if cu_k is not None else k8.shape[1]
    accumulation = 4 * -(-keys // 128) * 2.0 ** -14 if hardware else 0.0
    assert_attention_close(o, qf, kf, vf, lse=lse, scale=LN2,
                           score_error=0.5 * math.log1p(accumulation), **ragged, **kwargs)


@pytest.mark.parametrize("shape,mask", [
    (dict(batch=2, sq=130, sk=200, hq=2, hkv=1, d=128), dict(causal=True)),
    pytest.param(dict(batch=1, sq=77, sk=300, hq=4, hkv=2, d=128), dict(),
                 marks=pytest.mark.slow),  # the slow tier, which CI also runs
    (dict(batch=1, sq=200, sk=129, hq=3, hkv=3, d=128), dict(window=(40, 7))),
    pytest.param(dict(batch=1, sq=150, sk=150, hq=2, hkv=2, d=128), dict(chunk=64, causal=True),
                 marks=pytest.mark.slow),
    (dict(batch=1, sq=65, sk=257, hq=2, hkv=1, d=64), dict(causal=True)),
    (dict(batch=1, sq=40, sk=140, hq=2, hkv=1, d=192, dv=128), dict()),
    (dict(batch=1, sq=33, sk=130, hq=1, hkv=1, d=256), dict(causal=True)),
])
def test_exact_p_matches_the_reference(shape, mask, rng):
    (q8, k8, v8), descales, _, _ = exact_problem(rng, **shape)
    o, lse = prefill(q8, k8, v8, scale=LN2, return_lse=True, backend="interpret",
                     target="sm_90a", **descales, **mask)
    assert o.dtype == ml_dtypes.bfloat16 and o.shape == q8.shape[:-1] + v8.shape[-1:]
    _check_exact(o, lse, q8, k8, v8, descales, **mask)


def test_ragged_batch_with_sinks(rng):
    """Odd and empty sequences, GQA, sinks, per-sequence descales."""
    (q8, k8, v8), descales, cu_q, cu_k = exact_problem(
        rng, batch=None, sq=None, sk=None, hq=4, hkv=2, d=128, ragged_q=[17, 0, 130, 1],
        ragged_k=[40, 5, 131, 0])
    sinks = (rng.integers(-2, 3, 4) * LN2).astype(np.float32)  # whole log2 units: P exact
    o, lse = prefill(q8, k8, v8, scale=LN2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks,
                     causal=True, return_lse=True, backend="interpret", target="sm_90a",
                     **descales)
    _check_exact(o, lse, q8, k8, v8, descales, cu_q, cu_k, sinks=sinks, causal=True)


def _fp8_random(rng, batch, sq, sk, hq, hkv, d):
    """randn q/k/v quantised per (batch, head) to e4m3: ``(x8, descale [B, H])`` each."""
    out = []
    for shape in ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d)):
        x = rng.standard_normal(shape) * rng.uniform(0.5, 3.0, (shape[0], 1, shape[2], 1))
        descale = (np.abs(x).max(axis=(1, 3)) / 448.0).astype(np.float32)
        out.append(((x / descale[:, None, :, None]).astype(E4M3), descale))
    return out


def assert_within_fp8_bound(o, qf, kf, vf, *, scale, causal=False, window=None):
    """Each output may err by ``2**-8 |o|`` (bf16) plus P's e4m3 rounding: ``2**-4`` of
    ``sum_j P_j |v_j|``, and ``2**-10`` (the spacing below e4m3's smallest normal) of
    ``sum_j |v_j|`` over the row's denominator ``L = sum_j exp(s_j - max)`` (>= 1)."""
    want = attention_reference(qf, kf, vf, scale=scale, causal=causal, window=window)
    magnitude = attention_reference(qf, kf, np.abs(vf), scale=scale, causal=causal,
                                    window=window)
    group = qf.shape[2] // kf.shape[2]
    kr, vr = (np.repeat(x, group, axis=2) for x in (kf, vf))
    s = scale * np.einsum("bqhd,bkhd->bhqk", qf, kr)
    visible = visible_keys(qf.shape[1], kf.shape[1], causal=causal, window=window)
    s = np.where(visible, s, -np.inf)
    weights = np.exp(s - s.max(axis=-1, keepdims=True))
    flush = np.einsum("qk,bkhd->bqhd", np.where(visible, 1.0, 0.0), np.abs(vr)) \
        / weights.sum(axis=-1).transpose(0, 2, 1)[..., None]
    got = np.asarray(o, np.float64)
    tolerance = 2.0 ** -8 * np.abs(want) + 2.0 ** -4 * magnitude + 2.0 ** -10 * flush + 1e-6
    excess = np.abs(got - want) - tolerance
    assert not np.isnan(got).any()
    assert (excess <= 0).all(), f"{(excess > 0).sum()} outputs past FP8's bound, worst " \
                                f"{excess.max():.3g} over"
    return np.abs(got - want).max()


@pytest.mark.parametrize("causal,window", [(True, None), (False, (50, 20))])
def test_random_inputs_within_fp8_bound(causal, window, rng):
    (q8, dq), (k8, dk), (v8, dv) = _fp8_random(rng, 2, 150, 190, 4, 2, 128)
    o = prefill(q8, k8, v8, causal=causal, window=window, descale_q=dq, descale_k=dk,
                descale_v=dv, backend="interpret", target="sm_90a")
    qf, kf, vf = (_dequantised(x, ds) for x, ds in ((q8, dq), (k8, dk), (v8, dv)))
    error = assert_within_fp8_bound(o, qf, kf, vf, scale=128 ** -0.5, causal=causal,
                                    window=window)
    assert error > 0  # P really was rounded to e4m3: the bound is not vacuous


def test_scalar_descales_and_softcap(rng):
    """Scalar descales broadcast; softcap caps the descaled scores (hardware tanh's error)."""
    (q8, k8, v8), descales, _, _ = exact_problem(rng, batch=1, sq=70, sk=90, hq=2, hkv=1, d=128)
    o = prefill(q8, k8, v8, scale=LN2, softcap=2.5, descale_q=2.0, descale_k=np.float32(1.0),
                descale_v=np.array([0.5], np.float32), backend="interpret", target="sm_90a")
    qf, kf, vf = (x.astype(np.float64) * s for x, s in ((q8, 2.0), (k8, 1.0), (v8, 0.5)))
    want = attention_reference(qf, kf, vf, scale=LN2, softcap=2.5)
    magnitude = attention_reference(qf, kf, np.abs(vf), scale=LN2, softcap=2.5)
    err = np.abs(np.asarray(o, np.float64) - want)
    assert (err <= 2.0 ** -8 * np.abs(want) + 2.0 ** -4 * magnitude + 1e-6).all()


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(descale_q=np.ones((1, 3), np.float32)), kiln.KilnValueError, "descale_q has shape"),
    (dict(descale_v=np.ones((2, 2), np.float32)), kiln.KilnValueError, "descale_v has shape"),
    (dict(dtype=ml_dtypes.bfloat16, descale_k=1.0), kiln.KilnValueError,
     "descale_k is given for bf16"),
    (dict(d=72), kiln.UnsupportedError, "multiple of 16"),
])
def test_bad_fp8_inputs_fail_before_compiling(kwargs, error, words):
    dtype, d = kwargs.pop("dtype", E4M3), kwargs.pop("d", 64)
    q, k = np.ones((1, 8, 2, d), dtype), np.ones((1, 8, 1, d), dtype)
    with pytest.raises(error, match=re.escape(words)) as info:
        prefill(q, k, k, backend="interpret", target="sm_90a", **kwargs)
    assert info.value.fix


def test_mixed_fp8_and_bf16_inputs_are_refused():
    q = np.ones((1, 8, 2, 64), E4M3)
    with pytest.raises(kiln.UnsupportedError, match="dtypes"):
        prefill(q, q, q.astype(ml_dtypes.bfloat16), backend="interpret", target="sm_90a")


def _transpose_kernel(v_width, batch, keys=128):
    """V ``[keys, v_width]`` (int8 stand-ins for e4m3 bytes) into a raw ring as TMA's 128-byte
    swizzle lays it out, :func:`_transpose_v` by one warp group, ``Vt`` (one ``[v_width, 128]``
    box per 128 keys) read back unswizzled."""
    from kiln.kernels.attention import prefill_hopper_fp8 as fp8

    boxes = v_width // 128

    key_boxes = -(-keys // 128)

    @kiln.kernel(num_threads=128)
    def transpose(v: kiln.Tensor[kiln.i8, 2], vt: kiln.Tensor[kiln.i8, 2]):
        raw = kiln.dynamic_shared((boxes, keys, 128), kiln.f8e4m3, align=1024)
        out = kiln.dynamic_shared((key_boxes * v_width, 128), kiln.f8e4m3, align=1024)
        raw_bytes = raw.reinterpret((boxes, keys, 128), kiln.i8)
        out_bytes = out.reinterpret((key_boxes * v_width, 128), kiln.i8)
        tid = kiln.thread_id(0)
        for b in kiln.static_range(boxes):
            for key in kiln.range(keys):
                raw_bytes.store(b, key, ((tid // 16) ^ (key % 8)) * 16 + tid % 16,
                                v[key, b * 128 + tid])
        kiln.barrier()
        fp8._transpose_v(fp8._flat_b16(raw, boxes * keys * 128),
                         fp8._flat_b16(out, key_boxes * v_width * 128), 0, 0, tid, v_width, keys,
                         batch)
        kiln.barrier()
        for d in kiln.range(key_boxes * v_width):
            vt[d, tid] = out_bytes.load(d, ((tid // 16) ^ (d % 8)) * 16 + tid % 16)

    return transpose


@pytest.mark.parametrize("v_width,batch,keys", [(128, 1, 128), (256, 1, 128), (128, 4, 128),
                                                 (256, 8, 128), (128, 4, 192), (256, 1, 160)])
def test_v_transpose_writes_keys_in_the_fp8_a_order(v_width, batch, keys, rng):
    """Vt row d holds V's column d with each 32 keys in ``wgmma.FP8_A_K_ORDER`` (the order of
    P's e4m3 registers), keys past 128 in a second 128-byte box, whichever warp and unit moved
    them."""
    v = rng.integers(-128, 128, (keys, v_width)).astype(np.int8)
    boxes = -(-keys // 128)
    vt = np.full((boxes * v_width, 128), 77, np.int8)  # poisoned
    _transpose_kernel(v_width, batch, keys).interpret[1](v, vt, target="sm_90a")
    order = [32 * (k // 32) + kiln.wgmma.FP8_A_K_ORDER[k % 32] for k in range(keys)]
    for b in range(boxes):
        got = vt[b * v_width:(b + 1) * v_width, :min(128, keys - 128 * b)]
        np.testing.assert_array_equal(got, v[order[128 * b:128 * (b + 1)]].T)


@pytest.mark.parametrize("block_n", [128, pytest.param(160, marks=pytest.mark.slow)])
def test_other_key_tiles_match_the_reference(block_n, rng):
    """Key tiles of one 128-byte V^T row, or past it by one k32 step (the default's 192 keys
    run in every other test), causal and GQA: still exact."""
    default = HopperFp8PrefillConfig.for_head_dim

    def config(*dims):
        return dataclasses.replace(default(*dims), block_n=block_n)

    (q8, k8, v8), descales, _, _ = exact_problem(rng, batch=2, sq=130, sk=500, hq=2, hkv=1,
                                                 d=128)
    with mock.patch.object(HopperFp8PrefillConfig, "for_head_dim", config):
        o, lse = prefill(q8, k8, v8, scale=LN2, return_lse=True, causal=True,
                         backend="interpret", target="sm_90a", **descales)
    _check_exact(o, lse, q8, k8, v8, descales, causal=True)


def test_config_picks_raw_stages_that_fit():
    assert HopperFp8PrefillConfig.for_head_dim(128).raw_stages == 2
    assert HopperFp8PrefillConfig.for_head_dim(128).block_n == 192
    assert HopperFp8PrefillConfig.for_head_dim(192, 128).block_n == 128  # Q/K 256 wide
    assert HopperFp8PrefillConfig.for_head_dim(256).raw_stages == 1
    with pytest.raises(kiln.ResourceError, match="shared memory"):
        HopperFp8PrefillConfig(head_dim=256, stages=3)
    # 2 x 240 + 32 > 3 x 168: the consumers' setmaxnreg.inc would hang on the GPU.
    with pytest.raises(kiln.ResourceError, match="setmaxnreg.inc would wait forever"):
        HopperFp8PrefillConfig(producer_registers=32, consumer_registers=240)
    with pytest.raises(kiln.UnsupportedError, match="block_n=144"):
        HopperFp8PrefillConfig(block_n=144)


@pytest.fixture(scope="module")
def fp8_causal_d128():
    return compile_prefill("f8e4m3", target="sm_90a", head_dim=128, causal=True,
                           return_lse=True)


@pytest.mark.lower
def test_ptx_has_the_fp8_pipeline(fp8_causal_d128):
    ptx = " ".join(fp8_causal_d128.asm["ptx"].split())
    # 192-key tiles: S = Q K^T from shared memory (4 k32 steps of D 128, again in the rare
    # redo) and O += P V with P's e4m3 registers (6 k32 steps of 192 keys, in the loop and the
    # epilogue).
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n192k32\.f32\.e4m3\.e4m3 "
                    r"\{[^}]*\}, %rd\d+, %rd\d+", ptx)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3 "
                    r"\{[^}]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, p, 1, 1;", ptx)
    assert len(qk) == 3 * 4 and len(pv) == 2 * 6
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 2 * 48  # 96 P values per row pair
    # The producer transposes V: per 16 keys x 32 columns one ldmatrix.x4, four byte
    # permutes and one transposing stmatrix.x4 (12 of each for 192 keys, unrolled), then its
    # fence.
    assert "fence.proxy.async.shared::cta" in ptx
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 12
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 12
    assert ptx.count("prmt.b32") == 12 * 4
    assert "setmaxnreg.dec.sync.aligned.u32 40" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 232" in ptx
    assert "ex2.approx.ftz.f32" in ptx


@pytest.mark.lower
@pytest.mark.parametrize("d,dv", [(128, 128), pytest.param(64, 64, marks=pytest.mark.slow),
                                  (192, 128)])
def test_no_spills(d, dv):
    ck = compile_prefill("f8e4m3", target="sm_90a", head_dim=d, head_dim_v=dv, window=(128, 0),
                         group=4, sinks=True, return_lse=True)
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
    assert ck.metadata["wgmma_serialized"] is None
    assert ck.signature.dynamic_shared_bytes >= \
        HopperFp8PrefillConfig.for_head_dim(d, dv).shared_bytes()


# ---------------------------------------------------------------------------------------------
# On a GPU: exact-P and random inputs, outputs poisoned
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "causal_gqa": dict(batch=2, sq=1000, sk=1000, hq=4, hkv=2, d=128, causal=True),
    "none_long": dict(batch=1, sq=300, sk=4200, hq=2, hkv=1, d=128),
    "window_d64": dict(batch=1, sq=513, sk=700, hq=2, hkv=2, d=64, window=(100, 20)),
}


GPU_VARIANTS = {"block_n128": dict(block_n=128), "block_n160": dict(block_n=160),
                "stages4": dict(stages=4, raw_stages=2, block_n=128)}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("overrides", GPU_VARIANTS.values(), ids=GPU_VARIANTS.keys())
def test_config_variants_exact_on_gpu(overrides, rng):
    """The tile and pipeline options the benchmark compares, on the causal GQA case."""
    import torch

    default = HopperFp8PrefillConfig.for_head_dim

    def config(*dims):
        return dataclasses.replace(default(*dims), **overrides)

    (q8, k8, v8), descales, _, _ = exact_problem(rng, batch=2, sq=1000, sk=1000, hq=4, hkv=2,
                                                 d=128)
    dev = [torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
           for x in (q8, k8, v8)]
    poison_cuda_pool(torch, 4 * q8.nbytes)
    with mock.patch.object(HopperFp8PrefillConfig, "for_head_dim", config):
        o, lse = prefill(*dev, scale=LN2, return_lse=True, causal=True,
                         **{n: torch.from_numpy(x).cuda() for n, x in descales.items()})
    _check_exact(o.float().cpu().numpy().astype(ml_dtypes.bfloat16), lse.cpu().numpy(),
                 q8, k8, v8, descales, hardware=True, causal=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_exact_p_on_gpu(case, rng):
    import torch

    case = dict(case)
    mask = {n: case.pop(n) for n in ("causal", "window") if n in case}
    (q8, k8, v8), descales, _, _ = exact_problem(rng, **case)
    dev = [torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
           for x in (q8, k8, v8)]
    poison_cuda_pool(torch, 4 * q8.nbytes)
    o, lse = prefill(*dev, scale=LN2, return_lse=True,
                     **{n: torch.from_numpy(x).cuda() for n, x in descales.items()}, **mask)
    _check_exact(o.float().cpu().numpy().astype(ml_dtypes.bfloat16), lse.cpu().numpy(),
                 q8, k8, v8, descales, hardware=True, **mask)


@pytest.mark.gpu
@needs_gpu
def test_ragged_on_gpu(rng):
    import torch

    (q8, k8, v8), descales, cu_q, cu_k = exact_problem(
        rng, batch=None, sq=None, sk=None, hq=4, hkv=2, d=128, ragged_q=[300, 1, 129],
        ragged_k=[400, 64, 129])
    dev = [torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
           for x in (q8, k8, v8)]
    o, lse = prefill(*dev, scale=LN2, cu_seqlens_q=torch.from_numpy(cu_q).cuda(),
                     cu_seqlens_k=torch.from_numpy(cu_k).cuda(), causal=True, return_lse=True,
                     **{n: torch.from_numpy(x).cuda() for n, x in descales.items()})
    _check_exact(o.float().cpu().numpy().astype(ml_dtypes.bfloat16), lse.cpu().numpy(),
                 q8, k8, v8, descales, cu_q, cu_k, hardware=True, causal=True)
