"""Split-KV decode on a GPU against the float64 reference and torch; streams and graphs."""

import math

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.attention.decode import decode

from attention_reference import assert_paged_attention_close, poison_cuda_pool
from decode_problems import D, plan_module, problem


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
    q, kc, vc, table, seq_lens, _ = problem(rng, B, sq, Hkv * group, Hkv, page_size, lens,
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
