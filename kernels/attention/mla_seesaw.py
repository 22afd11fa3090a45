"""The ``seesaw`` schedule of the MLA decode kernel (:mod:`.mla_kernel`): pages two at a time,
one scored by each warp group, so that every ``Q K^T`` reads Q once per page (``m64n64k16``)
and one group's softmax runs while the other's products hold the tensor cores.

Pair ``i`` holds pages ``2 i`` (ring stage 0) and ``2 i + 1`` (stage 1); group 0 owns O's
columns 0..255 and scores page A, the one in stage ``i % 2``, group 1 owns 256..511 and scores
page B, the other (the stages alternate so that no K descriptor is loop-invariant: LLVM
would hoist all 36 k-steps' descriptors of both operands out of the loop, and spill):

| step | group 0 | group 1 |
| --- | --- | --- |
| 1 | ``S_A = Q K_A^T``; hand group 1 its turn | wait for the turn; ``S_B = Q K_B^T`` |
| 2 | softmax of ``S_A`` from the running max ``m``: ``m_A``, ``alpha_A``, ``P_A``; publish them (rows in shared memory, ``P_A`` in stage 0's rotary box, dead after the scores) | |
| 3 | ``O_L = alpha_A O_L + P_A V_A`` | on A's publication: softmax of ``S_B`` from ``m_A`` (while group 0's product runs): ``m_B``, ``alpha_B``, ``P_B``; publish; ``O_R = alpha_A O_R + P_A V_A`` |
| 4 | on B's publication: ``O_L = alpha_B O_L + P_B V_B``; release both stages | ``O_R = alpha_B O_R + P_B V_B``; release both stages |

Both groups read P back from the rotary boxes (group 0 its own ``P_A``, group 1 its own
``P_B``), so the code around the WGMMAs is the same in both and only the waits differ.

Warp 4 (group 1's, the last to release a pair's stages) loads the next pair's pages at the
top of its iteration (each stage a single-slot ring).

Each group keeps the row sums of its own pages' P, rescaled by both factors; they are added
at the end. A pair whose B would lie past the split's last page reads that last page again
with every key masked and its V rows zeroed (every pair then has the same shape). Named
barriers: ``QK_TURN`` (group 0 arrives, group 1 waits), ``A_READY``, ``B_READY``, and
``SUM_BARRIER`` once at the end; each of the first three takes one arrival and one wait a
pair, so they balance.
"""

from __future__ import annotations


import kiln
from kiln import nvidia_asm, wgmma

from kiln import tma
from kiln.shared import dynamic_shared

from .mla_page import (BLOCK_N, BOX_BYTES, BOX_UNITS, CHUNK, CHUNKS, GROUP_COLS, ROWS,
                       STAGES, THREADS, TILE_BYTES, load_tile, page_scores,
                       page_softmax, zero_v)

QK_TURN, A_READY, B_READY, SUM_BARRIER = 1, 2, 3, 4
GROUP_THREADS = 128
P_BOX = CHUNKS - 1  # a stage's rotary box: read by its scores only, then P's home


class SeesawRows:
    """The schedule's shared memory: Q's nine boxes and each stage's nine, the rows' running
    max and factor of each page of a pair, published by its scoring group (slot 0: A, slot 1:
    B), and the row sums met at the end."""

    def __init__(self):
        # Box c: Q's column chunk c; box CHUNKS (1 + s) + c: stage s's.
        self.boxes = dynamic_shared(((1 + STAGES) * CHUNKS, BLOCK_N, CHUNK), kiln.bf16,
                                    align=1024)
        self.max = kiln.shared((2, ROWS), kiln.f32)
        self.alpha = kiln.shared((2, ROWS), kiln.f32)
        self.sums = kiln.shared((2, ROWS), kiln.f32)

    def descriptors(self, group):
        """Q's descriptor, stage 0's K one and this group's V columns' of stage 0 (a stage
        further: ``+ stage_units(s)``)."""
        q = wgmma.smem_descriptor(self.boxes.tile(0), leading_bytes=16, stride_bytes=1024)
        k = wgmma.smem_descriptor(self.boxes.tile(CHUNKS), leading_bytes=16, stride_bytes=1024)
        v = wgmma.smem_descriptor(self.boxes.tile(CHUNKS), leading_bytes=BOX_BYTES,
                                  stride_bytes=1024) \
            + kiln.cast(group * (GROUP_COLS // CHUNK) * BOX_UNITS, kiln.i64)
        return q, k, v


def stage_units(stage):
    """A stage's offset in 16-byte descriptor units."""
    return kiln.cast(stage * TILE_BYTES // 16, kiln.i64)


def stage_box(stage, c):
    """The box index of stage ``stage``'s column chunk ``c``."""
    return CHUNKS * (1 + stage) + c


def _local_rows(tid):
    return [(tid % GROUP_THREADS) // 32 * 16 + (tid % 32) // 4 + 8 * half for half in range(2)]


@kiln.func
def _publish(rows, slot, m, alphas, probs, stage, tid):
    """Rows' ``m`` and ``alphas`` into ``slot`` (this group's index), this group's P (four
    16-key A fragments a thread) into the rotary box of ``stage`` (its page's), and a proxy
    fence (the box is TMA-loaded again later; zeroed V rows before it are read by WGMMA)."""
    local = _local_rows(tid)
    for half in kiln.static_range(2):
        rows.max[slot, local[half]] = m[half]
        rows.alpha[slot, local[half]] = alphas[half]
    for j in kiln.static_range(BLOCK_N // 16):
        unit = j * GROUP_THREADS + tid % GROUP_THREADS
        rows.boxes.store(stage_box(stage, P_BOX), unit // 8, unit % 8 * 8,
                         probs.fragment(0, j), align=16)
    nvidia_asm.fence_proxy_async()


@kiln.func
def _receive_rows(rows, slot, tid):
    """The other group's published ``(m, alphas)`` of ``slot``."""
    local = _local_rows(tid)
    return ([rows.max[slot, local[half]] for half in range(2)],
            [rows.alpha[slot, local[half]] for half in range(2)])


@kiln.func
def _receive_probs(rows, stage, tid):
    """The P published in ``stage``'s rotary box (four 16-key A fragments a thread)."""
    probs = []
    for j in range(BLOCK_N // 16):
        unit = j * GROUP_THREADS + tid % GROUP_THREADS
        probs.append(rows.boxes.load(stage_box(stage, P_BOX), unit // 8, unit % 8 * 8,
                                     width=8, align=16))
    return probs


@kiln.func
def _pv(o, probs, v_desc):
    """``O += P V`` of this group's 256 columns of the page at ``v_desc`` (``probs``: four
    16-key A fragments), committed, not waited."""
    wgmma.fence()
    for ks in kiln.static_range(BLOCK_N // 16):
        o = wgmma.mma_async(o, probs[ks], v_desc + ks * 16 * 128 // 16, dtype=kiln.bf16,
                            b_major="mn")
    wgmma.commit()
    return o


@kiln.func
def _page_softmax(scores, m, l, key0, tid, limits, scale_log2, unmasked):
    """:func:`_softmax` of one page, with the key mask only where some key is hidden."""
    if unmasked:
        new_m, new_l, probs, alphas = page_softmax(scores, m, l, key0, tid, limits, scale_log2,
                                               False)
    else:
        new_m, new_l, probs, alphas = page_softmax(scores, m, l, key0, tid, limits, scale_log2,
                                               True)
    return new_m, new_l, probs, alphas


@kiln.func
def seesaw_pages(o, m, l, rows, full, empty, table, kv_map, q_map, page_size, tile_begin,
                 num_tiles, seq_len, seq_q, key_limit, scale_log2, tid, group, warp, producer,
                 q_row):
    """The pair loop of the module docs over this split's ``num_tiles`` pages; returns this
    group's ``(o, m, l)`` (``l``: its own pages' sums, per lane; see :func:`seesaw_sum`).
    ``rows``: a :class:`SeesawRows`; ``full`` / ``empty``: a single-slot mbarrier ring a
    stage; ``producer``: the elected lane of warp 4 (group 1's first warp), which issues
    every TMA; ``q_row``: Q's first row in ``q_map``."""
    q_desc, k_desc, v_desc = rows.descriptors(group)
    split_end = (tile_begin + num_tiles) * BLOCK_N  # keys past the split: the pad page's
    visible_end = kiln.minimum(seq_len, split_end)
    limits = [kiln.minimum(k, split_end - 1) for k in key_limit]
    last_tile = tile_begin + num_tiles - 1
    for pair in kiln.range(0, (num_tiles + 1) // 2):
        phase = pair % 2
        if (pair == 0) & (warp == 4):
            full[0].arrive_expect_tx(0, TILE_BYTES + CHUNKS * tma.box_bytes(q_map),
                                     predicate=producer)
            for c in kiln.static_range(CHUNKS):
                tma.load(q_map, rows.boxes.tile(c), (c * CHUNK, q_row), full[0], 0,
                         predicate=producer)
            load_tile(page_size, table, tile_begin, seq_len, kv_map, rows.boxes, full[0], 0,
                      producer, False, slot=0)
            load_tile(page_size, table, kiln.minimum(tile_begin + 1, last_tile), seq_len,
                      kv_map, rows.boxes, full[1], 1, producer, True, slot=0)
        if (pair > 0) & (warp == 4):  # this pair's pages, once the last pair released them
            for stage in kiln.static_range(STAGES):
                empty[stage].try_wait(0, (pair + 1) % 2)
                load_tile(page_size, table,
                          kiln.minimum(tile_begin + 2 * pair + stage, last_tile), seq_len,
                          kv_map, rows.boxes, full[stage], stage, producer, True, slot=0)
        full[0].try_wait(0, phase)
        full[1].try_wait(0, phase)
        # Group 0 scores the page of stage pair % 2 ("A"), group 1 the other ("B"): the
        # stages alternate, so no descriptor is loop-invariant (LLVM would hoist all 72).
        a_stage = pair % 2
        own_stage = (pair + group) % 2
        key0 = (tile_begin + 2 * pair + own_stage) * BLOCK_N  # the page this group scores
        if group == 1:
            nvidia_asm.named_barrier(QK_TURN, THREADS)
        scores = page_scores((q_desc, k_desc + stage_units(own_stage)), 0)
        if group == 0:
            nvidia_asm.named_barrier_arrive(QK_TURN, THREADS)
        wgmma.wait_group(0)
        if key0 + BLOCK_N > visible_end:  # the last real page, or the pad page
            valid = kiln.maximum(visible_end - key0, 0)
            zero_v(rows.boxes, lambda c: stage_box(own_stage, c), valid, tid % GROUP_THREADS,
                   GROUP_THREADS)
        unmasked = key0 + BLOCK_N <= kiln.minimum(seq_len - seq_q + 1, split_end)
        # Group 1 scores from A's max: it waits for A's publication first.
        m_in, l_in, alphas_a = _start_rows(rows, m, l, tid, group)
        m_own, l_own, own, alphas_own = _page_softmax(scores, m_in, l_in, key0, tid, limits,
                                                      scale_log2, unmasked)
        _publish(rows, group, m_own, alphas_own, own, own_stage, tid)
        nvidia_asm.named_barrier_arrive(A_READY + group, THREADS)
        # Both groups read P_A (group 0 its own) and then P_B back from the rotary boxes: the
        # code around the WGMMAs is the same in both groups, so O's registers never merge
        # across branches.
        o = wgmma.scale_rows(o, [kiln.where(group == 0, alphas_own[half], alphas_a[half])
                                 for half in range(2)])
        o = _pv(o, _receive_probs(rows, a_stage, tid), v_desc + stage_units(a_stage))
        m = m_own
        alphas_b = alphas_own
        if group == 0:
            nvidia_asm.named_barrier(B_READY, THREADS)
            m, alphas_b = _receive_rows(rows, 1, tid)
        wgmma.wait_group(0)
        # Group 0's sums are A's: they move to B's max; group 1's already are B's.
        l = [l_own[half] * kiln.where(group == 0, alphas_b[half], 1.0) for half in range(2)]
        o = wgmma.scale_rows(o, alphas_b)
        o = _pv(o, _receive_probs(rows, 1 - a_stage, tid), v_desc + stage_units(1 - a_stage))
        wgmma.wait_group(0)
        if tid % GROUP_THREADS == 0:  # the next pair's loads wait for both stages anyway
            empty[0].arrive(0, wgmma_pending=0)
            empty[1].arrive(0, wgmma_pending=0)
    return o, m, l


@kiln.func
def _start_rows(rows, m, l, tid, group):
    """The running ``(m, l)`` this group's softmax starts from and A's factors: its own
    (group 0; the factors are its softmax's), or A's max and its sums moved to it, once
    group 0 published A (group 1)."""
    m_in = m
    l_in = l
    alphas_a = [kiln.cast(1.0, kiln.f32) for _ in range(2)]
    if group == 1:
        nvidia_asm.named_barrier(A_READY, THREADS)
        m_in, alphas_a = _receive_rows(rows, 0, tid)
        l_in = [l[half] * alphas_a[half] for half in range(2)]
    return m_in, l_in, alphas_a


@kiln.func
def seesaw_sum(rows, l, tid, group):
    """Each row's sum over both groups' pages (``l``: this group's, already summed over the
    thread quad)."""
    local = _local_rows(tid)
    for half in kiln.static_range(2):
        rows.sums[group, local[half]] = l[half]
    nvidia_asm.named_barrier(SUM_BARRIER, THREADS)
    return [l[half] + rows.sums[1 - group, local[half]] for half in range(2)]
