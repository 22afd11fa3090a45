"""kiln.kernels.attention.combine: LSE merge of split-KV partials, and the Partials contract.

Interpreter runs against a float64 numpy reference with fresh random inputs: random split
counts including 0, empty splits (LSE -inf, O 0) inside the valid range, rows whose every
split is empty, row counts that are not multiples of the 64-row tile, several head dims and
both log bases. Slots past each row's count hold NaN: reading one would poison the output.
Both schedules run: the split-parallel one the plan picks for these few rows, and the wide one
(forced), including split groups that each merge more than one pair.
"""

import importlib
import re

import numpy as np
import pytest
from attention_reference import assert_paged_attention_close

import kiln
from kiln.kernels.attention import Partials, PartialsMismatchError, combine, compile_combine
from kiln.kernels.runtime import PlanCache

combine_module = importlib.import_module("kiln.kernels.attention.combine")
CombineConfig, choose_config = combine_module.CombineConfig, combine_module.choose_config


def make_partials(rng, splits, batch, sq, heads, head_dim, *, empty_fraction=0.2, log_base="e",
                  counts=None):
    o = rng.standard_normal((splits, batch, sq, heads, head_dim)).astype(np.float32)
    lse = (rng.standard_normal((splits, batch, sq, heads)) * 4.0).astype(np.float32)
    if counts is None:
        counts = rng.integers(0, splits + 1, (batch, sq, heads)).astype(np.int32)
    empty = rng.random(lse.shape) < empty_fraction
    lse[empty] = -np.inf
    o[empty] = 0.0
    slot = np.arange(splits)[:, None, None, None]
    unused = slot >= counts[None]
    lse[unused] = np.nan                      # never read
    o[unused] = np.nan
    if log_base == "2":
        lse = (lse * np.log2(np.e)).astype(np.float32)
    return o, lse, counts


def reference(o, lse, counts, log_base="e"):
    """float64 (o, lse) with the C == 0 / Z == 0 conventions."""
    lse = lse.astype(np.float64) * (np.log(2.0) if log_base == "2" else 1.0)
    slot = np.arange(o.shape[0])[:, None, None, None]
    lse = np.where(slot < counts[None], lse, -np.inf)
    m = lse.max(axis=0)
    finite = np.isfinite(m)
    m_safe = np.where(finite, m, 0.0)
    w = np.exp(lse - m_safe)
    z = w.sum(axis=0)
    o64 = np.where((slot < counts[None])[..., None], o.astype(np.float64), 0.0)
    out = (w[..., None] * o64).sum(axis=0) / np.where(z > 0, z, 1.0)[..., None]
    valid = finite & (z > 0)
    return (np.where(valid[..., None], out, 0.0),
            np.where(valid, np.log(np.where(valid, z, 1.0)) + m_safe, -np.inf))


def assert_matches(o, lse, o_ref, lse_ref, tol):
    np.testing.assert_allclose(o.astype(np.float64), o_ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["chosen", "wide"])
def schedule(request, monkeypatch):
    """Run with the schedule the plan picks (split-parallel for these small problems), or with
    the wide one forced."""
    monkeypatch.setattr(combine_module, "_PLANS", PlanCache("test"))
    if request.param == "wide":
        monkeypatch.setattr(combine_module, "choose_config", lambda *a: combine_module.WIDE)
    return request.param


@pytest.mark.parametrize("splits,batch,sq,heads,head_dim", [
    (5, 2, 3, 37, 64),       # 111 rows: one full and one partial tile
    (16, 1, 1, 32, 128),     # decode shape, half a tile
    (2, 3, 5, 13, 256),
    (7, 1, 70, 1, 80),       # head dim with 4-wide vectors only
    (33, 1, 1, 5, 128),      # decode's 33 splits: 17 pairs, one group each
])
def test_combine_matches_float64(splits, batch, sq, heads, head_dim, schedule, rng):
    o_p, lse_p, counts = make_partials(rng, splits, batch, sq, heads, head_dim)
    counts.flat[0] = 0                                  # at least one row with no split
    if splits > 1:                                      # a row whose valid splits are empty
        last = (batch - 1, sq - 1, heads - 1)
        counts[last] = 2
        lse_p[(slice(0, 2),) + last] = -np.inf
        o_p[(slice(0, 2),) + last] = 0.0
    o, lse = combine(o_p, lse_p, counts, max_splits=max(splits, 8), out_dtype=kiln.f32,
                     backend="interpret")
    assert_matches(o, lse, *reference(o_p, lse_p, counts), tol=1e-5)
    assert not np.isnan(o).any()


def test_split_groups_that_merge_several_pairs_each(rng):
    """D = 256 caps a split-parallel CTA at 32 groups: 70 splits are 35 pairs, so groups 0-2
    merge two pairs each (and the loop runs zero times for rows with few splits)."""
    assert choose_config(3, 1, 70, 256) == CombineConfig(rows_per_cta=1, split_groups=32)
    o_p, lse_p, counts = make_partials(rng, 70, 1, 1, 3, 256,
                                       counts=np.array([[[70, 0, 66]]], np.int32))
    o, lse = combine(o_p, lse_p, counts, max_splits=70, out_dtype=kiln.f32, backend="interpret")
    assert_matches(o, lse, *reference(o_p, lse_p, counts), tol=1e-5)


@pytest.mark.parametrize("rows,batch,max_splits,head_dim,expected", [
    (64, 1, 33, 128, CombineConfig(rows_per_cta=2, split_groups=32)),   # decode, batch 1
    (256, 4, 33, 128, CombineConfig(rows_per_cta=2, split_groups=32)),  # 16 wide CTAs only
    (32, 1, 2, 128, CombineConfig()),                                   # one pair: wide
    (16384 * 64, 1, 2, 128, CombineConfig()),                           # prefill-sized rows
    (64 * 64, 16, 33, 128, CombineConfig()),                            # 1024 wide CTAs
    (64, 1, 8, 128, CombineConfig(rows_per_cta=16, split_groups=4)),
    (64, 1, 33, 256, CombineConfig(rows_per_cta=1, split_groups=32)),   # 32 KB of sums
])
def test_schedule_choice(rows, batch, max_splits, head_dim, expected):
    config = choose_config(rows, batch, max_splits, head_dim)
    assert config == expected
    assert config.threads <= 512
    assert config.split_groups * config.rows_per_cta * head_dim * 4 <= 32 * 1024 or \
        config.split_groups == 1


def test_bf16_output_and_log_base_2_partials(rng):
    o_p, lse_p, counts = make_partials(rng, 9, 2, 4, 24, 128, log_base="2")
    produced = Partials(producer="test-producer", max_splits=9, log_base="2")
    o, lse = combine(o_p, lse_p, counts, max_splits=16, partials=produced, backend="interpret")
    assert o.dtype == kiln.bf16.numpy
    assert_matches(o, lse, *reference(o_p, lse_p, counts, log_base="2"), tol=1e-2)


def test_large_lse_magnitudes_stay_accurate(rng):
    """LSEs near 5000 (long contexts): no overflow, weights from the LSE differences."""
    o_p, lse_p, counts = make_partials(rng, 4, 1, 2, 40, 64, empty_fraction=0.0)
    lse_p = np.where(np.isnan(lse_p), lse_p, lse_p * 30.0 + 5000.0).astype(np.float32)
    o, lse = combine(o_p, lse_p, counts, max_splits=4, out_dtype=kiln.f32, backend="interpret")
    assert_matches(o, lse, *reference(o_p, lse_p, counts), tol=1e-5)


def test_producer_carrying_partials_is_accepted(rng):
    class Producer:
        partials = Partials(producer="decode", max_splits=4)

    o_p, lse_p, counts = make_partials(rng, 4, 1, 1, 8, 64)
    o, lse = combine(o_p, lse_p, counts, max_splits=4, out_dtype=kiln.f32, partials=Producer(),
                     backend="interpret")
    assert_matches(o, lse, *reference(o_p, lse_p, counts), tol=1e-5)


@pytest.mark.parametrize("field,value,match", [
    ("max_splits", 64, "max_splits: decode may write 64 splits, .*combine is sized for 32"),
    ("depth_order", "blocked", "depth_order: decode writes 'blocked', .*combine reads 'natural'"),
    ("layout", ("b", "q", "h", "split", "d"), "layout: decode writes"),
    ("dtype", kiln.bf16, "dtype: decode writes .*bf16"),
])
def test_disagreeing_partials_fail_naming_both_sides(field, value, match, rng):
    o_p, lse_p, counts = make_partials(rng, 2, 1, 1, 4, 64)
    produced = Partials(**{"producer": "decode", "max_splits": 2, field: value})
    with pytest.raises(PartialsMismatchError, match=match):
        combine(o_p, lse_p, counts, partials=produced, backend="interpret")


def test_bad_inputs_are_rejected_before_compiling(rng):
    o_p, lse_p, counts = make_partials(rng, 3, 1, 2, 4, 64, empty_fraction=0.0)
    counts[:] = 3
    with pytest.raises(kiln.KilnValueError, match="more than max_splits=2"):
        combine(o_p, lse_p, counts, max_splits=2, backend="interpret")
    with pytest.raises(kiln.KilnValueError, match="partials disagree"):
        combine(o_p, lse_p[:, :, :1], counts, backend="interpret")
    with pytest.raises(kiln.KilnTypeError, match="split_counts int32"):
        combine(o_p, lse_p, counts.astype(np.int64), backend="interpret")
    with pytest.raises(kiln.KilnTypeError, match="Partials or an object"):
        combine(o_p, lse_p, counts, partials="decode", backend="interpret")
    with pytest.raises(kiln.KilnValueError, match="log_base"):
        Partials(producer="p", max_splits=2, log_base="10")


def test_repeat_calls_reuse_one_plan_per_shape_class(monkeypatch, rng):
    made = []
    make_plan = combine_module._make_plan
    monkeypatch.setattr(combine_module, "_make_plan",
                        lambda *a: made.append(a[3]) or make_plan(*a))
    monkeypatch.setattr(combine_module, "_PLANS", PlanCache("test"))
    for max_splits in (5, 5, 7):  # fresh values each call; a new max_splits is a new plan
        o_p, lse_p, counts = make_partials(rng, 5, 2, 3, 4, 64)
        o, lse = combine(o_p, lse_p, counts, max_splits=max_splits, out_dtype=kiln.f32,
                         backend="interpret")
        assert_matches(o, lse, *reference(o_p, lse_p, counts), tol=1e-5)
    assert made == [5, 7]


@pytest.mark.lower
@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
@pytest.mark.parametrize("config,shared_bytes", [
    (CombineConfig(), 64 * 32 * 4),                                    # weights only
    (CombineConfig(rows_per_cta=2, split_groups=32), 2 * 40 * 4 + 32 * 2 * 128 * 4),
])
def test_combine_compiles_to_16_byte_loads_without_spills(target, config, shared_bytes):
    ck = compile_combine(target=target, head_dim=128, max_splits=33 if config.split_groups > 1
                         else 32, config=config)
    if target == "sm_90a":
        assert "ld.global.v4.b32" in ck.asm["ptx"]
        assert ck.metadata["spill_bytes"] == 0
    else:
        assert re.search(r"global_load_dwordx4", ck.asm["amdgcn"])
        assert ck.metadata["scratch_bytes"] == 0
    assert ck.metadata.get("shared_bytes", ck.metadata.get("lds_bytes")) == shared_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("splits,batch,sq,heads,head_dim", [(16, 4, 1, 32, 128),
                                                            (2, 1, 300, 16, 64),
                                                            (33, 1, 1, 64, 128)])
@pytest.mark.parametrize("out_dtype", [kiln.f32, kiln.bf16])
def test_combine_on_gpu_matches_float64(splits, batch, sq, heads, head_dim, out_dtype, rng):
    """Against the numpy float64 merge; the first call writes into NaN-poisoned ``out`` /
    ``lse_out``, the repeats reuse the bound launch with fresh tensors' addresses."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch_out = torch.float32 if out_dtype is kiln.f32 else torch.bfloat16
    for call in range(3):
        o_p, lse_p, counts = make_partials(rng, splits, batch, sq, heads, head_dim)
        dev = [torch.from_numpy(a).cuda() for a in (o_p, lse_p, counts)]
        poisoned = dict(out=torch.full((batch, sq, heads, head_dim), float("nan"),
                                       device="cuda", dtype=torch_out),
                        lse_out=torch.full((batch, sq, heads), float("nan"), device="cuda")) \
            if call == 0 else {}
        o, lse = combine(*dev, max_splits=max(splits, 2), out_dtype=out_dtype, **poisoned)
        assert o.is_contiguous() and lse.is_contiguous() and lse.data_ptr() % 16 == 0
        assert tuple(o.shape) == (batch, sq, heads, head_dim) and lse.dtype == torch.float32
        o_ref, lse_ref = reference(o_p, lse_p, counts)
        assert_matches(o.float().cpu().numpy(), lse.cpu().numpy(), o_ref, lse_ref,
                       tol=1e-4 if out_dtype is kiln.f32 else 1e-2)


def test_preallocated_outputs_are_written_and_returned(rng):
    o_p, lse_p, counts = make_partials(rng, 4, 2, 3, 5, 64)
    out = np.full((2, 3, 5, 64), np.nan, np.float32)        # poisoned: fully overwritten
    lse_out = np.full((2, 3, 5), np.nan, np.float32)
    o, lse = combine(o_p, lse_p, counts, max_splits=4, out_dtype=kiln.f32, backend="interpret",
                     out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    assert_matches(out, lse_out, *reference(o_p, lse_p, counts), tol=1e-5)
    with pytest.raises(kiln.KilnValueError, match="lse_out must be a contiguous float32"):
        combine(o_p, lse_p, counts, max_splits=4, out_dtype=kiln.f32, backend="interpret",
                lse_out=np.empty((2, 3, 5), np.float64))
    with pytest.raises(kiln.KilnValueError, match=r"out must be .* shape \(2, 3, 5, 64\)"):
        combine(o_p, lse_p, counts, max_splits=4, out_dtype=kiln.f32, backend="interpret",
                out=np.empty((2, 3, 5, 32), np.float32))


# --- decode_attention's host path: its plan cache and its bound decode + combine pair


def _decode_inputs(rng, q_dtype=kiln.bf16.numpy):
    q = rng.standard_normal((1, 1, 8, 64)).astype(q_dtype)
    cache = rng.standard_normal((2, 64, 1, 64)).astype(kiln.bf16.numpy)
    return q, cache, cache.copy(), np.array([[1, 0]], np.int32), np.array([100], np.int32)


def test_decode_plans_miss_on_any_shape_or_dtype_change(monkeypatch, rng):
    plan_module = importlib.import_module("kiln.kernels.attention.decode_plan")
    monkeypatch.setattr(plan_module, "PLANS", PlanCache("test"))
    inputs = _decode_inputs(rng)
    first = plan_module.get_plan(*inputs, None, None, None, None, None, "interpret", None, False)
    assert plan_module.get_plan(*_decode_inputs(rng), None, None, None, None, None,
                                "interpret", None, False) is first
    with pytest.raises(kiln.KilnTypeError, match="q must be bf16"):
        plan_module.get_plan(*_decode_inputs(rng, np.float16), None, None, None, None, None,
                             "interpret", None, False)
    q, k, v, table, _ = inputs
    with pytest.raises(kiln.KilnValueError, match="seq_lens"):
        plan_module.get_plan(q, k, v, table, np.array([100, 100], np.int32), None, None, None,
                             None, None, "interpret", None, False)
    assert len(plan_module.PLANS) == 1 and first.bound is None and first.merge is None
    # the one partials allocation: O, then LSE, then counts at a 16-byte boundary
    assert (first.lse_offset, first.counts_offset % 4) == (first.slots * 8 * 64, 0)
    assert first.partial_words == first.counts_offset + 8


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq", [(1, 1), (2, 4)])
def test_bound_decode_attention_matches_decode_then_combine(batch, sq, rng):
    """decode_attention's bound two-kernel pair (one partials allocation, combine plan
    reused) gives the bits decode() + combine() give, for fresh inputs each call; its fused
    kernel (the last split CTA combines) agrees to rounding."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kiln.kernels.attention.decode import decode, decode_attention, decode_partials

    torch.manual_seed(int(rng.integers(2 ** 31)))  # the inputs follow the reported seed
    for _ in range(3):
        kc = torch.randn(40, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(40, device="cuda")[:batch * 20].view(batch, 20).int()
        q = torch.randn(batch, sq, 16, 128, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.randint(sq, 20 * 64, (batch,), device="cuda", dtype=torch.int32)
        # Fused first: its partials must not come from a buffer the same values were left in.
        o_fused, lse_fused = decode_attention(q, kc, vc, table, seq_lens, fused_combine=True)
        o, lse = decode_attention(q, kc, vc, table, seq_lens, fused_combine=False)
        o_part, lse_part, counts = decode(q, kc, vc, table, seq_lens)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                       for t in (o_part, lse_part, counts))  # one allocation, parts apart
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        o_want, lse_want = combine(o_part, lse_part, counts, max_splits=o_part.shape[0],
                                   partials=decode_partials(o_part.shape[0]))
        assert not torch.isnan(o).any()
        assert_paged_attention_close(o, lse, q, kc, vc, table, seq_lens)  # independent
        torch.testing.assert_close(o, o_want, atol=0, rtol=0)
        torch.testing.assert_close(lse, lse_want, atol=0, rtol=0)
        torch.testing.assert_close(o_fused.float(), o_want.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse_fused, lse_want, atol=1e-5, rtol=1e-5)
