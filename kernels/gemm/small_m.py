"""Decode-sized GEMMs (M <= 512): the config space, its autotuner and the untuned heuristic.

At small M a GEMM reads all of B once and little else, so it is memory-bound: what matters
is that every SM streams B with enough bytes in flight. The default 128 x 256 tiling gives
``ceil(N / 256)`` CTAs (16 at N = 4096, for 132 SMs); the configs here use narrower tiles,
split-K (:mod:`.splitk`) so that ``tiles * slices`` fills the GPU, deep rings (small stages),
and swap-AB when B is stored N x K, so an M of 1..32 pads to a 32-column WGMMA N instead of
a 64-row M; at M = 1 (B stored N x K) the GEMV of :mod:`.gemv`, which pads nothing, and
at M of 5..16 over few tiles of short K its tensor-core form (:mod:`.gemv_mma`).

``matmul`` picks, for M <= :data:`SMALL_M`, the config the small-M autotuner stored for the
shape (``tune_small_m``, e.g. run by ``bench/gemm.py --llm --tune``), else
:func:`heuristic_config` without timing anything: decode sees many distinct M, and tuning
each on first use would stall serving. Example::

    cfg = heuristic_config(1, 4096, 4096, "k", sms=132)  # the GEMV
    cfg = heuristic_config(2, 4096, 4096, "k", sms=132)  # swap-AB, 32 wide, 4 K slices
    cfg = heuristic_config(16, 4096, 4096, "k", sms=132)  # the tensor-core GEMV
    cfg = heuristic_config(256, 4096, 4096, "k", sms=132)  # 64 x 128 tiles, one wave
"""

from __future__ import annotations

import dataclasses

from kiln.autotune import autotune

from . import gemv_mma
from .hopper import HopperGemmConfig

SMALL_M = 512
DEFAULT_SMS = 132  # H100/H200 SXM: the heuristic's SM count where no GPU is asked
MIN_SLICE_STEPS = 16  # K steps (of 64) per slice: shorter slices were slower on an H100
WAVE = 0.7  # a tile shape "fills the GPU" with at least this many tiles per SM
ONE_WAVE = 0.8  # swap-AB gives way to 64 x 256 tiles that make one near-full wave
SPLIT_TILES = 3  # 64 x 128 tiles split K only when there are at most sms / 3 of them
SWAP_M = 32  # swap-AB (32 columns) up to this M; above, 64-row tiles were faster
# Swap-AB tiles over all of K, each stored straight into C (one launch, no partials), for K of
# at most DIRECT_STEPS steps and tile counts in these fractions of the SMs (128-row tiles for
# M <= 32, 64-row ones for M of 33..64). Measured on an H200 (kernel time vs cuBLAS):
# Llama-3-70B O M = 16 (64 tiles) 0.995 vs 0.887 split in two; outside the bounds they lost:
# 80 tiles (70B QKV M = 16) 0.846 vs 1.043 whole K through the reduction, 64 of 64 rows
# (8B O M = 64) 0.645 vs 0.788, and at K = 14336 with 32 tiles 0.647.
DIRECT_STEPS = 128
DIRECT_TILES = (1 / 3, 1 / 2)
DIRECT_TILES_64 = (1 / 2, 1)
# 192-row swap-AB tiles for few tiles over long K up to this M: measured faster at M = 1, level
# at M = 16 (Llama-3-8B down: 0.949 vs 0.952 of cuBLAS), where 128-row tiles stay
WIDE_SWAP_M = 8
# K steps from which M of 129..512 takes 128 x 128 tiles split in two over 64-row tiles whole
# (Llama-3-8B down, K = 14336, M = 256: 0.942 vs 0.897 of cuBLAS on an H200)
LONG_K_STEPS = 128
# 128-row tiles of odd multiples of 32 columns (B stored N x K) with their stages, for M of
# 65..512: taken where one fills at least ODD_FILL of its last wave and scores (wave use times
# intensity, block_n / (128 + block_n)) ODD_MARGIN above every 64-multiple width. Measured on
# an H200 (kernel time vs cuBLAS): Llama-3-70B QKV M = 256, 128 x 160: 0.947 vs 0.877 for
# 128 x 192; 8B gate/up M = 512, 128 x 224: 0.952 vs 0.901 (3 stages: 0.924); 128 x 96 lost
# at 8B QKV M = 256 (0.820 vs 0.832 for 128 x 128), so it is not among them.
ODD_WIDTHS = ((224, 4), (160, 4))
EVEN_WIDTHS = (256, 192, 128)
ODD_FILL = 0.9
ODD_MARGIN = 1.05
# From this M, 64 x 256 tiles replace as many 128 x 128 ones (one wave)
HALF_ROWS_M = 256
# 128 x 128 tiles of one wave under this fraction of the SMs are programmatic launches
PDL_WAVE = 0.8
# Whole-tile shapes (block_m, block_n, stages), largest first: the first that fills the GPU.
TILE_SHAPES = ((128, 256, 4), (128, 128, 6), (64, 256, 4), (64, 128, 8))

C = HopperGemmConfig
SMALL_M_CONFIGS = (
    # swap-AB (B stored N x K): M pads to WGMMA N = 32 or 64.
    C(block_n=32, stages=8, swap_ab=True), C(block_n=32, stages=8, swap_ab=True, split_k=2),
    C(block_n=32, stages=8, swap_ab=True, split_k=4),
    C(block_n=32, stages=8, swap_ab=True, split_k=8),
    C(block_n=64, stages=8, swap_ab=True), C(block_n=64, stages=8, swap_ab=True, split_k=2),
    C(block_n=64, stages=8, swap_ab=True, split_k=4),
    # 64-row tiles, any B layout.
    C(block_m=64, block_n=128, stages=8), C(block_m=64, block_n=128, stages=8, split_k=2),
    C(block_m=64, block_n=128, stages=8, split_k=4),
    C(block_m=64, block_n=256, stages=4), C(block_m=64, block_n=256, stages=4, split_k=2),
    # 128-row tiles for M of 65..512.
    C(block_n=128, stages=6), C(block_n=128, stages=6, split_k=2),
    C(block_n=128, stages=6, split_k=4), C(), C(block_n=192),
    # Reducing in the GEMM kernel (one launch). Measured slower than the reduction kernel on
    # an H100 while every slice published its whole f32 tile; now only in-bounds elements.
    C(block_n=32, stages=8, swap_ab=True, split_k=4, fused_reduce=True),
    C(block_m=64, block_n=128, stages=8, split_k=4, fused_reduce=True),
    # Stream-K (:mod:`.streamk`): every SM an equal share of the K steps, one launch.
    C(block_n=32, stages=8, swap_ab=True, stream_k=True),
    C(block_m=64, block_n=128, stages=8, stream_k=True), C(block_n=128, stages=6, stream_k=True),
    # swap-AB over all of K storing C directly (one launch, no workspace)
    C(block_n=32, stages=8, swap_ab=True, fused_reduce=True),
    C(block_m=64, block_n=64, stages=12, swap_ab=True, fused_reduce=True),
    # one wave of 128 x 192 tiles, its prologue overlapping the kernel before
    C(block_n=192, pdl=True),
    # few 192-row swap-AB tiles over long K, 4 slices (3 consumer warp groups)
    C(block_m=192, block_n=32, stages=6, consumer_registers=152, swap_ab=True, split_k=4),
    # the decode GEMV (:mod:`.gemv`; M <= 16, B stored N x K): no tile padding M to 32
    C(gemv=True),
    # odd multiples of 32 columns (B stored N x K): tile counts that fill the last wave
    C(block_n=160), C(block_n=224), C(block_n=160, cluster_m=2),
    # one partial wave of 128 x 128 tiles, launched programmatically
    C(block_n=128, stages=6, pdl=True))
# Programmatic dependent launches of the partials configs (what the heuristic runs).
SMALL_M_CONFIGS += tuple(dataclasses.replace(c, pdl=True) for c in SMALL_M_CONFIGS
                         if c.partials)
del C


def heuristic_config(m: int, n: int, k: int, b_major: str, *, sms: int) -> HopperGemmConfig:
    """A sensible untuned config for ``m <= SMALL_M``, fitted to per-config timings of the
    Llama-3-8B and -70B layers at M of 1, 16, 64 and 256 on an H200
    (``bench/gemm_config_sweep.py``):

    0. M = 1 with B stored N x K: the GEMV (``gemv=True``; kernel time vs cuBLAS on an H200,
       against the tile configs below: Llama-3-8B QKV 1.267 vs 0.976, O 1.525 vs 0.884,
       gate/up 1.040 vs 0.938, down 0.951 vs 0.950; 70B QKV 1.121 vs 0.951, O 0.990 vs
       0.951, gate/up 1.053 vs 1.000, down 1.053 vs 1.001; at M = 4 it lost everywhere);
    1. M <= 32 with B stored N x K: 64 x 256 tiles if they make one near-full wave
       (``0.8 * sms .. sms``); else swap-AB 128 x 32 tiles, with stream-K when there are at
       least ``sms`` of them; over all of K with C stored directly (``fused_reduce``, one
       launch) when there are ``sms / 3 .. sms / 2`` and K has at most 128 steps (Llama-3-70B
       O M = 1 / 16: 0.973 / 0.995 of cuBLAS vs 0.920 / 0.887 split in two; 8B QKV M = 1 / 16:
       0.898 / 0.938 vs 0.874 / 0.928); for M <= 8 with fewer than ``sms / 3`` and K over 128
       steps, swap-AB 192 x 32 tiles in ``sms // tiles`` K slices (Llama-3-8B down M = 1:
       0.964 vs 0.946 for 128 x 32 tiles in 4); for M of 5..16 with fewer than ``sms / 3``
       tiles and K of at most 128 steps, the tensor-core GEMV (``gemv=True``,
       :mod:`.gemv_mma`; Llama-3-8B O M = 16 / 8: 0.960 / 1.017 vs 0.923 / 0.826); else
       128 x 32 tiles split
       into ``sms // tiles`` K slices (a power of two, slices of at least 16 steps);
    2. M of 33..64, B stored N x K: swap-AB 64 x 64 tiles over all of K, C stored directly,
       when ``sms / 2 .. sms`` of them and K of at most 128 steps (Llama-3-8B QKV M = 64:
       0.978 vs 0.905 for 64 x 128 tiles; 70B O: 1.032 vs 1.000);
    3. M of 65..512, B stored N x K: 128 x 224 or 128 x 160 tiles where they fill at least
       0.9 of their last wave and beat the 64-multiple widths by 5 % in wave use times
       intensity (:data:`ODD_WIDTHS`: Llama-3-70B QKV M = 256, 0.947 vs 0.877 for 128 x 192;
       8B gate/up M = 512, 0.952 vs 0.901);
    4. the largest tile of :data:`TILE_SHAPES` (only 64-row ones for M <= 64) that makes at
       least ``0.7 * sms`` tiles, without splitting K; but 128 x 192 for 128 x 256 where its
       last wave is fuller (Llama-3-8B gate/up M = 512: 0.915 vs 0.88 of cuBLAS), and for
       M of 129..512 with K of at least 128 steps, 128 x 128 tiles in 2 K slices instead of
       64-row tiles when that makes at most ``sms`` units; and one wave of 128 x 192 tiles
       (``pdl``) rather than 128 x 128 ones that would take a second wave or 128 x 256 ones
       under ``0.7 * sms`` (Llama-3-70B QKV M = 256 before 3: 0.877 vs 0.735 for 128 x 256);
       above M = 256, 64 x 256 tiles instead of as many 128 x 128 ones in one wave
       (Llama-3-8B O / down M = 512: 0.946 / 0.930 vs 0.920 / 0.920); 128 x 128 tiles under
       ``0.8 * sms`` (one partial wave) with ``pdl`` (8B QKV M = 256: 0.868 vs 0.832);
    5. else 64 x 128 tiles, K split as in 1 only when they are at most ``sms / 3``.

    Configs with a second (reduction) kernel or an in-kernel fix-up are programmatic
    dependent launches (``pdl``): 1 to 3 us less GPU time per call at Llama-3-8B O M = 64 and
    down M = 1 on an H200 (``bench/gemm_ab.py``); whole-tile configs are not (64 x 256 tiles
    at gate/up M = 1 measured 5 % slower with it) but for the one-wave 128 x 192 and
    partial-wave 128 x 128 tiles of 4.
    Ratios are kernel-only GPU times on an H200 (``bench/gemm_ab.py``, interleaved samples).

    Example: ``heuristic_config(2, 4096, 4096, "k", sms=132)`` is swap-AB with 4 K slices."""
    steps = -(-k // 64)
    if m == 1 and b_major == "k":
        return HopperGemmConfig(gemv=True)
    if m <= SWAP_M and b_major == "k":
        if ONE_WAVE * sms <= -(-n // 256) <= sms:
            return HopperGemmConfig(block_m=64, block_n=256, stages=4)
        tiles = -(-n // 128)
        if tiles >= sms:
            return HopperGemmConfig(block_n=32, stages=8, swap_ab=True, stream_k=True, pdl=True)
        if _direct(tiles, DIRECT_TILES, steps, sms):
            return HopperGemmConfig(block_n=32, stages=8, swap_ab=True, fused_reduce=True,
                                    pdl=True)
        if m <= WIDE_SWAP_M and 3 * tiles < sms and steps > DIRECT_STEPS:
            # few tiles, long K: 192-row tiles in fewer, longer slices (Llama-3-8B down M = 1:
            # 88 units, 0.964 / 0.996 of cuBLAS in two runs vs 0.946 / 0.951 for 128 x 32)
            wide_tiles = -(-n // 192)
            return HopperGemmConfig(block_m=192, block_n=32, stages=6, consumer_registers=152,
                                    swap_ab=True, split_k=_slices(sms // wide_tiles, steps),
                                    pdl=True)
        if gemv_mma.MIN_ROWS <= m <= gemv_mma.MAX_ROWS and 3 * tiles < sms and \
                steps <= DIRECT_STEPS:
            # few tiles over short K: the tensor-core GEMV, not K slices through the reduction
            # (Llama-3-8B O M = 16 / 8: 0.960 / 1.017 of cuBLAS vs 0.923 / 0.826 for 128 x 32
            # tiles in 4, one H200 run; 0.953 vs 0.839 at M = 16 in another)
            return HopperGemmConfig(gemv=True)
        return HopperGemmConfig(block_n=32, stages=8, swap_ab=True,
                                split_k=_slices(sms // tiles, steps), pdl=True)
    if m <= 64 and b_major == "k" and _direct(-(-n // 64), DIRECT_TILES_64, steps, sms):
        return HopperGemmConfig(block_m=64, block_n=64, stages=12, swap_ab=True,
                                fused_reduce=True, pdl=True)
    if m > 64 and b_major == "k" and (odd := _odd_width(m, n, sms)) is not None:
        return odd
    wide = -(-m // 128) * -(-n // 256)  # 128 x 256 tiles
    for block_m, block_n, stages in TILE_SHAPES:
        tiles = -(-m // block_m) * -(-n // block_n)
        if (block_m, block_n) == (128, 128) and m > 64 and tiles > sms >= wide:
            # one wave of 128 x 192 tiles (4/3 of the 128 x 256 ones, under 0.7 * sms), not
            # two of 128 x 128
            return HopperGemmConfig(block_n=192, pdl=True)
        if (block_m == 64 or m > 64) and tiles >= WAVE * sms:
            if (block_m, block_n) == (128, 256) and \
                    _wave_use(-(-m // 128) * -(-n // 192), sms) > _wave_use(tiles, sms):
                return HopperGemmConfig(block_n=192)  # a fuller last wave
            if (block_m, block_n) == (128, 128) and m > HALF_ROWS_M and tiles <= sms and \
                    -(-m // 64) * -(-n // 256) == tiles:
                # as many 64 x 256 tiles (one consumer's m64n256 WGMMAs): Llama-3-8B O / down
                # M = 512: 0.946 / 0.930 of cuBLAS vs 0.920 / 0.920 for 128 x 128
                return HopperGemmConfig(block_m=64, block_n=256, stages=4)
            if (block_m, block_n) == (128, 128) and tiles < PDL_WAVE * sms:
                # a partial wave: the next kernel's prologue runs on the idle SMs (Llama-3-8B
                # QKV M = 256, 96 tiles: 0.868 vs 0.832; at 128 tiles it lost, 0.890 vs 0.919)
                return HopperGemmConfig(block_n=128, stages=6, pdl=True)
            if block_m == 64 and m > 128 and steps >= LONG_K_STEPS:
                pair_tiles = -(-m // 128) * -(-n // 128)  # 128 x 128 tiles, K split in two
                if 2 * pair_tiles <= sms:
                    return HopperGemmConfig(block_n=128, stages=6, split_k=2, pdl=True)
            return HopperGemmConfig(block_m=block_m, block_n=block_n, stages=stages)
    tiles = -(-m // 64) * -(-n // 128)
    split = _slices(sms // tiles, steps) if tiles * SPLIT_TILES <= sms else 1
    return HopperGemmConfig(block_m=64, block_n=128, stages=8, split_k=split, pdl=split > 1)


def _odd_width(m: int, n: int, sms: int) -> HopperGemmConfig | None:
    """128-row tiles of an :data:`ODD_WIDTHS` width where they fill the last wave and score
    :data:`ODD_MARGIN` above the 64-multiple widths (see :data:`ODD_WIDTHS`), else None."""
    def fill(width):
        return _wave_use(-(-m // 128) * -(-n // width), sms)

    def score(width):
        return fill(width) * width / (128 + width)

    even = max(score(width) for width in EVEN_WIDTHS)
    best, stages = max(ODD_WIDTHS, key=lambda ws: score(ws[0]))
    if fill(best) >= ODD_FILL and score(best) > ODD_MARGIN * even:
        return HopperGemmConfig(block_n=best, stages=stages)
    return None


def _direct(tiles: int, share: tuple, steps: int, sms: int) -> bool:
    """Whether ``tiles`` swap-AB tiles run over all of K storing C directly: their count within
    ``share`` of the SMs and K at most :data:`DIRECT_STEPS` steps."""
    return share[0] * sms <= tiles <= share[1] * sms and steps <= DIRECT_STEPS


def _wave_use(tiles: int, sms: int) -> float:
    """The fraction of ``ceil(tiles / sms)`` waves of ``sms`` CTAs that has a tile to run."""
    return tiles / (-(-tiles // sms) * sms)


def _slices(wanted: int, steps: int) -> int:
    """K slices: ``wanted`` at most, each of at least MIN_SLICE_STEPS steps, at most 16, a
    power of two (the measured factors)."""
    split = max(1, min(16, wanted, steps // MIN_SLICE_STEPS))
    return 1 << (split.bit_length() - 1)


def chosen_config(m: int, n: int, k: int, dtype: str, b_major: str, out_dtype: str, *,
                  sms: int = DEFAULT_SMS) -> HopperGemmConfig | None:
    """The config ``matmul`` runs for a small ``m``: the small-M autotuner's stored choice for
    this shape, else :func:`heuristic_config`; None when ``m > SMALL_M`` (the large-GEMM
    autotuner decides)."""
    if m > SMALL_M:
        return None
    stored = small_m_autotuner.cached((None, None, None, m, n, k, dtype, b_major, out_dtype,
                                       None), {})
    return stored or heuristic_config(m, n, k, b_major, sms=sms)


def _compile(config, a, b, c, m, n, k, dtype, b_major, out_dtype, target):
    from . import compile_matmul  # the package's compile entry; it imports this module

    compile_matmul(dtype, target=target, out_dtype=out_dtype, trans_b=b_major == "k",
                   **vars(config))


@autotune(configs=SMALL_M_CONFIGS, key=["m", "n", "k", "dtype", "b_major", "out_dtype"],
          precompile=_compile)
def small_m_autotuner(a, b, c, m, n, k, dtype, b_major, out_dtype, target, *, config):
    """Runs one small-M config (the tuner times each; see :func:`tune_small_m`)."""
    from . import run_hopper  # the package's launcher; it imports this module

    run_hopper(a, b, c, m, n, k, dtype=dtype, b_major=b_major, target=target, config=config)


def tune_small_m(a, b, c, m, n, k, dtype, b_major, out_dtype, target) -> HopperGemmConfig:
    """Time every :data:`SMALL_M_CONFIGS` entry on prepared operands (as ``run_hopper``
    takes them), store the winner for ``matmul`` and return it."""
    small_m_autotuner(a, b, c, m, n, k, dtype, b_major, out_dtype, target)
    return small_m_autotuner.cached((a, b, c, m, n, k, dtype, b_major, out_dtype, target), {})
