"""Shared fixtures of the decode tests: random paged problems and the float64 split reference."""

import importlib

import ml_dtypes
import numpy as np

from kiln.kernels.attention.decode import DecodeConfig

decode_module = importlib.import_module("kiln.kernels.attention.decode")
plan_module = importlib.import_module("kiln.kernels.attention.decode_plan")

BN = DecodeConfig().block_n
D = 64
# P is rounded to bf16 to feed the tensor cores (P.V in mma.sync), so O carries bf16 relative
# error on each weight; LSE comes from the f32 probabilities.
# 4e-3 ~ 2^-8, bf16's unit roundoff u: the bound u * sum_j P_j |v_j| of that error where
# sum P|v| stays near 1 (random scores spread P over many keys).
O_TOL = dict(atol=4e-3, rtol=4e-3)


def problem(rng, batch, sq, hq, hkv, page_size, seq_lens, *, sinks=False, head_dim=D):
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


def gather(cache, table, b, length):
    """The first ``length`` logical rows of sequence ``b``: ``[length, Hkv, D]`` float64."""
    page_size = cache.shape[1]
    rows = np.arange(length)
    return cache[table[b, rows // page_size], rows % page_size].astype(np.float64)


def partial(q_row, keys, values, scale, sink=None):
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


def reference_splits(q, k_cache, v_cache, table, lens, num_splits, scale, sinks=None, *,
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
        keys, values = gather(k_cache, table, b, L), gather(v_cache, table, b, L)
        for i in range(Sq):
            visible = L - Sq + i + 1
            for h in range(Hq):
                counts[b, i, h] = -(-(-(-max(visible, 0) // BN)) // per_split)
                for s in range(num_splits):
                    lo = min(s * per_split * BN, visible)
                    hi = min((s + 1) * per_split * BN, max(visible, 0))
                    sink = sinks[h] if sinks is not None and s == 0 else None
                    o[s, b, i, h], lse[s, b, i, h] = partial(
                        q[b, i, h].astype(np.float64), keys[lo:hi, h // group],
                        values[lo:hi, h // group], scale, sink)
    return o, lse, counts


def merge(o_part, lse_part, counts):
    """numpy LSE merge of the first ``counts`` slots (the combine contract)."""
    S = o_part.shape[0]
    valid = np.arange(S)[:, None, None, None] < counts[None]
    lse = np.where(valid, lse_part, -np.inf)
    m = lse.max(axis=0)
    w = np.where(valid, np.exp(lse - np.where(np.isfinite(m), m, 0)), 0.0)
    z = w.sum(axis=0)
    return (w[..., None] * np.where(valid[..., None], o_part, 0)).sum(axis=0) / \
        np.where(z > 0, z, 1)[..., None]


def check_partials(got, want, counts_want):
    o, lse, counts = got
    o_want, lse_want, _ = want
    np.testing.assert_array_equal(counts, counts_want)
    finite = np.isfinite(lse_want)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_want[finite], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o, o_want, **O_TOL)


def torch_paged(torch, rng, hq=8, hkv=1, d=64, page_size=64, pages=4):
    """A small decode problem as torch CPU tensors (fresh random values): ``q``, the K and V
    caches, a page table of two pages and a length 5 keys into the second."""
    def bf16(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16()

    kc = bf16(pages, page_size, hkv, d)
    return (bf16(1, 1, hq, d), kc, kc.clone(),
            torch.from_numpy(rng.permutation(pages)[:2].reshape(1, 2).astype(np.int32)),
            torch.tensor([page_size + 5], dtype=torch.int32))
