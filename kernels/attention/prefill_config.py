"""Tiles and masks of the Hopper prefill kernel (:mod:`.prefill_hopper`): ``HopperPrefillConfig``
and ``MaskSpec``, with the head dims the kernel serves.

Head dims: the kernel's tiles are 64-column TMA boxes, so Q/K and V each run at the next
multiple of 64 (``qk_width``, ``v_width``). A head dim that is not one (any multiple of 8 up to
256, e.g. 96, 192, or a V narrower than Q/K: DeepSeek's 192/128) is read through a 3-D
``[rows, heads, D]`` TMA view whose columns past ``D`` are out of bounds and land as zeros;
``S = Q K^T`` runs only ``ceil(D / 16)`` k-steps and the store skips the padding columns.

Example::

    cfg = HopperPrefillConfig.for_head_dim(192, 128)
    (cfg.qk_width, cfg.v_width, cfg.block_n)   # (192, 128, 128)
"""

from dataclasses import dataclass, replace

import kiln

WARP_GROUP_THREADS = 128
WARP_GROUP_ROWS = 64  # rows of one wgmma.m64nNk16
CHUNK_COLS = 64  # head-dim columns per 128-byte swizzled box
K_STEP = 16
SUPPORTED_DTYPES = ("bf16", "f16")
# Head dims with their own tuned tiles (DEFAULT_TILES); every multiple of 8 up to 256 runs.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
HEAD_DIM_MULTIPLE = 8  # TMA strides are 16-byte multiples: D * 2 bytes
MAX_HEAD_DIM = 256
SHARED_BUDGET = 227 * 1024 - 1024 - 256
ORDER_SCRATCH_BYTES = 3 * WARP_GROUP_THREADS * 4  # one i32 per thread for sched_barrier
# head_dim -> (block_n, stages): K and V stages are released separately, so 2 stages beat 3; the
# fastest tiles that keep S + O in registers (bench/LEDGER.md, session 8).
DEFAULT_TILES = {64: (192, 2), 128: (128, 2), 256: (80, 2)}
# Head dims where ``lazy_rescale`` / ``exp_before_max`` are faster (at D = 256 exp_before_max
# spills; bench/LEDGER.md, sessions 21-22).
LAZY_RESCALE_HEAD_DIMS = (64, 128, 256)
EXP_BEFORE_MAX_HEAD_DIMS = (64, 128)
# Keys per sequence up to which the persistent kernel runs (a work item's fixed cost, its Q
# load, pipeline fill and output, is then a large share of it).
PERSISTENT_MAX_KEYS = 2048
# O's widest columns where the persistent kernel runs, without / with a causal mask, for head
# dims SHORT_CONFIGS does not list (D 192 and 256 accumulators spill in its loop; at D 128
# causal one tile a CTA measured faster).
PERSISTENT_MAX_V_WIDTH = {False: 128, True: 64}
# (head_dim or (head_dim, head_dim_v), causal) -> ((keys, fields), ...): what sequences of up to
# ``keys`` keys run, first match, as fields over for_head_dim's config; past the last ``keys``,
# one tile a CTA (H200, bench/attention_short.py vs cuDNN: at D 64, 128-key tiles leave no
# partial tile at 512 / 1k keys and waste less of a causal diagonal, +5-18% over 192; a third
# stage +0.5-5%; the overlapped walk (an item's last P V with the next item's first S, output
# stored from the registers) 1.01 / 1.03 of cuDNN at 512 / 1k keys unmasked against 0.93 /
# 0.96, causal 1k / 2k 0.95 / 0.98 against 0.94 / 0.95, at causal 512 0.90 against 0.92; D 96
# causal at 512 keys: 64-key tiles skipping the first group's masked one 0.92 of cuDNN vs 0.85
# one tile a CTA, at 1k 0.93 vs 1.00; D 256 at 512 keys: 64-key tiles (8 whole tiles, 80-key
# ones leave a partial one) 0.95 / 0.94 causal / unmasked against 0.91 / 0.93).
OVERLAPPED_WALK = dict(persistent=True, overlap_items=True, direct_store=True)
SHORT_CONFIGS = {
    (64, False): ((1024, dict(block_n=128, stages=3, **OVERLAPPED_WALK)),
                  (PERSISTENT_MAX_KEYS, dict(persistent=True, block_n=192, stages=3))),
    (64, True): ((512, dict(persistent=True, block_n=128, stages=3)),
                 (PERSISTENT_MAX_KEYS, dict(block_n=128, stages=3, **OVERLAPPED_WALK))),
    (96, True): ((512, dict(persistent=True, block_n=64, stages=4, skip_masked_tiles=True)),),
    (256, False): ((512, dict(block_n=64)),),
    (256, True): ((512, dict(block_n=64)),),
}


def check_head_dim(name: str, d) -> None:
    """A KilnError naming ``name`` unless ``d`` is a multiple of 8 in 8..256.
    Example: ``check_head_dim("head_dim", 96)`` passes, ``check_head_dim("head_dim", 100)``
    raises."""
    if not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= MAX_HEAD_DIM \
            or d % HEAD_DIM_MULTIPLE:
        raise kiln.UnsupportedError(f"{name}={d!r} is not supported by the Hopper prefill "
                                    "kernel", fix=f"use a multiple of {HEAD_DIM_MULTIPLE} up to "
                                                  f"{MAX_HEAD_DIM}")


def tile_width(d: int) -> int:
    """Columns the kernel computes for head dim ``d``: the next multiple of 64.
    Example: ``tile_width(96) == 128``."""
    return -(-d // CHUNK_COLS) * CHUNK_COLS


class HeadDimTiles:
    """What a Hopper prefill config derives from ``head_dim`` / ``head_dim_v``: shared by the
    bf16 config and the FP8 one, which name their ``tile_width`` rule and ``k_step``."""

    tile_width = staticmethod(tile_width)
    k_step = K_STEP

    @property
    def dv(self) -> int:
        """V's (and O's) head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def qk_width(self) -> int:
        """Q/K columns in shared memory: ``head_dim`` rounded up to a whole box."""
        return self.tile_width(self.head_dim)

    @property
    def v_width(self) -> int:
        """V columns in shared memory and O columns in registers (whole boxes)."""
        return self.tile_width(self.dv)

    @property
    def qk_steps(self) -> int:
        """``k_step``-wide k-steps of ``S = Q K^T`` (columns past ``head_dim`` are zeros)."""
        return -(-self.head_dim // self.k_step)

    @property
    def padded_qk(self) -> bool:
        """Whether Q/K are read through the 3-D view that zero-fills the columns past D."""
        return self.head_dim != self.qk_width

    @property
    def padded_v(self) -> bool:
        return self.dv != self.v_width


@dataclass(frozen=True)
class HopperPrefillConfig(HeadDimTiles):
    """Tiles and pipeline of :func:`~.prefill_hopper.make_kernel`: ``head_dim`` of Q/K,
    ``head_dim_v`` of V and O (None: ``head_dim``), ``block_n`` keys per tile, ``stages`` K/V
    buffers in the ring, registers per thread of the producer and the two consumer groups.

    ``pin_pv_wait``: hold each consumer's wait for its own ``P V`` after the softmax in SASS too
    (:func:`kiln.nvidia_asm.sched_barrier`; ptxas otherwise hoists the wait above it). Off by
    default: ``exp_before_max``'s vote barrier holds it there already.
    ``lazy_rescale``: rescale O only when a row's max grew by more than
    ``LAZY_RESCALE_THRESHOLD`` (:meth:`OnlineSoftmax.lazy_scale_decision`).
    ``exp_before_max`` (with ``lazy_rescale``): P against the running max without reducing the
    tile's max; the max only when the group's vote says some P passed ``2**threshold`` (the
    kernel module's docstring, step 3).
    ``persistent``: one CTA per SM walks the work items (short sequences, :meth:`for_shape`);
    there ``overlap_items`` issues an item's last ``P V`` with the next item's first
    ``S = Q K^T`` (:attr:`overlaps_items`), and under a causal mask ``zigzag`` deals every
    second round of items in reverse CTA order; ``direct_store`` (either walk) writes O
    from the registers in 4-byte stores instead of staging it in the Q buffer. Off here;
    :meth:`for_shape` turns the overlapped walk with direct stores on where it measured faster
    (``SHORT_CONFIGS``; docs/kernels.md, short sequences).
    ``skip_masked_tiles``: each consumer group stops at the last key tile one of its own 64
    rows sees (with 64-key tiles under a causal mask, the first group skips the CTA's last
    tile) and passes its turn there without products; off by default (docs/kernels.md)."""

    head_dim: int = 128
    block_n: int = 128
    stages: int = 2
    producer_registers: int = 24
    consumer_registers: int = 240
    q_tiles_first: bool | None = None
    pin_pv_wait: bool = False
    lazy_rescale: bool = False
    exp_before_max: bool = False
    head_dim_v: int | None = None
    persistent: bool = False
    overlap_items: bool = False
    zigzag: bool = False
    direct_store: bool = False
    skip_masked_tiles: bool = False

    block_m = 2 * WARP_GROUP_ROWS  # two consumer warp groups
    num_warps = 12

    def __post_init__(self):
        check_head_dim("head_dim", self.head_dim)
        if self.head_dim_v is not None:
            check_head_dim("head_dim_v", self.head_dim_v)
        if self.block_n % 16 or not 64 <= self.block_n <= 256:
            raise kiln.UnsupportedError(f"block_n={self.block_n} is not supported",
                                        fix="use a multiple of 16 in 64..256")
        if not 1 <= self.stages <= 4:
            raise kiln.KilnValueError(f"stages={self.stages} must be in 1..4",
                                      fix="use 2 stages")
        if self.exp_before_max and not self.lazy_rescale:
            raise kiln.KilnValueError("exp_before_max needs lazy_rescale: P is taken against "
                                      "the running max, which only the lazy vote keeps",
                                      fix="set lazy_rescale=True")
        scratch = self._scratch()
        if self.shared_bytes() + scratch > SHARED_BUDGET:
            raise kiln.ResourceError(f"Q and {self.stages} K/V stages of {self.block_n} x "
                                     f"{self.qk_width} + {self.v_width} need "
                                     f"{self.shared_bytes() + scratch} bytes of shared memory "
                                     "(227 KB available)",
                                     fix="use fewer stages or a smaller block_n")
        if (2 * self.consumer_registers + self.producer_registers) * WARP_GROUP_THREADS > 65536:
            raise kiln.ResourceError("two consumer groups of "
                                     f"{self.consumer_registers} + {self.producer_registers} "
                                     "registers per thread exceed the 64K register file",
                                     fix="lower consumer_registers")

    @property
    def overlaps_items(self) -> bool:
        """Whether a persistent kernel's consumers issue an item's last ``P V`` with the next
        item's first ``S = Q K^T`` and write its output while that runs (``overlap_items``,
        where the next item's Q has its own buffer)."""
        return self.persistent and self.overlap_items and self.q_buffers == 2

    @property
    def q_buffers(self) -> int:
        """Q tiles in shared memory: two where a persistent kernel's second one fits (the next
        work item's Q loads while this one's output leaves the first), else one."""
        if not self.persistent:
            return 1
        return 2 if self._q_bytes(2) + self._kv_bytes() <= SHARED_BUDGET - self._scratch() \
            else 1

    def shared_bytes(self, itemsize: int = 2) -> int:
        """Dynamic shared memory: the Q tiles (which also stage O) and the K/V ring
        (``pin_pv_wait``'s scratch is static, ``ORDER_SCRATCH_BYTES``)."""
        return self._q_bytes(self.q_buffers, itemsize) + self._kv_bytes(itemsize)

    def _q_bytes(self, buffers: int, itemsize: int = 2) -> int:
        return buffers * self.block_m * max(self.qk_width, self.v_width) * itemsize

    def _kv_bytes(self, itemsize: int = 2) -> int:
        return self.stages * self.block_n * (self.qk_width + self.v_width) * itemsize

    def _scratch(self) -> int:
        return ORDER_SCRATCH_BYTES if self.pin_pv_wait else 0

    def grid_q_tiles_first(self, mask: "MaskSpec") -> bool:
        """Whether grid x walks the query tiles of one head (CTAs running together share that
        head's K/V in L2) rather than the heads (causal masks: longest tiles of many heads
        first). ``q_tiles_first=None`` picks by the mask."""
        return (not mask.causal) if self.q_tiles_first is None else self.q_tiles_first

    @classmethod
    def for_shape(cls, head_dim: int, head_dim_v: int | None, keys: int,
                  causal: bool = False) -> "HopperPrefillConfig":
        """The configuration :func:`~kiln.kernels.attention.prefill` runs for sequences of up to
        ``keys`` keys (``causal``: under a causal mask): :meth:`for_head_dim`'s, and up to
        ``PERSISTENT_MAX_KEYS`` keys ``SHORT_CONFIGS``' fields for the head dim and mask, or
        (head dims it does not list) the persistent kernel where O is at most
        ``PERSISTENT_MAX_V_WIDTH[causal]`` columns wide.
        Example: ``for_shape(128, None, 1024).persistent`` is True,
        ``for_shape(64, None, 512, causal=True).block_n == 128``."""
        config = cls.for_head_dim(head_dim, head_dim_v)
        if keys > PERSISTENT_MAX_KEYS:
            return config
        dims = head_dim if config.head_dim_v is None else (head_dim, config.head_dim_v)
        listed = SHORT_CONFIGS.get((dims, bool(causal)))
        for longest, fields in listed or ():
            if keys <= longest:
                return replace(config, **fields)
        if listed is None and config.v_width <= PERSISTENT_MAX_V_WIDTH[bool(causal)]:
            return replace(config, persistent=True)
        return config

    @classmethod
    def for_head_dim(cls, head_dim: int, head_dim_v: int | None = None) -> "HopperPrefillConfig":
        """The configuration :func:`~kiln.kernels.attention.prefill` uses: ``DEFAULT_TILES``'
        tiles and the softmax schedule of ``LAZY_RESCALE_HEAD_DIMS`` and
        ``EXP_BEFORE_MAX_HEAD_DIMS``; other head dims take those of the tuned head dim whose
        O accumulator is as wide (the next of 64/128/256 above ``v_width``), with ``block_n``
        lowered in steps of 16 until Q and the K/V ring fit in shared memory.
        Example: ``for_head_dim(128).block_n == 128``, ``for_head_dim(192, 128).block_n == 128``."""
        if head_dim_v == head_dim:
            head_dim_v = None
        if head_dim_v is None and head_dim in DEFAULT_TILES:
            block_n, stages = DEFAULT_TILES[head_dim]
            return cls(head_dim=head_dim, block_n=block_n, stages=stages,
                       lazy_rescale=head_dim in LAZY_RESCALE_HEAD_DIMS,
                       exp_before_max=head_dim in EXP_BEFORE_MAX_HEAD_DIMS)
        check_head_dim("head_dim", head_dim)
        dv = head_dim if head_dim_v is None else head_dim_v
        check_head_dim("head_dim_v", dv)
        tuned = min(t for t in DEFAULT_TILES if t >= tile_width(dv))
        block_n, stages = DEFAULT_TILES[tuned]
        widths = tile_width(head_dim) + tile_width(dv)
        q_bytes = cls.block_m * max(tile_width(head_dim), tile_width(dv)) * 2
        while q_bytes + stages * block_n * widths * 2 > SHARED_BUDGET:
            block_n -= 16
        # exp_before_max re-issues Q K^T; past one 128-column Q tile that spills (192/128).
        return cls(head_dim=head_dim, head_dim_v=head_dim_v, block_n=block_n, stages=stages,
                   lazy_rescale=tuned in LAZY_RESCALE_HEAD_DIMS,
                   exp_before_max=tuned in EXP_BEFORE_MAX_HEAD_DIMS
                   and tile_width(head_dim) <= 128)


@dataclass(frozen=True)
class MaskSpec:
    """The compile-time mask: ``causal``, ``window = (left, right)`` (-1 unbounded) and
    ``chunk`` (0: none). The kernel is specialised on it."""

    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    chunk: int = 0
