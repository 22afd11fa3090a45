"""Hopper (``sm_90a``) attention prefill: TMA + WGMMA, warp-specialised, online softmax.

One CTA computes ``BLOCK_M = 128`` query rows of one (sequence, query head) against every key
tile its mask lets through. Q, K and V are viewed as 2-D ``[rows, heads * D]`` matrices (dense
``[B, S, H, D]`` and ragged ``[total, H, D]`` alike; ``cu_seqlens`` give each sequence's first
row), so one TMA box of ``BLOCK_N x 64`` reads 64 head-dim columns of one head.

Schedule (3 warp groups; ``BLOCK_M x BLOCK_N`` and K/V stages: 128 x 192 x 2 for D = 64,
128 x 128 x 2 for D = 128, 128 x 80 x 2 for D = 256, see ``DEFAULT_TILES``):

| warp group | registers (setmaxnreg) | job |
| --- | --- | --- |
| 0 producer | 24 | one thread: TMA-load the Q tile (``D / 64`` boxes) on ``q_full``; then for each visible key tile ``j`` (stage ``s = j % STAGES``) wait ``k_empty[s]`` and load the K boxes on ``k_full[s]``, wait ``v_empty[s]`` and load the V boxes on ``v_full[s]`` (separate barriers both ways: QK starts before V lands, and K of a later tile loads while V of this one is still read) |
| 1, 2 consumers | 240 | rows ``64*(g-1) .. +64``, one iteration per key tile ``j`` (below) |

One consumer iteration (prologue: S_0 and its softmax; epilogue: the last PV):

| step | what | overlaps with |
| --- | --- | --- |
| 1 | wait ``k_full[j]``, ``v_full[j-1]``; wait for this group's turn (named barrier ``3 + g``) | |
| 2 | issue ``S_j = Q K_j^T`` (``wgmma m64nBNk16``, K-major); rescale O by ``exp2(m_{j-2} - m_{j-1})`` while it runs; issue ``O += P_{j-1} V_{j-1}`` (MN-major V, P from registers as in FlashAttention-3: ``BLOCK_N / 16`` register A operands of ``mma_async``); hand the turn to the other group (``bar.arrive``) | the other group's softmax (ping-pong) |
| 3 | ``wgmma.wait_group 1``: S_j is ready; mask it if the tile is a boundary tile; online softmax (``OnlineSoftmax``: running max, ``scale * log2 e`` folded into one FMA, ``exp2``, row sums); release ``k_empty[j]``; P_j cast to bf16/f16 into fresh registers | ``P_{j-1} V_{j-1}`` on the tensor cores (intra-warpgroup overlap) |
| 4 | ``wgmma.wait_group 0``; release ``v_empty[j-1]`` | |

O is rescaled lazily at every head dim: only when some row's max grew by more than
``LAZY_RESCALE_THRESHOLD`` does the next step 2 rescale O; otherwise the max stays where it was
and P may reach ``2**8``. At D = 64 and 128 (``exp_before_max``) step 3 does not even reduce the
tile's max: it takes P against the running max at once, and the warp group votes
(``bar.red.or``) whether some lane's row sums passed ``2**8``; only then (rare: a row's first
visible key, or a jump of the scores) does it issue ``S_j`` again and take the max. The max
reduction and its shuffles leave the path from S_j to P_j, and the vote's barrier keeps ptxas
from hoisting step 4's wait above the softmax. At D = 256 (``exp_before_max`` spills there) the
max is reduced first and each warp votes on it (``OnlineSoftmax.lazy_scale_decision``).

Masks are intervals: key ``j`` is visible from query ``i`` (key position ``p = i + Sk - Sq``,
bottom-right aligned) iff ``lo(p) <= j <= hi(p)`` with ``lo = max(0, p - left, chunk start)``,
``hi = min(Sk - 1, p [causal], p + right, chunk end)``. Both bounds grow with ``p``, so the key
tiles a CTA visits are one contiguous range (fully-masked tiles are never loaded) and the tiles
that need no mask at all are the ones inside ``[lo(last row), hi(first row)]``.
The softmax starts from a virtual first key: the sink (logit ``sinks[h]``, zero value), or,
without sinks, a key of logit ``-1e30`` whose weight becomes exactly 0 at the first real key,
so rows that see no key stay finite (o = 0; their LSE is written as -inf).

Other head dims (any multiple of 8 up to 256, V's apart from Q/K's) run on the next 64-column
tile through zero-filled 3-D TMA boxes (:mod:`.prefill_config`); ``softcap`` caps each score
(:mod:`.softcap`) before the mask, and the softmax then runs at a log2 scale of 1.

Grid: ``(query tiles, Hq, B)`` without a causal mask, so the CTAs running together share one
head's K/V in L2; ``(Hq, query tiles, B)`` with one, query tiles longest-first. Along the head
axis, query heads are remapped ``(x % GROUP) * HKV + x // GROUP`` so neighbouring heads read
different KV heads. The output leaves through shared memory (each consumer's own Q rows) in
16-byte stores.

Persistent variant (``config.persistent``, short sequences, :meth:`HopperPrefillConfig.for_shape`):
a grid of one CTA per SM walks the ``(query tile, head, batch)`` work items (causal: longest
query tiles of every head and batch first), each CTA every ``num_blocks``-th one. The K/V ring's
uses and the ping-pong turns run on across work items, and Q has two buffers (one where two do
not fit: 192/128) released by the consumers once their output left it, so the producer loads the
next item's Q and first K/V tiles while the consumers finish the current one. The consumer steps
live in :mod:`.prefill_hopper_consumer`, with the overlapped walk (``overlap_items``: an item's
last ``P V`` issued with the next item's first ``S``; D 64 takes it where it measured faster).
"""

import functools

import kiln
from kiln import mbarrier, nvidia_asm, tma
from kiln.shared import dynamic_shared

from .prefill_config import (CHUNK_COLS, DEFAULT_TILES, EXP_BEFORE_MAX_HEAD_DIMS,
                             LAZY_RESCALE_HEAD_DIMS, ORDER_SCRATCH_BYTES, SHARED_BUDGET,
                             SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, WARP_GROUP_ROWS,
                             WARP_GROUP_THREADS,
                             HopperPrefillConfig, MaskSpec)
from .prefill_hopper_consumer import (OVERLAP_FIRST_USE, _consume_items, _consume_items_one_by_one,
                                      _consume_tile)
from .prefill_hopper_steps import (DESCRIPTOR_UNIT, ROW_BYTES, SWIZZLE, SWIZZLE_ALIGN,
                                   _box_coords, _box_view, _one_tile_at_least, _remapped_head,
                                   _sequence_span, _tile_range, _work_item, plus)

__all__ = ["make_kernel", "HopperPrefillConfig", "MaskSpec", "SUPPORTED_DTYPES",
           "SUPPORTED_HEAD_DIMS", "DEFAULT_TILES", "LAZY_RESCALE_HEAD_DIMS",
           "EXP_BEFORE_MAX_HEAD_DIMS", "SHARED_BUDGET", "ORDER_SCRATCH_BYTES", "WARP_GROUP_ROWS"]


@functools.lru_cache(maxsize=None)
def make_kernel(dtype: str, config: HopperPrefillConfig, mask: MaskSpec, group: int,
                has_sinks: bool, return_lse: bool, softcap: float = 0.0):
    """The ``@kiln.kernel`` for ``dtype`` Q/K/V, ``config``'s tiles, ``mask``, ``group`` query
    heads per KV head, with or without sinks and an LSE output; ``softcap > 0`` caps the scores
    (:mod:`.softcap`).

    Run-time parameters: ``q_map`` / ``k_map`` / ``v_map`` (2-D ``[rows, heads * D]`` views, or
    3-D ``[rows, heads, D]`` for a head dim that is not a multiple of 64: see
    :mod:`.prefill_config`), ``o`` (``[total_q, Hq * Dv]``), ``lse`` (f32, flat), ``sinks``
    (f32 ``[Hq]``), ``cu_q`` /
    ``cu_k`` (int32 ``[B + 1]``), ``scale_log2`` (softmax scale times log2 e), and the LSE
    addressing ``lse[q_start * lse_row_mult + h * lse_head_stride + i]``; the persistent
    kernel (``config.persistent``) also takes ``num_q_tiles`` and ``batches``, the extent of
    its work items.
    """
    in_type = kiln.dtype(dtype)
    statics = _Statics(config, mask, group, has_sinks, return_lse, softcap, in_type)

    def prefill(q_map: kiln.TensorMap[in_type, (statics.bm, *statics.qk_box), SWIZZLE],
                k_map: kiln.TensorMap[in_type, (statics.bn, *statics.qk_box), SWIZZLE],
                v_map: kiln.TensorMap[in_type, (statics.bn, *statics.v_box), SWIZZLE],
                o: kiln.Tensor[in_type, 2], lse: kiln.Tensor[kiln.f32, 1],
                sinks: kiln.Tensor[kiln.f32, 1], cu_q: kiln.Tensor[kiln.i32, 1],
                cu_k: kiln.Tensor[kiln.i32, 1], scale_log2: kiln.f32,
                lse_row_mult: kiln.i32, lse_head_stride: kiln.i32,
                HKV: kiln.constexpr, STAGES: kiln.constexpr, PRODUCER_REGS: kiln.constexpr,
                CONSUMER_REGS: kiln.constexpr):
        ctx = _setup(statics, q_map, k_map, v_map, o, lse, sinks, scale_log2, lse_row_mult,
                     lse_head_stride, STAGES)
        head_axis, tile_axis = (1, 0) if config.grid_q_tiles_first(mask) else (0, 1)
        head = _remapped_head(kiln.block_id(head_axis), group, HKV)
        kv_head = head // group
        batch = kiln.block_id(2)
        q_start, k_start, seq_q, seq_k = _sequence_span(cu_q, cu_k, batch)
        q_tile = kiln.block_id(tile_axis)
        if mask.causal:  # the last query tiles see the most keys: launch them first
            q_tile = kiln.num_blocks(tile_axis) - 1 - q_tile
        m0 = q_tile * statics.bm
        if m0 < seq_q:
            lo_last, hi_first, first_tile, end_tile = _tile_range(m0, seq_q, seq_k, statics)
            warp_group = ctx.tid // WARP_GROUP_THREADS
            if warp_group == 0:
                nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
                if ctx.tid == 0:
                    _produce_tile(ctx, head, kv_head, q_start, m0, k_start, first_tile,
                                  end_tile, 0, 0)
            else:
                nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
                _consume_tile(ctx, warp_group - 1, head, m0, q_start, seq_q, seq_k, lo_last,
                              hi_first, first_tile, end_tile, 0, 0, True)

    def prefill_persistent(
            q_map: kiln.TensorMap[in_type, (statics.bm, *statics.qk_box), SWIZZLE],
            k_map: kiln.TensorMap[in_type, (statics.bn, *statics.qk_box), SWIZZLE],
            v_map: kiln.TensorMap[in_type, (statics.bn, *statics.v_box), SWIZZLE],
            o: kiln.Tensor[in_type, 2], lse: kiln.Tensor[kiln.f32, 1],
            sinks: kiln.Tensor[kiln.f32, 1], cu_q: kiln.Tensor[kiln.i32, 1],
            cu_k: kiln.Tensor[kiln.i32, 1], scale_log2: kiln.f32,
            lse_row_mult: kiln.i32, lse_head_stride: kiln.i32, num_q_tiles: kiln.i32,
            batches: kiln.i32, HKV: kiln.constexpr, STAGES: kiln.constexpr,
            PRODUCER_REGS: kiln.constexpr, CONSUMER_REGS: kiln.constexpr):
        ctx = _setup(statics, q_map, k_map, v_map, o, lse, sinks, scale_log2, lse_row_mult,
                     lse_head_stride, STAGES)
        heads = group * HKV
        work_items = num_q_tiles * heads * batches
        warp_group = ctx.tid // WARP_GROUP_THREADS
        if warp_group == 0:
            nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
            if ctx.tid == 0:
                kv_use = 0
                if config.overlaps_items:  # complete the ring's virtual use 0
                    ctx.k_full.arrive(0)
                    ctx.v_full.arrive(0)
                    kv_use = OVERLAP_FIRST_USE
                q_use = 0
                for item in kiln.range(kiln.block_id(0), work_items, kiln.num_blocks(0)):
                    head, batch, m0 = _work_item(item, num_q_tiles, heads, batches, statics)
                    q_start, k_start, seq_q, seq_k = _sequence_span(cu_q, cu_k, batch)
                    _, _, first_tile, end_tile = _tile_range(m0, seq_q, seq_k, statics)
                    if config.overlaps_items:
                        end_tile, _ = _one_tile_at_least(first_tile, end_tile)
                    active = m0 < seq_q  # ragged batches: past this sequence's last row
                    if active:
                        _produce_tile(ctx, head, head // group, q_start, m0, k_start,
                                      first_tile, end_tile, kv_use, q_use)
                    kv_use = kv_use + kiln.where(active, end_tile - first_tile, 0)
                    q_use = q_use + kiln.where(active, 1, 0)
        else:
            nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
            walk = _consume_items if config.overlaps_items else _consume_items_one_by_one
            walk(ctx, warp_group - 1, work_items, num_q_tiles, heads, batches, cu_q, cu_k)

    kernel = prefill_persistent if config.persistent else prefill
    dims = f"d{statics.d}" if statics.dv == statics.d else f"d{statics.d}v{statics.dv}"
    cap = f"_cap{softcap:g}".replace(".", "p") if softcap else ""
    suffix = f"{dims}_n{statics.bn}_{'c' if mask.causal else ''}w{mask.window_left}_" \
             f"{mask.window_right}_k{mask.chunk}_g{group}{'_sink' if has_sinks else ''}" \
             f"{'_lse' if return_lse else ''}{cap}{'_persistent' if config.persistent else ''}"
    kernel.__name__ = kernel.__qualname__ = f"hopper_prefill_{dtype}_{suffix}".replace("-", "m")
    # The softmax is exp2-bound: flushing f32 denormals makes each exp2 one MUFU op.
    return kiln.kernel(kernel, flush_denormals=True)


class _Statics:
    """What the kernel is specialised on, with the tile sizes derived from it."""

    def __init__(self, config, mask, group, has_sinks, return_lse, softcap, in_type):
        self.config, self.mask, self.group = config, mask, group
        self.has_sinks, self.return_lse, self.softcap, self.in_type = \
            has_sinks, return_lse, softcap, in_type
        self.bm, self.bn, self.d, self.dv = (config.block_m, config.block_n, config.head_dim,
                                             config.dv)
        self.chunks = config.qk_width // CHUNK_COLS
        self.v_chunks = config.v_width // CHUNK_COLS
        self.q_buffer_boxes = max(self.chunks, self.v_chunks)  # Q's tile also stages O
        self.box_units = self.bn * ROW_BYTES // DESCRIPTOR_UNIT  # one K/V box, descriptor units
        # A 3-D [rows, heads, D] view: its columns past D are out of bounds and read zeros.
        self.qk_box = (1, CHUNK_COLS) if config.padded_qk else (CHUNK_COLS,)
        self.v_box = (1, CHUNK_COLS) if config.padded_v else (CHUNK_COLS,)


class _Context:
    """A CTA's shared memory, barriers and run-time parameters, as the steps read them."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@kiln.func
def _setup(st, q_map, k_map, v_map, o, lse, sinks, scale_log2, lse_row_mult, lse_head_stride,
           STAGES):
    """Shared memory and barriers (initialised, fenced and synchronised) of one CTA."""
    config = st.config
    q_buffers = config.q_buffers
    q_tiles = dynamic_shared((q_buffers * st.q_buffer_boxes, st.bm, CHUNK_COLS), st.in_type,
                             align=SWIZZLE_ALIGN)
    k_tiles = dynamic_shared((STAGES * st.chunks, st.bn, CHUNK_COLS), st.in_type,
                             align=SWIZZLE_ALIGN)
    v_tiles = dynamic_shared((STAGES * st.v_chunks, st.bn, CHUNK_COLS), st.in_type,
                             align=SWIZZLE_ALIGN)
    q_boxes, k_boxes = (_box_view(t, config.padded_qk) for t in (q_tiles, k_tiles))
    v_boxes = _box_view(v_tiles, config.padded_v)
    q_full = mbarrier.group(num_barriers=q_buffers)
    k_full = mbarrier.group(num_barriers=STAGES)
    v_full = mbarrier.group(num_barriers=STAGES)
    k_empty = mbarrier.group(num_barriers=STAGES)
    v_empty = mbarrier.group(num_barriers=STAGES)
    # Persistent: the consumers free a Q buffer once their output has left it.
    q_empty = mbarrier.group(num_barriers=q_buffers) if config.persistent else None
    order_scratch = None
    if config.pin_pv_wait:  # sched_barrier's word per thread
        order_scratch = kiln.shared((ORDER_SCRATCH_BYTES // 4,), kiln.i32)
    tid = kiln.thread_id(0)
    for b in range(q_buffers):
        q_full.init(b, count=1, predicate=tid == 0)
    for s in kiln.static_range(STAGES):
        k_full.init(s, count=1, predicate=tid == 0)
        v_full.init(s, count=1, predicate=tid == 0)
        k_empty.init(s, count=2, predicate=tid == 0)
        v_empty.init(s, count=2, predicate=tid == 0)
    if config.persistent:
        for b in range(q_buffers):
            q_empty.init(b, count=2 * WARP_GROUP_THREADS, predicate=tid == 0)
    nvidia_asm.fence_mbarrier_init()
    kiln.barrier()
    return _Context(st=st, q_map=q_map, k_map=k_map, v_map=v_map, o=o, lse=lse, sinks=sinks,
                    scale_log2=scale_log2, lse_row_mult=lse_row_mult,
                    lse_head_stride=lse_head_stride, STAGES=STAGES, q_tiles=q_tiles,
                    k_tiles=k_tiles, v_tiles=v_tiles, q_boxes=q_boxes, k_boxes=k_boxes,
                    v_boxes=v_boxes, q_full=q_full, q_empty=q_empty, k_full=k_full,
                    v_full=v_full, k_empty=k_empty, v_empty=v_empty,
                    order_scratch=order_scratch, tid=tid)


@kiln.func
def _produce_tile(ctx, head, kv_head, q_start, m0, k_start, first_tile, end_tile, kv_use,
                  q_use):
    """The producer thread's loads of one work item: the Q tile into buffer ``q_use % 2`` (once
    the consumers freed it), then K and V of each visible key tile into the ring, whose
    ``kv_use``-th use is the item's first."""
    st, STAGES = ctx.st, ctx.STAGES
    config, d, dv, bn, chunks = st.config, st.d, st.dv, st.bn, st.chunks
    q_buffer = q_use % config.q_buffers
    if config.persistent:
        ctx.q_empty.try_wait(q_buffer, (q_use // config.q_buffers) % 2 ^ 1)
    ctx.q_full.arrive_expect_tx(q_buffer, chunks * tma.box_bytes(ctx.q_map))
    for c in kiln.static_range(chunks):
        tma.load(ctx.q_map, ctx.q_boxes.tile(plus(q_buffer * st.q_buffer_boxes, c)),
                 (c * CHUNK_COLS, head, q_start + m0) if config.padded_qk
                 else (head * d + c * CHUNK_COLS, q_start + m0), ctx.q_full, q_buffer)
    for j in kiln.range(first_tile, end_tile):
        use = plus(kv_use, j - first_tile)
        stage = use % STAGES
        ctx.k_empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
        row = k_start + j * bn
        ctx.k_full.arrive_expect_tx(stage, chunks * tma.box_bytes(ctx.k_map))
        for c in kiln.static_range(chunks):
            tma.load(ctx.k_map, ctx.k_boxes.tile(stage * chunks + c),
                     _box_coords(config.padded_qk, kv_head, d, c, row), ctx.k_full, stage)
        ctx.v_empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
        ctx.v_full.arrive_expect_tx(stage, st.v_chunks * tma.box_bytes(ctx.v_map))
        for c in kiln.static_range(st.v_chunks):
            tma.load(ctx.v_map, ctx.v_boxes.tile(stage * st.v_chunks + c),
                     _box_coords(config.padded_v, kv_head, dv, c, row), ctx.v_full, stage)
