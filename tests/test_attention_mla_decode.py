"""MLA decode on the interpreter against a float64 reference; input validation; the sm_90a
compile."""

import importlib

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.attention import mla_decode
from kiln.kernels.attention.mla_decode import (compile_mla_decode, default_mla_splits,
                                               merge_rows, mla_partials)

from mla_problems import assert_mla_close, mla_problem, mla_reference


@pytest.mark.parametrize("heads,sq,num_splits,split_keys", [
    (16, 1, 1, True), (16, 2, 3, True), (64, 1, 2, True), (40, 2, 1, False),
    # the slow tier, which CI also runs, has the other head counts and splits
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in [(20, 2, 1, True), (40, 2, 2, True), (16, 2, 3, False)])])
def test_matches_float64_on_odd_lengths(heads, sq, num_splits, split_keys, rng):
    """Lengths 1, 63, 65 and 200 in one batch (a page's end and start, a ragged last page,
    with Sq 2 a first query that sees nothing); pages shuffled through the cache; the rows
    past each sequence and the unused pages hold NaN; 40 x 2 rows take two row blocks. Both
    scores schedules (``split_keys``)."""
    q, kv, table, lens = mla_problem(rng, heads, sq, [1, 63, 65, 200])
    o, lse = mla_decode(q, kv, table, lens, num_splits=num_splits, backend="interpret",
                        split_keys=split_keys)
    assert o.shape == (4, sq, heads, 512) and o.dtype == ml_dtypes.bfloat16
    assert lse.shape == (4, sq, heads) and lse.dtype == np.float32
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))


@pytest.mark.slow
def test_deepseek_heads_two_tokens(rng):
    """H 128 x Sq 2: four row blocks of 64 packed rows, the default split count."""
    q, kv, table, lens = mla_problem(rng, 128, 2, [130, 77])
    o, lse = mla_decode(q, kv, table, lens, backend="interpret")
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))


@pytest.mark.parametrize("heads,sq,num_splits,options", [
    (16, 1, 3, dict(fused_combine=True)),  # 16-row merge, 16 threads a row
    (40, 2, 2, dict(fused_combine=True)),  # 64-row merge
    # The opt-in options (seesaw pairs, early launch) run in the slow tier, which CI also runs.
    pytest.param(16, 1, 1, dict(seesaw=True), marks=pytest.mark.slow),  # pad page after 1, 63, 65
    pytest.param(20, 2, 3, dict(seesaw=True, fused_combine=True, early_launch=True),
                 marks=pytest.mark.slow),
    pytest.param(40, 2, 3, dict(split_keys=False, fused_combine=True, early_launch=True),
                 marks=pytest.mark.slow),
    (16, 1, 1, dict(lead_group=True)),  # group 0 scores, group 1 reads P back
    pytest.param(16, 2, 3, dict(lead_group=True, fused_combine=True), marks=pytest.mark.slow),
    pytest.param(40, 2, 2, dict(lead_group=True, early_launch=True), marks=pytest.mark.slow),
    # group 0's product in flight over the loop
    pytest.param(16, 1, 1, dict(lead_group="pipelined"), marks=pytest.mark.slow),
    pytest.param(40, 2, 3, dict(lead_group="pipelined", fused_combine=True, early_launch=True),
                 marks=pytest.mark.slow),
    (16, 1, 1, dict(transposed=True)),  # keys as M, 16 query rows as N
    pytest.param(16, 2, 3, dict(transposed=True, fused_combine=True),  # 32 rows, two tokens' limits
                 marks=pytest.mark.slow),
    # 16 rows, 4 of them past
    pytest.param(8, 2, 2, dict(transposed=True, prefetch=2, early_launch=True),
                 marks=pytest.mark.slow),
    # the lead group with a page ahead in L2
    pytest.param(20, 1, 2, dict(prefetch=1), marks=pytest.mark.slow),
    # Q's 16 rows, 25 chunk slots
    pytest.param(16, 1, 1, dict(transposed="ring"), marks=pytest.mark.slow),
    # 22 slots
    pytest.param(16, 2, 3, dict(transposed="ring", fused_combine=True, early_launch=True),
                 marks=pytest.mark.slow),
    pytest.param(16, 1, 2, dict(transposed="pipelined", fused_combine=True),
                 marks=pytest.mark.slow),
    pytest.param(16, 2, 1, dict(transposed="ring-pipelined"), marks=pytest.mark.slow),
    pytest.param(16, 1, 3, dict(transposed=True, early_launch=True, early_pages=3),
                 marks=pytest.mark.slow),  # L2 before the wait
    (40, 2, 2, dict(early_launch=True, early_pages=2)),
])
def test_kernel_options_match_float64(heads, sq, num_splits, options, rng):
    """The fused combine (the last split CTA merges), the seesaw pairs and early launch, on
    the odd lengths of the test above (the partials are NaN until written: the merge reads
    only what the splits stored)."""
    q, kv, table, lens = mla_problem(rng, heads, sq, [1, 63, 65, 200])
    o, lse = mla_decode(q, kv, table, lens, num_splits=num_splits, backend="interpret",
                        **options)
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))


@pytest.mark.parametrize("options", [dict(transposed=True)] + [  # the opt-ins in the slow tier
    pytest.param(options, marks=pytest.mark.slow) for options in (
        dict(transposed=True, prefetch=1), dict(transposed="ring"), dict(transposed="pipelined"),
        dict(transposed="ring-pipelined"))])
def test_transposed_over_many_pages(options, rng):
    """The transposed schedule's double-buffered P^T, factors and maxima over sixteen and
    thirteen pages (the last ragged, NaN past it; the chunk ring wraps five times) and an
    empty sequence, in one split; one query row's scores made dominant in a late page so the
    running max moves."""
    q, kv, table, lens = mla_problem(rng, 16, 1, [1000, 777, 0])
    kv[table[0, 11], 5, :] = (q[0, 0, 3].astype(np.float32) * 0.5).astype(kv.dtype)
    o, lse = mla_decode(q, kv, table, lens, num_splits=1, backend="interpret", **options)
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))


@pytest.mark.parametrize("mode", [True, pytest.param("pipelined", marks=pytest.mark.slow)])
def test_lead_group_over_many_pages(mode, rng):
    """Sixteen and thirteen pages through the lead group's P hand-over (its buffer reused
    every page), the last page ragged, and an empty sequence, in one split."""
    q, kv, table, lens = mla_problem(rng, 16, 1, [1000, 777, 0])
    o, lse = mla_decode(q, kv, table, lens, num_splits=1, backend="interpret",
                        lead_group=mode)
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))


@pytest.mark.parametrize("heads,sq,ctas,lens,balanced", [
    (16, 1, 3, [1, 63, 65, 200], True),  # 9 pages + 4 units over 3 CTAs: segments cross
    (16, 2, 5, [0, 130, 0, 70, 1], 0),  # no overhead: an empty sequence counts one unit
    (8, 2, 7, [700, 5], 3),  # CTAs whose share is overhead only: empty partials
    (16, 1, 4, [300, 64, 129], 2),  # early launch: the share's first pages in L2 first
    pytest.param(16, 1, 40, [1, 63, 65, 200, 1500, 0], True,  # more CTAs than units: some idle
                 marks=pytest.mark.slow),
    pytest.param(16, 1, 1, [1000, 777, 0], True, marks=pytest.mark.slow)])  # one CTA
def test_balanced_grid_matches_float64(heads, sq, ctas, lens, balanced, rng):
    """The page-balanced grid: each CTA's equal share of the batch's work units cuts
    sequences anywhere, the ring carries on across them, and the last CTA of each sequence
    merges its parts (NaN past every sequence and in the unused pages, partials NaN until
    stored)."""
    q, kv, table, lens = mla_problem(rng, heads, sq, lens)
    o, lse = mla_decode(q, kv, table, lens, num_splits=ctas, backend="interpret",
                        balanced=balanced, early_launch=ctas == 4)
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))


def test_balanced_share_covers_every_page():
    """The shares' arithmetic in Python: with ``n = min(CTAs, units)`` every share holds a
    unit, every unit is in exactly one share, and each sequence's parts are consecutive CTAs
    (``_first_cta`` of its first and last unit) with distinct slots ``c + b``."""
    from kiln.kernels.attention.mla_balanced import _first_cta

    for units, ctas in (([65] * 32, 132), ([3, 1, 1, 9, 2], 4), ([1] * 7, 20), ([50], 9),
                        ([2, 2, 3, 5, 25, 65], 132)):
        total = sum(units)
        working = min(ctas, total)
        shares = [range(c * total // working, (c + 1) * total // working)
                  for c in range(working)]
        assert all(len(share) for share in shares)
        assert sorted(u for share in shares for u in share) == list(range(total))
        starts = np.cumsum([0] + units)
        slots = []
        for b, n in enumerate(units):
            first = _first_cta(starts[b], total, working)
            last = _first_cta(starts[b] + n - 1, total, working)
            holders = [c for c, share in enumerate(shares)
                       if set(share) & set(range(starts[b], starts[b] + n))]
            assert holders == list(range(first, last + 1))
            slots += [c + b for c in holders]
        assert len(slots) == len(set(slots))


def test_fused_and_two_kernel_paths_agree(rng):
    """The fused merge and the combine kernel take the same partials to the same bits of
    bf16 O (up to one ulp) and LSE."""
    q, kv, table, lens = mla_problem(rng, 16, 2, [150, 3, 129])
    fused = mla_decode(q, kv, table, lens, num_splits=3, backend="interpret",
                       fused_combine=True)
    apart = mla_decode(q, kv, table, lens, num_splits=3, backend="interpret",
                       fused_combine=False)
    np.testing.assert_allclose(np.asarray(fused[0], np.float32),
                               np.asarray(apart[0], np.float32), rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(fused[1], apart[1], rtol=1e-5, atol=1e-5)


def test_merge_rows_cover_the_block():
    assert [merge_rows(p) for p in (1, 4, 5, 16, 17, 32, 40, 64, 256)] == \
        [4, 4, 8, 16, 32, 32, 64, 64, 64]


def test_scale_and_a_dominant_key_in_a_later_page(rng):
    """A key of page 2 scores far above every earlier one for head 0 (its running max, sum
    and O must move to it), under a custom scale."""
    q, kv, table, lens = mla_problem(rng, 16, 1, [4 * 64 - 3])
    head = q[0, 0, 0].astype(np.float64)
    kv[table[0, 2], 5] = (6.0 * head / np.linalg.norm(head) * 8).astype(ml_dtypes.bfloat16)
    o, lse = mla_decode(q, kv, table, lens, scale=0.2, num_splits=1, backend="interpret")
    want = mla_reference(q, kv, table, lens, scale=0.2)
    assert want[1][0, 0, 0] > 40  # the key dominates head 0's row
    assert_mla_close(o, lse, *want)


def test_partials_follow_the_combine_contract(rng):
    """The kernel's partials, merged by combine, are what mla_decode returns; every slot a row
    counts is written (the interpreter's partials start as NaN)."""
    module = importlib.import_module("kiln.kernels.attention.mla_decode")

    q, kv, table, lens = mla_problem(rng, 16, 2, [150, 3])
    seen = {}
    real_combine = module.combine

    def spy(o_part, lse_part, counts, **kw):
        seen.update(o=o_part.copy(), lse=lse_part.copy(), counts=counts.copy(), **kw)
        return real_combine(o_part, lse_part, counts, **kw)

    module.combine = spy
    try:
        mla_decode(q, kv, table, lens, num_splits=3, backend="interpret", fused_combine=False)
    finally:
        module.combine = real_combine
    assert seen["partials"] == mla_partials(3)
    counts = seen["counts"]
    np.testing.assert_array_equal(counts[0], 3)  # 150 keys: pages 1 + 1 + 1
    np.testing.assert_array_equal(counts[1, 0], 1)  # 2 keys visible: one page
    for b, i, h in np.ndindex(counts.shape):
        assert np.isfinite(seen["o"][:counts[b, i, h], b, i, h]).all()
        assert not np.isnan(seen["lse"][:counts[b, i, h], b, i, h]).any()


def test_empty_batch_and_zero_length_rows(rng):
    q, kv, table, lens = mla_problem(rng, 16, 1, [0, 5], poison_tail=False)
    o, lse = mla_decode(q, kv, table, lens, backend="interpret")
    np.testing.assert_array_equal(o[0].astype(np.float32), 0.0)
    assert np.isneginf(lse[0]).all()
    assert_mla_close(o, lse, *mla_reference(q, kv, table, lens))
    o, lse = mla_decode(q[:0], kv, table[:0], lens[:0], backend="interpret")
    assert o.shape == (0, 1, 16, 512) and lse.shape == (0, 1, 16)


def _args(rng):
    q, kv, table, lens = mla_problem(rng, 16, 1, [70], poison_tail=False)
    return dict(q=q, kv_cache=kv, page_table=table, seq_lens=lens)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: a.update(q=a["q"].astype(np.float32)), kiln.KilnTypeError, "q must be bf16"),
    (lambda a: a.update(q=a["q"][..., :512].copy()), kiln.KilnValueError, "q's D"),
    (lambda a: a.update(q=a["q"][..., :512].copy(), kv_cache=a["kv_cache"][..., :512].copy()),
     kiln.UnsupportedError, "head dim 512"),
    (lambda a: a.update(kv_cache=a["kv_cache"][:, :32].copy()), kiln.UnsupportedError,
     "pages of 32"),
    (lambda a: a.update(q=np.concatenate([a["q"]] * 3, axis=1)), kiln.UnsupportedError,
     "Sq=3"),
    (lambda a: a.update(page_table=a["page_table"].astype(np.int64)), kiln.KilnTypeError,
     "page_table must be i32"),
    (lambda a: a.update(seq_lens=np.array([70, 1], np.int32)), kiln.KilnValueError,
     "seq_lens's B"),
    (lambda a: a.update(seq_lens=np.array([1000], np.int32)), kiln.KilnValueError,
     "seq_lens[0] = 1000"),
    (lambda a: a["page_table"].__setitem__((0, 1), 99), kiln.KilnValueError, "page_table"),
    (lambda a: a.update(q=a["q"][:, :, ::2]), kiln.KilnValueError, "q is not contiguous"),
    (lambda a: a.update(head_dim_v=256), kiln.UnsupportedError, "head_dim_v=256"),
    (lambda a: a.update(num_splits=0), kiln.KilnValueError, "num_splits=0"),
    (lambda a: a.update(num_splits=65), kiln.UnsupportedError, "num_splits=65"),
    (lambda a: a.update(scale=-1.0), kiln.KilnValueError, "scale=-1.0"),
    (lambda a: a.update(backend="cpu"), kiln.KilnValueError, "backend='cpu'"),
    (lambda a: a.update(target="gfx950"), kiln.UnsupportedError, "gfx950"),
    (lambda a: a.update(q=a["q"].tolist()), kiln.KilnTypeError, "q must be"),
    (lambda a: a.update(lead_group=True, split_keys=True), kiln.UnsupportedError,
     "lead_group=True"),
    (lambda a: a.update(lead_group="ahead"), kiln.KilnValueError, "lead_group='ahead'"),
    (lambda a: a.update(q=np.concatenate([a["q"]] * 3, axis=2), transposed=True),
     kiln.UnsupportedError, "not 48"),
    (lambda a: a.update(transposed=True, seesaw=True), kiln.UnsupportedError,
     "its own schedule"),
    (lambda a: a.update(prefetch=7), kiln.KilnValueError, "prefetch=7"),
    (lambda a: a.update(transposed="deep"), kiln.KilnValueError, "transposed='deep'"),
    (lambda a: a.update(merge_slices=3), kiln.KilnValueError, "merge_slices=3"),
    (lambda a: a.update(early_launch=True, early_pages=9), kiln.KilnValueError,
     "early_pages=9"),
    (lambda a: a.update(transposed="ring", prefetch=1), kiln.UnsupportedError, "chunk ring"),
    (lambda a: a.update(prefetch=1, lead_group="pipelined"), kiln.UnsupportedError,
     "pipelined"),
])
def test_bad_input_names_the_argument(change, error, words, rng):
    args = _args(rng)
    change(args)
    with pytest.raises(error) as info:
        mla_decode(args.pop("q"), args.pop("kv_cache"), args.pop("page_table"),
                   args.pop("seq_lens"), backend=args.pop("backend", "interpret"), **args)
    assert words in str(info.value)
    assert info.value.loc is not None and info.value.loc.filename == __file__
    assert info.value.fix


def test_transposed_default_resolves_per_shape(monkeypatch):
    """A transposed default applies at most 16 packed rows and gives way to an explicit
    schedule option; an explicit mode is taken as given (up to 32 rows)."""
    module = importlib.import_module("kiln.kernels.attention.mla_decode")
    monkeypatch.setattr(module, "TRANSPOSED", "ring")
    assert module._transposed(None, 16) == (16, True, False)
    assert module._transposed(None, 32) == (0, False, False)  # 16 rows at most by default
    assert module._transposed(None, 48) == (0, False, False)
    assert module._transposed(None, 16, lead_group=True) == (0, False, False)
    assert module._transposed("pipelined", 20) == (32, False, True)
    assert module._transposed(True, 32) == (32, False, False)
    monkeypatch.setattr(module, "TRANSPOSED", False)
    assert module._transposed(None, 16) == (0, False, False)


@pytest.mark.parametrize("batch,options,balanced", [
    (48, {}, True), (100, {}, True),  # the default split: 96 / 100 CTAs of 132 SMs
    (32, {}, False), (64, {}, False), (128, {}, False), (16, {}, False),  # 128 CTAs; batch 16
    (48, dict(num_splits=2), False), (48, dict(transposed=True), False),  # a split asked for
    (48, dict(balanced=False), False), (32, dict(balanced=True), True)])
def test_balanced_default_resolves_per_batch(batch, options, balanced, monkeypatch):
    """With ``BALANCED`` on, the balanced grid by default where the default split leaves a
    fifth of the SMs idle (132 in the interpreter), at batch 32 or more, with the transposed
    default only."""
    module = importlib.import_module("kiln.kernels.attention.mla_decode")
    monkeypatch.setattr(module, "BALANCED", True)
    q = np.zeros((batch, 1, 16, 576), ml_dtypes.bfloat16)
    kv = np.zeros((4, 64, 576), ml_dtypes.bfloat16)
    plan = module._get_plan(q, kv, np.zeros((batch, 64), np.int32), np.zeros(batch, np.int32),
                            512, None, options.get("num_splits"), None, "interpret", None, None,
                            (None, None, None, options.get("transposed"), None, None, None,
                             options.get("balanced")))
    assert plan.balanced == balanced


def test_default_splits_fill_one_wave():
    assert default_mla_splits(1, 2, 4096) == 64
    assert default_mla_splits(32, 2, 4096, sms=132) == 2  # 128 CTAs
    assert default_mla_splits(64, 2, 4096, sms=132) == 1
    assert default_mla_splits(1, 1, 100) == 2  # never below one page a split


@pytest.mark.lower
@pytest.mark.parametrize("split_keys,scores_n,direct,options", [
    # plain split-keys and direct variants, and the transposed prefetch: slow tier (CI runs it)
    (True, 32, False, {}), pytest.param(False, 64, False, {}, marks=pytest.mark.slow),
    pytest.param(True, 32, True, {}, marks=pytest.mark.slow),
    (True, 32, False, dict(fused_slots=4, heads=16, early_launch=True)),
    (False, 64, False, dict(fused_slots=2)),
    pytest.param(False, 64, True, dict(seesaw=True), marks=pytest.mark.slow),
    pytest.param(False, 64, False, dict(seesaw=True, fused_slots=4, heads=16, early_launch=True),
                 marks=pytest.mark.slow),
    (False, 64, True, dict(lead_group=True, heads=128, sq=2)),
    (False, 64, False, dict(lead_group=True, fused_slots=4, heads=16, early_launch=True)),
    pytest.param(False, 16, False, dict(transposed=True, fused_slots=4, heads=16, prefetch=2),
                 marks=pytest.mark.slow),
    (False, 32, True, dict(transposed=True, heads=16, sq=2)),
    (False, 16, False, dict(transposed=True, balanced=True, heads=16, early_launch=True)),
    pytest.param(False, 16, False, dict(transposed="ring", fused_slots=4, heads=16),
                 marks=pytest.mark.slow)])
def test_compiles_for_sm90a_without_spills(split_keys, scores_n, direct, options):
    ck = compile_mla_decode(target="sm_90a", split_keys=split_keys, direct=direct, **options)
    # The balanced grid spills a few of its segments' values (in the segment's head and
    # store, none in the page loop: its SASS has no LDL/STL between the loop's HGMMAs).
    spills = 160 if options.get("balanced") else 0
    assert ck.metadata["spill_bytes"] <= spills and ck.metadata["registers"] <= 255
    ptx = ck.asm["ptx"]
    assert not ck.metadata["wgmma_serialized"]
    if not options.get("transposed"):  # its products are all m64nRk16
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{scores_n}k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx


@pytest.mark.lower
def test_pipelined_lead_group_compiles_unserialised():
    """Group 0's product left in flight over the loop's back edge: ptxas keeps the WGMMAs
    asynchronous (it spills 8 bytes)."""
    ck = compile_mla_decode(target="sm_90a", heads=128, sq=2, direct=True, split_keys=False,
                            lead_group="pipelined")
    assert not ck.metadata["wgmma_serialized"] and ck.metadata["spill_bytes"] <= 8
    assert ck.asm["ptx"].count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 36
