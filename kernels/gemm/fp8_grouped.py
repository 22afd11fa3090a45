"""Grouped (MoE) FP8 GEMM on Hopper: the grouped walk of :mod:`.grouped` with the FP8 main loop
and scales of :mod:`.fp8_hopper`.

``C[o[g]:o[g+1]] = (A[o[g]:o[g+1]] * sa) @ (B[g] * sb[g])^T``: A ``[total_M, K]`` FP8, B
``[G, N, K]`` FP8 (K-major, ``trans_b=True``), f32 accumulation, bf16/f32 C. The tile table,
the tile walk, the inactive-consumer rule and the masked epilogue of the group's last 64-row
slice are :mod:`.grouped`'s; the K loop is :mod:`.fp8_hopper`'s (``BK = 128``, four
``wgmma.m64nNk32`` per stage). With ``Fp8GemmConfig(split_n=True)`` at ``block_m=64`` both
consumers share every tile's 64 rows, half its columns each, so a group pads to 64 rows instead
of 128; at ``block_m=128`` (the default) only a group's last tile of at most 64 rows is split
that way, so no consumer idles on it. With block scales each consumer's columns lie in one
128-column B scale block. Scales as the kernel sees them (the entry point,
:func:`.grouped_api.grouped_matmul`, normalises the user's forms to these):

| ``scale_mode`` | ``scale_a`` | ``scale_b`` | applied |
| --- | --- | --- | --- |
| ``(tensor or row, tensor or col)`` | ``[1]`` or ``[total_M]`` | ``[G, 1]`` (one per expert) or ``[G, N]`` | promoted per 128-K step (``total += acc``), scaled in the epilogue: ``total * sa[r] * sb[g, c]`` |
| ``(block, block)`` | ``[total_M, ceil(K/128)]`` | ``[G * ceil(N/128), ceil(K/128)]`` | per 128-K step, promoted into an f32 register total |
"""

import functools

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared

from .fp8_hopper import (FP8_K_STEP, SCALE_BLOCK, Fp8GemmConfig, block_scales, promote,
                         rescale, thread_columns, thread_rows)
from .grouped import _store_group_tile, build_tile_table, locate_tile, pass_stages
from .hopper import ROW_BYTES, SWIZZLE, SWIZZLE_ALIGN, WARP_GROUP_THREADS


# 128 x 128 tiles for every scale kind (one B scale block per tile with block scales; the
# promoted total doubles the accumulator registers), five stages beside the tile table; a
# group's last tile of <= 64 rows split by columns between the consumers (split_n). H200, 64
# router-sized groups, 4096 x 4096 experts, per tensor, against the dense FP8 GEMM in the same
# rounds: 0.765 (without split_n 0.704; 64 x 256 split_n tiles 0.757 / 0.770 at group_m 16 / 32);
# 4096 x 14336 experts: 0.754 vs 0.685 (block scales 0.777 vs 0.710), 8 groups 0.856 vs 0.753.
GROUPED_FP8_CONFIG = Fp8GemmConfig(block_n=128, stages=5, split_n=True)


def grouped_fp8_constexprs(cfg: Fp8GemmConfig, table: int) -> dict:
    return dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages,
                GROUP_M=cfg.group_m, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers, TABLE=table)


def scale_group_accumulator(acc, scale_a, scale_b, g, row0, col0, m, n, a_mode, b_mode):
    """``acc * sa[r] * sb[g, c]`` for one consumer's 64 x BN accumulator (clamped indices:
    rows past ``m`` and columns past ``n`` are never stored)."""
    top, bottom = thread_rows(row0)
    rows = [scale_a[kiln.minimum(r, m - 1)] for r in (top, bottom)] if a_mode == "row" \
        else [scale_a[0]] * 2
    if b_mode == "tensor":
        sb = scale_b[g, 0]
        return rescale(acc, [r * sb for r in rows])
    return rescale(acc, rows, [scale_b[g, kiln.minimum(c, n - 1)]
                               for c in thread_columns(col0, acc.shape[1])])


@functools.lru_cache(maxsize=None)
def make_grouped_fp8_kernel(dtype: str, out_dtype: str, scale_mode: tuple,
                            config: Fp8GemmConfig):
    """The ``@kiln.kernel``: run-time parameters ``a_map`` (box BM x BK), ``b_map`` (B viewed as
    ``[G * Np, Kp]``, box BN x BK), ``c_map``, ``c``, ``offsets`` (i32 ``[G + 1]``),
    ``scale_a``, ``scale_b`` (see the module table), ``groups``, ``m`` (total_M), ``n`` (Np),
    ``k`` (Kp), ``b_rows`` (Np)."""
    a_mode, b_mode = scale_mode
    block = a_mode == "block"
    # split_n: at block_m=64 both consumers share every tile's rows; at 128 only a group's
    # tail tiles of at most 64 rows (split_tail), the rest split by rows as usual.
    split = config.split_n and config.block_m == 64
    split_tail = config.split_n and config.block_m == 128
    # A consumer's columns: all of the tile's, or half of them (split: both share its rows).
    cons_n = config.block_n // 2 if split else config.block_n
    if block and not (cons_n == SCALE_BLOCK or split and cons_n == SCALE_BLOCK // 2):
        raise kiln.UnsupportedError(f"grouped block-scaled FP8 gives each consumer one B scale "
                                    f"block's columns, not {cons_n} (block_n="
                                    f"{config.block_n}, split_n={split})",
                                    fix="use Fp8GemmConfig(block_n=128), or block_m=64, "
                                        "block_n=256, split_n=True, with block scales")
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    c_cols = ROW_BYTES // out_type.itemsize
    # split_n: the tile's 64 rows x epilogue columns are staged as each consumer's half
    epilogue_n = config.epilogue_columns(out_type.itemsize) // (2 if split else 1)
    c_tiles_per_round = epilogue_n // c_cols
    threads = WARP_GROUP_THREADS * (config.consumers + 1)
    step_units = FP8_K_STEP // 16

    def make_steps(width: int, rounds: int, tiles_per_round: int, slot_stride=None):
        """The K loop and epilogue of one consumer's ``64 x width`` slice of a tile (a
        ``kiln.func``); ``slot_stride``: its staging tiles start at ``consumer * slot_stride``
        (a tail's narrower slices stay in the consumer's own staging tiles)."""
        @kiln.func
        def steps(a_base, b_base, full, empty, c_map, c, c_tiles, scale_a, scale_b, where, use,
                  first_thread, consumer):
            g, row0, col0, row_end, m, n, n_blocks, k_tiles = where
            acc = wgmma.fragment_zeros(width)
            total = wgmma.fragment_zeros(width)
            if block:
                top, bottom = thread_rows(row0)
                top, bottom = kiln.minimum(top, m - 1), kiln.minimum(bottom, m - 1)
                b_row = g * n_blocks + col0 // SCALE_BLOCK
                ahead = block_scales(scale_a, scale_b, top, bottom, b_row, 0)
            for kt in kiln.range(0, k_tiles):
                stage = use % config.stages
                full.try_wait(stage, (use // config.stages) % 2)
                stage64 = kiln.cast(stage, kiln.i64)
                a_desc = a_base + stage64 * (bm * bk // 16)
                b_desc = b_base + stage64 * (bn * bk // 16)
                wgmma.fence()
                for ks in kiln.static_range(bk // FP8_K_STEP):
                    acc = wgmma.mma_async(acc, a_desc + ks * step_units,
                                          b_desc + ks * step_units, dtype=in_type,
                                          accumulate=ks > 0)
                wgmma.commit()
                if block:
                    # Load the next block's scales while these WGMMAs run.
                    current = ahead
                    ahead = block_scales(scale_a, scale_b, top, bottom, b_row,
                                         kiln.minimum(kt + 1, k_tiles - 1))
                wgmma.wait_group(0)
                if first_thread:
                    empty.arrive(stage, wgmma_pending=0)
                total = promote(total, acc, current) if block else promote(total, acc)
                use = use + 1
            out = total if block else scale_group_accumulator(
                total, scale_a, scale_b, g, row0, col0, m, n, a_mode, b_mode)
            _store_group_tile(out, c_map, c, c_tiles, consumer, row0, col0,
                              kiln.minimum(row_end, m), n, first_thread, rounds,
                              tiles_per_round, c_cols,
                              None if slot_stride is None else consumer * slot_stride)
            return use
        return steps

    tile_steps = make_steps(cons_n, cons_n // epilogue_n, c_tiles_per_round)
    tail_n = bn // 2  # split_tail: each consumer's columns of a tail tile
    tail_steps = make_steps(tail_n, 1, tail_n // c_cols, c_tiles_per_round) if split_tail \
        else None

    def grouped_gemm_fp8(a_map: kiln.TensorMap[in_type, (bm, bk), SWIZZLE],
                         b_map: kiln.TensorMap[in_type, (bn, bk), SWIZZLE],
                         c_map: kiln.TensorMap[out_type, (64, c_cols), SWIZZLE],
                         c: kiln.Tensor[out_type, 2], offsets: kiln.Tensor[kiln.i32, 1],
                         scale_a: kiln.Tensor[kiln.f32, 2 if block else 1],
                         scale_b: kiln.Tensor[kiln.f32, 2],
                         groups: kiln.i32, m: kiln.i32, n: kiln.i32, k: kiln.i32,
                         b_rows: kiln.i32, BM: kiln.constexpr, BN: kiln.constexpr,
                         BK: kiln.constexpr, STAGES: kiln.constexpr, GROUP_M: kiln.constexpr,
                         PRODUCER_REGS: kiln.constexpr, CONSUMER_REGS: kiln.constexpr,
                         TABLE: kiln.constexpr):
        a_tiles = dynamic_shared((STAGES, BM, BK), in_type, align=SWIZZLE_ALIGN)
        b_tiles = dynamic_shared((STAGES, BN, BK), in_type, align=SWIZZLE_ALIGN)
        c_tiles = dynamic_shared((config.consumers * c_tiles_per_round, 64, c_cols), out_type,
                                 align=SWIZZLE_ALIGN)
        table = kiln.shared((TABLE,), kiln.i32)
        full = mbarrier.group(num_barriers=STAGES)
        empty = mbarrier.group(num_barriers=STAGES)
        tid = kiln.thread_id(0)
        warp_group = tid // WARP_GROUP_THREADS
        first_thread = tid % WARP_GROUP_THREADS == 0
        for s in kiln.static_range(STAGES):
            full.init(s, count=1, predicate=tid == 0)
            empty.init(s, count=config.consumers, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        tiles_n = (n + BN - 1) // BN
        build_tile_table(table, offsets, groups, tiles_n, tid, BM, TABLE, threads)
        num_tiles = table[groups]
        k_tiles = (k + BK - 1) // BK
        n_blocks = (n + SCALE_BLOCK - 1) // SCALE_BLOCK
        stage_bytes = tma.box_bytes(a_map) + tma.box_bytes(b_map)
        if warp_group == 0:
            nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
            if tid == 0:
                tma.prefetch_descriptor(a_map)
                tma.prefetch_descriptor(b_map)
                use = 0
                for tile in kiln.range(kiln.block_id(0), num_tiles, kiln.num_blocks(0)):
                    g, m0, n0, row_end = locate_tile(table, offsets, tile, tiles_n, BM, BN,
                                                      GROUP_M, TABLE)
                    for kt in kiln.range(0, k_tiles):
                        stage = use % STAGES
                        empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                        full.arrive_expect_tx(stage, stage_bytes)
                        tma.load(a_map, a_tiles.tile(stage), (kt * BK, m0), full, stage)
                        tma.load(b_map, b_tiles.tile(stage), (kt * BK, g * b_rows + n0), full,
                                 stage)
                        use = use + 1
        else:
            nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
            consumer = warp_group - 1
            a_base = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                           byte_offset=0 if split else
                                           consumer * 64 * ROW_BYTES)
            b_base = wgmma.smem_descriptor(b_tiles.tile(0), leading_bytes=16, stride_bytes=1024)
            if split:  # this consumer's rows of the K-major B tile (whole 8-row swizzle atoms)
                b_base = b_base + kiln.cast(consumer, kiln.i64) * (cons_n * bk // 16)
            a_tail, b_tail = a_base, b_base
            if split_tail:  # the tile's first 64 rows of A, the consumer's half of B
                a_tail = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16,
                                               stride_bytes=1024)
                b_tail = b_base + kiln.cast(consumer, kiln.i64) * (tail_n * bk // 16)
            use = 0
            for tile in kiln.range(kiln.block_id(0), num_tiles, kiln.num_blocks(0)):
                g, m0, n0, row_end = locate_tile(table, offsets, tile, tiles_n, BM, BN,
                                                  GROUP_M, TABLE)
                row0, col0 = m0 + consumer * 64, n0
                if split:
                    row0, col0 = m0, n0 + consumer * cons_n
                where = (g, row0, col0, row_end, m, n, n_blocks, k_tiles)
                if split_tail:  # a tail of <= 64 rows: both consumers on it, half the columns
                    if row_end - m0 <= 64:
                        use = tail_steps(a_tail, b_tail, full, empty, c_map, c, c_tiles,
                                         scale_a, scale_b, (g, m0, n0 + consumer * tail_n)
                                         + where[3:], use, first_thread, consumer)
                    else:
                        use = tile_steps(a_base, b_base, full, empty, c_map, c, c_tiles,
                                         scale_a, scale_b, where, use, first_thread, consumer)
                else:
                    # A consumer whose 64 rows all lie past its group's end passes stages on.
                    if row0 < row_end:
                        use = tile_steps(a_base, b_base, full, empty, c_map, c, c_tiles,
                                         scale_a, scale_b, where, use, first_thread, consumer)
                    else:
                        use = pass_stages(full, empty, use, k_tiles, STAGES, first_thread)
            if first_thread:
                tma.wait_group(0, read=True)  # the staging tiles must outlive the last store

    grouped_gemm_fp8.__name__ = grouped_gemm_fp8.__qualname__ = \
        f"hopper_grouped_gemm_{dtype}_{out_dtype}_{a_mode}_{b_mode}"
    return kiln.kernel(grouped_gemm_fp8)
