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


def _one_sequence(q, k, v, *, scale, sinks, **mask):
    """q `[Sq, Hq, D]`, k/v `[Sk, Hkv, D]` → o `[Sq, Hq, D]`, lse `[Hq, Sq]` (float64)."""
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    kh = np.repeat(k, group, axis=1)
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, kh) * scale
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
                        scale=None, cu_seqlens_q=None, cu_seqlens_k=None, return_lse=False):
    """Attention forward in float64; same arguments and shapes as `prefill` (module docstring)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    mask = dict(causal=causal, window=window, chunk=chunk)
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


def random_qkv(rng, *, batch, sq, sk, hq, hkv, d, dtype=np.float32, ragged_q=None, ragged_k=None):
    """Fresh random q/k/v (values exactly representable in bf16/f16 storage by rounding through
    float16) and, for ragged batches, int32 `cu_seqlens` from per-sequence length lists."""
    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float16).astype(dtype)
    if ragged_q is None:
        return draw(batch, sq, hq, d), draw(batch, sk, hkv, d), draw(batch, sk, hkv, d), None, None
    cu_q = np.concatenate([[0], np.cumsum(ragged_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(ragged_k)]).astype(np.int32)
    return (draw(int(cu_q[-1]), hq, d), draw(int(cu_k[-1]), hkv, d), draw(int(cu_k[-1]), hkv, d),
            cu_q, cu_k)
