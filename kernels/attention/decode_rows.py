"""Per-row helpers both decode consumers and the fused merge share: a row's running max
(:func:`advance_row_max`), a row's states merged into its partial (:func:`row_weights`,
:func:`store_row_lse`, :func:`split_count`), and the column chunks a row's threads take
(:func:`interleaved_columns`)."""

from __future__ import annotations

import math

import kiln

from .decode_config import LN2, LOG2E


def advance_row_max(m, lane_max):
    """One row's running max after a tile whose scores this lane saw up to ``lane_max`` (a
    row is a thread quad's): ``(m_next, m_safe, alpha)``, where ``m_safe`` is what the tile's
    scores are shifted by and ``alpha = 2^(m - m_safe)`` rescales the row's earlier sums.
    A row with no key yet keeps m = -inf; shifting by 0 instead avoids inf - inf."""
    m_next = kiln.maximum(m, kiln.shuffle.butterfly_reduce(lane_max, (1, 2), kiln.maximum))
    m_safe = kiln.where(m_next == -math.inf, 0.0, m_next)
    return m_next, m_safe, kiln.exp2(m - m_safe)


def interleaved_columns(tid, per_row: int, head_dim: int) -> list:
    """The first columns of the 4-column chunks that thread ``tid`` takes of its row, when
    ``per_row`` threads share each row: ``4 j + 4 per_row k`` for ``j = tid % per_row``. One
    instruction of a row's threads then covers ``16 per_row`` contiguous bytes of f32 (whole
    sectors), where each thread's chunks side by side would make 4-byte stores 64 bytes
    apart."""
    return [4 * (tid % per_row) + 4 * per_row * k for k in range(head_dim // (4 * per_row))]


def row_weights(ms, ls, sinks, head, split, has_sinks):
    """One row's states ``(m_w, l_w)`` (base 2, ``m = -inf`` for none) merged: the row max
    (split 0's sink included), each state's weight ``2^(m_w - max)``, the denominator and its
    inverse (0 for a row without mass)."""
    m_all = ms[0]
    for x in ms[1:]:
        m_all = kiln.maximum(m_all, x)
    if has_sinks:
        sink = kiln.where(split == 0, sinks[head] * LOG2E, -math.inf)
        m_all = kiln.maximum(m_all, sink)
    m_safe = kiln.where(m_all == -math.inf, 0.0, m_all)
    weights = [kiln.exp2(x - m_safe) for x in ms]
    total = weights[0] * ls[0]
    for w, x in zip(weights[1:], ls[1:]):
        total = kiln.fma(w, x, total)
    if has_sinks:
        total = total + kiln.exp2(sink - m_safe)
    return m_all, weights, total, kiln.where(total > 0.0, 1.0 / kiln.maximum(total, 1e-30), 0.0)


@kiln.func
def store_row_lse(m_all, total, block_table, lse_part, counts, split, b, q_index, head,
                  kv_head, seq_len, seq_q, tiles_per_split, shape, block_sparse):
    """LSE_partial of one row (natural log, ``-inf`` without mass) and, on split 0, its
    split count."""
    lse_part[split, b, q_index, head] = kiln.where(
        total > 0.0, (m_all + kiln.log2(kiln.maximum(total, 1e-30))) * LN2, -math.inf)
    if split == 0:
        counts[b, q_index, head] = split_count(
            block_table, b, q_index, kv_head, seq_len - seq_q + q_index + 1,
            tiles_per_split, shape.config.block_n, block_sparse)


@kiln.func
def split_count(block_table, b, q_index, kv_head, visible_keys, tiles_per_split, BN,
                block_sparse):
    """Partial slots holding keys for a row: its selected blocks (``-1`` padded), or the
    splits that cover its first ``visible_keys`` keys."""
    if block_sparse:
        selected = 0
        for j in kiln.range(0, block_table.shape[3]):
            selected = selected + kiln.where(block_table[b, q_index, kv_head, j] >= 0, 1, 0)
        return selected
    visible_tiles = (kiln.maximum(visible_keys, 0) + BN - 1) // BN
    return (visible_tiles + tiles_per_split - 1) // tiles_per_split

