"""The Hopper attention prefill: interpreter correctness against the float64 reference, input
checks and results on a GPU (``gpu``, against float64); the compiled kernel's checks are in
``test_attention_prefill_hopper_ptx.py``."""

import importlib
import re
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import (assert_attention_close, poison_cuda_pool, random_qkv,
                                 tile_edge_lengths, very_negative_scores)
from kiln.kernels.attention import prefill_hopper
from kiln.kernels.attention.prefill import prefill
from kiln.kernels.attention.prefill_hopper import HopperPrefillConfig, MaskSpec
from kiln.runtime.cuda import cuda_available

# The module, not the function the package exports under the same name.
prefill_module = importlib.import_module("kiln.kernels.attention.prefill")
prefill_config = importlib.import_module("kiln.kernels.attention.prefill_config")
needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
STORAGE = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


def _check(rng, *, batch=1, sq=None, sk=None, hq=2, hkv=1, d=64, dtype="bf16", ragged=None,
           with_sinks=False, scale=None, qkv=None, **mask):
    """Run the kernel on the interpreter and compare elementwise with the float64 reference
    on the very same (exactly representable) inputs; ``qkv`` replaces the random draw."""
    lengths_q, lengths_k = ragged if ragged else (None, None)
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=batch, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d,
                                     ragged_q=lengths_q, ragged_k=lengths_k) \
        if qkv is None else (*qkv, None, None)
    sinks = rng.standard_normal(hq).astype(np.float32) * 2 if with_sinks else None
    cast = STORAGE[dtype]
    q, k, v = (x.astype(cast) for x in (q, k, v))
    o, lse = prefill(q, k, v, sinks=sinks, scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                     return_lse=True, backend="interpret", target="sm_90a", **mask)
    assert o.dtype == cast and o.shape == q.shape
    return assert_attention_close(o, q, k, v, lse=lse, sinks=sinks, scale=scale,
                                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **mask)


MASK_CASES = {
    "none": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(37, 5)),
    "window_left_only": dict(window=(50, -1)),
    "causal_window": dict(causal=True, window=(70, 0)),
    "chunk": dict(chunk=48),
    "causal_chunk": dict(causal=True, chunk=100),
}


# The persistent kernel with every opt-in overlap option (the overlapped walk, the zigzag
# causal deal, direct output stores).
OVERLAPPED = dict(overlap_items=True, zigzag=True, direct_store=True)


def _run_overlapped(monkeypatch, **options):
    """Make the persistent kernels ``prefill`` picks run with ``options`` (default
    ``OVERLAPPED``)."""
    picked = HopperPrefillConfig.for_shape
    monkeypatch.setattr(HopperPrefillConfig, "for_shape", lambda *a, **k: (
        replace(picked(*a, **k), **(options or OVERLAPPED)) if picked(*a, **k).persistent
        else picked(*a, **k)))


def _run_persistent(monkeypatch, **options):
    """Make ``prefill`` run the persistent kernel with ``options`` wherever it would run the
    persistent one or, under a causal mask, the one-tile kernel up to ``PERSISTENT_MAX_KEYS``
    keys."""
    picked = HopperPrefillConfig.for_shape
    monkeypatch.setattr(HopperPrefillConfig, "for_shape", lambda d, dv, keys, causal=False: (
        replace(picked(d, dv, keys, causal), persistent=True, **options)
        if keys <= prefill_config.PERSISTENT_MAX_KEYS and replace(
            picked(d, dv, keys, causal), persistent=True).q_buffers == 2
        else picked(d, dv, keys, causal)))


# The one-tile kernel's edge cases (long sequences take it) and the opt-in overlapped walk's run
# in the slow tier (CI runs it too); the default persistent kernel's here.
@pytest.fixture(params=["persistent", pytest.param("persistent_direct", marks=pytest.mark.slow),
                        pytest.param("overlapped", marks=pytest.mark.slow),
                        pytest.param("overlapped_staged", marks=pytest.mark.slow),
                        pytest.param("one_tile", marks=pytest.mark.slow),
                        pytest.param("skip_overlapped", marks=pytest.mark.slow),
                        pytest.param("skip_one_tile", marks=pytest.mark.slow)])
def kernel_kind(request, monkeypatch):
    """Short sequences run the persistent kernel; ``overlapped`` / ``overlapped_staged`` turn
    on its opt-in overlapped walk (output stored from the registers / staged in the Q buffer),
    ``persistent_direct`` stores the default walk's output from the registers;
    ``one_tile`` makes them run the kernel of one CTA a query tile, which long ones take;
    ``skip_*``: 64-key tiles whose first consumer group skips the tiles none of its rows sees
    (``skip_masked_tiles``), on the overlapped walk or one tile a CTA."""
    if request.param == "one_tile":
        monkeypatch.setattr(prefill_config, "PERSISTENT_MAX_KEYS", 0)
    elif request.param == "persistent_direct":
        _run_overlapped(monkeypatch, direct_store=True)
    elif request.param == "overlapped":
        _run_overlapped(monkeypatch)
    elif request.param == "overlapped_staged":
        _run_overlapped(monkeypatch, **dict(OVERLAPPED, direct_store=False))
    elif request.param.startswith("skip_"):
        picked = HopperPrefillConfig.for_shape
        fields = dict(OVERLAPPED, persistent=True) if request.param == "skip_overlapped" \
            else dict(persistent=False)
        monkeypatch.setattr(HopperPrefillConfig, "for_shape", lambda *a, **k: replace(
            picked(*a, **k), skip_masked_tiles=True, block_n=64, stages=4, **fields))
    return request.param


def test_short_sequences_take_the_persistent_kernel():
    longest = prefill_config.PERSISTENT_MAX_KEYS
    for dims in ((64, None), (96, None), (128, None), (192, 128)):
        assert HopperPrefillConfig.for_shape(*dims, longest).persistent
        assert not HopperPrefillConfig.for_shape(*dims, longest + 1).persistent
    # Causal: D 64 only (one tile a CTA is faster at D 128).
    assert HopperPrefillConfig.for_shape(64, None, longest, causal=True).persistent
    assert not HopperPrefillConfig.for_shape(128, None, 512, causal=True).persistent
    tiles = [(keys, causal, HopperPrefillConfig.for_shape(64, None, keys, causal))
             for keys in (512, 1024, 2048) for causal in (False, True)]
    assert [(keys, causal, c.block_n, c.stages) for keys, causal, c in tiles] == [
        (512, False, 128, 3), (512, True, 128, 3), (1024, False, 128, 3), (1024, True, 128, 3),
        (2048, False, 192, 3), (2048, True, 128, 3)]
    assert all(c.shared_bytes() <= prefill_config.SHARED_BUDGET for _, _, c in tiles)
    # The overlapped walk with direct stores: unmasked up to 1k keys, causal past 512.
    assert [(keys, causal) for keys, causal, c in tiles if c.overlaps_items and c.direct_store] \
        == [(512, False), (1024, False), (1024, True), (2048, True)]
    # D 256 at 512 keys: 64-key tiles, one tile a CTA; 80-key ones past that.
    assert [HopperPrefillConfig.for_shape(256, None, keys, causal).block_n
            for keys in (512, 513) for causal in (False, True)] == [64, 64, 80, 80]
    # D 96 causal: 64-key tiles skipping the first group's masked one up to 512 keys, then one
    # tile a CTA.
    short96 = HopperPrefillConfig.for_shape(96, 96, 512, causal=True)
    assert (short96.persistent, short96.block_n, short96.stages, short96.skip_masked_tiles,
            short96.head_dim_v, short96.q_buffers) == (True, 64, 4, True, None, 2)
    assert not HopperPrefillConfig.for_shape(96, None, 513, causal=True).persistent
    # O accumulators of 192 or 256 columns would spill in the persistent loop.
    assert not HopperPrefillConfig.for_shape(256, None, 512).persistent
    assert not HopperPrefillConfig.for_shape(192, None, 512).persistent
    # A second Q buffer fits beside the K/V ring at D <= 128, not at 192 / 128 or 256.
    buffers = {dims: replace(HopperPrefillConfig.for_head_dim(*dims), persistent=True).q_buffers
               for dims in ((64, None), (128, None), (192, 128), (256, None))}
    assert buffers == {(64, None): 2, (128, None): 2, (192, 128): 1, (256, None): 1}
    assert HopperPrefillConfig.for_head_dim(128).q_buffers == 1
    q = np.zeros((3, 512, 4, 64), ml_dtypes.bfloat16)
    shapes = dict(batch=3, hq=4, hkv=2, d=64, dv=64)
    kernel, args, grid, _, _ = prefill_module._operands(
        q, q[:, :, :2], q[:, :, :2], None, None, None, shapes, MaskSpec(causal=True), 0.125,
        0.0, False, interpret=True)
    # 4 query tiles x 4 heads x 3 sequences: one CTA each of INTERPRET_CTAS walks them.
    assert grid == (prefill_module.INTERPRET_CTAS, 1, 1) and args[-2:] == [4, 3]
    assert kernel.__name__.endswith("_persistent")


def test_default_softmax_schedule_per_head_dim():
    for d in (64, 128):
        config = HopperPrefillConfig.for_head_dim(d)
        assert config.lazy_rescale and config.exp_before_max and not config.pin_pv_wait
    config = HopperPrefillConfig.for_head_dim(256)
    assert config.lazy_rescale and not config.exp_before_max
    assert HopperPrefillConfig.for_head_dim(128).block_n == 128
    with pytest.raises(kiln.KilnValueError, match="lazy_rescale"):
        HopperPrefillConfig(head_dim=128, exp_before_max=True)


@pytest.mark.parametrize("schedule", [dict(lazy_rescale=False),
                                      dict(lazy_rescale=True, pin_pv_wait=True)],
                         ids=["max_first", "max_first_lazy_pinned"])
def test_max_first_schedules_match_the_reference(monkeypatch, schedule, rng):
    # The schedules D = 256 keeps (the tile's max before exp2, per-warp vote or none) at D = 128,
    # with a window: rows whose first visible key lies past the first tile.
    built = []
    config = replace(HopperPrefillConfig.for_head_dim(128), exp_before_max=False, **schedule)
    monkeypatch.setattr(HopperPrefillConfig, "for_shape", lambda d, dv, keys, causal: config)
    monkeypatch.setattr(prefill_module, "make_kernel",
                        lambda dtype, config, *rest: built.append(config) or
                        prefill_hopper.make_kernel(dtype, config, *rest))
    _check(rng, sq=150, sk=420, d=128, window=(60, 10), with_sinks=True)
    assert built == [config]


@pytest.mark.parametrize("d", [64, 128])
def test_a_key_far_above_the_running_max_is_redone(d, rng):
    # Key 300 (in the second or third key tile) scores 140-210 log2 units above every earlier
    # key for the first 40 query rows (non-negative q) and up to ~25 more for about half of the
    # others: P against the running max would be inf in the first rows, so the warp groups'
    # votes must send the tile back through its max (NaN otherwise).
    cast = ml_dtypes.bfloat16
    q = rng.standard_normal((1, 130, 2, d)).astype(cast)
    k = (rng.standard_normal((1, 600, 1, d)) * 0.5).astype(cast)
    v = rng.standard_normal((1, 600, 1, d)).astype(cast)
    q[0, :40] = np.abs(q[0, :40])
    k[0, 300] = 16.0
    o, lse = prefill(q, k, v, return_lse=True, backend="interpret", target="sm_90a")
    assert np.isfinite(o.astype(np.float32)).all()
    assert_attention_close(o, q, k, v, lse=lse)


def test_a_per_warp_vote_around_the_redo_is_caught(monkeypatch, rng):
    # The redo issues a WGMMA, which the whole warp group must reach: voting per warp
    # (any_lane) instead of per group lets some warps take it alone (a GPU hangs there).
    monkeypatch.setattr(prefill_hopper.nvidia_asm, "named_barrier_any",
                        lambda barrier, threads, flag: kiln.shuffle.any_lane(flag))
    with pytest.raises(kiln.KilnValueError, match="of the 128 threads of warp group"):
        _check(rng, sq=150, sk=290, d=128, window=(37, 5))


@pytest.mark.parametrize("mask", MASK_CASES.values(), ids=MASK_CASES.keys())
@pytest.mark.slow
def test_every_mask_kind(mask, rng):
    # 150 queries x 290 keys: partial query and key tiles, boundary and interior key tiles.
    _check(rng, sq=150, sk=290, **mask)


# Tile-edge residues at D = 64: 128 query rows per CTA (two consumer groups), 192-key tiles
# (128 on the persistent kernel that short sequences run).
BLOCK_Q = 2 * prefill_hopper.WARP_GROUP_ROWS
BLOCK_N = HopperPrefillConfig.for_head_dim(64).block_n
RESIDUE_MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(BLOCK_N - 1, 1)),  # both bounds one key off a causal edge
    "causal_window": dict(causal=True, window=(BLOCK_N + 1, -1)),
    "chunk": dict(chunk=BLOCK_N - 1),
}


def _check_residues(rng, mask, *, every):
    # The key tile of the kernel these (short) sequences run: 128 keys on the persistent one.
    block_n = HopperPrefillConfig.for_shape(64, None, 4 * BLOCK_N).block_n
    lengths = tile_edge_lengths(BLOCK_Q, block_n, every=every)
    assert max(lengths[1]) <= 4 * BLOCK_N
    _check(rng, batch=len(lengths[0]), hq=1, hkv=1, d=64, ragged=lengths, **mask)


# causal bounds the loop on both sides; the other masks (2 s each in the interpreter) run in
# the slow tier, which CI also runs (make test has them at odd sizes in test_attention_prefill_dims:
# no mask at d96, a window at d40, a chunk at d136, causal with a window at d64_v104)
@pytest.mark.parametrize("mask", [m if name == "causal" else pytest.param(m, marks=pytest.mark.slow)
                                  for name, m in RESIDUE_MASKS.items()], ids=RESIDUE_MASKS.keys())
def test_masks_at_tile_edge_residues(mask, kernel_kind, rng):
    """Sk - Sq at 0, 1, 2, -2 and -1 modulo the key tile (and negative), Sq around a query
    tile: a boundary tile whose mask is skipped or bounded one key off errs there."""
    _check_residues(rng, mask, every=False)


@pytest.mark.slow
@pytest.mark.parametrize("mask", RESIDUE_MASKS.values(), ids=RESIDUE_MASKS.keys())
def test_masks_at_every_residue(mask, rng):
    """Every residue of Sk - Sq modulo the 192-key tile, in one ragged launch per mask."""
    _check_residues(rng, mask, every=True)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_whose_every_score_is_very_negative(causal, rng):
    """Rows whose scores all lie near one offset from 0 down to -1e4 (natural units): the
    sentinel start takes each row against its own max, so none underflows."""
    _check(rng, hq=1, hkv=1, qkv=very_negative_scores(rng, sq=64, sk=250, d=64), causal=causal)


def test_fully_masked_key_tiles_are_never_read(rng):
    # 128 queries at key positions 384..511 with window (10, 0) see keys 374..511: the key
    # tiles before the one holding key 374 are outside every row. Poisoned with NaN they must
    # not matter (a loaded V tile would spread NaN through 0 * NaN even where P is 0).
    bf = ml_dtypes.bfloat16
    q, k, v = (x.astype(bf) for x in random_qkv(rng, batch=1, sq=128, sk=512, hq=2, hkv=1,
                                                d=64)[:3])
    block_n = HopperPrefillConfig.for_head_dim(64).block_n
    skipped = 374 // block_n * block_n
    assert skipped >= 128  # at least one whole tile is skipped
    k_poisoned, v_poisoned = k.copy(), v.copy()
    k_poisoned[:, :skipped] = np.nan
    v_poisoned[:, :skipped] = np.nan
    o = prefill(q, k_poisoned, v_poisoned, window=(10, 0), backend="interpret")
    assert_attention_close(o, q, k, v, window=(10, 0))


@pytest.mark.slow
@pytest.mark.parametrize("direct_store", [True, False], ids=["direct", "staged"])
def test_an_item_no_row_sees_ignores_the_keys_it_reads(direct_store, monkeypatch, rng):
    # The persistent kernel visits one key tile even for 128 query rows that see no key
    # (sequence 0: no keys); that tile is the next sequence's keys 0..127, a tile no row of
    # that sequence visits (window (10, 0) over 200 keys), NaN here: 0 * NaN must not reach
    # sequence 0's output.
    bf = ml_dtypes.bfloat16
    lengths = ([128, 1, 150], [0, 200, 150])
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=None, sk=None, hq=2, hkv=1, d=64,
                                     ragged_q=lengths[0], ragged_k=lengths[1])
    q, k, v = (x.astype(bf) for x in (q, k, v))
    k_poisoned, v_poisoned = k.copy(), v.copy()
    k_poisoned[:128] = np.nan
    v_poisoned[:128] = np.nan
    _run_overlapped(monkeypatch, **dict(OVERLAPPED, direct_store=direct_store))
    o, lse = prefill(q, k_poisoned, v_poisoned, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                     window=(10, 0), return_lse=True, backend="interpret", target="sm_90a")
    assert HopperPrefillConfig.for_shape(64, None, 200).overlaps_items
    assert_attention_close(o, q, k, v, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           window=(10, 0))


@pytest.mark.parametrize("overlap_items", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["overlapped", "one_by_one"])
def test_causal_walk_deals_every_second_round_in_reverse(overlap_items, monkeypatch, rng):
    # 5 query tiles x 2 heads = 10 work items over the interpreter's 3 CTAs: rounds 0, 1, 2
    # are full (round 1 dealt in reverse), the last item alone.
    assert prefill_module.INTERPRET_CTAS == 3
    _run_overlapped(monkeypatch, **dict(OVERLAPPED, overlap_items=overlap_items))
    assert HopperPrefillConfig.for_shape(64, None, 600, True).zigzag
    _check(rng, sq=600, sk=600, hq=2, hkv=1, causal=True)


@pytest.mark.parametrize("sq,sk", [(300, 100), (64, 64), (1, 200), (200, 1)])
def test_causal_is_bottom_right_aligned_when_lengths_differ(sq, sk, rng):
    # sq > sk leaves the first sq - sk query rows with no key at all (o = 0, lse = -inf).
    want_lse = _check(rng, sq=sq, sk=sk, causal=True)
    assert np.isinf(want_lse).any() == (sq > sk)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
def test_grouped_query_heads(hq, hkv, kernel_kind, rng):
    _check(rng, sq=70, sk=130, hq=hq, hkv=hkv, causal=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.slow
def test_head_dims(d, rng):
    _check(rng, sq=80, sk=200, d=d, window=(90, 20))


def test_f16_and_custom_scale(rng):
    _check(rng, sq=90, sk=90, dtype="f16", scale=0.3, causal=True)


def test_sinks_enlarge_the_denominator(rng):
    # Causal with sq > sk: rows without keys keep the sink alone (o = 0, lse = sink).
    _check(rng, sq=160, sk=120, causal=True, with_sinks=True)
    _check(rng, sq=64, sk=200, hq=4, hkv=2, with_sinks=True, chunk=64)


def test_ragged_batch(kernel_kind, rng):
    # Empty sequences, lengths below and above one tile, more keys than queries (persistent:
    # the work items past a sequence's last row are skipped by all three warp groups).
    _check(rng, batch=4, hq=4, hkv=2, d=128,
           ragged=([33, 0, 140, 7], [50, 9, 150, 0]), causal=True, with_sinks=True)


def test_ragged_batch_with_window(rng):
    _check(rng, batch=2, ragged=([129, 40], [129, 300]), window=(60, 60))


def test_numpy_output_without_lse_keeps_input_layout(rng):
    bf = ml_dtypes.bfloat16
    q, k, v = (x.astype(bf) for x in random_qkv(rng, batch=2, sq=20, sk=30, hq=2, hkv=2,
                                                d=64)[:3])
    o = prefill(q, k, v, backend="interpret")
    assert_attention_close(o, q, k, v)


def test_gfx950_target_dispatches_to_the_gfx950_kernel(rng):
    bf = ml_dtypes.bfloat16
    q, k, v = (x.astype(bf) for x in random_qkv(rng, batch=1, sq=40, sk=70, hq=2, hkv=1,
                                                d=64)[:3])
    o = prefill(q, k, v, causal=True, target="gfx950", backend="interpret")
    assert_attention_close(o, q, k, v, causal=True)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(q_shape=(1, 8, 2, 100)), kiln.UnsupportedError, "head dim"),
    (dict(q_shape=(1, 8, 3, 64)), kiln.KilnValueError, "not a multiple"),
    (dict(q_shape=(8, 2, 64)), kiln.KilnValueError, "expected [B, S, H, D]"),
    (dict(dtype=np.float32), kiln.UnsupportedError, "dtypes"),
    (dict(window=(3,)), kiln.KilnValueError, "window"),
    (dict(chunk=0), kiln.KilnValueError, "chunk"),
    (dict(sinks=np.zeros(3, np.float32)), kiln.KilnValueError, "sinks"),
    (dict(cu_seqlens_q=np.array([0, 8], np.int32)), kiln.KilnValueError, "together"),
    (dict(backend="cpu"), kiln.KilnValueError, "backend"),
    (dict(target="sm_80"), kiln.UnsupportedError, "WGMMA"),
])
def test_bad_inputs_fail_before_compiling(kwargs, error, words):
    q_shape = kwargs.pop("q_shape", (1, 8, 2, 64))
    dtype = kwargs.pop("dtype", ml_dtypes.bfloat16)
    q = np.ones(q_shape, dtype)
    k = np.ones((1, 8, 2, 64) if len(q_shape) == 4 else (8, 2, 64), dtype)
    with pytest.raises(error, match=re.escape(words)) as info:
        prefill(q, k, k, **kwargs)
    assert info.value.fix


def test_config_rejects_what_does_not_fit():
    with pytest.raises(kiln.UnsupportedError, match="head_dim"):
        HopperPrefillConfig(head_dim=100)
    with pytest.raises(kiln.ResourceError, match="shared memory"):
        HopperPrefillConfig(head_dim=256, block_n=128, stages=3)


# ---------------------------------------------------------------------------------------------
# On a GPU: against the float64 reference on the same seeded inputs, outputs poisoned
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "causal_gqa": dict(b=2, sq=1000, sk=1000, hq=8, hkv=2, d=128, causal=True),
    "causal_sq_lt_sk": dict(b=1, sq=300, sk=777, hq=4, hkv=4, d=64, causal=True),
    "window_sinks": dict(b=2, sq=513, sk=513, hq=4, hkv=1, d=128, window=(100, 20), sinks=True),
    "chunk_d256": dict(b=1, sq=400, sk=400, hq=2, hkv=1, d=256, chunk=128),
    "none_d64": dict(b=3, sq=257, sk=129, hq=16, hkv=16, d=64),
    # Unmasked over many key tiles, the last one partial (8300 = 64 x 128 + 108).
    "none_long_keys": dict(b=1, sq=300, sk=8300, hq=4, hkv=2, d=128),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_matches_float64_on_gpu(case, rng):
    import torch

    case = dict(case)
    b, sq, sk, hq, hkv, d = (case.pop(n) for n in ("b", "sq", "sk", "hq", "hkv", "d"))
    with_sinks = case.pop("sinks", False)
    q, k, v = (x.astype(ml_dtypes.bfloat16)
               for x in random_qkv(rng, batch=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d)[:3])
    sinks = rng.standard_normal(hq).astype(np.float32) if with_sinks else None
    dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16) for x in (q, k, v)]
    poison_cuda_pool(torch, 2 * q.nbytes)
    o, lse = prefill(*dev, sinks=None if sinks is None else torch.from_numpy(sinks).cuda(),
                     return_lse=True, **case)
    assert_attention_close(o, q, k, v, lse=lse, sinks=sinks, **case)


@pytest.mark.gpu
@needs_gpu
def test_ragged_and_lse_on_gpu(rng):
    import torch

    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=None, sk=None, hq=4, hkv=2, d=128,
                                     ragged_q=[300, 1, 129], ragged_k=[400, 64, 129])
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16) for x in (q, k, v)]
    poison_cuda_pool(torch, 2 * q.nbytes)
    o, lse = prefill(*dev, cu_seqlens_q=torch.from_numpy(cu_q).cuda(),
                     cu_seqlens_k=torch.from_numpy(cu_k).cuda(), causal=True, return_lse=True)
    assert_attention_close(o, q, k, v, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           causal=True)


PERSISTENT_WALKS = {
    "d64_causal_ragged": dict(d=64, causal=True,
                              lengths=([300, 1, 129, 0, 512], [400, 64, 129, 5, 512])),
    "d128_window_sinks": dict(d=128, window=(100, 20), sinks=True,
                              lengths=([513, 200, 77], [513, 260, 700])),
    "d128_causal_ragged": dict(d=128, causal=True,
                               lengths=([700, 129, 1, 256], [700, 200, 64, 256])),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("walk", ["picked", "overlapped", "one_by_one"])
@pytest.mark.parametrize("case", PERSISTENT_WALKS.values(), ids=PERSISTENT_WALKS.keys())
def test_persistent_ctas_walk_many_work_items_on_gpu(case, walk, monkeypatch, rng):
    """Two CTAs walk every work item of a ragged batch (items past a sequence's end, sequences
    without rows or keys among them): the K/V ring, the Q buffers and the turns run on across
    items of different lengths; in the walk ``prefill`` picks, and in the overlapped and
    one-by-one walks whichever it picks."""
    import torch

    monkeypatch.setattr(prefill_module.runtime, "multiprocessor_count", lambda: 2)
    if walk != "picked":
        _run_persistent(monkeypatch, **(OVERLAPPED if walk == "overlapped" else
                                        dict(overlap_items=False, direct_store=False)))
    case = dict(case)
    d, (lengths_q, lengths_k), with_sinks = case.pop("d"), case.pop("lengths"), \
        case.pop("sinks", False)
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=len(lengths_q), sq=None, sk=None, hq=4, hkv=2,
                                     d=d, ragged_q=lengths_q, ragged_k=lengths_k)
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    sinks = rng.standard_normal(4).astype(np.float32) if with_sinks else None
    dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16) for x in (q, k, v)]
    poison_cuda_pool(torch, 2 * q.nbytes)
    o, lse = prefill(*dev, cu_seqlens_q=torch.from_numpy(cu_q).cuda(),
                     cu_seqlens_k=torch.from_numpy(cu_k).cuda(), return_lse=True,
                     sinks=None if sinks is None else torch.from_numpy(sinks).cuda(), **case)
    assert_attention_close(o, q, k, v, lse=lse, sinks=sinks, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, **case)


def test_fragment_helpers_reject_wrong_kinds():
    @kiln.kernel
    def wrong_element_dtype(x: kiln.Tensor[kiln.f32, 1]):
        kiln.wgmma.fragment_from_elements([kiln.cast(1, kiln.i32)] * 4)

    @kiln.kernel
    def wrong_tile(x: kiln.Tensor[kiln.f32, 1]):
        tile = kiln.wgmma.fragment_to_tile(kiln.wgmma.fragment_zeros(16))
        kiln.wgmma.fragment_from_tile(tile.T)

    x = np.ones(4, np.float32)
    with pytest.raises(kiln.KilnTypeError, match="must be f32"):
        wrong_element_dtype.trace(x, target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="wgmma_m64_accumulator"):
        wrong_tile.trace(x, target="sm_90a")


@pytest.mark.gpu
@needs_gpu
def test_repeat_dense_calls_reuse_one_bound_plan(rng):
    """The dense torch path binds one launch per shape class: fresh tensors each call (new
    addresses, poisoned outputs reused by the allocator) still match the float64 reference,
    with the LSE; a non-contiguous q takes the general path and agrees."""
    import importlib

    import torch

    prefill_module = importlib.import_module("kiln.kernels.attention.prefill")
    prefill_module._PLANS.clear()
    for _ in range(3):
        q, k, v = (x.astype(ml_dtypes.bfloat16) for x in
                   random_qkv(rng, batch=2, sq=200, sk=300, hq=4, hkv=2, d=64)[:3])
        poison_cuda_pool(torch, 2 * 2 * 200 * 4 * 64 * 4)
        dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
               for x in (q, k, v)]
        o, lse = prefill(*dev, causal=True, return_lse=True)
        assert_attention_close(o, q, k, v, lse=lse, causal=True)
    assert len(prefill_module._PLANS) == 1
    strided_q = dev[0].transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided_q.is_contiguous()
    o_general = prefill(strided_q, dev[1], dev[2], causal=True)
    torch.testing.assert_close(o_general, o, atol=0, rtol=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, False)])
@pytest.mark.parametrize("direct_store", [True, False], ids=["direct", "staged"])
def test_overlapped_walk_last_items_on_gpu(d, causal, direct_store, monkeypatch, rng):
    """Sixteen CTAs, each walking four or more 512-key items: every CTA's last item's product
    (issued after the item loop) read outside shared memory at D 64 causal and the wrong
    bytes at D 96 / 128 when ptxas dropped its descriptor's upper word (docs/kernels.md)."""
    import torch

    monkeypatch.setattr(prefill_module.runtime, "multiprocessor_count", lambda: 16)
    _run_overlapped(monkeypatch, **dict(OVERLAPPED, direct_store=direct_store))
    q, k, v = (x.astype(ml_dtypes.bfloat16)
               for x in random_qkv(rng, batch=2, sq=512, sk=512, hq=8, hkv=8, d=d)[:3])
    dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16) for x in (q, k, v)]
    poison_cuda_pool(torch, 2 * q.nbytes)
    o, lse = prefill(*dev, causal=causal, return_lse=True)
    assert_attention_close(o, q, k, v, lse=lse, causal=causal)
