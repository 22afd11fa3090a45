"""Shared inputs and float64 reference of the MLA decode tests (interpreter and GPU).

Conventions (those of :func:`kiln.kernels.attention.mla_decode`): ``q [B, Sq, H, 576]``,
``kv_cache [num_pages, 64, 576]`` (one latent head; V = its first 512 columns), query ``i``
of ``Sq`` sees keys ``0 .. seq_len - Sq + i``; ``lse`` is the natural log of the denominator,
``-inf`` (with ``o = 0``) for a row that sees no key.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

PAGE = 64
DQK, DV = 576, 512


def mla_problem(rng, heads, sq, lens, *, spare_pages=3, poison_tail=True):
    """Random bf16 ``q``, a cache with the pages of every sequence scattered at random
    (non-contiguous, shuffled) among ``spare_pages`` unused ones, the page table and lengths.
    ``poison_tail``: the rows of each last page past its sequence, and the unused pages, hold
    NaN (the kernel must never let them reach a sum)."""
    B = len(lens)
    pages_of = [max(1, -(-L // PAGE)) for L in lens]
    width = max(pages_of) + 1  # one entry past the longest sequence: never read
    num_pages = sum(pages_of) + spare_pages
    order = rng.permutation(num_pages).astype(np.int32)
    table = np.full((B, width), -7, np.int32)  # entries past a sequence are garbage
    used = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = order[used:used + n]
        used += n
    q = rng.standard_normal((B, sq, heads, DQK)).astype(ml_dtypes.bfloat16)
    kv = rng.standard_normal((num_pages, PAGE, DQK)).astype(ml_dtypes.bfloat16)
    if poison_tail:
        kv[order[used:]] = math.nan
        for b, L in enumerate(lens):
            kv[table[b, pages_of[b] - 1], (L - 1) % PAGE + 1 if L else 0:] = math.nan
    return q, kv, table, np.asarray(lens, np.int32)


def mla_reference(q, kv, table, seq_lens, scale=None):
    """``(o [B, Sq, H, 512], lse [B, Sq, H])`` in float64."""
    q = np.asarray(q, np.float64)
    B, sq, heads, dqk = q.shape
    scale = dqk ** -0.5 if scale is None else scale
    o = np.zeros((B, sq, heads, DV))
    lse = np.full((B, sq, heads), -np.inf)
    for b in range(B):
        L = int(seq_lens[b])
        pages = [kv[table[b, p]] for p in range(-(-L // PAGE))]
        rows = np.concatenate(pages).astype(np.float64)[:L] if pages else np.zeros((0, dqk))
        for i in range(sq):
            visible = max(L - sq + i + 1, 0)
            if visible == 0:
                continue
            s = q[b, i] @ rows[:visible].T * scale
            top = s.max(axis=-1, keepdims=True)
            w = np.exp(s - top)
            den = w.sum(axis=-1, keepdims=True)
            o[b, i] = w @ rows[:visible, :DV] / den
            lse[b, i] = np.log(den[:, 0]) + top[:, 0]
    return o, lse


def assert_mla_close(o, lse, want_o, want_lse):
    """bf16 output within bf16's rounding of the float64 reference (P rounds to bf16 too);
    LSE within f32 accumulation error; -inf exactly where the reference has it."""
    o = np.asarray(o, np.float64)
    assert np.isfinite(o).all(), "non-finite output"
    np.testing.assert_allclose(o, want_o, atol=2e-2, rtol=2e-2)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-3, rtol=1e-4)
