"""Split-KV decode consumers: warp groups, the WGMMA consumer and what Hopper compiles to."""

import re

import numpy as np
import pytest

import kiln
from kiln.kernels.attention.decode import DecodeConfig, decode, default_config

from decode_problems import BN, check_partials, problem, reference_splits


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
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 4, 8, 1, 16, [3 * BN + 5], head_dim=128)
    got = decode(q, kc, vc, table, seq_lens, num_splits=2, config=config, backend="interpret")
    want = reference_splits(q, kc, vc, table, seq_lens, 2, 128 ** -0.5, head_dim=128)
    check_partials(got, want, want[2])
    with pytest.raises(kiln.UnsupportedError, match="8 keys") as error:
        decode(q[:, :1], kc, vc, table, seq_lens, config=config, backend="interpret")
    assert error.value.loc.filename == __file__


@pytest.mark.parametrize("page_size,sq,group,sinks,config", [
    (64, 8, 8, False, None),  # the default from 33 packed rows: 64 keys, 4 stages
    (16, 8, 8, True, None),
    # 128 rows: two row blocks of 64, 128-key tiles (slow tier, which CI also runs)
    pytest.param(64, 16, 8, False, None, marks=pytest.mark.slow),
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
    q, kc, vc, table, seq_lens, sink = problem(rng, B, sq, group * Hkv, Hkv, page_size, lens,
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
    want = reference_splits(q, kc, vc, table, seq_lens, 2, head_dim ** -0.5, sink,
                             head_dim=head_dim, block_n=bn)
    check_partials(got, want, want[2])


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
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 1, 8, 1, 4, [40], head_dim=128)
    with pytest.raises(kiln.UnsupportedError, match="pages of >= 8 rows") as error:
        decode(q, kc, vc, table, seq_lens, backend="interpret",
               config=DecodeConfig(consumer="wgmma"))
    assert "test_attention_decode_consumers.py" in str(error.value)


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
