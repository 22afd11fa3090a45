"""Split-KV paged decode: the interpreter against a float64 numpy reference; GPU against torch."""

import importlib
import math
import re
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.attention.decode import (DecodeConfig, decode, default_config,
                                           default_num_splits, early_launch_tiles)
from kiln.kernels.runtime import PlanCache

from attention_reference import (assert_paged_attention_close, attention_reference,
                                 paged_attention_reference, poison_cuda_pool)

# The module, not the function the package exports under the same name.
decode_module = importlib.import_module("kiln.kernels.attention.decode")
plan_module = importlib.import_module("kiln.kernels.attention.decode_plan")

BN = DecodeConfig().block_n
D = 64
# P is rounded to bf16 to feed the tensor cores (P.V in mma.sync), so O carries bf16 relative
# error on each weight; LSE comes from the f32 probabilities.
# 4e-3 ~ 2^-8, bf16's unit roundoff u: the bound u * sum_j P_j |v_j| of that error where
# sum P|v| stays near 1 (random scores spread P over many keys).
O_TOL = dict(atol=4e-3, rtol=4e-3)


def _problem(rng, batch, sq, hq, hkv, page_size, seq_lens, *, sinks=False, head_dim=D):
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = batch * max_pages + 3
    shape = (num_pages, page_size, hkv, head_dim)
    k_cache = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    v_cache = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    # Pages of every sequence scattered over the pool, beyond-the-end entries are garbage ids.
    pool = rng.permutation(num_pages)
    table = pool[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    q = rng.standard_normal((batch, sq, hq, head_dim)).astype(ml_dtypes.bfloat16)
    lens = np.asarray(seq_lens, np.int32)
    sink = rng.standard_normal(hq).astype(np.float32) if sinks else None
    return q, k_cache, v_cache, table, lens, sink


def _gather(cache, table, b, length):
    """The first ``length`` logical rows of sequence ``b``: ``[length, Hkv, D]`` float64."""
    page_size = cache.shape[1]
    rows = np.arange(length)
    return cache[table[b, rows // page_size], rows % page_size].astype(np.float64)


def _partial(q_row, keys, values, scale, sink=None):
    """(O, LSE) of softmax over ``keys`` (natural log), with an optional sink logit."""
    logits = keys @ q_row * scale
    if sink is not None:
        logits = np.append(logits, sink)
    if logits.size == 0:
        return np.zeros(q_row.shape), -np.inf
    m = logits.max()
    w = np.exp(logits - m)
    o = w[:keys.shape[0]] @ values / w.sum() if keys.shape[0] else np.zeros(q_row.shape)
    return o, m + np.log(w.sum())


def _reference_splits(q, k_cache, v_cache, table, lens, num_splits, scale, sinks=None, *,
                      head_dim=D, block_n=BN):
    """Expected ``O_partial``, ``LSE_partial``, ``split_counts`` of the split schedule of
    ``block_n``-key tiles."""
    BN = block_n
    B, Sq, Hq, _ = q.shape
    group = Hq // k_cache.shape[2]
    o = np.zeros((num_splits, B, Sq, Hq, head_dim))
    lse = np.full((num_splits, B, Sq, Hq), -np.inf)
    counts = np.zeros((B, Sq, Hq), np.int32)
    for b in range(B):
        L = int(lens[b])
        tiles = -(-L // BN)
        per_split = max(-(-tiles // num_splits), 1)
        keys, values = _gather(k_cache, table, b, L), _gather(v_cache, table, b, L)
        for i in range(Sq):
            visible = L - Sq + i + 1
            for h in range(Hq):
                counts[b, i, h] = -(-(-(-max(visible, 0) // BN)) // per_split)
                for s in range(num_splits):
                    lo = min(s * per_split * BN, visible)
                    hi = min((s + 1) * per_split * BN, max(visible, 0))
                    sink = sinks[h] if sinks is not None and s == 0 else None
                    o[s, b, i, h], lse[s, b, i, h] = _partial(
                        q[b, i, h].astype(np.float64), keys[lo:hi, h // group],
                        values[lo:hi, h // group], scale, sink)
    return o, lse, counts


def _merge(o_part, lse_part, counts):
    """numpy LSE merge of the first ``counts`` slots (the combine contract)."""
    S = o_part.shape[0]
    valid = np.arange(S)[:, None, None, None] < counts[None]
    lse = np.where(valid, lse_part, -np.inf)
    m = lse.max(axis=0)
    w = np.where(valid, np.exp(lse - np.where(np.isfinite(m), m, 0)), 0.0)
    z = w.sum(axis=0)
    return (w[..., None] * np.where(valid[..., None], o_part, 0)).sum(axis=0) / \
        np.where(z > 0, z, 1)[..., None]


def _check_partials(got, want, counts_want):
    o, lse, counts = got
    o_want, lse_want, _ = want
    np.testing.assert_array_equal(counts, counts_want)
    finite = np.isfinite(lse_want)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_want[finite], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o, o_want, **O_TOL)


@pytest.mark.parametrize("page_size,group,sq", [(1, 1, 1), (16, 4, 4), (64, 8, 1),
                                                (16, 8, 4), (64, 1, 4), (16, 4, 16)])
@pytest.mark.slow
def test_split_partials_match_numpy(page_size, group, sq, rng):
    hkv = 2 if group < 8 else 1
    lens = [int(rng.integers(sq, 3 * BN)), int(rng.integers(2 * BN, 4 * BN))]  # ragged
    q, kc, vc, table, seq_lens, _ = _problem(rng, 2, sq, group * hkv, hkv, page_size, lens)
    num_splits = 3
    got = decode(q, kc, vc, table, seq_lens, num_splits=num_splits, backend="interpret")
    want = _reference_splits(q, kc, vc, table, seq_lens, num_splits, D ** -0.5)
    _check_partials(got, want, want[2])
    merged = _merge(*got)
    np.testing.assert_allclose(merged, paged_attention_reference(q, kc, vc, table, seq_lens)[0],
                               **O_TOL)


@pytest.mark.parametrize("lazy_rescale", [True, False])
def test_a_key_that_dominates_after_the_first_tile_rescales_the_output(lazy_rescale, rng):
    """One CTA walks five tiles, and a key of tile 2 scores ~160 log2 units above every key
    before it for query head 0: the row's running max, sum and O must move to it (against the
    old max its probability would overflow f32), and match the float64 reference. With
    ``lazy_rescale`` only that tile's vote moves the max."""
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 1, 4, 1, 16, [5 * BN])
    head = q[0, 0, 0].astype(np.float64)
    unit = D ** -0.5 * np.log2(np.e)  # log2 units of a unit dot product
    key = 2 * BN + 5
    before = (_gather(kc, table, 0, key)[:, 0] @ head * unit).max()
    gain = (before + 160) / (head @ head * unit)
    kc[table[0, key // 16], key % 16, 0] = (gain * head).astype(ml_dtypes.bfloat16)
    jump = kc[table[0, key // 16], key % 16, 0].astype(np.float64) @ head * unit - before
    assert jump > 128  # 2**128 is inf in f32

    config = replace(default_config(4, D, 16), lazy_rescale=lazy_rescale)
    got = decode(q, kc, vc, table, seq_lens, num_splits=1, config=config, backend="interpret")
    np.testing.assert_allclose(_merge(*got), paged_attention_reference(q, kc, vc, table,
                                                                       seq_lens)[0], **O_TOL)


def test_sinks_scale_and_empty_sequence(rng):
    """A zero-length sequence has no valid split; sinks only enlarge split 0's denominator."""
    q, kc, vc, table, seq_lens, sinks = _problem(rng, 2, 1, 4, 2, 16, [0, BN + 5], sinks=True)
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, scale=0.3, sinks=sinks,
                 backend="interpret")
    want = _reference_splits(q, kc, vc, table, seq_lens, 2, 0.3, sinks)
    _check_partials(got, want, want[2])
    assert (got[2][0] == 0).all()


@pytest.mark.parametrize("page_size", [16, 64])
def test_block_sparse_selection(page_size, rng):
    """Slot j holds block block_table[b, i, kv, j]; -1 padding, empty rows give C = 0."""
    B, Sq, Hq, Hkv, top_k = 2, 2, 4, 2, 3
    lens = [4 * BN, 3 * BN + 7]
    q, kc, vc, table, seq_lens, _ = _problem(rng, B, Sq, Hq, Hkv, page_size, lens)
    blocks = np.full((B, Sq, Hkv, top_k), -1, np.int32)
    blocks[0, 0, 0] = [2, 0, -1]
    blocks[0, 1, 1] = [3, 1, 2]
    blocks[1, 0, 0] = [3, -1, -1]  # the partial last block
    blocks[1, 1, 0] = [1, 0, 3]   # blocks[1, 1, 1] and others select nothing
    o, lse, counts = decode(q, kc, vc, table, seq_lens, block_table=blocks, backend="interpret")
    group = Hq // Hkv
    for b in range(B):
        L = int(seq_lens[b])
        keys, values = _gather(kc, table, b, L), _gather(vc, table, b, L)
        for i in range(Sq):
            visible = L - Sq + i + 1
            for h in range(Hq):
                selected = blocks[b, i, h // group]
                assert counts[b, i, h] == (selected >= 0).sum()
                for j, blk in enumerate(selected):
                    if blk < 0:
                        assert lse[j, b, i, h] == -np.inf and (o[j, b, i, h] == 0).all()
                        continue
                    lo, hi = blk * BN, min((blk + 1) * BN, visible)
                    o_want, lse_want = _partial(q[b, i, h].astype(np.float64),
                                                keys[lo:hi, h // group], values[lo:hi, h // group],
                                                D ** -0.5)
                    np.testing.assert_allclose(lse[j, b, i, h], lse_want, rtol=1e-4, atol=1e-4)
                    np.testing.assert_allclose(o[j, b, i, h], o_want, **O_TOL)


def test_bad_inputs_raise_kiln_errors(rng):
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 1, 3, 2, 16, [10])
    with pytest.raises(kiln.UnsupportedError, match="multiple of Hkv") as error:
        decode(q, kc, vc, table, seq_lens, backend="interpret")
    assert error.value.loc.filename == __file__  # the caller's line, not the kernel module's
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 1, 2, 2, 16, [10])
    with pytest.raises(kiln.UnsupportedError):
        decode(q, kc[:, :12], vc[:, :12], table, seq_lens, backend="interpret")
    with pytest.raises(kiln.KilnTypeError, match="bf16"):
        decode(q.astype(np.float32), kc, vc, table, seq_lens, backend="interpret")
    for scale in (0.0, -0.1):
        with pytest.raises(kiln.KilnValueError, match="must be positive") as error:
            decode(q, kc, vc, table, seq_lens, scale=scale, backend="interpret")
        assert error.value.loc.filename == __file__


def test_early_launch_is_chosen_by_the_tiles_a_split_holds():
    config = DecodeConfig()
    assert early_launch_tiles(config, 128, 64, 65536, 16) == 6  # 64 tiles a split, 192 KB
    assert early_launch_tiles(config, 128, 64, 16384, 8) == 6  # 32 tiles
    assert early_launch_tiles(config, 64, 64, 65536, 16) == 12  # tiles of 16 KB
    # Splits of at most SHORT_SPLIT_TILES tiles prefetch at most 3.
    assert early_launch_tiles(config, 128, 64, 16384, 16) == 3  # 16 tiles a split
    assert early_launch_tiles(config, 128, 64, 4096, 4) == 3
    assert early_launch_tiles(config, 64, 64, 1024, 2) == 3  # 8 tiles of 16 KB
    assert early_launch_tiles(config, 256, 128, 65536, 16) == 3  # 64 KB tiles, 64 a split
    assert early_launch_tiles(config, 128, 64, 4096, 16) == 0  # 4 tiles: over before it helps
    assert early_launch_tiles(config, 128, 64, 16384, 1) == 0  # 256 tiles: the launch costs
    assert early_launch_tiles(config, 128, 16, 16384, 16) == 0  # 4 pages a tile


def test_early_launch_reads_the_split_through_the_interpreter(rng):
    """A split of 8 tiles prefetches its first 3 tiles' pages before the grid-dependency wait
    (the interpreter runs the page look-ups and skips the prefetch) and still matches numpy."""
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 1, 4, 1, 64, [16 * BN - 5])
    plan = plan_module.get_plan(q, kc, vc, table, seq_lens, 2, None, None, None, None,
                                "interpret", None, fused=False)
    assert plan.kernel.__name__.endswith("_pf3")
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret")
    want = _reference_splits(q, kc, vc, table, seq_lens, 2, D ** -0.5)
    _check_partials(got, want, want[2])


def test_short_splits_ring_four_stages(rng):
    """A default mma.sync config rings 4 stages where a split holds at most
    ``SHORT_SPLIT_TILES`` tiles, else 3; block-sparse calls (a block a split), WGMMA defaults
    and configs given by the caller keep theirs. A plan of 9 tiles a split takes the 4-stage
    kernel, one of 17 the 3-stage one (the interpreter test above runs a 4-stage ring that
    wraps twice)."""
    assert decode_module.SHORT_SPLIT_TILES == 16
    assert default_config(32, 128, tiles_per_split=16) == DecodeConfig(num_warps=8, stages=4)
    assert default_config(8, 128, tiles_per_split=17) == DecodeConfig()
    assert default_config(8, 128, block_sparse=True, tiles_per_split=1).stages == 3
    assert default_config(64, 128, tiles_per_split=64) == DecodeConfig(consumer="wgmma", stages=4)
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 1, 4, 1, 64, [34 * BN - 5])
    plans = [plan_module.get_plan(q, kc, vc, table, seq_lens, splits, None, None, None, None,
                                  "interpret", config, fused=False)
             for splits, config in ((4, None), (2, None), (4, DecodeConfig()))]
    short_config = DecodeConfig(stages=4)  # 4 packed rows at D 64: one group of 4 warps
    assert [plan.kernel for plan in plans] == [  # 9, 17 and 9 tiles a split
        decode_module.make_kernel(D, 4, 1, 64, False, False, config, 0, 1, prefetch)
        for config, prefetch in ((short_config, 3), (DecodeConfig(), 12), (DecodeConfig(), 3))]


def test_early_launch_prefetches_before_the_wait_and_lets_the_next_kernel_start_after_it():
    def ops(prefetch_tiles):
        ck = decode_module.compile_decode(target="sm_90a", sq=4, fused_slots=16, merge_slices=4,
                                          prefetch_tiles=prefetch_tiles)
        return re.findall(r"nvvm\.(cp\.async\.bulk\.tensor\.prefetch|griddepcontrol +\w+)",
                          ck.asm["kiln"])

    order = [" ".join(op.split()) for op in ops(6)]
    per_tile = 2 * 2  # K, V x halves
    ahead = decode_module.AHEAD_PREFETCH_TILES
    assert order.count("cp.async.bulk.tensor.prefetch") == (6 + ahead) * per_tile
    wait = order.index("griddepcontrol wait")
    assert order[:wait] == ["cp.async.bulk.tensor.prefetch"] * 6 * per_tile
    # After the wait: the next kernel may launch, then the producer's prefetch of the tiles
    # after the prefetched ones goes out with the first tiles' copies.
    assert order[wait + 1:] == ["griddepcontrol launch_dependents"] + \
        ["cp.async.bulk.tensor.prefetch"] * ahead * per_tile
    assert [" ".join(op.split()) for op in ops(0)] == ["griddepcontrol wait"]
    with pytest.raises(kiln.UnsupportedError, match="one page a tile"):
        decode_module.compile_decode(target="sm_90a", page_size=16, prefetch_tiles=2)


def test_default_num_splits():
    """One full wave of one CTA per SM on 132 SMs, never a second, nearly empty one."""
    assert default_num_splits(1, 8, 16384) == 16
    assert default_num_splits(4, 8, 65536) == 4
    assert default_num_splits(16, 8, 65536) == 1
    assert default_num_splits(1, 8, 16384, row_blocks=2) == 8
    assert default_num_splits(1, 1, 10) == 1


def test_default_splits_fill_the_gpu_the_call_launches_on(monkeypatch, rng):
    """The split count follows the device's SM count (114 on an H100 PCIe: 14 splits of 8 KV
    heads, one wave); interpreted calls keep DEFAULT_SMS, without asking for a device."""
    from kiln.kernels import runtime

    q, k_cache, v_cache, table, lens, _ = _problem(rng, 1, 1, 64, 8, 64,
                                                   [1024], head_dim=128)
    with runtime.use_runtime(runtime.DryRuntime(sms=114)):
        gpu_plan = plan_module.make_plan(plan_module.ArrayLib(q), q, k_cache, v_cache, table,
                                         lens, None, None, None, None, "sm_90a", None, None,
                                         False)
    assert gpu_plan.slots == 14 and gpu_plan.grid == (14, 8, 1)
    with runtime.use_runtime(object()):  # an interpreted call must not ask a runtime
        interpreted = plan_module.make_plan(plan_module.ArrayLib(q), q, k_cache, v_cache,
                                            table, lens, None, None, None, None, "sm_90a",
                                            "interpret", None, False)
    assert interpreted.slots == 16


def test_stale_cache_rows_never_reach_the_sums(rng):
    """NaN in the rows of a partially filled page past the sequence end: scores are masked
    and V rows zeroed, so O stays finite and exact. D=128 with 32 packed rows and whole-tile
    pages also takes the two-warp-group path."""
    head_dim, page_size = 128, 64
    lens = [BN + 37, 2 * BN - 3]
    B, Sq, Hkv, group = 2, 4, 1, 8
    max_pages = -(-max(lens) // page_size)
    num_pages = B * max_pages + 1
    shape = (num_pages, page_size, Hkv, head_dim)
    kc = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    vc = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    table = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    for b, L in enumerate(lens):
        last = table[b, (L - 1) // page_size]
        kc[last, L % page_size:] = np.nan
        vc[last, L % page_size:] = np.nan
    q = rng.standard_normal((B, Sq, group * Hkv, head_dim)).astype(ml_dtypes.bfloat16)
    seq_lens = np.asarray(lens, np.int32)
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret")
    assert np.isfinite(got[0]).all()
    o_want, lse_want, counts_want = _reference_splits(q, kc, vc, table, seq_lens, 2,
                                                      head_dim ** -0.5, head_dim=head_dim)
    _check_partials(got, (o_want, lse_want, None), counts_want)


@pytest.mark.parametrize("page_size", [16, 64])
def test_a_tile_that_ends_with_the_sequence_hides_later_draft_tokens_keys(page_size, rng):
    """Sequences a whole number of tiles long at Sq 4 (as in bench/decode.py): each last tile
    holds keys that the earlier draft tokens must not see. The pages after a sequence hold
    NaN and are never read."""
    head_dim, Sq, group = 128, 4, 8
    lens = [BN, 3 * BN]
    q, kc, vc, table, seq_lens, _ = _problem(rng, 2, Sq, group, 1, page_size, lens,
                                             head_dim=head_dim)
    unused = table[0, BN // page_size:]
    kc[unused], vc[unused] = np.nan, np.nan
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret")
    want = _reference_splits(q, kc, vc, table, seq_lens, 2, head_dim ** -0.5,
                             head_dim=head_dim)
    _check_partials(got, want, want[2])


@pytest.mark.parametrize("page_size,sinks", [(1, False), (16, True), (64, False)])
def test_one_cta_serves_sq4_gqa8_rows_at_d128(page_size, sinks, rng):
    """Sq 4 x GQA 8 = 32 packed rows at D = 128: one CTA per (split, KV head) (grid y == Hkv),
    two warp groups of one m16 tile each, every warp on 32 keys of a tile. Ragged lengths
    end mid-tile and mid-page; the merged partials match float64 causal attention."""
    from kiln.kernels.attention.decode_plan import PLANS

    head_dim, B, Sq, group, Hkv, num_splits = 128, 2, 4, 8, 2, 2
    lens = [int(rng.integers(Sq, BN + 20)), int(rng.integers(2 * BN + 1, 3 * BN))]
    q, kc, vc, table, seq_lens, sink = _problem(rng, B, Sq, group * Hkv, Hkv, page_size, lens,
                                                sinks=sinks, head_dim=head_dim)
    PLANS.clear()
    got = decode(q, kc, vc, table, seq_lens, num_splits=num_splits, sinks=sink,
                 backend="interpret")
    (plan,) = PLANS.values()
    assert plan.grid == (num_splits, Hkv, B)
    want = _reference_splits(q, kc, vc, table, seq_lens, num_splits, head_dim ** -0.5, sink,
                             head_dim=head_dim)
    _check_partials(got, want, want[2])
    merged = _merge(*got)
    for b, L in enumerate(lens):
        k, v = _gather(kc, table, b, L)[None], _gather(vc, table, b, L)[None]
        np.testing.assert_allclose(merged[b], attention_reference(q[b:b + 1], k, v, causal=True,
                                                                  sinks=sink)[0], **O_TOL)


def test_warp_groups_widen_a_cta_within_the_accumulator_budget():
    """D = 128 doubles the rows of a CTA with a second warp group; D = 64 already holds two m
    tiles a warp and D = 256 a full O, so they keep one group."""
    config = DecodeConfig()
    assert [config.warp_groups(rows, 128) for rows in (8, 16, 32, 128)] == [1, 1, 2, 2]
    assert [config.row_blocks(rows, 128) for rows in (8, 32, 64, 128)] == [1, 1, 2, 4]
    assert config.warp_groups(64, 64) == 1 and config.row_blocks(64, 64) == 2
    assert config.warp_groups(32, 256) == 1 and config.row_blocks(32, 256) == 2
    assert config.keys_per_warp(2) == 32
    assert DecodeConfig(block_n=128, num_warps=8).warp_groups(32, 128) == 2
    assert DecodeConfig(block_n=128).warp_groups(32, 128) == 1  # 64 keys a warp: too many
    assert DecodeConfig(num_warps=8).keys_per_warp(2) == 16
    assert default_config(32, 128) == DecodeConfig(num_warps=8)  # two groups of 4 warps
    assert default_config(8, 128) == default_config(32, 64) == DecodeConfig()
    assert not default_config(8, 256).lazy_rescale  # the lazy branch spills at D = 256


def test_eight_warps_on_64_key_tiles_serve_two_groups(rng):
    """DecodeConfig(num_warps=8): Sq 4 x GQA 8 runs as two groups of four warps with 16 keys
    each; with one query token the warps' 8-key slices are rejected before compiling."""
    config = DecodeConfig(num_warps=8)
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 4, 8, 1, 16, [3 * BN + 5], head_dim=128)
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, config=config, backend="interpret")
    want = _reference_splits(q, kc, vc, table, seq_lens, 2, 128 ** -0.5, head_dim=128)
    _check_partials(got, want, want[2])
    with pytest.raises(kiln.UnsupportedError, match="8 keys") as error:
        decode(q[:, :1], kc, vc, table, seq_lens, config=config, backend="interpret")
    assert error.value.loc.filename == __file__


@pytest.mark.parametrize("page_size,sq,group,sinks,config", [
    (64, 8, 8, False, None),  # the default from 33 packed rows: 64 keys, 4 stages
    (16, 8, 8, True, None),
    (64, 16, 8, False, None),  # 128 rows: two row blocks of 64, 128-key tiles
    (32, 4, 8, False, DecodeConfig(consumer="wgmma")),  # rows 32-63 of the m64 are padding
    (8, 1, 4, True, DecodeConfig(consumer="wgmma", block_n=128, stages=2)),
])
def test_wgmma_consumer_matches_numpy(page_size, sq, group, sinks, config, rng):
    """``consumer='wgmma'``: one warp group, S and P V on ``wgmma`` with a tile's softmax
    between them, P V issued one iteration late. Ragged sequences of up to 11 tiles (the ring
    wraps several times with its stages held one iteration longer) end mid-page with NaN in
    the rest of the page, which the V rows zeroed in shared memory keep out of O."""
    from kiln.kernels.attention.decode_plan import PLANS

    head_dim, B, Hkv = 128, 2, 2
    config_used = config or default_config(sq * group, head_dim, page_size)
    assert config_used.consumer == "wgmma"
    bn = config_used.block_n
    lens = [int(rng.integers(sq, 3 * bn)), int(rng.integers(9 * bn, 11 * bn))]
    q, kc, vc, table, seq_lens, sink = _problem(rng, B, sq, group * Hkv, Hkv, page_size, lens,
                                                sinks=sinks, head_dim=head_dim)
    for b, L in enumerate(lens):
        kc[table[b, (L - 1) // page_size], L % page_size or page_size:] = np.nan
        vc[table[b, (L - 1) // page_size], L % page_size or page_size:] = np.nan
    PLANS.clear()
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, sinks=sink, backend="interpret",
                 config=config)
    (plan,) = PLANS.values()
    assert plan.num_warps == 4 and plan.grid == (2, Hkv * -(-sq * group // 64), B)
    assert np.isfinite(got[0]).all()
    want = _reference_splits(q, kc, vc, table, seq_lens, 2, head_dim ** -0.5, sink,
                             head_dim=head_dim, block_n=bn)
    _check_partials(got, want, want[2])


def test_default_config_picks_wgmma_for_64_row_blocks_at_d128():
    assert default_config(64, 128) == DecodeConfig(consumer="wgmma", stages=4)
    assert default_config(33, 128, 16) == DecodeConfig(consumer="wgmma", stages=4)
    assert default_config(128, 128) == DecodeConfig(consumer="wgmma", block_n=128)
    # block_n is block_table's block size: block-sparse keeps 64 keys.
    assert default_config(128, 128, block_sparse=True).block_n == 64
    assert default_config(64, 128, 4).consumer == "mma_sync"  # unswizzled 4-row boxes
    assert default_config(64, 64).consumer == default_config(32, 128).consumer == "mma_sync"
    assert DecodeConfig(consumer="wgmma").row_blocks(128, 128) == 2


def test_wgmma_consumer_rejects_what_it_cannot_run(rng):
    with pytest.raises(kiln.UnsupportedError, match="one warp group"):
        DecodeConfig(consumer="wgmma", num_warps=8)
    with pytest.raises(kiln.KilnValueError, match="consumer='mma'"):
        DecodeConfig(consumer="mma")
    with pytest.raises(kiln.UnsupportedError, match="D <= 128"):
        DecodeConfig(consumer="wgmma").check_rows(8, 256)
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 1, 8, 1, 4, [40], head_dim=128)
    with pytest.raises(kiln.UnsupportedError, match="pages of >= 8 rows") as error:
        decode(q, kc, vc, table, seq_lens, backend="interpret",
               config=DecodeConfig(consumer="wgmma"))
    assert "test_attention_decode.py" in str(error.value)


@pytest.mark.lower
@pytest.mark.parametrize("sq", [8, 16])
def test_wgmma_decode_keeps_its_wgmmas_pipelined(sq):
    """The default kernels at Sq 8 / 16 x GQA 8: register-A WGMMAs for S (m64n{BN}k16) and
    P V (m64n128k16), no spills, and ptxas did not serialise the WGMMAs (it does when O is
    rescaled while S's group is in flight, or when a wait is skipped on some path)."""
    from kiln.kernels.attention.decode import compile_decode

    compiled = compile_decode(target="sm_90a", head_dim=128, group=8, sq=sq, page_size=64,
                              fused_slots=16, merge_slices=4)
    block_n = default_config(sq * 8, 128).block_n
    ptx = compiled.asm["ptx"]
    assert compiled.metadata["num_warps"] == 4
    assert compiled.metadata["spill_bytes"] == 0
    if compiled.metadata["registers"] is not None:  # ptxas ran
        assert compiled.metadata["wgmma_serialized"] is None
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
    assert "ldmatrix" not in ptx and "mma.sync" not in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # V rows zeroed for the tensor core


@pytest.mark.lower
@pytest.mark.parametrize("num_warps", [4, 8])
def test_sq4_gqa8_d128_two_warp_groups_do_not_spill(num_warps):
    """Two warp groups cost a few registers (32-key slices with 4 warps, 16 with the default
    8), not spills, and the CTA's registers fit an SM's 64K (the default splits run one CTA
    per SM)."""
    from kiln.kernels.attention.decode import compile_decode

    config = DecodeConfig(num_warps=num_warps)
    metadata = compile_decode(target="sm_90a", sq=4, group=8, head_dim=128,
                              config=config).metadata
    assert metadata["spill_bytes"] == 0
    assert metadata["registers"] * 32 * num_warps <= 65536


def test_accumulator_pairs_are_the_p_fragment_and_v_keys_match_the_mask():
    """The register identities the kernel relies on: two n8 accumulators (keys 0-7, 8-15) are
    the k16 A fragment of P, and a transposed-V B fragment's element e holds key
    2 (lane % 4) + e % 2 + 8 (e // 2) (the keys its V-row mask tests)."""
    from kiln import layout as L

    lanes = np.arange(32)[:, None]
    c_rows, c_cols = L.mma_m16n8_accumulator().coords()
    a_rows, a_cols = L.mma_m16n8k16_a().coords()
    pair_rows = np.concatenate([c_rows, c_rows], axis=1)
    pair_cols = np.concatenate([c_cols, c_cols + 8], axis=1)
    np.testing.assert_array_equal(pair_rows, a_rows)
    np.testing.assert_array_equal(pair_cols, a_cols)
    b_keys, _ = L.mma_m16n8k16_b().coords()
    e = np.arange(4)[None, :]
    np.testing.assert_array_equal(b_keys, 2 * (lanes % 4) + e % 2 + 8 * (e // 2))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,group,sq", [(1, 8, 1), (16, 8, 4), (64, 4, 1), (64, 8, 4),
                                                (128, 8, 1), (256, 8, 4), (64, 8, 8),
                                                (16, 8, 16)])
def test_decode_matches_float64_on_gpu(page_size, group, sq, rng):
    """Against the float64 paged reference on the same (seeded) inputs, elementwise; the rows
    of each last page past its sequence hold NaN, and the allocator's pool is poisoned before
    the call. Sq 8 and 16 x GQA 8 run the WGMMA consumer."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kiln.kernels.attention.decode import decode_attention

    B, Hkv, Dh = 3, 2, 128
    lens = [int(x) for x in rng.integers(sq, 3000, B)]
    q, kc, vc, table, seq_lens, _ = _problem(rng, B, sq, Hkv * group, Hkv, page_size, lens,
                                             head_dim=Dh)
    for b, L in enumerate(lens):
        kc[table[b, (L - 1) // page_size], L % page_size or page_size:] = math.nan
        vc[table[b, (L - 1) // page_size], L % page_size or page_size:] = math.nan
    dev = [_to_cuda(torch, x) for x in (q, kc, vc, table, seq_lens)]
    poison_cuda_pool(torch, 4 * q.size * 4)
    out, lse = decode_attention(*dev)
    assert_paged_attention_close(out, lse, q, kc, vc, table, seq_lens)


def _to_cuda(torch, x):
    """A numpy array (bf16 included, exactly) as a CUDA tensor of the same dtype."""
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
    return torch.from_numpy(x).to("cuda")


def _small_cuda_problem(torch, page=16, L=100):
    """q, a K cache (also used as V), page table and lengths of one small CUDA decode call."""
    B, Sq, Hkv, group = 1, 1, 1, 4
    pages = -(-L // page)
    kc = torch.randn(pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(pages, device="cuda", dtype=torch.int32).view(B, pages)
    q = torch.randn(B, Sq, Hkv * group, D, device="cuda", dtype=torch.bfloat16)
    return q, kc, table, torch.full((B,), L, device="cuda", dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("page,length,num_splits", [(16, 100, None), (64, 16 * 64, 2)])
def test_calls_wait_for_the_kernels_queued_before_them(page, length, num_splits, rng):
    """The split kernel may start while the previous kernel on the stream runs (programmatic
    dependent launch); its reads must still see what that kernel wrote. Each round rewrites q
    and the cache in place with torch kernels right before two back-to-back decode calls, and
    nothing synchronises until every round is queued. With 8 tiles a split (the second case)
    each call prefetches before its wait and lets the next call launch early, so the second
    call of a round starts while the first still merges."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kiln.kernels.attention.decode import decode_attention

    torch.manual_seed(int(rng.integers(2 ** 31)))  # the inputs follow the reported seed
    q, kc, table, seq_lens = _small_cuda_problem(torch, page, length)
    L, group = int(seq_lens[0]), q.shape[2] // kc.shape[2]
    plan = plan_module.get_plan(q, kc, kc, table, seq_lens, num_splits, None, None, None, None,
                                None, None, fused=None)
    assert plan.kernel.__name__.endswith("_pf3") == (num_splits is not None)
    inputs, outputs = [], []
    for round_ in range(4):
        q.mul_(-1.5)
        kc.add_(0.25 * (round_ + 1))
        then = (q.clone(), kc.clone())
        pair = [decode_attention(q, kc, kc, table, seq_lens, num_splits=num_splits)[0]
                for _ in range(2)]  # fresh outputs, queued back to back
        inputs += [then, then]
        outputs += pair
    torch.cuda.synchronize()
    for (q_then, kc_then), out in zip(inputs, outputs):
        keys = kc_then.reshape(-1, kc.shape[2], D)[:L].float()  # pages 0.. in order, [L, Hkv, D]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q_then[0].float().transpose(0, 1), keys, keys)  # [Hq, 1, D]
        torch.testing.assert_close(out[0].float().transpose(0, 1), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_cache_on_another_device_is_rejected():
    """The bound launch takes raw addresses; a CPU cache beside a CUDA q must raise, before and
    after the shape class has a bound plan."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, kc, table, seq_lens = _small_cuda_problem(torch)
    for _ in range(2):
        with pytest.raises(kiln.KilnValueError, match="k_cache is on cpu") as error:
            decode(q, kc.cpu(), kc, table, seq_lens)
        assert error.value.loc.filename == __file__
        decode(q, kc, kc, table, seq_lens)  # binds the plan for the second round


@pytest.mark.gpu
def test_a_misaligned_q_is_rejected():
    """q's bf16 pairs are read as 32-bit words: a view starting at an odd element must raise
    (not fault), before and after the shape class has a bound plan."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, kc, table, seq_lens = _small_cuda_problem(torch)
    odd = torch.empty(q.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(q.shape)
    odd.copy_(q)
    for _ in range(2):
        with pytest.raises(kiln.KilnValueError, match="not 4-byte aligned") as error:
            decode(odd, kc, kc, table, seq_lens)
        assert error.value.loc.filename == __file__
        decode(q, kc, kc, table, seq_lens)  # binds the plan for the second round


@pytest.mark.gpu
def test_decode_attention_replays_in_a_cuda_graph(rng):
    """A serving loop captures decode + combine once and replays them (no host work per step):
    the bound launches go to the capturing stream, and replays follow new inputs written in
    place."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the inputs follow the reported seed
    from kiln.kernels.attention.decode import decode_attention

    B, Sq, Hkv, group, page, L = 2, 1, 2, 8, 64, 1000
    pages = -(-L // page)
    kc = torch.randn(B * pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * pages, device="cuda").view(B, pages).int()
    q = torch.randn(B, Sq, Hkv * group, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    decode_attention(q, kc, vc, table, seq_lens)  # compile and bind outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, kc, vc, table, seq_lens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a capture cannot synchronise: the ids are vouched for
        out, lse = decode_attention(q, kc, vc, table, seq_lens, validate=False)
    for _ in range(2):
        q.copy_(torch.randn_like(q))  # new step: inputs change in place
        out.fill_(float("nan"))
        graph.replay()
        want, want_lse = decode_attention(q, kc, vc, table, seq_lens)
        torch.cuda.synchronize()
        assert_paged_attention_close(out, lse, q, kc, vc, table, seq_lens)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


@pytest.mark.lower
@pytest.mark.parametrize("page_size,group,sq,sparse", [(1, 8, 1, False), (64, 8, 4, False),
                                                       (16, 8, 16, False), (4, 8, 16, False),
                                                       (256, 4, 1, True)])
def test_decode_compiles_for_hopper(page_size, group, sq, sparse):
    """The full sm_90a pipeline (through ptxas) accepts every page-size class without spills,
    with either consumer (WGMMA from 33 packed rows on pages of >= 8 rows)."""
    from kiln.kernels.attention.decode import compile_decode

    compiled = compile_decode(target="sm_90a", head_dim=128, group=group, sq=sq,
                              page_size=page_size, block_sparse=sparse)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata["spill_bytes"] == 0
    assert "cp.async.bulk.tensor.2d" in ptx
    if default_config(sq * group, 128, page_size).consumer == "wgmma":
        assert "wgmma.mma_async.sync.aligned" in ptx
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    # Only the ring's own waits (full, empty): a wait of fixed parity added after the loop
    # (kiln-insert-waits, before the merge reuses the ring) would hang some CTAs.
    assert ptx.count("mbarrier.try_wait.parity") == 2
    assert ptx.count("elect.sync") == 1
    # Every K/V copy asks L2 to evict the streamed cache first; both descriptors are
    # prefetched before the page look-ups.
    copies = re.findall(r"cp\.async\.bulk\.tensor\.2d\.\S+", ptx)
    assert copies and all(copy.endswith(".L2::cache_hint") for copy in copies)
    assert "createpolicy.fractional.L2::evict_first.b64" in ptx
    assert ptx.count("prefetch.tensormap") == 2
    # Programmatic dependent launch: the kernel waits on the previous grid once, after its
    # mbarrier set-up and before its first global access (the descriptor prefetch), and asks
    # for more than half an SM's shared memory, so no two CTAs share an SM.
    assert compiled.signature.programmatic_launch
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.rindex("mbarrier.init", 0, wait) < wait < ptx.index("prefetch.tensormap")
    assert not re.search(r"ld\.global|ld\.param\.u64.*\n.*ld\.global", ptx[:wait])
    assert compiled.signature.dynamic_shared_bytes > 114 * 1024


def test_partials_contract_is_natural_log_split_major():
    from kiln.kernels.attention.decode import decode_partials
    from kiln.kernels.attention.partials import Partials, PartialsMismatchError

    produced = decode_partials(8)
    produced.check_consumer(Partials(producer="combine", max_splits=32))
    with pytest.raises(PartialsMismatchError, match="log_base"):
        produced.check_consumer(Partials(producer="combine", max_splits=32, log_base="2"))
    with pytest.raises(PartialsMismatchError, match="max_splits"):
        produced.check_consumer(Partials(producer="combine", max_splits=4))


def test_decode_attention_combines_to_the_full_softmax(rng):
    from kiln.kernels.attention.decode import decode_attention

    q, kc, vc, table, seq_lens, _ = _problem(rng, 2, 4, 8, 2, 16, [3 * BN - 5, 7])
    out, lse = decode_attention(q, kc, vc, table, seq_lens, num_splits=3, backend="interpret")
    want = paged_attention_reference(q, kc, vc, table, seq_lens)[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2)
    assert np.isfinite(np.asarray(lse)).all()


# --- decode_attention's fused kernel: the last split CTA of each row block combines

BF16_OUT_TOL = dict(atol=1.5e-2, rtol=1e-2)  # O_TOL plus the bf16 rounding of the output


def _check_decode_attention(q, kc, vc, table, seq_lens, *, sinks=None, **options):
    """decode_attention on the interpreter against the float64 reference, elementwise."""
    from kiln.kernels.attention.decode import decode_attention

    o, lse = decode_attention(q, kc, vc, table, seq_lens, sinks=sinks, backend="interpret",
                              **options)
    assert_paged_attention_close(o, lse, q, kc, vc, table, seq_lens, sinks=sinks)


# Lengths whose visible key counts (L - Sq + i + 1 for row i) sit at the edges of a BN-key
# tile: a tile whose causal bound is one key off errs there.
TILE_EDGES = (0, 1, 2, BN - 2, BN - 1)


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["edges", "every_residue"])
def test_causal_new_tokens_at_tile_edge_residues(every, rng):
    """Sq = 4 new tokens, causal among themselves, over sequence lengths at every tile-edge
    residue (``every``: every residue) modulo the 64-key tile, one and two tiles long, two
    splits; one launch per case."""
    residues = range(BN) if every else TILE_EDGES
    lens = [length for r in residues for length in (r + 1, BN + r, 2 * BN + r)]
    q, kc, vc, table, seq_lens, _ = _problem(rng, len(lens), 4, 2, 1, 16, lens)
    _check_decode_attention(q, kc, vc, table, seq_lens, num_splits=2)


def test_rows_whose_every_score_is_very_negative(rng):
    """Query rows whose scores all sit near one offset from 0 down to -1e4 (natural units):
    the running max starts at -inf, so no row's denominator underflows."""
    q, kc, vc, table, seq_lens, _ = _problem(rng, 2, 4, 8, 2, 16, [BN + 7, 3 * BN - 1])
    offsets = -np.geomspace(1.0, 1.0e4, q.shape[0] * q.shape[1] * q.shape[2])
    kc[..., 0] = -256.0
    q[..., 0] = (-offsets * D ** 0.5 / 256.0).reshape(q.shape[:3]).astype(ml_dtypes.bfloat16)
    _check_decode_attention(q, kc, vc, table, seq_lens, num_splits=2)


@pytest.mark.parametrize("page_size,group,sq,head_dim,sinks",
                         [(1, 1, 1, 64, False), (16, 4, 4, 64, True), (64, 8, 1, 128, False),
                          (16, 8, 4, 128, True)])
def test_fused_decode_attention_matches_numpy(page_size, group, sq, head_dim, sinks, rng):
    """Ragged lengths (one sequence empty: O = 0, LSE = -inf or the sink) over 3 splits."""
    from kiln.kernels.attention.decode import decode_attention

    hkv = 2 if group < 8 else 1
    lens = [0 if sq == 1 else sq, int(rng.integers(2 * BN, 4 * BN))]
    q, kc, vc, table, seq_lens, sink = _problem(rng, 2, sq, group * hkv, hkv, page_size, lens,
                                                sinks=sinks, head_dim=head_dim)
    o, lse = decode_attention(q, kc, vc, table, seq_lens, num_splits=3, sinks=sink,
                              backend="interpret", fused_combine=True)
    assert_paged_attention_close(o, lse, q, kc, vc, table, seq_lens, sinks=sink)


def test_fused_and_two_kernel_decode_attention_agree(rng):
    from kiln.kernels.attention.decode import decode_attention

    q, kc, vc, table, seq_lens, _ = _problem(rng, 2, 2, 8, 2, 16, [3 * BN + 9, BN - 3])
    fused = decode_attention(q, kc, vc, table, seq_lens, num_splits=4, backend="interpret",
                             fused_combine=True)
    separate = decode_attention(q, kc, vc, table, seq_lens, num_splits=4, backend="interpret",
                                fused_combine=False)
    np.testing.assert_allclose(np.asarray(fused[0], np.float32),
                               np.asarray(separate[0], np.float32), atol=8e-3, rtol=8e-3)
    np.testing.assert_allclose(fused[1], separate[1], rtol=1e-5, atol=1e-5)


def test_fused_block_sparse_rows_that_select_nothing(rng):
    """Block-sparse slots merge in the last CTA too; a row with no block gets O = 0, LSE -inf."""
    from kiln.kernels.attention.decode import decode_attention

    B, Sq, Hq, Hkv, top_k = 1, 2, 4, 2, 3
    q, kc, vc, table, seq_lens, _ = _problem(rng, B, Sq, Hq, Hkv, 16, [3 * BN + 7])
    blocks = np.full((B, Sq, Hkv, top_k), -1, np.int32)
    blocks[0, 0, 0] = [2, 0, -1]
    blocks[0, 1, 1] = [3, 1, 2]  # blocks[0, 0, 1] and blocks[0, 1, 0] select nothing
    o, lse = decode_attention(q, kc, vc, table, seq_lens, block_table=blocks,
                              backend="interpret", fused_combine=True)
    parts = decode(q, kc, vc, table, seq_lens, block_table=blocks, backend="interpret")
    want_o = _merge(*parts)
    group = Hq // Hkv
    for i, h in ((0, 2), (0, 3), (1, 0), (1, 1)):  # the empty (query, KV head) rows
        assert lse[0, i, h] == -np.inf and (np.asarray(o[0, i, h], np.float32) == 0).all()
        assert blocks[0, i, h // group].max() < 0
    np.testing.assert_allclose(np.asarray(o, np.float64), want_o, **BF16_OUT_TOL)


@pytest.mark.gpu
def test_fused_decode_attention_on_the_gpu_repeats_on_two_streams(rng):
    """The fused kernel's ticket counters advance by one launch's splits every launch (a
    repeat that misread them would merge too early) and are separate per stream; at Sq 4 x
    GQA 8 the last CTAs share the merge, waiting for the last; block-sparse rows that select
    nothing give O = 0, LSE = -inf. Checked against the two-kernel path."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the inputs follow the reported seed
    from kiln.kernels.attention.decode import decode_attention

    B, Sq, Hkv, group, page, Dh = 3, 4, 2, 8, 16, 128
    lens = [4000, 77, 1500]
    pages = -(-max(lens) // page)
    kc = torch.randn(B * pages + 2, page, Hkv, Dh, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * pages + 2, device="cuda")[:B * pages].view(B, pages).int()
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    blocks = torch.randint(0, 20, (B, Sq, Hkv, 4), device="cuda", dtype=torch.int32)
    blocks[blocks >= torch.div(seq_lens, BN, rounding_mode="floor").view(B, 1, 1, 1)] = -1
    blocks[0, 1] = -1  # a query token that selects nothing
    blocks = blocks.sort(dim=-1, descending=True).values  # -1 padding at the end (the contract)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the caches and tables above
    for selection in (None, blocks):
        for stream in (torch.cuda.current_stream(), side, side, torch.cuda.current_stream()):
            with torch.cuda.stream(stream):  # q made on the stream that reads it
                q = torch.randn(B, Sq, Hkv * group, Dh, device="cuda", dtype=torch.bfloat16)
                out, lse = decode_attention(q, kc, vc, table, seq_lens, block_table=selection,
                                            fused_combine=True)
                want, want_lse = decode_attention(q, kc, vc, table, seq_lens,
                                                  block_table=selection, fused_combine=False)
            stream.synchronize()
            if selection is None:  # independent of both Kiln paths
                assert_paged_attention_close(out, lse, q, kc, vc, table, seq_lens)
            torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert (lse[0, 1] == -float("inf")).all() and (out[0, 1] == 0).all()


def test_decode_attention_fuses_the_combine_only_for_small_merges(monkeypatch, rng):
    """Default: fused while the last CTA reads at most FUSED_COMBINE_MAX_BYTES of partials."""
    monkeypatch.setattr(plan_module, "PLANS", PlanCache("test"))
    q, kc, vc, table, seq_lens, _ = _problem(rng, 1, 4, 8, 1, 64, [4 * BN], head_dim=128)
    plan = lambda splits, fused: plan_module.get_plan(  # noqa: E731
        q, kc, vc, table, seq_lens, splits, None, None, None, None, "interpret", None, fused)
    # 32 packed rows x 128 columns x 4 bytes = 16 KB a split
    assert plan(16, None).fused and not plan(17, None).fused
    assert plan(17, True).fused and not plan(16, False).fused


def test_large_fused_merges_are_shared_by_the_last_ctas_on_the_gpu(monkeypatch, rng):
    """32 packed rows (Sq 4 x GQA 8): on a GPU the CTAs that draw the last MERGE_SLICES
    tickets share the fused merge. 8 rows keep one merging CTA, and so does the interpreter,
    which runs one CTA at a time and could not run the others' wait."""
    monkeypatch.setattr(plan_module, "PLANS", PlanCache("test"))

    def kernel_name(sq, backend, splits=16):
        q, kc, vc, table, seq_lens, _ = _problem(rng, 1, sq, 8, 1, 64, [4 * BN])
        return plan_module.make_plan(plan_module.ArrayLib(q), q, kc, vc, table, seq_lens,
                                     splits, None, None, None, "sm_90a", backend, None,
                                     None).kernel.name

    slices = decode_module.MERGE_SLICES
    assert kernel_name(4, None).endswith(f"_fused16x{slices}")
    # Never more slices than splits, and a power of two (the slices split the columns).
    assert kernel_name(4, None, splits=3).endswith("_fused3x2")
    from kiln.kernels.attention.decode import compile_decode

    for slices, splits in ((3, 16), (4, 2)):
        with pytest.raises(kiln.KilnValueError, match="merge_slices") as error:
            compile_decode(target="sm_90a", sq=4, fused_slots=splits, merge_slices=slices)
        assert error.value.loc.filename == __file__
    assert kernel_name(4, "interpret").endswith("_fused16")
    assert kernel_name(1, None).endswith("_fused16")


@pytest.mark.lower
def test_one_merging_cta_is_the_last_to_arrive():
    """With one merging CTA, thread 0 takes its ARRIVED ticket (counter 0) as the main loop
    ends, before the CTA's own merge (two barriers), and the last to arrive waits for the
    PUBLISHED counter (8 bytes on) instead of fencing after a second ticket. Shared merges
    (Sq 4 x GQA 8) only count PUBLISHED."""
    from kiln.kernels.attention.decode import compile_decode

    ptx = compile_decode(target="sm_90a", sq=1, fused_slots=16).asm["ptx"]
    tickets = re.findall(r"atom\.global\.add\.u64\s+%rd\d+, \[%rd\d+(\+8)?\], 1;", ptx)
    assert tickets == ["", "+8"]
    arrived, wait = ptx.index("atom.global.add.u64"), ptx.index("ld.acquire.gpu")
    assert ptx.count("bar.sync", arrived, wait) >= 2
    assert ptx.index("fence.acq_rel.gpu") > wait  # only the CTAs that do not merge fence

    shared = compile_decode(target="sm_90a", sq=4, fused_slots=16, merge_slices=4).asm["ptx"]
    assert re.findall(r"atom\.global\.add\.u64\s+%rd\d+, \[%rd\d+(\+8)?\], 1;",
                      shared) == ["+8"]


@pytest.mark.lower
def test_fused_merge_accumulates_with_fma():
    """The last CTA's merge is issue-bound: each split's weighted columns take one fma each
    (16 splits x 16 columns a thread at Sq 4), not a multiply and an add."""
    from kiln.kernels.attention.decode import compile_decode

    ptx = compile_decode(target="sm_90a", head_dim=128, group=8, sq=4,
                         fused_slots=16).asm["ptx"]
    merge = ptx[ptx.rindex("atom.global"):]  # after the last ticket
    assert merge.count("fma.rn.ftz.f32") >= 16 * 16  # the kernel flushes f32 denormals
    assert merge.count("mul.rn.ftz.f32") < 16 * 16 // 4


def test_decode_modules_are_split_by_job_and_keep_the_public_names():
    """decode's modules stay under ~600 lines each (config, kernel skeleton, two consumers,
    row helpers, fused combine, plans, entry points), and kiln.kernels.attention.decode still
    exports what callers import from it."""
    import pathlib

    folder = pathlib.Path(decode_module.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("decode*.py")}
    assert len(sizes) >= 5 and max(sizes.values()) <= 600, sizes
    for name in ("decode", "decode_attention", "compile_decode", "make_kernel", "DecodeConfig",
                 "default_config", "default_num_splits", "early_launch_tiles",
                 "decode_partials", "SHORT_SPLIT_TILES", "FUSED_COMBINE_MAX_BYTES"):
        assert hasattr(decode_module, name), name
