"""AMD gfx950 (CDNA4) GEMM: LDS DMA double buffering + MFMA 32x32x16 (compile-only here).

``C[M, N] = A[M, K] @ B`` with bf16/f16 inputs, f32 accumulation and a bf16/f16/f32 output.
B is stored N x K (``b_layout="nk"``, i.e. ``matmul(..., trans_b=True)``; the default) or K x N
(``"kn"``).

Schedule (one workgroup per ``BM x BN`` output tile, ``warps_m x warps_n`` waves, defaults
128 x 128 x 64 over 2 x 2 waves):

| phase | what each wave does |
| --- | --- |
| prologue | DMA (``buffer_load_dwordx4 ... lds``) its share of the A and B tiles of K step 0 into LDS stage 0 |
| K step ``t`` | ``s_waitcnt vmcnt(0)`` + ``s_barrier`` (stage ``t % 2`` is complete, stage ``(t + 1) % 2`` is free); DMA step ``t + 1`` into the other stage; then ``BK / 16`` times: ``ds_read_b128`` the A and B fragments of its ``WM x WN`` sub-tile and issue ``(WM / 32) * (WN / 32)`` ``v_mfma_f32_32x32x16_*`` at ``s_setprio 1`` |
| epilogue | convert and store the accumulators with 4-wide buffer stores |

So each wave issues ``(BM / 32) * (BN / 32) * (BK / 16) / waves`` MFMAs per K step (16 by
default). With ``"nk"`` the MFMA is issued as ``B A^T`` so every accumulator holds a tile of
``C^T``: each group of 4 values is 4 consecutive columns of one C row, stored with one vector
store. With ``"kn"`` the B fragments come from K x N LDS tiles through two
``ds_read_b64_tr_b16`` each (:meth:`~kiln.loader.TiledMmaLoader.load_b_tr`), whose columns are
permuted inside 16-column blocks; the MFMA is ``A B`` and the store writes each lane's values
to the columns its B fragment held (scalar stores).

K-contiguous LDS tiles are ``BK = 64`` elements (128 bytes) per row, swizzled by
``Swizzle(3, 3, 3)`` on element offsets (16-byte chunk ^= row % 8), so the 32 lanes reading one
fragment column hit distinct banks; K x N B tiles are not swizzled. The DMA writes each wave's 1 KiB contiguously in lane order, so lane ``l`` loads
the global element whose swizzled LDS position is its own (the swizzle is an involution).

Edges: A, B and C are accessed through buffer views, so rows past the end read as zeros and
stores past them are dropped; a load whose column is past the row's end is redirected to the
row past the last (out of range, reads 0). Loads move 16-byte pieces along rows, so K must be a
multiple of 8, and N too with ``"kn"`` (a 4 with ``"nk"``: 4-wide stores).
"""

from dataclasses import dataclass

import numpy as np

import kiln
from kiln import amd_asm, amd_buffer, mfma, mma
from kiln.amd.loader import TiledMmaLoader
from kiln.swizzle import Swizzle

MMA_SHAPE = (32, 32, 16)
WAVE = 64
LDS_ROW_BYTES = 128  # one BK row: 8 chunks of 16 bytes, what the swizzle permutes
DMA_BYTES = 16  # per lane per DMA instruction (dwordx4)
SUPPORTED_DTYPES = ("bf16", "f16")
OUT_DTYPES = ("bf16", "f16", "f32")
STAGES = 2
FEEDS = ("registers", "dma")
B_LAYOUTS = ("nk", "kn")


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape of :func:`make_kernel` (see the module docstring for the schedule).

    Example: ``GemmConfig(block_m=256, warps_m=4)`` (8 waves, 32 MFMAs per wave per K step:
    ``GemmConfig(256, 128, 64, 4, 2).mfmas_per_k_step == 16``).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps_m: int = 2
    warps_n: int = 2
    feed: str = "registers"  # "registers": buffer_load -> VGPRs -> ds_write; "dma": LDS DMA
    b_layout: str = "nk"  # B stored N x K ("nk", matmul's trans_b=True) or K x N ("kn")
    out_dtype: str | None = None  # default: the input dtype

    def __post_init__(self):
        m, n, k = MMA_SHAPE
        checks = (
            (self.block_m % (self.warps_m * m) == 0, f"block_m={self.block_m} must be a "
             f"multiple of warps_m * {m} = {self.warps_m * m}"),
            (self.block_n % (self.warps_n * n) == 0, f"block_n={self.block_n} must be a "
             f"multiple of warps_n * {n} = {self.warps_n * n}"),
            (self.block_k == LDS_ROW_BYTES // 2, f"block_k={self.block_k} must be "
             f"{LDS_ROW_BYTES // 2} (one 128-byte swizzled LDS row of a 2-byte dtype)"),
            (self.block_m % (self.rows_per_dma * self.num_warps) == 0
             and self.block_n % (self.rows_per_dma * self.num_warps) == 0,
             f"block_m and block_n must be multiples of {self.rows_per_dma * self.num_warps} "
             "(the rows all waves' DMAs cover at once)"),
            (self.feed in FEEDS, f"feed={self.feed!r} is not one of {FEEDS}"),
            (self.b_layout in B_LAYOUTS, f"b_layout={self.b_layout!r} is not one of "
             f"{B_LAYOUTS}"),
            (self.b_layout == "nk" or (WAVE * DMA_BYTES // 2) % self.block_n == 0,
             f"block_n={self.block_n} must divide {WAVE * DMA_BYTES // 2} with b_layout='kn' "
             "(one wave-wide load fills whole B rows)"),
            (self.out_dtype is None or self.out_dtype in OUT_DTYPES,
             f"out_dtype={self.out_dtype!r} is not one of {OUT_DTYPES}"),
            (self.lds_bytes <= 160 * 1024, f"{self.lds_bytes} bytes of LDS exceed gfx950's "
             "160 KiB"),
        )
        for ok, message in checks:
            if not ok:
                raise kiln.KilnValueError(f"GemmConfig: {message}",
                                          fix="start from GemmConfig() and scale block_m/block_n "
                                              "with warps_m/warps_n")

    @property
    def num_warps(self) -> int:
        return self.warps_m * self.warps_n

    @property
    def rows_per_dma(self) -> int:
        """LDS rows one wave-wide DMA fills: 64 lanes x 16 bytes over 128-byte rows."""
        return WAVE * DMA_BYTES // LDS_ROW_BYTES

    @property
    def mfmas_per_k_step(self) -> int:
        """MFMAs one wave issues per ``block_k`` step."""
        m, n, k = MMA_SHAPE
        return (self.block_m // m) * (self.block_n // n) * (self.block_k // k) // self.num_warps

    @property
    def lds_bytes(self) -> int:
        return STAGES * (self.block_m + self.block_n) * self.block_k * 2


LDS_SWIZZLE = Swizzle(3, 3, 3)  # element offsets of 2-byte data: 16-byte chunk ^= row % 8
PIECE = WAVE * DMA_BYTES // 2  # elements one wave moves per 16-byte-per-lane load


def _swizzled(swizzle, offset):
    return offset if swizzle is None else swizzle(offset)


def make_kernel(dtype: str, config: GemmConfig, *, grouped: bool = False):
    """The ``@kiln.kernel`` for ``dtype`` inputs and ``config``; arguments ``(a, b, c, m, n, k)``
    with ``a``: M x K, ``b``: N x K (``"nk"``) or K x N (``"kn"``), ``c``: M x N; grid ``ceil(M/BM)
    * ceil(N/BN)``. ``grouped``: the grouped GEMM (``grouped_gemm_gfx950``, see its docs)."""
    in_type = kiln.dtype(dtype)
    out_type = kiln.dtype(config.out_dtype or dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # The kernel body captures only plain values: they enter the compile-cache key.
    warps_n = config.warps_n
    wm, wn = bm // config.warps_m, bn // warps_n  # one wave's sub-tile
    tiles_m, tiles_n = wm // MMA_SHAPE[0], wn // MMA_SHAPE[1]
    waves = config.num_warps
    loader = TiledMmaLoader(in_type, MMA_SHAPE, swizzle=LDS_SWIZZLE)
    loader_tr = TiledMmaLoader(in_type, MMA_SHAPE)  # K x N B tiles: ds_read_b64_tr_b16
    FEED_DMA = config.feed == "dma"  # noqa: N806 - trace-time constants used in `if`
    B_KN = config.b_layout == "kn"  # noqa: N806
    elems_per_lane = DMA_BYTES // in_type.itemsize
    # B's LDS stage: BN x BK rows of K ("nk") or BK x BN rows of N ("kn", not swizzled).
    b_stage_rows, b_row_len = (bk, bn) if B_KN else (bn, bk)
    b_swizzle = None if B_KN else LDS_SWIZZLE
    b_tr_layout = loader_tr.b_tr_layout() if B_KN else None

    def b_corner(n0, k0):
        """Global (row, col) of a B stage's corner."""
        return (k0, n0) if B_KN else (n0, k0)

    def dma_tile(src, lds, stage_row, stage, origin, limits, wave, lane):
        """DMA this wave's share of one LDS stage into rows ``stage_row..``. ``stage`` is
        ``(elements, row_len, swizzle)``; ``origin`` the global (row, col) of its corner. The
        data landing at LDS position ``p`` is the global element at ``swizzle(p)`` (swizzles are
        involutions, so LDS holds the swizzled tile)."""
        elements, row_len, swizzle = stage
        for i in kiln.static_range(elements // (PIECE * waves)):
            chunk = wave + i * waves
            position = _swizzled(swizzle, chunk * PIECE + lane * elems_per_lane)
            col = origin[1] + position % row_len
            row = kiln.where(col < limits[1], origin[0] + position // row_len, limits[0])
            amd_buffer.copy_to_lds(src, (row, col), lds, (stage_row + chunk * PIECE // row_len, 0),
                                   width=elems_per_lane)

    def load_tile(src, stage, origin, limits, wave, lane):
        """This wave's share of one stage as registers (16-byte buffer loads)."""
        elements, row_len, _ = stage
        pieces = []
        for i in kiln.static_range(elements // (PIECE * waves)):
            element = (wave + i * waves) * PIECE + lane * elems_per_lane
            col = origin[1] + element % row_len
            row = kiln.where(col < limits[1], origin[0] + element // row_len, limits[0])
            pieces.append(src.load(row, col, width=elems_per_lane))
        return pieces

    def store_tile(pieces, lds, stage_row, stage, wave, lane):
        """Write :func:`load_tile`'s registers to their (swizzled) LDS positions."""
        _, row_len, swizzle = stage
        for i, piece in enumerate(pieces):
            position = _swizzled(swizzle, (wave + i * waves) * PIECE + lane * elems_per_lane)
            lds.store(stage_row + position // row_len, position % row_len, piece)

    def mma_k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom):
        """All MFMAs of one BK step on LDS stage ``stage``; returns the new accumulators."""
        acc = list(acc)
        for kk in kiln.static_range(bk // MMA_SHAPE[2]):
            k0 = kk * MMA_SHAPE[2]
            a_frags = loader.load_b(a_lds, n_tiles=tiles_m, n0=stage * bm + wave_m * wm, k0=k0)
            if B_KN:
                b_frags = [loader_tr.load_b_tr(b_lds, k0=stage * bk + k0,
                                               n0=wave_n * wn + j * MMA_SHAPE[1])
                           for j in range(tiles_n)]
            else:
                b_frags = loader.load_b(b_lds, n_tiles=tiles_n, n0=stage * bn + wave_n * wn,
                                        k0=k0)
            amd_asm.s_setprio(1)
            for i in kiln.static_range(tiles_m):
                for j in kiln.static_range(tiles_n):
                    index = i * tiles_n + j
                    # "nk": B A^T gives C^T tiles (4-wide stores); "kn": A B with B's columns
                    # permuted by the transposed read (re-mapped at the store).
                    acc[index] = (atom(a_frags[i], b_frags[j], acc[index]) if B_KN else
                                  atom(b_frags[j], a_frags[i], acc[index]))
            amd_asm.s_setprio(0)
        return acc

    a_stage = (bm * bk, bk, LDS_SWIZZLE)
    b_stage = (bn * bk, b_row_len, b_swizzle)

    def gemm_gfx950(a: kiln.Tensor[in_type, 2], b: kiln.Tensor[in_type, 2],
                    c: kiln.Tensor[out_type, 2], m: kiln.i32, n: kiln.i32, k: kiln.i32):
        a_lds = kiln.shared((STAGES * bm, bk), in_type)
        b_lds = kiln.shared((STAGES * b_stage_rows, b_row_len), in_type)
        a_buf, b_buf, c_buf = amd_buffer.buffer(a), amd_buffer.buffer(b), amd_buffer.buffer(c)
        atom = mma.atom(*MMA_SHAPE, in_type)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        wave_m, wave_n = wave // warps_n, wave % warps_n
        block_n_count = (n + bn - 1) // bn
        m0 = (kiln.block_id(0) // block_n_count) * bm
        n0 = (kiln.block_id(0) % block_n_count) * bn
        k_steps = (k + bk - 1) // bk
        acc = [kiln.values.constant(0.0, kiln.f32, (16,)) for _ in range(tiles_m * tiles_n)]
        a_limits, b_limits = (m, k), ((k, n) if B_KN else (n, k))

        if FEED_DMA:
            dma_tile(a_buf, a_lds, 0, a_stage, (m0, 0), a_limits, wave, lane)
            dma_tile(b_buf, b_lds, 0, b_stage, b_corner(n0, 0), b_limits, wave, lane)
        else:
            store_tile(load_tile(a_buf, a_stage, (m0, 0), a_limits, wave, lane), a_lds, 0,
                       a_stage, wave, lane)
            store_tile(load_tile(b_buf, b_stage, b_corner(n0, 0), b_limits, wave, lane), b_lds,
                       0, b_stage, wave, lane)
        for step in kiln.range(k_steps):
            stage = step % STAGES
            k_next = (step + 1) * bk
            a_next_row, b_next_row = (1 - stage) * bm, (1 - stage) * b_stage_rows
            if FEED_DMA:
                amd_asm.s_waitcnt(vmcnt=0)  # this wave's DMAs of `step` have landed ...
                amd_asm.s_barrier()          # ... and every wave's; stage 1 - stage is free
                if step + 1 < k_steps:
                    dma_tile(a_buf, a_lds, a_next_row, a_stage, (m0, k_next), a_limits, wave,
                             lane)
                    dma_tile(b_buf, b_lds, b_next_row, b_stage, b_corner(n0, k_next), b_limits,
                             wave, lane)
                acc = mma_k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom)
            else:
                # Past the last step the loads read zeros (K >= k) and fill an unused stage.
                a_next = load_tile(a_buf, a_stage, (m0, k_next), a_limits, wave, lane)
                b_next = load_tile(b_buf, b_stage, b_corner(n0, k_next), b_limits, wave, lane)
                amd_asm.s_waitcnt(lgkmcnt=0)  # this wave's ds_writes of `step` are done ...
                amd_asm.s_barrier()            # ... and every wave's
                acc = mma_k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom)
                store_tile(a_next, a_lds, a_next_row, a_stage, wave, lane)
                store_tile(b_next, b_lds, b_next_row, b_stage, wave, lane)

        for i in kiln.static_range(tiles_m):
            for j in kiln.static_range(tiles_n):
                mfma.store_accumulator(acc[i * tiles_n + j], c_buf,
                                       m0 + wave_m * wm + i * MMA_SHAPE[0],
                                       n0 + wave_n * wn + j * MMA_SHAPE[1], transposed=not B_KN,
                                       limits=(m, n), b_layout=b_tr_layout)

    if not grouped:
        return kiln.kernel(gemm_gfx950)
    from .grouped import build_tile_table, locate_tile

    group_m = 8  # row tiles per column sweep inside a group, as on Hopper
    threads = waves * WAVE

    def grouped_gemm_gfx950(a: kiln.Tensor[in_type, 2], b: kiln.Tensor[in_type, 2],
                            c: kiln.Tensor[out_type, 2], offsets: kiln.Tensor[kiln.i32, 1],
                            groups: kiln.i32, m: kiln.i32, n: kiln.i32, k: kiln.i32,
                            b_rows: kiln.i32, ctas: kiln.i32, TABLE: kiln.constexpr):
        """The grouped (MoE) GEMM of :mod:`.grouped` with this kernel's tiles and K loop:
        ``c[offsets[g]:offsets[g+1]] = a[...] @ B[g]``, B viewed as ``[G * b_rows, cols]``, a
        persistent grid of ``ctas`` workgroups (an argument: the grid size is a ROCm library
        call) walking the tiles of all groups (the tile table of
        :func:`.grouped.build_tile_table`); C's stores go through a buffer view that ends at
        the group's last row, so rows of the next group are never written."""
        a_lds = kiln.shared((STAGES * bm, bk), in_type)
        b_lds = kiln.shared((STAGES * b_stage_rows, b_row_len), in_type)
        table = kiln.shared((TABLE,), kiln.i32)
        a_buf, b_buf = amd_buffer.buffer(a), amd_buffer.buffer(b)
        atom = mma.atom(*MMA_SHAPE, in_type)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        wave_m, wave_n = wave // warps_n, wave % warps_n
        tiles = (n + bn - 1) // bn
        build_tile_table(table, offsets, groups, tiles, kiln.thread_id(0), bm, TABLE, threads)
        num_tiles = table[groups]
        k_steps = (k + bk - 1) // bk
        # Loads past a row's end are redirected to row `limits[0]`: past the whole array, not
        # into the next group.
        a_limits = (m, k)
        b_limits = (groups * b_rows, n) if B_KN else (groups * b_rows, k)
        for tile in kiln.range(kiln.block_id(0), num_tiles, ctas):
            g, m0, n0, row_end = locate_tile(table, offsets, tile, tiles, bm, bn, group_m,
                                             TABLE)
            b0 = g * b_rows
            b_origin = (b0, n0) if B_KN else (b0 + n0, 0)
            amd_asm.s_barrier()  # every wave has finished reading the previous tile's LDS
            acc = [kiln.values.constant(0.0, kiln.f32, (16,)) for _ in range(tiles_m * tiles_n)]
            if FEED_DMA:
                dma_tile(a_buf, a_lds, 0, a_stage, (m0, 0), a_limits, wave, lane)
                dma_tile(b_buf, b_lds, 0, b_stage, b_origin, b_limits, wave, lane)
            else:
                store_tile(load_tile(a_buf, a_stage, (m0, 0), a_limits, wave, lane), a_lds, 0,
                           a_stage, wave, lane)
                store_tile(load_tile(b_buf, b_stage, b_origin, b_limits, wave, lane), b_lds,
                           0, b_stage, wave, lane)
            for step in kiln.range(k_steps):
                stage = step % STAGES
                k_next = (step + 1) * bk
                a_next_row, b_next_row = (1 - stage) * bm, (1 - stage) * b_stage_rows
                b_next = (b0 + k_next, n0) if B_KN else (b0 + n0, k_next)
                if FEED_DMA:
                    amd_asm.s_waitcnt(vmcnt=0)
                    amd_asm.s_barrier()
                    if step + 1 < k_steps:
                        dma_tile(a_buf, a_lds, a_next_row, a_stage, (m0, k_next), a_limits,
                                 wave, lane)
                        dma_tile(b_buf, b_lds, b_next_row, b_stage, b_next, b_limits, wave,
                                 lane)
                    acc = mma_k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom)
                else:
                    a_regs = load_tile(a_buf, a_stage, (m0, k_next), a_limits, wave, lane)
                    b_regs = load_tile(b_buf, b_stage, b_next, b_limits, wave, lane)
                    amd_asm.s_waitcnt(lgkmcnt=0)
                    amd_asm.s_barrier()
                    acc = mma_k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom)
                    store_tile(a_regs, a_lds, a_next_row, a_stage, wave, lane)
                    store_tile(b_regs, b_lds, b_next_row, b_stage, wave, lane)
            # C's rows past the group's end are outside this view, so their stores drop.
            rows = kiln.minimum(row_end, m)
            c_buf = amd_buffer.buffer(c, valid_bytes=kiln.cast(kiln.maximum(rows, 0), kiln.i64)
                                      * n * out_type.itemsize)
            for i in kiln.static_range(tiles_m):
                for j in kiln.static_range(tiles_n):
                    mfma.store_accumulator(acc[i * tiles_n + j], c_buf,
                                           m0 + wave_m * wm + i * MMA_SHAPE[0],
                                           n0 + wave_n * wn + j * MMA_SHAPE[1],
                                           transposed=not B_KN, limits=(rows, n),
                                           b_layout=b_tr_layout)

    grouped_gemm_gfx950.__name__ = grouped_gemm_gfx950.__qualname__ = \
        f"grouped_gemm_gfx950_{dtype}_{out_type.name}_{config.b_layout}"
    return kiln.kernel(grouped_gemm_gfx950)


def compile_gfx950(dtype, *, target: str = "gfx950", config: GemmConfig | None = None):
    """Compile (without running) the gfx950 GEMM for ``dtype`` (bf16/f16) inputs; returns the
    ``CompiledKernel`` (``.asm["amdgcn"]``, ``.metadata["scratch_bytes"]``, ...).

    Example: ``compile_gfx950("bf16").metadata["vgpr_count"]``.
    """
    name = kiln.dtype(dtype).name
    if name not in SUPPORTED_DTYPES:
        raise kiln.UnsupportedError(f"the gfx950 GEMM does not support {name} inputs",
                                    fix=f"use one of {', '.join(SUPPORTED_DTYPES)}")
    if str(target) != "gfx950":
        raise kiln.UnsupportedError(f"the MFMA GEMM uses v_mfma_f32_32x32x16, which {target} "
                                    "lacks", fix="compile for target='gfx950'")
    config = config or GemmConfig()
    out = kiln.dtype(config.out_dtype or name)
    # Placeholder arrays carry dtype and rank only: the kernel is specialised on them.
    a = np.empty((1, 1), kiln.dtype(name).numpy)
    c = np.empty((1, 1), out.numpy)
    return make_kernel(name, config).compile(a, a, c, 1, 1, 1, target=target,
                                             num_warps=config.num_warps)
