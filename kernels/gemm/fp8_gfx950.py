"""AMD gfx950 (CDNA4) FP8 GEMM: MFMA ``v_mfma_f32_32x32x64_f8f6f4`` (double the bf16 rate),
register-fed LDS double buffering, the scales of :mod:`.scales` (compile-only here; checked in
the interpreter and at the ISA level).

``C[M, N] = A[M, K] @ B[N, K]^T`` for f8e4m3/f8e5m2 A and B (B stored N x K, as on Hopper),
f32 accumulation, bf16 or f32 C. The schedule is the bf16 kernel's register feed
(:mod:`.gfx950`) with FP8 tiles:

| phase | what each wave does |
| --- | --- |
| prologue | 16-byte buffer loads of its share of K step 0's A and B tiles, ``ds_write_b128`` into LDS stage 0 |
| K step ``t`` | issue the buffer loads of step ``t + 1``; ``s_waitcnt lgkmcnt(0)`` + ``s_barrier``; twice (``BK / 64``): two ``ds_read_b128`` per A and B fragment (32 fp8 values a lane), ``(WM / 32) * (WN / 32)`` MFMAs at ``s_setprio 1``; then write step ``t + 1`` into the other stage |
| block scales | each K step is one 128-K scale block: its MFMAs start from zero and the step's product is promoted, ``total += acc * sa[m, t] * sb[n / 128, t]`` |
| epilogue | per-tensor / row / column scales multiply the accumulators; 4-wide buffer stores |

LDS rows are ``BK = 128`` fp8 values (128 bytes) swizzled by ``Swizzle(3, 4, 3)`` (16-byte
chunk ^= row % 8, as the bf16 kernel's ``Swizzle(3, 3, 3)`` on 2-byte elements). The MFMA is
issued as ``B A^T``, as in the bf16 ``"nk"`` kernel, so every accumulator holds a tile of
``C^T``: lane ``l`` owns row ``l % 32`` of its 32 x 32 tile and value ``v`` column
``8 (v // 4) + 4 (l // 32) + v % 4``; each row needs one A scale, the columns one B scale each.
"""

from dataclasses import dataclass

import numpy as np

import kiln
from kiln import amd_asm, amd_buffer, mfma, mma
from kiln.amd.loader import TiledMmaLoader
from kiln.swizzle import Swizzle

from .. import runtime
from .fp8_hopper import scale_tensor_type

MMA_SHAPE = (32, 32, 64)
WAVE = 64
LDS_ROW_BYTES = 128
LOAD_BYTES = 16  # per lane per buffer load (dwordx4)
STAGES = 2
SCALE_BLOCK = 128


@dataclass(frozen=True)
class Fp8Gfx950Config:
    """Tile shape of :func:`make_fp8_gfx950_kernel`: ``warps_m x warps_n`` waves over a
    ``block_m x block_n`` tile, ``block_k`` 128 (one LDS row, one scale block). Example:
    ``Fp8Gfx950Config(block_m=256, warps_m=4)``."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    warps_m: int = 2
    warps_n: int = 2

    def __post_init__(self):
        m, n, _ = MMA_SHAPE
        rows = WAVE * LOAD_BYTES // LDS_ROW_BYTES * self.num_warps
        checks = ((self.block_m % (self.warps_m * m) == 0,
                   f"block_m={self.block_m} must be a multiple of warps_m * {m}"),
                  (self.block_n % (self.warps_n * n) == 0,
                   f"block_n={self.block_n} must be a multiple of warps_n * {n}"),
                  (self.block_k == LDS_ROW_BYTES, f"block_k={self.block_k} must be 128"),
                  (self.block_m % rows == 0 and self.block_n % rows == 0,
                   f"block_m and block_n must be multiples of {rows} (one load of all waves)"),
                  (self.lds_bytes <= 160 * 1024, f"{self.lds_bytes} bytes of LDS exceed 160 KiB"))
        for ok, message in checks:
            if not ok:
                raise kiln.KilnValueError(f"Fp8Gfx950Config: {message}",
                                          fix="start from Fp8Gfx950Config() and scale block_m/"
                                              "block_n with warps_m/warps_n")

    @property
    def num_warps(self) -> int:
        return self.warps_m * self.warps_n

    @property
    def lds_bytes(self) -> int:
        return STAGES * (self.block_m + self.block_n) * self.block_k


LDS_SWIZZLE = Swizzle(3, 4, 3)  # byte (= fp8 element) offsets: 16-byte chunk ^= row % 8
PIECE = WAVE * LOAD_BYTES  # elements one wave moves per load


def make_fp8_gfx950_kernel(dtype: str, out_dtype: str, scale_mode: tuple,
                           config: Fp8Gfx950Config, *, grouped: bool = False):
    """The ``@kiln.kernel`` with arguments ``(a, b, c, scale_a, scale_b, m, n, k)``: ``a`` M x K,
    ``b`` N x K (FP8), ``c`` M x N, the scales of ``scale_mode``; grid ``ceil(M/BM) *
    ceil(N/BN)``. Block scales need ``block_n = 128``. ``grouped``: the grouped (MoE) variant,
    arguments ``(a, b, c, offsets, scale_a, scale_b, groups, m, n, k, b_rows, ctas)`` and the
    ``TABLE`` constexpr (see :mod:`.grouped`)."""
    a_mode, b_mode = scale_mode
    block = a_mode == "block"
    if block and config.block_n != SCALE_BLOCK:
        raise kiln.KilnValueError(f"block scales need block_n={SCALE_BLOCK}, got "
                                  f"{config.block_n}", fix="use Fp8Gfx950Config(block_n=128)")
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    warps_n, waves = config.warps_n, config.num_warps
    wm, wn = bm // config.warps_m, bn // warps_n
    tiles_m, tiles_n = wm // MMA_SHAPE[0], wn // MMA_SHAPE[1]
    loader = TiledMmaLoader(in_type, MMA_SHAPE, swizzle=LDS_SWIZZLE)

    def load_tile(src, rows, origin, limits, wave, lane):
        """This wave's share of a ``rows x BK`` stage as 16-byte registers; a piece past K
        is redirected to row ``limits[0]`` (outside the buffer: zeros)."""
        pieces = []
        for i in kiln.static_range(rows * bk // (PIECE * waves)):
            element = (wave + i * waves) * PIECE + lane * LOAD_BYTES
            col = origin[1] + element % bk
            row = kiln.where(col < limits[1], origin[0] + element // bk, limits[0])
            pieces.append(src.load(row, col, width=LOAD_BYTES))
        return pieces

    def store_tile(pieces, lds, stage_row, wave, lane):
        for i, piece in enumerate(pieces):
            position = LDS_SWIZZLE((wave + i * waves) * PIECE + lane * LOAD_BYTES)
            lds.store(stage_row + position // bk, position % bk, piece)

    def k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom):
        acc = list(acc)
        for kk in kiln.static_range(bk // MMA_SHAPE[2]):
            k0 = kk * MMA_SHAPE[2]
            a_frags = loader.load_b(a_lds, n_tiles=tiles_m, n0=stage * bm + wave_m * wm, k0=k0)
            b_frags = loader.load_b(b_lds, n_tiles=tiles_n, n0=stage * bn + wave_n * wn, k0=k0)
            amd_asm.s_setprio(1)
            for i in kiln.static_range(tiles_m):
                for j in kiln.static_range(tiles_n):
                    # B A^T: the accumulator holds C^T (4-wide row stores, see the docs)
                    acc[i * tiles_n + j] = atom(b_frags[j], a_frags[i], acc[i * tiles_n + j])
            amd_asm.s_setprio(0)
        return acc

    def zeros():
        return [kiln.values.constant(0.0, kiln.f32, (16,)) for _ in range(tiles_m * tiles_n)]

    def lane_rows(m0, m, wave_m, lane):
        """This lane's C row in each row tile (clamped to ``m - 1``: edge rows are not
        stored), for the A scales."""
        return [kiln.minimum(m0 + wave_m * wm + i * 32 + lane % 32, m - 1)
                for i in range(tiles_m)]

    def block_step(total, a_lds, b_lds, stage, wave_m, wave_n, atom, row_scale, sb):
        """One 128-K scale block: its product from zero, promoted into ``total`` with
        ``sa[row, step] * sb``."""
        part = k_step(zeros(), a_lds, b_lds, stage, wave_m, wave_n, atom)
        factor = [r * sb for r in row_scale]
        return [total[t] + part[t] * factor[t // tiles_n] for t in range(tiles_m * tiles_n)]

    def epilogue_scale(acc, row_scale, col0, b_scale):
        """``acc * sa[row] * sb[col]``: ``b_scale(col)`` reads B's scale of a column (one value
        for per-tensor scales: ``b_scale(None)``)."""
        out = list(acc)
        for j in kiln.static_range(tiles_n):
            if b_mode == "col":  # value v: column 8 (v // 4) + v % 4 past the lane's first
                col_scale = kiln.pack([b_scale(col0 + j * 32 + 8 * (v // 4) + v % 4)
                                       for v in range(16)])
            else:
                col_scale = b_scale(None)
            for i in kiln.static_range(tiles_m):
                out[i * tiles_n + j] = acc[i * tiles_n + j] * (col_scale * row_scale[i])
        return out

    def store(total, c_buf, m0, n0, wave_m, wave_n, limits):
        for i in kiln.static_range(tiles_m):
            for j in kiln.static_range(tiles_n):
                mfma.store_accumulator(total[i * tiles_n + j], c_buf,
                                       m0 + wave_m * wm + i * MMA_SHAPE[0],
                                       n0 + wave_n * wn + j * MMA_SHAPE[1], transposed=True,
                                       limits=limits)

    def gemm_fp8_gfx950(a: kiln.Tensor[in_type, 2], b: kiln.Tensor[in_type, 2],
                        c: kiln.Tensor[out_type, 2], scale_a: scale_tensor_type(a_mode),
                        scale_b: scale_tensor_type(b_mode), m: kiln.i32, n: kiln.i32,
                        k: kiln.i32):
        a_lds = kiln.shared((STAGES * bm, bk), in_type)
        b_lds = kiln.shared((STAGES * bn, bk), in_type)
        a_buf, b_buf, c_buf = amd_buffer.buffer(a), amd_buffer.buffer(b), amd_buffer.buffer(c)
        atom = mma.atom(*MMA_SHAPE, in_type)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        wave_m, wave_n = wave // warps_n, wave % warps_n
        block_n_count = (n + bn - 1) // bn
        m0 = (kiln.block_id(0) // block_n_count) * bm
        n0 = (kiln.block_id(0) % block_n_count) * bn
        k_steps = (k + bk - 1) // bk
        rows = lane_rows(m0, m, wave_m, lane)
        acc = zeros()
        total = zeros()
        store_tile(load_tile(a_buf, bm, (m0, 0), (m, k), wave, lane), a_lds, 0, wave, lane)
        store_tile(load_tile(b_buf, bn, (n0, 0), (n, k), wave, lane), b_lds, 0, wave, lane)
        for step in kiln.range(k_steps):
            stage = step % STAGES
            k_next = (step + 1) * bk
            # Past the last step the loads read zeros (K >= k) and fill an unused stage.
            a_next = load_tile(a_buf, bm, (m0, k_next), (m, k), wave, lane)
            b_next = load_tile(b_buf, bn, (n0, k_next), (n, k), wave, lane)
            amd_asm.s_waitcnt(lgkmcnt=0)  # this wave's ds_writes of `step` are done ...
            amd_asm.s_barrier()            # ... and every wave's
            if block:
                total = block_step(total, a_lds, b_lds, stage, wave_m, wave_n, atom,
                                   [scale_a[r, step] for r in rows], scale_b[n0 // bn, step])
            else:
                acc = k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom)
            store_tile(a_next, a_lds, (1 - stage) * bm, wave, lane)
            store_tile(b_next, b_lds, (1 - stage) * bn, wave, lane)
        if not block:
            total = epilogue_scale(acc, [scale_a[r] if a_mode == "row" else scale_a[0]
                                         for r in rows], n0 + wave_n * wn + 4 * (lane // 32),
                                   lambda col: scale_b[0] if col is None else
                                   scale_b[kiln.minimum(col, n - 1)])
        store(total, c_buf, m0, n0, wave_m, wave_n, (m, n))

    gemm_fp8_gfx950.__name__ = gemm_fp8_gfx950.__qualname__ = \
        f"gemm_gfx950_{dtype}_{out_dtype}_{a_mode}_{b_mode}"
    if not grouped:
        return kiln.kernel(gemm_fp8_gfx950)
    from .grouped import build_tile_table, locate_tile

    threads = waves * WAVE

    def grouped_gemm_fp8_gfx950(a: kiln.Tensor[in_type, 2], b: kiln.Tensor[in_type, 2],
                                c: kiln.Tensor[out_type, 2], offsets: kiln.Tensor[kiln.i32, 1],
                                scale_a: scale_tensor_type(a_mode),
                                scale_b: kiln.Tensor[kiln.f32, 2], groups: kiln.i32,
                                m: kiln.i32, n: kiln.i32, k: kiln.i32, b_rows: kiln.i32,
                                ctas: kiln.i32, TABLE: kiln.constexpr):
        """The grouped FP8 GEMM (scales as in :mod:`.fp8_grouped`): the tile walk of the bf16
        grouped gfx950 kernel over B viewed as ``[G * b_rows, K]``, this kernel's K loop."""
        a_lds = kiln.shared((STAGES * bm, bk), in_type)
        b_lds = kiln.shared((STAGES * bn, bk), in_type)
        table = kiln.shared((TABLE,), kiln.i32)
        a_buf, b_buf = amd_buffer.buffer(a), amd_buffer.buffer(b)
        atom = mma.atom(*MMA_SHAPE, in_type)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        wave_m, wave_n = wave // warps_n, wave % warps_n
        tiles = (n + bn - 1) // bn
        n_blocks = (n + SCALE_BLOCK - 1) // SCALE_BLOCK
        build_tile_table(table, offsets, groups, tiles, kiln.thread_id(0), bm, TABLE, threads)
        num_tiles = table[groups]
        k_steps = (k + bk - 1) // bk
        b_limits = (groups * b_rows, k)  # past a row's K: the row past the whole array
        for tile in kiln.range(kiln.block_id(0), num_tiles, ctas):
            g, m0, n0, row_end = locate_tile(table, offsets, tile, tiles, bm, bn, 8, TABLE)
            b0 = g * b_rows + n0
            rows = lane_rows(m0, m, wave_m, lane)
            amd_asm.s_barrier()  # every wave has finished reading the previous tile's LDS
            acc = zeros()
            total = zeros()
            store_tile(load_tile(a_buf, bm, (m0, 0), (m, k), wave, lane), a_lds, 0, wave, lane)
            store_tile(load_tile(b_buf, bn, (b0, 0), b_limits, wave, lane), b_lds, 0, wave,
                       lane)
            for step in kiln.range(k_steps):
                stage = step % STAGES
                k_next = (step + 1) * bk
                a_next = load_tile(a_buf, bm, (m0, k_next), (m, k), wave, lane)
                b_next = load_tile(b_buf, bn, (b0, k_next), b_limits, wave, lane)
                amd_asm.s_waitcnt(lgkmcnt=0)
                amd_asm.s_barrier()
                if block:
                    total = block_step(total, a_lds, b_lds, stage, wave_m, wave_n, atom,
                                       [scale_a[r, step] for r in rows],
                                       scale_b[g * n_blocks + n0 // bn, step])
                else:
                    acc = k_step(acc, a_lds, b_lds, stage, wave_m, wave_n, atom)
                store_tile(a_next, a_lds, (1 - stage) * bm, wave, lane)
                store_tile(b_next, b_lds, (1 - stage) * bn, wave, lane)
            if not block:
                total = epilogue_scale(acc, [scale_a[r] if a_mode == "row" else scale_a[0]
                                             for r in rows],
                                       n0 + wave_n * wn + 4 * (lane // 32),
                                       lambda col: scale_b[g, 0] if col is None else
                                       scale_b[g, kiln.minimum(col, n - 1)])
            # C's rows past the group's end are outside this view, so their stores drop.
            end = kiln.minimum(row_end, m)
            c_buf = amd_buffer.buffer(c, valid_bytes=kiln.cast(kiln.maximum(end, 0), kiln.i64)
                                      * n * out_type.itemsize)
            store(total, c_buf, m0, n0, wave_m, wave_n, (end, n))

    grouped_gemm_fp8_gfx950.__name__ = grouped_gemm_fp8_gfx950.__qualname__ = \
        f"grouped_gemm_gfx950_{dtype}_{out_dtype}_{a_mode}_{b_mode}"
    return kiln.kernel(grouped_gemm_fp8_gfx950)


def compile_fp8_gfx950(dtype, *, target: str = "gfx950", out_dtype: str = "bf16",
                       scales=("tensor", "tensor"), **config):
    """Compile (without running) the gfx950 FP8 GEMM; returns the ``CompiledKernel``
    (``.asm["amdgcn"]``, ``.metadata["scratch_bytes"]``). Example:
    ``compile_fp8_gfx950("f8e4m3", scales=("block", "block")).metadata["vgpr_count"]``."""
    if str(target) != "gfx950":
        raise kiln.UnsupportedError(f"the FP8 MFMA GEMM uses v_mfma_f32_32x32x64_f8f6f4, which "
                                    f"{target} lacks", fix="compile for target='gfx950'")
    cfg = Fp8Gfx950Config(**config)
    a = np.empty((1, 1), kiln.dtype(dtype).numpy)
    c = np.empty((1, 1), kiln.dtype(out_dtype).numpy)
    sa, sb = (np.empty((1,) * (2 if s == "block" else 1), np.float32) for s in scales)
    return make_fp8_gfx950_kernel(kiln.dtype(dtype).name, out_dtype, tuple(scales), cfg).compile(
        a, a, c, sa, sb, 1, 1, 1, target=target, num_warps=cfg.num_warps)


def interpret_fp8_gfx950(args: list, dtype: str, out: str, mode: tuple) -> None:
    """Run the kernel in the CPU interpreter on host ``args`` (a, b, c, sa, sb, m, n, k)."""
    cfg = Fp8Gfx950Config()
    m, n = args[5], args[6]
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    runtime.interpret(make_fp8_gfx950_kernel(dtype, out, mode, cfg), (tiles, 1, 1), args,
                      target="gfx950", num_warps=cfg.num_warps)
