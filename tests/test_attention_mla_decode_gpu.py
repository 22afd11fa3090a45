"""MLA decode on a Hopper GPU against the float64 reference and a torch float32 one."""

import ml_dtypes
import numpy as np
import pytest

from mla_problems import DV, PAGE, assert_mla_close, mla_problem, mla_reference


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def _to_cuda(torch, x):
    """A numpy array (bf16 included, exactly) as a CUDA tensor of the same dtype."""
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
    return torch.from_numpy(x).to("cuda")


def _numpy(torch, x):
    return x.float().cpu().numpy() if x.dtype == torch.bfloat16 else x.cpu().numpy()


def torch_mla(torch, q, kv, table, seq_lens, scale=None):
    """Float32 torch reference: gather each sequence's pages, heads x tokens as query rows
    of one latent head, bottom-right causal among the tokens."""
    B, sq, heads, dqk = q.shape
    scale = dqk ** -0.5 if scale is None else scale
    o = torch.zeros(B, sq, heads, DV, device=q.device)
    lse = torch.full((B, sq, heads), -float("inf"), device=q.device)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        rows = kv[table[b, :-(-L // PAGE)].long()].reshape(-1, dqk)[:L].float()
        s = torch.einsum("thd,kd->thk", q[b].float(), rows) * scale
        limit = L - sq + torch.arange(sq, device=q.device)
        visible = torch.arange(L, device=q.device)[None, :] <= limit[:, None]
        s = s.masked_fill(~visible[:, None, :], -float("inf"))
        lse[b] = torch.logsumexp(s, dim=-1)
        o[b] = torch.nan_to_num(torch.softmax(s, dim=-1)) @ rows[:, :DV]
    return o, lse


@pytest.mark.gpu
@pytest.mark.parametrize("split_keys", [True, False])
@pytest.mark.parametrize("heads,sq,num_splits", [(16, 1, None), (16, 2, 3), (128, 1, None),
                                                 (128, 2, 5), (64, 2, 1), (40, 1, 7)])
def test_matches_float64_on_gpu(heads, sq, num_splits, split_keys, rng):
    """Odd and page-aligned lengths, shuffled pages, NaN past every sequence and in the unused
    pages; the output pool is poisoned before the call."""
    torch = _torch()
    from kiln.kernels.attention import mla_decode

    lens = [1, 63, 65, 200, int(rng.integers(300, 3000)), 4096]
    q, kv, table, seq_lens = mla_problem(rng, heads, sq, lens)
    dev = [_to_cuda(torch, x) for x in (q, kv, table, seq_lens)]
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))
    o, lse = mla_decode(*dev, num_splits=num_splits, validate=True, split_keys=split_keys)
    assert o.dtype == torch.bfloat16 and o.shape == (len(lens), sq, heads, DV)
    assert_mla_close(_numpy(torch, o), _numpy(torch, lse), *mla_reference(q, kv, table, seq_lens))


def _check_twice_on_gpu(heads, sq, num_splits, options, rng):
    """``mla_decode`` with ``options`` on ragged lengths up to 4096 against the float64
    reference, twice (the fused kernel's tickets carry over), NaN left in the pool before
    each call."""
    torch = _torch()
    from kiln.kernels.attention import mla_decode

    lens = [1, 63, 65, 200, int(rng.integers(300, 3000)), 4096]
    q, kv, table, seq_lens = mla_problem(rng, heads, sq, lens)
    dev = [_to_cuda(torch, x) for x in (q, kv, table, seq_lens)]
    want = mla_reference(q, kv, table, seq_lens)
    for _ in range(2):
        torch.empty(1 << 26, device="cuda").fill_(float("nan"))
        o, lse = mla_decode(*dev, num_splits=num_splits, validate=True, **options)
        assert_mla_close(_numpy(torch, o), _numpy(torch, lse), *want)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(fused_combine=True), dict(fused_combine=False), dict(seesaw=True),
    dict(seesaw=True, fused_combine=True, early_launch=True),
    dict(fused_combine=True, early_launch=True), dict(lead_group=True),
    dict(lead_group=True, fused_combine=True, early_launch=True),
    dict(lead_group="pipelined"), dict(lead_group="pipelined", early_launch=True),
    dict(prefetch=1), dict(prefetch=2, early_launch=True), dict(merge_slices=2),
    dict(early_launch=True, early_pages=2)])
@pytest.mark.parametrize("heads,sq,num_splits", [(16, 1, 4), (128, 2, 3), (40, 1, 1)])
def test_kernel_options_on_gpu(heads, sq, num_splits, options, rng):
    """The fused combine (or not), the seesaw pairs, early launch and the lead group against
    the float64 reference, called twice (the fused kernel's tickets carry over between
    calls)."""
    _check_twice_on_gpu(heads, sq, num_splits, options, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(transposed=True), dict(transposed=True, prefetch=2, early_launch=True),
    dict(transposed="ring"), dict(transposed="ring", early_launch=True),
    dict(transposed="pipelined"), dict(transposed="ring-pipelined", early_launch=True),
    dict(transposed="ring", merge_slices=4),
    dict(transposed=True, early_launch=True, early_pages=2, merge_slices=4)])
@pytest.mark.parametrize("heads,sq,num_splits", [(16, 1, 4), (16, 2, 3), (8, 1, 1)])
def test_transposed_on_gpu(heads, sq, num_splits, options, rng):
    """The transposed schedule (16 and 32 query rows, 8 of 16 real) on two page stages or the
    chunk ring, against the float64 reference, called twice."""
    _check_twice_on_gpu(heads, sq, num_splits, options, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,sq,ctas,balanced,early", [
    (16, 1, None, True, None), (16, 2, None, 2, None), (8, 1, 5, 0, False)])
def test_balanced_on_gpu(heads, sq, ctas, balanced, early, rng):
    """The page-balanced grid on every SM (most shares empty or overhead only: six
    sequences, about 110 units) or 5 CTAs, 16 and 32 query rows, against the float64
    reference, called twice (each launch's merging CTAs reset the sequences' counters)."""
    _check_twice_on_gpu(heads, sq, ctas, dict(balanced=balanced, early_launch=early), rng)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,heads", [(32, 1, 128), (33, 2, 128), (64, 2, 16)])
def test_matches_torch_float32_at_serving_shapes(batch, sq, heads):
    """Batches of 4k-context sequences (ragged), default splits, against torch in float32."""
    torch = _torch()
    from kiln.kernels.attention import mla_decode

    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + sq)
    lens = torch.randint(3000, 4097, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    pages = 4096 // PAGE
    kv = torch.randn(batch * pages + 5, PAGE, 576, device="cuda", dtype=torch.bfloat16,
                     generator=gen)
    table = torch.randperm(batch * pages + 5, device="cuda", generator=gen)[:batch * pages]
    table = table.view(batch, pages).int()
    q = torch.randn(batch, sq, heads, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    o, lse = mla_decode(q, kv, table, lens)
    want_o, want_lse = torch_mla(torch, q, kv, table, lens.cpu())
    assert (o.float() - want_o).abs().max().item() < 2e-2
    assert (lse - want_lse).abs().max().item() < 1e-3
