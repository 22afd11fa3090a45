"""gfx950 MhaPrefillV2 prefill: interpreter correctness against the float64 reference, and the
compiled kernel's shape (no scratch, register budget, cluster schedule conformance)."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import (assert_attention_close, random_qkv, rising_maxima,
                                 tile_edge_lengths, very_negative_scores)
from kiln.kernels.attention.prefill_gfx950 import (PrefillGfx950Config, compile_prefill_gfx950,
                                                   run_prefill_gfx950)

BF16 = ml_dtypes.bfloat16


def _check(q, k, v, **kwargs):
    o, lse = run_prefill_gfx950(q, k, v, return_lse=True, backend="interpret", **kwargs)
    return assert_attention_close(o, q, k, v, lse=lse, **kwargs)


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (20, 5)},
    "window_left_only": {"window": (33, -1), "causal": True},
    "chunk": {"chunk": 48},
}


@pytest.mark.parametrize("mask", [m if m in ("none", "causal", "window_left_only")
                                  else pytest.param(m, marks=pytest.mark.slow) for m in MASKS])
def test_masks_with_sq_ne_sk_and_ragged_tile_edges(mask, rng):
    q, k, v, _, _ = random_qkv(rng, batch=2, sq=37, sk=150, hq=2, hkv=1, d=64, dtype=BF16)
    _check(q, k, v, **MASKS[mask])


def test_causal_with_more_queries_than_keys_leaves_empty_rows(rng):
    """Bottom-right causal with Sq > Sk: the first rows see no key (o = 0, lse = -inf)."""
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=45, sk=30, hq=1, hkv=1, d=64, dtype=BF16)
    _check(q, k, v, causal=True)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 1)])
def test_gqa_ratios_with_sinks(hq, hkv, rng):
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=20, sk=70, hq=hq, hkv=hkv, d=64, dtype=BF16)
    sinks = rng.standard_normal(hq).astype(np.float32) * 2
    _check(q, k, v, sinks=sinks, causal=True)


@pytest.mark.parametrize("d", [128, 256])
def test_head_dims(d, rng):
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=33, sk=67, hq=1, hkv=1, d=d, dtype=BF16)
    _check(q, k, v, scale=0.3 / np.sqrt(d), window=(40, 10))


def test_ragged_batch_and_f16(rng):
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=0, sk=0, hq=4, hkv=2, d=64,
                                     dtype=np.float16, ragged_q=[17, 1, 40], ragged_k=[17, 90, 3])
    _check(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_lazy_rescale_survives_a_huge_first_growth(rng):
    """Scores that start tiny and jump by far more than the threshold: the rescale fires once
    and every later skip resets scale_vec, so the result stays finite and exact."""
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=8, sk=200, hq=1, hkv=1, d=64, dtype=BF16)
    k[:, 100:] *= 8
    _check(q, k, v, scale=1.0)


# Tile-edge residues at D = 64: 256 query rows per block, 64-key tiles.
BLOCK_Q = 256
BLOCK_KV = PrefillGfx950Config(head_dim=64).block_kv
RESIDUE_MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (BLOCK_KV - 1, 1)},  # both bounds one key off a causal edge
    "causal_window": {"causal": True, "window": (BLOCK_KV + 1, -1)},
    "chunk": {"chunk": BLOCK_KV - 1},
}


def _check_residues(rng, mask, *, every):
    lengths_q, lengths_k = tile_edge_lengths(BLOCK_Q, BLOCK_KV, every=every)
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=0, sq=0, sk=0, hq=1, hkv=1, d=64, dtype=BF16,
                                     ragged_q=lengths_q, ragged_k=lengths_k)
    _check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **mask)


# 3-4 s each in the interpreter: the slow tier, which CI also runs (make test keeps the ragged
# tile edges of test_masks_with_sq_ne_sk_and_ragged_tile_edges)
@pytest.mark.slow
@pytest.mark.parametrize("mask", RESIDUE_MASKS)
def test_masks_at_tile_edge_residues(mask, rng):
    """Sk - Sq at 0, 1, 2, -2 and -1 modulo the key tile (and negative), Sq around a query
    block: a boundary tile whose mask is skipped or bounded one key off errs there."""
    _check_residues(rng, RESIDUE_MASKS[mask], every=False)


@pytest.mark.slow
@pytest.mark.parametrize("mask", RESIDUE_MASKS)
def test_masks_at_every_residue(mask, rng):
    """Every residue of Sk - Sq modulo the 64-key tile, in one ragged launch per mask."""
    _check_residues(rng, RESIDUE_MASKS[mask], every=True)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_rows_whose_every_score_is_very_negative(mask, rng):
    """Rows whose scores all lie near one offset from 0 down to -1e4 (natural units): the
    running max starts empty, not at 0, so exp2 never underflows the denominator (which gave
    NaN for row maxima near -134..-147 log2 units and 0 below about -149)."""
    q, k, v = very_negative_scores(rng, sq=64, sk=150, d=64)
    _check(q.astype(BF16), k.astype(BF16), v.astype(BF16), **MASKS[mask])


def test_very_negative_rows_with_a_sink(rng):
    """A sink at -20 (natural units) above rows at -1e4: the sink holds all the weight."""
    q, k, v = very_negative_scores(rng, sq=20, sk=70, d=64)
    _check(q.astype(BF16), k.astype(BF16), v.astype(BF16), sinks=np.full(1, -20.0, np.float32))


@pytest.mark.parametrize("causal", [False, True])
def test_rescale_across_tiles_whose_max_rises(causal, rng):
    """Each 64-key tile lifts the rows' max by 4.7-14 log2 units while its other keys keep a
    weight that only a correct exp2(prev - max) rescale of the earlier tiles leaves right."""
    q, k, v = rising_maxima(rng, sq=40, sk=320, d=64, block_kv=64)
    _check(q.astype(BF16), k.astype(BF16), v.astype(BF16), causal=causal)


@pytest.mark.parametrize("sq,sk,d,mask", [(300, 300, 128, {"causal": True}),
                                          (40, 600, 64, {}),
                                          (300, 330, 64, {"window": (100, 40)}),
                                          (600, 600, 64, {"chunk": 256})])
@pytest.mark.slow
def test_long_sequences_run_the_main_loop_over_interior_and_boundary_tiles(sq, sk, d, mask, rng):
    """Several main-loop iterations, with tiles that skip the mask (every key visible to the
    whole block) next to boundary tiles that need it."""
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=sq, sk=sk, hq=1, hkv=1, d=d, dtype=BF16)
    _check(q, k, v, **mask)


def test_interpret_only_backend_is_enforced():
    q = np.zeros((1, 4, 1, 64), BF16)
    with pytest.raises(kiln.UnsupportedError, match="interpret"):
        run_prefill_gfx950(q, q, q, backend=None)


@pytest.mark.parametrize("d,dv", [(100, None), (264, None), (64, 0), (128, 12)])
def test_config_rejects_unsupported_head_dim(d, dv):
    with pytest.raises(kiln.UnsupportedError, match="head_dim"):
        PrefillGfx950Config(head_dim=d, head_dim_v=dv)


@pytest.mark.lower
@pytest.mark.parametrize("d,masks", [(64, {"causal": True, "sinks": True}),
                                     (64, {"chunk": 1}),
                                     (128, {"causal": True}),
                                     (128, {"window": (1, 1)})])
@pytest.mark.slow
def test_gfx950_assembly_has_no_scratch_fits_registers_and_follows_the_recipes(d, masks):
    from kiln.lowering.isa_amdgpu import parse, verify_waits
    from kiln.lowering.verify_schedule import verify_schedule

    ck = compile_prefill_gfx950(head_dim=d, **masks)
    assert ck.metadata["scratch_bytes"] == 0
    # 8 waves per block are two per SIMD: 256 of the 512 unified VGPR+AGPR registers each.
    assert ck.metadata["vgpr_count"] + ck.metadata["agpr_count"] <= 256
    program = parse(ck.asm["amdgcn"], "prefill_gfx950")
    verify_waits(program)
    assert verify_schedule(program, ck.recipes, "prefill_gfx950", strict=True) == []


def test_p_cache_gives_the_same_output(rng):
    """``att_bf16_full`` casts P to bf16 in the softmax cluster instead of at the PV: the
    same casts of the same values, so the outputs agree bit for bit."""
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=40, sk=150, hq=2, hkv=1, d=64, dtype=BF16)
    o = [run_prefill_gfx950(q, k, v, causal=True, backend="interpret", att_bf16_full=cache)
         for cache in (True, False)]
    assert_attention_close(o[0], q, k, v, causal=True)
    assert np.array_equal(o[0].view(np.uint16), o[1].view(np.uint16))


@pytest.mark.lower
@pytest.mark.slow
def test_p_cache_spills_and_is_refused_without_allow_scratch():
    """The loop-carried bf16 P (module docs) costs registers: at D 128 the kernel spills, so
    compiling it needs ``allow_scratch=True``; its waits still verify."""
    from kiln.lowering.isa_amdgpu import parse, verify_waits

    with pytest.raises(kiln.ResourceError, match="spills"):
        compile_prefill_gfx950(head_dim=128, causal=True, att_bf16_full=True)
    ck = compile_prefill_gfx950(head_dim=128, causal=True, att_bf16_full=True,
                                allow_scratch=True)
    assert ck.metadata["scratch_bytes"] > 0
    verify_waits(parse(ck.asm["amdgcn"], "prefill_gfx950"))
