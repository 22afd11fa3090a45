"""The transposed schedule (:mod:`.mla_transposed`) on a deeper ring: Q takes only its 16 or
32 rows of shared memory, and the bytes saved hold more of the split's pages in flight.

Every product of the transposed schedule reads one 64-column box of a page (K for the
scores, a 64-column block of V for ``V^T P^T``), so a page's nine column chunks need not be
adjacent: the ring is :func:`ring_slots` slots of one ``64 x 64`` box (8 KB), 25 beside 16
rows of Q (2 7/9 pages), 22 beside 32. Chunk ``c`` of the split's page ``t`` lives in slot
``(9 t + c) % slots``. At the top of step ``t`` the producer (group 1's first warp) waits
until page ``t - 1`` is released and refills its nine slots with the next chunks in load
order (the rest of page ``t + 1``, the first chunks of page ``t + 2``). Pages complete on
``full[t % 3]`` and are released on ``empty[t % 3]`` (three pages at most hold slots).
"""

from __future__ import annotations

import kiln
from kiln import tma, wgmma
from kiln.shared import dynamic_shared

from .mla_page import BLOCK_N, BOX_BYTES, BOX_UNITS, CHUNK, CHUNKS, TILE_BYTES, V_CHUNKS
from .mla_transposed import GROUP_THREADS, PageOperands, TransposedRows, consume_tile_transposed
from .paged import PagedRowIndices

PAGE_SLOTS = 3  # pages holding ring slots at once: the one consumed and two ahead
SHARED_LIMIT = 227 * 1024  # sm_90a's opt-in shared memory per block
# Static shared bytes beside the ring, Q and P^T (maxima, factors, sums, barriers, the merge's
# flag) and the dynamic region's alignment slack.
OTHER_BYTES = 3072


def ring_slots(rows: int) -> int:
    """The ring's 8 KB slots beside ``rows`` rows of Q and two ``rows x 64`` P^T tiles.
    Example: ``ring_slots(16) == 25``."""
    free = SHARED_LIMIT - OTHER_BYTES - (CHUNKS + 2) * rows * CHUNK * 2
    return min(free // BOX_BYTES, PAGE_SLOTS * CHUNKS - 1)


class RingBuffers:
    """The ring's slots, Q's ``rows`` rows of nine chunks, then the schedule's
    :class:`TransposedRows`."""

    def __init__(self, rows: int):
        self.slots = ring_slots(rows)
        self.rows = rows
        self.ring = dynamic_shared((self.slots, BLOCK_N, CHUNK), kiln.bf16, align=1024)
        self.q = dynamic_shared((CHUNKS, rows, CHUNK), kiln.bf16, align=1024)
        self.shared = TransposedRows(rows)


@kiln.func
def _slot(slots, page, c):
    """The ring slot of the split's page ``page``'s chunk ``c``."""
    return (page * CHUNKS + c) % slots


@kiln.func
def _page_row(page_size, table, tile_begin, page, seq_len):
    """The cache row of the split's page ``page``."""
    return PagedRowIndices[BLOCK_N, page_size].populate(table, (tile_begin + page) * BLOCK_N,
                                                        seq_len).row(0)


@kiln.func
def _load_chunks(buffers, full, row, page, first, last, kv_map, producer, arm=True):
    """TMA chunks ``first .. last - 1`` of the split's page ``page`` (cache row ``row``) into
    their slots, on ``full[page % 3]`` (armed for the whole page with its first chunk unless
    ``arm`` is False: page 0's bytes are expected with Q's)."""
    bar = page % PAGE_SLOTS
    if first == 0 and arm:
        full.arrive_expect_tx(bar, TILE_BYTES, predicate=producer)
    for c in kiln.static_range(first, last):
        tma.load(kv_map, buffers.ring.tile(_slot(buffers.slots, page, c)), (c * CHUNK, row),
                 full, bar, predicate=producer)


@kiln.func
def _zero_slots(buffers, slots_of, valid_keys, tid):
    """Zero V's rows from key ``valid_keys`` on in the page's eight V slots, with group 0's
    128 threads (``0 * NaN`` in ``V^T P^T`` would poison a query row)."""
    zeros = kiln.vector_constant([0.0] * 8, kiln.bf16)
    per_box = BLOCK_N * 8  # 16-byte units of one box
    for step in kiln.static_range(V_CHUNKS * per_box // GROUP_THREADS):
        index = step * GROUP_THREADS + tid % GROUP_THREADS
        key = index // 8 % BLOCK_N
        if key >= valid_keys:
            buffers.ring.store(slots_of[step * GROUP_THREADS // per_box], key, index % 8 * 8,
                               zeros, align=16)


@kiln.func
def ring_pages(o, m, l, buffers, full, empty, table, kv_map, q_map, page_size, tile_begin,
               num_tiles, seq_len, seq_q, row0, packed, heads, scale_log2, tid, group, warp,
               producer_warp, producer, q_row, pipelined=False):
    """The loop of the module docs over this split's ``num_tiles`` pages; returns this
    group's ``(o, m, l)`` as :func:`consume_tile_transposed` keeps them. ``full`` and
    ``empty``: three barriers each (initialised); ``producer``: the producer warp's elected
    lane; ``q_row``: Q's first row in ``q_map``; ``pipelined``: as
    :func:`consume_tile_transposed`'s ``release_previous`` (the caller releases group 0's
    last page)."""
    slots = buffers.slots
    ahead = slots // CHUNKS  # whole pages the ring holds
    extra = slots % CHUNKS  # and the first chunks of one more
    q_desc = wgmma.smem_descriptor(buffers.q.tile(0), leading_bytes=16, stride_bytes=1024)
    k_desc = wgmma.smem_descriptor(buffers.ring.tile(0), leading_bytes=16, stride_bytes=1024)
    v_desc = wgmma.smem_descriptor(buffers.ring.tile(0), leading_bytes=BOX_BYTES,
                                   stride_bytes=1024)
    q_units = buffers.rows * CHUNK * 2 // 16
    # The cache rows of the two pages step it refills, read a step early: the page table's
    # latency stays off the producer's (group 1's) path to the hand-over.
    rows_next = [kiln.cast(0, kiln.i32) for _ in range(2)]
    for it in kiln.range(0, num_tiles):
        if (it == 0) & (warp == producer_warp):  # Q, the ring's first pages and chunks
            full.arrive_expect_tx(0, CHUNKS * tma.box_bytes(q_map) + TILE_BYTES,
                                  predicate=producer)
            for c in kiln.static_range(CHUNKS):
                tma.load(q_map, buffers.q.tile(c), (c * CHUNK, q_row), full, 0,
                         predicate=producer)
            for page in kiln.static_range(ahead):
                if page < num_tiles:
                    _load_chunks(buffers, full, _page_row(page_size, table, tile_begin, page,
                                                          seq_len),
                                 page, 0, CHUNKS, kv_map, producer, arm=page > 0)
            if extra:
                if ahead < num_tiles:
                    _load_chunks(buffers, full, _page_row(page_size, table, tile_begin, ahead,
                                                          seq_len),
                                 ahead, 0, extra, kv_map, producer)
        if (it > 0) & (warp == producer_warp):  # the nine slots page it - 1 released
            # Page it - 1's barrier is page it + 2's: the wait names that use.
            empty.try_wait((it - 1 + PAGE_SLOTS) % PAGE_SLOTS,
                           ((it - 1 + PAGE_SLOTS) // PAGE_SLOTS + 1) % 2)
            if it - 1 + ahead < num_tiles:
                _load_chunks(buffers, full, rows_next[0], it - 1 + ahead, extra, CHUNKS, kv_map,
                             producer)
            if extra:
                if it + ahead < num_tiles:
                    _load_chunks(buffers, full, rows_next[1], it + ahead, 0, extra, kv_map,
                                 producer)
        rows_next = [_page_row(page_size, table, tile_begin, it + ahead + i, seq_len)
                     for i in range(2)]
        full.try_wait(it % PAGE_SLOTS, (it // PAGE_SLOTS) % 2)
        base = (it * CHUNKS) % slots
        slots_of = [kiln.where(base + c >= slots, base + c - slots, base + c)
                    for c in range(CHUNKS)]
        ops = PageOperands(q_desc, q_units, k_desc, v_desc,
                           [kiln.cast(slot * BOX_UNITS, kiln.i64) for slot in slots_of],
                           lambda valid: _zero_slots(buffers, slots_of, valid, tid))
        key0 = (tile_begin + it) * BLOCK_N
        o, m, l = consume_tile_transposed(
            o, m, l, ops, buffers.shared, key0, row0, packed, heads, seq_len, seq_q,
            scale_log2, tid, group, it,
            (lambda: empty.arrive((it + PAGE_SLOTS - 1) % PAGE_SLOTS, wgmma_pending=1))
            if pipelined else None)
        if not pipelined:
            empty.arrive(it % PAGE_SLOTS, wgmma_pending=0)
        elif group == 1:  # group 0 released the last page behind these scores
            empty.arrive(it % PAGE_SLOTS, wgmma_pending=0)
    return o, m, l
