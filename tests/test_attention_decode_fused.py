"""decode_attention: the combine of split partials, fused into the last split CTA or not."""

import re

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.attention.decode import decode
from kiln.kernels.runtime import PlanCache

from attention_reference import assert_paged_attention_close, paged_attention_reference
from decode_problems import BN, D, decode_module, merge, plan_module, problem


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

    q, kc, vc, table, seq_lens, _ = problem(rng, 2, 4, 8, 2, 16, [3 * BN - 5, 7])
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
    q, kc, vc, table, seq_lens, _ = problem(rng, len(lens), 4, 2, 1, 16, lens)
    _check_decode_attention(q, kc, vc, table, seq_lens, num_splits=2)


def test_rows_whose_every_score_is_very_negative(rng):
    """Query rows whose scores all sit near one offset from 0 down to -1e4 (natural units):
    the running max starts at -inf, so no row's denominator underflows."""
    q, kc, vc, table, seq_lens, _ = problem(rng, 2, 4, 8, 2, 16, [BN + 7, 3 * BN - 1])
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
    q, kc, vc, table, seq_lens, sink = problem(rng, 2, sq, group * hkv, hkv, page_size, lens,
                                                sinks=sinks, head_dim=head_dim)
    o, lse = decode_attention(q, kc, vc, table, seq_lens, num_splits=3, sinks=sink,
                              backend="interpret", fused_combine=True)
    assert_paged_attention_close(o, lse, q, kc, vc, table, seq_lens, sinks=sink)


def test_fused_and_two_kernel_decode_attention_agree(rng):
    from kiln.kernels.attention.decode import decode_attention

    q, kc, vc, table, seq_lens, _ = problem(rng, 2, 2, 8, 2, 16, [3 * BN + 9, BN - 3])
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
    q, kc, vc, table, seq_lens, _ = problem(rng, B, Sq, Hq, Hkv, 16, [3 * BN + 7])
    blocks = np.full((B, Sq, Hkv, top_k), -1, np.int32)
    blocks[0, 0, 0] = [2, 0, -1]
    blocks[0, 1, 1] = [3, 1, 2]  # blocks[0, 0, 1] and blocks[0, 1, 0] select nothing
    o, lse = decode_attention(q, kc, vc, table, seq_lens, block_table=blocks,
                              backend="interpret", fused_combine=True)
    parts = decode(q, kc, vc, table, seq_lens, block_table=blocks, backend="interpret")
    want_o = merge(*parts)
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
    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 4, 8, 1, 64, [4 * BN], head_dim=128)
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
        q, kc, vc, table, seq_lens, _ = problem(rng, 1, sq, 8, 1, 64, [4 * BN])
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


@pytest.mark.parametrize("fused", [True, False])
def test_decode_attention_writes_into_given_outputs(fused, rng):
    from kiln.kernels.attention.decode import decode_attention

    q, kc, vc, table, seq_lens, _ = problem(rng, 1, 2, 4, 2, 16, [2 * BN + 5])
    shape = q.shape
    out = np.full(shape, np.nan, ml_dtypes.bfloat16)
    lse_out = np.full(shape[:3], np.nan, np.float32)
    o, lse = decode_attention(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret",
                              fused_combine=fused, out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    assert_paged_attention_close(out, lse_out, q, kc, vc, table, seq_lens)
    for name, bad in (("out", np.zeros(shape, np.float32)),
                      ("lse_out", np.zeros(shape[:2], np.float32))):
        with pytest.raises(kiln.KilnValueError, match=f"decode_attention's {name} must be"):
            decode_attention(q, kc, vc, table, seq_lens, num_splits=2, backend="interpret",
                             **{name: bad})
