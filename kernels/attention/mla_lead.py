"""The ``lead_group`` schedule of the MLA decode kernel (:mod:`.mla_kernel`): warp group 0
scores every key of a page and hands P to group 1, as FlashMLA splits the work.

| step (per page) | group 0 | group 1 |
| --- | --- | --- |
| scores | ``S = Q K^T`` (``m64n64k16`` x 36, Q read once a page) | |
| softmax | the streaming update of all 64 keys; V rows past the sequence zeroed; P (four 16-key A fragments a thread) and the rows' factors published in shared memory | waits for them (named barrier ``READY``), reads them, then frees the buffer (``FREE``) |
| P V | ``O[:, :256] = alpha O + P V`` | ``O[:, 256:] = alpha O + P V`` |

Group 1's product of page ``t`` runs while group 0 scores page ``t + 1``, so the tensor cores
see ``Q K^T`` of one page beside ``P V`` of the other instead of both groups' softmax at once.
Group 1's first warp issues the TMA loads (it releases each stage last). Group 0 keeps the
running max and sums; group 1 receives the sums at the end. The page ring and its barriers
are the page loop's (:func:`~kiln.kernels.attention.mla_kernel.make_mla_kernel`).

:func:`lead_pages_pipelined` (``lead_group="pipelined"``) leaves group 0's ``P V`` of page
``t`` in flight and issues its scores of page ``t + 1`` behind it: one pipeline drain a page
instead of two, the stage released as soon as the product is done (``wait_group(1)``).
"""

from __future__ import annotations

import kiln
from kiln import nvidia_asm, wgmma

from .mla_page import (BLOCK_N, CHUNKS, ROWS, THREADS, TILE_BYTES, page_scores, page_softmax,
                       zero_v)

# The default of mla_decode's lead_group: H200, session 36, batch 2, vs split keys: batch 64
# H 128 Sq 2 559 vs 476 TFLOP/s, batch 32 H 16 47.3 vs 49.9 us, batch 128 H 16 0.94 vs 0.87
# of copy bandwidth, batch 32 H 128 480 vs 406 TFLOP/s (early launch off in both).
LEAD_GROUP = True
READY, FREE, SUM_BARRIER = 1, 2, 3  # named barriers (the page loop's are unused here)
GROUP_THREADS = 128
PRODUCER_WARP = 4  # group 1's first warp


class LeadRows:
    """Shared memory the groups meet in: P (four A fragments of 128 threads), each row's
    factor, and the row sums at the end."""

    def __init__(self):
        self.probs = kiln.shared((BLOCK_N // 16, GROUP_THREADS, 8), kiln.bf16)
        self.alpha = kiln.shared((ROWS,), kiln.f32)
        self.sums = kiln.shared((ROWS,), kiln.f32)


def _local_rows(tid):
    return [(tid % GROUP_THREADS) // 32 * 16 + (tid % 32) // 4 + 8 * half for half in range(2)]


@kiln.func
def consume_tile_lead(o, m, l, descs, boxes, rows, stage, key0, key_limit, seq_len, seq_q,
                      scale_log2, tid, group, it, num_tiles):
    """One page (ring ``stage``, split page ``it`` of ``num_tiles``) of the module docs;
    returns ``(o, m, l)`` (``m``, ``l``: group 0's running max and per-lane sums; group 1's
    are passed through). ``descs``: the page loop's Q, K and this group's V descriptors."""
    units = kiln.cast(stage * TILE_BYTES // 16, kiln.i64)
    local = _local_rows(tid)
    probs = [kiln.vector_constant([0.0] * 8, kiln.bf16) for _ in range(BLOCK_N // 16)]
    alphas = [kiln.cast(1.0, kiln.f32) for _ in range(2)]
    if group == 0:
        scores = page_scores(descs, units)
        wgmma.wait_group(0)
        m, l, alphas, probs = _publish(scores, m, l, boxes, rows, stage, key0, key_limit,
                                       seq_len, seq_q, scale_log2, tid, it, local)
    else:
        probs, alphas = _receive(rows, local, tid, it, num_tiles)
    o = _pv(o, probs, alphas, descs, units)
    wgmma.wait_group(0)
    return o, m, l


@kiln.func
def lead_sum(rows, l, tid, group):
    """Every row's sum (group 0's, already summed over the thread quad) in both groups."""
    local = _local_rows(tid)
    if group == 0:
        for half in kiln.static_range(2):
            rows.sums[local[half]] = l[half]
    nvidia_asm.named_barrier(SUM_BARRIER, THREADS)
    return [rows.sums[local[half]] for half in range(2)]


@kiln.func
def _publish(scores, m, l, boxes, rows, stage, key0, key_limit, seq_len, seq_q, scale_log2,
             tid, it, local):
    """Group 0's half of a page after its scores: the softmax (V rows past the sequence
    zeroed first), then P and the rows' factors published once group 1 freed the last page's.
    Returns ``(m, l, alphas, probs)``."""
    if key0 + BLOCK_N <= seq_len - seq_q + 1:  # every key visible to every row
        m, l, tile, alphas = page_softmax(scores, m, l, key0, tid, key_limit, scale_log2, False)
    else:
        if key0 + BLOCK_N > seq_len:
            zero_v(boxes, CHUNKS * (1 + stage), seq_len - key0, tid % GROUP_THREADS,
                   GROUP_THREADS)
            nvidia_asm.fence_proxy_async()  # zeroed by threads, read by both groups' WGMMA
        m, l, tile, alphas = page_softmax(scores, m, l, key0, tid, key_limit, scale_log2, True)
    if it > 0:  # group 1 has read the last page's P
        nvidia_asm.named_barrier(FREE, THREADS)
    probs = [tile.fragment(0, j) for j in range(BLOCK_N // 16)]
    for j in kiln.static_range(BLOCK_N // 16):
        rows.probs.store(j, tid % GROUP_THREADS, 0, probs[j], align=16)
    for half in kiln.static_range(2):
        rows.alpha[local[half]] = alphas[half]
    nvidia_asm.named_barrier_arrive(READY, THREADS)
    return m, l, alphas, probs


@kiln.func
def _receive(rows, local, tid, it, num_tiles):
    """Group 1's half: P and the rows' factors once group 0 published them; the buffer freed
    for the next page's. Returns ``(probs, alphas)``."""
    nvidia_asm.named_barrier(READY, THREADS)
    probs = [rows.probs.load(j, tid % GROUP_THREADS, 0, width=8, align=16)
             for j in range(BLOCK_N // 16)]
    alphas = [rows.alpha[local[half]] for half in range(2)]
    if it < num_tiles - 1:  # group 0 may write the next page's P
        nvidia_asm.named_barrier_arrive(FREE, THREADS)
    return probs, alphas


@kiln.func
def _pv(o, probs, alphas, descs, units):
    """``O = alpha O + P V`` over this group's half of V at ``units``, committed."""
    o = wgmma.scale_rows(o, alphas)
    wgmma.fence()
    for ks in kiln.static_range(BLOCK_N // 16):
        o = wgmma.mma_async(o, probs[ks], descs[2] + units + ks * 16 * 128 // 16,
                            dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    return o


@kiln.func
def lead_pages_pipelined(o, m, l, descs, boxes, rows, full, empty, load_pages, stage_bytes,
                         tile_begin, num_tiles, seq_len, seq_q, key_limit, scale_log2, tid,
                         group, warp):
    """The lead-group loop with group 0's ``P V`` of page ``t`` left in flight until its
    scores of page ``t + 1`` are issued behind it (the tensor pipe runs them without
    draining between); group 0 releases page ``t`` once its product is done. Returns ``(o, m, l)``.
    ``load_pages(it)``: the producer's loads at the top of iteration ``it`` (the page
    loop's); ``stage_bytes``: a stage's offset in descriptor units."""
    for it in kiln.range(0, num_tiles):
        stage = it % 2
        load_pages(it)
        full.try_wait(stage, (it // 2) % 2)
        key0 = (tile_begin + it) * BLOCK_N
        units = kiln.cast(stage * stage_bytes, kiln.i64)
        local = _local_rows(tid)
        probs = [kiln.vector_constant([0.0] * 8, kiln.bf16) for _ in range(BLOCK_N // 16)]
        alphas = [kiln.cast(1.0, kiln.f32) for _ in range(2)]
        if group == 0:
            scores = page_scores(descs, units)
            if it > 0:  # the last page's product is done: its stage can load again
                wgmma.wait_group(1)
                empty.arrive(1 - stage, wgmma_pending=1)
            wgmma.wait_group(0)
            m, l, alphas, probs = _publish(scores, m, l, boxes, rows, stage, key0, key_limit,
                                           seq_len, seq_q, scale_log2, tid, it, local)
        else:
            probs, alphas = _receive(rows, local, tid, it, num_tiles)
        o = _pv(o, probs, alphas, descs, units)
        if group == 1:
            wgmma.wait_group(0)
            empty.arrive(stage, wgmma_pending=0)
    wgmma.wait_group(0)
    if (group == 0) & (num_tiles > 0):
        empty.arrive((num_tiles - 1) % 2, wgmma_pending=0)
    return o, m, l
