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
"""

import functools
import math
import operator

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared

from .online_softmax import OnlineSoftmax
from .prefill_config import (CHUNK_COLS, DEFAULT_TILES, EXP_BEFORE_MAX_HEAD_DIMS, K_STEP,
                             LAZY_RESCALE_HEAD_DIMS, ORDER_SCRATCH_BYTES, SHARED_BUDGET,
                             SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, WARP_GROUP_ROWS,
                             WARP_GROUP_THREADS, HopperPrefillConfig, MaskSpec)
from .softcap import soft_cap, soft_cap_constants

__all__ = ["make_kernel", "HopperPrefillConfig", "MaskSpec", "SUPPORTED_DTYPES",
           "SUPPORTED_HEAD_DIMS", "DEFAULT_TILES", "LAZY_RESCALE_HEAD_DIMS",
           "EXP_BEFORE_MAX_HEAD_DIMS", "SHARED_BUDGET", "ORDER_SCRATCH_BYTES"]

SWIZZLE = 128  # bytes: one 64-element row of bf16/f16
SWIZZLE_ALIGN = 1024
ROW_BYTES = 128
DESCRIPTOR_UNIT = 16  # matrix descriptors address shared memory in 16-byte units
LOG2E = 1.4426950408889634
# Finite stand-in for -inf as the initial row max: exp2(-inf - sentinel) is 0 and
# sentinel - sentinel is 0, so rows that see no key stay NaN-free.
MAX_SENTINEL = -1.0e30
LAZY_RESCALE_THRESHOLD = 8.0  # log2 units: P stays below 2**8 between rescales
PINGPONG_BARRIER = 3  # named barriers 3, 4: the consumers' turns
OUTPUT_BARRIER = 5  # named barriers 5, 6: one consumer group staging its output
VOTE_BARRIER = 7  # named barriers 7, 8: one consumer group's rescale vote (exp_before_max)


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
    addressing ``lse[q_start * lse_row_mult + h * lse_head_stride + i]``.
    """
    in_type = kiln.dtype(dtype)
    bm, bn, d, dv = config.block_m, config.block_n, config.head_dim, config.dv
    chunks = config.qk_width // CHUNK_COLS
    v_chunks = config.v_width // CHUNK_COLS
    box_units = bn * ROW_BYTES // DESCRIPTOR_UNIT  # one K/V box in descriptor units
    # A 3-D [rows, heads, D] view: its columns past D are out of bounds and read zeros.
    qk_box = (1, CHUNK_COLS) if config.padded_qk else (CHUNK_COLS,)
    v_box = (1, CHUNK_COLS) if config.padded_v else (CHUNK_COLS,)

    def prefill(q_map: kiln.TensorMap[in_type, (bm, *qk_box), SWIZZLE],
                k_map: kiln.TensorMap[in_type, (bn, *qk_box), SWIZZLE],
                v_map: kiln.TensorMap[in_type, (bn, *v_box), SWIZZLE],
                o: kiln.Tensor[in_type, 2], lse: kiln.Tensor[kiln.f32, 1],
                sinks: kiln.Tensor[kiln.f32, 1], cu_q: kiln.Tensor[kiln.i32, 1],
                cu_k: kiln.Tensor[kiln.i32, 1], scale_log2: kiln.f32,
                lse_row_mult: kiln.i32, lse_head_stride: kiln.i32,
                HKV: kiln.constexpr, STAGES: kiln.constexpr, PRODUCER_REGS: kiln.constexpr,
                CONSUMER_REGS: kiln.constexpr):
        # Q's tile also stages O: as many boxes as the wider of the two.
        q_tiles = dynamic_shared((max(chunks, v_chunks), bm, CHUNK_COLS), in_type,
                                 align=SWIZZLE_ALIGN)
        k_tiles = dynamic_shared((STAGES * chunks, bn, CHUNK_COLS), in_type, align=SWIZZLE_ALIGN)
        v_tiles = dynamic_shared((STAGES * v_chunks, bn, CHUNK_COLS), in_type,
                                 align=SWIZZLE_ALIGN)
        q_boxes, k_boxes = (_box_view(t, config.padded_qk) for t in (q_tiles, k_tiles))
        v_boxes = _box_view(v_tiles, config.padded_v)
        q_full = mbarrier.group(num_barriers=1)
        k_full = mbarrier.group(num_barriers=STAGES)
        v_full = mbarrier.group(num_barriers=STAGES)
        k_empty = mbarrier.group(num_barriers=STAGES)
        v_empty = mbarrier.group(num_barriers=STAGES)
        if config.pin_pv_wait:  # sched_barrier's word per thread
            order_scratch = kiln.shared((ORDER_SCRATCH_BYTES // 4,), kiln.i32)
        tid = kiln.thread_id(0)
        q_full.init(0, count=1, predicate=tid == 0)
        for s in kiln.static_range(STAGES):
            k_full.init(s, count=1, predicate=tid == 0)
            v_full.init(s, count=1, predicate=tid == 0)
            k_empty.init(s, count=2, predicate=tid == 0)
            v_empty.init(s, count=2, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        kiln.barrier()

        head_axis, tile_axis = (1, 0) if config.grid_q_tiles_first(mask) else (0, 1)
        head = _remapped_head(kiln.block_id(head_axis), group, HKV)
        kv_head = head // group
        batch = kiln.block_id(2)
        q_start = cu_q[batch]
        k_start = cu_k[batch]
        seq_q = cu_q[batch + 1] - q_start
        seq_k = cu_k[batch + 1] - k_start
        q_tile = kiln.block_id(tile_axis)
        if mask.causal:  # the last query tiles see the most keys: launch them first
            q_tile = kiln.num_blocks(tile_axis) - 1 - q_tile
        m0 = q_tile * bm
        if m0 < seq_q:
            last_row = kiln.minimum(m0 + bm, seq_q) - 1
            lo_last, _ = _key_bounds(last_row, seq_q, seq_k, mask)
            lo_first, hi_first = _key_bounds(m0, seq_q, seq_k, mask)
            _, hi_last = _key_bounds(last_row, seq_q, seq_k, mask)
            first_tile = lo_first // bn
            end_tile = kiln.maximum((hi_last + bn) // bn, first_tile)
            warp_group = tid // WARP_GROUP_THREADS
            if warp_group == 0:
                nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
                if tid == 0:
                    q_full.arrive_expect_tx(0, chunks * tma.box_bytes(q_map))
                    for c in kiln.static_range(chunks):
                        tma.load(q_map, q_boxes.tile(c),
                                 (c * CHUNK_COLS, head, q_start + m0) if config.padded_qk
                                 else (head * d + c * CHUNK_COLS, q_start + m0), q_full, 0)
                    for j in kiln.range(first_tile, end_tile):
                        use = j - first_tile
                        stage = use % STAGES
                        k_empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                        row = k_start + j * bn
                        k_full.arrive_expect_tx(stage, chunks * tma.box_bytes(k_map))
                        for c in kiln.static_range(chunks):
                            tma.load(k_map, k_boxes.tile(stage * chunks + c),
                                     _box_coords(config.padded_qk, kv_head, d, c, row),
                                     k_full, stage)
                        v_empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                        v_full.arrive_expect_tx(stage, v_chunks * tma.box_bytes(v_map))
                        for c in kiln.static_range(v_chunks):
                            tma.load(v_map, v_boxes.tile(stage * v_chunks + c),
                                     _box_coords(config.padded_v, kv_head, dv, c, row),
                                     v_full, stage)
            else:
                nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
                consumer = warp_group - 1
                lane = tid % 32
                # The two rows this thread holds in every m64 fragment (a WGMMA accumulator).
                row0 = m0 + consumer * WARP_GROUP_ROWS + (tid % WARP_GROUP_THREADS) // 32 * 16 \
                    + lane // 4
                rows = (row0, row0 + 8)
                first_col = 2 * (lane % 4)
                tile_mask = _TileMask(rows, seq_q, seq_k, mask, lo_last, hi_first, bn,
                                      soft_cap_constants(scale_log2, softcap) if softcap
                                      else None)
                # Capped scores come out of soft_cap in log2 units: the softmax scale is 1.
                log2_scale = 1.0 if softcap else scale_log2
                ops = _Operands(
                    q=wgmma.smem_descriptor(q_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                            byte_offset=consumer * WARP_GROUP_ROWS * ROW_BYTES),
                    k=wgmma.smem_descriptor(k_tiles.tile(0), leading_bytes=16, stride_bytes=1024),
                    v=wgmma.smem_descriptor(v_tiles.tile(0), leading_bytes=bn * ROW_BYTES,
                                            stride_bytes=1024),
                    dtype=in_type, config=config, box_units=box_units,
                    q_box_units=bm * ROW_BYTES // DESCRIPTOR_UNIT)
                first_thread = tid % WARP_GROUP_THREADS == 0
                my_turn = PINGPONG_BARRIER + consumer
                other_turn = PINGPONG_BARRIER + 1 - consumer
                if consumer == 1:  # consumer 0 issues its WGMMAs first
                    nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER, 2 * WARP_GROUP_THREADS)
                acc = wgmma.fragment_zeros(config.v_width)
                softmax = OnlineSoftmax[kiln.f32].init(wgmma.fragment_to_tile(
                    wgmma.fragment_zeros(bn)), q_axis="row")
                # A sink is a virtual first key; without one, a key of logit MAX_SENTINEL whose
                # weight becomes exactly 0 at the first real key keeps masked rows finite.
                softmax.reseed_with_sink(sinks[head] * LOG2E if has_sinks else MAX_SENTINEL)
                # Q has landed even when no key is visible: its rows later stage the output.
                q_full.try_wait(0, 0)
                if first_tile < end_tile:
                    # Prologue: S of the first tile, alone.
                    k_full.try_wait(0, 0)
                    nvidia_asm.named_barrier(my_turn, 2 * WARP_GROUP_THREADS)
                    scores = _issue_qk(ops, 0)
                    nvidia_asm.named_barrier_arrive(other_turn, 2 * WARP_GROUP_THREADS)
                    wgmma.wait_group(0)
                    if first_thread:
                        k_empty.arrive(0, wgmma_pending=0)
                    probs, rescale_pending = _softmax_tile(
                        softmax, scores, first_tile * bn, tile_mask, log2_scale, in_type,
                        config.lazy_rescale)
                    for j in kiln.range(first_tile + 1, end_tile):
                        use = j - first_tile
                        stage = use % STAGES
                        previous = (use - 1) % STAGES
                        k_full.try_wait(stage, (use // STAGES) % 2)
                        v_full.try_wait(previous, ((use - 1) // STAGES) % 2)
                        # S_j and O += P_{j-1} V_{j-1} issue back to back; softmax of S_j then
                        # runs while the PV product is still on the tensor cores.
                        nvidia_asm.named_barrier(my_turn, 2 * WARP_GROUP_THREADS)
                        scores = _issue_qk(ops, stage)
                        # O to P_{j-1}'s max, on the CUDA cores while S_j is on the tensor cores.
                        if rescale_pending:
                            acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
                        acc = _issue_pv(ops, acc, probs, previous)
                        nvidia_asm.named_barrier_arrive(other_turn, 2 * WARP_GROUP_THREADS)
                        wgmma.wait_group(1)
                        # P_j lands in new registers: P_{j-1}'s are still the PV operand.
                        if config.exp_before_max:
                            next_probs, rescale_pending = _softmax_tile_max_on_demand(
                                softmax, scores, j * bn, tile_mask, log2_scale, in_type, ops,
                                stage, VOTE_BARRIER + consumer)
                            if first_thread:  # K_j is not read again
                                k_empty.arrive(stage, wgmma_pending=1)
                        else:
                            if first_thread:  # S_j is done with K_j
                                k_empty.arrive(stage, wgmma_pending=1)
                            next_probs, rescale_pending = _softmax_tile(
                                softmax, scores, j * bn, tile_mask, log2_scale, in_type,
                                config.lazy_rescale)
                        if config.pin_pv_wait:  # else ptxas waits before the softmax
                            nvidia_asm.sched_barrier(order_scratch, tid)
                        # P_j must not take P_{j-1}'s registers while P_{j-1} V_{j-1} runs.
                        wgmma.wait_group(0, reads=probs)
                        if first_thread:
                            v_empty.arrive(previous, wgmma_pending=0)
                        probs = next_probs
                    # Epilogue: the last tile's PV product.
                    last = end_tile - 1 - first_tile
                    v_full.try_wait(last % STAGES, (last // STAGES) % 2)
                    nvidia_asm.named_barrier(my_turn, 2 * WARP_GROUP_THREADS)
                    if rescale_pending:
                        acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
                    acc = _issue_pv(ops, acc, probs, last % STAGES)
                    nvidia_asm.named_barrier_arrive(other_turn, 2 * WARP_GROUP_THREADS)
                    wgmma.wait_group(0)
                    if first_thread:
                        v_empty.arrive(last % STAGES, wgmma_pending=0)
                if consumer == 0:  # absorb consumer 1's last hand-over
                    nvidia_asm.named_barrier(PINGPONG_BARRIER, 2 * WARP_GROUP_THREADS)
                inverse_norm = [kiln.where(n > 0.0, kiln.rcp(n), 0.0)
                                for n in softmax.norm_vec.values[0]]
                out = wgmma.scale_rows(acc, inverse_norm)
                lse_rows = softmax.log_sum_exp().values[0]
                max_rows = softmax.max_vec.values[0]
                _write_output(out, lse_rows, max_rows, rows, o, lse, head, dv, seq_q, q_start,
                              first_col, lane, lse_row_mult, lse_head_stride, return_lse,
                              q_tiles, m0, consumer)

    dims = f"d{d}" if dv == d else f"d{d}v{dv}"
    cap = f"_cap{softcap:g}".replace(".", "p") if softcap else ""
    suffix = f"{dims}_n{bn}_{'c' if mask.causal else ''}w{mask.window_left}_{mask.window_right}" \
             f"_k{mask.chunk}_g{group}{'_sink' if has_sinks else ''}{'_lse' if return_lse else ''}{cap}"
    prefill.__name__ = prefill.__qualname__ = f"hopper_prefill_{dtype}_{suffix}".replace("-", "m")
    # The softmax is exp2-bound: flushing f32 denormals makes each exp2 one MUFU op.
    return kiln.kernel(prefill, flush_denormals=True)


@kiln.func
def _remapped_head(block_x, group, num_kv_heads):
    """Query head of grid column ``block_x``: neighbours in x alternate KV heads."""
    return (block_x % group) * num_kv_heads + block_x // group


def _key_bounds(row, seq_q, seq_k, mask: MaskSpec):
    """``(lo, hi)``: the inclusive key range query ``row`` may read (empty when hi < lo)."""
    pos = row + seq_k - seq_q
    lo = 0
    hi = seq_k - 1
    if mask.causal:
        hi = kiln.minimum(hi, pos)
    if mask.window_left >= 0:
        lo = kiln.maximum(lo, pos - mask.window_left)
    if mask.window_right >= 0:
        hi = kiln.minimum(hi, pos + mask.window_right)
    if mask.chunk:
        chunk_start = pos - (pos % mask.chunk + mask.chunk) % mask.chunk  # floor, pos may be < 0
        lo = kiln.maximum(lo, chunk_start)
        hi = kiln.minimum(hi, chunk_start + mask.chunk - 1)
    return lo, hi


def _fragment_row(i: int) -> int:
    """Which of the thread's two rows register ``i`` of an m64 fragment belongs to."""
    return (i // 2) % 2


def _fragment_col(i: int) -> int:
    """Column of register ``i`` relative to the thread's first column ``2 * (lane % 4)``."""
    return 8 * (i // 4) + i % 2


class _TileMask:
    """Where a consumer thread's two rows may look: ``needed(n0)`` says whether key tile
    ``n0 ..`` has any invisible key for any row of the CTA, ``apply`` masks it. The per-row
    bounds are recomputed inside the (rare) masked branch rather than kept live in registers."""

    def __init__(self, rows, seq_q, seq_k, mask, lo_last, hi_first, block_n, cap):
        self.rows, self.seq_q, self.seq_k, self.mask = rows, seq_q, seq_k, mask
        self.lo_last, self.hi_first, self.block_n = lo_last, hi_first, block_n
        self.cap = cap  # soft_cap_constants, or None

    def soft_cap(self, scores):
        """The soft-capped scores (log2 units) with a softcap, else ``scores`` unchanged."""
        if self.cap is None:
            return scores
        return wgmma.fragment_from_elements([soft_cap(scores.element(i), *self.cap)
                                             for i in range(scores.shape[1] // 2)])

    def needed(self, n0):
        return (n0 < self.lo_last) | (n0 + self.block_n - 1 > self.hi_first)

    def apply(self, scores, n0):
        bounds = [_key_bounds(r, self.seq_q, self.seq_k, self.mask) for r in self.rows]
        return _mask_scores(scores, n0 + 2 * (kiln.thread_id(0) % 4), bounds)


def _mask_scores(scores, first_col, bounds):
    """Scores outside each row's visible key interval become -inf."""
    values = []
    for i in range(scores.shape[1] // 2):
        lo, hi = bounds[_fragment_row(i)]
        col = first_col + _fragment_col(i)
        values.append(kiln.where((col >= lo) & (col <= hi), scores.element(i),
                                 kiln.cast(-math.inf, kiln.f32)))
    return wgmma.fragment_from_elements(values)


class _Operands:
    """The consumer's WGMMA operand descriptors (i64 base addresses, see
    :func:`kiln.wgmma.smem_descriptor`) and the strides between their boxes."""

    def __init__(self, *, q, k, v, dtype, config, box_units, q_box_units):
        self.q, self.k, self.v = q, k, v
        self.dtype, self.config, self.block_n = dtype, config, config.block_n
        self.box_units, self.q_box_units = box_units, q_box_units

    def stage_offset(self, stage, width):
        """Descriptor offset of ring stage ``stage`` of a K or V ring of ``width`` columns
        (``width / 64`` boxes per stage)."""
        return kiln.cast(stage * (width // CHUNK_COLS) * self.box_units, kiln.i64)


def _box_view(tiles, padded):
    """The TMA destinations of a ring: one ``[rows, 1, 64]`` box per 3-D (padded) load."""
    if not padded:
        return tiles
    count, rows, cols = tiles.shape
    return tiles.reinterpret((count, rows, 1, cols), tiles.dtype)


def _box_coords(padded, head, d, chunk, row):
    """TMA coordinates (innermost first) of box ``chunk`` of ``head``'s columns at ``row``."""
    if padded:
        return (chunk * CHUNK_COLS, head, row)
    return (head * d + chunk * CHUNK_COLS, row)


def _issue_qk(ops: _Operands, stage):
    """Issue ``S = Q K^T`` on ring stage ``stage`` as one WGMMA group (K is K-major: each
    16-wide K step moves 32 bytes inside a 64-column box, every 4 steps the next box)."""
    base = ops.k + ops.stage_offset(stage, ops.config.qk_width)
    scores = wgmma.fragment_zeros(ops.block_n)
    wgmma.fence()
    for ks in range(ops.config.qk_steps):  # columns past the head dim are zeros: skipped
        scores = wgmma.mma_async(scores, ops.q + (ks // 4) * ops.q_box_units + (ks % 4) * 2,
                                 base + (ks // 4) * ops.box_units + (ks % 4) * 2,
                                 dtype=ops.dtype)
    wgmma.commit()
    return scores


def _issue_pv(ops: _Operands, acc, probs, stage):
    """Issue ``O += P V`` on ring stage ``stage`` as one WGMMA group: P from registers (``probs``,
    one A operand per 16 keys), V MN-major (its ``D / 64`` boxes are the descriptor's leading
    dimension; each 16-key step moves 16 rows of 128 bytes)."""
    base = ops.v + ops.stage_offset(stage, ops.config.v_width)
    wgmma.fence()  # orders O's rescale and P's registers before the asynchronous reads
    for ks in range(ops.block_n // K_STEP):
        acc = wgmma.mma_async(acc, probs.fragment(0, ks),
                              base + ks * K_STEP * ROW_BYTES // DESCRIPTOR_UNIT,
                              dtype=ops.dtype, b_major="mn")
    wgmma.commit()
    return acc


@kiln.func
def _softmax_tile(softmax, scores, n0, tile_mask, scale_log2, dtype, lazy_rescale):
    """One tile of the online softmax on raw scores ``S`` of keys ``n0 ..``: mask (boundary
    tiles only), fold ``scale * log2 e`` into the max subtraction, return P in ``dtype`` as the
    ``BLOCK_N / 16`` register A operands of the PV product.
    ``softmax.scale_vec`` then holds the factor O must be rescaled by before ``P V``."""
    scores = tile_mask.soft_cap(scores)
    if tile_mask.needed(n0):
        scores = tile_mask.apply(scores, n0)
    raw = wgmma.fragment_to_tile(scores)
    softmax.col_max_acc_scaled(raw, scale_log2)
    rescale_pending = True
    if lazy_rescale:
        rescale_pending = softmax.lazy_scale_decision(LAZY_RESCALE_THRESHOLD)
    else:
        softmax.update_scale_unconditional()
    probs = softmax.sub_max_scaled(raw, scale_log2).exp2()
    softmax.apply_unconditional_norm_rescale()
    softmax.col_sum_acc(probs)
    return _p_operands(probs, dtype), rescale_pending


@kiln.func
def _softmax_tile_max_on_demand(softmax, scores, n0, tile_mask, scale_log2, dtype, ops, stage,
                                vote_barrier):
    """:func:`_softmax_tile` with a lazy rescale that computes the tile's max only when it is
    needed: P = exp2(scale * S - running max) at once, and while every lane's partial row sums
    stay within ``2**LAZY_RESCALE_THRESHOLD`` (so every P does too) that P stands and the max
    is not reduced at all. Otherwise (rare: a row's max grew, or a row saw its first key) the
    group issues ``S = Q K^T`` again on ``stage`` (K is released after this call) and takes
    the tile the usual way. Returns P's A operands and whether O must be rescaled."""
    scores = tile_mask.soft_cap(scores)
    if tile_mask.needed(n0):
        scores = tile_mask.apply(scores, n0)
    probs = softmax.sub_max_scaled(wgmma.fragment_to_tile(scores), scale_log2).exp2()
    partial = probs.row_reduce(operator.add, across_lanes=False)
    # The whole warp group decides: the redo issues a (warp-group-wide) WGMMA.
    rescale_pending = nvidia_asm.named_barrier_any(
        vote_barrier, WARP_GROUP_THREADS, partial.any_greater(2.0 ** LAZY_RESCALE_THRESHOLD))
    if rescale_pending:
        scores = _issue_qk(ops, stage)
        wgmma.wait_group(0)
        scores = tile_mask.soft_cap(scores)
        if tile_mask.needed(n0):
            scores = tile_mask.apply(scores, n0)
        raw = wgmma.fragment_to_tile(scores)
        softmax.col_max_acc_scaled(raw, scale_log2)
        softmax.update_scale_unconditional()
        probs = softmax.sub_max_scaled(raw, scale_log2).exp2()
        partial = probs.row_reduce(operator.add, across_lanes=False)
    else:
        softmax.reset_scale()
    softmax.apply_unconditional_norm_rescale()
    softmax.norm_vec = softmax.norm_vec + probs.reduce_lanes(partial, operator.add)
    return _p_operands(probs, dtype), rescale_pending


def _p_operands(probs, dtype):
    """P as the register A operands of ``P V``: FP8 ones hold each 32-key block's keys in
    ``wgmma.FP8_A_K_ORDER`` (:mod:`.prefill_hopper_fp8` writes V's transpose in that order)."""
    return wgmma.a_fragment_from_accumulator(probs, dtype, k_permuted=dtype.is_fp8)


@kiln.func
def _write_output(out, lse_rows, max_rows, rows, o, lse, head, d, seq_q, q_start, first_col,
                  lane, lse_row_mult, lse_head_stride, return_lse, q_tiles, m0, consumer):
    """Store the normalised rows inside the sequence with 16-byte stores (``d`` columns: O's
    padding columns past V's head dim stay behind): the group's own 64
    rows of the Q tile (no longer read once its last QK is waited) stage O, with the 16-byte
    units of a row XOR-swizzled by ``row % 8`` so both the fragment-order writes and the
    row-order reads are free of bank conflicts. The quad's first lane writes the LSE (-inf for
    a row whose max never left the sentinel: it saw no key and no sink)."""
    group_thread = kiln.thread_id(0) % WARP_GROUP_THREADS
    staging = OUTPUT_BARRIER + consumer
    first_local = consumer * WARP_GROUP_ROWS
    nvidia_asm.named_barrier(staging, WARP_GROUP_THREADS)  # every warp's QK reads of Q are done
    for r in range(2):
        local = rows[r] - m0 - first_local
        for i in range(0, out.shape[1] // 2, 2):  # registers i, i + 1: adjacent columns of one row
            if _fragment_row(i) == r and 8 * (i // 4) < d:
                unit = 8 * (i // 4)  # first column of the 16-byte unit (static)
                pair = kiln.pack([kiln.cast(out.element(i), o.dtype),
                                  kiln.cast(out.element(i + 1), o.dtype)])
                q_tiles.store(unit // CHUNK_COLS, first_local + local,
                              ((unit % CHUNK_COLS) // 8 ^ local % 8) * 8 + first_col, pair,
                              align=4)
        if return_lse:
            if (lane % 4 == 0) & (rows[r] < seq_q):
                lse[q_start * lse_row_mult + head * lse_head_stride + rows[r]] = kiln.where(
                    max_rows[r] > MAX_SENTINEL, lse_rows[r], kiln.cast(-math.inf, kiln.f32))
    nvidia_asm.named_barrier(staging, WARP_GROUP_THREADS)
    units_per_row = d // 8
    units = WARP_GROUP_ROWS * units_per_row
    for step in range(-(-units // WARP_GROUP_THREADS)):
        index = step * WARP_GROUP_THREADS + group_thread
        partial = (step + 1) * WARP_GROUP_THREADS > units  # the last step of an odd width
        if partial:  # threads past the last unit re-read it; their store is dropped
            keep = index < units
            index = kiln.minimum(index, units - 1)
        local = index // units_per_row
        unit = index % units_per_row
        values = q_tiles.load(unit // 8, first_local + local, (unit % 8 ^ local % 8) * 8,
                              width=8, align=16)
        row = m0 + first_local + local
        inside = row < seq_q
        if partial:
            inside = inside & keep
        if inside:
            o.store(q_start + row, head * d + unit * 8, values, align=16)
