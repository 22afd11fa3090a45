"""gfx950 MhaPrefillV2 prefill: interpreter correctness against the float64 reference, and the
compiled kernel's shape (no scratch, register budget, cluster schedule conformance)."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import attention_reference, random_qkv
from kiln.kernels.attention.prefill_gfx950 import (PrefillGfx950Config, compile_prefill_gfx950,
                                                   run_prefill_gfx950)

BF16 = ml_dtypes.bfloat16


def _check(q, k, v, *, tol=2e-2, **kwargs):
    o, lse = run_prefill_gfx950(q, k, v, return_lse=True, backend="interpret", **kwargs)
    ref_o, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    assert not np.isnan(o.astype(np.float32)).any()
    assert np.abs(o.astype(np.float64) - ref_o).max() < tol
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (20, 5)},
    "window_left_only": {"window": (33, -1), "causal": True},
    "chunk": {"chunk": 48},
}


@pytest.mark.parametrize("mask", MASKS)
def test_masks_with_sq_ne_sk_and_ragged_tile_edges(mask):
    rng = np.random.default_rng()
    q, k, v, _, _ = random_qkv(rng, batch=2, sq=37, sk=150, hq=2, hkv=1, d=64, dtype=BF16)
    _check(q, k, v, **MASKS[mask])


def test_causal_with_more_queries_than_keys_leaves_empty_rows():
    """Bottom-right causal with Sq > Sk: the first rows see no key (o = 0, lse = -inf)."""
    rng = np.random.default_rng()
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=45, sk=30, hq=1, hkv=1, d=64, dtype=BF16)
    _check(q, k, v, causal=True)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 1)])
def test_gqa_ratios_with_sinks(hq, hkv):
    rng = np.random.default_rng()
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=20, sk=70, hq=hq, hkv=hkv, d=64, dtype=BF16)
    sinks = rng.standard_normal(hq).astype(np.float32) * 2
    _check(q, k, v, sinks=sinks, causal=True)


@pytest.mark.parametrize("d", [128, 256])
def test_head_dims(d):
    rng = np.random.default_rng()
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=33, sk=67, hq=1, hkv=1, d=d, dtype=BF16)
    _check(q, k, v, scale=0.3 / np.sqrt(d), window=(40, 10))


def test_ragged_batch_and_f16():
    rng = np.random.default_rng()
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=0, sk=0, hq=4, hkv=2, d=64,
                                     dtype=np.float16, ragged_q=[17, 1, 40], ragged_k=[17, 90, 3])
    _check(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_lazy_rescale_survives_a_huge_first_growth():
    """Scores that start tiny and jump by far more than the threshold: the rescale fires once
    and every later skip resets scale_vec, so the result stays finite and exact."""
    rng = np.random.default_rng()
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=8, sk=200, hq=1, hkv=1, d=64, dtype=BF16)
    k[:, 100:] *= 8
    _check(q, k, v, scale=1.0, tol=3e-2)


@pytest.mark.parametrize("sq,sk,d,mask", [(300, 300, 128, {"causal": True}),
                                          (40, 600, 64, {}),
                                          (300, 330, 64, {"window": (100, 40)}),
                                          (600, 600, 64, {"chunk": 256})])
@pytest.mark.slow
def test_long_sequences_run_the_main_loop_over_interior_and_boundary_tiles(sq, sk, d, mask):
    """Several main-loop iterations, with tiles that skip the mask (every key visible to the
    whole block) next to boundary tiles that need it."""
    rng = np.random.default_rng()
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=sq, sk=sk, hq=1, hkv=1, d=d, dtype=BF16)
    _check(q, k, v, **mask)


def test_interpret_only_backend_is_enforced():
    q = np.zeros((1, 4, 1, 64), BF16)
    with pytest.raises(kiln.UnsupportedError, match="interpret"):
        run_prefill_gfx950(q, q, q, backend=None)


def test_config_rejects_unsupported_head_dim():
    with pytest.raises(kiln.UnsupportedError, match="head_dim"):
        PrefillGfx950Config(head_dim=96)


def test_head_dim_256_compiles_only_with_scratch_allowed():
    with pytest.raises(kiln.UnsupportedError, match="spills to scratch"):
        compile_prefill_gfx950(head_dim=256, causal=True)


@pytest.mark.lower
@pytest.mark.parametrize("d,masks", [(64, {"causal": True, "sinks": True}),
                                     (64, {"chunk": 1}),
                                     (128, {"causal": True}),
                                     (128, {"window": (1, 1)})])
@pytest.mark.slow
def test_gfx950_assembly_has_no_scratch_fits_registers_and_follows_the_recipes(d, masks):
    from kiln.lowering.isa_amdgpu import parse, verify_waits
    from kiln.passes.verify_schedule import verify_schedule

    ck = compile_prefill_gfx950(head_dim=d, **masks)
    assert ck.metadata["scratch_bytes"] == 0
    # 8 waves per block are two per SIMD: 256 of the 512 unified VGPR+AGPR registers each.
    assert ck.metadata["vgpr_count"] + ck.metadata["agpr_count"] <= 256
    program = parse(ck.asm["amdgcn"], "prefill_gfx950")
    verify_waits(program)
    assert verify_schedule(program, ck.recipes, "prefill_gfx950", strict=True) == []
