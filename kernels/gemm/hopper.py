"""Hopper GEMM: TMA + WGMMA, multi-stage mbarrier ring, warp-specialised, persistent grid.

``C[M, N] = A[M, K] @ B`` with bf16/f16 inputs, f32 accumulation and a bf16/f16/f32 output.
B is ``K x N`` row-major (``b_major="mn"``) or, for ``trans_b``, ``N x K`` (``b_major="k"``).

Schedule (one CTA per SM, 3 warp groups, ``BM x BN x BK`` = 128 x 256 x 64 by default):

| warp group | registers (setmaxnreg) | job |
| --- | --- | --- |
| 0 producer | 40 | one thread: for each tile and K step, wait ``empty[s]``, expect the stage's bytes on ``full[s]``, TMA-load the A box and the B box(es) into stage ``s`` |
| 1, 2 consumers | 232 | rows ``64*(g-1) .. +64`` of the tile: wait ``full[s]``, 4 ``wgmma.m64n256k16`` on stage ``s``, keep one WGMMA group in flight, release the previous stage on ``empty``; at the end of the tile stage the 64 x 256 accumulator in 128B-swizzled shared tiles and TMA-store it (asynchronously, overlapping the next tile; TMA clips the matrix edges) |

With ``cluster_m=2`` CTAs run in pairs (a 2-CTA cluster) on vertically adjacent tiles that share
B: each producer loads its own A box and half of B's boxes (chunk ``j`` from CTA ``j % 2``) with
TMA multicast to both CTAs, and still expects the whole stage's bytes on its own ``full[s]``.
Both CTAs' consumers release a stage on the ``empty[s]`` of both CTAs (``mapa`` + remote
``mbarrier.arrive``, count ``consumers * 2``), so neither producer overwrites a stage its peer
still reads; a cluster barrier follows the mbarrier init and precedes exit. The persistent grid
is the number of co-resident clusters (``cuOccupancyMaxActiveClusters``). The CPU interpreter
runs clusters too (``tests/test_interpret_cluster.py``); ``matmul(..., backend="interpret")``
uses the single-CTA default config.

Stage ``s`` of use ``n`` is ``n % STAGES`` and its barriers complete phases of parity
``(n // STAGES) % 2``; the producer waits ``empty`` on the opposite parity, so its first pass
over the ring does not block. Tiles are visited in grouped order (``GROUP_M`` row tiles per
column sweep) so consecutive CTAs share A and B tiles in L2. K edges need no masking: TMA fills
out-of-bounds elements of a box with zeros. ``kiln.kernels.gemm`` pads K and N to multiples of
8 (TMA needs 16-byte row strides) and autotunes among a few configs (128 x 192 tiles fill the
last wave of 132 SMs better at N = 8192; 64-row tiles suit short K).
"""

import functools
from dataclasses import dataclass

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared  # kiln.dynamic_shared once exported

from . import streamk
from .epilogue import WARP_GROUP_THREADS, finish_fused, store_tile, store_transposed

SWIZZLE = 128  # bytes: one 64-element row of bf16/f16, the layout WGMMA reads conflict-free
SWIZZLE_ALIGN = 1024  # 128B-swizzled tiles start on a 1024-byte boundary
K_STEP = 16  # K of one wgmma.m64nNk16
ROW_BYTES = 128  # one swizzled row: 64 elements of a 2-byte dtype
SUPPORTED_DTYPES = ("bf16", "f16")
OUT_DTYPES = ("bf16", "f16", "f32")
# H100's 227 KB of shared memory per block, less the dynamic region's alignment slack and
# the mbarriers.
SHARED_BUDGET = 227 * 1024 - 1024 - 256
MAX_SPLIT_K = 16
PINGPONG_BARRIER = 3  # named barriers 3, 4: the consumers' turns (1, 2: their epilogues)
# deep rings of small tiles keep a weight stream's bytes in flight (shared memory decides)
MAX_STAGES = 12


@dataclass(frozen=True)
class HopperGemmConfig:
    """Tile shape and pipeline of :func:`make_kernel`.

    ``block_m`` is 64 per consumer warp group; ``block_n`` a multiple of 64 up to 256 (of 32
    from 96 with B stored N x K: 96, 160, 224 fill the last wave where 64-multiples do not);
    ``block_k`` is 64 (one 128-byte swizzled row); ``stages`` buffers in the ring;
    ``cluster_m`` 2 runs CTA pairs on vertically adjacent tiles that share (multicast) B.
    ``split_k`` > 1 cuts K into that many slices, one work unit each, whose f32 partial tiles
    a second kernel sums (:mod:`.splitk`); ``swap_ab`` computes ``C.T = B.T @ A.T`` so a
    small M becomes WGMMA's N (``block_n`` 32 allowed), through the same f32 partials.
    Both are *partials* configs (:attr:`partials`); ``fused_reduce`` has the last K slice of
    each tile to finish sum the partials in the GEMM kernel itself (no second kernel); with
    ``swap_ab`` and no ``split_k`` it stores each tile of C.T straight into C (one launch, no
    workspace).
    ``stream_k`` gives every CTA an equal share of the K steps of the last tiles (all tiles when
    there are fewer than CTAs), fixing split tiles up in the kernel (:mod:`.streamk`).
    ``pingpong`` (64-row tiles, whole K) runs two consumer warp groups on alternate tiles, one's
    epilogue overlapping the other's main loop (CUTLASS's ping-pong schedule). ``pdl`` makes
    the kernel (and split-K's reduction) programmatic dependent launches: each waits for the
    work before it on the stream at its top (``griddepcontrol.wait``) and lets the next kernel
    launch at once, so launch latencies overlap the previous kernel's tail; before its wait
    one thread L2-prefetches the first ``stages`` K steps of its CTA's first tile. Example:
    ``HopperGemmConfig(block_m=128, block_n=32, swap_ab=True, split_k=4)`` for M <= 32,
    ``HopperGemmConfig(stream_k=True)`` for 4096 x 4096 (3.9 waves of 128 x 256 tiles).
    ``gemv`` runs another kernel, the decode GEMV of :mod:`.gemv` (M of at most 16, B stored
    N x K; no WGMMA, the tile fields unused; M of 5..16 on ``mma.sync``, :mod:`.gemv_mma`):
    ``HopperGemmConfig(gemv=True)``.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    producer_registers: int = 40
    consumer_registers: int = 232
    cluster_m: int = 1
    split_k: int = 1
    swap_ab: bool = False
    fused_reduce: bool = False
    stream_k: bool = False
    pingpong: bool = False
    pdl: bool = False
    gemv: bool = False

    def __post_init__(self):
        if self.block_m % 64 or not 64 <= self.block_m <= 256:
            raise kiln.UnsupportedError(f"block_m={self.block_m} is not supported",
                                        fix="use 64, 128 or 192 (64 rows per consumer group)")
        # f32 partials stage 32-column (128-byte) tiles; bf16/f16 C 64-column ones, or 32-column
        # (64-byte) ones for an N of 96, 160 or 224 (tile counts that fill the last wave)
        narrowest = 32 if self.partials else 64
        if self.block_n % 32 or not narrowest <= self.block_n <= 256:
            raise kiln.UnsupportedError(f"block_n={self.block_n} is not supported",
                                        fix=f"use a multiple of 32 from {narrowest} up to 256 "
                                            "(32 only with split_k > 1 or swap_ab)")
        if self.partials and self.cluster_m != 1:
            raise kiln.UnsupportedError("split-K and swap-AB configs run single CTAs",
                                        fix="use cluster_m=1 with split_k or swap_ab")
        if self.stream_k and self.split_k > 1:
            raise kiln.KilnValueError("stream_k splits K across CTAs itself",
                                      fix="use split_k=1 with stream_k=True")
        if self.fused_reduce and not self.partials:
            raise kiln.KilnValueError("fused_reduce sums split-K / swap-AB partials; this config "
                                      "has none", fix="add split_k > 1 or swap_ab=True")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise kiln.KilnValueError(f"split_k={self.split_k} must be in 1..{MAX_SPLIT_K}",
                                      fix="use 1 (no split) or e.g. 2, 4, 8")
        if self.pingpong and (self.block_m != 64 or self.cluster_m != 1 or self.split_k != 1
                              or self.stream_k or self.fused_reduce):
            raise kiln.UnsupportedError("pingpong runs whole 64-row tiles of one CTA",
                                        fix="use block_m=64 without cluster_m, split_k, "
                                            "stream_k or fused_reduce")
        if self.gemv and (self.partials or self.cluster_m != 1 or self.pingpong or self.pdl):
            raise kiln.UnsupportedError("gemv runs the GEMV kernel, which has no tiles to split "
                                        "or pair", fix="use HopperGemmConfig(gemv=True) alone")
        if self.pdl and self.cluster_m != 1:
            raise kiln.UnsupportedError("programmatic launches of CTA pairs are not supported",
                                        fix="use cluster_m=1 with pdl=True")
        if self.block_k != 64:
            raise kiln.UnsupportedError(f"block_k={self.block_k} is not supported",
                                        fix="use block_k=64 (one 128-byte swizzled row)")
        if self.cluster_m not in (1, 2):
            raise kiln.UnsupportedError(f"cluster_m={self.cluster_m} is not supported",
                                        fix="use 1 (no cluster) or 2 (CTA pairs sharing B)")
        if self.group_m < 1:
            raise kiln.KilnValueError(f"group_m={self.group_m} must be >= 1",
                                      fix="use e.g. group_m=8")
        if not 2 <= self.stages <= MAX_STAGES:
            raise kiln.KilnValueError(f"stages={self.stages} must be in 2..{MAX_STAGES}",
                                      fix="use 3 or 4 stages (up to 10 for 32-wide tiles)")
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * 2
        if ring + self.staged_rows * ROW_BYTES > SHARED_BUDGET:
            raise kiln.ResourceError(f"{self.stages} stages of {self.block_m}x{self.block_k} + "
                                     f"{self.block_n}x{self.block_k} tiles ({ring} bytes) leave "
                                     "no room for the epilogue in 227 KB of shared memory",
                                     fix="use fewer stages or a smaller block_n")
        total = self.consumers * self.consumer_registers + self.producer_registers
        if total * WARP_GROUP_THREADS > 65536:
            raise kiln.ResourceError(f"{self.consumers} consumer groups x "
                                     f"{self.consumer_registers} + {self.producer_registers} "
                                     "registers per thread exceed the 64K register file",
                                     fix="lower consumer_registers")

    @property
    def partials(self) -> bool:
        """Whether the kernel writes f32 partial tiles that :mod:`.splitk` reduces into C."""
        return self.split_k > 1 or self.swap_ab or self.stream_k

    @property
    def reduces_in_kernel(self) -> bool:
        """Whether the GEMM kernel itself sums the partials (``fused_reduce``, stream-K)."""
        return self.fused_reduce or self.stream_k

    @property
    def consumers(self) -> int:
        """Consumer warp groups: one per 64 rows of a tile, or two taking turns (pingpong)."""
        return 2 if self.pingpong else self.block_m // 64

    @property
    def staged_rows(self) -> int:
        """Rows of C staged in shared memory at once: each consumer's 64."""
        return 64 * self.consumers

    @property
    def num_warps(self) -> int:
        return 4 * (self.consumers + 1)

    def shared_bytes(self, itemsize: int = 2, out_itemsize: int = 2) -> int:
        """Dynamic shared memory: the operand ring plus the epilogue's staging tiles."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * itemsize
        return ring + self.staged_rows * self.epilogue_columns(out_itemsize) * out_itemsize

    def staging_columns(self, out_itemsize: int) -> int:
        """Columns of one swizzled C staging tile: 128 bytes of C, or 64 where ``block_n`` is
        an odd multiple of 64 bytes' worth (e.g. 160 bf16 columns: 64-byte swizzle)."""
        return ROW_BYTES // out_itemsize if self.block_n * out_itemsize % ROW_BYTES == 0 \
            else ROW_BYTES // 2 // out_itemsize

    def epilogue_columns(self, out_itemsize: int) -> int:
        """Columns of C staged per epilogue round: all of ``block_n`` when it fits next to the
        ring, else the largest slice of staging tiles that does."""
        tile_cols = self.staging_columns(out_itemsize)
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * 2
        slices = [c for c in range(self.block_n, 0, -tile_cols) if self.block_n % c == 0]
        return next((c for c in slices
                     if ring + self.staged_rows * c * out_itemsize <= SHARED_BUDGET),
                    slices[-1])


@functools.lru_cache(maxsize=None)
def make_kernel(dtype: str, out_dtype: str, b_major: str, config: HopperGemmConfig):
    """The ``@kiln.kernel`` for ``dtype`` inputs, an ``out_dtype`` output, B stored
    ``b_major`` ("mn": K x N row-major, "k": N x K) and ``config``'s tiles.

    Run-time parameters: ``a_map`` (A, box BM x BK), ``b_map`` (box BK x 64 for "mn", BN x BK
    for "k"), ``c_map`` (C, box 64 x 128 bytes, written by TMA stores), ``m, n, k``.
    """
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # Run-time tensors of the in-kernel reduction (constexpr placeholders, None, otherwise).
    fused = config.reduces_in_kernel
    stream_k = config.stream_k
    fused_types = (kiln.Tensor[kiln.f32, 1] if fused else kiln.constexpr,
                   kiln.Tensor[kiln.i64, 1] if fused else kiln.constexpr,
                   kiln.Tensor[out_type, 2] if fused and config.swap_ab else kiln.constexpr)
    if b_major == "mn" and bn % 64:
        raise kiln.UnsupportedError(f"block_n={bn} needs B stored N x K (64-column MN-major "
                                    "chunks otherwise)", fix="use trans_b=True, or block_n 64")
    pair = config.cluster_m
    pingpong = config.pingpong
    # TMA boxes of B per stage: 64-column chunks when MN-major; when K-major one box, or one
    # half per CTA of a pair (the halves stack into the same K-major layout).
    b_box = (bk, 64) if b_major == "mn" else (bn // pair, bk)
    chunks = bn // 64 if b_major == "mn" else pair
    b_chunk_rows = 64 if b_major == "mn" else bn // pair
    # Descriptor strides (PTX "Matrix Descriptor"): K-major tiles step 1024 bytes per 8 rows of
    # M/N; MN-major chunks step 1024 bytes per 8 rows of K and bk * 128 bytes per 64 columns.
    b_leading = bk * ROW_BYTES if b_major == "mn" else 16
    b_k_step = K_STEP * ROW_BYTES if b_major == "mn" else K_STEP * in_type.itemsize
    c_cols = config.staging_columns(out_type.itemsize)  # columns of one C staging tile
    c_swizzle = c_cols * out_type.itemsize  # 128 bytes, or 64 for 32 of 2-byte columns
    epilogue_n = config.epilogue_columns(out_type.itemsize)
    c_tiles_per_round = epilogue_n // c_cols
    if fused and not config.swap_ab and bn % c_cols:
        raise kiln.UnsupportedError(f"block_n={bn} is narrower than a {out_dtype} C staging tile",
                                    fix=f"use block_n a multiple of {c_cols}, or swap_ab")

    def b_coords(k0, n0):  # TMA coordinates, innermost first
        return (n0, k0) if b_major == "mn" else (k0, n0)

    def load_b(b_map, b_tiles, full, stage, k0, n0, rank):
        """Stage ``stage``'s B chunks: alone, all of them; in a pair, chunk ``j`` comes from
        CTA ``j % 2`` and is multicast to both, so each CTA fetches about half of B."""
        for j in range(chunks):
            destination = b_tiles.tile(stage * chunks + j)
            coords = b_coords(k0, n0 + b_chunk_rows * j)
            if pair == 1:
                tma.load(b_map, destination, coords, full, stage)
            else:
                tma.load(b_map, destination, coords, full, stage,
                         multicast_mask=(1 << pair) - 1, predicate=rank == j % pair)

    def release(empty, stage, wgmma_pending):
        """Hand ``stage`` back to the producer(s) writing it: this CTA's, and in a pair also
        the peer's, whose multicast B lands here too; WGMMA groups but the newest
        ``wgmma_pending`` are done reading it."""
        if pair == 1:
            empty.arrive(stage, wgmma_pending=wgmma_pending)
        else:
            for r in range(pair):
                empty.arrive_cluster(stage, r, wgmma_pending=wgmma_pending)

    def gemm(a_map: kiln.TensorMap[in_type, (bm, bk), SWIZZLE],
             b_map: kiln.TensorMap[in_type, b_box, SWIZZLE],
             c_map: kiln.TensorMap[out_type, (64, c_cols), c_swizzle],
             m: kiln.i32, n: kiln.i32, k: kiln.i32,
             work: fused_types[0], tickets: fused_types[1], c_out: fused_types[2],
             BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
             STAGES: kiln.constexpr, GROUP_M: kiln.constexpr, PRODUCER_REGS: kiln.constexpr,
             CONSUMER_REGS: kiln.constexpr, CLUSTER_M: kiln.constexpr,
             SPLIT_K: kiln.constexpr):
        if CLUSTER_M > 1:
            nvidia_asm.cluster_dims(CLUSTER_M)
        a_tiles = dynamic_shared((STAGES, BM, BK), in_type, align=SWIZZLE_ALIGN)
        b_tiles = dynamic_shared((STAGES * chunks,) + b_box, in_type, align=SWIZZLE_ALIGN)
        c_tiles = None  # swap-AB's fused reduction writes C with plain stores
        if not (fused and config.swap_ab):
            c_tiles = dynamic_shared((config.consumers * c_tiles_per_round, 64, c_cols),
                                     out_type, align=SWIZZLE_ALIGN)
        if fused:  # per consumer: whether it sums its tile's partials (see epilogue.finish_fused)
            owners = dynamic_shared((BM // 64,), kiln.i32)
        full = mbarrier.group(num_barriers=STAGES)
        empty = mbarrier.group(num_barriers=STAGES)
        tid = kiln.thread_id(0)
        warp_group = tid // WARP_GROUP_THREADS
        first_thread = tid % WARP_GROUP_THREADS == 0
        for s in kiln.static_range(STAGES):
            full.init(s, count=1, predicate=tid == 0)
            # (with pingpong one consumer reads a stage: the one whose tile it holds)
            empty.init(s, count=(1 if pingpong else BM // 64) * CLUSTER_M, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        if CLUSTER_M > 1:
            nvidia_asm.cluster_sync()  # the peer's barriers exist before anything signals them
            rank = nvidia_asm.cluster_ctarank()
        else:
            kiln.barrier()
            rank = 0

        # A pair of CTAs works on CLUSTER_M vertically adjacent tiles (a "pair tile") at once.
        tiles_m = (m + BM * CLUSTER_M - 1) // (BM * CLUSTER_M)
        tiles_n = (n + BN - 1) // BN
        k_tiles = (k + BK - 1) // BK
        if SPLIT_K > 1:  # work unit = (K slice, tile); every slice has at least one K step
            slice_steps = (k_tiles + SPLIT_K - 1) // SPLIT_K
            slices = (k_tiles + slice_steps - 1) // slice_steps
            num_tiles = tiles_m * tiles_n * slices
        else:
            slices = 1
            num_tiles = tiles_m * tiles_n
        first_tile = kiln.block_id(0) // CLUSTER_M
        tile_step = kiln.num_blocks(0) // CLUSTER_M
        plan = None
        if stream_k:  # this CTA's units: data-parallel tiles, then a range of K steps
            plan = streamk.schedule(num_tiles, k_tiles)
            first_tile, num_tiles, tile_step = 0, plan[0], 1
        group_m = max(1, GROUP_M // CLUSTER_M)
        stage_bytes = tma.box_bytes(a_map) + chunks * tma.box_bytes(b_map)
        if config.pdl:  # nothing above touched global memory but the (constant) tensor maps
            if (tid == 0) & (first_tile < num_tiles):
                # L2 prefetches of the first unit's first STAGES K steps: the weight stream
                # starts while the kernel before still runs (they change no visible value)
                first = work_unit(first_tile, tiles_m, tiles_n, k_tiles, group_m, SPLIT_K, plan)
                for kt in kiln.range(first[2], kiln.minimum(first[3], first[2] + STAGES)):
                    tma.prefetch(a_map, (kt * BK, first[0]))
                    for j in kiln.static_range(chunks):
                        tma.prefetch(b_map, b_coords(kt * BK, first[1] + b_chunk_rows * j))
            nvidia_asm.grid_dependency_wait()
            nvidia_asm.launch_dependents()
        if warp_group == 0:
            nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
            if tid == 0:
                tma.prefetch_descriptor(a_map)
                tma.prefetch_descriptor(b_map)
                use = 0
                for tile in kiln.range(first_tile, num_tiles, tile_step):
                    m0, n0, k_first, k_end, _, _ = work_unit(tile, tiles_m, tiles_n, k_tiles,
                                                             group_m, SPLIT_K, plan)
                    m0 = m0 + rank * BM
                    for kt in kiln.range(k_first, k_end):
                        stage = use % STAGES
                        empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                        # All of B arrives here, half of it from the peer's multicast.
                        full.arrive_expect_tx(stage, stage_bytes)
                        tma.load(a_map, a_tiles.tile(stage), (kt * BK, m0), full, stage)
                        load_b(b_map, b_tiles, full, stage, kt * BK, n0, rank)
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
            if pingpong:  # consumer c takes the CTA's tiles c, c + 2, ..; uses k_tiles a tile
                own_first, own_step = first_tile + consumer * tile_step, 2 * tile_step
                use = consumer * k_tiles
            for tile in kiln.range(own_first, num_tiles, own_step):
                m0, n0, k_first, k_end, piece, mn_tile = work_unit(tile, tiles_m, tiles_n,
                                                                   k_tiles, group_m, SPLIT_K,
                                                                   plan)
                m0 = m0 + rank * BM
                acc = wgmma.fragment_zeros(BN)
                if pingpong:
                    take_turn(consumer, tile > first_tile)
                for kt in kiln.range(k_first, k_end):
                    stage = use % STAGES
                    full.try_wait(stage, (use // STAGES) % 2)
                    stage64 = kiln.cast(stage, kiln.i64)
                    a_desc = a_base + stage64 * a_stage_units
                    b_desc = b_base + stage64 * b_stage_units
                    wgmma.fence()
                    for ks in kiln.static_range(BK // K_STEP):
                        acc = wgmma.mma_async(acc, a_desc + ks * K_STEP * in_type.itemsize // 16,
                                              b_desc + ks * b_k_step // 16, dtype=in_type,
                                              b_major=b_major)
                    wgmma.commit()
                    # Keep this K step's group in flight; the previous one has finished reading
                    # its stage, which goes back to the producer.
                    wgmma.wait_group(1)
                    if (kt > k_first) & first_thread:
                        release(empty, (use + STAGES - 1) % STAGES, 1)
                    use = use + 1
                wgmma.wait_group(0)
                if first_thread:
                    release(empty, (use + STAGES - 1) % STAGES, 0)
                if pingpong:
                    use = use + k_tiles  # the other consumer's tile
                    pass_turn(consumer, tile + tile_step < num_tiles)
                if stream_k:
                    streamk.finish(acc, c_map, c_tiles, work, tickets, c_out, owners, consumer,
                                   m0 + consumer * 64, n0, piece, k_first, k_end, k_tiles,
                                   plan[3], plan[4], m, n, first_thread, BN // epilogue_n,
                                   c_tiles_per_round, c_cols, config.swap_ab, BM // 64)
                elif fused and config.split_k == 1:  # swap-AB over all of K: C.T's tile to C
                    store_transposed(acc, c_out, m0 + consumer * 64, n0, m, n)
                elif fused:
                    finish_fused(acc, c_map, c_tiles, work, tickets, c_out, owners, consumer,
                                  m0 + consumer * 64, n0, mn_tile * (BM // 64) + consumer,
                                  piece, slices, m, n, first_thread, BN // epilogue_n,
                                  c_tiles_per_round, c_cols, config.swap_ab)
                else:
                    if SPLIT_K > 1:  # slice s of the partials starts at row s * tiles_m * BM
                        m0 = m0 + piece * tiles_m * BM * CLUSTER_M
                    store_tile(acc, c_map, c_tiles, consumer,
                               m0 + (0 if pingpong else consumer * 64), n0, first_thread,
                               BN // epilogue_n, c_tiles_per_round, c_cols)
            if first_thread:
                tma.wait_group(0, read=True)  # the staging tiles must outlive the last store
        if CLUSTER_M > 1:
            nvidia_asm.cluster_sync()  # the peer may still arrive on this CTA's barriers

    def work_unit(tile, tiles_m, tiles_n, k_tiles, group_m, split_k, plan):
        """Origin, K steps ``[k_first, k_end)``, K slice and output tile of work unit
        ``tile``: a whole output tile, or with ``split_k`` one K slice of one tile (slice-major,
        so CTAs running together share the slice's A and B columns); with stream-K (``plan``
        from :func:`.streamk.schedule`) unit ``tile`` of this CTA, its "slice" the stream-K
        tile index."""
        if plan is not None:
            tile, k_first, k_end, sk_tile = streamk.unit(tile, k_tiles, *plan[1:3], *plan[4:])
            m0, n0 = _tile_origin(tile, tiles_m, tiles_n, bm, bn, group_m)
            return m0, n0, k_first, k_end, sk_tile, tile
        if split_k == 1:  # the plain GEMM's tile walk, unchanged
            m0, n0 = _tile_origin(tile, tiles_m, tiles_n, bm * pair, bn, group_m)
            return m0, n0, 0, k_tiles, 0, tile
        per_slice = tiles_m * tiles_n
        slice_steps = (k_tiles + split_k - 1) // split_k
        piece = tile // per_slice
        m0, n0 = _tile_origin(tile % per_slice, tiles_m, tiles_n, bm * pair, bn, group_m)
        k_first = piece * slice_steps
        return (m0, n0, k_first, kiln.minimum(k_first + slice_steps, k_tiles), piece,
                tile % per_slice)

    gemm.__name__ = gemm.__qualname__ = f"hopper_gemm_{dtype}_{out_dtype}_{b_major}"
    return kiln.kernel(gemm)


@kiln.func
def take_turn(consumer, wait):
    """Ping-pong: before its main loop, a consumer waits (``wait``: every tile but the CTA's
    first) until the other has waited on every stage of the tile before; a stage's next use is
    then at most one barrier phase ahead of the phase its waiter sees."""
    if (consumer == 1) | wait:
        nvidia_asm.named_barrier(PINGPONG_BARRIER + consumer, 2 * WARP_GROUP_THREADS)


@kiln.func
def pass_turn(consumer, more):
    """Ping-pong: after its main loop, a consumer lets the other start its next tile (``more``:
    the CTA has one), so every wait of :func:`take_turn` meets exactly one arrive."""
    if more:
        nvidia_asm.named_barrier_arrive(PINGPONG_BARRIER + 1 - consumer, 2 * WARP_GROUP_THREADS)


def kernel_constexprs(cfg: HopperGemmConfig) -> dict:
    """The constexpr arguments of :func:`make_kernel`'s kernel for ``cfg`` (with None for the
    in-kernel reduction's tensors where ``cfg`` has none: see :mod:`.splitk`)."""
    unused = () if cfg.swap_ab else ("c_out",)
    placeholders = dict.fromkeys(unused if cfg.reduces_in_kernel else ("work", "tickets", "c_out"))
    return dict(placeholders, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages,
                GROUP_M=cfg.group_m, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers, CLUSTER_M=cfg.cluster_m,
                SPLIT_K=cfg.split_k)


@kiln.func
def _tile_origin(tile, tiles_m, tiles_n, BM, BN, GROUP_M):
    """(row, column) of output tile ``tile`` in grouped order: ``GROUP_M`` tile rows are swept
    column by column, so CTAs running together reuse the same A rows and B columns from L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = kiln.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % per_group) % group_rows
    tile_n = (tile % per_group) // group_rows
    return tile_m * BM, tile_n * BN
