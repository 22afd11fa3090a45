"""Grouped (MoE) GEMM on Hopper: one persistent launch over the tiles of every group.

``C[offs[g]:offs[g+1]] = A[offs[g]:offs[g+1]] @ B[g]`` for ``g < G``: ``A`` holds the rows of
all groups back to back (``[total_M, K]``), ``B`` one ``K x N`` matrix per group (``[G, K, N]``,
or ``[G, N, K]`` with ``trans_b``), ``group_offsets`` the ``G + 1`` row boundaries. The main loop
is the Hopper GEMM's (:mod:`.hopper`: TMA ring, warp-specialised producer, two WGMMA consumer
warp groups, 128B-swizzled operands); what differs is which tile a CTA works on and how its
rows are stored.

| phase | who | what |
| --- | --- | --- |
| tile table | all threads, then thread 0 | thread ``i`` reads ``offs[i], offs[i+1]`` and writes group ``i``'s tile count ``ceil(M_i / BM) * ceil(N / BN)`` to a shared table (``TABLE`` entries, a power of two above ``G``; the rest a sentinel); thread 0 turns the counts into first-tile indices (an exclusive prefix sum); no host round trip, so device ``group_offsets`` need no synchronisation |
| tile walk | every warp group | global tiles ``t = cta, cta + grid, ...`` up to the total; ``t``'s group is the last table entry ``<= t`` (a binary search of ``log2(TABLE)`` shared loads); within the group the tiles are swept column by column, ``GROUP_M`` row tiles at a time (:func:`.hopper._tile_origin`) |
| producer | warp group 0, one thread | A box at row ``offs[g] + m``: its last tile reads rows of the next group, which only reach output rows that are not stored; B box at row ``g * b_rows`` of B viewed as ``[G * rows, cols]`` |
| consumers | warp groups 1 (, 2) | WGMMA as in :mod:`.hopper`, except that a consumer whose 64 rows all lie past its group's end (in the group's last tile, with 128-row tiles) only waits for each stage and releases it; the default 64 x 256 tiles (:func:`grouped_config`) pad a group to 64 rows with no idle consumer; the epilogue stages 64-row slices in swizzled shared tiles, and a slice that lies inside its group (or runs past ``total_M``, which TMA clips) leaves by TMA store, the group's last, partial slice by masked 16-byte stores of the rows ``< offs[g+1]`` |

B's K edge: with B MN-major (``[G, K, N]``) a box past row ``K`` of group ``g`` would read group
``g + 1``'s rows (A's columns there are zero, but ``0 * inf`` is NaN), so the entry point pads
K to a multiple of ``BK`` for B in that case. Unchecked device offsets that are not monotone or
exceed ``total_M`` give meaningless rows but never a write outside ``C``: tile counts are
clamped at zero, TMA clips its stores, and the masked stores check ``0 <= row < total_M``.
"""

import functools

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared

from .hopper import (K_STEP, ROW_BYTES, SWIZZLE, SWIZZLE_ALIGN, WARP_GROUP_THREADS,
                     HopperGemmConfig, _tile_origin, pass_turn, take_turn)

MAX_GROUPS = 1024
MIN_TABLE = 64  # fewer table sizes, fewer specialisations
SENTINEL = 1 << 30  # table entries past G: above every tile index
UNIT_BYTES = 16  # one swizzle unit: what a masked store writes at a time
CLAIM_SLOTS = 4  # claimed tiles in flight from the producer to the consumers (dynamic)


def table_size(groups: int) -> int:
    """Entries of the shared tile table for ``groups`` groups: a power of two > ``groups``."""
    size = MIN_TABLE
    while size <= groups:
        size *= 2
    return size


def grouped_config(groups: int) -> HopperGemmConfig:
    """The tile configuration for ``groups`` groups: 64 x 256 tiles, 4 stages, or 3 when the
    tile table (4 bytes an entry) would not fit beside 4 and an f32 epilogue. Measured on an
    H200 at 32768 router-sized rows (``bench/gemm_grouped_probe.py``), they beat the dense
    default's 128 x 256 by 12 to 49 % (G = 8, 64): a group's last 128-row tile often holds 64
    rows or fewer, and one consumer warp group alone takes about as long as two on a full
    tile. Row tiles are swept 16 at a time (32 above 16 groups) so that each 256-column block
    of a group's B is read from HBM about once (``bench/gemm_grouped_ab.py``, one H200 run, vs
    8 at a time: G = 64 658 vs 632 TFLOP/s, G = 8 745 vs 639)."""
    return HopperGemmConfig(block_m=64, block_n=256, stages=4 if table_size(groups) <= 256
                            else 3, group_m=16 if groups <= 16 else 32)


def grouped_constexprs(cfg: HopperGemmConfig, groups: int, dynamic: bool = False) -> dict:
    """The constexpr arguments of :func:`make_grouped_kernel`'s kernel for ``groups`` (with
    ``counters`` None unless ``dynamic``)."""
    return dict({} if dynamic else {"counters": None}, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages,
                GROUP_M=cfg.group_m, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers, TABLE=table_size(groups))


@functools.lru_cache(maxsize=None)
def make_grouped_kernel(dtype: str, out_dtype: str, b_major: str, config: HopperGemmConfig,
                        dynamic: bool = False):
    """The ``@kiln.kernel`` of the grouped GEMM (single CTAs: ``config.cluster_m`` must be 1).
    ``dynamic``: CTAs claim tiles from a global counter (:func:`claim_tile`) instead of
    striding over them, so the tiles running at once stay a window of consecutive tiles
    (which share B in L2) however unequal the tiles' costs.

    Run-time parameters: ``a_map`` (A ``[total_M, K]``, box BM x BK), ``b_map`` (B viewed as
    ``[G * b_rows, cols]``), ``c_map`` (C, box 64 x 128 bytes), ``c`` (C again, for the masked
    stores), ``offsets`` (i32 ``[G + 1]``), ``groups``, ``m`` (total_M), ``n``, ``k``,
    ``b_rows`` (rows of one group's B in that view: padded K for "mn", padded N for "k"),
    with ``dynamic`` also ``counters`` (i32 ``[2]``, zero before the launch and after it).
    """
    if config.cluster_m != 1:
        raise kiln.UnsupportedError("the grouped GEMM runs single CTAs",
                                    fix="use a HopperGemmConfig with cluster_m=1")
    if config.pingpong and dynamic:
        raise kiln.UnsupportedError("dynamic tile claims do not take turns between consumers",
                                    fix="use pingpong=False with dynamic=True")
    pingpong = config.pingpong
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    b_box = (bk, 64) if b_major == "mn" else (bn, bk)
    chunks = bn // 64 if b_major == "mn" else 1
    b_leading = bk * ROW_BYTES if b_major == "mn" else 16
    b_k_step = K_STEP * ROW_BYTES if b_major == "mn" else K_STEP * in_type.itemsize
    c_cols = ROW_BYTES // out_type.itemsize
    epilogue_n = config.epilogue_columns(out_type.itemsize)
    c_tiles_per_round = epilogue_n // c_cols
    threads = WARP_GROUP_THREADS * (config.consumers + 1)
    counters_type = kiln.Tensor[kiln.i32, 1] if dynamic else kiln.constexpr

    def b_coords(k0, n0, row0):  # TMA coordinates, innermost first
        return (n0, row0 + k0) if b_major == "mn" else (k0, row0 + n0)

    def grouped_gemm(a_map: kiln.TensorMap[in_type, (bm, bk), SWIZZLE],
                     b_map: kiln.TensorMap[in_type, b_box, SWIZZLE],
                     c_map: kiln.TensorMap[out_type, (64, c_cols), SWIZZLE],
                     c: kiln.Tensor[out_type, 2], offsets: kiln.Tensor[kiln.i32, 1],
                     groups: kiln.i32, m: kiln.i32, n: kiln.i32, k: kiln.i32, b_rows: kiln.i32,
                     counters: counters_type, BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
                     STAGES: kiln.constexpr, GROUP_M: kiln.constexpr,
                     PRODUCER_REGS: kiln.constexpr, CONSUMER_REGS: kiln.constexpr,
                     TABLE: kiln.constexpr):
        a_tiles = dynamic_shared((STAGES, BM, BK), in_type, align=SWIZZLE_ALIGN)
        b_tiles = dynamic_shared((STAGES * chunks,) + b_box, in_type, align=SWIZZLE_ALIGN)
        c_tiles = dynamic_shared((config.consumers * c_tiles_per_round, 64, c_cols), out_type,
                                 align=SWIZZLE_ALIGN)
        table = kiln.shared((TABLE,), kiln.i32)
        full = mbarrier.group(num_barriers=STAGES)
        empty = mbarrier.group(num_barriers=STAGES)
        if dynamic:  # the claimed tiles, passed from the producer to the consumers
            claimed = kiln.shared((CLAIM_SLOTS,), kiln.i32)
            claim_full = mbarrier.group(num_barriers=CLAIM_SLOTS)
            claim_empty = mbarrier.group(num_barriers=CLAIM_SLOTS)
        tid = kiln.thread_id(0)
        warp_group = tid // WARP_GROUP_THREADS
        first_thread = tid % WARP_GROUP_THREADS == 0
        for s in kiln.static_range(STAGES):
            full.init(s, count=1, predicate=tid == 0)
            empty.init(s, count=1 if pingpong else BM // 64, predicate=tid == 0)
        if dynamic:
            for s in kiln.static_range(CLAIM_SLOTS):
                claim_full.init(s, count=1, predicate=tid == 0)
                claim_empty.init(s, count=BM // 64 * WARP_GROUP_THREADS, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        tiles_n = (n + BN - 1) // BN
        build_tile_table(table, offsets, groups, tiles_n, tid, BM, TABLE, threads)
        num_tiles = table[groups]
        k_tiles = (k + BK - 1) // BK
        first_tile = kiln.block_id(0)
        tile_step = kiln.num_blocks(0)
        units = num_tiles
        alive = True
        if dynamic:  # unit i is this CTA's i-th claim: at most every tile, then one past them
            first_tile, tile_step, units = 0, 1, num_tiles + 1
            alive = tid >= 0
        stage_bytes = tma.box_bytes(a_map) + chunks * tma.box_bytes(b_map)
        if warp_group == 0:
            nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
            if tid == 0:
                tma.prefetch_descriptor(a_map)
                tma.prefetch_descriptor(b_map)
                use = 0
                if dynamic:
                    ahead = counters.atomic_add(0, 1)  # the first claim
                for unit in kiln.range(first_tile, units, tile_step):
                    tile = unit
                    if dynamic:
                        alive, tile, ahead = claim_tile(counters, claimed, claim_full,
                                                        claim_empty, unit, ahead, num_tiles,
                                                        alive, CLAIM_SLOTS)
                    if alive:
                        g, m0, n0, row_end = locate_tile(table, offsets, tile, tiles_n, BM, BN,
                                                          GROUP_M, TABLE)
                        for kt in kiln.range(0, k_tiles):
                            stage = use % STAGES
                            empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                            full.arrive_expect_tx(stage, stage_bytes)
                            tma.load(a_map, a_tiles.tile(stage), (kt * BK, m0), full, stage)
                            for j in kiln.static_range(chunks):
                                tma.load(b_map, b_tiles.tile(stage * chunks + j),
                                         b_coords(kt * BK, n0 + 64 * j, g * b_rows), full,
                                         stage)
                            use = use + 1
        else:
            nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
            consumer = warp_group - 1
            a_base = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                           byte_offset=0 if pingpong else
                                           consumer * 64 * ROW_BYTES)
            b_base = wgmma.smem_descriptor(b_tiles.tile(0), leading_bytes=b_leading,
                                           stride_bytes=1024)
            a_stage_units = BM * BK * in_type.itemsize // 16  # descriptor address units
            b_stage_units = BN * BK * in_type.itemsize // 16
            use = 0
            own_first, own_step = first_tile, tile_step
            if pingpong:  # as in .hopper: alternate tiles, k_tiles uses each
                own_first, own_step = first_tile + consumer * tile_step, 2 * tile_step
                use = consumer * k_tiles
            for unit in kiln.range(own_first, units, own_step):
                tile = unit
                if dynamic:
                    alive, tile = receive_tile(claimed, claim_full, claim_empty, unit, alive,
                                               CLAIM_SLOTS)
                if alive:
                    g, m0, n0, row_end = locate_tile(table, offsets, tile, tiles_n, BM, BN,
                                                      GROUP_M, TABLE)
                    if pingpong:
                        take_turn(consumer, unit > first_tile)
                    row0 = m0 + (0 if pingpong else consumer * 64)
                    # In a group's last tile the lower 64 rows may all lie past its end: that
                    # consumer only passes the stages on, leaving the tensor cores to the other.
                    active = row0 < row_end
                    acc = wgmma.fragment_zeros(BN)
                    if active:
                        for kt in kiln.range(0, k_tiles):
                            stage = use % STAGES
                            full.try_wait(stage, (use // STAGES) % 2)
                            stage64 = kiln.cast(stage, kiln.i64)
                            a_desc = a_base + stage64 * a_stage_units
                            b_desc = b_base + stage64 * b_stage_units
                            wgmma.fence()
                            for ks in kiln.static_range(BK // K_STEP):
                                acc = wgmma.mma_async(
                                    acc, a_desc + ks * K_STEP * in_type.itemsize // 16,
                                    b_desc + ks * b_k_step // 16, dtype=in_type,
                                    b_major=b_major)
                            wgmma.commit()
                            wgmma.wait_group(1)
                            if (kt > 0) & first_thread:
                                empty.arrive((use + STAGES - 1) % STAGES)
                            use = use + 1
                        wgmma.wait_group(0)
                        if first_thread & (k_tiles > 0):
                            empty.arrive((use + STAGES - 1) % STAGES)
                        if pingpong:
                            use = use + k_tiles  # the other consumer's tile
                            pass_turn(consumer, unit + tile_step < units)
                        _store_group_tile(acc, c_map, c, c_tiles, consumer, row0, n0,
                                          kiln.minimum(row_end, m), n, first_thread,
                                          BN // epilogue_n, c_tiles_per_round, c_cols)
                    else:
                        use = pass_stages(full, empty, use, k_tiles, STAGES, first_thread)
            if first_thread:
                tma.wait_group(0, read=True)  # the staging tiles must outlive the last store

    grouped_gemm.__name__ = grouped_gemm.__qualname__ = \
        f"hopper_grouped_gemm_{dtype}_{out_dtype}_{b_major}"
    return kiln.kernel(grouped_gemm)


@kiln.func
def build_tile_table(table, offsets, groups, tiles_n, tid, BM, TABLE, THREADS):
    """``table[g]`` = index of group ``g``'s first tile for ``g <= groups`` (``table[groups]``
    is the total), ``SENTINEL`` past it. Every thread of the CTA calls it; it ends in a
    barrier, after which the table is read-only."""
    for i in kiln.range(tid, TABLE, THREADS):
        rows = offsets.load(i + 1, mask=i < groups, other=0) - \
            offsets.load(i, mask=i < groups, other=0)
        count = kiln.maximum(rows + BM - 1, 0) // BM * tiles_n
        table[i] = kiln.where(i > groups, SENTINEL, count)
    kiln.barrier()
    if tid == 0:
        start = 0
        for i in kiln.range(0, groups + 1):
            tiles = table[i]
            table[i] = start
            start = start + tiles
    kiln.barrier()


@kiln.func
def claim_tile(counters, claimed, claim_full, claim_empty, unit, ahead, num_tiles, alive,
               SLOTS):
    """Producer thread, claim ``unit``: pass the tile claimed ``ahead`` (-1 once the tiles are
    gone) to the consumers through slot ``unit % SLOTS``, and claim the next one while this
    one loads. Returns ``(alive, tile, ahead)``. A CTA's claim past the last tile is its last;
    the CTA that counts the grid's last such claim zeroes the counters for the next launch
    (every claim of this launch has been made by then)."""
    tile = ahead
    if alive:
        slot = unit % SLOTS
        claim_empty.try_wait(slot, (unit // SLOTS) % 2 ^ 1)
        valid = ahead < num_tiles
        claimed[slot] = kiln.where(valid, ahead, -1)
        # (through the cluster form, rank 0 = this CTA: a plain arrive would read, to the
        # mbarrier ring checks, as a release of an empty ring; this ring has no TMA fill)
        claim_full.arrive_cluster(slot, 0)
        if valid:
            ahead = counters.atomic_add(0, 1)
        else:
            if counters.atomic_add(1, 1) == kiln.num_blocks(0) - 1:
                counters.atomic_exchange(0, 0)
                counters.atomic_exchange(1, 0)
        alive = valid
    return alive, tile, ahead


@kiln.func
def receive_tile(claimed, claim_full, claim_empty, unit, alive, SLOTS):
    """Consumer thread, claim ``unit``: the tile the producer passed (``alive`` False from the
    first -1 on, after which the loop idles). Returns ``(alive, tile)``."""
    tile = unit * 0 - 1
    if alive:
        slot = unit % SLOTS
        claim_full.try_wait(slot, (unit // SLOTS) % 2)
        tile = claimed[slot]
        claim_empty.arrive(slot)
    return tile >= 0, tile


@kiln.func
def locate_tile(table, offsets, tile, tiles_n, BM, BN, GROUP_M, TABLE):
    """(group, first row in A/C, first column, the group's end row) of global tile ``tile``:
    the group is the last table entry ``<= tile`` (empty groups share their start with the
    next group, so the search passes over them)."""
    g = tile * 0
    for level in kiln.static_range(TABLE.bit_length() - 1):
        probe = g + (TABLE >> (level + 1))
        g = kiln.where(table[probe] <= tile, probe, g)
    row_start = offsets[g]
    row_end = offsets[g + 1]
    tiles_m = (row_end - row_start + BM - 1) // BM
    m_local, n0 = _tile_origin(tile - table[g], tiles_m, tiles_n, BM, BN, GROUP_M)
    return g, row_start + m_local, n0, row_end


@kiln.func
def pass_stages(full, empty, use, k_tiles, stages, first_thread):
    """A consumer with no rows in its tile hands the tile's ``k_tiles`` ring stages back
    unread (the producer fills them all); returns ``use`` past them."""
    for kt in kiln.range(0, k_tiles):
        stage = use % stages
        full.try_wait(stage, (use // stages) % 2)
        if first_thread:
            empty.arrive(stage)
        use = use + 1
    return use


@kiln.func
def _store_group_tile(acc, c_map, c, c_tiles, consumer, row0, col0, row_end, n, first_thread,
                      rounds, tiles_per_round, tile_cols, slot=None):
    """Epilogue of one consumer's 64 rows: stage ``acc`` in swizzled shared tiles as
    :func:`.epilogue.store_tile` does; rows that all lie before ``row_end`` (the group's end,
    capped at total_M) leave by TMA store (which clips C's edges), a slice that straddles
    ``row_end`` by masked 16-byte stores of its rows before it. The consumer's staging tiles
    start at ``slot`` (default ``consumer * tiles_per_round``)."""
    columns = tiles_per_round * tile_cols
    whole = row0 + 64 <= row_end
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    row = lane // 2  # two threads per staged row, four 16-byte units each
    unit = UNIT_BYTES // c.dtype.itemsize  # elements of one swizzle unit
    in_rows = (row0 + row < row_end) & (row0 + row >= 0)
    for r in kiln.static_range(rounds):
        if first_thread:
            tma.wait_group(0, read=True)
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
        wgmma.store_fragment_swizzled(acc, c_tiles, _first_slot(slot, consumer, tiles_per_round),
                                      columns=(r * columns, (r + 1) * columns))
        nvidia_asm.fence_proxy_async()  # generic-proxy writes before the async-proxy TMA read
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
        if whole:
            if first_thread:
                for j in kiln.static_range(tiles_per_round):
                    tma.store(c_tiles.tile(_first_slot(slot, consumer, tiles_per_round) + j),
                              c_map,
                              (col0 + r * columns + j * tile_cols, row0))
                tma.commit_group()
        else:
            for j in kiln.static_range(tiles_per_round):
                staged = c_tiles.tile(_first_slot(slot, consumer, tiles_per_round) + j)
                for q in kiln.static_range(ROW_BYTES // UNIT_BYTES // 2):
                    u = (lane % 2) * (ROW_BYTES // UNIT_BYTES // 2) + q
                    col = col0 + r * columns + j * tile_cols + u * unit
                    values = staged.load(row, (u ^ (row % 8)) * unit, width=unit,
                                         align=UNIT_BYTES)
                    if in_rows & (col < n):
                        c.store(row0 + row, col, values, align=UNIT_BYTES)


def _first_slot(slot, consumer, tiles_per_round):
    """A consumer's first staging tile: ``slot``, or its own ``consumer * tiles_per_round``
    (computed where it is used, so the kernels' instruction order stays as it was)."""
    return consumer * tiles_per_round if slot is None else slot
