"""The page-balanced grid of the transposed MLA decode schedule (:mod:`.mla_transposed`):
every CTA takes an equal share of all the batch's pages, whatever the sequences' lengths.

The batch's pages in sequence order form one list of ``T`` work units: each sequence counts
its pages plus ``overhead`` units for what a segment costs beyond its pages (the store, the
merge's ticket, the ring's restart; at least one unit a sequence, so that a CTA writes the
zeros of a sequence without keys), those first. CTA ``c`` of ``n = min(CTAs, T)`` takes
units ``c T / n .. (c + 1) T / n``, never none (the CTAs past ``n`` have no share; FlashMLA's tile scheduler does the same, with 5 blocks of
overhead, from metadata a kernel computes; here each CTA works out its share from
``seq_lens`` with warp scans). Its share crosses sequence boundaries: a *segment* is the part
of one sequence inside it (possibly only overhead units: no page, an empty partial). Per
segment the CTA runs the transposed page loop (Q of the segment's sequence loaded with its
first page; the page ring and its barrier phases continue across segments, counted over the
CTA's pages) and stores the segment's partial at slot ``c + b``: the slots of sequence
``b`` are consecutive, one per CTA that holds part of it, and no two (CTA, sequence) pairs
share one. During a segment's last page the producer prefetches the next segment's first
two pages into L2, and once its loop ends it loads the next segment's Q and first page, so
they arrive during the segment's store and merge.

Merge (decode's ticket scheme, :func:`~kiln.kernels.attention.decode_fused.combine_if_last`,
counted in units): as a segment's loop ends, thread 0 adds its units to sequence ``b``'s
ARRIVED counter (``tickets[b, 0, 0]``; the round trip overlaps the stores). The CTA whose
units complete the sequence's waits until the others have published (fence, then their
units added to ``tickets[b, 0, 1]``), zeroes both counters (the next launch starts after
this grid completes, whatever its lengths) and merges the segments' partials into ``o``
and ``lse``, as :func:`~kiln.kernels.attention.combine` would.
The partials (``[n + B, 1, Sq, H, 512]`` f32 and ``[n + B, 1, Sq, H]``) are this grid's
own: no ``combine`` call reads them. With early launch, :func:`balanced_prefetch` works out
the share before the grid-dependency wait and prefetches its first pages into L2.
"""

from __future__ import annotations

import math
import operator

import kiln
from kiln import nvidia_asm, tma

from .decode_config import ARRIVED, LN2, LOG2E, MAX_COMBINE_LOADS, PUBLISHED
from .decode_rows import interleaved_columns
from .mla_page import (BLOCK_N, CHUNK, CHUNKS, HEAD_DIM_V, ROWS, STAGES, THREADS, TILE_BYTES,
                       load_tile)
from .mla_transposed import (consume_tile_transposed, stage_operands, store_transposed,
                             transposed_init, transposed_totals)
from .paged import PageTableRow

# The default of mla_decode's balanced option: on with the transposed default where the
# default split leaves at least BALANCED_IDLE of the SMs idle, at BALANCED_MIN_BATCH
# sequences or more. H200, session 38, H 16 Sq 1 4k, vs the default split: batch 48 (96
# CTAs) 71.9 / 70.9 vs 73.7 / 73.8 us (batches 1, 2), batch 100 (100 CTAs) 131.1 vs 134.6;
# ragged batch 32 (lengths 1k-7k) 52.5 vs 55.4 but batch 32 / 64 / 128 4k 54.0 / 89.1 /
# 161.0 vs 46.3 / 80.4 / 147.2 (128 CTAs, no SM idle); batch 3, this rule as the default:
# batch 48 70.2 vs 73.7 us, batch 100 130.3 vs 134.2. And the overhead units a sequence
# counts with balanced=True (0, 1, 2, 4 within 3% at batch 32).
BALANCED = True
BALANCED_IDLE = 0.2
BALANCED_MIN_BATCH = 32
BALANCE_OVERHEAD = 1
LANES = (1, 2, 4, 8, 16)  # a warp's butterfly steps
LSE_LOADS = 8  # the merge's LSE loads a thread keeps in flight


def check_balanced(overhead, transposed_loop):
    """Refuse the balanced grid (``overhead`` not None) beside a schedule other than the
    transposed page loop (``transposed_loop``: transposed, no ring, pipelining or other merge).
    Example: ``check_balanced(None, False)``."""
    if overhead is not None and not transposed_loop:
        raise kiln.UnsupportedError("the balanced grid runs the transposed page loop and "
                                    "merges its own partials", fix="pass balanced=True with "
                                    "transposed=16 or 32, no ring, pipelining or fused_slots")


def _units(seq_len, overhead):
    """A sequence's work units: its pages and ``overhead``, at least one."""
    return kiln.maximum((seq_len + BLOCK_N - 1) // BLOCK_N + overhead, 1)


@kiln.func
def _warp_units(seq_lens, batch, chunk, lane, overhead):
    """Lane ``lane``'s sequence of 32-sequence chunk ``chunk``: its units, 0 past the
    batch."""
    index = chunk * 32 + lane
    return kiln.where(index < batch, _units(seq_lens[kiln.minimum(index, batch - 1)], overhead),
                      0)


@kiln.func
def _inclusive_scan(x, lane):
    """The warp's inclusive prefix sums of ``x`` (xor shuffles: at step ``d`` a lane whose
    bit ``d`` is set adds the total of the half block before its own)."""
    prefix = x
    block = x
    for d in kiln.static_range(len(LANES)):
        other = kiln.shuffle.xor_shuffle(block, LANES[d])
        prefix = kiln.where((lane & LANES[d]) != 0, prefix + other, prefix)
        block = block + other
    return prefix


@kiln.func
def balanced_share(seq_lens, batch, ctas, cta, lane, overhead):
    """CTA ``cta``'s share of the batch's work units (every warp works it out alike):
    ``(total, working, first, base, segments, begin, end)``: the batch's units ``total``, the
    CTAs with a share (``min(ctas, total)``: none empty), the share's units ``begin ..
    end - 1`` in the batch's order, its first sequence ``first`` and that sequence's first
    unit ``base``, and how many sequences it touches (0 without a share)."""
    chunks = (batch + 31) // 32
    total = kiln.cast(0, kiln.i32)
    for k in kiln.range(0, chunks):
        total = total + kiln.shuffle.butterfly_reduce(
            _warp_units(seq_lens, batch, k, lane, overhead), LANES, operator.add)
    working = kiln.minimum(ctas, total)
    begin = cta * total // working
    end = (cta + 1) * total // working
    carry = kiln.cast(0, kiln.i32)
    before = kiln.cast(0, kiln.i32)  # sequences that end at or before unit begin
    base = kiln.cast(0, kiln.i32)
    upto = kiln.cast(0, kiln.i32)  # sequences that end at or before unit end - 1
    for k in kiln.range(0, chunks):
        units = _warp_units(seq_lens, batch, k, lane, overhead)
        ends = _inclusive_scan(units, lane) + carry
        done = (ends <= begin) & (units > 0)
        before = before + kiln.shuffle.butterfly_reduce(kiln.where(done, 1, 0), LANES,
                                                        operator.add)
        base = kiln.maximum(base, kiln.shuffle.butterfly_reduce(kiln.where(done, ends, 0),
                                                                LANES, kiln.maximum))
        upto = upto + kiln.shuffle.butterfly_reduce(
            kiln.where((ends <= end - 1) & (units > 0), 1, 0), LANES, operator.add)
        carry = carry + kiln.shuffle.butterfly_reduce(units, LANES, operator.add)
    segments = kiln.where(cta < working, upto - before + 1, 0)
    return total, working, before, base, segments, begin, end


def _first_cta(unit, total, ctas):
    """The CTA whose share holds unit ``unit`` of the batch's order."""
    return ((unit + 1) * ctas + total - 1) // total - 1


@kiln.func
def _load_head(g, page, table, seq_len, q_map, kv_map, boxes, full, empty, q_row, producer):
    """A segment's Q and first page (the CTA's page ``g``), both on ``full[g % 2]``, once the
    page before it in the stage was released."""
    empty.try_wait(g % STAGES, (g // STAGES + 1) % 2)
    full.arrive_expect_tx(g % STAGES, TILE_BYTES + CHUNKS * tma.box_bytes(q_map),
                          predicate=producer)
    for c in kiln.static_range(CHUNKS):
        tma.load(q_map, boxes.tile(c), (c * CHUNK, q_row), full, g % STAGES,
                 predicate=producer)
    load_tile(BLOCK_N, table, page, seq_len, kv_map, boxes, full, g % STAGES, producer, False)


@kiln.func
def _segment_loads(it, g, count, begin, table, seq_len, q_map, kv_map, boxes, full, empty,
                   q_row, preloaded, warp, producer_warp, producer):
    """The producer warp's loads at step ``it`` of a segment of ``count`` pages from page
    ``begin`` (``g``: the CTA's page count so far): with the first, Q and the first page
    unless the last segment loaded them (``preloaded``), and the second; later, page
    ``it + 1``; each once the page before it in its stage was released."""
    if warp == producer_warp:
        if it == 0:
            if preloaded == 0:
                _load_head(g, begin, table, seq_len, q_map, kv_map, boxes, full, empty, q_row,
                           producer)
            if count > 1:
                empty.try_wait((g + 1) % STAGES, ((g + 1) // STAGES + 1) % 2)
                load_tile(BLOCK_N, table, begin + 1, seq_len, kv_map, boxes, full,
                          (g + 1) % STAGES, producer, True)
        if (it > 0) & (it + 1 < count):
            empty.try_wait((g + 1) % STAGES, ((g - 1) // STAGES) % 2)
            load_tile(BLOCK_N, table, begin + it + 1, seq_len, kv_map, boxes, full,
                      (g + 1) % STAGES, producer, True)


@kiln.func
def _prefetch_next(kv_map, page_table, seq_lens, b, batch, producer):
    """L2 prefetch of sequence ``b``'s first two pages (the CTA's next segment)."""
    if producer & (b < batch):
        pages = (seq_lens[b] + BLOCK_N - 1) // BLOCK_N
        for p in kiln.static_range(2):
            if p < pages:
                row = page_table[b, p] * BLOCK_N
                for c in kiln.static_range(CHUNKS):
                    tma.prefetch(kv_map, (c * CHUNK, row))


@kiln.func
def balanced_prefetch(q_map, kv_map, page_table, seq_lens, heads, seq_q, tid, producer, pages,
                      overhead):
    """Before the grid-dependency wait: the CTA's share from ``seq_lens`` as they are now,
    and its first segment's Q rows and first ``pages`` pages into L2 (stale lengths only
    waste the prefetch)."""
    batch = seq_lens.shape[0]
    _, _, first, base, segments, begin, end = balanced_share(
        seq_lens, batch, kiln.num_blocks(1), kiln.block_id(1), tid % 32, overhead)
    if producer & (segments > 0):
        packed = heads * seq_q
        for c in kiln.static_range(CHUNKS):
            tma.prefetch(q_map, (c * CHUNK, first * packed + kiln.block_id(0) * ROWS))
        tiles = (seq_lens[first] + BLOCK_N - 1) // BLOCK_N
        lo = kiln.maximum(begin - base - overhead, 0)
        stop = kiln.minimum(end - base - overhead, tiles)
        for p in kiln.static_range(pages):
            if lo + p < stop:
                row = page_table[first, lo + p] * BLOCK_N
                for c in kiln.static_range(CHUNKS):
                    tma.prefetch(kv_map, (c * CHUNK, row))


@kiln.func
def balanced_pages(q_map, kv_map, page_table, seq_lens, o_part, lse_part, o_out, lse_out,
                   tickets, boxes, full, empty, shared, heads, seq_q, scale_log2, tid,
                   group, warp, producer_warp, producer, merge_rows, overhead):
    """The CTA's share (module docs): each segment's pages, partial and, for the last CTA of
    a sequence, the merge. ``shared``: the schedule's
    :class:`~kiln.kernels.attention.mla_transposed.TransposedRows`."""
    rows = shared.rows
    lane = tid % 32
    batch = seq_lens.shape[0]
    ctas = kiln.num_blocks(1)
    cta = kiln.block_id(1)
    row0 = kiln.block_id(0) * ROWS
    packed = heads * seq_q
    total, working, first, base, segments, begin, end = balanced_share(seq_lens, batch, ctas,
                                                                       cta, lane, overhead)
    flag = kiln.shared((1,), kiln.i32)
    g = kiln.cast(0, kiln.i32)  # the CTA's pages so far: the ring's stage and phase
    start = begin
    preloaded = kiln.cast(0, kiln.i32)  # this segment's head loaded by the last one
    for s in kiln.range(0, segments):
        b = first + s
        seq_len = seq_lens[b]
        tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
        span = _units(seq_len, overhead)
        hi = kiln.minimum(end - base, span)  # the segment's units: start - base .. hi - 1
        lo = kiln.maximum(start - base - overhead, 0)  # and its pages: lo .. lo + count - 1
        count = kiln.maximum(kiln.minimum(hi - overhead, tiles) - lo, 0)
        table = PageTableRow(page_table, b)
        # The next segment's pages (a later segment starts at its sequence's first page),
        # read before the loop: its length's load stays off the path to the store.
        next_len = seq_lens[kiln.minimum(b + 1, batch - 1)]
        next_count = kiln.where(s + 1 < segments, kiln.maximum(kiln.minimum(
            kiln.minimum(end - base - span, _units(next_len, overhead)) - overhead,
            (next_len + BLOCK_N - 1) // BLOCK_N), 0), 0)
        o, m, l = transposed_init(rows)
        for it in kiln.range(0, count):
            _segment_loads(it, g + it, count, lo, table, seq_len, q_map, kv_map, boxes, full,
                           empty, b * packed + row0, preloaded, warp, producer_warp, producer)
            if (it == kiln.maximum(count - 2, 0)) & (s + 1 < segments):
                _prefetch_next(kv_map, page_table, seq_lens, b + 1, batch, producer)
            full.try_wait((g + it) % STAGES, ((g + it) // STAGES) % 2)
            o, m, l = consume_tile_transposed(
                o, m, l, stage_operands(boxes, (g + it) % STAGES, tid), shared,
                (lo + it) * BLOCK_N, row0, packed, heads, seq_len, seq_q, scale_log2, tid,
                group, g + it)
            empty.arrive((g + it) % STAGES, wgmma_pending=0)
        # Q is free (group 0's last scores are done) and so is a stage: the next segment's
        # head loads during this one's store and merge.
        if (warp == producer_warp) & (next_count > 0):
            _load_head(g + count, 0, PageTableRow(page_table, b + 1), next_len, q_map, kv_map,
                       boxes, full, empty, (b + 1) * packed + row0, producer)
        preloaded = kiln.where(next_count > 0, 1, 0)
        # The segment's units arrive now: the atomic's round trip overlaps the stores.
        mine = hi - (start - base)
        arrival = kiln.cast(0, kiln.i64)
        if tid == 0:
            arrival = tickets.atomic_add(b, kiln.block_id(0), ARRIVED, kiln.cast(mine, kiln.i64))
        m, l = transposed_totals(m, l, shared, tid, group)
        store_transposed(o, m, l, rows, o_part, lse_part, None, cta + b, 0, row0, heads,
                         packed, group, tid, seq_len, seq_q, 0, False)
        first_cta = _first_cta(base, total, working)
        last_cta = _first_cta(base + span - 1, total, working)
        kiln.barrier()  # every thread's partial stores before thread 0's release or merge
        if tid == 0:
            last = arrival + kiln.cast(mine, kiln.i64) == kiln.cast(span, kiln.i64)
            if last:  # the others arrived first, so run: wait for their partials
                nvidia_asm.wait_for_count(tickets, b, kiln.block_id(0), PUBLISHED,
                                          target=kiln.cast(span - mine, kiln.i64))
                for counter in kiln.static_range(2):  # zero for the next launch
                    tickets.atomic_exchange(b, kiln.block_id(0), counter,
                                            kiln.cast(0, kiln.i64))
            else:
                kiln.fence("gpu")
                tickets.atomic_add(b, kiln.block_id(0), PUBLISHED, kiln.cast(mine, kiln.i64))
            flag[0] = kiln.where(last, 1, 0)
        kiln.barrier()
        if flag[0] != 0:
            merge_segments(o_part, lse_part, o_out, lse_out, b, first_cta + b, last_cta + b,
                           row0, heads, packed, tid, merge_rows)
        kiln.barrier()  # the flag is read before the next segment's thread 0 writes it
        g = g + count
        start = base + hi
        base = base + span


@kiln.func
def merge_segments(o_part, lse_part, o_out, lse_out, b, first, last, row0, heads, packed, tid,
                   merge_rows):
    """Merge slots ``first .. last`` of the partials into sequence ``b``'s rows of ``o_out``
    and ``lse_out`` (``THREADS / merge_rows`` threads a row, 4-column chunks): the LSEs
    ``LSE_LOADS`` slots at a time (a running max and sum), then the partials ``SLOT_LOADS``
    slots at a time, every load of a round in flight together (a merge in a loop of single
    loads waited out one L2 round trip each: 8 us more a call at batch 32, H200)."""
    per_row = THREADS // merge_rows
    r = tid // per_row
    row = row0 + r
    columns = interleaved_columns(tid, per_row, HEAD_DIM_V)
    slot_loads = max(1, MAX_COMBINE_LOADS // len(columns))
    if (r < merge_rows) & (row < packed):
        token = row // heads
        head = row % heads
        m = kiln.cast(-math.inf, kiln.f32)
        total = kiln.cast(0.0, kiln.f32)
        for s0 in kiln.range(first, last + 1, LSE_LOADS):
            xs = [kiln.where(s0 + j <= last,
                             lse_part[kiln.minimum(s0 + j, last), 0, token, head], -math.inf)
                  for j in range(LSE_LOADS)]
            top = xs[0]
            for x in xs[1:]:
                top = kiln.maximum(top, x)
            m_next = kiln.maximum(m, top)
            m_safe = kiln.where(m_next == -math.inf, 0.0, m_next)  # no -inf - -inf
            total = total * kiln.exp2((m - m_safe) * LOG2E)
            for x in xs:
                total = total + kiln.exp2((x - m_safe) * LOG2E)
            m = m_next
        m_safe = kiln.where(m == -math.inf, 0.0, m)
        valid = (total > 0.0) & (total < math.inf)
        inv = kiln.where(valid, 1.0 / kiln.maximum(total, 1e-30), 0.0)
        acc = [kiln.vector_constant([0.0] * 4, kiln.f32) for _ in columns]
        for s0 in kiln.range(first, last + 1, slot_loads):
            slots = [kiln.minimum(s0 + j, last) for j in range(slot_loads)]
            weights = [kiln.where(s0 + j <= last, kiln.exp2(
                (lse_part[slots[j], 0, token, head] - m_safe) * LOG2E) * inv, 0.0)
                for j in range(slot_loads)]  # a repeated last slot weighs 0
            parts = [[o_part.load(slot, 0, token, head, c, width=4, align=16) for c in columns]
                     for slot in slots]
            for w, vectors in zip(weights, parts):
                acc = [kiln.fma(v, w, a) for a, v in zip(acc, vectors)]
        for c, a in zip(columns, acc):
            o_out.store(b, token, head, c, kiln.cast(kiln.where(valid, a, 0.0), kiln.bf16),
                        align=8)
        if tid % per_row == 0:
            lse_out[b, token, head] = kiln.where(
                valid, m_safe + kiln.log2(kiln.maximum(total, 1e-30)) * LN2, -math.inf)
