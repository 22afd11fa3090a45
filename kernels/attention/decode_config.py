"""Configuration of the paged decode kernel (:mod:`kiln.kernels.attention.decode`): the
tuning table, :class:`DecodeConfig` and the defaults the host picks from a call's shape
(:func:`default_config`, :func:`default_num_splits`, :func:`early_launch_tiles`), and
:class:`DecodeShape`, the compile-time sizes of one kernel.

Every tuning constant sits in the table below with a one-line reason; the measurements behind
them (device, shapes, times) are in ``bench/LEDGER.md`` under *decode*.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import kiln
from kiln.layout import Layout
from kiln.swizzle import Swizzle

from .paged import PagedRowIndices
from .partials import Partials

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
WARP = 32
PRODUCER = "kiln.kernels.attention.decode"  # the Partials producer name combine checks
HALF = 64  # columns of one TMA box: 128 bytes of bf16, the 128-byte swizzle's row
SWIZZLED_MIN_PAGE = 8  # a box of >= 8 rows of 128 bytes lands 1024-byte aligned
CONSUMERS = ("mma_sync", "wgmma")  # DecodeConfig.consumer: which tensor-core instruction
SUPPORTED_HEAD_DIMS = (64, 128, 256)
Q_ALIGN = 4  # bytes: q's bf16 pairs are loaded as 32-bit words (2x fewer loads than 16-bit)
MERGE_PAD = 8  # f32 padding of a merge row: 64-bit stores of 16 lanes hit 32 distinct banks
# The fused kernel's i64 counters per (batch, KV head, row block): splits that ended their
# main loops (counted where one CTA merges) and splits whose partials are stored and released.
ARRIVED, PUBLISHED = 0, 1

# ---- Tuning table: value, then why (the measurements: bench/LEDGER.md, area "decode") ------
# Splits: one wave of CTAs.
DEFAULT_SMS = 132  # interpreted calls query no device: an H100 SXM's / H200's SM count
CTAS_PER_SM = 1  # two CTAs an SM (half the tiles each) were slower and doubled the partials
MAX_DEFAULT_SPLITS = 64  # bounds the partials a row merges (and the fused kernel's slots)
# Consumer choice.
WGMMA_MIN_ROWS = 33  # from here (D 128) one m64 WGMMA group beats mma.sync; at 32 half is padding
LAZY_RESCALE_THRESHOLD = 8.0  # log2 units a score may pass the stale max: P <= 2^8 stays exact
LAZY_RESCALE_HEAD_DIMS = (64, 128)  # at D 256 the branch around O's rescale made ptxas spill
MAX_ACCUMULATORS = 80  # f32 O + S a lane when warp groups widen the key slice: more spilled
MAX_UNROLLED_PAGES = 1  # more pages a tile are looked up in a run-time loop (registers, code)
# Ring and launch.
MIN_SHARED_BYTES = 116 * 1024  # over half an SM's 228 KB: overlapped calls never share an SM
SHORT_SPLIT_TILES = 16  # splits this short ring 4 stages: the ring's fill is much of the call
KV_EVICTION = "evict_first"  # K/V lines are read once: evict them before the shared small data
# Early launch (prefetch into L2 before the grid-dependency wait, then launch_dependents).
EARLY_LAUNCH_TILES = range(8, 65)  # tiles a split: at 4 the call ends first, at 256 it costs
PREFETCH_BYTES = 192 * 1024  # K and V prefetched before the wait: 6 tiles at D 128 (5, 8 no faster)
SHORT_SPLIT_PREFETCH_TILES = 3  # at most this many at <= SHORT_SPLIT_TILES: the wait ends sooner
AHEAD_PREFETCH_TILES = 2  # more prefetched with the first copies, so HBM streams while L2 serves
# Merges.
FUSED_COMBINE_MAX_BYTES = 256 * 1024  # partials one SM merges from L2 faster than a combine kernel
MERGE_HELPER_MIN_ROWS = 32  # a fused merge of this many rows is shared; fewer: the wait costs more
MERGE_SLICES = 4  # CTAs sharing such a merge, D / 4 columns each; 2, 8 and 16 were no faster
MAX_COMBINE_LOADS = 32  # 16-byte partial loads one thread of the fused merge keeps in flight


@functools.lru_cache(maxsize=None)
def decode_partials(num_slots: int) -> Partials:
    """The :class:`Partials` contract of a :func:`decode` call with ``num_slots`` partial slots:
    split-major f32 O, natural-log LSE, natural depth order, empty split = (-inf, zeros).
    Example: ``combine(o, lse, counts, partials=decode_partials(o.shape[0]))``."""
    return Partials(producer=PRODUCER, max_splits=num_slots)


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` keys per tile (also the block size of ``block_table``), ``stages`` K/V tiles
    in the shared ring, ``num_warps`` warps per CTA, and the tensor-core ``consumer``:

    - ``"mma_sync"``: the warps form :meth:`warp_groups` groups, each serving its own
      :meth:`m_tiles` m16 tiles of packed query rows; a group's warps split every tile's keys
      (:meth:`keys_per_warp` each, a multiple of 16) and merge their states at the end.
    - ``"wgmma"``: one warp group (4 warps) serves 64 packed rows with ``wgmma m64nNk16``, every
      key of a tile, O in its registers (no merge between warps); D <= 128, pages of >= 8 rows.

    ``lazy_rescale`` (the mma.sync consumer): a warp moves its rows' running maxima, and
    rescales its O and sums, only on a tile where one of its scores passed its row's max by
    ``LAZY_RESCALE_THRESHOLD`` (a ``vote.any``); on every other tile P = 2^(s - stale max)
    <= 2^8, with no cross-lane max and no O multiply (far fewer instructions a tile). False:
    every tile takes the max first.

    Example: ``DecodeConfig(block_n=128, stages=2)``, ``DecodeConfig(consumer="wgmma")``."""

    block_n: int = 64
    stages: int = 3
    num_warps: int = 4
    consumer: str = "mma_sync"
    lazy_rescale: bool = True

    def __post_init__(self):
        if self.consumer not in CONSUMERS:
            raise kiln.KilnValueError(f"consumer={self.consumer!r} is not one of {CONSUMERS}",
                                      fix="use 'mma_sync' or 'wgmma'")
        if self.consumer == "wgmma" and self.num_warps != 4:
            raise kiln.UnsupportedError(f"consumer='wgmma' runs one warp group (4 warps), not "
                                        f"num_warps={self.num_warps}", fix="use num_warps=4")
        if self.block_n not in (64, 128):
            raise kiln.UnsupportedError(f"block_n={self.block_n} is not supported",
                                        fix="use 64 or 128")
        if self.stages not in (2, 3, 4):
            raise kiln.UnsupportedError(f"stages={self.stages} is not supported",
                                        fix="use 2, 3 or 4 K/V stages")
        if self.num_warps not in (2, 4, 8):
            raise kiln.UnsupportedError(f"num_warps={self.num_warps} is not supported",
                                        fix="use 2, 4 or 8 warps")

    def check_rows(self, packed_rows: int, head_dim: int) -> None:
        """Every warp's key slice must be whole k16 steps; how many warps share a tile depends
        on the rows (:meth:`warp_groups`), so 8 warps with ``block_n=64`` need > 16 packed
        rows. Example: ``DecodeConfig(num_warps=8).check_rows(32, 128)`` passes."""
        if self.consumer == "wgmma" and head_dim > 128:
            raise kiln.UnsupportedError(
                f"consumer='wgmma' keeps a 64 x {head_dim} f32 O in one warp group's registers; "
                "it supports D <= 128", fix="use consumer='mma_sync' for D=256")
        keys = self.keys_per_warp(self.warp_groups(packed_rows, head_dim))
        if keys % 16:
            raise kiln.UnsupportedError(
                f"{self} gives each warp {keys} keys of a tile for {packed_rows} packed query "
                f"rows (Sq x Hq/Hkv) at D={head_dim}; the slices must be multiples of 16",
                fix="use 4 warps, or 8 with block_n=128 (8 with block_n=64 needs more than "
                    "16 packed rows)")

    def m_tiles(self, packed_rows: int, head_dim: int) -> int:
        """m16 tiles of packed query rows one warp holds: up to 128 f32 O columns a lane (O
        and the Q fragments of every m tile stay in registers; a warp holding more spilled).
        Example: ``m_tiles(32, 64) == 2``, ``m_tiles(32, 128) == 1``."""
        if self.consumer == "wgmma":
            return 1
        return max(1, min(-(-packed_rows // 16), 128 // head_dim))

    def warp_groups(self, packed_rows: int, head_dim: int) -> int:
        """Groups of warps in one CTA, each serving its own ``m_tiles`` m16 tiles, so that one
        CTA reads each page once for more rows. Doubling the groups doubles every warp's key
        slice (its S accumulators), so it stops at the rows needed, at ``num_warps`` groups or
        when O and S would exceed ``MAX_ACCUMULATORS`` f32 a lane.
        Example: ``DecodeConfig().warp_groups(32, 128) == 2`` (warps 0-1 rows 0-15, warps 2-3
        rows 16-31, 32 keys a warp), ``warp_groups(8, 128) == 1``, ``warp_groups(64, 64) == 1``."""
        if self.consumer == "wgmma":  # each warp 16 rows of the m64 product, every key
            return self.num_warps
        m_tiles = self.m_tiles(packed_rows, head_dim)
        needed = -(-packed_rows // (16 * m_tiles))
        groups = 1
        while groups < needed and 2 * groups <= self.num_warps:
            accumulators = m_tiles * (head_dim + self.keys_per_warp(2 * groups)) // 2
            if accumulators > MAX_ACCUMULATORS:
                break
            groups *= 2
        return groups

    def keys_per_warp(self, warp_groups: int) -> int:
        """Keys of every tile one warp attends to. Example: ``DecodeConfig().keys_per_warp(2)
        == 32``."""
        return self.block_n * warp_groups // self.num_warps

    def tile_bytes(self, head_dim: int) -> int:
        """Bytes of one tile's K and V (bf16): one ring stage, and what its TMAs bring.
        Example: ``DecodeConfig().tile_bytes(128) == 32768``."""
        return 2 * self.block_n * head_dim * 2

    def row_blocks(self, packed_rows: int, head_dim: int) -> int:
        """CTAs sharing one KV head's packed rows (each re-reads its pages).
        Example: ``row_blocks(32, 128) == 1``, ``row_blocks(128, 128) == 4``."""
        cta_rows = 16 * self.m_tiles(packed_rows, head_dim) * self.warp_groups(packed_rows,
                                                                                  head_dim)
        return -(-packed_rows // cta_rows)


def default_config(packed_rows: int, head_dim: int, page_size: int = 64, *,
                   block_sparse: bool = False, tiles_per_split: int | None = None) -> DecodeConfig:
    """The config :func:`decode` uses when given none (``tiles_per_split``: the most tiles a
    split of the call attends, once :func:`decode` has chosen the split count; None: unknown).

    - More than ``WGMMA_MIN_ROWS - 1`` packed rows at D = 128 on pages of >= 8 rows (e.g.
      Sq 8 x GQA 8): one WGMMA warp group (``consumer='wgmma'``), 64-key tiles and 4 stages up
      to 64 rows; beyond (two row blocks) 128-key tiles and 3 stages, except block-sparse
      (``block_n`` is its block size, so it stays 64).
    - Otherwise ``mma.sync``: 64-key tiles, 3 stages, and 8 warps where the rows take two warp
      groups (each warp then attends 16 keys of a tile, not 32: faster at Sq 4 x GQA 8,
      D 128), else 4; the lazy rescale at D 64 and 128
      (``LAZY_RESCALE_HEAD_DIMS``); 4 stages where a split has at most ``SHORT_SPLIT_TILES``
      tiles (not block-sparse: a block is one tile).

    Example: ``default_config(32, 128).num_warps == 8``, ``default_config(8, 128).num_warps
    == 4``, ``default_config(64, 128).consumer == "wgmma"``,
    ``default_config(32, 128, tiles_per_split=16).stages == 4``."""
    if head_dim == 128 and packed_rows >= WGMMA_MIN_ROWS and \
            (page_size == 0 or page_size >= SWIZZLED_MIN_PAGE):
        if packed_rows <= 64 or block_sparse:
            return DecodeConfig(consumer="wgmma", stages=4)
        return DecodeConfig(consumer="wgmma", block_n=128)
    two_groups = DecodeConfig().warp_groups(packed_rows, head_dim) == 2
    short = not block_sparse and tiles_per_split is not None and \
        tiles_per_split <= SHORT_SPLIT_TILES
    return DecodeConfig(num_warps=8 if two_groups else 4, stages=4 if short else 3,
                        lazy_rescale=head_dim in LAZY_RESCALE_HEAD_DIMS)


@dataclass(frozen=True)
class DecodeShape:
    """Compile-time sizes of one kernel: tile, ring, fragments and merge scratch.
    Example: ``DecodeShape(128, 8, 4, 64, DecodeConfig(num_warps=8)).rows == 32``."""

    head_dim: int
    group: int
    q_rows: int
    page_size: int
    config: DecodeConfig

    def __post_init__(self):
        c, D = self.config, self.head_dim
        rows = PagedRowIndices[self.rows_params]
        object.__setattr__(self, "eff", rows.eff_page)
        object.__setattr__(self, "pages", rows.num_pages)
        packed = self.q_rows * self.group
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "m_tiles", c.m_tiles(packed, D))
        object.__setattr__(self, "warp_groups", c.warp_groups(packed, D))
        object.__setattr__(self, "row_blocks", c.row_blocks(packed, D))
        if c.consumer == "wgmma" and rows.eff_page < SWIZZLED_MIN_PAGE:
            raise kiln.UnsupportedError(
                f"consumer='wgmma' reads K and V through 128-byte swizzled descriptors, which "
                f"pages of {self.page_size} rows cannot give (a TMA box of fewer than "
                f"{SWIZZLED_MIN_PAGE} rows lands unswizzled)",
                fix=f"use consumer='mma_sync', or pages of >= {SWIZZLED_MIN_PAGE} rows")

    rows_params = property(lambda self: (self.config.block_n, self.page_size))
    wgmma = property(lambda self: self.config.consumer == "wgmma")
    halves = property(lambda self: self.head_dim // HALF)
    warp_rows = property(lambda self: 16 * self.m_tiles)  # packed rows of one warp group
    rows = property(lambda self: self.warp_rows * self.warp_groups)  # per CTA, padded
    group_warps = property(lambda self: self.config.num_warps // self.warp_groups)
    keys = property(lambda self: self.config.keys_per_warp(self.warp_groups))
    threads = property(lambda self: self.config.num_warps * WARP)
    swizzle_bytes = property(lambda self: 128 if self.eff >= SWIZZLED_MIN_PAGE else 0)
    tile_bytes = property(lambda self: self.config.tile_bytes(self.head_dim))
    merge_row = property(lambda self: self.head_dim + MERGE_PAD)
    # Fused combine: the rows of a CTA that exist (not the m16 padding), each merged by
    # combine_threads_per_row threads (a power of two), each taking 4-column chunks.
    combine_rows = property(lambda self: min(self.rows, self.packed))

    @property
    def combine_threads_per_row(self) -> int:
        fit = self.threads // self.combine_rows
        return min(1 << (fit.bit_length() - 1), self.head_dim // 4)

    @property
    def merge_floats(self) -> int:
        """f32 scratch of the merge: every warp's O rows, then their (m, l) pairs."""
        return self.config.num_warps * self.warp_rows * (self.merge_row + 2)

    @property
    def ring_elems(self) -> int:
        """bf16 elements of the dynamic shared buffer: the K/V ring, which the merge scratch
        reuses, and at least ``MIN_SHARED_BYTES``."""
        ring = self.config.stages * self.tile_bytes // 2
        return max(ring, 2 * self.merge_floats, MIN_SHARED_BYTES // 2)

    def ring_layout(self) -> Layout:
        """(row, col) of the ring seen as ``2 * stages * BN`` rows (stage-major, K then V) of
        ``D`` columns -> bf16 offset: each tile is stored as 64-column halves of ``BN`` rows."""
        BN, D = self.config.block_n, self.head_dim
        return Layout(((BN, 2 * self.config.stages), (HALF, self.halves)),
                      ((HALF, BN * D), (1, BN * HALF)))

    def first_slot(self, stage, kv, half):
        """The ring slot (a ``slots`` tile of ``eff x 64``) of page 0 of ``stage``'s K
        (``kv = 0``) or V (``kv = 1``), 64-column half ``half``; page ``p`` is ``p`` further."""
        return ((stage * 2 + kv) * self.halves + half) * self.pages

    def ring_swizzle(self):
        return Swizzle.sw128b(2) if self.swizzle_bytes else None


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, block_n: int = 64,
                       sms: int = DEFAULT_SMS, row_blocks: int = 1) -> int:
    """Splits that fill one wave of ``CTAS_PER_SM`` CTAs per SM (rounded down, so no second
    wave of a few CTAs), without splitting below one tile each.
    Example: ``default_num_splits(1, 8, 16384) == 16`` (128 CTAs of 16 tiles on 132 SMs)."""
    tiles = max(1, -(-max_seq_len // block_n))
    per_split = batch * kv_heads * row_blocks
    return max(1, min(tiles, CTAS_PER_SM * sms // per_split, MAX_DEFAULT_SPLITS))


def early_launch_tiles(config: DecodeConfig, head_dim: int, page_size: int, max_seq_len: int,
                       num_splits: int) -> int:
    """Tiles of K and V a split of a dense (not block-sparse) decode prefetches into L2 before
    its grid-dependency wait, 0 for none (and then no early launch): ``PREFETCH_BYTES`` worth,
    at most ``SHORT_SPLIT_PREFETCH_TILES`` where a split holds at most ``SHORT_SPLIT_TILES``,
    where the splits of a ``max_seq_len`` sequence (the page table's width) hold
    ``EARLY_LAUNCH_TILES`` tiles each and a tile is one page or less.
    Example: ``early_launch_tiles(DecodeConfig(), 128, 64, 65536, 16) == 6`` (64 tiles a
    split), ``... 16384, 16) == 3`` (16), ``... 4096, 16) == 0`` (4)."""
    tiles_per_split = longest_split_tiles(max_seq_len, config.block_n, num_splits)
    if page_size < config.block_n or tiles_per_split not in EARLY_LAUNCH_TILES:
        return 0
    tiles = PREFETCH_BYTES // config.tile_bytes(head_dim)
    if tiles_per_split <= SHORT_SPLIT_TILES:
        tiles = min(tiles, SHORT_SPLIT_PREFETCH_TILES)
    return max(1, min(tiles, tiles_per_split))


def longest_split_tiles(max_seq_len: int, block_n: int, num_splits: int) -> int:
    """Tiles of ``block_n`` keys of the longest split of a ``max_seq_len``-key sequence."""
    tiles = -(-max_seq_len // block_n)
    return -(-tiles // num_splits)

