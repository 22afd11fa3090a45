"""The ``deep_ring`` page loop of the MLA decode kernel (:mod:`.mla_kernel`): with fewer than
64 packed query rows, Q takes only ``q_rows`` (16 or 32) rows of shared memory, and the bytes
saved deepen the ring of pages in flight.

The ring is :func:`ring_boxes` slots of one ``64 x 64`` box (8 KB; a page is nine, its column
chunks): 24 slots at 16 rows (2 2/3 pages), 22 at 32, 18 at 64 (the two stages of the page
loop). Chunk ``c`` of the split's page ``t`` lives in slot ``(9 t + c) % slots``; at the top of
iteration ``t`` the producer (warp 0's elected lane) waits until page ``t - 1`` is released and
refills exactly its nine slots, with the next chunks in load order (page ``t + 1``'s last ones
and page ``t + 2``'s first ones). Pages complete on ``full[t % 3]`` and are released on
``empty[t % 3]`` (at most three pages hold slots at once).

A page's slots need not be adjacent, so each 16-column k-step of the scores addresses its
chunk's slot, and ``P V`` runs as four ``m64n64k16`` a k-step (one per 64-column box of this
group's 256 V columns) instead of one ``m64n256k16``. The scores and the softmax are the
``split_keys`` schedule's (:func:`~kiln.kernels.attention.mla_kernel.split_softmax`).

Q's products read 64 rows (one wgmma M); rows past ``q_rows`` belong to no query, and read
the next chunk's rows, or for the last chunk the P exchange buffer placed right after Q
(written by threads, never by TMA): garbage rows whose results are never stored.
"""

from __future__ import annotations

import kiln
from kiln import mbarrier, tma, wgmma
from kiln.shared import dynamic_shared

from .mla_kernel import (BLOCK_N, BOX_BYTES, BOX_UNITS, CHUNK, CHUNKS, GROUP_COLS, HEAD_DIM,
                         PROBS_SHAPE, ROWS, THREADS, TILE_BYTES, V_CHUNKS, _Exchange,
                         split_softmax)
from .paged import PagedRowIndices

# The default of mla_decode's deep_ring (not yet measured on a GPU).
DEEP_RING = False
PAGE_SLOTS = 3  # pages holding ring slots at once: the one consumed and two ahead
# Shared bytes besides Q, the ring and P (row maxima, barriers, the merge's flag) and the
# dynamic region's alignment slack.
OTHER_BYTES = 2048
SHARED_LIMIT = 227 * 1024  # sm_90a's opt-in shared memory per block
BOXES_PER_GROUP = GROUP_COLS // CHUNK


def ring_q_rows(packed: int) -> int:
    """Q's rows in shared memory for ``packed`` query rows (16, 32 or 64).
    Example: ``ring_q_rows(16) == 16``."""
    return 16 if packed <= 16 else 32 if packed <= 32 else ROWS


def ring_boxes(q_rows: int) -> int:
    """The ring's 8 KB slots beside ``q_rows`` rows of Q and the P exchange.
    Example: ``ring_boxes(16) == 24``."""
    free = SHARED_LIMIT - OTHER_BYTES - CHUNKS * q_rows * CHUNK * 2 \
        - PROBS_SHAPE[0] * PROBS_SHAPE[1] * PROBS_SHAPE[2] * 2
    return min(free // BOX_BYTES, 3 * CHUNKS - 1)


class RingBuffers:
    """The ring's slots, Q's ``q_rows`` rows of nine chunks, then the P exchange buffer; the
    barriers: ``full`` a page (``chunk_waits``: a slot), ``empty`` a page."""

    def __init__(self, q_rows: int, chunk_waits: bool = False):
        self.slots = ring_boxes(q_rows)
        self.q_rows = q_rows
        self.chunk_waits = chunk_waits
        self.full = mbarrier.group(num_barriers=self.slots if chunk_waits else PAGE_SLOTS)
        self.empty = mbarrier.group(num_barriers=PAGE_SLOTS)
        self.ring = dynamic_shared((self.slots, BLOCK_N, CHUNK), kiln.bf16, align=1024)
        self.q = dynamic_shared((CHUNKS, q_rows, CHUNK), kiln.bf16, align=1024)
        probs = dynamic_shared(PROBS_SHAPE, kiln.bf16, align=1024)
        self.exchange = _Exchange(probs)

    def init_barriers(self, predicate):
        """One arrival (the producer's arm) completes a fill; every thread releases a page."""
        for i in kiln.static_range(self.slots if self.chunk_waits else PAGE_SLOTS):
            self.full.init(i, count=1, predicate=predicate)
        for i in kiln.static_range(PAGE_SLOTS):
            self.empty.init(i, count=THREADS, predicate=predicate)


@kiln.func
def _page_slots(buffers, page):
    """The ring slot of each of the split's page ``page``'s nine chunks."""
    base = (page * CHUNKS) % buffers.slots
    slots = []
    for c in range(CHUNKS):
        slot = base + c
        slots.append(kiln.where(slot >= buffers.slots, slot - buffers.slots, slot))
    return slots


@kiln.func
def _slot(buffers, page, c):
    """The ring slot of the split's page ``page``'s chunk ``c``."""
    return (page * CHUNKS + c) % buffers.slots


@kiln.func
def _page_row(page_size, table, tile_begin, page, seq_len):
    """The cache row of the split's page ``page`` (the sequence's tile ``tile_begin + page``;
    a page past the sequence maps out of bounds)."""
    return PagedRowIndices[BLOCK_N, page_size].populate(table, (tile_begin + page) * BLOCK_N,
                                                        seq_len).row(0)


@kiln.func
def _load_chunks(buffers, row, page, first, last, kv_map, producer, arm=True):
    """TMA chunks ``first .. last - 1`` of the split's page ``page`` (at cache row ``row``)
    into their slots, on ``full[page % 3]`` (armed for the whole page with its first chunk,
    unless ``arm`` is False: page 0's bytes are expected with Q's), or with ``chunk_waits``
    each on its slot's barrier."""
    full = buffers.full
    bar = page % PAGE_SLOTS
    if first == 0 and arm and not buffers.chunk_waits:
        full.arrive_expect_tx(bar, TILE_BYTES, predicate=producer)
    for c in kiln.static_range(first, last):
        slot = _slot(buffers, page, c)
        if buffers.chunk_waits and arm:
            full.arrive_expect_tx(slot, BOX_BYTES, predicate=producer)
        tma.load(kv_map, buffers.ring.tile(slot), (c * CHUNK, row), full,
                 slot if buffers.chunk_waits else bar, predicate=producer)


@kiln.func
def _zero_ring_rows(buffers, slots, valid_keys, tid):
    """Zero V's rows from key ``valid_keys`` on in the page's eight V slots (the CTA's
    threads share the 16-byte stores; ``0 * NaN`` in ``P V`` would poison a row)."""
    zeros = kiln.vector_constant([0.0] * 8, kiln.bf16)
    per_box = BLOCK_N * 8  # 16-byte units of one box
    for step in kiln.static_range(V_CHUNKS * per_box // THREADS):
        index = step * THREADS + tid
        key = index // 8 % BLOCK_N
        if key >= valid_keys:
            buffers.ring.store(slots[step * THREADS // per_box], key, index % 8 * 8, zeros,
                               align=16)


@kiln.func
def ring_pages(o, m, l, buffers, table, kv_map, q_map, page_size, tile_begin, num_tiles,
               seq_len, seq_q, key_limit, scale_log2, tid, group, warp, producer, q_row):
    """The loop of the module docs over this split's ``num_tiles`` pages; returns this
    group's ``(o, m, l)`` (``l`` per lane, each group's own keys' sums, as ``split_keys``).
    ``buffers``: a :class:`RingBuffers` (its barriers initialised); ``producer``: warp 0's
    elected lane; ``q_row``: Q's first row in ``q_map``."""
    full, empty = buffers.full, buffers.empty
    slots = buffers.slots
    ahead = slots // CHUNKS  # whole pages the ring holds
    extra = slots % CHUNKS  # and the first chunks of one more
    q_units = buffers.q_rows * CHUNK * 2 // 16  # one Q chunk in 16-byte units
    q_desc = wgmma.smem_descriptor(buffers.q.tile(0), leading_bytes=16, stride_bytes=1024)
    k_desc = wgmma.smem_descriptor(buffers.ring.tile(0), leading_bytes=16, stride_bytes=1024)
    v_desc = wgmma.smem_descriptor(buffers.ring.tile(0), leading_bytes=BOX_BYTES,
                                   stride_bytes=1024)
    half_keys = kiln.cast(group * (BLOCK_N // 2) * 128 // 16, kiln.i64)  # 32 rows of 128 B
    # The cache rows of the two pages iteration it loads into, read one iteration early: the
    # page table's latency stays off the producer's (and so group 0's) path.
    rows_next = [kiln.cast(0, kiln.i32) for _ in range(2)]
    for it in kiln.range(0, num_tiles):
        if (it == 0) & (warp == 0):  # Q, the ring's first pages and chunks
            # Q completes with page 0 (chunk_waits: with its first chunk, since each chunk's
            # product reads the next chunks' rows of Q too, beyond q_rows).
            full.arrive_expect_tx(0, CHUNKS * tma.box_bytes(q_map)
                                  + (BOX_BYTES if buffers.chunk_waits else TILE_BYTES),
                                  predicate=producer)
            for c in kiln.static_range(CHUNKS):
                tma.load(q_map, buffers.q.tile(c), (c * CHUNK, q_row), full, 0,
                         predicate=producer)
            if buffers.chunk_waits:
                for c in kiln.static_range(1, CHUNKS):
                    full.arrive_expect_tx(c, BOX_BYTES, predicate=producer)
            for page in kiln.static_range(ahead):
                if page < num_tiles:
                    _load_chunks(buffers, _page_row(page_size, table, tile_begin, page,
                                                    seq_len),
                                 page, 0, CHUNKS, kv_map, producer, arm=page > 0)
            if extra:
                if ahead < num_tiles:
                    _load_chunks(buffers, _page_row(page_size, table, tile_begin, ahead,
                                                    seq_len),
                                 ahead, 0, extra, kv_map, producer)
        if (it > 0) & (warp == 0):  # the nine slots page it - 1 released
            # Page it - 1's barrier is page it + 2's: the wait names that use.
            empty.try_wait((it - 1 + PAGE_SLOTS) % PAGE_SLOTS,
                           ((it - 1 + PAGE_SLOTS) // PAGE_SLOTS + 1) % 2)
            if it - 1 + ahead < num_tiles:
                _load_chunks(buffers, rows_next[0], it - 1 + ahead, extra, CHUNKS, kv_map,
                             producer)
            if extra:
                if it + ahead < num_tiles:
                    _load_chunks(buffers, rows_next[1], it + ahead, 0, extra, kv_map,
                                 producer)
        rows_next = [_page_row(page_size, table, tile_begin, it + ahead + i, seq_len)
                     for i in range(2)]
        slots_of = _page_slots(buffers, it)
        use = it * CHUNKS // slots  # the ring's pass that chunk 0 is in
        if not buffers.chunk_waits:
            full.try_wait(it % PAGE_SLOTS, (it // PAGE_SLOTS) % 2)
        units = [kiln.cast(slot * BOX_UNITS, kiln.i64) for slot in slots_of]
        scores = wgmma.fragment_zeros(BLOCK_N // 2)
        wgmma.fence()
        for ks in kiln.static_range(HEAD_DIM // 16):
            if buffers.chunk_waits and ks % 4 == 0:  # this chunk's slot, use 9 it + c
                # Use 9 it + c of its slot: the pass after chunk 0's once the slots wrapped.
                full.try_wait(slots_of[ks // 4],
                              (use + kiln.where(slots_of[ks // 4] < slots_of[0], 1, 0)) % 2)
            step = (ks % 4) * 2  # 16 columns = 32 bytes of a box
            scores = wgmma.mma_async(scores, q_desc + (ks // 4) * q_units + step,
                                     k_desc + units[ks // 4] + half_keys + step,
                                     dtype=kiln.bf16)
        wgmma.commit()
        wgmma.wait_group(0)
        key0 = (tile_begin + it) * BLOCK_N
        p, m, l, alphas = split_softmax(
            scores, m, l, buffers.exchange, key0, key_limit, seq_len, seq_q, scale_log2, tid,
            group, lambda valid: _zero_ring_rows(buffers, slots_of, valid, tid))
        o = _pv(o, p, alphas, v_desc, units, group)
        empty.arrive(it % PAGE_SLOTS, wgmma_pending=0)
    return o, m, l


@kiln.func
def _pv(o, p, alphas, v_desc, units, group):
    """``O = alpha O + P V`` of this group's 256 columns, as four 64-column accumulators (the
    boxes' slots are not adjacent), waited."""
    o = wgmma.scale_rows(o, alphas)
    per = GROUP_COLS // BOXES_PER_GROUP // 2  # registers of one 64-column accumulator
    parts = [wgmma.fragment_from_elements([o.element(per * f + i) for i in range(per)])
             for f in range(BOXES_PER_GROUP)]
    boxes = [kiln.where(group == 0, units[f], units[BOXES_PER_GROUP + f])
             for f in range(BOXES_PER_GROUP)]
    wgmma.fence()
    for ks in kiln.static_range(BLOCK_N // 16):
        for f in kiln.static_range(BOXES_PER_GROUP):
            parts[f] = wgmma.mma_async(parts[f], p[ks], v_desc + boxes[f] + ks * 16 * 128 // 16,
                                       dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    wgmma.wait_group(0)
    return wgmma.fragment_from_elements([parts[f].element(i) for f in range(BOXES_PER_GROUP)
                                         for i in range(per)])
