"""Hopper FP8 GEMM: TMA + WGMMA ``m64nNk32`` (e4m3/e5m2), warp-specialised, persistent grid.

``C[M, N] = (A[M, K] @ B[N, K]^T)`` with the scales of :mod:`.scales` applied, f32
accumulation, a bf16 or f32 output. FP8 WGMMA reads both operands K-major, so B is stored
``N x K`` (``matmul(..., trans_b=True)``); the entry points refuse K x N FP8 B.

The pipeline is the bf16 kernel's (:mod:`.hopper`): one producer warp group TMA-loads the A and
B boxes of each K step into a ring of ``stages`` 128B-swizzled buffers (``BK = 128`` one-byte
elements = one swizzled row), ``block_m / 64`` consumer warp groups (two, or three at
``block_m=192`` with 160 registers each) issue four ``wgmma.m64nNk32`` per stage.

Hopper's FP8 WGMMA adds its products with only ~14 mantissa bits in the tensor core
(DeepSeek-V3 §3.3.2), so every 128-K step, whatever the scales, starts a fresh accumulator
(four WGMMAs, the first with scale-d = 0), waits for it (``wait_group(0)``; the other
consumer's WGMMAs fill the tensor cores meanwhile), releases the stage and promotes it into an
f32 register total, as cuBLAS does without fast accumulation:

| scales (``scale_mode``) | promotion per 128-K step | epilogue |
| --- | --- | --- |
| ``("tensor" or "row", "tensor" or "col")`` | ``total += acc`` | ``total[r, c] *= sa[r] * sb[c]`` (one index for a per-tensor scale) before staging and TMA-storing the tile |
| ``("block", "block")`` (DeepSeek-V3) | ``total += acc * sa[r, kt] * sb[n0 / 128, kt]`` (the scales are loaded a step, or with ``overlap_steps`` a group, before their use, so their latency hides behind the WGMMAs) | ``total`` is staged and stored |

The accumulator and the total take ``block_n`` f32 registers per thread, hence
``block_n <= 192``.

With ``overlap_steps = G > 1`` (at ``block_n <= 128`` two accumulators and the total take
``3 * block_n / 2`` registers) a consumer takes K steps in groups of ``G`` on two
accumulators in turn: step ``t + 1``'s WGMMAs are issued before step ``t`` is waited for
(``wait_group(1)``) and promoted, so all but each group's last promotion run under this warp
group's own tensor-core work. A group is straight-line code and ends with ``wait_group(0)``:
with an accumulator in flight across the loop's back edge ptxas serialises every WGMMA
(C7514). Steps past the last whole group run the one-accumulator loop. Wider tiles
(``block_n=192``) split each step's WGMMAs into two half-width accumulators instead: the left
half is promoted while the right half runs, the right while the next step's left runs.

Block scaling on ``block_n = 128`` reads one B scale per step; a tile of 64 or 192 columns
straddles two 128-column B scale blocks, so it reads two and each 64-column chunk of the
accumulator multiplies by its own (:func:`promote`). Scale indices are clamped to the matrix
(rows/columns past the edge are never stored, K blocks past the end are loaded a group ahead
and never used), so no scale load needs a mask. With ``cluster_m=2`` CTAs run in pairs on
vertically adjacent tiles that share B, as in :mod:`.hopper`: each producer loads its A box
and one half of B (rows ``BN/2 * rank ..``) multicast to both CTAs; consumers release each
stage on both CTAs' ``empty`` barriers.
"""

import functools
from dataclasses import dataclass

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.nvidia.wgmma import keep_registers_live
from kiln.shared import dynamic_shared

from .epilogue import store_tile
from .hopper import ROW_BYTES, SWIZZLE, SWIZZLE_ALIGN, WARP_GROUP_THREADS, _tile_origin

FP8_K_STEP = 32  # K of one wgmma.m64nNk32: 32 bytes, two descriptor units
FP8_OUT_DTYPES = ("bf16", "f32")
SCALE_BLOCK = 128  # DeepSeek-V3 block: 1 x 128 for A, 128 x 128 for B
SHARED_BUDGET = 227 * 1024 - 1024 - 256  # as in .hopper: alignment slack and mbarriers
A_MODES = ("tensor", "row", "block")
B_MODES = ("tensor", "col", "block")
MAX_BLOCK_N = 192  # 256 would need 256 accumulator registers (acc + total): ptxas spills
MAX_DOUBLE_N = 128  # two accumulators and the total: 192 registers; wider tiles split N
REGISTER_FILE = 65536  # 32-bit registers per SM, shared by the warp groups (setmaxnreg)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles and pipeline of :func:`make_fp8_kernel`: ``block_m`` 64 per consumer warp group,
    ``block_n`` a multiple of 64 up to 192 (128 with block scales: the WGMMA accumulator and
    the promoted total take ``block_n`` f32 registers per thread), ``block_k`` 128 (one
    128-byte swizzled row of FP8, one scale block). ``block_m=192`` runs three consumer warp
    groups and needs registers that fit the SM (``consumer_registers=160,
    producer_registers=24``); ``overlap_steps`` (1, 2, 4 or 8) promotes each K step under the
    next one's WGMMAs (half a step's at ``block_n=192``; see the module docstring).
    ``split_n`` (the grouped kernel only, :mod:`.fp8_grouped`) with ``block_m=64``
    (``block_n`` 128 or 256) has two consumer warp groups share each tile's 64 rows, each taking
    half of its columns, so a group pads to 64 rows instead of 128; with ``block_m=128,
    block_n=128`` only a group's last tile, when it holds at most 64 rows, is split that way
    (the others split by rows as usual). Example:
    ``Fp8GemmConfig(block_n=128, stages=6, overlap_steps=4)``."""

    block_m: int = 128
    block_n: int = 192
    block_k: int = 128
    stages: int = 4
    group_m: int = 8
    producer_registers: int = 40
    consumer_registers: int = 232
    cluster_m: int = 1
    overlap_steps: int = 1
    split_n: bool = False

    def __post_init__(self):
        # split_n at block_m=64: half of block_n per consumer
        widest = 2 * SCALE_BLOCK if self.split_n and self.block_m == 64 else MAX_BLOCK_N
        checks = ((self.block_m in (64, 128, 192),
                   f"block_m={self.block_m} must be 64, 128 or 192"),
                  (not self.split_n or ((self.block_m, self.block_n) in
                                        ((64, 128), (64, 256), (128, 128))
                                        and self.cluster_m == 1 and self.overlap_steps == 1),
                   "split_n takes block_m=64 with block_n 128 or 256, or block_m=128 with "
                   "block_n=128, and no cluster_m or overlap_steps"),
                  (self.cluster_m in (1, 2), f"cluster_m={self.cluster_m} must be 1 or 2"),
                  (self.overlap_steps in (1, 2, 4, 8),
                   f"overlap_steps={self.overlap_steps} must be 1, 2, 4 or 8"),
                  (self.block_n % 64 == 0 and 64 <= self.block_n <= widest,
                   f"block_n={self.block_n} must be a multiple of 64 up to {widest} (the "
                   "accumulator and its promoted total share 232 registers)"),
                  (self.block_k == ROW_BYTES, f"block_k={self.block_k} must be {ROW_BYTES} "
                   "(one 128-byte swizzled row of FP8)"),
                  (2 <= self.stages <= 8, f"stages={self.stages} must be in 2..8"),
                  (self.consumers * self.consumer_registers + self.producer_registers
                   <= REGISTER_FILE // WARP_GROUP_THREADS,
                   f"{self.consumers} consumer warp groups of {self.consumer_registers} "
                   f"registers and a producer of {self.producer_registers} exceed the "
                   f"{REGISTER_FILE} registers of an SM (block_m=192: e.g. 160 and 24)"),
                  (self.group_m >= 1, f"group_m={self.group_m} must be >= 1"),
                  (self.ring_bytes + self.block_m * 32 <= SHARED_BUDGET,
                   f"{self.stages} stages of {self.ring_bytes // self.stages} bytes leave no "
                   "room for the epilogue in 227 KB of shared memory"))
        for ok, message in checks:
            if not ok:
                raise kiln.KilnValueError(f"Fp8GemmConfig: {message}",
                                          fix="start from Fp8GemmConfig() and change one field")

    @property
    def consumers(self) -> int:
        return 2 if self.split_n else self.block_m // 64

    @property
    def num_warps(self) -> int:
        return 4 * (self.consumers + 1)

    @property
    def ring_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * self.block_k

    def epilogue_columns(self, out_itemsize: int) -> int:
        """Columns of C staged per epilogue round: all of ``block_n`` when they fit beside the
        ring, else the largest slice of 128-byte tiles that does."""
        tile_cols = ROW_BYTES // out_itemsize
        slices = [c for c in range(self.block_n, 0, -tile_cols) if self.block_n % c == 0]
        return next((c for c in slices
                     if self.ring_bytes + self.block_m * c * out_itemsize <= SHARED_BUDGET),
                    slices[-1])


def fp8_constexprs(cfg: Fp8GemmConfig) -> dict:
    return dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages,
                GROUP_M=cfg.group_m, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers, CLUSTER_M=cfg.cluster_m)


def scale_tensor_type(mode: str):
    """The kernel parameter type of a scale of ``mode``: f32 ``[M]``/``[N]`` (one element for
    per tensor) or ``[rows, K blocks]`` for block scales."""
    return kiln.Tensor[kiln.f32, 2 if mode == "block" else 1]


@kiln.func
def thread_rows(row0):
    """(top, bottom) accumulator rows of this thread in its warp group's 64-row slice."""
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    top = row0 + (lane // 32) * 16 + (lane % 32) // 4
    return top, top + 8


def thread_columns(col0, bn: int) -> list:
    """The ``bn / 4`` accumulator columns of this thread, in register order: register ``i`` is
    column ``8 (i // 4) + i % 2`` past the thread's first (``i`` and ``i + 2`` share one)."""
    first = col0 + 2 * (kiln.thread_id(0) % 4)
    return [first + 8 * j + e for j in range(bn // 8) for e in range(2)]


def rescale(acc, row_scale: list, col_scale: list | None = None):
    """``acc`` (64 x BN) times ``row_scale[0]`` / ``[1]`` on the thread's top / bottom row and,
    if given, ``col_scale[q]`` on its column ``q`` (:func:`thread_columns` order)."""
    values = [acc.element(i) * row_scale[(i // 2) % 2] for i in range(acc.shape[1] // 2)]
    if col_scale is not None:
        values = [v * col_scale[(i // 4) * 2 + i % 2] for i, v in enumerate(values)]
    return wgmma.fragment_from_elements(values)


def block_scales(scale_a, scale_b, top, bottom, b_row, kb, b_next=None) -> list:
    """The raw scales of K block ``kb`` for this thread: ``[sa[top, kb], sa[bottom, kb],
    sb[b_row, kb]]``, and ``sb[b_next, kb]`` for a tile that spans two B scale blocks (loaded
    a block ahead of :func:`promote`, which multiplies them)."""
    scales = [scale_a[top, kb], scale_a[bottom, kb], scale_b[b_row, kb]]
    return scales if b_next is None else scales + [scale_b[b_next, kb]]


def promote(total, acc, scales: list | None = None, second_half=None, first: int = 0):
    """Promotion into f32 registers after one 128-K step (the tensor core accumulates FP8
    products with ~14 mantissa bits only): ``total + acc``, or ``fma(acc, sa[row, kb] *
    sb[kb], total)`` with block ``scales`` from :func:`block_scales`. ``acc`` may be the
    columns of ``total`` from register ``first`` on (a half-width accumulator).

    With four scales the tile's 64-column chunks straddle two B blocks: chunk ``c`` of a tile
    starting ``second_half`` (a traced bool: 64 columns into its 128-column block) lies in
    block ``(second_half + c) // 2``, so even chunks know their block and odd chunks select
    it once per step (DeepGEMM's two B scales per tile, at 64-column granularity)."""
    if scales is None:
        def add(j, x, t):
            return t + x
    elif len(scales) == 3:
        row_scale = [scales[0] * scales[2], scales[1] * scales[2]]

        def add(j, x, t):  # one FFMA: a .rn multiply and add are never fused, and cost twice
            return kiln.fma(x, row_scale[(j // 2) % 2], t)
    else:
        sb = scales[2:]
        chunk_scale = [sb[c // 2] if c % 2 == 0 else kiln.where(second_half, sb[1], sb[0])
                       for c in range(total.shape[1] // 64)]
        products = [[row * col for col in chunk_scale] for row in scales[:2]]

        def add(j, x, t):  # register j: column 8 (j // 4) + j % 2 (+ lane's), chunk j // 32
            return kiln.fma(x, products[(j // 2) % 2][j // 32], t)
    width = acc.shape[1] // 2
    return wgmma.fragment_from_elements([
        add(j, acc.element(j - first), total.element(j)) if first <= j < first + width
        else total.element(j) for j in range(total.shape[1] // 2)])


def scale_accumulator(acc, scale_a, scale_b, row0, col0, m, n, a_mode: str, b_mode: str):
    """``acc[r, c] * sa[r] * sb[c]`` for a 64 x BN accumulator at (row0, col0); a per-tensor
    scale reads its one element. Indices are clamped: edge rows/columns are never stored."""
    top, bottom = thread_rows(row0)
    rows = [scale_a[kiln.minimum(r, m - 1)] for r in (top, bottom)] if a_mode == "row" \
        else [scale_a[0]] * 2
    if b_mode == "tensor":
        sb = scale_b[0]
        return rescale(acc, [r * sb for r in rows])
    return rescale(acc, rows, [scale_b[kiln.minimum(c, n - 1)]
                               for c in thread_columns(col0, acc.shape[1])])


@functools.lru_cache(maxsize=None)
def make_fp8_kernel(dtype: str, out_dtype: str, scale_mode: tuple, config: Fp8GemmConfig):
    """The ``@kiln.kernel`` for FP8 ``dtype`` A and B (N x K), ``out_dtype`` C and the scales
    of ``scale_mode`` (``(a_mode, b_mode)``, see the module docstring).

    Run-time parameters: ``a_map`` (box BM x BK), ``b_map`` (box BN x BK), ``c_map`` (box
    64 x 128 bytes), ``scale_a``, ``scale_b`` (f32, :func:`scale_tensor_type`), ``m, n, k``.
    """
    a_mode, b_mode = scale_mode
    block = a_mode == "block"
    if config.split_n:
        raise kiln.UnsupportedError("split_n is a grouped-GEMM config (the dense kernel gives "
                                    "each consumer its own rows)",
                                    fix="use Fp8GemmConfig(split_n=False) for matmul")
    if block != (b_mode == "block") or a_mode not in A_MODES or b_mode not in B_MODES:
        raise kiln.KilnValueError(f"scale modes {scale_mode} do not combine",
                                  fix="use block scales for both operands, or per-tensor / "
                                      "per-row / per-column scales for both")
    # A tile of 64 or 192 columns straddles two B scale blocks: two B scales per step.
    wide = block and config.block_n != SCALE_BLOCK
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    c_cols = ROW_BYTES // out_type.itemsize
    epilogue_n = config.epilogue_columns(out_type.itemsize)
    c_tiles_per_round = epilogue_n // c_cols
    step_units = FP8_K_STEP // 16  # descriptor address units per k32 step
    pair = config.cluster_m
    b_box = (bn // pair, bk)  # in a pair, each CTA loads (and multicasts) one half of B

    def load_b(b_map, b_tiles, full, stage, k0, n0, rank):
        for j in range(pair):
            if pair == 1:
                tma.load(b_map, b_tiles.tile(stage), (k0, n0), full, stage)
            else:  # the halves stack into the stage's K-major BN x BK tile
                tma.load(b_map, b_tiles.tile(stage * pair + j), (k0, n0 + bn // pair * j), full,
                         stage, multicast_mask=(1 << pair) - 1, predicate=rank == j)

    def release(empty, stage, wgmma_pending):
        """Hand ``stage`` back to its producer(s): in a pair also the peer's, whose multicast B
        lands here too."""
        if pair == 1:
            empty.arrive(stage, wgmma_pending=wgmma_pending)
        else:
            for r in range(pair):
                empty.arrive_cluster(stage, r, wgmma_pending=wgmma_pending)

    def issue(acc, a_base, b_base, stage, half=None):
        """Four ``m64nNk32`` WGMMAs of one 128-K stage into a fresh accumulator (the first
        ignores ``acc``'s values), committed; with ``half`` (0 or 1) those of that half of
        the tile's columns (``acc`` is ``block_n / 2`` wide)."""
        stage64 = kiln.cast(stage, kiln.i64)
        a_desc = a_base + stage64 * (bm * bk // 16)  # descriptor address units
        b_desc = b_base + stage64 * (bn * bk // 16)
        if half:  # the second half's rows of the K-major B tile (whole 8-row swizzle atoms)
            b_desc = b_desc + bn // 2 * bk // 16
        wgmma.fence()
        for ks in kiln.static_range(bk // FP8_K_STEP):
            acc = wgmma.mma_async(acc, a_desc + ks * step_units, b_desc + ks * step_units,
                                  dtype=in_type, accumulate=ks > 0)
        wgmma.commit()
        return acc

    def step_scales(scale_a, scale_b, where, kt, k_tiles):
        """Block scales of K step ``kt`` (clamped: loads a group ahead run past the end) at
        ``where`` = (top row, bottom row, B scale row[, second half, next B scale row]); none
        (``()``) for epilogue-scaled modes."""
        if not where:
            return ()
        return block_scales(scale_a, scale_b, *where[:3], kiln.minimum(kt, k_tiles - 1),
                            where[4] if wide else None)

    def promote_step(total, acc, scales, where, first=0):
        if not where:
            return promote(total, acc, first=first)
        return promote(total, acc, scales, where[3] if wide else None, first)

    @kiln.func
    def mainloop_single(total, ahead, where, a_base, b_base, full, empty, use, first_thread,
                        scale_a, scale_b, k_first, k_tiles):
        """Steps ``k_first ..`` with one accumulator: each step's WGMMAs are waited for, then
        promoted (the other consumer's WGMMAs keep the tensor cores busy meanwhile)."""
        acc = wgmma.fragment_zeros(bn)
        for kt in kiln.range(k_first, k_tiles):
            stage = use % config.stages
            full.try_wait(stage, (use // config.stages) % 2)
            acc = issue(acc, a_base, b_base, stage)
            current = ahead  # load the next block's scales while these WGMMAs run
            ahead = step_scales(scale_a, scale_b, where, kt + 1, k_tiles)
            wgmma.wait_group(0)
            if first_thread:
                release(empty, stage, 0)
            total = promote_step(total, acc, current, where)
            use = use + 1
        return total, use

    @kiln.func
    def mainloop_grouped(total, where, a_base, b_base, full, empty, use, first_thread,
                         scale_a, scale_b, k_tiles):
        """Groups of ``overlap_steps`` steps on two accumulators in turn: step ``t + 1``'s
        WGMMAs run while step ``t`` is promoted, so all but a group's last promotion overlap
        this warp group's own tensor-core work. Nothing is in flight across the loop's back
        edge (ptxas serialises every WGMMA when a second accumulator is). A group's block
        scales are loaded one group ahead."""
        group = config.overlap_steps
        ahead = [step_scales(scale_a, scale_b, where, i, k_tiles) for i in range(group)]
        for g in kiln.range(0, k_tiles // group):
            kt = g * group
            current = ahead
            accs = [wgmma.fragment_zeros(bn), wgmma.fragment_zeros(bn)]
            stages = [(use + i) % config.stages for i in range(group)]
            full.try_wait(stages[0], (use // config.stages) % 2)
            accs[0] = issue(accs[0], a_base, b_base, stages[0])
            ahead = [step_scales(scale_a, scale_b, where, kt + group + i, k_tiles)
                     for i in range(group)]
            for i in kiln.static_range(1, group):
                full.try_wait(stages[i], ((use + i) // config.stages) % 2)
                accs[i % 2] = issue(accs[i % 2], a_base, b_base, stages[i])
                wgmma.wait_group(1)  # step i - 1 is done, step i runs on
                if first_thread:
                    release(empty, stages[i - 1], 1)
                total = promote_step(total, accs[(i - 1) % 2], current[i - 1], where)
            wgmma.wait_group(0)
            if first_thread:
                release(empty, stages[group - 1], 0)
            total = promote_step(total, accs[(group - 1) % 2], current[group - 1], where)
            use = use + group
        rest = k_tiles // group * group
        return mainloop_single(total, step_scales(scale_a, scale_b, where, rest, k_tiles),
                               where, a_base, b_base, full, empty, use, first_thread, scale_a,
                               scale_b, rest, k_tiles)

    def pinned(total):
        """``total``, computed here: LLVM would sink the promotion's additions past the next
        issue (into the block after a release branch), keeping both half accumulators live."""
        keep_registers_live([r.ir for r in total.registers()])
        return total

    @kiln.func
    def mainloop_split(total, where, a_base, b_base, full, empty, use, first_thread,
                       scale_a, scale_b, k_tiles):
        """Overlap for tiles too wide for two whole accumulators (``block_n > 128``): each
        step's WGMMAs go to two half-width accumulators, the left half's promoted while the
        right half runs and the right's while the next step's left runs; groups of
        ``overlap_steps`` steps as in :func:`mainloop_grouped` (only a group's last right
        half is promoted with nothing of this warp group in flight)."""
        group, half_n = config.overlap_steps, bn // 2
        ahead = [step_scales(scale_a, scale_b, where, i, k_tiles) for i in range(group)]
        for g in kiln.range(0, k_tiles // group):
            kt = g * group
            current = ahead
            stages = [(use + i) % config.stages for i in range(group)]
            full.try_wait(stages[0], (use // config.stages) % 2)
            left = issue(wgmma.fragment_zeros(half_n), a_base, b_base, stages[0], 0)
            right = issue(wgmma.fragment_zeros(half_n), a_base, b_base, stages[0], 1)
            ahead = [step_scales(scale_a, scale_b, where, kt + group + i, k_tiles)
                     for i in range(group)]
            for i in kiln.static_range(group):
                wgmma.wait_group(1)  # step i's left half is done, its right half runs on
                total = pinned(promote_step(total, left, current[i], where, 0))
                if i + 1 < group:
                    full.try_wait(stages[i + 1], ((use + i + 1) // config.stages) % 2)
                    left = issue(wgmma.fragment_zeros(half_n), a_base, b_base, stages[i + 1], 0)
                    wgmma.wait_group(1)  # step i's right half is done
                    total = pinned(promote_step(total, right, current[i], where, half_n // 2))
                    right = issue(wgmma.fragment_zeros(half_n), a_base, b_base, stages[i + 1],
                                  1)
                    if first_thread:  # after every read of stage i + 1 (the ring passes' rule)
                        release(empty, stages[i], 2)
                else:
                    wgmma.wait_group(0)
                    if first_thread:
                        release(empty, stages[i], 0)
                    total = promote_step(total, right, current[i], where, half_n // 2)
            use = use + group
        rest = k_tiles // group * group
        return mainloop_single(total, step_scales(scale_a, scale_b, where, rest, k_tiles),
                               where, a_base, b_base, full, empty, use, first_thread, scale_a,
                               scale_b, rest, k_tiles)

    def gemm_fp8(a_map: kiln.TensorMap[in_type, (bm, bk), SWIZZLE],
                 b_map: kiln.TensorMap[in_type, b_box, SWIZZLE],
                 c_map: kiln.TensorMap[out_type, (64, c_cols), SWIZZLE],
                 scale_a: scale_tensor_type(a_mode), scale_b: scale_tensor_type(b_mode),
                 m: kiln.i32, n: kiln.i32, k: kiln.i32,
                 BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
                 STAGES: kiln.constexpr, GROUP_M: kiln.constexpr, PRODUCER_REGS: kiln.constexpr,
                 CONSUMER_REGS: kiln.constexpr, CLUSTER_M: kiln.constexpr):
        if CLUSTER_M > 1:
            nvidia_asm.cluster_dims(CLUSTER_M)
        a_tiles = dynamic_shared((STAGES, BM, BK), in_type, align=SWIZZLE_ALIGN)
        b_tiles = dynamic_shared((STAGES * CLUSTER_M,) + b_box, in_type, align=SWIZZLE_ALIGN)
        c_tiles = dynamic_shared((BM // 64 * c_tiles_per_round, 64, c_cols), out_type,
                                 align=SWIZZLE_ALIGN)
        full = mbarrier.group(num_barriers=STAGES)
        empty = mbarrier.group(num_barriers=STAGES)
        tid = kiln.thread_id(0)
        warp_group = tid // WARP_GROUP_THREADS
        first_thread = tid % WARP_GROUP_THREADS == 0
        for s in kiln.static_range(STAGES):
            full.init(s, count=1, predicate=tid == 0)
            empty.init(s, count=BM // 64 * CLUSTER_M, predicate=tid == 0)
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
        num_tiles = tiles_m * tiles_n
        first_tile = kiln.block_id(0) // CLUSTER_M
        tile_step = kiln.num_blocks(0) // CLUSTER_M
        group_m = max(1, GROUP_M // CLUSTER_M)
        # All of B arrives on each CTA's barrier, half of it from the peer's multicast.
        stage_bytes = tma.box_bytes(a_map) + CLUSTER_M * tma.box_bytes(b_map)
        if warp_group == 0:
            nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
            if tid == 0:
                tma.prefetch_descriptor(a_map)
                tma.prefetch_descriptor(b_map)
                use = 0
                for tile in kiln.range(first_tile, num_tiles, tile_step):
                    m0, n0 = _tile_origin(tile, tiles_m, tiles_n, BM * CLUSTER_M, BN, group_m)
                    m0 = m0 + rank * BM
                    for kt in kiln.range(0, k_tiles):
                        stage = use % STAGES
                        empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                        full.arrive_expect_tx(stage, stage_bytes)
                        tma.load(a_map, a_tiles.tile(stage), (kt * BK, m0), full, stage)
                        load_b(b_map, b_tiles, full, stage, kt * BK, n0, rank)
                        use = use + 1
        else:
            nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
            consumer = warp_group - 1
            a_base = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                           byte_offset=consumer * 64 * ROW_BYTES)
            b_base = wgmma.smem_descriptor(b_tiles.tile(0), leading_bytes=16, stride_bytes=1024)
            use = 0
            for tile in kiln.range(first_tile, num_tiles, tile_step):
                m0, n0 = _tile_origin(tile, tiles_m, tiles_n, BM * CLUSTER_M, BN, group_m)
                row0 = m0 + rank * BM + consumer * 64
                total = wgmma.fragment_zeros(BN)
                where, ahead = (), ()
                if block:
                    top, bottom = thread_rows(row0)
                    top, bottom = kiln.minimum(top, m - 1), kiln.minimum(bottom, m - 1)
                    where = (top, bottom, n0 // SCALE_BLOCK)
                    if wide:
                        last_block = (n + SCALE_BLOCK - 1) // SCALE_BLOCK - 1
                        where = where + (n0 % SCALE_BLOCK >= 64,
                                         kiln.minimum(n0 // SCALE_BLOCK + 1, last_block))
                    if config.overlap_steps == 1 and wide:
                        ahead = step_scales(scale_a, scale_b, where, 0, k_tiles)
                    elif config.overlap_steps == 1:  # the 128-column path's PTX as before
                        ahead = block_scales(scale_a, scale_b, *where, 0)
                if config.overlap_steps > 1 and BN > MAX_DOUBLE_N:
                    total, use = mainloop_split(total, where, a_base, b_base, full, empty, use,
                                                first_thread, scale_a, scale_b, k_tiles)
                elif config.overlap_steps > 1:
                    total, use = mainloop_grouped(total, where, a_base, b_base, full, empty,
                                                  use, first_thread, scale_a, scale_b, k_tiles)
                else:
                    total, use = mainloop_single(total, ahead, where, a_base, b_base, full,
                                                 empty, use, first_thread, scale_a, scale_b, 0,
                                                 k_tiles)
                out = total if block else scale_accumulator(total, scale_a, scale_b, row0, n0,
                                                            m, n, a_mode, b_mode)
                store_tile(out, c_map, c_tiles, consumer, row0, n0, first_thread,
                           BN // epilogue_n, c_tiles_per_round, c_cols)
            if first_thread:
                tma.wait_group(0, read=True)  # the staging tiles must outlive the last store
        if CLUSTER_M > 1:
            nvidia_asm.cluster_sync()  # the peer may still arrive on this CTA's barriers

    gemm_fp8.__name__ = gemm_fp8.__qualname__ = \
        f"hopper_gemm_{dtype}_{out_dtype}_{a_mode}_{b_mode}"
    return kiln.kernel(gemm_fp8)
