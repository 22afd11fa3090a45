"""The paged decode kernel's skeleton (:func:`make_kernel`): set-up, the producer (page
look-ups and TMA loads of the K/V ring, early-launch prefetches), the main loop, and the
epilogue, around one of two consumers, :mod:`~kiln.kernels.attention.decode_mma_sync` or
:mod:`~kiln.kernels.attention.decode_wgmma` (the schedule: :mod:`kiln.kernels.attention.decode`).

A consumer module gives ``LAG`` (iterations a tile holds its ring stage past its own),
``start`` (its loop-carried state ``(o, m, l, ...)``), ``step`` (one tile), ``drain`` (after
the loop; returns ``(o, m, l)``) and ``store`` (the split's partials of its rows).
"""

from __future__ import annotations

import functools
import math
import operator

import kiln
from kiln import mbarrier, nvidia_asm, tiles
from kiln.shared import dynamic_shared  # kiln.dynamic_shared once exported

from . import decode_mma_sync, decode_wgmma
from .decode_config import (AHEAD_PREFETCH_TILES, ARRIVED, HALF, KV_EVICTION,
                            MAX_UNROLLED_PAGES, WARP, DecodeConfig, DecodeShape)
from .decode_fused import combine_if_last
from .paged import OOB_ROW, PagedRowIndices, PageTableRow


@functools.lru_cache(maxsize=None)
def make_kernel(head_dim: int, group: int, q_rows: int, page_size: int, block_sparse: bool,
                has_sinks: bool, config: DecodeConfig = DecodeConfig(), fused_slots: int = 0,
                merge_slices: int = 1, prefetch_tiles: int = 0):
    """The ``@kiln.kernel`` for one shape class: ``q_rows`` query tokens per CTA (``Sq``, or 1
    when block-sparse) times ``group`` query heads per KV head. ``fused_slots > 0``: the
    grid has that many splits and the last CTA of each (batch, KV head, row block) to finish
    merges them all into ``o_out`` / ``lse_out``; ``merge_slices > 1``: the last that many
    CTAs share that merge, each taking a slice of the columns (see
    :func:`~kiln.kernels.attention.decode_fused.combine_if_last`; GPU only, the interpreter
    cannot run the wait). ``prefetch_tiles > 0``: early launch (see
    :func:`~kiln.kernels.attention.decode_config.early_launch_tiles`): before its
    grid-dependency wait each CTA prefetches the K and V of its split's first
    ``prefetch_tiles`` tiles into L2, and after it lets the next kernel on the stream launch;
    the producer prefetches ``AHEAD_PREFETCH_TILES`` more with the first tiles.

    Example: ``make_kernel(128, 8, 4, 64, False, False).name ==
    "paged_decode_d128_g8_q4_p64"``."""
    config.check_rows(q_rows * group, head_dim)
    if prefetch_tiles and (block_sparse or page_size < config.block_n):
        raise kiln.UnsupportedError(
            f"prefetch_tiles={prefetch_tiles} needs one page a tile (page_size >= block_n) and "
            "no block table", fix="pass prefetch_tiles=0")
    shape = DecodeShape(head_dim, group, q_rows, page_size, config)
    consumer = decode_wgmma if shape.wgmma else decode_mma_sync
    # The ring stage freed last: tile it - 1's, or with wgmma tile it - 2's (a tile's P V
    # product is issued one iteration later, so it holds its stage that long).
    lag = consumer.LAG
    D, S = head_dim, config.stages
    packed, ROWS, MT, RB = shape.packed, shape.rows, shape.m_tiles, shape.row_blocks

    def paged_decode(q: kiln.Tensor[kiln.bf16, 4],
                     k_map: kiln.TensorMap[kiln.bf16, (shape.eff, HALF), shape.swizzle_bytes],
                     v_map: kiln.TensorMap[kiln.bf16, (shape.eff, HALF), shape.swizzle_bytes,
                                           "nan"],
                     page_table: kiln.Tensor[kiln.i32, 2], seq_lens: kiln.Tensor[kiln.i32, 1],
                     block_table: kiln.Tensor[kiln.i32, 4], sinks: kiln.Tensor[kiln.f32, 1],
                     o_part: kiln.Tensor[kiln.f32, 5], lse_part: kiln.Tensor[kiln.f32, 4],
                     counts: kiln.Tensor[kiln.i32, 3], o_out: kiln.Tensor[kiln.bf16, 4],
                     lse_out: kiln.Tensor[kiln.f32, 3], tickets: kiln.Tensor[kiln.i64, 3],
                     num_splits: kiln.i32, scale_log2: kiln.f32):
        ring = dynamic_shared((shape.ring_elems,), kiln.bf16, align=1024)
        slots = ring.reinterpret((2 * S * shape.halves * shape.pages, shape.eff, HALF),
                                kiln.bf16)
        kv_s = tiles.SharedTile.view(ring, (2 * S * config.block_n, D), shape.ring_layout(),
                                     shape.ring_swizzle())
        full = mbarrier.group(num_barriers=S)
        empty = mbarrier.group(num_barriers=S)
        tid = kiln.thread_id(0)
        warp = tid // WARP
        lane = tid % WARP
        # Warp group g serves the CTA's m tiles g * m_tiles ..; its warps split every tile's
        # keys, warp w taking slice w % group_warps.
        warp_row0 = (warp // shape.group_warps) * shape.warp_rows
        key_slice = warp % shape.group_warps
        # Converged here, before any branch: warp 0's elected lane issues every TMA.
        producer = nvidia_asm.elect_sync() & (warp == 0)
        for s in kiln.static_range(S):
            full.init(s, count=1, predicate=tid == 0)
            empty.init(s, count=shape.threads, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        kiln.barrier()
        # Programmatic dependent launch: the CTA may start while the previous kernel on the
        # stream finishes. Its shared-memory set-up is done; everything after reads or writes
        # global memory, so it waits for that kernel here. With early launch, the last warp's
        # first lane first prefetches the split's first tiles into L2 (it also reads seq_lens
        # and the page table, which that kernel may still write: a stale value only wastes a
        # prefetch), and after the wait lets the next kernel's CTAs start on the SMs this
        # grid frees, so that they prefetch during this grid's merge.
        early_lane = (warp == config.num_warps - 1) & (lane == 0)
        if prefetch_tiles:
            if early_lane:
                _prefetch_split_start(k_map, v_map, page_table, seq_lens, num_splits,
                                      kiln.block_id(0), kiln.block_id(2),
                                      (kiln.block_id(1) // RB) * D, prefetch_tiles, shape)
        nvidia_asm.grid_dependency_wait()
        if prefetch_tiles:
            if early_lane:
                nvidia_asm.launch_dependents()
        # The descriptors' fetch overlaps the seq_len -> page table look-ups, not the first
        # TMA.
        kiln.tma.prefetch_descriptor(k_map, predicate=producer)
        kiln.tma.prefetch_descriptor(v_map, predicate=producer)

        split = kiln.block_id(0)
        kv_head = kiln.block_id(1) // RB
        row0 = (kiln.block_id(1) % RB) * ROWS  # first packed row of this CTA
        seq_q = q.shape[1]
        if block_sparse:
            b = kiln.block_id(2) // seq_q
            q_first = kiln.block_id(2) % seq_q
        else:
            b = kiln.block_id(2)
            q_first = 0
        seq_len = seq_lens[b]
        tiles_total, tiles_per_split, tile_begin, tile_end = _split_tiles(
            seq_len, num_splits, split, config.block_n)
        if block_sparse:
            block = block_table[b, q_first, kv_head, split]
            tile_begin = kiln.maximum(block, 0)
            tile_end = kiln.where(block >= 0, kiln.minimum(block + 1, tiles_total), 0)
        num_tiles = kiln.maximum(tile_end - tile_begin, 0)

        # The warp's Q A fragments stay in registers for the whole split, loaded straight from
        # global memory: no shared staging, and no barrier between them and the first TMA.
        q_frags = _load_q_fragments(q, b, q_first, kv_head, row0 + warp_row0, lane, shape)
        # Per lane: rows lane // 4 and lane // 4 + 8 of every m tile; the last key each sees.
        key_limit = []
        for i in range(MT):
            for half in range(2):
                r = kiln.minimum(row0 + warp_row0 + 16 * i + lane // 4 + 8 * half, packed - 1)
                key_limit.append(seq_len - seq_q + q_first + r // group)
        m = [kiln.cast(-math.inf, kiln.f32) for _ in range(2 * MT)]
        l = [kiln.cast(0.0, kiln.f32) for _ in range(2 * MT)]
        # The consumer's loop-carried state, (o, m, l, ...), and what it reads from the ring.
        state, ring_view = consumer.start(m, l, ring, kv_s, shape)

        # Page look-ups go out before anything waits on them: the prologue's S here, beside
        # Q's loads, and in the loop the next tile's before its stage is free, so their
        # latency overlaps the TMA's instead of adding to it.
        # Look-ups stop at the table's width even for a longer seq_len (unchecked with
        # validate=False): keys past it get out-of-bounds boxes, whose NaN V poisons the row.
        table_len = kiln.minimum(seq_len, page_table.shape[1] * page_size)
        first_rows = [_tile_rows(shape.rows_params, page_table, b, tile_begin + t, table_len)
                      for t in range(S)]
        ahead_rows = [_tile_rows(shape.rows_params, page_table, b,
                                 tile_begin + prefetch_tiles + t, table_len)
                      for t in range(AHEAD_PREFETCH_TILES if prefetch_tiles else 0)]
        for it in kiln.range(0, num_tiles):
            stage = it % S
            # The first tiles load inside the loop, so every TMA is followed by a wait on its
            # ring on every path: kiln-insert-waits then adds no wait before the merge (one
            # of fixed parity after the loop would hang a CTA whose stage 0 completed an even
            # number of phases, none included).
            if (it == 0) & (warp == 0):
                if shape.pages > MAX_UNROLLED_PAGES:  # one copy of the look-up loop
                    for t in kiln.range(0, kiln.minimum(num_tiles, S)):
                        _load_tile(shape.rows_params, None, page_table, b, tile_begin + t,
                                   table_len, k_map, v_map, slots, full, t, kv_head * D,
                                   producer, shape)
                else:
                    for t in kiln.static_range(S):
                        if t < num_tiles:
                            _load_tile(shape.rows_params, first_rows[t], page_table, b,
                                       tile_begin + t, table_len, k_map, v_map, slots, full, t,
                                       kv_head * D, producer, shape)
                    if producer:
                        for t, rows in enumerate(ahead_rows):
                            if prefetch_tiles + t < num_tiles:
                                _prefetch_tile(k_map, v_map, kv_head * D, rows.row(0), shape)
            ahead = it + S - 1 - lag
            if (it > lag) & (ahead < num_tiles):
                if warp == 0:  # warp-uniform: the whole producer warp waits, one lane issues
                    rows = _tile_rows(shape.rows_params, page_table, b, tile_begin + ahead,
                                      table_len)
                    empty.try_wait(ahead % S, ((it - 1 - lag) // S) % 2)
                    _load_tile(shape.rows_params, rows, page_table, b, tile_begin + ahead,
                               table_len, k_map, v_map, slots, full, ahead % S, kv_head * D,
                               producer, shape)
            full.try_wait(stage, (it // S) % 2)
            key0 = (tile_begin + it) * config.block_n
            state = consumer.step(state, ring_view, it, stage, key0, q_frags, key_limit, seq_len,
                                  seq_q, scale_log2, tid, lane, key_slice, slots, empty, shape)
        o, m, l = consumer.drain(state, ring_view, num_tiles, empty, shape)

        arrival = None
        if fused_slots and merge_slices == 1:
            # This CTA's place among its (batch, KV head, row block)'s splits to end their
            # loops; only read after the merge below, so the atomic's round trip overlaps it.
            arrival = kiln.cast(0, kiln.i64)
            if tid == 0:
                arrival = tickets.atomic_add(kiln.block_id(2), kiln.block_id(1), ARRIVED, 1)
        l = [kiln.shuffle.butterfly_reduce(x, (1, 2), operator.add) for x in l]
        consumer.store(ring, m, l, o, sinks, block_table, o_part, lse_part, counts, split, b,
                       q_first, kv_head, row0, warp_row0, key_slice, tid, lane, seq_len, seq_q,
                       tiles_per_split, shape, block_sparse, has_sinks)
        if fused_slots:
            last = kiln.shared((1,), kiln.i32)
            combine_if_last(o_part, lse_part, o_out, lse_out, tickets, arrival, last, b,
                            q_first, kv_head, row0, tid, shape, fused_slots, merge_slices)

    paged_decode.__name__ = paged_decode.__qualname__ = (
        f"paged_decode_d{D}_g{group}_q{q_rows}_p{page_size}{'_sparse' if block_sparse else ''}"
        f"{'_sinks' if has_sinks else ''}{f'_fused{fused_slots}' if fused_slots else ''}"
        f"{f'x{merge_slices}' if merge_slices > 1 else ''}"
        f"{f'_pf{prefetch_tiles}' if prefetch_tiles else ''}")
    # Each exp2 is then one MUFU op, not four with the denormal range fix-up around it.
    return kiln.kernel(paged_decode, flush_denormals=True)


def _split_tiles(seq_len, num_splits, split, block_n):
    """``(tiles_total, tiles_per_split, tile_begin, tile_end)``: a sequence of ``seq_len``
    keys in ``block_n``-key tiles, split evenly (every split at least one tile), and the
    range of split ``split``."""
    tiles_total = (seq_len + block_n - 1) // block_n
    tiles_per_split = kiln.maximum((tiles_total + num_splits - 1) // num_splits, 1)
    tile_begin = split * tiles_per_split
    return (tiles_total, tiles_per_split, tile_begin,
            kiln.minimum(tile_begin + tiles_per_split, tiles_total))


@kiln.func
def _prefetch_split_start(k_map, v_map, page_table, seq_lens, num_splits, split, b, column,
                          tiles, shape):
    """TMA prefetches into L2 of K's and V's boxes of split ``split``'s first ``tiles`` tiles
    (one page a tile). Its page look-ups go out together, bounded by the page table's width,
    so a stale ``seq_lens`` entry only aims the prefetches wrong."""
    _, _, tile_begin, tile_end = _split_tiles(seq_lens[b], num_splits, split,
                                              shape.config.block_n)
    table_rows = page_table.shape[1] * shape.page_size
    rows = [_tile_rows(shape.rows_params, page_table, b, tile_begin + t, table_rows).row(0)
            for t in range(tiles)]
    for t in kiln.static_range(tiles):
        if tile_begin + t < tile_end:
            _prefetch_tile(k_map, v_map, column, rows[t], shape)


def _prefetch_tile(k_map, v_map, column, row, shape):
    """TMA prefetches into L2 of one page-sized tile's K and V boxes from cache row ``row``."""
    for h in range(shape.halves):
        kiln.tma.prefetch(k_map, (column + h * HALF, row))
        kiln.tma.prefetch(v_map, (column + h * HALF, row))


def _load_q_fragments(q, b, q_first, kv_head, warp_row0, lane, shape):
    """The m16n8k16 A fragments of packed q rows ``warp_row0 ..``: a RegTile of layout
    ``kiln.layout.mma_m16n8k16_a()``, grid ``(m tiles, k16 steps)``, read from global memory in
    the order ``ldmatrix.x4`` gives: lane holds
    rows ``lane // 4`` (+ 8) and columns ``2 (lane % 4)`` (+ 8) of each 16 x 16 block, as
    ``(row, col)``, ``(row + 8, col)``, ``(row, col + 8)``, ``(row + 8, col + 8)`` pairs.
    Padding rows past the packed rows are zeros."""
    group, packed = shape.group, shape.packed
    frags = []
    for i in range(shape.m_tiles):
        heads, tokens, live = [], [], []
        for half in range(2):
            r = warp_row0 + 16 * i + lane // 4 + 8 * half
            row = kiln.minimum(r, packed - 1)
            tokens.append(q_first + row // group)
            heads.append(kv_head * group + row % group)
            live.append(r < packed)
        for kk in range(shape.head_dim // 16):
            parts = []
            for col_half, half in ((0, 0), (0, 1), (1, 0), (1, 1)):
                pair = q.load(b, tokens[half], heads[half], 16 * kk + 8 * col_half
                              + 2 * (lane % 4), width=2, align=4)
                parts += kiln.unpack(kiln.where(live[half], pair, 0.0))
            frags.append(kiln.pack(parts))
    return kiln.RegTile(frags, kiln.layout.mma_m16n8k16_a(), (shape.m_tiles, shape.head_dim // 16))


def _tile_rows(rows_params, page_table, b, tile, seq_len):
    """The :class:`PagedRowIndices` of tile ``tile`` (its page-table loads), or None where
    the tile has more pages than are unrolled (:func:`_load_tile` looks those up itself).
    A tile past the sequence reads the last page's entry and maps to out-of-bounds rows."""
    Rows = PagedRowIndices[rows_params]
    if Rows.num_pages > MAX_UNROLLED_PAGES:
        return None
    return Rows.populate(PageTableRow(page_table, b), tile * Rows.BN, seq_len)


@kiln.func
def _load_tile(rows_params, rows, page_table, b, tile, seq_len, k_map, v_map, slots, full,
               stage, column, producer, shape):
    """TMA tile ``tile``'s K and V into ring ``stage`` from its looked-up ``rows`` (see
    :func:`_tile_rows`; None: look the pages up here): one box per page and 64-column half,
    slot ``shape.first_slot(stage, kv, half) + page``.
    ``rows_params`` is ``(BN, page_size)``: a struct class cannot be captured by a traced if."""
    Rows = PagedRowIndices[rows_params]
    full.arrive_expect_tx(stage, shape.tile_bytes, predicate=producer)
    if Rows.num_pages > MAX_UNROLLED_PAGES:
        # Many small pages: a run-time loop keeps the code and the live rows (registers beside
        # O) small.
        for p in kiln.range(0, Rows.num_pages):
            logical = tile * Rows.BN + p * Rows.eff_page
            page = kiln.minimum(logical // Rows.page_size,
                                kiln.maximum((seq_len - 1) // Rows.page_size, 0))
            row = kiln.where(logical < seq_len, page_table[b, page] * Rows.page_size
                             + logical % Rows.page_size, OOB_ROW)
            for h in kiln.static_range(shape.halves):
                for kv in kiln.static_range(2):
                    kiln.tma.load(v_map if kv else k_map,
                                  slots.tile(shape.first_slot(stage, kv, h) + p),
                                  (column + h * HALF, row), full, stage, predicate=producer,
                                  eviction_policy=KV_EVICTION)
        return
    for h in kiln.static_range(shape.halves):
        rows.tma_copy_k(k_map, slots, full, stage, column=column + h * HALF, elect=producer,
                        needs_partial=False, eviction_policy=KV_EVICTION,
                        first_slot=shape.first_slot(stage, 0, h))
        rows.tma_copy_v(v_map, slots, full, stage, column=column + h * HALF, elect=producer,
                        needs_partial=False, eviction_policy=KV_EVICTION,
                        first_slot=shape.first_slot(stage, 1, h))

