"""The consumer warp groups of the Hopper prefill kernel (:mod:`.prefill_hopper`): one work item
(``_consume_tile``, the one-tile kernel's and the plain persistent loop's), and the persistent
loop that carries each item's last ``P V`` into the next item's first turn (``_consume_items``).

Example::

    _consume_items(ctx, consumer, work_items, num_q_tiles, heads, batches, cu_q, cu_k)
"""

import kiln
from kiln import nvidia_asm, wgmma

from .online_softmax import OnlineSoftmax
from .prefill_config import WARP_GROUP_ROWS, WARP_GROUP_THREADS
from .prefill_hopper_steps import (DESCRIPTOR_UNIT, LOG2E, MAX_SENTINEL, PINGPONG_BARRIER,
                                   ROW_BYTES, VOTE_BARRIER, _issue_pv, _issue_qk, _key_bounds,
                                   _one_tile_at_least, _Operands, _p_operands, _sequence_span,
                                   _softmax_tile, _softmax_tile_max_on_demand, _tile_range,
                                   _TileMask, _work_item, _write_output, _write_rows, plus)
from .softcap import soft_cap_constants

TURN_THREADS = 2 * WARP_GROUP_THREADS  # both consumer groups meet at a turn's named barrier
# The overlapped walk's first real K/V ring use: use 0 is virtual (the producer completes its
# full barriers with plain arrives), so every item's first turn issues a P V of the use before.
OVERLAP_FIRST_USE = 1


class _View:
    """What one consumer group needs to run a work item: its two fragment rows, the mask of
    the item, the WGMMA operands on the item's Q buffer and the softmax's log2 scale."""

    def __init__(self, ctx, consumer, m0, seq_q, seq_k, lo_last, hi_first, q_buffer):
        st = ctx.st
        self.rows, self.lane, self.first_col = _fragment_rows(ctx, consumer, m0)
        self.tile_mask = _TileMask(self.rows, seq_q, seq_k, st.mask, lo_last, hi_first, st.bn,
                                   soft_cap_constants(ctx.scale_log2, st.softcap)
                                   if st.softcap else None)
        # Capped scores come out of soft_cap in log2 units: the softmax scale is 1.
        self.log2_scale = 1.0 if st.softcap else ctx.scale_log2
        self.ops = _operands(ctx, consumer, q_buffer)


def _operands(ctx, consumer, q_buffer):
    """The group's WGMMA operands: its 64 rows of Q buffer ``q_buffer``, the K and V rings."""
    st = ctx.st
    q_box_units = st.bm * ROW_BYTES // DESCRIPTOR_UNIT
    q_desc = wgmma.smem_descriptor(ctx.q_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                   byte_offset=consumer * WARP_GROUP_ROWS * ROW_BYTES)
    return _Operands(
        q=plus(kiln.cast(q_buffer * st.q_buffer_boxes * q_box_units, kiln.i64)
               if st.config.persistent else 0, q_desc),
        k=wgmma.smem_descriptor(ctx.k_tiles.tile(0), leading_bytes=16, stride_bytes=1024),
        v=wgmma.smem_descriptor(ctx.v_tiles.tile(0), leading_bytes=st.bn * ROW_BYTES,
                                stride_bytes=1024),
        dtype=st.in_type, config=st.config, box_units=st.box_units, q_box_units=q_box_units)


def _fragment_rows(ctx, consumer, m0):
    """``(rows, lane, first_col)``: the two rows this thread holds in every m64 fragment (a
    WGMMA accumulator) of the item at ``m0``, its lane and its first column."""
    lane = ctx.tid % 32
    row0 = m0 + consumer * WARP_GROUP_ROWS + (ctx.tid % WARP_GROUP_THREADS) // 32 * 16 + \
        lane // 4
    return (row0, row0 + 8), lane, 2 * (lane % 4)


def _fresh_softmax(ctx, head, bn):
    """Row state before an item's first key: the sink as a virtual first key; without one, a
    key of logit MAX_SENTINEL whose weight becomes exactly 0 at the first real key keeps
    masked rows finite."""
    softmax = OnlineSoftmax[kiln.f32].init(wgmma.fragment_to_tile(
        wgmma.fragment_zeros(bn)), q_axis="row")
    softmax.reseed_with_sink(ctx.sinks[head] * LOG2E if ctx.st.has_sinks else MAX_SENTINEL)
    return softmax


def _own_end_tile(ctx, consumer, m0, seq_q, seq_k, first_tile, end_tile):
    """The end of the key tiles one of this group's own rows sees (``skip_masked_tiles``;
    ``end_tile`` otherwise): a key bound grows with the row, so its last row's bound; at
    least one tile past ``first_tile``."""
    st = ctx.st
    if not st.config.skip_masked_tiles:
        return end_tile
    last_row = kiln.minimum(m0 + (consumer + 1) * WARP_GROUP_ROWS, seq_q) - 1
    _, hi = _key_bounds(last_row, seq_q, seq_k, st.mask)
    return kiln.minimum(end_tile, kiln.maximum((hi + st.bn) // st.bn, first_tile + 1))


@kiln.func
def _pass_turns(ctx, consumer, own_end, end_tile, first_tile, kv_use):
    """This group's turns at the key tiles ``own_end .. end_tile`` none of its rows sees: no
    products (the other group keeps the tensor cores), and the tiles' K and V released once
    they landed (an earlier release would count toward the stage's previous use)."""
    STAGES = ctx.STAGES
    for j in kiln.range(own_end, end_tile):
        use = plus(kv_use, j - first_tile)
        stage = use % STAGES
        ctx.k_full.try_wait(stage, (use // STAGES) % 2)
        ctx.v_full.try_wait(stage, (use // STAGES) % 2)
        nvidia_asm.named_barrier(PINGPONG_BARRIER + consumer, TURN_THREADS)
        nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER + 1 - consumer, TURN_THREADS)
        if ctx.tid % WARP_GROUP_THREADS == 0:
            ctx.k_empty.arrive(stage)
            ctx.v_empty.arrive(stage)


@kiln.func
def _key_tiles(ctx, view, consumer, softmax, acc, probs, rescale_pending, first_tile, end_tile,
               kv_use):
    """The steady iterations of one item (the module docstring of :mod:`.prefill_hopper`):
    key tiles ``first_tile + 1 .. end_tile``, each issuing ``S_j`` and ``P_{j-1} V_{j-1}`` in
    one turn. Returns O, the last tile's P and whether O needs a rescale before its product."""
    st, STAGES = ctx.st, ctx.STAGES
    config, bn, in_type, ops = st.config, st.bn, st.in_type, view.ops
    first_thread = ctx.tid % WARP_GROUP_THREADS == 0
    my_turn = PINGPONG_BARRIER + consumer
    other_turn = PINGPONG_BARRIER + 1 - consumer
    for j in kiln.range(first_tile + 1, end_tile):
        use = plus(kv_use, j - first_tile)
        stage = use % STAGES
        previous = (use - 1) % STAGES
        ctx.k_full.try_wait(stage, (use // STAGES) % 2)
        ctx.v_full.try_wait(previous, ((use - 1) // STAGES) % 2)
        # S_j and O += P_{j-1} V_{j-1} issue back to back; softmax of S_j then
        # runs while the PV product is still on the tensor cores.
        nvidia_asm.named_barrier(my_turn, TURN_THREADS)
        scores = _issue_qk(ops, stage)
        # O to P_{j-1}'s max, on the CUDA cores while S_j is on the tensor cores.
        if rescale_pending:
            acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
        acc = _issue_pv(ops, acc, probs, previous)
        nvidia_asm.named_barrier_arrive(other_turn, TURN_THREADS)
        wgmma.wait_group(1)
        # P_j lands in new registers: P_{j-1}'s are still the PV operand.
        if config.exp_before_max:
            next_probs, rescale_pending = _softmax_tile_max_on_demand(
                softmax, scores, j * bn, view.tile_mask, view.log2_scale, in_type, ops,
                stage, VOTE_BARRIER + consumer)
            if first_thread:  # K_j is not read again
                ctx.k_empty.arrive(stage, wgmma_pending=1)
        else:
            if first_thread:  # S_j is done with K_j
                ctx.k_empty.arrive(stage, wgmma_pending=1)
            next_probs, rescale_pending = _softmax_tile(
                softmax, scores, j * bn, view.tile_mask, view.log2_scale, in_type,
                config.lazy_rescale)
        if config.pin_pv_wait:  # else ptxas waits before the softmax
            nvidia_asm.sched_barrier(ctx.order_scratch, ctx.tid)
        # P_j must not take P_{j-1}'s registers while P_{j-1} V_{j-1} runs.
        wgmma.wait_group(0, reads=probs)
        if first_thread:
            ctx.v_empty.arrive(previous, wgmma_pending=0)
        probs = next_probs
    return acc, probs, rescale_pending


def _inverse_norm(softmax):
    """``1 / row sum`` of the thread's two rows (0 for a row of sum 0: it saw no key)."""
    return [kiln.where(n > 0.0, kiln.rcp(n), 0.0) for n in softmax.norm_vec.values[0]]


def _row_factors(softmax):
    """``(1 / row sum, LSE, max)`` of the thread's two rows."""
    return _inverse_norm(softmax), softmax.log_sum_exp().values[0], softmax.max_vec.values[0]


@kiln.func
def _store_item(ctx, consumer, acc, factors, fragment_rows, head, m0, q_start, seq_q,
                q_buffer, q_use=None):
    """The normalised output and LSE of one item's rows (``factors``: :func:`_row_factors`'
    tuple, or the softmax to take them from; ``fragment_rows``:
    :func:`_fragment_rows`' of the item), staged in Q buffer ``q_buffer`` (a persistent
    kernel with ``direct_store``: stored from the registers), which a persistent kernel then
    hands back to the producer. ``q_use``: the buffer's use by this item, waited
    again (it landed long ago, but the wait pass does not tell the two Q buffers' hand-backs
    apart)."""
    st = ctx.st
    rows, lane, first_col = fragment_rows
    if isinstance(factors, tuple):
        inverse_norm, lse_rows, max_rows = factors
        out = wgmma.scale_rows(acc, inverse_norm)
    else:  # the softmax itself: 1 / row sum, O's scaling, then LSE and max (as ever before)
        out = wgmma.scale_rows(acc, _inverse_norm(factors))
        lse_rows, max_rows = factors.log_sum_exp().values[0], factors.max_vec.values[0]
    if st.config.direct_store and st.config.persistent:  # no staging: the buffer is free
        _write_rows(out, lse_rows, max_rows, rows, ctx.o, ctx.lse, head, st.dv, seq_q, q_start,
                    first_col, lane, ctx.lse_row_mult, ctx.lse_head_stride, st.return_lse)
        ctx.q_empty.arrive(q_buffer)
        return
    if q_use is not None:
        ctx.q_full.try_wait(q_buffer, (q_use // 2) % 2)
    _write_output(out, lse_rows, max_rows, rows, ctx.o, ctx.lse, head, st.dv,
                  seq_q, q_start, first_col, lane, ctx.lse_row_mult,
                  ctx.lse_head_stride, st.return_lse, ctx.q_tiles, m0, consumer,
                  q_buffer * st.q_buffer_boxes)
    if st.config.persistent:  # this group's output has left the Q buffer
        nvidia_asm.fence_proxy_async()
        ctx.q_empty.arrive(q_buffer)


@kiln.func
def _consume_tile(ctx, consumer, head, m0, q_start, seq_q, seq_k, lo_last, hi_first, first_tile,
                  end_tile, kv_use, q_use, own_turns):
    """One consumer group's work item: its 64 query rows against every visible key tile (the
    module docstring's iteration), then the normalised output and LSE. ``own_turns``: the
    item starts and ends the ping-pong turns (one item per CTA); else the turns run on."""
    st, STAGES = ctx.st, ctx.STAGES
    config, bn, in_type = st.config, st.bn, st.in_type
    q_buffer = q_use % config.q_buffers
    view = _View(ctx, consumer, m0, seq_q, seq_k, lo_last, hi_first, q_buffer)
    first_thread = ctx.tid % WARP_GROUP_THREADS == 0
    my_turn = PINGPONG_BARRIER + consumer
    other_turn = PINGPONG_BARRIER + 1 - consumer
    if own_turns:
        if consumer == 1:  # consumer 0 issues its WGMMAs first
            nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER, TURN_THREADS)
    acc = wgmma.fragment_zeros(config.v_width)
    softmax = _fresh_softmax(ctx, head, bn)
    # Q has landed even when no key is visible: its rows later stage the output.
    ctx.q_full.try_wait(q_buffer, (q_use // config.q_buffers) % 2)
    if first_tile < end_tile:
        # Prologue: S of the first tile, alone.
        first_stage = kv_use % STAGES
        ctx.k_full.try_wait(first_stage, (kv_use // STAGES) % 2)
        nvidia_asm.named_barrier(my_turn, TURN_THREADS)
        scores = _issue_qk(view.ops, first_stage)
        nvidia_asm.named_barrier_arrive(other_turn, TURN_THREADS)
        wgmma.wait_group(0)
        if first_thread:
            ctx.k_empty.arrive(first_stage, wgmma_pending=0)
        probs, rescale_pending = _softmax_tile(
            softmax, scores, first_tile * bn, view.tile_mask, view.log2_scale, in_type,
            config.lazy_rescale)
        own_end = _own_end_tile(ctx, consumer, m0, seq_q, seq_k, first_tile, end_tile)
        acc, probs, rescale_pending = _key_tiles(ctx, view, consumer, softmax, acc, probs,
                                                 rescale_pending, first_tile, own_end, kv_use)
        if config.skip_masked_tiles:
            _pass_turns(ctx, consumer, own_end, end_tile, first_tile, kv_use)
        # Epilogue: the last tile's PV product.
        last = plus(kv_use, own_end - 1 - first_tile)
        ctx.v_full.try_wait(last % STAGES, (last // STAGES) % 2)
        nvidia_asm.named_barrier(my_turn, TURN_THREADS)
        if rescale_pending:
            acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
        acc = _issue_pv(view.ops, acc, probs, last % STAGES)
        nvidia_asm.named_barrier_arrive(other_turn, TURN_THREADS)
        wgmma.wait_group(0)
        if first_thread:
            ctx.v_empty.arrive(last % STAGES, wgmma_pending=0)
    if own_turns:
        if consumer == 0:  # absorb consumer 1's last hand-over
            nvidia_asm.named_barrier(PINGPONG_BARRIER, TURN_THREADS)
    _store_item(ctx, consumer, acc, softmax, (view.rows, view.lane, view.first_col), head, m0,
                q_start, seq_q, q_buffer)


@kiln.func
def _flush(ctx, consumer, ops, acc, probs, rescale_pending, softmax, last_use, head, m0,
           q_start, seq_q, q_use, empty):
    """The last item's last ``P V`` alone (no next item to pair it with), then its output
    (zeros where ``empty``: see :func:`_one_tile_at_least`). ``ops``: operands made before
    the walk (a V descriptor made here, after the loop, lost its upper word in ptxas 13.0:
    the product read outside shared memory)."""
    STAGES = ctx.STAGES
    stage = last_use % STAGES
    ctx.v_full.try_wait(stage, (last_use // STAGES) % 2)
    factors = _row_factors(softmax)
    if rescale_pending:
        acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
    nvidia_asm.named_barrier(PINGPONG_BARRIER + consumer, TURN_THREADS)
    acc = _issue_pv(ops, acc, probs, stage)
    nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER + 1 - consumer, TURN_THREADS)
    wgmma.wait_group(0, reads=probs)
    if ctx.tid % WARP_GROUP_THREADS == 0:
        ctx.v_empty.arrive(stage, wgmma_pending=0)
    if empty:
        acc = wgmma.fragment_zeros(ctx.st.config.v_width)
    _store_item(ctx, consumer, acc, factors, _fragment_rows(ctx, consumer, m0), head, m0,
                q_start, seq_q, q_use % 2, q_use)


@kiln.func
def _consume_items(ctx, consumer, work_items, num_q_tiles, heads, batches, cu_q, cu_k):
    """One consumer group's walk of a persistent CTA's work items with their turns run on: an
    item's last ``P V`` issues in the next item's first turn, before that item's first
    ``S = Q K^T`` (on the other Q buffer), and the item's output is written while that ``S``
    is on the tensor cores, so no turn waits on a lone product or an output store."""
    st, STAGES = ctx.st, ctx.STAGES
    config, bn, in_type = st.config, st.bn, st.in_type
    first_thread = ctx.tid % WARP_GROUP_THREADS == 0
    my_turn = PINGPONG_BARRIER + consumer
    other_turn = PINGPONG_BARRIER + 1 - consumer
    if consumer == 1:  # the turns alternate across items: hand the first one over once
        nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER, TURN_THREADS)
    acc = wgmma.fragment_zeros(config.v_width)
    softmax = _fresh_softmax(ctx, 0, bn)
    probs = _p_operands(wgmma.fragment_to_tile(wgmma.fragment_zeros(bn)), in_type)
    flush_ops = _operands(ctx, consumer, 0)  # the last P V's (see _flush)
    rescale_pending = ctx.tid < 0  # a traced False
    prev_empty = rescale_pending
    prev_head, prev_m0, prev_q_start, prev_seq_q = 0, 0, 0, 0
    # The pending item's last key tile this group saw (skip_masked_tiles): use 0 is virtual.
    prev_last_use = OVERLAP_FIRST_USE - 1
    # The K/V ring starts at its virtual use 0 (OVERLAP_FIRST_USE): its K is released here,
    # its V by the first item's dropped product. Its K phase is waited first, so every phase
    # completed is waited on (compute-sanitizer synccheck: no missing wait).
    ctx.k_full.try_wait(0, 0)
    if first_thread:
        ctx.k_empty.arrive(0)
    kv_use = OVERLAP_FIRST_USE
    q_use = 0
    for item in kiln.range(kiln.block_id(0), work_items, kiln.num_blocks(0)):
        head, batch, m0 = _work_item(item, num_q_tiles, heads, batches, st)
        q_start, k_start, seq_q, seq_k = _sequence_span(cu_q, cu_k, batch)
        lo_last, hi_first, first_tile, end_tile = _tile_range(m0, seq_q, seq_k, st)
        end_tile, empty = _one_tile_at_least(first_tile, end_tile)
        active = m0 < seq_q  # ragged batches: past this sequence's last row
        if active:
            q_buffer = q_use % 2
            pending = q_use > 0  # the previous item's last P V is not issued yet
            # The pending item's last key tile in the ring.
            last_use = prev_last_use if config.skip_masked_tiles else kv_use - 1
            view = _View(ctx, consumer, m0, seq_q, seq_k, lo_last, hi_first, q_buffer)
            ctx.q_full.try_wait(q_buffer, (q_use // 2) % 2)
            factors = _row_factors(softmax)
            if pending & rescale_pending:
                acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
            stage = kv_use % STAGES
            ctx.k_full.try_wait(stage, (kv_use // STAGES) % 2)
            ctx.v_full.try_wait(last_use % STAGES, (last_use // STAGES) % 2)
            nvidia_asm.named_barrier(my_turn, TURN_THREADS)
            scores = _issue_qk(view.ops, stage)
            # Without a pending item this is the ring's virtual first use: a product of a
            # zero P that is dropped (a product under a branch would serialise the WGMMAs).
            acc = _issue_pv(view.ops, acc, probs, last_use % STAGES)
            nvidia_asm.named_barrier_arrive(other_turn, TURN_THREADS)
            wgmma.wait_group(1)
            if first_thread:
                ctx.k_empty.arrive(stage, wgmma_pending=1)
            softmax = _fresh_softmax(ctx, head, bn)
            next_probs, rescale_pending = _softmax_tile(
                softmax, scores, first_tile * bn, view.tile_mask, view.log2_scale,
                in_type, config.lazy_rescale)
            wgmma.wait_group(0, reads=probs)
            if first_thread:
                ctx.v_empty.arrive(last_use % STAGES, wgmma_pending=0)
            probs = next_probs
            if pending:  # its output leaves while the other group has the tensor cores
                if prev_empty:  # its one tile's product may hold 0 * NaN from unseen keys
                    acc = wgmma.fragment_zeros(config.v_width)
                _store_item(ctx, consumer, acc, factors,
                            _fragment_rows(ctx, consumer, prev_m0), prev_head, prev_m0,
                            prev_q_start, prev_seq_q, (q_use - 1) % 2, q_use - 1)
                # Landed already: the wait pass does not tell this item's Q buffer from
                # the one just handed back.
                ctx.q_full.try_wait(q_buffer, (q_use // 2) % 2)
            acc = wgmma.fragment_zeros(config.v_width)
            own_end = _own_end_tile(ctx, consumer, m0, seq_q, seq_k, first_tile, end_tile)
            acc, probs, rescale_pending = _key_tiles(
                ctx, view, consumer, softmax, acc, probs, rescale_pending, first_tile,
                own_end, kv_use)
            if config.skip_masked_tiles:
                _pass_turns(ctx, consumer, own_end, end_tile, first_tile, kv_use)
                prev_last_use = plus(kv_use, own_end - 1 - first_tile)
            prev_head, prev_m0, prev_q_start, prev_seq_q = head, m0, q_start, seq_q
            prev_empty = empty
        kv_use = kv_use + kiln.where(active, end_tile - first_tile, 0)
        q_use = q_use + kiln.where(active, 1, 0)
    if q_use > 0:
        _flush(ctx, consumer, flush_ops, acc, probs, rescale_pending, softmax,
               prev_last_use if config.skip_masked_tiles else kv_use - 1, prev_head,
               prev_m0, prev_q_start, prev_seq_q, q_use - 1, prev_empty)
    if consumer == 0:  # absorb consumer 1's last hand-over
        nvidia_asm.named_barrier(PINGPONG_BARRIER, TURN_THREADS)


@kiln.func
def _consume_items_one_by_one(ctx, consumer, work_items, num_q_tiles, heads, batches, cu_q,
                              cu_k):
    """One consumer group's walk of a persistent CTA's work items, each whole
    (:func:`_consume_tile`) before the next: the kernel with one Q buffer (192 / 128)."""
    st = ctx.st
    # The turns alternate across work items: hand the first one over once, absorb the
    # last hand-over once.
    if consumer == 1:
        nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER, TURN_THREADS)
    kv_use = 0
    q_use = 0
    for item in kiln.range(kiln.block_id(0), work_items, kiln.num_blocks(0)):
        head, batch, m0 = _work_item(item, num_q_tiles, heads, batches, st)
        q_start, k_start, seq_q, seq_k = _sequence_span(cu_q, cu_k, batch)
        lo_last, hi_first, first_tile, end_tile = _tile_range(m0, seq_q, seq_k, st)
        active = m0 < seq_q
        if active:
            _consume_tile(ctx, consumer, head, m0, q_start, seq_q, seq_k, lo_last,
                          hi_first, first_tile, end_tile, kv_use, q_use, False)
        kv_use = kv_use + kiln.where(active, end_tile - first_tile, 0)
        q_use = q_use + kiln.where(active, 1, 0)
    if consumer == 0:
        nvidia_asm.named_barrier(PINGPONG_BARRIER, TURN_THREADS)
