"""gfx950 FP8 prefill: interpreter correctness against the float64 reference of the dequantised
inputs (FlashAttention-3 descales), both P-cache settings, the public entries, and the compiled
kernel's shape (f8 MFMAs, no scratch, register budget, waits, cluster schedule).

The compile-only tests read the assembly llvmlite prints; none needs ``ld.lld`` (hsaco only)."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import (LSE_TOLERANCE, attention_reference, tile_edge_lengths,
                                 visible_keys)
from kiln.kernels.attention import compile_prefill, prefill
from kiln.kernels.attention.prefill_gfx950_fp8 import (PrefillGfx950Fp8Config,
                                                       compile_prefill_gfx950_fp8, fp8_descales,
                                                       run_prefill_gfx950_fp8)

F8 = ml_dtypes.float8_e4m3fn
P_ROUNDOFF = 2.0 ** -4  # e4m3: 3 mantissa bits
P_FLUSH = 2.0 ** -10  # half e4m3's smallest subnormal: the most a tiny P loses
BF16_ROUNDOFF = 2.0 ** -8


def quantized(rng, shape, *, batch_axis=0, head_axis=-2, spread=1.0):
    """FP8 values ``x / s`` of a fresh normal ``x`` (times ``spread``) with a random descale
    ``s`` per (batch, head) -- ``[B, H]`` -- saturated at e4m3's largest finite value."""
    x = rng.standard_normal(shape) * spread
    s = rng.uniform(0.02, 0.1, (shape[batch_axis], shape[head_axis]))
    expand = [1] * len(shape)
    expand[batch_axis], expand[head_axis] = s.shape
    finite = float(ml_dtypes.finfo(F8).max)
    return np.clip(x / s.reshape(expand), -finite, finite).astype(F8), s.astype(np.float32)


def dequantized(x, s, cu=None):
    """``x * s`` in float64: dense ``[B, S, H, D]`` with ``s [B, H]``, or ragged
    ``[total, H, D]`` with each sequence's rows scaled by its batch's ``s``."""
    x = x.astype(np.float64)
    s = np.broadcast_to(np.asarray(s, np.float64), (x.shape[0] if cu is None else len(cu) - 1,
                                                   x.shape[-2]))
    if cu is None:
        return x * s[:, None, :, None]
    rows = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    return x * s[rows][:, :, None]


def flush_bound(q, k, v, *, scale, cu_q=None, cu_k=None, sinks=None, softcap=None, **mask):
    """``sum_j |v_j| / sum_j exp(s_j - max)`` per output element (float64, dequantised
    inputs): the kernel's P lies in units where the row max gives ``>= 1``, so this bounds
    what P values flushed below e4m3's subnormals may move the output, per unit of flush."""
    if cu_q is None:
        return np.stack([flush_bound(q[b], k[b], v[b], scale=scale, sinks=sinks,
                                     softcap=softcap, cu_q=[0, q.shape[1]],
                                     cu_k=[0, k.shape[1]], **mask) for b in range(q.shape[0])])
    out = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        group = qs.shape[1] // ks.shape[1]
        kh, vh = np.repeat(ks, group, axis=1), np.abs(np.repeat(vs, group, axis=1))
        s = np.einsum("qhd,khd->hqk", qs, kh) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        visible = visible_keys(len(qs), len(ks), **mask)[None]
        s = np.where(visible, s, -np.inf)
        top = s.max(axis=-1, keepdims=True)
        if sinks is not None:
            top = np.maximum(top, np.asarray(sinks, np.float64)[:, None, None])
        top = np.where(np.isfinite(top), top, 0.0)
        norm = np.exp(s - top).sum(-1, keepdims=True)
        if sinks is not None:
            norm = norm + np.exp(np.asarray(sinks, np.float64)[:, None, None] - top)
        mass = np.einsum("hqk,khd->qhd", visible.astype(np.float64) * np.ones_like(s), vh)
        out.append(mass / np.maximum(norm.transpose(1, 0, 2), 1.0))
    return np.concatenate(out)


def assert_fp8_attention_close(o, lse, q8, k8, v8, sq, sk, sv, *, cu_q=None, cu_k=None,
                               scale=None, **kwargs):
    """``o`` (bf16) and ``lse`` against the float64 reference of the dequantised inputs. Each
    element may err by the bf16 store (``2**-8 |o|``), P's e4m3 rounding (``2**-4`` of
    ``sum_j P_j |v_j|``) and P's flush below the subnormals (``2**-10`` times
    :func:`flush_bound`), plus f32 slack."""
    qd, kd, vd = dequantized(q8, sq, cu_q), dequantized(k8, sk, cu_k), dequantized(v8, sv, cu_k)
    scale = 1.0 / np.sqrt(q8.shape[-1]) if scale is None else scale
    ragged = {} if cu_q is None else {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    want, want_lse = attention_reference(qd, kd, vd, scale=scale, return_lse=True, **ragged,
                                         **kwargs)
    magnitude = attention_reference(qd, kd, np.abs(vd), scale=scale, **ragged, **kwargs)
    flush = flush_bound(qd, kd, vd, scale=scale, cu_q=cu_q, cu_k=cu_k, **kwargs)
    got = np.asarray(o).astype(np.float64)
    assert got.shape == want.shape and not np.isnan(got).any()
    tolerance = BF16_ROUNDOFF * np.abs(want) + P_ROUNDOFF * (1 + BF16_ROUNDOFF) * magnitude \
        + P_FLUSH * flush + 1e-6 * (magnitude + 1)
    excess = np.abs(got - want) - tolerance
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert (excess <= 0).all(), (f"{(excess > 0).sum()} of {excess.size} outputs off; worst "
                                 f"at {worst}: got {got[worst]:.6g}, want {want[worst]:.6g}, "
                                 f"tolerance {tolerance[worst]:.3g}")
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=LSE_TOLERANCE,
                               atol=LSE_TOLERANCE)
    return want


def _run(rng, *, batch=1, sq=37, sk=150, hq=2, hkv=1, d=64, dv=None, spread=1.0,
         att_bf16_full=True, **kwargs):
    q8, dq = quantized(rng, (batch, sq, hq, d))
    k8, dk = quantized(rng, (batch, sk, hkv, d), spread=spread)
    v8, dvs = quantized(rng, (batch, sk, hkv, dv or d))
    o, lse = run_prefill_gfx950_fp8(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dvs,
                                    return_lse=True, backend="interpret",
                                    att_bf16_full=att_bf16_full, **kwargs)
    assert o.dtype == kiln.bf16.numpy
    assert_fp8_attention_close(o, lse, q8, k8, v8, dq, dk, dvs, **kwargs)
    return o


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (20, 5)},
    "window_left_only": {"window": (33, -1), "causal": True},
    "chunk": {"chunk": 48},
}


# no mask and chunks run in the slow tier, which CI also runs
@pytest.mark.parametrize("mask", [m if m not in ("none", "chunk")
                                  else pytest.param(m, marks=pytest.mark.slow) for m in MASKS])
def test_masks_with_odd_lengths_and_per_head_descales(mask, rng):
    _run(rng, batch=2, **MASKS[mask])


def test_causal_with_more_queries_than_keys_leaves_empty_rows(rng):
    _run(rng, sq=45, sk=30, hq=1, causal=True)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (6, 2)])
def test_gqa_with_sinks(hq, hkv, rng):
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    _run(rng, sq=20, sk=70, hq=hq, hkv=hkv, sinks=sinks, causal=True)


@pytest.mark.parametrize("d,dv", [(128, None), (80, 48), (96, 128)])
def test_head_dims_including_padded_tiles(d, dv, rng):
    _run(rng, sq=33, sk=67, d=d, dv=dv, scale=0.3 / np.sqrt(d), window=(40, 10))


@pytest.mark.parametrize("causal", [False, True])
def test_p_cache_on_and_off_agree_bit_for_bit(causal, rng):
    """``att_bf16_full`` moves P's fp8 cast from the PV cluster to the softmax one: the same
    casts of the same f32 values, so both outputs are identical (and each within bounds)."""
    seed = int(rng.integers(1 << 30))
    outputs = [_run(np.random.default_rng(seed), sq=41, sk=200, d=128, causal=causal,
                    att_bf16_full=cache) for cache in (True, False)]
    assert np.array_equal(outputs[0].view(np.uint16), outputs[1].view(np.uint16))


def test_ragged_batch(rng):
    lengths_q, lengths_k = [17, 1, 40], [17, 90, 3]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q8, dq = quantized(rng, (1, cu_q[-1], 4, 64))
    k8, dk = quantized(rng, (1, cu_k[-1], 2, 64))
    v8, dvs = quantized(rng, (1, cu_k[-1], 2, 64))
    # ragged: per-(batch, head) descales of 3 sequences
    dq, dk, dvs = (np.repeat(s, 3, axis=0) * rng.uniform(0.5, 2, (3, 1)).astype(np.float32)
                   for s in (dq, dk, dvs))
    q8, k8, v8 = q8[0], k8[0], v8[0]
    o, lse = run_prefill_gfx950_fp8(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dvs,
                                    causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    return_lse=True, backend="interpret")
    assert_fp8_attention_close(o, lse, q8, k8, v8, dq, dk, dvs, causal=True, cu_q=cu_q,
                               cu_k=cu_k)


def test_lazy_rescale_survives_a_huge_first_growth(rng):
    """Scores that jump by far more than the threshold: the vote fires and P stays < 2**8."""
    q8, dq = quantized(rng, (1, 8, 1, 64))
    k8, dk = quantized(rng, (1, 200, 1, 64))
    k8[:, 100:] = (k8[:, 100:].astype(np.float32) * 6).clip(-448, 448).astype(F8)
    v8, dvs = quantized(rng, (1, 200, 1, 64))
    o, lse = run_prefill_gfx950_fp8(q8, k8, v8, descale_q=dq * 20, descale_k=dk,
                                    descale_v=dvs, scale=1.0, return_lse=True,
                                    backend="interpret")
    assert_fp8_attention_close(o, lse, q8, k8, v8, dq * 20, dk, dvs, scale=1.0)


def test_softcap(rng):
    _run(rng, sq=30, sk=90, causal=True, softcap=0.5, scale=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("sq,sk,d,mask", [(300, 300, 128, {"causal": True}),
                                          (40, 600, 64, {}),
                                          (300, 330, 64, {"window": (100, 40)})])
def test_long_sequences_run_interior_and_boundary_tiles(sq, sk, d, mask, rng):
    _run(rng, sq=sq, sk=sk, hq=1, d=d, **mask)


@pytest.mark.slow
@pytest.mark.parametrize("d,dv", [(256, None), (192, 128)])
def test_four_wave_head_dims(d, dv, rng):
    _run(rng, sq=40, sk=100, hq=1, d=d, dv=dv, causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["causal", "chunk"])
def test_masks_at_tile_edge_residues(mask, rng):
    """Sk - Sq around 0, +-1, +-2 modulo the 64-key tile and Sq around the 256-row block."""
    lengths_q, lengths_k = tile_edge_lengths(256, 64)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    kwargs = {"causal": True} if mask == "causal" else {"chunk": 63}
    q8 = quantized(rng, (1, cu_q[-1], 1, 64))[0][0]
    k8, v8 = (quantized(rng, (1, cu_k[-1], 1, 64))[0][0] for _ in range(2))
    o, lse = run_prefill_gfx950_fp8(q8, k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    return_lse=True, backend="interpret", **kwargs)
    assert_fp8_attention_close(o, lse, q8, k8, v8, 1.0, 1.0, 1.0, cu_q=cu_q, cu_k=cu_k,
                               **kwargs)


def test_public_prefill_takes_fp8_with_scalar_and_absent_descales(rng):
    q8, _ = quantized(rng, (2, 19, 4, 64))
    k8, dk = quantized(rng, (2, 45, 2, 64))
    v8, _ = quantized(rng, (2, 45, 2, 64))
    o, lse = prefill(q8, k8, v8, causal=True, descale_q=0.05, descale_k=dk, return_lse=True,
                     target="gfx950", backend="interpret")
    assert o.dtype == kiln.bf16.numpy
    assert_fp8_attention_close(o, lse, q8, k8, v8, 0.05, dk, 1.0, causal=True)


@pytest.mark.parametrize("bad,message", [
    ({"descale_q": np.ones(3)}, r"descale_q has shape \(3,\)"),
    ({"descale_v": np.ones((2, 4))}, r"descale_v has shape \(2, 4\)"),
    ({"descale_k": float("nan")}, "finite scalar"),
])
def test_bad_descales_name_the_argument(bad, message):
    q = np.zeros((2, 4, 4, 64), F8)
    k = np.zeros((2, 4, 2, 64), F8)
    with pytest.raises(kiln.KilnValueError, match=message):
        prefill(q, k, k, target="gfx950", backend="interpret", **bad)


def test_descales_need_fp8_inputs_and_the_runner_needs_the_interpreter():
    x = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(kiln.KilnValueError, match="descale_q is given for f16"):
        prefill(x, x, x, descale_q=1.0, target="gfx950", backend="interpret")
    x8 = np.zeros((1, 4, 1, 64), F8)
    with pytest.raises(kiln.UnsupportedError, match="interpret"):
        run_prefill_gfx950_fp8(x8, x8, x8)


def test_no_keys_gives_bf16_zeros():
    q, k = np.ones((1, 3, 2, 64), F8), np.ones((1, 0, 1, 64), F8)
    o, lse = prefill(q, k, k, descale_q=2.0, return_lse=True, target="gfx950",
                     backend="interpret")
    assert o.dtype == kiln.bf16.numpy and not o.astype(np.float32).any()
    assert (lse == -np.inf).all()


def test_descales_broadcast_to_batch_and_head():
    dq, dk, dv = fp8_descales(2, 4, 2, descale_q=0.5, descale_v=[[1, 2], [3, 4]])
    assert dq.tolist() == [0.5] * 8 and dk.tolist() == [1.0] * 4
    assert dv.tolist() == [1, 2, 3, 4] and dv.dtype == np.float32


@pytest.mark.parametrize("d,dv", [(264, None), (64, 12), (0, None), (72, None)])
def test_config_rejects_unsupported_head_dims(d, dv):
    with pytest.raises(kiln.UnsupportedError, match="head_dim"):
        PrefillGfx950Fp8Config(head_dim=d, head_dim_v=dv)


def test_config_shapes():
    c = PrefillGfx950Fp8Config(head_dim=64)
    assert (c.qk_width, c.waves, c.block_q, c.block_kv, c.dmas_per_tile) == (128, 8, 256, 64,
                                                                               (1, 1))
    assert PrefillGfx950Fp8Config(head_dim=192, head_dim_v=128).dmas_per_tile == (4, 2)
    with pytest.raises(kiln.UnsupportedError, match="bf16"):
        PrefillGfx950Fp8Config(dtype="bf16")


def _cvt_before_first_mfma(program, clusters):
    """Per instance of ``clusters``: (fp8 conversions before its first MFMA, in all)."""
    from kiln.lowering.isa_amdgpu import cluster_instances

    out = []
    for marker, instrs in cluster_instances(program):
        if marker.cluster in clusters:
            names = [i.mnemonic for i in instrs]
            first = names.index(next(n for n in names if n.startswith("v_mfma")))
            cvts = [n.startswith("v_cvt_pk_fp8_f32") for n in names]
            out.append((sum(cvts[:first]), sum(cvts)))
    return out


def _cvts_per_cluster(program, clusters):
    from kiln.lowering.isa_amdgpu import cluster_instances

    counts = {}
    for marker, instrs in cluster_instances(program):
        if marker.cluster in clusters:
            counts[marker.cluster] = counts.get(marker.cluster, 0) + sum(
                i.mnemonic.startswith("v_cvt_pk_fp8_f32") for i in instrs)
    return counts


@pytest.mark.lower
@pytest.mark.slow
@pytest.mark.parametrize("d,dv,masks,cache", [(128, None, {"causal": True}, True),
                                              (128, None, {"causal": True}, False),
                                              (64, None, {"sinks": True, "causal": True}, True),
                                              (128, None, {"window": (1, 1)}, False),
                                              (256, None, {"causal": True}, True),
                                              (192, 128, {"chunk": 1}, False)])
def test_gfx950_fp8_assembly(d, dv, masks, cache):
    from kiln.lowering.isa_amdgpu import parse, verify_waits
    from kiln.lowering.verify_schedule import verify_schedule

    ck = compile_prefill_gfx950_fp8(head_dim=d, head_dim_v=dv, att_bf16_full=cache, **masks)
    config = PrefillGfx950Fp8Config(head_dim=d, head_dim_v=dv)
    asm, meta = ck.asm["amdgcn"], ck.metadata
    assert meta["scratch_bytes"] == 0
    # Two waves per SIMD share the 512 unified VGPR + AGPR registers; one wave has them all.
    assert meta["vgpr_count"] + meta["agpr_count"] <= 512 // (config.waves // 4)
    assert "v_mfma_f32_32x32x64_f8f6f4" in asm and "v_mfma_f32_32x32x16_bf16" not in asm
    assert asm.count("ds_read_b64_tr_b8") > 0 and "ds_read_b64_tr_b16" not in asm
    program = parse(asm, "prefill_gfx950_fp8")
    verify_waits(program)
    assert verify_schedule(program, ck.recipes, "prefill_gfx950_fp8", strict=True) == []
    # P's 16 v_cvt_pk_fp8_f32 a tile: without the cache they open each PV cluster, ahead of
    # the MFMAs they feed; with it none is on the PV's path (C6 casts after its exps; LLVM's
    # MachineSink moves C2's cast to C5, past C5's mask branch, as the module docs say).
    placed = _cvt_before_first_mfma(program, {2, 6})
    assert len(placed) == 2
    assert all(before == (0 if cache else 16) for before, _ in placed), placed
    assert sum(_cvts_per_cluster(program, range(8)).values()) == 32


@pytest.mark.lower
def test_compile_prefill_selects_the_fp8_kernel():
    ck = compile_prefill("f8e4m3", target="gfx950", head_dim=128)
    assert ck.metadata["scratch_bytes"] == 0
    assert ck.metadata["vgpr_count"] + ck.metadata["agpr_count"] <= 256
    assert "v_mfma_f32_32x32x64_f8f6f4" in ck.asm["amdgcn"]
    with pytest.raises(kiln.UnsupportedError, match="gfx950"):
        compile_prefill_gfx950_fp8(head_dim=128, target="gfx942")
