"""Hopper (``sm_90a``) FP8 attention prefill: e4m3 Q/K/V, ``wgmma.m64nNk32``, bf16 output.

The bf16 kernel's design (:mod:`.prefill_hopper`: warp specialisation, ping-pong consumers,
the lazy online softmax, interval masks, sinks, softcap, GQA, ragged batches) with three
changes FP8 WGMMA imposes:

| what | bf16 kernel | FP8 kernel |
| --- | --- | --- |
| ``S = Q K^T`` | ``m64nNk16``, 64-column boxes | ``m64nNk32`` on 128-column (128-byte) boxes; the descales of q and k fold into the per-head softmax scale |
| ``O += P V`` | V MN-major straight from TMA | FP8 B must be K-major: the producer warp group transposes each V tile into ``Vt[d, key]`` in shared memory |
| P | bf16 A operands | e4m3 A operands (``cvt.rn.satfinite``; P <= ``2**8`` < 448 under the lazy rescale); the 8-bit A fragment holds other columns than the accumulator, so ``Vt``'s keys are stored in ``wgmma.FP8_A_K_ORDER`` and no register crosses threads |

Schedule (3 warp groups, ``BLOCK_M x BLOCK_N = 128 x 128``):

| warp group | registers | job |
| --- | --- | --- |
| 0 producer | 40 | thread 0 TMA-loads Q, then per key tile ``j`` K_{j+1} (``k_full``/``k_empty``, released by the consumers) and raw V_{j + raw_stages - 1} (``v_full``/``v_empty``); all 128 threads then wait ``v_full[j]`` and ``vt_empty[j]``, transpose V_j into ``Vt`` (per 16 keys x 32 columns: one ``ldmatrix.x4``, four ``prmt``, one ``stmatrix.x4.trans``; :func:`_transpose_v`), arrive on ``v_empty[j]``, ``fence.proxy.async`` (the WGMMA reads through the async proxy) and arrive on ``vt_full[j]`` (128 arrivals each) |
| 1, 2 consumers | 232 | the bf16 kernel's iteration, waiting ``vt_full`` instead of ``v_full`` |

Descales (FlashAttention-3's convention, ``[B, Hq]`` for q, ``[B, Hkv]`` for k and v, scalars
broadcast by the caller): ``softmax(scale * dq * dk * q k^T) (dv * v)``: the softmax scale of a
(batch, head) is ``scale * dq[b, h] * dk[b, h // group]`` and the row normaliser is
multiplied by ``dv[b, h // group]``.
"""

import functools

from mlir import ir
from mlir.dialects import vector

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared
from kiln.tiles import SharedTile

from .online_softmax import OnlineSoftmax
from .prefill_config import WARP_GROUP_ROWS, WARP_GROUP_THREADS, MaskSpec
from .prefill_hopper_fp8_config import (FP8_CHUNK_COLS, FP8_K_STEP, HopperFp8PrefillConfig,
                                        vt_boxes)
from .prefill_hopper_steps import (DESCRIPTOR_UNIT, LOG2E, MAX_SENTINEL, PINGPONG_BARRIER,
                                   ROW_BYTES, SWIZZLE, SWIZZLE_ALIGN, VOTE_BARRIER, _box_coords,
                                   _box_view, _issue_qk, _key_bounds, _Operands, _remapped_head,
                                   _softmax_tile, _softmax_tile_max_on_demand, _TileMask,
                                   _write_output)
from .softcap import soft_cap_constants

__all__ = ["make_fp8_kernel", "HopperFp8PrefillConfig"]

OUT_COLS = 64  # bf16 output columns per 128-byte staging row (the bf16 kernel's boxes)


@functools.lru_cache(maxsize=None)
def make_fp8_kernel(config: HopperFp8PrefillConfig, mask: MaskSpec, group: int,
                    has_sinks: bool, return_lse: bool, softcap: float = 0.0):
    """The ``@kiln.kernel`` for e4m3 Q/K/V and a bf16 output, ``config``'s tiles, ``mask``,
    ``group`` query heads per KV head, with or without sinks and an LSE output.

    Run-time parameters: those of :func:`.prefill_hopper.make_kernel` (the views are FP8, ``o``
    bf16), plus ``descale_q`` (f32 ``[B * Hq]``), ``descale_k`` and ``descale_v`` (f32
    ``[B * Hkv]``); ``scale_log2`` is the softmax scale times log2 e without the descales.
    """
    in_type, out_type = kiln.f8e4m3, kiln.bf16
    bm, bn, d, dv = config.block_m, config.block_n, config.head_dim, config.dv
    chunks = config.qk_width // FP8_CHUNK_COLS
    v_chunks = config.v_width // FP8_CHUNK_COLS
    box_units = bn * ROW_BYTES // DESCRIPTOR_UNIT
    qk_box = (1, FP8_CHUNK_COLS) if config.padded_qk else (FP8_CHUNK_COLS,)
    v_box = (1, FP8_CHUNK_COLS) if config.padded_v else (FP8_CHUNK_COLS,)
    q_region_cols = max(config.qk_width, 2 * config.v_width) // 2  # in bf16 columns

    def prefill(q_map: kiln.TensorMap[in_type, (bm, *qk_box), SWIZZLE],
                k_map: kiln.TensorMap[in_type, (bn, *qk_box), SWIZZLE],
                v_map: kiln.TensorMap[in_type, (bn, *v_box), SWIZZLE],
                o: kiln.Tensor[out_type, 2], lse: kiln.Tensor[kiln.f32, 1],
                sinks: kiln.Tensor[kiln.f32, 1], cu_q: kiln.Tensor[kiln.i32, 1],
                cu_k: kiln.Tensor[kiln.i32, 1], descale_q: kiln.Tensor[kiln.f32, 1],
                descale_k: kiln.Tensor[kiln.f32, 1], descale_v: kiln.Tensor[kiln.f32, 1],
                scale_log2: kiln.f32, lse_row_mult: kiln.i32, lse_head_stride: kiln.i32,
                HKV: kiln.constexpr, STAGES: kiln.constexpr, RAW_STAGES: kiln.constexpr,
                PRODUCER_REGS: kiln.constexpr, CONSUMER_REGS: kiln.constexpr):
        # The Q tile also stages the bf16 O rows (64-column boxes): as large as the larger.
        o_tiles = dynamic_shared((q_region_cols // OUT_COLS, bm, OUT_COLS), out_type,
                                 align=SWIZZLE_ALIGN)
        q_tiles = o_tiles.reinterpret((chunks, bm, FP8_CHUNK_COLS), in_type)
        k_tiles = dynamic_shared((STAGES * chunks, bn, FP8_CHUNK_COLS), in_type,
                                 align=SWIZZLE_ALIGN)
        vt_tiles = dynamic_shared((STAGES * vt_boxes(bn), config.v_width, FP8_CHUNK_COLS),
                                  in_type, align=SWIZZLE_ALIGN)
        raw_tiles = dynamic_shared((RAW_STAGES * v_chunks, bn, FP8_CHUNK_COLS), in_type,
                                   align=SWIZZLE_ALIGN)
        q_boxes, k_boxes = (_box_view(t, config.padded_qk) for t in (q_tiles, k_tiles))
        raw_boxes = _box_view(raw_tiles, config.padded_v)
        q_full = mbarrier.group(num_barriers=1)
        k_full = mbarrier.group(num_barriers=STAGES)
        k_empty = mbarrier.group(num_barriers=STAGES)
        v_full = mbarrier.group(num_barriers=RAW_STAGES)
        v_empty = mbarrier.group(num_barriers=RAW_STAGES)
        vt_full = mbarrier.group(num_barriers=STAGES)
        vt_empty = mbarrier.group(num_barriers=STAGES)
        tid = kiln.thread_id(0)
        q_full.init(0, count=1, predicate=tid == 0)
        for s in kiln.static_range(STAGES):
            k_full.init(s, count=1, predicate=tid == 0)
            k_empty.init(s, count=2, predicate=tid == 0)
            vt_full.init(s, count=WARP_GROUP_THREADS, predicate=tid == 0)
            vt_empty.init(s, count=2, predicate=tid == 0)
        for s in kiln.static_range(RAW_STAGES):
            v_full.init(s, count=1, predicate=tid == 0)
            v_empty.init(s, count=WARP_GROUP_THREADS, predicate=tid == 0)
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
                loads = _Loads(k_map, v_map, k_boxes, raw_boxes, k_full, k_empty, v_full,
                               v_empty, config, chunks, v_chunks, kv_head, k_start, first_tile)
                if tid == 0:
                    q_full.arrive_expect_tx(0, chunks * tma.box_bytes(q_map))
                    for c in kiln.static_range(chunks):
                        tma.load(q_map, q_boxes.tile(c),
                                 _box_coords(config.padded_qk, head, d, c, q_start + m0,
                                             FP8_CHUNK_COLS),
                                 q_full, 0)
                    if first_tile < end_tile:
                        loads.k(first_tile, STAGES)
                    for j in kiln.range(first_tile, kiln.minimum(first_tile + RAW_STAGES - 1,
                                                                 end_tile)):
                        loads.v(j, RAW_STAGES)
                raw_flat = _flat_b16(raw_tiles, RAW_STAGES * v_chunks * bn * ROW_BYTES)
                vt_flat = _flat_b16(vt_tiles, STAGES * vt_boxes(bn) * config.v_width * ROW_BYTES)
                for j in kiln.range(first_tile, end_tile):
                    use = j - first_tile
                    if tid == 0:  # the next K tile, and the V tile raw_stages - 1 ahead
                        if j + 1 < end_tile:
                            loads.k(j + 1, STAGES)
                        if j + RAW_STAGES - 1 < end_tile:
                            loads.v(j + RAW_STAGES - 1, RAW_STAGES)
                    stage = use % STAGES
                    raw = use % RAW_STAGES
                    v_full.try_wait(raw, (use // RAW_STAGES) % 2)
                    vt_empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                    _transpose_v(raw_flat, vt_flat, raw * v_chunks, stage, tid, config.v_width,
                                 bn, config.transpose_batch)
                    v_empty.arrive(raw)
                    nvidia_asm.fence_proxy_async()  # Vt's generic writes -> the WGMMA's reads
                    vt_full.arrive(stage, fills=True)  # filled by the stores above
            else:
                nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
                consumer = warp_group - 1
                lane = tid % 32
                row0 = m0 + consumer * WARP_GROUP_ROWS + (tid % WARP_GROUP_THREADS) // 32 * 16 \
                    + lane // 4
                rows = (row0, row0 + 8)
                first_col = 2 * (lane % 4)
                head_scale = scale_log2 * descale_q[batch * (HKV * group) + head] \
                    * descale_k[batch * HKV + kv_head]
                tile_mask = _TileMask(rows, seq_q, seq_k, mask, lo_last, hi_first, bn,
                                      soft_cap_constants(head_scale, softcap) if softcap
                                      else None)
                log2_scale = 1.0 if softcap else head_scale
                ops = _Fp8Operands(
                    q=wgmma.smem_descriptor(q_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                            byte_offset=consumer * WARP_GROUP_ROWS * ROW_BYTES),
                    k=wgmma.smem_descriptor(k_tiles.tile(0), leading_bytes=16, stride_bytes=1024),
                    v=wgmma.smem_descriptor(vt_tiles.tile(0), leading_bytes=16,
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
                softmax.reseed_with_sink(sinks[head] * LOG2E if has_sinks else MAX_SENTINEL)
                q_full.try_wait(0, 0)
                if first_tile < end_tile:
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
                        vt_full.try_wait(previous, ((use - 1) // STAGES) % 2)
                        nvidia_asm.named_barrier(my_turn, 2 * WARP_GROUP_THREADS)
                        scores = _issue_qk(ops, stage)
                        if rescale_pending:
                            acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
                        acc = _issue_pv(ops, acc, probs, previous)
                        nvidia_asm.named_barrier_arrive(other_turn, 2 * WARP_GROUP_THREADS)
                        wgmma.wait_group(1)
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
                        # P_j must not take P_{j-1}'s registers while P_{j-1} V_{j-1} runs.
                        wgmma.wait_group(0, reads=probs)
                        if first_thread:
                            vt_empty.arrive(previous, wgmma_pending=0)
                        probs = next_probs
                    last = end_tile - 1 - first_tile
                    vt_full.try_wait(last % STAGES, (last // STAGES) % 2)
                    nvidia_asm.named_barrier(my_turn, 2 * WARP_GROUP_THREADS)
                    if rescale_pending:
                        acc = wgmma.scale_rows(acc, softmax.scale_vec.values[0])
                    acc = _issue_pv(ops, acc, probs, last % STAGES)
                    nvidia_asm.named_barrier_arrive(other_turn, 2 * WARP_GROUP_THREADS)
                    wgmma.wait_group(0)
                    if first_thread:
                        vt_empty.arrive(last % STAGES, wgmma_pending=0)
                if consumer == 0:  # absorb consumer 1's last hand-over
                    nvidia_asm.named_barrier(PINGPONG_BARRIER, 2 * WARP_GROUP_THREADS)
                v_scale = descale_v[batch * HKV + kv_head]
                inverse_norm = [kiln.where(n > 0.0, kiln.rcp(n) * v_scale, 0.0)
                                for n in softmax.norm_vec.values[0]]
                out = wgmma.scale_rows(acc, inverse_norm)
                _write_output(out, softmax.log_sum_exp().values[0], softmax.max_vec.values[0],
                              rows, o, lse, head, dv, seq_q, q_start, first_col, lane,
                              lse_row_mult, lse_head_stride, return_lse, o_tiles, m0, consumer)

    dims = f"d{d}" if dv == d else f"d{d}v{dv}"
    cap = f"_cap{softcap:g}".replace(".", "p") if softcap else ""
    suffix = f"{dims}_{'c' if mask.causal else ''}w{mask.window_left}_{mask.window_right}" \
             f"_k{mask.chunk}_g{group}{'_sink' if has_sinks else ''}{'_lse' if return_lse else ''}{cap}"
    prefill.__name__ = prefill.__qualname__ = f"hopper_prefill_f8e4m3_{suffix}".replace("-", "m")
    return kiln.kernel(prefill, flush_denormals=True)


class _Loads:
    """The producer's TMA loads of key tile ``j``: its K boxes into the K ring (waiting for
    both consumers to release the stage), its raw V boxes into the raw ring (free once the
    producer's 128 threads have read it: ``v_empty``)."""

    def __init__(self, k_map, v_map, k_boxes, raw_boxes, k_full, k_empty, v_full, v_empty,
                 config, chunks, v_chunks, kv_head, k_start, first_tile):
        self.k_map, self.v_map, self.k_boxes, self.raw_boxes = k_map, v_map, k_boxes, raw_boxes
        self.k_full, self.k_empty, self.v_full, self.v_empty = k_full, k_empty, v_full, v_empty
        self.config, self.chunks, self.v_chunks = config, chunks, v_chunks
        self.kv_head, self.k_start, self.first_tile = kv_head, k_start, first_tile

    def k(self, j, stages):
        use = j - self.first_tile
        stage = use % stages
        self.k_empty.try_wait(stage, (use // stages) % 2 ^ 1)
        self.k_full.arrive_expect_tx(stage, self.chunks * tma.box_bytes(self.k_map))
        for c in kiln.static_range(self.chunks):
            tma.load(self.k_map, self.k_boxes.tile(stage * self.chunks + c),
                     _box_coords(self.config.padded_qk, self.kv_head, self.config.head_dim, c,
                                 self.k_start + j * self.config.block_n, FP8_CHUNK_COLS),
                     self.k_full, stage)

    def v(self, j, raw_stages):
        use = j - self.first_tile
        raw = use % raw_stages
        self.v_empty.try_wait(raw, (use // raw_stages) % 2 ^ 1)
        self.v_full.arrive_expect_tx(raw, self.v_chunks * tma.box_bytes(self.v_map))
        for c in kiln.static_range(self.v_chunks):
            tma.load(self.v_map, self.raw_boxes.tile(raw * self.v_chunks + c),
                     _box_coords(self.config.padded_v, self.kv_head, self.config.dv, c,
                                 self.k_start + j * self.config.block_n, FP8_CHUNK_COLS),
                     self.v_full, raw)


class _Fp8Operands(_Operands):
    """:class:`.prefill_hopper._Operands` with 128-column FP8 boxes; ``v`` addresses V^T."""

    def stage_offset(self, stage, width):
        return kiln.cast(stage * (width // FP8_CHUNK_COLS) * self.box_units, kiln.i64)


def _flat_b16(tiles, nbytes):
    """A ring's bytes as one ``[rows, 64]`` b16 SharedTile (no swizzle: callers address the
    TMA swizzle themselves), for ``ldmatrix`` / ``stmatrix``."""
    half = ROW_BYTES // 2
    return SharedTile.view(tiles.reinterpret((nbytes // 2,), kiln.bf16), (nbytes // ROW_BYTES,
                                                                          half))


def _issue_pv(ops: _Fp8Operands, acc, probs, stage):
    """Issue ``O += P V`` on V^T stage ``stage`` as one WGMMA group: P's e4m3 A operands
    (one per 32 keys) from registers, V^T K-major (each k32 step moves 32 bytes along its
    128-byte rows of keys, every 4 steps the next 128-key box)."""
    box = ops.config.v_width * ROW_BYTES // DESCRIPTOR_UNIT
    base = ops.v + kiln.cast(stage * vt_boxes(ops.block_n) * box, kiln.i64)
    wgmma.fence()  # orders O's rescale and P's registers before the asynchronous reads
    for ks in range(ops.block_n // FP8_K_STEP):
        acc = wgmma.mma_async(acc, probs.fragment(0, ks),
                              base + (ks // 4) * box + (ks % 4) * FP8_K_STEP // 16,
                              dtype=ops.dtype)
    wgmma.commit()
    return acc


@kiln.func
def _transpose_v(raw_flat, vt_flat, raw_box, stage, tid, v_width, block_n, batch=1):
    """``Vt[stage][d, k] = V[key(k), d]`` for one ``block_n``-key tile, by the producer's four
    warps, 512 bytes per warp instruction pair (``ldmatrix.x4`` in, ``stmatrix.x4.trans`` out).

    A unit is 16 keys (one 16-byte group of a ``Vt`` row) x 32 head-dim columns. Its x4 load
    reads four 8-row b16 blocks of raw V: rows ``A`` and ``B`` of key pairs ``(a(i), a(i) + 1)``
    with ``a(i) = 2 (i // 2) + 8 (i % 2)`` (pair ``i`` is logical keys ``2i, 2i+1``,
    ``wgmma.FP8_A_K_ORDER``), for two 16-column chunks. Row ``i`` of block ``A`` holds key
    ``a(i) + i % 2``, of ``B`` the other one, so each block's eight rows fall in eight
    different 16-byte columns of the swizzle (no bank conflict). A lane then holds four bytes
    (columns ``4t .. 4t+3``) of both keys of its pair ``i``; two ``prmt`` make b16 elements
    ``(V[a][d], V[a+1][d])`` for columns ``4t, 4t+1`` and ``4t+2, 4t+3``, and the transposing
    store writes each block's column ``d`` as a row of ``Vt``: the pairs of keys in logical
    order. Warp ``w`` takes column chunks ``2w, 2w+1`` (+8 per further 128 columns) and walks
    the key groups, so every address is a lane constant plus an immediate (the ``Vt`` swizzle:
    one XOR). ``batch`` units' loads are issued before their stores (ptxas keeps a load
    behind an earlier store, so one at a time each waits out the load's latency)."""
    warp, lane = tid // 32, tid % 32
    block, i = lane // 8, lane % 8  # the block and row this lane addresses
    high = block % 2  # block B
    key = 2 * (i // 2) + 8 * (i % 2) + (high ^ (i % 2))
    chunk = 2 * warp + block // 2
    half = ROW_BYTES // 2  # b16 elements per 128-byte row
    load_base = raw_box * (block_n * half) + key * half + (chunk ^ (i ^ high)) * 8
    d = 32 * warp + 16 * (block // 2) + 4 * (i // 2) + i % 2 + 2 * high
    store_base = stage * (vt_boxes(block_n) * v_width * half) + d * half + (d % 8) * 8
    odd = (lane // 4) % 2 == 1  # this lane's pair i is odd: its low key sits in block B
    units = [(q, group) for q in range(v_width // FP8_CHUNK_COLS)
             for group in range(block_n // 16)]
    for first in range(0, len(units), batch):  # loads first: no load waits behind a store
        loaded = [_words(kiln.ldmatrix.ldmatrix(
            raw_flat, None, _X4, offset=load_base + q * (block_n * half) + group * 16 * half))
            for q, group in units[first:first + batch]]
        for (q, group), words in zip(units[first:first + batch], loaded):
            out = []
            for c in (0, 2):  # the two column chunks
                lo = kiln.where(odd, words[c + 1], words[c])
                hi = kiln.where(odd, words[c], words[c + 1])
                out += [_shuffle(_bytes(lo), _bytes(hi), order)
                        for order in ((0, 4, 1, 5), (2, 6, 3, 7))]
            kiln.ldmatrix.stmatrix(vt_flat, None, _X4, _halves(out), trans=True,
                                   offset=(store_base ^ (8 * (group % 8))) + q * FP8_CHUNK_COLS
                                   * half + group // 8 * (v_width * half))

_X4 = ((0, 0),) * 4  # four blocks: ldmatrix / stmatrix take this lane's row offset directly


def _words(value):
    """A ``vector<8 x bf16>`` as its four i32 registers."""
    words = vector.bitcast(ir.VectorType.get([4], ir.IntegerType.get_signless(32)), value.ir)
    return [kiln.Value(vector.extract(words, [], [n])) for n in range(4)]


def _bytes(word):
    """An i32 register as ``vector<4 x i8>`` (what ``_shuffle`` permutes)."""
    return kiln.Value(vector.bitcast(ir.VectorType.get([4], ir.IntegerType.get_signless(8)),
                                     vector.broadcast(ir.VectorType.get(
                                         [1], ir.IntegerType.get_signless(32)), word.ir)))


def _halves(parts):
    """Four ``vector<4 x i8>`` as one ``vector<8 x bf16>`` (stmatrix's four registers)."""
    joined = vector.shuffle(vector.shuffle(parts[0].ir, parts[1].ir, list(range(8))),
                            vector.shuffle(parts[2].ir, parts[3].ir, list(range(8))),
                            list(range(16)))
    return kiln.Value(vector.bitcast(ir.VectorType.get([8], ir.BF16Type.get()), joined),
                      kiln.bf16)


def _shuffle(a, b, order):
    return kiln.Value(vector.shuffle(a.ir, b.ir, list(order)), a.dtype)
