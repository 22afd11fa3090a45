"""Float64 numpy reference for attention prefill, shared by every attention test.

Conventions (the ones `kiln.kernels.attention.prefill` implements):

- Dense inputs: q `[B, Sq, Hq, D]`, k/v `[B, Sk, Hkv, D]`; `Hq % Hkv == 0`, query head `h` reads
  KV head `h // (Hq // Hkv)` (MHA, GQA, MQA alike).
- Ragged inputs: q `[total_q, Hq, D]`, k/v `[total_k, Hkv, D]` with int32 `cu_seqlens_q/k`
  (`[B + 1]`, prefix sums); sequence `b` owns rows `cu[b]:cu[b + 1]`.
- Masks intersect. Query `i` of a sequence with `Sq` queries and `Sk` keys sits at key position
  `p = i + Sk - Sq` (bottom-right alignment). Key `j` is visible iff
  `causal`: `j <= p`; `window=(left, right)` (FlashAttention `window_size`, -1 = unbounded):
  `p - left <= j <= p + right`; `chunk=C`: `j // C == p // C`.
- `sinks[h]` is the logit (already in scaled-score units) of a virtual key whose value vector is
  zero: it enlarges the softmax denominator and adds nothing to the numerator.
- `lse[b, h, i]` is the natural log of the softmax denominator, sink included. A query row that
  sees no key has `o = 0` and `lse = -inf` (or `lse = sinks[h]` with a sink).
  Ragged `lse` is `[Hq, total_q]`.

Example:
    >>> q = np.random.randn(1, 5, 2, 64); k = np.random.randn(1, 7, 1, 64); v = k.copy()
    >>> o, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    >>> o.shape, lse.shape
    ((1, 5, 2, 64), (1, 2, 5))
"""

from __future__ import annotations

import numpy as np


def visible_keys(sq: int, sk: int, *, causal=False, window=None, chunk=None) -> np.ndarray:
    """Boolean `[sq, sk]`: True where query row `i` may read key `j` (conventions above)."""
    pos = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    visible = np.ones((sq, sk), dtype=bool)
    if causal:
        visible &= j <= pos
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= pos - left
        if right >= 0:
            visible &= j <= pos + right
    if chunk is not None:
        visible &= (j // chunk) == (pos // chunk)
    return visible


def _one_sequence(q, k, v, *, scale, sinks, softcap=None, **mask):
    """q `[Sq, Hq, D]`, k/v `[Sk, Hkv, D]` → o `[Sq, Hq, D]`, lse `[Hq, Sq]` (float64)."""
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    kh = np.repeat(k, group, axis=1)
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, kh) * scale
    if softcap:  # Gemma-2 soft-capping of the scaled scores, before the mask
        scores = softcap * np.tanh(scores / softcap)
    visible = visible_keys(sq, sk, **mask)[None]
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, initial=-np.inf)
    if sinks is not None:
        row_max = np.maximum(row_max, np.asarray(sinks, np.float64)[:, None])
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - safe_max[..., None])
    denom = weights.sum(axis=-1)
    if sinks is not None:
        denom = denom + np.exp(np.asarray(sinks, np.float64)[:, None] - safe_max)
    numer = np.einsum("hqk,khd->qhd", weights, vh)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(denom.T[..., None] > 0, numer / denom.T[..., None], 0.0)
        lse = np.where(denom > 0, np.log(denom) + safe_max, -np.inf)
    return o.reshape(sq, hq, dv), lse


def attention_reference(q, k, v, *, causal=False, window=None, chunk=None, sinks=None,
                        scale=None, softcap=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        return_lse=False):
    """Attention forward in float64; same arguments and shapes as `prefill` (module docstring)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    mask = dict(causal=causal, window=window, chunk=chunk, softcap=softcap)
    if cu_seqlens_q is None:
        outs = [_one_sequence(q[b], k[b], v[b], scale=scale, sinks=sinks, **mask)
                for b in range(q.shape[0])]
        o = np.stack([o for o, _ in outs])
        lse = np.stack([lse for _, lse in outs])
    else:
        cq = np.asarray(cu_seqlens_q)
        ck = np.asarray(cu_seqlens_k)
        o = np.zeros(q.shape[:2] + (v.shape[-1],))
        lse = np.full((q.shape[1], q.shape[0]), -np.inf)
        for b in range(len(cq) - 1):
            qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            o[qs], lse[:, qs] = _one_sequence(q[qs], k[ks], v[ks], scale=scale, sinks=sinks, **mask)
    return (o, lse) if return_lse else o


# Unit roundoff of the dtype P is cast to before P V and O is stored in.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
LSE_TOLERANCE = 1e-5  # f32 row sums and logs: measured below 1e-6 on the interpreter


def exact_inputs(x):
    """``x`` rounded to values that bf16 and f16 both hold exactly (through f16, then bf16:
    8 significant bits inside f16's range), so every storage dtype a test casts to keeps them
    and the float64 reference sees the kernel's inputs exactly."""
    import ml_dtypes

    return np.asarray(x, np.float32).astype(np.float16).astype(ml_dtypes.bfloat16) \
        .astype(np.float32)


def assert_attention_close(o, q, k, v, *, lse=None, score_error=0.0, **reference_kwargs):
    """Check a kernel's ``o`` (and ``lse``; numpy or torch) elementwise against
    :func:`attention_reference` on the same inputs ``q``, ``k``, ``v`` (the arrays the kernel
    got). Returns the reference LSE.

    Each element may err by ``u * |o| + u * (1 + u) * sum_j P_j |v_j|`` with ``u`` the unit
    roundoff of ``o``'s dtype: the bound for P rounded to that dtype before ``P V`` plus the
    rounding of the stored output. A key too many or too few in a row moves its output by
    ``P_key |v_key - o|``, well past that for rows that see a few hundred keys or fewer.

    ``score_error``: the most an approximate op may move each (natural-unit) score, e.g. a
    hardware tanh's; it moves each P by a factor within ``exp(+-2 score_error)``, so adds
    ``(exp(2 score_error) - 1) sum_j P_j |v_j|``."""
    got = _host(o)
    u = UNIT_ROUNDOFF[got.dtype.name]
    want_o, want_lse = attention_reference(q, k, v, return_lse=True, **reference_kwargs)
    magnitude = attention_reference(q, k, np.abs(np.asarray(v, np.float64)), **reference_kwargs)
    got = got.astype(np.float64)
    assert got.shape == want_o.shape
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} NaN outputs"
    # The stored output's rounding also scales P's rounding error: the u**2 term.
    p_error = u * (1 + u) + np.expm1(2 * score_error)  # P's rounding, plus the scores' error
    tolerance = u * np.abs(want_o) + p_error * magnitude + 1e-7
    excess = np.abs(got - want_o) - tolerance
    if (excess > 0).any():
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        raise AssertionError(
            f"{(excess > 0).sum()} of {excess.size} outputs exceed their tolerance; worst at "
            f"{worst}: got {got[worst]:.6g}, want {want_o[worst]:.6g}, tolerance "
            f"{tolerance[worst]:.3g} (index [batch, row, head, depth] or [token, head, depth])")
    if lse is not None:
        lse = _host(lse)
        assert lse.shape == want_lse.shape
        finite = np.isfinite(want_lse)
        assert np.array_equal(np.isfinite(lse), finite), "LSE is finite exactly where rows see keys"
        assert (lse[~finite] == -np.inf).all(), "rows that see no key have LSE -inf"
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=LSE_TOLERANCE,
                                   rtol=LSE_TOLERANCE)
    return want_lse


def random_qkv(rng, *, batch, sq, sk, hq, hkv, d, dtype=np.float32, ragged_q=None, ragged_k=None,
               dv=None):
    """Fresh random q/k/v (values exactly representable in both bf16 and f16, see
    :func:`exact_inputs`; v's head dim ``dv``, default ``d``) and, for ragged batches, int32
    `cu_seqlens` from per-sequence length lists."""
    dv = d if dv is None else dv
    def draw(*shape):
        return exact_inputs(rng.standard_normal(shape)).astype(dtype)
    if ragged_q is None:
        return draw(batch, sq, hq, d), draw(batch, sk, hkv, d), draw(batch, sk, hkv, dv), None, None
    cu_q = np.concatenate([[0], np.cumsum(ragged_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(ragged_k)]).astype(np.int32)
    return (draw(int(cu_q[-1]), hq, d), draw(int(cu_k[-1]), hkv, d), draw(int(cu_k[-1]), hkv, dv),
            cu_q, cu_k)


def very_negative_scores(rng, *, sq, sk, d, lowest=-1.0e4, batch=1, hq=1, hkv=1):
    """q/k/v whose query rows see scaled scores (at the default scale ``1/sqrt(d)``) all near
    one row offset, from 0 down to ``lowest`` (natural units): column 0 holds ``q = c_row``
    and ``k = -256``, the other columns random. Rows whose max is below about -87 (-126 log2
    units) underflow a softmax whose running max starts at 0 instead of the row's own max."""
    q, k, v, _, _ = random_qkv(rng, batch=batch, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d)
    offsets = np.concatenate([np.linspace(0.0, -200.0, (sq + 1) // 2),
                              -np.geomspace(200.0, -lowest, sq // 2)])
    k[..., 0] = -256.0
    q[..., 0] = exact_inputs(-offsets * np.sqrt(d) / 256.0)[None, :, None]
    return q, k, v


def rising_maxima(rng, *, sq, sk, d, block_kv, step=13.0):
    """q/k/v whose rows' running max grows by ``2.3 * c_row`` log2 units (c_row in 2..6) in
    every ``block_kv``-key tile: tile ``t``'s keys sit at level ``step * t`` of column 0 and
    one key per tile at ``step * (t + 1)``. Each tile's bulk keeps a weight that a wrong
    rescale factor (exp2 of the wrong difference) visibly changes."""
    q, k, v, _, _ = random_qkv(rng, batch=1, sq=sq, sk=sk, hq=1, hkv=1, d=d)
    keys = np.arange(sk)
    k[0, :, 0, 0] = step * (keys // block_kv) + step * (keys % block_kv == 5)
    q[0, :, 0, 0] = 2.0 + np.arange(sq) % 5
    return q, k, v


def tile_edge_lengths(block_q: int, block_k: int, *, every: bool = False):
    """``(lengths_q, lengths_k)`` of a ragged batch whose sequences put ``Sk - Sq`` (of either
    sign) at tile-edge residues modulo ``block_k`` -- the ones a one-key error in a boundary
    tile's mask shows at -- with ``Sq`` just below, at and past a query tile and ``Sk`` at
    the matching residues. ``every``: every residue of ``Sk - Sq`` modulo ``block_k`` instead,
    with ``Sq`` spread over ``1 .. block_q + 2``. One launch covers them all."""
    # A difference one key tile longer puts the diagonal of a block's first row in the second
    # key tile, past any tile a kernel masks unconditionally (e.g. a pipeline's prologue).
    if every:
        pairs = [(1 + (5 * r) % (block_q + 2), r + block_k * (r % 2)) for r in range(block_k)]
    else:
        edges = (0, 1, 2, block_k - 2, block_k - 1)
        pairs = [pair for r in edges for pair in ((1, r), (1, r + block_k),
                                                  (block_q - 1, r + block_k), (block_q + 1, r))]
    # Sq > Sk: bottom-right alignment leaves the first rows with no key under a causal mask.
    pairs += [(sq, -r) for sq, r in ((block_q - 1, 1), (block_q + 1, block_q), (3, 2))]
    return [sq for sq, _ in pairs], [sq + r for sq, r in pairs]


def paged_attention_reference(q, k_cache, v_cache, page_table, seq_lens, *, sinks=None,
                              scale=None):
    """Float64 ``(o [B, Sq, Hq, D], lse [B, Sq, Hq])`` of decode over a paged cache
    ``[pages, page_size, Hkv, D]``: sequence ``b``'s logical key ``r`` is at
    ``page_table[b, r // page_size]``, row ``r % page_size``; the ``Sq`` new tokens are the
    last of the ``seq_lens[b]`` keys, causal among themselves (bottom-right alignment)."""
    k_cache, v_cache = (np.asarray(c).astype(np.float64) for c in (k_cache, v_cache))
    q, table, lens = np.asarray(q).astype(np.float64), np.asarray(page_table), np.asarray(seq_lens)
    page_size = k_cache.shape[1]
    outs, lses = [], []
    for b in range(q.shape[0]):
        rows = np.arange(int(lens[b]))
        pages, offsets = table[b, rows // page_size], rows % page_size
        o, lse = attention_reference(q[b:b + 1], k_cache[pages, offsets][None],
                                     v_cache[pages, offsets][None], causal=True, sinks=sinks,
                                     scale=scale, return_lse=True)
        outs.append(o[0])
        lses.append(lse[0].T)
    return np.stack(outs), np.stack(lses)


def assert_paged_attention_close(o, lse, q, k_cache, v_cache, page_table, seq_lens, *,
                                 sinks=None, scale=None):
    """:func:`assert_attention_close`'s elementwise bound for decode outputs (numpy or torch)
    against :func:`paged_attention_reference` on the same inputs."""
    o, lse, q, k_cache, v_cache, page_table, seq_lens = (
        _host(x) for x in (o, lse, q, k_cache, v_cache, page_table, seq_lens))
    sinks = None if sinks is None else _host(sinks)
    want_o, want_lse = paged_attention_reference(q, k_cache, v_cache, page_table, seq_lens,
                                                 sinks=sinks, scale=scale)
    magnitude, _ = paged_attention_reference(q, k_cache, np.abs(v_cache.astype(np.float64)),
                                             page_table, seq_lens, sinks=sinks, scale=scale)
    got = o.astype(np.float64)
    assert got.shape == want_o.shape and not np.isnan(got).any()
    u = UNIT_ROUNDOFF[o.dtype.name]
    tolerance = u * np.abs(want_o) + u * (1 + u) * magnitude + 1e-7  # as assert_attention_close
    excess = np.abs(got - want_o) - tolerance
    assert (excess <= 0).all(), (f"{(excess > 0).sum()} outputs off, worst at "
                                 f"{np.unravel_index(np.argmax(excess), excess.shape)}")
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=LSE_TOLERANCE,
                               rtol=LSE_TOLERANCE)


def _host(x):
    """A torch tensor (any device) or array as a numpy array of the same dtype (bf16 kept)."""
    if hasattr(x, "detach"):
        import ml_dtypes
        import torch

        if x.dtype == torch.bfloat16:
            return x.detach().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return x.detach().cpu().numpy()
    return np.asarray(x)


def poison_cuda_pool(torch, nbytes: int) -> None:
    """Fill ``nbytes`` of the CUDA caching allocator with NaN and free them, so an output an
    entry point allocates itself (no ``out=`` argument) starts as NaN wherever it lands in
    that memory rather than as an earlier result."""
    torch.empty(-(-nbytes // 4), device="cuda").fill_(float("nan"))
