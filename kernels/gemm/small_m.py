"""Decode-sized GEMMs (M <= 512): the config space, its autotuner and the untuned heuristic.

At small M a GEMM reads all of B once and little else, so it is memory-bound: what matters
is that every SM streams B with enough bytes in flight. The default 128 x 256 tiling gives
``ceil(N / 256)`` CTAs (16 at N = 4096, for 132 SMs); the configs here use narrower tiles,
split-K (:mod:`.splitk`) so that ``tiles * slices`` fills the GPU, deep rings (small stages),
and swap-AB when B is stored N x K, so an M of 1..64 pads to a 32- or 64-column WGMMA N
instead of a 64-row M.

``matmul`` picks, for M <= :data:`SMALL_M`, the config the small-M autotuner stored for the
shape (``tune_small_m``, e.g. run by ``bench/gemm.py --llm --tune``), else
:func:`heuristic_config` without timing anything: decode sees many distinct M, and tuning
each on first use would stall serving. Example::

    cfg = heuristic_config(16, 4096, 4096, "k", sms=132)  # swap-AB, 32 wide, 4 K slices
"""

from __future__ import annotations

from kiln.autotune import autotune

from .hopper import HopperGemmConfig

SMALL_M = 512
DEFAULT_SMS = 132  # H100/H200 SXM: the heuristic's SM count where no GPU is asked
MIN_SLICE_STEPS = 4  # K steps (of 64) per slice: shorter slices cost more in partials
FULL_WAVE = 0.75  # tiles / SMs above which splitting K no longer pays

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
    C(block_n=128, stages=6, split_k=4), C(),
    # The same, reducing in the GEMM kernel (no second launch).
    C(block_n=32, stages=8, swap_ab=True, fused_reduce=True),
    C(block_n=32, stages=8, swap_ab=True, split_k=4, fused_reduce=True),
    C(block_n=32, stages=8, swap_ab=True, split_k=8, fused_reduce=True),
    C(block_n=64, stages=8, swap_ab=True, split_k=2, fused_reduce=True),
    C(block_m=64, block_n=128, stages=8, split_k=4, fused_reduce=True),
    C(block_n=128, stages=6, split_k=2, fused_reduce=True))
del C


def heuristic_config(m: int, n: int, k: int, b_major: str, *, sms: int) -> HopperGemmConfig:
    """A sensible untuned config for ``m <= SMALL_M``: swap-AB for M <= 64 with B stored
    N x K, 64-row tiles for M <= 64 otherwise, 128-row tiles above; then as many K slices as
    keep ``tiles * slices`` within one wave of ``sms`` and each slice 4+ K steps.
    Example: ``heuristic_config(1, 14336, 4096, "k", sms=132).swap_ab``."""
    k_tiles = -(-k // 64)
    if m <= 64 and b_major == "k":
        shape = dict(block_m=128, block_n=32 if m <= 32 else 64, stages=8, swap_ab=True)
        tiles = -(-n // 128)
    elif m <= 64:
        shape = dict(block_m=64, block_n=128, stages=8)
        tiles = -(-n // 128)
    else:
        shape = dict(block_m=128, block_n=128, stages=6)
        tiles = -(-m // 128) * -(-n // 128)
    split = 1
    if tiles < FULL_WAVE * sms:
        split = max(1, min(16, sms // tiles, k_tiles // MIN_SLICE_STEPS))
    # Partials are summed by the last slice of each tile to finish: one launch, not two.
    return HopperGemmConfig(split_k=split, fused_reduce=split > 1 or shape.get("swap_ab", False),
                            **shape)


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
