"""combine's seed layouts: partials in the ``stg128`` depth order (MSA's ``real_to_fake``)
and token-ragged partials with ``cu_seqlens_q`` / ``max_seqlen_q``, against the float64
reference of ``test_attention_combine`` on fresh random partials (unused slots hold NaN)."""

import importlib

import numpy as np
import pytest
from test_attention_combine import assert_matches, make_partials, reference

import kiln
from kiln.kernels.attention import Partials, combine, compile_combine
from kiln.kernels.attention.partials import fake_to_real, real_to_fake, stg128_vector
from kiln.kernels.runtime import PlanCache
from kiln.runtime.cuda import cuda_available

combine_module = importlib.import_module("kiln.kernels.attention.combine")
needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")


@pytest.fixture(params=["chosen", "wide"])
def schedule(request, monkeypatch):
    monkeypatch.setattr(combine_module, "_PLANS", PlanCache("test"))
    if request.param == "wide":
        monkeypatch.setattr(combine_module, "choose_config", lambda *a: combine_module.WIDE)
    return request.param


def to_stg128(o):
    """Natural-order partials as an stg128 producer stores them."""
    vector = stg128_vector(kiln.dtype(o.dtype))
    fake = np.empty_like(o)
    fake[..., [real_to_fake(r, vector) for r in range(o.shape[-1])]] = o
    return fake


@pytest.mark.parametrize("vector", [4, 8])
def test_real_to_fake_is_the_mma_store_permutation(vector):
    group = 4 * vector
    fake = [real_to_fake(r, vector) for r in range(3 * group)]
    assert sorted(fake) == list(range(3 * group))
    assert [fake_to_real(f, vector) for f in fake] == list(range(3 * group))
    # Quad lane t's 16-byte store holds its column pairs 2t, 2t + 1 of consecutive 8-blocks.
    for t in range(4):
        stored = [fake_to_real(f, vector) for f in range(t * vector, (t + 1) * vector)]
        assert stored == [8 * j + 2 * t + e for j in range(vector // 2) for e in (0, 1)]


@pytest.mark.parametrize("dtype,head_dim", [(np.float32, 64), (np.float32, 48),
                                            (kiln.bf16.numpy, 96)])
def test_stg128_partials_merge_in_natural_order(dtype, head_dim, schedule, rng):
    o_p, lse_p, counts = make_partials(rng, 7, 2, 3, 5, head_dim)
    o_p = o_p.astype(dtype)
    producer = Partials(producer="msa", max_splits=8, dtype=kiln.dtype(dtype),
                        depth_order="stg128")
    o, lse = combine(to_stg128(o_p), lse_p, counts, max_splits=8, out_dtype=kiln.f32,
                     partials=producer, backend="interpret")
    assert_matches(o, lse, *reference(o_p.astype(np.float32), lse_p, counts), tol=1e-5)
    # Read as natural order, the same bytes give another answer: the order is honoured.
    wrong, _ = combine(to_stg128(o_p), lse_p, counts, max_splits=8, out_dtype=kiln.f32,
                       backend="interpret")
    assert np.abs(wrong - o).max() > 0.1


def test_stg128_needs_whole_groups(rng):
    o_p, lse_p, counts = make_partials(rng, 2, 1, 1, 2, 40)
    producer = Partials(producer="msa", max_splits=2, depth_order="stg128")
    with pytest.raises(kiln.UnsupportedError, match="groups of 16"):
        combine(o_p, lse_p, counts, max_splits=2, partials=producer, backend="interpret")


def ragged_partials(rng, splits, lengths, heads, head_dim, max_seqlen_q):
    """Token-major partials of sequences ``lengths`` and the dense per-sequence view."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    dense = [make_partials(rng, splits, 1, n, heads, head_dim) for n in lengths]
    o_p = np.concatenate([o[:, 0] for o, _, _ in dense], axis=1)
    lse_p = np.concatenate([lse[:, 0] for _, lse, _ in dense], axis=1)
    counts = np.full((len(lengths), max_seqlen_q, heads), 10 ** 6, np.int32)  # never read
    for b, (_, _, c) in enumerate(dense):
        counts[b, :lengths[b]] = c[0]
    return o_p, lse_p, counts, cu, dense


@pytest.mark.parametrize("lengths,max_seqlen_q", [([3, 0, 17, 1], 17), ([5, 9], 12)])
def test_ragged_partials_match_each_sequence(lengths, max_seqlen_q, schedule, rng):
    heads, head_dim, splits = 5, 32, 6
    o_p, lse_p, counts, cu, dense = ragged_partials(rng, splits, lengths, heads, head_dim,
                                                    max_seqlen_q)
    counts[counts == 10 ** 6] = 0  # numpy counts are checked against the slots
    o, lse = combine(o_p, lse_p, counts, cu_seqlens_q=cu, max_seqlen_q=max_seqlen_q,
                     max_splits=splits, out_dtype=kiln.f32, backend="interpret")
    assert o.shape == (sum(lengths), heads, head_dim) and lse.shape == (sum(lengths), heads)
    for b, (o_b, lse_b, c_b) in enumerate(dense):
        rows = slice(cu[b], cu[b + 1])
        assert_matches(o[rows][None], lse[rows][None], *reference(o_b, lse_b, c_b), tol=1e-5)


def test_ragged_stg128_bf16_out(rng):
    o_p, lse_p, counts, cu, dense = ragged_partials(rng, 3, [4, 7], 2, 64, 8)
    counts[counts == 10 ** 6] = 0
    producer = Partials(producer="msa", max_splits=4, depth_order="stg128")
    o, lse = combine(to_stg128(o_p), lse_p, counts, cu_seqlens_q=cu, max_splits=4,
                     partials=producer, backend="interpret")
    assert o.dtype == kiln.bf16.numpy
    for b, (o_b, lse_b, c_b) in enumerate(dense):
        rows = slice(cu[b], cu[b + 1])
        assert_matches(o[rows][None].astype(np.float32), lse[rows][None],
                       *reference(o_b, lse_b, c_b), tol=1e-2)


@pytest.mark.parametrize("change,match", [
    (dict(max_seqlen_q=3), "longer than max_seqlen_q"),
    (dict(max_seqlen_q=9), "max_seqlen_q"),
    (dict(cu=np.array([0, 4, 10], np.int32)), "prefix sums"),
    (dict(cu=np.array([0, 4, 11], np.int64)), "int32"),
    (dict(o_p=np.zeros((3, 10, 2, 64), np.float32)), "disagree"),
])
def test_bad_ragged_inputs_are_refused(change, match, rng):
    o_p, lse_p, counts, cu, _ = ragged_partials(rng, 3, [4, 7], 2, 64, 8)
    counts[counts == 10 ** 6] = 0
    args = dict(o_p=o_p, cu=cu, max_seqlen_q=None) | change
    with pytest.raises(kiln.KilnError, match=match):
        combine(args["o_p"], lse_p, counts, cu_seqlens_q=args["cu"],
                max_seqlen_q=args["max_seqlen_q"], backend="interpret")


def test_max_seqlen_q_needs_cu_seqlens(rng):
    o_p, lse_p, counts = make_partials(rng, 2, 1, 3, 2, 64)
    with pytest.raises(kiln.KilnValueError, match="ragged"):
        combine(o_p, lse_p, counts, max_seqlen_q=3, backend="interpret")


@pytest.mark.lower
@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_layouts_compile_without_spills(target):
    for kwargs in (dict(depth_order="stg128"), dict(ragged=True),
                   dict(ragged=True, depth_order="stg128", dtype=kiln.bf16)):
        ck = compile_combine(target=target, **kwargs)
        assert ck.metadata.get("spill_bytes", 0) == 0
        assert ck.metadata.get("scratch_bytes", 0) == 0


@pytest.mark.gpu
@needs_gpu
def test_ragged_stg128_on_gpu(rng):
    import torch

    o_p, lse_p, counts, cu, dense = ragged_partials(rng, 9, [300, 1, 77, 0, 129], 8, 128,
                                                    300)
    producer = Partials(producer="msa", max_splits=16, depth_order="stg128")
    dev = [torch.from_numpy(x).cuda() for x in (to_stg128(o_p), lse_p, counts, cu)]
    o, lse = combine(*dev[:3], cu_seqlens_q=dev[3], max_splits=16, out_dtype=kiln.f32,
                     partials=producer)
    o, lse = o.cpu().numpy(), lse.cpu().numpy()
    for b, (o_b, lse_b, c_b) in enumerate(dense):
        rows = slice(cu[b], cu[b + 1])
        assert_matches(o[rows][None], lse[rows][None], *reference(o_b, lse_b, c_b), tol=1e-5)
