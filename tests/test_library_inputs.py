"""The kernel library's entry points validate what they are given (issue 38): each bad input
raises a KilnError naming the argument at the caller's line, zero-size inputs return correctly
shaped outputs, combine follows the seed's non-finite contract, and the interpreter's launch
arguments are checked like the GPU launch's. CPU only (numpy, ``backend="interpret"``), except
the GPU test of the device-tensor page-id policy."""

import math

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.attention import combine, decode, decode_attention, prefill
from kiln.kernels.gemm import matmul

BF16 = ml_dtypes.bfloat16
D = 64
SEED = np.random.SeedSequence().entropy  # printed on failure: rerun with this seed


def _rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


def _decode_problem(rng, batch=2, sq=1, hq=4, hkv=2, page_size=16, num_pages=6, width=3):
    shape = (num_pages, page_size, hkv, D)
    kc = rng.standard_normal(shape).astype(BF16)
    vc = rng.standard_normal(shape).astype(BF16)
    q = rng.standard_normal((batch, sq, hq, D)).astype(BF16)
    table = rng.permutation(num_pages)[:batch * width].reshape(batch, width).astype(np.int32)
    lens = np.full(batch, width * page_size - 8, np.int32)  # every table entry is used
    return q, kc, vc, table, lens


def _raises(error, words, fn, *args, **kwargs):
    """``fn`` raises ``error`` whose message has ``words`` and points at this file."""
    with pytest.raises(error, match=words) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, kiln.KilnError)
    assert info.value.loc is not None and info.value.loc.filename == __file__
    assert info.value.fix
    return info.value


# --- decode / decode_attention -------------------------------------------------------------

@pytest.mark.parametrize("entry", [decode, decode_attention])
@pytest.mark.parametrize("bad,words", [
    (dict(table=lambda t: t.at(0, 1, 6)), r"page_table\[0, 1\] = 6 is not a page"),
    (dict(table=lambda t: t.at(1, 0, -1)), r"page_table\[1, 0\] = -1 is not a page"),
    (dict(lens=lambda n: n.at(1, 3 * 16 + 1)), r"seq_lens\[1\] = 49 is outside \[0, 48\]"),
    (dict(lens=lambda n: n.at(0, -1)), r"seq_lens\[0\] = -1 is outside"),
    (dict(num_splits=0), r"num_splits=0 must be positive"),
    (dict(num_splits=2.5), r"num_splits=2.5 must be positive \(an int\)"),
    (dict(table=lambda t: t.base[0]), r"page_table must be \[B, max_pages\] \(rank 2\)"),
    (dict(table=lambda t: t.base.astype(np.int64)), r"page_table must be i32"),
    (dict(lens=lambda n: n.base[:1]), r"seq_lens's B is 1, but q's B is 2"),
    (dict(kc=lambda c: c[..., :32]), r"k_cache's D is 32, but q's D is 64"),
    (dict(kc=lambda c: c[:, :, :0], vc=lambda c: c[:, :, :0]), r"k_cache has Hkv=0 heads"),
    (dict(q=lambda q: q.tolist()), r"q must be a numpy array or a torch tensor"),
    (dict(scale=-1.0), r"scale=-1.0 must be positive"),
    (dict(backend="cpu"), r"backend='cpu' is not one of"),
])
def test_decode_rejects_bad_inputs_naming_them(entry, bad, words):
    """Each of these ran before (a zero box read, a wrong default, an IndexError, or only
    the interpreter's bounds check): now a KilnError names the argument before any launch."""
    q, kc, vc, table, lens = _decode_problem(_rng())
    args = dict(q=q, kc=kc, vc=vc, table=_Edit(table), lens=_Edit(lens))
    options = {}
    for name, change in bad.items():
        if callable(change):
            args[name] = change(args[name])
        else:
            options[name] = change
    args = {k: v.base if isinstance(v, _Edit) else v for k, v in args.items()}
    error = kiln.KilnTypeError if "must be i32" in words or "numpy array" in words \
        else kiln.KilnValueError
    _raises(error, words, entry, args["q"], args["kc"], args["vc"], args["table"],
            args["lens"], backend=options.pop("backend", "interpret"), **options)


@pytest.mark.parametrize("entry", [decode, decode_attention])
def test_decode_rejects_block_indices_below_minus_one(entry):
    """-1 pads a block selection; anything lower names no block and is refused."""
    q, kc, vc, table, lens = _decode_problem(_rng())
    selection = np.full((2, 1, 2, 2), -1, np.int32)
    selection[1, 0, 1, 0] = -2
    _raises(kiln.KilnValueError, "block_table holds an entry below -1", entry, q, kc, vc, table,
            lens, block_table=selection, backend="interpret")


class _Edit:
    """A numpy array and a one-element edit of a copy of it (``.at(i, j, value)``)."""

    def __init__(self, base):
        self.base = base

    def at(self, *index_and_value):
        *index, value = index_and_value
        edited = self.base.copy()
        edited[tuple(index)] = value
        return edited


def test_page_ids_past_the_sequence_are_not_read():
    """Entries a sequence does not reach may hold anything (-1, past the pool): not an error,
    and the result is the one with valid ids there."""
    rng = _rng()
    q, kc, vc, table, lens = _decode_problem(rng, batch=1)
    lens[:] = 20  # pages 0 and 1 of 16 keys; entry 2 is never read
    garbage = table.copy()
    garbage[0, 2] = -7
    want = decode_attention(q, kc, vc, table, lens, num_splits=2, backend="interpret")
    got = decode_attention(q, kc, vc, garbage, lens, num_splits=2, backend="interpret")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("shape", [(0, 1, 4), (2, 0, 4), (2, 1, 0)])
def test_decode_of_an_empty_batch_returns_empty_outputs(shape):
    """``B``, ``Sq`` or ``Hq`` of 0 returned partials / outputs of the right shape and dtype
    (B = 0 raised ZeroDivisionError; Sq = 0 was refused)."""
    B, Sq, Hq = shape
    q, kc, vc, table, lens = _decode_problem(_rng())
    q = np.zeros((B, Sq, Hq, D), BF16)
    table, lens = table[:B], lens[:B]
    o_part, lse_part, counts = decode(q, kc, vc, table, lens, num_splits=3,
                                      backend="interpret")
    assert o_part.shape == (3, B, Sq, Hq, D) and o_part.dtype == np.float32
    assert lse_part.shape == (3, B, Sq, Hq) and lse_part.dtype == np.float32
    assert counts.shape == (B, Sq, Hq) and counts.dtype == np.int32
    o, lse = decode_attention(q, kc, vc, table, lens, backend="interpret")
    assert o.shape == (B, Sq, Hq, D) and o.dtype == BF16
    assert lse.shape == (B, Sq, Hq) and lse.dtype == np.float32


# --- combine ---------------------------------------------------------------------------------

def _combine_reference(o_part, lse_part, counts):
    """float64 merge of the seed contract (msa_combine): only the first ``C`` slots count; a
    zero or non-finite denominator (C = 0, all -inf, a NaN or +inf LSE) gives O = 0,
    LSE = -inf."""
    splits, batch, sq, heads, d = o_part.shape
    o = np.zeros((batch, sq, heads, d))
    lse = np.full((batch, sq, heads), -np.inf)
    for b, i, h in np.ndindex(batch, sq, heads):
        x = lse_part[:counts[b, i, h], b, i, h].astype(np.float64)
        if x.size == 0 or np.isnan(x).any() or np.isposinf(x).any() or x.max() == -np.inf:
            continue
        w = np.exp(x - x.max())
        o[b, i, h] = (w[:, None] * o_part[:x.size, b, i, h].astype(np.float64)).sum(0) / w.sum()
        lse[b, i, h] = x.max() + np.log(w.sum())
    return o, lse


@pytest.mark.parametrize("splits", [2, 5])  # the wide schedule, split-parallel
def test_combine_non_finite_lse_gives_zero_output_and_minus_inf(splits):
    """A NaN or +inf LSE in a counted slot gave O = NaN; the contract is O = 0, LSE = -inf.
    Rows with only -inf, or no counted slot, keep that result; other rows merge as usual."""
    rng = _rng()
    sq, heads = 2, 8
    o_part = rng.standard_normal((splits, 1, sq, heads, D)).astype(np.float32)
    lse_part = (rng.standard_normal((splits, 1, sq, heads)) * 3).astype(np.float32)
    counts = rng.integers(1, splits + 1, (1, sq, heads)).astype(np.int32)
    counts[0, 0, :4] = splits
    lse_part[1, 0, 0, 0] = np.nan
    lse_part[0, 0, 0, 1] = np.inf
    lse_part[:, 0, 0, 2] = -np.inf
    counts[0, 0, 3] = 0
    lse_part[1, 0, 0, 3] = np.nan  # past the count: ignored
    out = np.full((1, sq, heads, D), np.nan, np.float32)  # poisoned: every row is written
    lse_out = np.full((1, sq, heads), np.nan, np.float32)
    o, lse = combine(o_part, lse_part, counts, max_splits=splits, out_dtype=kiln.f32,
                     backend="interpret", out=out, lse_out=lse_out)
    want_o, want_lse = _combine_reference(o_part, lse_part, counts)
    assert (o[0, 0, :4] == 0).all() and (lse[0, 0, :4] == -np.inf).all()
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_combine_zero_splits_and_empty_batches():
    """Zero split slots: every row has C = 0, so O = 0, LSE = -inf (was a misleading stride
    error); an empty batch gives empty outputs."""
    counts = np.zeros((2, 1, 4), np.int32)
    o, lse = combine(np.zeros((0, 2, 1, 4, D), np.float32), np.zeros((0, 2, 1, 4), np.float32),
                     counts, out_dtype=kiln.f32, backend="interpret")
    assert o.shape == (2, 1, 4, D) and (o == 0).all()
    assert lse.shape == (2, 1, 4) and (lse == -np.inf).all()
    o, lse = combine(np.zeros((3, 0, 1, 4, D), np.float32), np.zeros((3, 0, 1, 4), np.float32),
                     np.zeros((0, 1, 4), np.int32), backend="interpret")
    assert o.shape == (0, 1, 4, D) and o.dtype == BF16 and lse.shape == (0, 1, 4)


def test_combine_rejects_bad_inputs_naming_them():
    rng = _rng()
    o_part = rng.standard_normal((2, 1, 1, 4, D)).astype(np.float32)
    lse_part = rng.standard_normal((2, 1, 1, 4)).astype(np.float32)
    counts = np.full((1, 1, 4), 2, np.int32)
    _raises(kiln.KilnValueError, "head dim D = 0", combine, o_part[..., :0], lse_part, counts,
            backend="interpret")
    for bad in (3, -1):
        wrong = counts.copy()
        wrong[0, 0, 2] = bad
        _raises(kiln.KilnValueError, rf"split_counts\[0, 0, 2\] = {bad} is outside \[0, 2\]",
                combine, o_part, lse_part, wrong, backend="interpret")
    _raises(kiln.KilnTypeError, "LSE_partial must be a numpy array", combine, o_part,
            lse_part.tolist(), counts, backend="interpret")


# --- prefill ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
@pytest.mark.parametrize("q_shape,k_shape", [((1, 8, 0, D), (1, 8, 2, D)),   # Hq = 0
                                             ((1, 0, 2, D), (1, 8, 2, D)),   # Sq = 0
                                             ((0, 8, 2, D), (0, 8, 2, D))])  # B = 0
def test_prefill_without_query_rows_returns_empty_outputs(target, q_shape, k_shape):
    """Hq = 0 raised a reshape ValueError, Sq = 0 misleading errors or IndexError."""
    q, k = np.ones(q_shape, BF16), np.ones(k_shape, BF16)
    o, lse = prefill(q, k, k, return_lse=True, target=target, backend="interpret")
    assert o.shape == q_shape and o.dtype == BF16
    assert lse.shape == (q_shape[0], q_shape[2], q_shape[1]) and lse.dtype == np.float32


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_prefill_without_keys_gives_zero_output_and_the_sink(target):
    """Sk = 0: every row sees no key, so o = 0 and lse = -inf, or the sink's logit."""
    rng = _rng()
    q = rng.standard_normal((2, 4, 2, D)).astype(BF16)
    k = np.ones((2, 0, 2, D), BF16)
    o, lse = prefill(q, k, k, return_lse=True, target=target, backend="interpret")
    assert o.shape == q.shape and (o == 0).all() and (lse == -np.inf).all()
    sinks = rng.standard_normal(2).astype(np.float32)
    o, lse = prefill(q, k, k, sinks=sinks, return_lse=True, target=target, backend="interpret")
    assert (o == 0).all()
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], (2, 2, 4)))


def test_ragged_prefill_of_no_sequences_or_no_keys():
    """An empty ragged batch (cu_seqlens = [0]) was refused; no keys at all gives o = 0."""
    cu = np.zeros(1, np.int32)
    o, lse = prefill(np.ones((0, 2, D), BF16), np.ones((0, 2, D), BF16),
                     np.ones((0, 2, D), BF16), cu_seqlens_q=cu, cu_seqlens_k=cu,
                     return_lse=True, backend="interpret")
    assert o.shape == (0, 2, D) and lse.shape == (2, 0)
    q = _rng().standard_normal((5, 2, D)).astype(BF16)
    o, lse = prefill(q, np.ones((0, 2, D), BF16), np.ones((0, 2, D), BF16),
                     cu_seqlens_q=np.array([0, 2, 5], np.int32),
                     cu_seqlens_k=np.zeros(3, np.int32), return_lse=True, backend="interpret")
    assert (o == 0).all() and lse.shape == (2, 5) and (lse == -np.inf).all()


def test_prefill_rejects_bad_inputs_naming_them():
    q, k = np.ones((1, 8, 2, D), BF16), np.ones((1, 8, 2, D), BF16)
    _raises(kiln.KilnValueError, "k has Hkv=0 heads", prefill, q, k[:, :, :0], k[:, :, :0],
            backend="interpret")
    _raises(kiln.KilnTypeError, "q must be a numpy array", prefill, q.tolist(), k, k,
            backend="interpret")
    _raises(kiln.KilnValueError, "scale=0 must be positive", prefill, q, k, k, scale=0,
            backend="interpret")


# --- matmul ----------------------------------------------------------------------------------

def test_matmul_zero_sizes_and_bad_operands():
    a, b = np.ones((0, 16), BF16), np.ones((16, 8), BF16)
    assert matmul(a, b, backend="interpret").shape == (0, 8)
    c = matmul(np.ones((4, 0), BF16), np.ones((0, 8), BF16), backend="interpret")
    assert c.shape == (4, 8) and c.dtype == BF16 and (c == 0).all()
    _raises(kiln.KilnValueError, r"a must be \[M, K\] \(rank 2\)", matmul, np.ones(16, BF16),
            b, backend="interpret")
    _raises(kiln.KilnTypeError, "b must be a numpy array", matmul, np.ones((4, 16), BF16),
            [[1.0]], backend="interpret")


# --- interpreter (and GPU) launch arguments ------------------------------------------------

@kiln.kernel
def _add_one(x, y, n: kiln.i32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        y[i] = x[i] + 1.0


@pytest.mark.parametrize("grid,error,words", [
    (2.5, kiln.KilnTypeError, r"grid dimension 0 is 2.5 \(float\), not an int"),
    ((1, 1.0), kiln.KilnTypeError, "grid dimension 1 is 1.0"),
    (0, kiln.KilnValueError, "grid dimension 0 is 0"),
    ((1, -2), kiln.KilnValueError, "grid dimension 1 is -2"),
    ((1, 1, 1, 1), kiln.KilnValueError, "1 to 3 dimensions"),
    ((), kiln.KilnValueError, "1 to 3 dimensions"),
])
def test_interpreter_rejects_bad_grids(grid, error, words):
    x, y = np.ones(8, np.float32), np.zeros(8, np.float32)
    _raises(error, words, _add_one.interpret[grid], x, y, 8, BLOCK=32, num_warps=1)


def test_interpreter_checks_integer_arguments_and_read_only_outputs():
    """An i32 of 2**33 raised OverflowError; a read-only output the interpreter's ValueError.
    A read-only input is fine."""
    x, y = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    _raises(kiln.KilnValueError, r"argument 'n' = 8589934592 is outside the range of i32",
            _add_one.interpret[1], x, y, 2**33, BLOCK=32, num_warps=1)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    _raises(kiln.KilnValueError, r"writes argument 'y', a read-only numpy array",
            _add_one.interpret[1], x, frozen, 8, BLOCK=32, num_warps=1)
    x.flags.writeable = False
    _add_one.interpret[1](x, y, 8, BLOCK=32, num_warps=1)
    np.testing.assert_array_equal(y, np.arange(8) + 1.0)


def test_gpu_launch_packs_integer_arguments_with_the_same_check():
    """The GPU path's argument converter refuses 2**33 for an i32 with the same error."""
    from kiln.runtime.arguments import scalar_converter
    from kiln.signature import ScalarParam

    to_int = scalar_converter(ScalarParam("n", "i32"))
    flat = []
    to_int(2**31 - 1, flat, None)
    assert flat == [2**31 - 1]
    _raises(kiln.KilnValueError, r"argument 'n' = 8589934592 is outside the range of i32",
            to_int, 2**33, flat, None)


# --- device tensors ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_device_page_ids_out_of_range_raise_unless_vouched_for():
    """torch CUDA tensors with validate=True: an out-of-range or negative page id, or a seq_len
    past the table, raises (one device-side reduction); a validated call inside a capture is
    refused rather than silently unchecked; unchecked calls (the default) poison, never read
    another page."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, kc, vc, table, lens = (torch.from_numpy(np.asarray(x).view(np.int16)).cuda().view(
        torch.bfloat16) if x.dtype == BF16 else torch.from_numpy(x).cuda()
        for x in _decode_problem(_rng(), page_size=64, num_pages=6, width=2))
    lens.fill_(100)
    decode_attention(q, kc, vc, table, lens, validate=True)  # in range: runs
    for entry, value, words in ((0, 6, r"page_table\[0, 1\] = 6"),
                                (0, -1, r"page_table\[0, 1\] = -1")):
        bad = table.clone()
        bad[entry, 1] = value
        for fn in (decode, decode_attention):
            _raises(kiln.KilnValueError, words, fn, q, kc, vc, bad, lens, validate=True)
        out, _ = decode_attention(q, kc, vc, bad, lens)  # unchecked: poisoned rows
        assert torch.isnan(out[entry].float()).any()
    long = lens.clone()
    long[1] = 129
    _raises(kiln.KilnValueError, r"seq_lens\[1\] = 129", decode_attention, q, kc, vc, table,
            long, validate=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(kiln.KilnValueError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            decode_attention(q, kc, vc, table, lens, validate=True)
    torch.cuda.synchronize()
    assert math.isfinite(float(decode_attention(q, kc, vc, table, lens)[1].float().sum()))


@pytest.mark.parametrize("page_size", [16, 64])  # several pages a tile, one page a tile
@pytest.mark.parametrize("bad_id", [6, -1])
def test_unchecked_out_of_range_page_ids_poison_their_rows(monkeypatch, page_size, bad_id):
    """What ``validate=False`` leaves to the kernel (device tensors), run here by skipping the
    host check: an id outside the cache read a zero box (a quietly wrong output); now V's NaN
    out-of-bounds fill makes that sequence's rows NaN and leaves the others exact."""
    import kiln.kernels.runtime as inputs

    rng = _rng()
    q, kc, vc, table, lens = _decode_problem(rng, page_size=page_size, num_pages=6, width=3)
    lens[:] = 2 * page_size + 3  # entries 0..2 are read
    want_o, want_lse = decode_attention(q, kc, vc, table, lens, num_splits=2,
                                        backend="interpret")
    monkeypatch.setattr(inputs, "_check_paged_numpy", lambda *args: None)
    bad = table.copy()
    bad[0, 1] = bad_id
    o, lse = decode_attention(q, kc, vc, bad, lens, num_splits=2, backend="interpret")
    assert np.isnan(o[0].astype(np.float32)).all()
    np.testing.assert_array_equal(o[1], want_o[1])
    np.testing.assert_array_equal(lse[1], want_lse[1])


def test_an_unchecked_seq_len_past_the_table_poisons_instead_of_reading_past_it(monkeypatch):
    """A seq_len longer than the page table (unchecked with validate=False) made the kernel
    read entries past its row (the interpreter's bounds check; another sequence's pages on a
    GPU); now the keys past the
    table read NaN boxes, so that sequence's rows are NaN and the others exact."""
    import kiln.kernels.runtime as inputs

    q, kc, vc, table, lens = _decode_problem(_rng(), num_pages=6, width=3)
    want_o, _ = decode_attention(q, kc, vc, table, lens, num_splits=2, backend="interpret")
    monkeypatch.setattr(inputs, "_check_paged_numpy", lambda *args: None)
    long = lens.copy()
    long[0] = 3 * 16 + 10  # 10 keys past the table's 3 pages of 16
    o, _ = decode_attention(q, kc, vc, table, long, num_splits=2, backend="interpret")
    assert np.isnan(o[0].astype(np.float32)).all()
    np.testing.assert_array_equal(o[1], want_o[1])


def test_tensor_map_annotation_takes_an_out_of_bounds_fill():
    """``kiln.TensorMap[dtype, box, swizzle, "nan"]``: what decode's V map declares."""
    spec = kiln.TensorMap[kiln.bf16, (16, 64), 128, "nan"]
    assert (spec.box, spec.swizzle, spec.oob_fill_nan) == ((16, 64), 128, True)
    assert not kiln.TensorMap[kiln.bf16, (16, 64), 128].oob_fill_nan
    _raises(kiln.KilnValueError, "out-of-bounds fill 'inf'", lambda: kiln.TensorMap[
        kiln.bf16, (16, 64), 128, "inf"])
