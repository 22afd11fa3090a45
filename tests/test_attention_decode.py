"""Split-KV paged decode: split partials on the interpreter against a float64 numpy reference,
the early launch and the split count."""

import re
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.attention.decode import (DecodeConfig, decode, default_config,
                                           default_num_splits, early_launch_tiles)

from attention_reference import attention_reference, paged_attention_reference
from decode_problems import (BN, D, O_TOL, check_partials, decode_module, gather, merge, partial,
                             plan_module, problem, reference_splits)


@pytest.mark.parametrize("page_size,group,sq", [(1, 1, 1), (16, 4, 4), (64, 8, 1),
                                                (16, 8, 4), (64, 1, 4), (16, 4, 16)])
@pytest.mark.slow
def test_split_partials_match_numpy(page_size, group, sq, rng):
    hkv = 2 if group < 8 else 1
    lens = [int(rng.integers(sq, 3 * BN)), int(rng.integers(2 * BN, 4 * BN))]  # ragged
    q, kc, vc, table, seq_lens, _ = problem(rng, 2, sq, group * hkv, hkv, page_size, lens)
    num_splits = 3
    got = decode(q, kc, vc, table, seq_lens, num_splits=num_splits, backend="interpret")
    want = reference_splits(q, kc, vc, table, seq_lens, num_splits, D ** -0.5)
    check_partials(got, want, want[2])
    merged = merge(*got)
    np.testing.assert_allclose(merged, paged_attention_reference(q, kc, vc, table, seq_lens)[0],
                               **O_TOL)


@pytest.mark.parametrize("lazy_rescale", [True, False])
def test_a_key_that_dominates_after_the_first_tile_rescales_the_output(lazy_rescale, rng):
    """One CTA walks five tiles, and a key of tile 2 scores ~160 log2 units above every key
    before it for query head 0: the row's running max, sum and O must move to it (against the
    old max its probability would overflow f32), and match the float64 reference. With
    ``lazy_rescale`` only that tile's vote moves the max."""
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 1, 4, 1, 16, [5 * BN])
    head = q[0, 0, 0].astype(np.float64)
    unit = D ** -0.5 * np.log2(np.e)  # log2 units of a unit dot product
    key = 2 * BN + 5
    before = (gather(kc, table, 0, key)[:, 0] @ head * unit).max()
    gain = (before + 160) / (head @ head * unit)
    kc[table[0, key // 16], key % 16, 0] = (gain * head).astype(ml_dtypes.bfloat16)
    jump = kc[table[0, key // 16], key % 16, 0].astype(np.float64) @ head * unit - before
    assert jump > 128  # 2**128 is inf in f32

    config = replace(default_config(4, D, 16), lazy_rescale=lazy_rescale)
    got = decode(q, kc, vc, table, seq_lens, num_splits=1, config=config, backend="interpret")
    np.testing.assert_allclose(merge(*got), paged_attention_reference(q, kc, vc, table,
                                                                       seq_lens)[0], **O_TOL)


def test_sinks_scale_and_empty_sequence(rng):
    """A zero-length sequence has no valid split; sinks only enlarge split 0's denominator."""
    q, kc, vc, table, seq_lens, sinks = problem(rng, 2, 1, 4, 2, 16, [0, BN + 5], sinks=True)
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, scale=0.3, sinks=sinks,
                 backend="interpret")
    want = reference_splits(q, kc, vc, table, seq_lens, 2, 0.3, sinks)
    check_partials(got, want, want[2])
    assert (got[2][0] == 0).all()


@pytest.mark.parametrize("page_size", [16, 64])
def test_block_sparse_selection(page_size, rng):
    """Slot j holds block block_table[b, i, kv, j]; -1 padding, empty rows give C = 0."""
    B, Sq, Hq, Hkv, top_k = 2, 2, 4, 2, 3
    lens = [4 * BN, 3 * BN + 7]
    q, kc, vc, table, seq_lens, _ = problem(rng, B, Sq, Hq, Hkv, page_size, lens)
    blocks = np.full((B, Sq, Hkv, top_k), -1, np.int32)
    blocks[0, 0, 0] = [2, 0, -1]
    blocks[0, 1, 1] = [3, 1, 2]
    blocks[1, 0, 0] = [3, -1, -1]  # the partial last block
    blocks[1, 1, 0] = [1, 0, 3]   # blocks[1, 1, 1] and others select nothing
    o, lse, counts = decode(q, kc, vc, table, seq_lens, block_table=blocks, backend="interpret")
    group = Hq // Hkv
    for b in range(B):
        L = int(seq_lens[b])
        keys, values = gather(kc, table, b, L), gather(vc, table, b, L)
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
                    o_want, lse_want = partial(q[b, i, h].astype(np.float64),
                                                keys[lo:hi, h // group], values[lo:hi, h // group],
                                                D ** -0.5)
                    np.testing.assert_allclose(lse[j, b, i, h], lse_want, rtol=1e-4, atol=1e-4)
                    np.testing.assert_allclose(o[j, b, i, h], o_want, **O_TOL)


def test_bad_inputs_raise_kiln_errors(rng):
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 1, 3, 2, 16, [10])
    with pytest.raises(kiln.UnsupportedError, match="multiple of Hkv") as error:
        decode(q, kc, vc, table, seq_lens, backend="interpret")
    assert error.value.loc.filename == __file__  # the caller's line, not the kernel module's
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 1, 2, 2, 16, [10])
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
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 1, 4, 1, 64, [16 * BN - 5])
    plan = plan_module.get_plan(q, kc, vc, table, seq_lens, 2, None, None, None, None,
                                "interpret", None, fused=False)
    assert plan.kernel.__name__.endswith("_pf3")
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret")
    want = reference_splits(q, kc, vc, table, seq_lens, 2, D ** -0.5)
    check_partials(got, want, want[2])


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
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 1, 4, 1, 64, [34 * BN - 5])
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

    q, k_cache, v_cache, table, lens, _ = problem(rng, 1, 1, 64, 8, 64,
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
    o_want, lse_want, counts_want = reference_splits(q, kc, vc, table, seq_lens, 2,
                                                      head_dim ** -0.5, head_dim=head_dim)
    check_partials(got, (o_want, lse_want, None), counts_want)


@pytest.mark.parametrize("page_size", [16, 64])
def test_a_tile_that_ends_with_the_sequence_hides_later_draft_tokens_keys(page_size, rng):
    """Sequences a whole number of tiles long at Sq 4 (as in bench/decode.py): each last tile
    holds keys that the earlier draft tokens must not see. The pages after a sequence hold
    NaN and are never read."""
    head_dim, Sq, group = 128, 4, 8
    lens = [BN, 3 * BN]
    q, kc, vc, table, seq_lens, _ = problem(rng, 2, Sq, group, 1, page_size, lens,
                                             head_dim=head_dim)
    unused = table[0, BN // page_size:]
    kc[unused], vc[unused] = np.nan, np.nan
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret")
    want = reference_splits(q, kc, vc, table, seq_lens, 2, head_dim ** -0.5,
                             head_dim=head_dim)
    check_partials(got, want, want[2])


@pytest.mark.parametrize("page_size,sinks", [(1, False), (16, True), (64, False)])
def test_one_cta_serves_sq4_gqa8_rows_at_d128(page_size, sinks, rng):
    """Sq 4 x GQA 8 = 32 packed rows at D = 128: one CTA per (split, KV head) (grid y == Hkv),
    two warp groups of one m16 tile each, every warp on 32 keys of a tile. Ragged lengths
    end mid-tile and mid-page; the merged partials match float64 causal attention."""
    from kiln.kernels.attention.decode_plan import PLANS

    head_dim, B, Sq, group, Hkv, num_splits = 128, 2, 4, 8, 2, 2
    lens = [int(rng.integers(Sq, BN + 20)), int(rng.integers(2 * BN + 1, 3 * BN))]
    q, kc, vc, table, seq_lens, sink = problem(rng, B, Sq, group * Hkv, Hkv, page_size, lens,
                                                sinks=sinks, head_dim=head_dim)
    PLANS.clear()
    got = decode(q, kc, vc, table, seq_lens, num_splits=num_splits, sinks=sink,
                 backend="interpret")
    (plan,) = PLANS.values()
    assert plan.grid == (num_splits, Hkv, B)
    want = reference_splits(q, kc, vc, table, seq_lens, num_splits, head_dim ** -0.5, sink,
                             head_dim=head_dim)
    check_partials(got, want, want[2])
    merged = merge(*got)
    for b, L in enumerate(lens):
        k, v = gather(kc, table, b, L)[None], gather(vc, table, b, L)[None]
        np.testing.assert_allclose(merged[b], attention_reference(q[b:b + 1], k, v, causal=True,
                                                                  sinks=sink)[0], **O_TOL)
