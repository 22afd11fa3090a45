"""The ``transposed`` schedule of the MLA decode kernel (:mod:`.mla_kernel`) for row blocks of
at most 32 packed query rows (``H x Sq``; DeepSeek-V3 at 16 heads a GPU): the keys, and V's
columns, are the WGMMA's M, the query rows its N (16 or 32), so no product computes the 48
(or 32) rows of padding a 64-row M would.

| step (per page) | group 0 | group 1 |
| --- | --- | --- |
| scores | ``S^T = K Q^T`` (``m64nRk16`` x 36: K the A operand, Q's first ``R`` rows the B) | |
| softmax | each query row is a column: its max over the page's 64 keys meets across the four warps in shared memory (double-buffered); P^T (bf16, 128-byte swizzled ``R x 64``) and the rows' factors published (double-buffered); V rows past the sequence zeroed | |
| hand-over | ``READY`` (both groups, ``bar.sync``): the previous page's products of both groups are done, so this page's buffers were free | same |
| P V | ``O^T[0:256] = alpha O^T + V^T P^T`` (``m64nRk16`` x 16: V MN-major from the page, P^T from shared memory) | ``O^T[256:512]``, the same |

O^T lives as four ``64 x R`` accumulators a group (``2 R`` registers a thread instead of 128);
group 0 keeps the running max and per-thread partial sums, summed over the threads at the
end. The page ring, its loads and barriers are the page loop's
(:func:`~kiln.kernels.attention.mla_kernel.make_mla_kernel`); group 1's first warp loads, as
in :mod:`.mla_lead`. The stores write the same partials (or ``o`` / ``lse``) as the other
schedules, so the fused merge and ``combine`` are unchanged.
"""

from __future__ import annotations

import math
import operator

import kiln
from kiln import nvidia_asm, wgmma
from kiln.shared import dynamic_shared

from .decode_rows import split_count
from .mla_page import (BLOCK_N, BOX_BYTES, BOX_UNITS, CHUNK, CHUNKS, GROUP_COLS, HEAD_DIM,
                       THREADS, TILE_BYTES, zero_v)

# The default of mla_decode's transposed option at most TRANSPOSED_DEFAULT_ROWS packed rows
# (False, or a mode: True, "ring", "pipelined", "ring-pipelined"), and the early launch and
# pages prefetched before its wait that the transposed schedule takes by default. H200,
# session 37, batch 2 (GPU time of queued calls, H 16 Sq 1, ctx 4k), vs the lead group: batch
# 32 46.1 vs 47.3 us, 64 80.7 vs 82.5, 128 147.1 vs 150.7, batch 32 ctx 16k 149.6 vs 151.6.
# At 32 rows (Sq 2) the transposed kernel was slower (53.6 vs 50.2 us): the lead group stays.
TRANSPOSED = True
TRANSPOSED_DEFAULT_ROWS = 16
TRANSPOSED_EARLY = True
TRANSPOSED_EARLY_PAGES = 2
MAX_ROWS = 32  # packed query rows a transposed CTA serves (the products' N)
TMAX, READY, END = 1, 2, 3  # named barriers: group 0's max exchange; the hand-over; the sums
GROUP_THREADS = 128
GROUP_WARPS = 4
M_BLOCKS = GROUP_COLS // CHUNK  # 64-column blocks of O^T a group holds


def transposed_rows(packed: int) -> int:
    """The products' N for ``packed`` query rows (16 or 32), 0 above :data:`MAX_ROWS`.
    Example: ``transposed_rows(16) == 16``."""
    return 16 if packed <= 16 else 32 if packed <= MAX_ROWS else 0


class TransposedRows:
    """Shared memory of the schedule: P^T (two ``R x 64`` bf16 tiles, 128-byte swizzled), the
    warps' column maxima (two pages), the rows' factors (two pages), and the sums and maxima
    at the end."""

    def __init__(self, rows: int):
        self.rows = rows
        self.probs = dynamic_shared((2, rows, CHUNK), kiln.bf16, align=1024)
        self.maxima = kiln.shared((2, GROUP_WARPS, rows), kiln.f32)
        self.alpha = kiln.shared((2, rows), kiln.f32)
        self.sums = kiln.shared((GROUP_WARPS, rows), kiln.f32)
        self.final_max = kiln.shared((rows,), kiln.f32)


def _column(i, tid):
    """The query row (the accumulator column) of register ``i`` of a ``64 x R`` fragment."""
    return 8 * (i // 4) + 2 * (tid % 4) + i % 2


def _slot(i):
    """Register ``i``'s index among the thread's ``R / 4`` columns."""
    return 2 * (i // 4) + i % 2


def transposed_init(rows):
    """``(o, m, l)`` before the first page: the group's four zero ``64 x R`` O^T blocks, and
    the running max and partial sums of the thread's ``R / 4`` columns."""
    o = [wgmma.fragment_zeros(rows) for _ in range(M_BLOCKS)]
    m = [kiln.cast(-math.inf, kiln.f32) for _ in range(rows // 4)]
    l = [kiln.cast(0.0, kiln.f32) for _ in range(rows // 4)]
    return o, m, l


class PageOperands:
    """Where a page's operands are: the Q, K (K-major) and V (MN-major) descriptors, one Q
    chunk's size in descriptor units, and ``units[c]``, column chunk ``c``'s offset (units)
    from the K and V descriptors. ``zero_v(valid_keys)`` zeroes V's rows from ``valid_keys``
    on (group 0's threads)."""

    def __init__(self, q_desc, q_units, k_desc, v_desc, units, zero_v):
        self.q_desc, self.q_units, self.k_desc, self.v_desc = q_desc, q_units, k_desc, v_desc
        self.units, self.zero_v = units, zero_v


def stage_operands(boxes, stage, tid):
    """The page loop's :class:`PageOperands` of ring ``stage`` (Q in boxes 0-8, the stages'
    nine boxes after it, adjacent)."""
    base = kiln.cast(stage * TILE_BYTES // 16, kiln.i64)
    return PageOperands(
        wgmma.smem_descriptor(boxes.tile(0), leading_bytes=16, stride_bytes=1024), BOX_UNITS,
        wgmma.smem_descriptor(boxes.tile(CHUNKS), leading_bytes=16, stride_bytes=1024),
        wgmma.smem_descriptor(boxes.tile(CHUNKS), leading_bytes=BOX_BYTES, stride_bytes=1024),
        [base + c * BOX_UNITS for c in range(CHUNKS)],
        lambda valid: zero_v(boxes, CHUNKS * (1 + stage), valid, tid % GROUP_THREADS,
                             GROUP_THREADS))


@kiln.func
def consume_tile_transposed(o, m, l, ops, shared, key0, row0, packed, heads, seq_len, seq_q,
                            scale_log2, tid, group, it, release_previous=None):
    """One page (split page ``it``, operands ``ops``, a :class:`PageOperands`) of the module
    docs; returns ``(o, m, l)``. ``shared``: the :class:`TransposedRows`.
    ``release_previous`` (pipelined; None: every product waited here): group 0 leaves its
    ``V^T P^T`` in flight over the loop's back edge, retires it behind the next page's
    scores (``wait_group(1)``) and then calls ``release_previous()`` to free that page;
    the caller releases group 1's pages, and group 0's last one after its final wait."""
    rows = shared.rows
    buf = it % 2
    alphas = [kiln.cast(1.0, kiln.f32) for _ in range(rows // 4)]
    if group == 0:
        scores = wgmma.fragment_zeros(rows)
        wgmma.fence()
        for ks in kiln.static_range(HEAD_DIM // 16):
            step = (ks % 4) * 2  # 16 columns = 32 bytes of a box
            scores = wgmma.mma_async(scores, ops.k_desc + ops.units[ks // 4] + step,
                                     ops.q_desc + (ks // 4) * ops.q_units + step,
                                     dtype=kiln.bf16)
        wgmma.commit()
        if release_previous is not None:
            if it > 0:  # the last page's product is done: its page can load again
                wgmma.wait_group(1)
                release_previous()
        wgmma.wait_group(0)
        m, l, alphas = _softmax_publish(scores, m, l, ops, shared, key0, row0, packed, heads,
                                        seq_len, seq_q, scale_log2, tid, buf)
    else:
        nvidia_asm.named_barrier(READY, THREADS)
        alphas = [shared.alpha[buf, _column(4 * (s // 2) + s % 2, tid)]
                  for s in range(rows // 4)]
    o = _pv(o, alphas, ops, shared, buf, rows, group)
    if release_previous is None:
        wgmma.wait_group(0)
    elif group == 1:
        wgmma.wait_group(0)
    return o, m, l


@kiln.func
def _softmax_publish(scores, m, l, ops, shared, key0, row0, packed, heads, seq_len, seq_q,
                     scale_log2, tid, buf):
    """Group 0's softmax of a ``64 x R`` S^T tile: columns' maxima over the four warps, P^T
    and the factors into shared memory (``buf``), then the hand-over. Returns
    ``(m, l, alphas)``."""
    rows = shared.rows
    lane = tid % 32
    warp = (tid % GROUP_THREADS) // 32
    key = [key0 + 16 * warp + lane // 4 + 8 * half for half in range(2)]
    limit = [seq_len - seq_q + kiln.minimum(row0 + _column(4 * (s // 2) + s % 2, tid),
                                            packed - 1) // heads for s in range(rows // 4)]
    masked = key0 + BLOCK_N > seq_len - seq_q + 1
    x = []
    for i in kiln.static_range(rows // 2):
        xi = scores.element(i) * scale_log2
        x.append(kiln.where(masked & (key[(i // 2) % 2] > limit[_slot(i)]), -math.inf, xi))
    for s in kiln.static_range(rows // 4):
        mine = [x[i] for i in range(rows // 2) if _slot(i) == s]
        local = kiln.shuffle.butterfly_reduce(kiln.maximum(mine[0], mine[1]), (4, 8, 16),
                                              kiln.maximum)
        shared.maxima[buf, warp, _column(4 * (s // 2) + s % 2, tid)] = local
    if key0 + BLOCK_N > seq_len:  # 0 * NaN in V^T P^T would poison a column
        ops.zero_v(seq_len - key0)
    nvidia_asm.named_barrier(TMAX, GROUP_THREADS)
    safes, alphas, new_m = [], [], []
    for s in kiln.static_range(rows // 4):
        column = _column(4 * (s // 2) + s % 2, tid)
        top = shared.maxima[buf, 0, column]
        for w in kiln.static_range(1, GROUP_WARPS):
            top = kiln.maximum(top, shared.maxima[buf, w, column])
        m_next = kiln.maximum(m[s], top)
        m_safe = kiln.where(m_next == -math.inf, 0.0, m_next)
        safes.append(m_safe)
        alphas.append(kiln.exp2(m[s] - m_safe))
        new_m.append(m_next)
    probs = [kiln.exp2(x[i] - safes[_slot(i)]) for i in range(rows // 2)]
    new_l = []
    for s in kiln.static_range(rows // 4):
        total = l[s] * alphas[s]
        for i in kiln.static_range(rows // 2):
            if _slot(i) == s:
                total = total + probs[i]
        new_l.append(total)
    for i in kiln.static_range(rows // 2):  # P^T[column, key], 16-byte units XOR row % 8
        column = _column(i, tid)
        k = 16 * warp + lane // 4 + 8 * ((i // 2) % 2)
        shared.probs.store(buf, column, k ^ (column % 8 * 8), kiln.cast(probs[i], kiln.bf16))
    for s in kiln.static_range(rows // 4):
        shared.alpha[buf, _column(4 * (s // 2) + s % 2, tid)] = alphas[s]
    nvidia_asm.fence_proxy_async()  # P^T and zeroed V rows: thread stores the WGMMA reads
    nvidia_asm.named_barrier(READY, THREADS)
    return new_m, new_l, alphas


@kiln.func
def _pv(o, alphas, ops, shared, buf, rows, group):
    """``O^T = alpha O^T + V^T P^T`` over this group's four 64-column blocks (V's column
    chunks ``4 group ..``), committed."""
    scaled = []
    for b in kiln.static_range(M_BLOCKS):
        scaled.append(wgmma.fragment_from_elements(
            [o[b].element(i) * alphas[_slot(i)] for i in range(rows // 2)]))
    probs = wgmma.smem_descriptor(shared.probs.tile(0), leading_bytes=16, stride_bytes=1024) \
        + kiln.cast(buf * (rows * CHUNK * 2 // 16), kiln.i64)
    wgmma.fence()
    out = []
    for b in kiln.static_range(M_BLOCKS):
        acc = scaled[b]
        chunk = ops.v_desc + kiln.where(group == 0, ops.units[b], ops.units[M_BLOCKS + b])
        for ks in kiln.static_range(BLOCK_N // 16):
            acc = wgmma.mma_async(acc, chunk + ks * 16 * 128 // 16, probs + ks * 2,
                                  dtype=kiln.bf16, a_major="mn")
        out.append(acc)
    wgmma.commit()
    return out


@kiln.func
def transposed_totals(m, l, shared, tid, group):
    """Every column's running max and sum (over all keys), in both groups: ``(m, l)``."""
    rows = shared.rows
    warp = (tid % GROUP_THREADS) // 32
    if group == 0:
        for s in kiln.static_range(rows // 4):
            column = _column(4 * (s // 2) + s % 2, tid)
            shared.sums[warp, column] = kiln.shuffle.butterfly_reduce(l[s], (4, 8, 16),
                                                                      operator.add)
            shared.final_max[column] = m[s]
    nvidia_asm.named_barrier(END, THREADS)
    new_m, new_l = [], []
    for s in kiln.static_range(rows // 4):
        column = _column(4 * (s // 2) + s % 2, tid)
        total = shared.sums[0, column]
        for w in kiln.static_range(1, GROUP_WARPS):
            total = total + shared.sums[w, column]
        new_l.append(total)
        new_m.append(shared.final_max[column])
    return new_m, new_l


@kiln.func
def store_transposed(o, m, l, rows, o_part, lse_part, counts, split, b, row0, heads, packed,
                     group, tid, seq_len, seq_q, tiles_per_split, direct):
    """The thread's O^T registers divided by their columns' sums into ``O_partial`` (or
    ``o`` with ``direct``); group 0's first warp's lanes 0-3 write the columns' LSE and, on
    split 0, the split counts (none where ``counts`` is None)."""
    lane = tid % 32
    warp = (tid % GROUP_THREADS) // 32
    inv = [kiln.where(l[s] > 0.0, 1.0 / kiln.maximum(l[s], 1e-30), 0.0)
           for s in range(rows // 4)]
    for i in kiln.static_range(rows // 2):
        row = row0 + _column(i, tid)
        if row < packed:
            token = row // heads
            head = row % heads
            for blk in kiln.static_range(M_BLOCKS):
                col = group * GROUP_COLS + blk * CHUNK + 16 * warp + lane // 4 + 8 * ((i // 2) % 2)
                value = kiln.cast(o[blk].element(i) * inv[_slot(i)], o_part.dtype)
                if direct:
                    o_part[b, token, head, col] = value
                else:
                    o_part[split, b, token, head, col] = value
    if (group == 0) & (warp == 0) & (lane < 4):
        for s in kiln.static_range(rows // 4):
            row = row0 + _column(4 * (s // 2) + s % 2, tid)
            if row < packed:
                token = row // heads
                head = row % heads
                lse = kiln.where(l[s] > 0.0, (m[s] + kiln.log2(kiln.maximum(l[s], 1e-30)))
                                 * math.log(2.0), -math.inf)
                if direct:
                    lse_part[b, token, head] = lse
                else:
                    lse_part[split, b, token, head] = lse
                    if counts is not None:  # the balanced grid keeps no counts
                        if split == 0:
                            counts[b, token, head] = split_count(
                                None, b, token, 0, seq_len - seq_q + token + 1, tiles_per_split,
                                BLOCK_N, False)
