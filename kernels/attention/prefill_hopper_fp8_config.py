"""Tiles of the Hopper FP8 prefill kernel (:mod:`.prefill_hopper_fp8`): ``HopperFp8PrefillConfig``.

FP8 rows are one byte per element, so one 128-byte swizzled TMA box holds 128 head-dim
columns (the bf16 kernel's boxes hold 64) and one ``wgmma.m64nNk32`` step reads 32 of them.
Q/K and V run at the next multiple of 128 columns (``qk_width``, ``v_width``); head dims that
are not one are read through the 3-D ``[rows, heads, D]`` TMA view whose columns past ``D``
land as zeros, as in :mod:`.prefill_config`. V's transpose ``Vt[d, key]`` holds 128 keys per
128-byte swizzled row (``block_n`` past 128: a second box of rows for the keys past 128).

Shared memory: the Q tile (which also stages the bf16 O), ``stages`` K tiles and V^T tiles
(read by the WGMMAs), and ``raw_stages`` V tiles as TMA lands them (read by the transposing
producer warp group only). Example::

    cfg = HopperFp8PrefillConfig.for_head_dim(128)
    (cfg.qk_width, cfg.v_width, cfg.block_n, cfg.stages)   # (128, 128, 192, 2)
"""

from dataclasses import dataclass

import kiln

from .prefill_config import MAX_HEAD_DIM, SHARED_BUDGET, HeadDimTiles

FP8_CHUNK_COLS = 128  # FP8 head-dim columns per 128-byte swizzled box
FP8_K_STEP = 32  # K of one wgmma.m64nNk32
FP8_BLOCK_N = 128  # keys per tile: one 128-byte row of V^T
NARROW_BLOCK_N = 192  # keys per tile where Q/K and O are at most 128 wide (fewer per-tile syncs)
FP8_HEAD_DIM_MULTIPLE = 16  # TMA strides are 16-byte multiples: D * 1 byte
FP8_DTYPES = ("f8e4m3",)
OUT_ITEMSIZE = 2  # bf16 output
LAUNCH_REGISTERS = 168  # per thread of a 384-thread CTA: 65536 / 384, in units of 8


def check_fp8_head_dim(name: str, d) -> None:
    """A KilnError naming ``name`` unless ``d`` is a multiple of 16 in 16..256 (FP8 rows must
    be 16-byte multiples for TMA). Example: ``check_fp8_head_dim("head_dim", 128)`` passes."""
    if not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= MAX_HEAD_DIM \
            or d % FP8_HEAD_DIM_MULTIPLE:
        raise kiln.UnsupportedError(f"{name}={d!r} is not supported by the FP8 Hopper prefill "
                                    "kernel", fix=f"use a multiple of {FP8_HEAD_DIM_MULTIPLE} "
                                                  f"up to {MAX_HEAD_DIM}")


def fp8_tile_width(d: int) -> int:
    """Columns the FP8 kernel computes for head dim ``d``: the next multiple of 128."""
    return -(-d // FP8_CHUNK_COLS) * FP8_CHUNK_COLS


def vt_boxes(block_n: int) -> int:
    """128-key (128-byte) boxes of one V^T tile: its rows hold ``block_n`` keys."""
    return -(-block_n // FP8_CHUNK_COLS)


def fp8_shared_bytes(head_dim: int, dv: int, stages: int, raw_stages: int,
                     block_n: int = FP8_BLOCK_N) -> int:
    """Dynamic shared memory of the FP8 kernel: the Q tile (which later stages the bf16 O
    rows, so the larger of the two), ``stages`` K and V^T tiles (whole 128-key boxes),
    ``raw_stages`` V tiles."""
    qk, v = fp8_tile_width(head_dim), fp8_tile_width(dv)
    q_region = HopperFp8PrefillConfig.block_m * max(qk, v * OUT_ITEMSIZE)
    vt = vt_boxes(block_n) * FP8_CHUNK_COLS * v
    return q_region + stages * (block_n * qk + vt) + raw_stages * block_n * v


@dataclass(frozen=True)
class HopperFp8PrefillConfig(HeadDimTiles):
    """Tiles and pipeline of :func:`~.prefill_hopper_fp8.make_fp8_kernel`: ``head_dim`` of
    Q/K, ``head_dim_v`` of V and O (None: ``head_dim``), ``stages`` K and V^T buffers,
    ``raw_stages`` V buffers before the transpose, registers per thread of the producer (40: its
    transpose loop spills in the bf16 kernel's 24) and of the two consumer groups (232: the
    three groups share the 3 x 168 registers a thread of the 384-thread launch gets, and
    ``setmaxnreg.inc`` waits forever for registers the CTA was never given);
    ``lazy_rescale`` / ``exp_before_max`` as in :class:`~.prefill_config.HopperPrefillConfig`
    (P stays below ``2**8``, inside e4m3's 448); ``transpose_batch``: units of V's
    transpose whose loads issue before their stores (4 registers each); ``block_n``: keys per
    tile, a multiple of 32 in 128..256 (past 128, V^T takes a second 128-byte box along the
    keys; 224 and 256 spill)."""

    tile_width = staticmethod(fp8_tile_width)  # 128-column (128-byte) boxes
    k_step = FP8_K_STEP

    head_dim: int = 128
    head_dim_v: int | None = None
    stages: int = 2
    raw_stages: int = 2
    producer_registers: int = 40
    consumer_registers: int = 232
    q_tiles_first: bool | None = None
    lazy_rescale: bool = True
    exp_before_max: bool = True
    transpose_batch: int = 1
    block_n: int = FP8_BLOCK_N

    block_m = 128  # two consumer warp groups of 64 rows
    num_warps = 12

    def __post_init__(self):
        check_fp8_head_dim("head_dim", self.head_dim)
        if self.head_dim_v is not None:
            check_fp8_head_dim("head_dim_v", self.head_dim_v)
        if not 1 <= self.stages <= 4 or not 1 <= self.raw_stages <= 4:
            raise kiln.KilnValueError(f"stages={self.stages} / raw_stages={self.raw_stages} "
                                      "must be in 1..4", fix="use 2 and 2")
        if self.block_n % FP8_K_STEP or not FP8_BLOCK_N <= self.block_n <= 256:
            raise kiln.UnsupportedError(f"block_n={self.block_n!r} is not supported by the FP8 "
                                        "prefill kernel", fix="use a multiple of 32 in 128..256")
        if not 1 <= self.transpose_batch <= 8:
            raise kiln.KilnValueError(f"transpose_batch={self.transpose_batch!r} must be in "
                                      "1..8", fix="use 1, or 8 with 56 producer registers")
        if self.exp_before_max and not self.lazy_rescale:
            raise kiln.KilnValueError("exp_before_max needs lazy_rescale",
                                      fix="set lazy_rescale=True")
        if self.shared_bytes() > SHARED_BUDGET:
            raise kiln.ResourceError(f"the FP8 prefill's tiles need {self.shared_bytes()} bytes "
                                     "of shared memory (227 KB available)",
                                     fix="use fewer stages or raw_stages")
        if 2 * self.consumer_registers + self.producer_registers > 3 * LAUNCH_REGISTERS:
            raise kiln.ResourceError("two consumer groups and the producer ask for more than "
                                     f"the 3 x {LAUNCH_REGISTERS} registers per thread the "
                                     "CTA is given (setmaxnreg.inc would wait forever)",
                                     fix="keep 2 * consumer_registers + producer_registers "
                                         f"<= {3 * LAUNCH_REGISTERS}")

    def shared_bytes(self) -> int:
        return fp8_shared_bytes(self.head_dim, self.dv, self.stages, self.raw_stages,
                                self.block_n)

    def grid_q_tiles_first(self, mask) -> bool:
        return (not mask.causal) if self.q_tiles_first is None else self.q_tiles_first

    @classmethod
    def for_head_dim(cls, head_dim: int, head_dim_v: int | None = None):
        """The configuration :func:`~kiln.kernels.attention.prefill` uses for FP8: two stages
        of each ring, one raw V stage where two do not fit (V 256 wide), and where Q/K and the
        O accumulator are at most 128 wide the bf16 kernel's ``exp_before_max`` and 192-key
        tiles (H200, D 128, seq 4k-16k: 1.22-1.35x Kiln's bf16 prefill, 128-key tiles
        1.17-1.26x; wider ones spill).
        Example: ``HopperFp8PrefillConfig.for_head_dim(256).raw_stages == 1``,
        ``HopperFp8PrefillConfig.for_head_dim(128).block_n == 192``."""
        if head_dim_v == head_dim:
            head_dim_v = None
        check_fp8_head_dim("head_dim", head_dim)
        dv = head_dim if head_dim_v is None else head_dim_v
        check_fp8_head_dim("head_dim_v", dv)
        narrow = fp8_tile_width(dv) <= 128 and fp8_tile_width(head_dim) <= 128
        block_n = NARROW_BLOCK_N if narrow else FP8_BLOCK_N
        fits = fp8_shared_bytes(head_dim, dv, cls.stages, 2, block_n) <= SHARED_BUDGET
        return cls(head_dim=head_dim, head_dim_v=head_dim_v, raw_stages=2 if fits else 1,
                   exp_before_max=narrow, block_n=block_n)
