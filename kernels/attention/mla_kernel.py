"""The Hopper (``sm_90a``) MLA decode kernel (:func:`make_mla_kernel`): one latent KV head of
``576`` columns whose first ``512`` are V, attended by ``H x Sq`` query rows with WGMMA.

A CTA serves one split of one sequence's pages and 64 *packed* query rows (row ``r`` = query
token ``r // H``, head ``r % H``: the rows of ``q[b]`` in memory order) as the ``M`` of every
``wgmma.m64nNk16``. Two warp groups (256 threads) share the rows:

| step (per 64-key page) | who | what |
| --- | --- | --- |
| load | warp 0, one elected lane | with the first page, the CTA's Q (nine 64-column TMA boxes of ``64 x 64``); each page's ``64 x 576`` tile as nine boxes into ring stage ``t % 2``, completing on ``full[s]``; page ``t + 1`` is loaded while page ``t`` is consumed |
| scores | each warp group | ``split_keys`` (default): group ``g`` scores keys ``32 g .. 32 g + 31`` of the page (``m64n32k16`` x 36, Q and K from 128-byte swizzled shared memory); otherwise both groups compute the whole ``S`` (``m64n64k16`` x 36) |
| softmax | each warp group | base-2 streaming update (each row is a thread quad's); keys past a row's causal limit are ``-inf``; in a page that ends past the sequence, the V rows past it are zeroed in shared memory once both groups are done with K. ``split_keys``: the groups' row maxima meet in shared memory (named barrier), each group keeps the row sums of its keys (added at the end), and its P, as A fragments in register order, meets the other's (named barrier) |
| P V | warp group ``g`` | ``O_g += P V[:, 256 g : 256 g + 256]`` (``m64n256k16`` x 4, P from registers, V MN-major: the first 512 columns of the same tile, read once from HBM) |
| release | every thread | arrive on ``empty[s]`` |
| store | each warp group | its 256 columns of ``O / l`` into ``O_partial``; group 0 the LSE (and, on split 0, the split count) |
| merge (``fused_slots``) | the last split CTA of a row block | takes a ticket, and if it is the last to arrive merges every split's partial from L2 into ``o`` / ``lse`` (decode's :func:`~kiln.kernels.attention.decode_fused.combine_if_last`) |

``seesaw=True`` replaces the page loop by the pair schedule of
:mod:`~kiln.kernels.attention.mla_seesaw`.

Shared memory: Q (73,728 bytes) and two stages of one page (73,728 bytes each), every box a
``64 x 64`` bf16 tile of 128-byte rows (TMA 128-byte swizzle), 216 KB, and with
``split_keys`` 8.5 KB of exchange (row maxima and sums, P fragments).
Causal rule among the new tokens (bottom-right): query ``i`` of ``Sq`` sees keys
``0 .. seq_len - Sq + i``. Keys past ``seq_len`` never reach the sums, even when the page
holds NaN there. The partials follow :func:`~kiln.kernels.attention.mla_decode.mla_partials`.
"""

from __future__ import annotations

import functools
import math
import operator

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared

from .decode_config import ARRIVED
from .decode_fused import combine_if_last
from .decode_rows import advance_row_max, split_count
from .mla_balanced import balanced_pages, balanced_prefetch, check_balanced
from .mla_lead import PRODUCER_WARP, LeadRows, consume_tile_lead, lead_pages_pipelined, lead_sum
from .mla_page import (BLOCK_N, BOX_BYTES, BOX_UNITS, CHUNK, CHUNKS, GROUP_COLS, HEAD_DIM,
                       HEAD_DIM_V, NUM_WARPS, ROWS, STAGES, THREADS, TILE_BYTES,
                       WARP_GROUPS, load_tile, page_scores, page_softmax, zero_v)
from .mla_seesaw import SeesawRows, seesaw_pages, seesaw_sum
from .mla_transposed import (TransposedRows, consume_tile_transposed, stage_operands,
                             store_transposed, transposed_init, transposed_totals)
from .mla_transposed_ring import PAGE_SLOTS, RingBuffers, ring_pages
from .paged import PagedRowIndices, PageTableRow

ZERO_BARRIER = 1  # named barrier: both groups done with K before V rows are zeroed, and after
MAX_BARRIER, P_BARRIER = 2, 3  # split_keys: row maxima exchanged; P fragments exchanged
# The schedule without the lead group (mla_lead, the default): each group scores half of a
# page's keys (True), or both score all of them (False, twice the QK work, no exchange).
SPLIT_KEYS = True
# Programmatic dependent launch: each CTA lets the next kernel on the stream launch once it
# started (True), or the next kernel starts when this one ends (False). H200, session 36:
# 2-3% faster with the lead group at batch 32 H 16 and batch 64 H 128 Sq 2; off until
# measured at the other shapes.
EARLY_LAUNCH = False
# Pages two at a time, one scored by each warp group (mla_seesaw), or one at a time.
SEESAW = False
# Pages of the split the producer prefetches into L2 beyond the two the ring holds (0: none;
# H200, session 37: one page measured slower, 50.1 vs 47.7 us at batch 32 H 16).
PREFETCH = 0


@functools.lru_cache(maxsize=None)
def make_mla_kernel(page_size: int = 64, split_keys: bool = SPLIT_KEYS, direct: bool = False,
                    fused_slots: int = 0, merge_rows: int = ROWS, seesaw: bool = SEESAW,
                    early_launch: bool = EARLY_LAUNCH, lead_group: int = 0,
                    transposed: int = 0, prefetch: int = PREFETCH, ring: bool = False,
                    pipelined: bool = False, merge_slices: int = 1, early_pages: int = 0,
                    balanced: int | None = None):
    """The ``@kiln.kernel`` of MLA decode for caches of ``page_size``-row pages (a multiple of
    64); ``split_keys``: the scores schedule (module docs); ``direct``: one split, whose rows
    go straight to ``o_out`` (bf16) and ``lse_out`` instead of the partials;
    ``fused_slots > 0``: the grid has that many splits, and the last CTA of each (batch, row
    block) to store its partials merges them all into ``o_out`` / ``lse_out`` (the fused
    combine of :func:`~kiln.kernels.attention.decode_fused.combine_if_last`, ``256 /
    merge_rows`` threads a row, ``merge_rows`` a power of two covering the block's real rows).
    Run-time parameters: ``q_map`` (``[B * Sq * H, 576]``), ``kv_map``
    (``[num_pages * page_size, 576]``), ``page_table``, ``seq_lens``, the partials ``o_part``
    ``[splits, B, Sq, H, 512]``, ``lse_part``, ``counts``, ``o_out`` ``[B, Sq, H, 512]``,
    ``lse_out`` (placeholders where not written), ``tickets`` (``[B, row blocks, 2]`` i64,
    zeroed once; each fused launch adds the split count), then ``num_splits``,
    ``heads`` (H), ``seq_q`` (Sq) and ``scale_log2``. ``seesaw``: the pair schedule of
    :mod:`~kiln.kernels.attention.mla_seesaw` (``split_keys`` does not apply).
    ``early_launch``: programmatic dependent launch: the kernel waits for the previous kernel
    on the stream after its shared-memory set-up, and then each CTA lets the next kernel's
    CTAs start on the SMs this grid frees (back-to-back calls overlap one's merge and tail
    with the next one's set-up). A TMA prefetch of the split's first pages before the
    wait made ptxas spill (272 bytes at 16 heads, fused). ``lead_group`` (0: off): group 0
    scores every key and hands P to group 1 (:mod:`~kiln.kernels.attention.mla_lead`; with
    ``split_keys=False``, not ``seesaw``); 2: with group 0's scores one page ahead.
    ``transposed`` (0: off; 16 or 32, at least the packed rows): keys as the products' M and
    the query rows as their N (:mod:`~kiln.kernels.attention.mla_transposed`; with
    ``split_keys=False`` and no other schedule). ``prefetch``: pages the producer prefetches
    into L2 beyond the ring's (page ``t + 1 + prefetch`` at step ``t``; the page loop's
    schedules, not ``seesaw`` or the pipelined lead group). ``ring`` (with ``transposed``):
    Q's shared memory trimmed to its rows and a deeper ring of 8 KB chunk slots
    (:mod:`~kiln.kernels.attention.mla_transposed_ring`; ``prefetch`` does not apply).
    ``pipelined`` (with ``transposed``): group 0's ``V^T P^T`` left in flight until its next
    scores are issued behind it. ``merge_slices > 1`` (with ``fused_slots``): the last that
    many split CTAs of a row block share its merge, a slice of the 512 columns each (GPU
    only: the interpreter runs one CTA at a time and cannot run the wait). ``early_pages``
    (with ``early_launch``): before the grid-dependency wait the producer prefetches Q and the
    split's first that many pages into L2 (page table and length read for it only: the
    loads after the wait read them again), so a CTA that starts while the previous kernel
    ends fills its idle DRAM. ``balanced`` (None: off): the transposed loop on the page-balanced
    grid of :mod:`~kiln.kernels.attention.mla_balanced`, that many overhead units a sequence.
    Example: ``make_mla_kernel(64, False).name == "mla_decode_p64"``."""
    if lead_group and (seesaw or split_keys):
        raise kiln.UnsupportedError("the lead-group schedule has group 0 score every key",
                                    fix="pass lead_group=True with split_keys=False, no seesaw")
    if transposed and (seesaw or split_keys or lead_group or transposed not in (16, 32)):
        raise kiln.UnsupportedError("the transposed schedule takes 16 or 32 rows and no other "
                                    "schedule", fix="pass transposed=16 or 32 with "
                                                    "split_keys=False, no seesaw or lead group")
    check_balanced(balanced, transposed and not (ring or pipelined or fused_slots or direct))
    if (ring or pipelined) and not transposed:
        raise kiln.UnsupportedError("the chunk ring serves the transposed schedule",
                                    fix="pass ring=True with transposed=16 or 32")
    stages = PAGE_SLOTS if ring else STAGES
    Rows = PagedRowIndices[BLOCK_N, page_size]
    if Rows.num_pages != 1:
        raise kiln.UnsupportedError(f"MLA decode reads pages of a multiple of {BLOCK_N} rows, "
                                    f"not {page_size}", fix=f"use page_size={BLOCK_N}")

    def mla_decode(q_map: kiln.TensorMap[kiln.bf16, (ROWS, CHUNK), 128],
                   kv_map: kiln.TensorMap[kiln.bf16, (BLOCK_N, CHUNK), 128],
                   page_table: kiln.Tensor[kiln.i32, 2], seq_lens: kiln.Tensor[kiln.i32, 1],
                   o_part: kiln.Tensor[kiln.f32, 5], lse_part: kiln.Tensor[kiln.f32, 4],
                   counts: kiln.Tensor[kiln.i32, 3], o_out: kiln.Tensor[kiln.bf16, 4],
                   lse_out: kiln.Tensor[kiln.f32, 3], tickets: kiln.Tensor[kiln.i64, 3],
                   num_splits: kiln.i32, heads: kiln.i32,
                   seq_q: kiln.i32, scale_log2: kiln.f32):
        # Box 0 .. 8: Q; box 9 + 9 s + c: column chunk c of ring stage s.
        if not (seesaw or ring):  # seesaw's and the ring's buffers are their own
            boxes = dynamic_shared(((1 + STAGES) * CHUNKS, BLOCK_N, CHUNK), kiln.bf16,
                                   align=1024)
        if seesaw:  # one single-slot ring a stage: a pair waits once on each
            full = [mbarrier.group(num_barriers=1) for _ in range(STAGES)]
            empty = [mbarrier.group(num_barriers=1) for _ in range(STAGES)]
        else:
            full = mbarrier.group(num_barriers=stages)
            empty = mbarrier.group(num_barriers=stages)
        # split_keys: the groups' row maxima, sums and P fragments, exchanged in shared memory.
        exchange = _Exchange() if split_keys and not seesaw else None
        rows_x = SeesawRows() if seesaw else None
        lead_rows = LeadRows() if lead_group else None
        ring_buffers = RingBuffers(transposed) if ring else None
        t_rows = TransposedRows(transposed) if transposed and not ring else None
        tid = kiln.thread_id(0)
        warp = tid // 32
        lane = tid % 32
        group = tid // 128
        # The TMA issuer (seesaw: group 1's first warp, which releases the stages last).
        producer_warp = 4 if seesaw else PRODUCER_WARP if lead_group or transposed else 0
        producer = nvidia_asm.elect_sync() & (warp == producer_warp)  # converged, no branch
        for s in kiln.static_range(stages):
            # One arrival a warp group: its WGMMA reads are done once its thread 0 waited.
            releases = WARP_GROUPS if seesaw else THREADS
            if seesaw:
                full[s].init(0, count=1, predicate=tid == 0)
                empty[s].init(0, count=releases, predicate=tid == 0)
            else:
                full.init(s, count=1, predicate=tid == 0)
                empty.init(s, count=releases, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        kiln.barrier()
        if early_launch:
            if early_pages and balanced is not None:  # its share's first, from seq_lens now
                balanced_prefetch(q_map, kv_map, page_table, seq_lens, heads, seq_q, tid,
                                  producer, early_pages, balanced)
            elif early_pages:  # prefetches change no value: they may run before the wait
                _early_prefetch(q_map, kv_map, page_table, seq_lens, num_splits, heads, seq_q,
                                page_size, producer, early_pages)
            # Everything after the wait reads or writes global memory the previous kernel
            # may write.
            nvidia_asm.grid_dependency_wait()
            if (warp == NUM_WARPS - 1) & (lane == 0):
                nvidia_asm.launch_dependents()
        kiln.tma.prefetch_descriptor(q_map, predicate=producer)
        kiln.tma.prefetch_descriptor(kv_map, predicate=producer)

        # Grid (row blocks, splits, B): the CTAs that read the same pages launch side by side
        # and share them in L2.
        row0 = kiln.block_id(0) * ROWS
        split = kiln.block_id(1)
        b = kiln.block_id(2)
        packed = heads * seq_q
        seq_len = seq_lens[b]
        tiles_total = (seq_len + BLOCK_N - 1) // BLOCK_N
        tiles_per_split = kiln.maximum((tiles_total + num_splits - 1) // num_splits, 1)
        tile_begin = split * tiles_per_split
        num_tiles = kiln.maximum(kiln.minimum(tile_begin + tiles_per_split, tiles_total)
                                 - tile_begin, 0)
        table = PageTableRow(page_table, b)

        # This thread's two rows of its warp's 16 in each m64 product, and their last keys.
        rows = [row0 + (tid % 128) // 32 * 16 + lane // 4 + 8 * half for half in range(2)]
        key_limit = [seq_len - seq_q + kiln.minimum(r, packed - 1) // heads for r in rows]
        if not (seesaw or ring):
            descs = (wgmma.smem_descriptor(boxes.tile(0), leading_bytes=16, stride_bytes=1024),
                     wgmma.smem_descriptor(boxes.tile(CHUNKS), leading_bytes=16,
                                           stride_bytes=1024),
                     wgmma.smem_descriptor(boxes.tile(CHUNKS), leading_bytes=BOX_BYTES,
                                           stride_bytes=1024)
                     + kiln.cast(group * (GROUP_COLS // CHUNK) * BOX_UNITS, kiln.i64))
        if transposed:
            o, m, l = transposed_init(transposed)
        else:
            o = wgmma.fragment_zeros(GROUP_COLS)
            m = [kiln.cast(-math.inf, kiln.f32) for _ in range(2)]
            l = [kiln.cast(0.0, kiln.f32) for _ in range(2)]
        if seesaw:
            o, m, l = seesaw_pages(o, m, l, rows_x, full, empty, table, kv_map, q_map,
                                   page_size, tile_begin, num_tiles, seq_len, seq_q, key_limit,
                                   scale_log2, tid, group, warp, producer, b * packed + row0)
        elif ring:
            o, m, l = ring_pages(o, m, l, ring_buffers, full, empty, table, kv_map, q_map,
                                 page_size, tile_begin, num_tiles, seq_len, seq_q, row0, packed,
                                 heads, scale_log2, tid, group, warp, producer_warp, producer,
                                 b * packed + row0, pipelined)
            if pipelined:
                _release_last(empty, num_tiles, PAGE_SLOTS, group)
        elif lead_group == 2:
            o, m, l = lead_pages_pipelined(
                o, m, l, descs, boxes, lead_rows, full, empty,
                lambda it: _load_pages(it, warp, producer_warp, producer, full, empty, q_map,
                                       kv_map, boxes, b * packed + row0, page_size, table,
                                       tile_begin, num_tiles, seq_len),
                TILE_BYTES // 16, tile_begin, num_tiles, seq_len, seq_q, key_limit, scale_log2,
                tid, group, warp)
        elif balanced is not None:
            balanced_pages(q_map, kv_map, page_table, seq_lens, o_part, lse_part, o_out, lse_out,
                           tickets, boxes, full, empty, t_rows, heads, seq_q, scale_log2, tid,
                           group, warp, producer_warp, producer, merge_rows, balanced)
        else:
            for it in kiln.range(0, num_tiles):
                stage = it % STAGES
                _load_pages(it, warp, producer_warp, producer, full, empty, q_map, kv_map,
                            boxes, b * packed + row0, page_size, table, tile_begin, num_tiles,
                            seq_len)
                if prefetch:
                    _prefetch_pages(it, producer, kv_map, page_size, table, tile_begin,
                                    num_tiles, prefetch)
                full.try_wait(stage, (it // STAGES) % 2)
                key0 = (tile_begin + it) * BLOCK_N
                if transposed:
                    o, m, l = consume_tile_transposed(
                        o, m, l, stage_operands(boxes, stage, tid), t_rows, key0, row0, packed,
                        heads, seq_len, seq_q, scale_log2, tid, group, it,
                        (lambda: empty.arrive((it + STAGES - 1) % STAGES, wgmma_pending=1))
                        if pipelined else None)
                elif lead_group:
                    o, m, l = consume_tile_lead(o, m, l, descs, boxes, lead_rows, stage, key0,
                                                key_limit, seq_len, seq_q, scale_log2, tid,
                                                group, it, num_tiles)
                elif split_keys:
                    o, m, l = _consume_tile_split(o, m, l, descs, boxes, exchange, stage, key0,
                                                  key_limit, seq_len, seq_q, scale_log2, tid,
                                                  group)
                else:
                    o, m, l = _consume_tile(o, m, l, descs, boxes, stage, key0, key_limit,
                                            seq_len, seq_q, scale_log2, tid)
                if not pipelined:
                    empty.arrive(stage, wgmma_pending=0)
                elif group == 1:  # group 0 released the last page behind these scores
                    empty.arrive(stage, wgmma_pending=0)
            if pipelined:
                _release_last(empty, num_tiles, STAGES, group)
        if balanced is None:  # the balanced grid stored and merged its segments itself
            arrival = None
            if fused_slots and merge_slices == 1:
                # This CTA's place among its row block's splits; read only after its own stores,
                # so the atomic's round trip overlaps them.
                arrival = kiln.cast(0, kiln.i64)
                if tid == 0:
                    arrival = tickets.atomic_add(b, kiln.block_id(0), ARRIVED, 1)
            if transposed:  # group 0 kept the columns' maxima and per-thread sums
                m, l = transposed_totals(m, l, ring_buffers.shared if ring else t_rows, tid, group)
            else:
                l = [kiln.shuffle.butterfly_reduce(x, (1, 2), operator.add) for x in l]
            if seesaw:  # each group summed its own pages
                l = seesaw_sum(rows_x, l, tid, group)
            elif split_keys:  # each group summed its own keys: the row's sum is both groups'
                l = exchange.sum_rows(l, tid, group)
            elif lead_group:  # group 0 summed every key
                l = lead_sum(lead_rows, l, tid, group)
            if transposed:
                store_transposed(o, m, l, transposed, o_out if direct else o_part,
                                 lse_out if direct else lse_part, counts, split, b, row0, heads,
                                 packed, group, tid, seq_len, seq_q, tiles_per_split, direct)
            else:
                _store_rows(o, m, l, rows, o_out if direct else o_part,
                            lse_out if direct else lse_part, counts, split, b, heads, packed, group,
                            lane, seq_len, seq_q, tiles_per_split, direct)
            if fused_slots:
                last = kiln.shared((1,), kiln.i32)
                combine_if_last(o_part, lse_part, o_out, lse_out, tickets, arrival, last, b, 0, 0,
                                row0, tid, _MergeRows(packed, heads, merge_rows), fused_slots,
                                merge_slices,
                                cta=(b, kiln.block_id(0)))

    if ring:  # Q's TMA boxes of its rows (a string annotation sees no locals)
        mla_decode.__annotations__["q_map"] = kiln.TensorMap[kiln.bf16, (transposed, CHUNK), 128]
    mla_decode.__name__ = mla_decode.__qualname__ = \
        f"mla_decode_p{page_size}{'_split' if split_keys else ''}{'_direct' if direct else ''}" \
        f"{f'_fused{fused_slots}r{merge_rows}' if fused_slots else ''}" \
        f"{'_seesaw' if seesaw else ''}{'_early' if early_launch else ''}" \
        f"{'_lead' if lead_group else ''}{'2' if lead_group == 2 else ''}" \
        f"{f'_t{transposed}' if transposed else ''}{'_ring' if ring else ''}" \
        f"{'_pipe' if pipelined else ''}{f'x{merge_slices}' if merge_slices > 1 else ''}" \
        f"{f'_ep{early_pages}' if early_pages else ''}" \
        f"{f'_pf{prefetch}' if prefetch else ''}{f'_bal{balanced}' if balanced is not None else ''}"
    # Each exp2 is then one MUFU op, not four with the denormal range fix-up around it.
    return kiln.kernel(mla_decode, flush_denormals=True)


@kiln.func
def _load_pages(it, warp, producer_warp, producer, full, empty, q_map, kv_map, boxes, q_row,
                page_size, table, tile_begin, num_tiles, seq_len):
    """The producer warp's loads at the top of iteration ``it`` of the page loop: with the
    first, Q and the first two pages; later, page ``it + 1`` into the stage page ``it - 1``
    released. Every TMA is followed by a wait on its barrier on every path: the first pages
    (and Q, on stage 0's barrier) load inside the loop."""
    if (it == 0) & (warp == producer_warp):
        full.arrive_expect_tx(0, TILE_BYTES + CHUNKS * tma.box_bytes(q_map), predicate=producer)
        for c in kiln.static_range(CHUNKS):
            tma.load(q_map, boxes.tile(c), (c * CHUNK, q_row), full, 0, predicate=producer)
        load_tile(page_size, table, tile_begin, seq_len, kv_map, boxes, full, 0, producer,
                   arm=False)
        if num_tiles > 1:
            load_tile(page_size, table, tile_begin + 1, seq_len, kv_map, boxes, full, 1,
                       producer, arm=True)
    ahead = it + STAGES - 1
    if (it > 0) & (ahead < num_tiles):
        if warp == producer_warp:  # warp-uniform: it waits, one lane issues
            empty.try_wait(ahead % STAGES, ((it - 1) // STAGES) % 2)
            load_tile(page_size, table, tile_begin + ahead, seq_len, kv_map, boxes, full,
                       ahead % STAGES, producer, arm=True)


@kiln.func
def _early_prefetch(q_map, kv_map, page_table, seq_lens, num_splits, heads, seq_q, page_size,
                    producer, pages):
    """Before the grid-dependency wait: Q's boxes of this CTA and its split's first ``pages``
    pages into L2 (the length and page ids as they are now; stale ones only waste the
    prefetch)."""
    if producer:
        b = kiln.block_id(2)
        for c in kiln.static_range(CHUNKS):
            tma.prefetch(q_map, (c * CHUNK, b * heads * seq_q + kiln.block_id(0) * ROWS))
        tiles_total = (seq_lens[b] + BLOCK_N - 1) // BLOCK_N
        per_split = kiln.maximum((tiles_total + num_splits - 1) // num_splits, 1)
        begin = kiln.block_id(1) * per_split
        count = kiln.minimum(begin + per_split, tiles_total) - begin
        for p in kiln.static_range(pages):
            if p < count:
                row = page_table[b, begin + p] * page_size
                for c in kiln.static_range(CHUNKS):
                    tma.prefetch(kv_map, (c * CHUNK, row))


@kiln.func
def _release_last(empty, num_tiles, stages, group):
    """After a pipelined loop: every product retired, and group 0's last page released."""
    wgmma.wait_group(0)
    if (group == 0) & (num_tiles > 0):
        empty.arrive((num_tiles - 1) % stages, wgmma_pending=0)


@kiln.func
def _prefetch_pages(it, producer, kv_map, page_size, table, tile_begin, num_tiles, ahead):
    """The producer's L2 prefetches at step ``it``: with the first, the split's pages
    ``STAGES .. STAGES + ahead - 1``; later, page ``it + STAGES - 1 + ahead`` (each before the
    ring's load of it, which then reads L2)."""
    if producer:
        if it == 0:
            for a in kiln.static_range(ahead):
                _prefetch_page(kv_map, page_size, table, tile_begin, STAGES + a, num_tiles)
        else:
            _prefetch_page(kv_map, page_size, table, tile_begin, it + STAGES - 1 + ahead,
                           num_tiles)


@kiln.func
def _prefetch_page(kv_map, page_size, table, tile_begin, page, num_tiles):
    """Prefetch the split's page ``page`` (nine column boxes) into L2 if the split has it."""
    if page < num_tiles:
        row = table[tile_begin + page] * page_size
        for c in kiln.static_range(CHUNKS):
            tma.prefetch(kv_map, (c * CHUNK, row))


@kiln.func
def _consume_tile(o, m, l, descs, boxes, stage, key0, key_limit, seq_len, seq_q, scale_log2,
                  tid):
    """One page: ``S = Q K^T``, the streaming softmax, ``O = alpha O + P V`` of this warp
    group's columns; returns ``(o, m, l)``."""
    units = kiln.cast(stage * TILE_BYTES // 16, kiln.i64)
    scores = page_scores(descs, units)
    wgmma.wait_group(0)
    if key0 + BLOCK_N <= seq_len - seq_q + 1:  # every key visible to every row
        m, l, probs, alphas = page_softmax(scores, m, l, key0, tid, key_limit, scale_log2, False)
    else:
        if key0 + BLOCK_N > seq_len:
            _zero_rows_past_end(boxes, stage, seq_len - key0, tid)
        m, l, probs, alphas = page_softmax(scores, m, l, key0, tid, key_limit, scale_log2, True)
    o = wgmma.scale_rows(o, alphas)
    wgmma.fence()  # orders O's rescale and P's registers before the asynchronous reads
    for ks in kiln.static_range(BLOCK_N // 16):
        o = wgmma.mma_async(o, probs.fragment(0, ks), descs[2] + units + ks * 16 * 128 // 16,
                            dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    wgmma.wait_group(0)
    return o, m, l


@kiln.func
def _zero_rows_past_end(boxes, stage, valid_keys, tid):
    """Zero V's rows (its eight column boxes) of ring ``stage`` from key ``valid_keys`` on,
    once both groups' ``S`` reads of the tile are done: ``0 * NaN`` in ``P V`` would poison a
    row. A whole 128-byte row is zeroed, so the swizzle does not matter."""
    nvidia_asm.named_barrier(ZERO_BARRIER, THREADS)
    zero_v(boxes, lambda c: CHUNKS * (1 + stage) + c, valid_keys, tid, THREADS)
    nvidia_asm.fence_proxy_async()
    nvidia_asm.named_barrier(ZERO_BARRIER, THREADS)


@kiln.func
def _store_rows(o, m, l, rows, o_part, lse_part, counts, split, b, heads, packed, group, lane,
                seq_len, seq_q, tiles_per_split, direct):
    """This thread's two rows of its group's 256 columns of ``O / l`` into ``O_partial`` (a
    quad's stores fill 32-byte sectors); group 0's quad leaders write the natural-log LSE and,
    on split 0, the split count. ``direct``: ``o_part`` and ``lse_part`` are the outputs
    (bf16 O, no split axis, no counts)."""
    for half in kiln.static_range(2):
        total = l[half]
        row = rows[half]
        if row < packed:
            token = row // heads
            head = row % heads
            inv = kiln.where(total > 0.0, 1.0 / kiln.maximum(total, 1e-30), 0.0)
            where = (b, token, head) if direct else (split, b, token, head)
            for n in kiln.static_range(GROUP_COLS // 8):
                pair = kiln.pack([o.element(4 * n + 2 * half), o.element(4 * n + 2 * half + 1)])
                o_part.store(*where, group * GROUP_COLS + 8 * n + 2 * (lane % 4),
                             kiln.cast(pair * inv, o_part.dtype), align=4 if direct else 8)
            if (lane % 4 == 0) & (group == 0):
                lse_part[where] = kiln.where(
                    total > 0.0, (m[half] + kiln.log2(kiln.maximum(total, 1e-30)))
                    * math.log(2.0), -math.inf)
                if not direct:
                    if split == 0:
                        counts[b, token, head] = split_count(None, b, token, 0,
                                                             seq_len - seq_q + token + 1,
                                                             tiles_per_split, BLOCK_N, False)


class _MergeRows:
    """The row block's sizes :func:`combine_if_last` reads: packed row ``r`` is token
    ``r // heads``, head ``r % heads`` (one KV head), ``merge_rows`` rows of 512 columns."""

    head_dim = HEAD_DIM_V

    def __init__(self, packed, heads, merge_rows):
        self.packed, self.group, self.combine_rows = packed, heads, merge_rows
        self.combine_threads_per_row = THREADS // merge_rows


class _Exchange:
    """Shared memory through which the two groups of ``split_keys`` meet: per packed row of
    the CTA each group's row max (and, at the end, its row sum), and each group's P as its
    threads' A fragments (fragment ``j`` of thread ``t`` of either group covers the same rows:
    group ``g`` writes keys ``32 g + 16 j ..``, and every thread reads back all four)."""

    def __init__(self):
        self.rows = kiln.shared((WARP_GROUPS, ROWS), kiln.f32)
        self.probs = kiln.shared((WARP_GROUPS * 2, 128, 8), kiln.bf16)

    def row_max(self, local_max, tid, group):
        """The tile's row maxima over both groups' keys, from this group's ``local_max``."""
        return self._both(local_max, tid, group, MAX_BARRIER, kiln.maximum)

    def sum_rows(self, sums, tid, group):
        """The rows' sums over both groups' keys (after the loop)."""
        return self._both(sums, tid, group, MAX_BARRIER, operator.add)

    def _both(self, mine, tid, group, barrier, combine):
        # Every lane of a quad writes its row's (equal) value: no lane-divergent branch
        # beside the barrier.
        local = [(tid % 128) // 32 * 16 + (tid % 32) // 4 + 8 * half for half in range(2)]
        for half in kiln.static_range(2):
            self.rows[group, local[half]] = mine[half]
        nvidia_asm.named_barrier(barrier, THREADS)
        both = [combine(mine[half], self.rows[1 - group, local[half]]) for half in range(2)]
        # The other group may write again only after this group's next barrier: none of the
        # reads above can see the next tile's values.
        return both

    def full_probs(self, probs, tid, group):
        """All four 16-key A fragments of the page from this group's two (a 1 x 2 RegTile);
        the exchange barrier also orders the V rows zeroed before it."""
        for j in kiln.static_range(2):
            self.probs.store(2 * group + j, tid % 128, 0, probs.fragment(0, j), align=16)
        nvidia_asm.fence_proxy_async()  # V rows zeroed by generic stores, read by the WGMMA
        nvidia_asm.named_barrier(P_BARRIER, THREADS)
        return [self.probs.load(j, tid % 128, 0, width=8, align=16)
                for j in range(2 * WARP_GROUPS)]


@kiln.func
def _consume_tile_split(o, m, l, descs, boxes, exchange, stage, key0, key_limit, seq_len,
                        seq_q, scale_log2, tid, group):
    """One page with ``split_keys``: group ``g`` scores keys ``32 g .. 32 g + 31`` (Q from
    shared memory, 36 ``m64n32k16``), the row maxima meet in shared memory, each group takes
    P of its keys and keeps its own row sums, the P fragments meet, and each group adds
    ``P V`` of all 64 keys to its 256 columns of O; returns ``(o, m, l)``."""
    units = kiln.cast(stage * TILE_BYTES // 16, kiln.i64)
    half_keys = kiln.cast(group * (BLOCK_N // 2) * 128 // 16, kiln.i64)  # 32 rows of 128 B
    scores = wgmma.fragment_zeros(BLOCK_N // 2)
    wgmma.fence()
    for ks in kiln.static_range(HEAD_DIM // 16):
        offset = (ks // 4) * BOX_UNITS + (ks % 4) * 2
        scores = wgmma.mma_async(scores, descs[0] + offset,
                                 descs[1] + units + half_keys + offset, dtype=kiln.bf16)
    wgmma.commit()
    wgmma.wait_group(0)
    col = key0 + group * (BLOCK_N // 2) + 2 * (tid % 4)
    masked = key0 + BLOCK_N > seq_len - seq_q + 1
    x = []
    for i in kiln.static_range(BLOCK_N // 4):
        xi = scores.element(i) * scale_log2
        x.append(kiln.where(masked & (col + 8 * (i // 4) + i % 2 > key_limit[(i // 2) % 2]),
                            -math.inf, xi))
    local_max = []
    for half in kiln.static_range(2):
        mine = [x[i] for i in range(BLOCK_N // 4) if (i // 2) % 2 == half]
        row_max = mine[0]
        for xi in mine[1:]:
            row_max = kiln.maximum(row_max, xi)
        local_max.append(kiln.shuffle.butterfly_reduce(row_max, (1, 2), kiln.maximum))
    tile_max = exchange.row_max(local_max, tid, group)  # both groups are done with K here
    if key0 + BLOCK_N > seq_len:
        zero_v(boxes, lambda c: CHUNKS * (1 + stage) + c, seq_len - key0, tid, THREADS)
    alphas, safes, new_m, new_l = [], [], [], []
    for half in kiln.static_range(2):
        m_next, m_safe, alpha = advance_row_max(m[half], tile_max[half])
        alphas.append(alpha)
        safes.append(m_safe)
        new_m.append(m_next)
    probs = [kiln.exp2(x[i] - safes[(i // 2) % 2]) for i in range(BLOCK_N // 4)]
    for half in kiln.static_range(2):
        total = l[half] * alphas[half]
        for i in kiln.static_range(BLOCK_N // 4):
            if (i // 2) % 2 == half:
                total = total + probs[i]
        new_l.append(total)
    p = exchange.full_probs(wgmma.a_fragment_from_accumulator(
        wgmma.fragment_from_elements(probs), kiln.bf16), tid, group)
    o = wgmma.scale_rows(o, alphas)
    wgmma.fence()
    for ks in kiln.static_range(BLOCK_N // 16):
        o = wgmma.mma_async(o, p[ks], descs[2] + units + ks * 16 * 128 // 16, dtype=kiln.bf16,
                            b_major="mn")
    wgmma.commit()
    wgmma.wait_group(0)
    return o, new_m, new_l
