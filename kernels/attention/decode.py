"""Split-KV paged decode attention (Hopper): TMA page loads, tensor-core consumer (mma.sync, or
WGMMA for 64-row blocks).

``decode(q, k_cache, v_cache, page_table, seq_lens)`` attends ``q[B, Sq, Hq, D]`` (``Sq`` 1–16
draft tokens, causal within the cache: query ``i`` sees keys ``0 .. L - Sq + i``) to a paged
bf16 cache ``[num_pages, page_size, Hkv, D]`` and returns per-split partials for
:func:`kiln.kernels.attention.combine`:

``O_partial[split, b, i, h, :]`` (f32, normalised within the split), ``LSE_partial[split, b, i,
h]`` (natural log, ``-inf`` for a split that saw no key) and ``split_counts[b, i, h]`` (the
splits holding keys for that row; slots past it are ignored by ``combine``).

Schedule: grid ``(num_splits, Hkv * row_blocks, B)`` (block-sparse: ``(top_k, Hkv *
row_blocks, B * Sq)``). A CTA serves one KV head and a block of *packed* query rows (row ``r``
= query token ``r // group``, head ``r % group``) as m16 tiles padded with zero rows that are
never stored, and reads each of its pages once. Its ``num_warps`` warps form ``warp_groups``
groups; group ``g`` serves ``m_tiles`` m16 tiles (Q's fragments and O stay in registers) and
its warps split every BN-key tile, each keeping its own ``(m, l, O)``:

| D | m tiles a warp | warp groups | most rows a CTA | keys a warp (BN 64, default warps) |
| --- | --- | --- | --- | --- |
| 64 | 2 (1 for <= 16 rows) | 1 | 32 | 16 (4 warps) |
| 128 | 1 | 2 when > 16 rows (e.g. Sq 4 x GQA 8) | 32 | 16 (4 warps, or 8 for two groups) |
| 256 | 1 | 1 | 16 | 16 (4 warps) |

More rows than a CTA serves take ``row_blocks`` CTAs per KV head, run side by side and sharing
its pages in L2 (``DecodeConfig.warp_groups`` stops widening where O and S would exceed
``MAX_ACCUMULATORS`` f32 registers a lane). The default split count gives one CTA per SM of the
GPU the call launches on (``DEFAULT_SMS`` when interpreted).

| phase | who | what |
| --- | --- | --- |
| prefetch (early launch only) | the last warp's first lane | before the grid-dependency wait, TMA prefetches into L2 of the K and V of the split's first tiles (:func:`early_launch_tiles`); after the wait, ``launch_dependents`` |
| load q | each lane | its A fragments of its group's packed q rows, straight from global memory into registers as 32-bit bf16 pairs (zero padding rows) |
| load | warp 0, one elected lane issues | tile ``t + stages - 1``: ``PagedRowIndices.populate`` (the page look-up, before the wait; the prologue's ``stages`` tiles are looked up together), wait ``empty[s]`` (tile ``t - 1`` released by every thread), one TMA per page and 64-column half of K and V (128-byte swizzled boxes) completing on ``full[s]`` |
| scores | each warp | its key slice: ``S = Q K^T`` with ``mma.sync`` m16n8k16: Q A-fragments of its group's m tiles (kept in registers), K B-fragments (``ldmatrix.x4``) |
| softmax | each warp | base-2 streaming update, ``scale * log2 e`` folded into the exp2's FMA; with ``DecodeConfig.lazy_rescale`` (default below D 256) a row's max moves, and O is rescaled, only on a tile where a score passed it by 2^8 (one ``vote.any``), else the row max over the 4 lanes of a row every tile; row sums kept per lane until the end; f32 denormals flushed (one MUFU op an exp2) |
| P·V | each warp | P's accumulators, cast to bf16, are the A fragments (two n8 accumulators = one k16 A); V B-fragments by ``ldmatrix.x4.trans`` |
| release | every thread | arrive on ``empty[s]`` |
| merge | all | per row, the ``(m, l, O)`` of its group's warps through shared memory (the ring reused as f32), then ``O / l``, ``LSE = (m + log2 l) * ln 2`` (sinks join here); split 0 writes ``split_counts`` |
| combine (fused kernel of :func:`decode_attention` only) | all | one CTA of each (batch, KV head, row block), or with ``merge_slices > 1`` the last few, merges every split's partial, read from L2, into ``o`` (bf16) and ``lse``, ``combine_threads_per_row`` threads a row, each CTA its slice of the columns; the merging CTAs are picked by tickets (see :func:`_combine_if_last`) |

``DecodeConfig(consumer="wgmma")`` (the default from 33 packed rows at D 128, e.g. Sq 8 x
GQA 8): the CTA is one warp group of 4 warps serving 64 packed rows (more take ``row_blocks``
CTAs); warp ``w`` holds rows ``16 w ..`` of the ``m64`` products and their Q A fragments. Per
tile ``t``: issue ``S_t = Q K_t^T`` (``wgmma m64nBNk16``, A from registers, K K-major from the
ring) and ``O += P_{t-1} V_{t-1}`` (P from registers, V MN-major) back to back, wait for
``S_t``, run its softmax (each row is a thread quad's; in a tile past the sequence the V rows
past the end are first zeroed in shared memory) while the P·V product runs, wait for it, and
release tile ``t - 1``'s stage, so a stage is held one iteration longer and the producer loads
tile ``t + stages - 2``. After the loop, the last P·V; then each quad stores its rows of
``O / l`` straight from the accumulator: no merge through shared memory.

Shared memory: a ring of ``stages`` K/V tiles; tile rows are stored as 64-column halves, each
``BN x 64`` bf16 with 128-byte rows, so a TMA box of ``eff_page x 64`` lands at a multiple of
``eff_page * 128`` bytes. With pages of 8 rows or more that is 1024-byte aligned and the boxes
use the TMA 128-byte swizzle (``ldmatrix`` then reads 8 rows in 8 different bank groups);
smaller pages use unswizzled boxes (correct, with ldmatrix bank conflicts).

Keys past the sequence end never reach the sums, even when the cache holds NaN there: scores
are masked to ``-inf`` and, in a tile that ends past the sequence, the V fragments of those keys
are zeroed before ``P·V`` (``0 * NaN`` would poison the row). That is what lets V's tensor map
fill out-of-bounds boxes with NaN (K's with zeros): the pages past a sequence's end (looked up
as an out-of-bounds row) never reach the sums, while a page id outside ``[0, num_pages)``
inside the sequence (only with ``validate=False``, which skips the host check) reads a NaN box
and poisons its rows' ``O`` (the LSE stays finite, so ``combine`` keeps the NaN) instead of
silently attending to zeros; so does a ``seq_len`` past the page table (look-ups stop at its
width). Ids are i32: ``id * page_size`` must fit in 31 bits. Attention sinks (``sinks[Hq]``,
natural-log logits that only enlarge the denominator) join split 0's merge.

Block-sparse selection (``block_table[B, Sq, Hkv, top_k]`` of BN-key block indices, ``-1``
padded at the end): slot ``j`` of row ``(b, i, kv head)`` is the partial over block
``block_table[b, i, h_kv, j]``; ``split_counts`` is the number of non-negative entries, so a
row that selects nothing has ``C = 0`` (combine returns ``O = 0``, ``LSE = -inf``).

Synchronisation: the only CTA-wide barriers are at top level (after initialising the
mbarriers; before and after the merge; around the fused kernel's tickets: a gpu-scope fence
before a CTA publishes its partials and, in a merging CTA, an acquire before it reads the
others', see :func:`_combine_if_last`). The WGMMA consumer adds one named barrier (its whole
CTA, in a CTA-uniform branch) after zeroing V rows past the sequence. ``elect_sync`` runs once,
converged, before any branch. The K/V ring is a full/empty mbarrier pair per stage: ``full[s]`` is re-armed only
after every thread arrived on ``empty[s]`` for the tile it held, and those arrivals come after
each thread's wait on ``full[s]``, so no phase is reused while a waiter may still be on it.

Launch: programmatic dependent launch (``grid_dependency_wait`` right after the mbarrier
set-up, before any global memory access), so a call's CTAs start while the previous kernel on
the stream finishes; each CTA asks for ``MIN_SHARED_BYTES`` of shared memory, so no two share
an SM. Early launch (where :func:`early_launch_tiles` finds splits of 8-64 tiles, one page a
tile): before the wait the last warp's first lane prefetches the K and V of its split's first
tiles into L2 (TMA prefetches; the seq_lens and page-table reads that aim them may see stale
values, which only misaims a prefetch), and after the wait it lets the next kernel on the
stream launch. Back-to-back calls then overlap: the next call's CTAs start on the SMs that
this call's non-merging CTAs free and fill L2 while the merge runs, when HBM would idle. When
it issues the first tiles, the producer also prefetches the ``AHEAD_PREFETCH_TILES`` tiles
after the prefetched ones, so that HBM streams them while the consumers read L2.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field, replace

import numpy as np

import kiln
from kiln import ldmatrix, mbarrier, nvidia_asm, tiles, wgmma
from kiln.layout import Layout
from kiln.shared import dynamic_shared  # kiln.dynamic_shared once exported
from kiln.swizzle import Swizzle

from ..inputs import (Dims, check_backend, check_heads, check_paged_lengths, check_positive,
                      empty_like, is_torch, resolve_target)
from .paged import OOB_ROW, PagedRowIndices, PageTableRow, kv_sub_tile_rows
from .partials import Partials

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
WARP = 32
DEFAULT_SMS = 132  # H100 SXM / H200: the split count of interpreted calls (no device queried)
# Default splits fill one CTA per SM. Two (the shared memory of 3 x 32 KB stages allows it) lost
# on an H200 (bench/decode.py --sweep): batch 1 ctx 16k took 26.6 vs 28.8 us at Sq 1 and 35.3 vs
# 45.1 us at Sq 4; halving the CTAs also halves the partials the combine reads.
CTAS_PER_SM = 1
MAX_DEFAULT_SPLITS = 64
PRODUCER = "kiln.kernels.attention.decode"
HALF = 64  # columns of one TMA box: 128 bytes of bf16, the 128-byte swizzle's row
SWIZZLED_MIN_PAGE = 8  # a box of >= 8 rows of 128 bytes lands 1024-byte aligned
CONSUMERS = ("mma_sync", "wgmma")  # DecodeConfig.consumer: which tensor-core instruction
# Packed query rows from which the default consumer is one WGMMA warp group (D = 128). Its m64
# product holds 64 rows: at Sq 8 x GQA 8 it took 25.3 us where 8 mma.sync warps took 33.4
# (batch 1, 16k, H200) and 250 vs 361 us at batch 16; at 32 rows half of it is padding, and
# mma.sync stayed 0.4-1 us faster (bench/RESULTS.md, session 15).
WGMMA_MIN_ROWS = 33
# log2 units a score may pass its row's running max before the mma.sync consumer rescales
# (DecodeConfig.lazy_rescale): P then stays at most 2^8, far from overflow in bf16 and f32.
LAZY_RESCALE_THRESHOLD = 8.0
# Head dims whose default is the lazy rescale (as the prefill's LAZY_RESCALE_HEAD_DIMS): at
# D = 256 the branch around O's rescale took the spills from 84 to 340 bytes a thread (sm_90a).
LAZY_RESCALE_HEAD_DIMS = (64, 128)
MAX_UNROLLED_PAGES = 1  # more pages per tile are looked up in a run-time loop, not unrolled
# f32 accumulators (O and S) a lane may hold when warp groups widen its key slice: D=128
# with 32 keys holds 80 (173 registers); D=64 with two m tiles and 32 keys held 96 (231).
MAX_ACCUMULATORS = 80
# 16-byte partial loads one thread of the fused combine keeps in flight (a chunk of splits).
MAX_COMBINE_LOADS = 32
# decode_attention merges in the split kernel's last CTA while that CTA reads at most this many
# partial bytes. One SM reads them from L2: on an H200 that beat a combine kernel by 2-3 us at
# 64 KB (batch 1 Sq 1, 16 splits; batch 4 Sq 4, 4 splits) and by 0.3-1.1 us at 256 KB (batch 1
# Sq 4, 16 splits), the largest merge of bench/decode.py's grid.
FUSED_COMBINE_MAX_BYTES = 256 * 1024
# A fused merge of at least this many rows a CTA is shared by the last MERGE_SLICES CTAs of a
# (batch, KV head, row block) to draw tickets, each merging D / MERGE_SLICES columns; the
# earlier ones wait for the last (:func:`_combine_if_last`). On an H200 that took 0.3-1.2 us
# off Sq 4 x GQA 8 (32 rows, 64-256 KB of partials), and cost 0.1-0.6 us at Sq 1 (8 rows),
# where waiting for the last ticket took longer than the merge it split.
MERGE_HELPER_MIN_ROWS = 32
MERGE_SLICES = 4
# The fused kernel's i64 counters per (batch, KV head, row block): splits that ended their
# main loops (counted where one CTA merges) and splits whose partials are stored and released.
ARRIVED, PUBLISHED = 0, 1
# Shared memory a CTA asks for at least: more than half of an SM's 228 KB, so no two CTAs share
# an SM. With programmatic dependent launch the next call's CTAs start while this call's last
# ones run; where two fit on an SM, some landed on the same one and that SM streamed twice the
# bytes (batch 4, 16k, Sq 1: 64.9 -> 70.5 us on an H200).
MIN_SHARED_BYTES = 116 * 1024
# Early launch (make_kernel's prefetch_tiles): splits of EARLY_LAUNCH_TILES tiles prefetch
# their first PREFETCH_BYTES of K and V (short splits: SHORT_SPLIT_PREFETCH_TILES tiles) into
# L2 before the grid-dependency wait and let the next kernel launch right after it, so
# back-to-back calls overlap one call's merge (~3.5 us in which HBM idles) with the next
# call's first loads. On an H200 that took 0.5-2.0 us off the batch 1-16 shapes of 16-64 tiles
# a split (b1 16k Sq 4: 21.67 -> 20.06 us, Sq 1: 19.92 -> 18.14; b4 4k Sq 4: 21.20 -> 19.65),
# but cost 0.3 us at 4 tiles a split (b1 4k: the call is over before its prefetch is) and
# 3.5 us at 256 (b16 16k: the early launch alone cost about 1.4%).
EARLY_LAUNCH_TILES = range(8, 65)
PREFETCH_BYTES = 192 * 1024  # 6 tiles at D 128: 5 and 8 were within 0.2 us of it
# Splits of at most SHORT_SPLIT_TILES tiles prefetch at most this many tiles before the wait.
# On an H200 (A/B, two runs, HEAD 6 tiles): b1 16k Sq 4 19.79 -> 19.15 us, Sq 1 17.90 ->
# 17.43, b4 4k Sq 4 19.62 -> 18.96, Sq 1 18.14 -> 17.20; at each, 2 tiles were 0.05-0.7 us
# slower than 3 and 4 tiles 0.5-0.8. At 64 tiles a split (b4 16k, b1 64k Sq 4) 3 tiles cost
# 0.25-0.65 us.
SHORT_SPLIT_PREFETCH_TILES = 3
# With early launch, the producer also prefetches the next AHEAD_PREFETCH_TILES tiles past the
# prefetched ones when it issues the first: the consumers then eat tiles from L2 while HBM
# already streams the ones after. On an H200 (A/B, five runs): b1 16k Sq 1 0.3-0.4 us
# faster (18.33 -> 17.90), b4 16k Sq 4 and b1 64k Sq 4 0.0-0.3, b4 4k Sq 4 0.0-0.2, b1 16k
# Sq 4 unchanged (-0.06 to +0.19); 4 tiles were slower than 2 at b1 64k and b4 4k.
AHEAD_PREFETCH_TILES = 2
# mma.sync splits of at most this many tiles ring 4 stages, not 3 (default_config): with few
# tiles a split the ring's fill at the start is a large part of the call. On an H200 (median
# of 5 A/B rounds, 3 runs): b1 16k Sq 4 20.13 -> 19.84 us, b1 4k Sq 4 9.22 -> 9.02, b4 4k Sq 4
# 19.85 -> 19.68, Sq 1 within 0.15 either way; 5 and 6 stages were slower, and at 64 tiles a
# split 4 stages cost 0.4-1.5 us (b4 16k, b1 64k).
SHORT_SPLIT_TILES = 16
# L2 priority of the K/V copies: a decode step reads each cache line once, so those lines go
# first, not the small data every CTA shares (page table, seq_lens, q, partials). Measured on
# an H200: 0.5-1.5 us less per call (about 1 us at most shapes), also with inputs rotated so
# that no call re-reads another's cache.
KV_EVICTION = "evict_first"
Q_ALIGN = 4  # bytes: q's bf16 pairs are loaded as 32-bit words (2x fewer loads than 16-bit)
MERGE_PAD = 8  # f32 padding of a merge row: 64-bit stores of 16 lanes hit 32 distinct banks
# ldmatrix blocks (row, col offsets of 8x8 blocks) of two B fragments at once:
# K stored key x depth (non-transposed): keys n0.. then n0+8.., each 16 deep.
K_PAIR_BLOCKS = ((0, 0), (0, 8), (8, 0), (8, 8))
# V stored key x depth, read transposed: depth columns n0.. then n0+8.., each 16 keys deep.
V_PAIR_BLOCKS = ((0, 0), (8, 0), (0, 8), (8, 8))


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
    <= 2^8, with no cross-lane max and no O multiply (about 40% fewer instructions a tile at
    Sq 4 x GQA 8, D 128). False: every tile takes the max first.

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
      groups (each warp then attends 16 keys of a tile, not 32: 2-5% faster at Sq 4 x GQA 8,
      D 128 on an H200), else 4; the lazy rescale at D 64 and 128
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


SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class _Shape:
    """Compile-time sizes of one kernel: tile, ring, fragments and merge scratch."""

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


@functools.lru_cache(maxsize=None)
def make_kernel(head_dim: int, group: int, q_rows: int, page_size: int, block_sparse: bool,
                has_sinks: bool, config: DecodeConfig = DecodeConfig(), fused_slots: int = 0,
                merge_slices: int = 1, prefetch_tiles: int = 0):
    """The ``@kiln.kernel`` for one shape class: ``q_rows`` query tokens per CTA (``Sq``, or 1
    when block-sparse) times ``group`` query heads per KV head. ``fused_slots > 0``: the
    grid has that many splits and the last CTA of each (batch, KV head, row block) to finish
    merges them all into ``o_out`` / ``lse_out``; ``merge_slices > 1``: the last that many
    CTAs share that merge, each taking a slice of the columns (see :func:`_combine_if_last`;
    GPU only, the interpreter cannot run the wait). ``prefetch_tiles > 0``: early launch (see
    :func:`early_launch_tiles`): before its grid-dependency wait each CTA prefetches the K and
    V of its split's first ``prefetch_tiles`` tiles into L2, and after it lets the next kernel
    on the stream launch; the producer prefetches ``AHEAD_PREFETCH_TILES`` more with the
    first tiles."""
    config.check_rows(q_rows * group, head_dim)
    if prefetch_tiles and (block_sparse or page_size < config.block_n):
        raise kiln.UnsupportedError(
            f"prefetch_tiles={prefetch_tiles} needs one page a tile (page_size >= block_n) and "
            "no block table", fix="pass prefetch_tiles=0")
    shape = _Shape(head_dim, group, q_rows, page_size, config)
    D, S = head_dim, config.stages
    packed, ROWS, MT, RB = shape.packed, shape.rows, shape.m_tiles, shape.row_blocks

    def paged_decode(q: kiln.Tensor[kiln.bf16, 4],
                     k_map: kiln.TensorMap[kiln.bf16, (shape.eff, HALF), shape.swizzle_bytes],
                     v_map: kiln.TensorMap[kiln.bf16, (shape.eff, HALF), shape.swizzle_bytes,
                                           "nan"],
                     page_table: kiln.Tensor[kiln.i32, 2], seq_lens: kiln.Tensor[kiln.i32, 1],
                     block_table: kiln.Tensor[kiln.i32, 4], sinks: kiln.Tensor[kiln.f32, 1],
                     o_part: kiln.Tensor[kiln.f32, 5], lse_part: kiln.Tensor[kiln.f32, 4],
                     counts: kiln.Tensor[kiln.i32, 3], o_out: kiln.Tensor[kiln.bf16, 4],
                     lse_out: kiln.Tensor[kiln.f32, 3], tickets: kiln.Tensor[kiln.i64, 3],
                     num_splits: kiln.i32, scale_log2: kiln.f32):
        ring = dynamic_shared((shape.ring_elems,), kiln.bf16, align=1024)
        slots = ring.reinterpret((2 * S * shape.halves * shape.pages, shape.eff, HALF),
                                kiln.bf16)
        kv_s = tiles.SharedTile.view(ring, (2 * S * config.block_n, D), shape.ring_layout(),
                                     shape.ring_swizzle())
        full = mbarrier.group(num_barriers=S)
        empty = mbarrier.group(num_barriers=S)
        tid = kiln.thread_id(0)
        warp = tid // WARP
        lane = tid % WARP
        # Warp group g serves the CTA's m tiles g * m_tiles ..; its warps split every tile's
        # keys, warp w taking slice w % group_warps.
        warp_row0 = (warp // shape.group_warps) * shape.warp_rows
        key_slice = warp % shape.group_warps
        # Converged here, before any branch: warp 0's elected lane issues every TMA.
        producer = nvidia_asm.elect_sync() & (warp == 0)
        for s in kiln.static_range(S):
            full.init(s, count=1, predicate=tid == 0)
            empty.init(s, count=shape.threads, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        kiln.barrier()
        # Programmatic dependent launch: the CTA may start while the previous kernel on the
        # stream finishes. Its shared-memory set-up is done; everything after reads or writes
        # global memory, so it waits for that kernel here. With early launch, the last warp's
        # first lane first prefetches the split's first tiles into L2 (it also reads seq_lens
        # and the page table, which that kernel may still write: a stale value only wastes a
        # prefetch), and after the wait lets the next kernel's CTAs start on the SMs this
        # grid frees, so that they prefetch during this grid's merge.
        early_lane = (warp == config.num_warps - 1) & (lane == 0)
        if prefetch_tiles:
            if early_lane:
                _prefetch_split_start(k_map, v_map, page_table, seq_lens, num_splits,
                                      kiln.block_id(0), kiln.block_id(2),
                                      (kiln.block_id(1) // RB) * D, prefetch_tiles, shape)
        nvidia_asm.grid_dependency_wait()
        if prefetch_tiles:
            if early_lane:
                nvidia_asm.launch_dependents()
        # The descriptors' fetch overlaps the seq_len -> page table look-ups, not the first
        # TMA (0.1-0.3 us at batch 1 on an H200).
        kiln.tma.prefetch_descriptor(k_map, predicate=producer)
        kiln.tma.prefetch_descriptor(v_map, predicate=producer)

        split = kiln.block_id(0)
        kv_head = kiln.block_id(1) // RB
        row0 = (kiln.block_id(1) % RB) * ROWS  # first packed row of this CTA
        seq_q = q.shape[1]
        if block_sparse:
            b = kiln.block_id(2) // seq_q
            q_first = kiln.block_id(2) % seq_q
        else:
            b = kiln.block_id(2)
            q_first = 0
        seq_len = seq_lens[b]
        tiles_total, tiles_per_split, tile_begin, tile_end = _split_tiles(
            seq_len, num_splits, split, config.block_n)
        if block_sparse:
            block = block_table[b, q_first, kv_head, split]
            tile_begin = kiln.maximum(block, 0)
            tile_end = kiln.where(block >= 0, kiln.minimum(block + 1, tiles_total), 0)
        num_tiles = kiln.maximum(tile_end - tile_begin, 0)

        # The warp's Q A fragments stay in registers for the whole split, loaded straight from
        # global memory: no shared staging, and no barrier between them and the first TMA.
        q_frags = _load_q_fragments(q, b, q_first, kv_head, row0 + warp_row0, lane, shape)
        # Per lane: rows lane // 4 and lane // 4 + 8 of every m tile; the last key each sees.
        key_limit = []
        for i in range(MT):
            for half in range(2):
                r = kiln.minimum(row0 + warp_row0 + 16 * i + lane // 4 + 8 * half, packed - 1)
                key_limit.append(seq_len - seq_q + q_first + r // group)
        m = [kiln.cast(-math.inf, kiln.f32) for _ in range(2 * MT)]
        l = [kiln.cast(0.0, kiln.f32) for _ in range(2 * MT)]
        if shape.wgmma:
            o = wgmma.fragment_zeros(D)
            # The previous tile's P (A operands of its P V product) and O's pending rescale.
            probs = [kiln.vector_constant([0.0] * 8, kiln.bf16)
                     for _ in range(config.block_n // 16)]
            alphas = [kiln.cast(1.0, kiln.f32) for _ in range(2)]
            # Stage 0's K (K-major) and V (MN-major: the leading byte offset steps from one
            # 64-column half to the next); stage s is s * tile_bytes further.
            descs = (wgmma.smem_descriptor(ring, leading_bytes=16, stride_bytes=1024),
                     wgmma.smem_descriptor(ring, leading_bytes=config.block_n * HALF * 2,
                                           stride_bytes=1024,
                                           byte_offset=config.block_n * D * 2))
        else:
            o = [[kiln.vector_constant([0.0] * 4, kiln.f32) for _ in range(D // 8)]
                 for _ in range(MT)]

        # Page look-ups go out before anything waits on them: the prologue's S here, beside
        # Q's loads, and in the loop the next tile's before its stage is free, so their
        # latency overlaps the TMA's instead of adding to it.
        # Look-ups stop at the table's width even for a longer seq_len (unchecked with
        # validate=False): keys past it get out-of-bounds boxes, whose NaN V poisons the row.
        table_len = kiln.minimum(seq_len, page_table.shape[1] * page_size)
        first_rows = [_tile_rows(shape.rows_params, page_table, b, tile_begin + t, table_len)
                      for t in range(S)]
        ahead_rows = [_tile_rows(shape.rows_params, page_table, b,
                                 tile_begin + prefetch_tiles + t, table_len)
                      for t in range(AHEAD_PREFETCH_TILES if prefetch_tiles else 0)]
        for it in kiln.range(0, num_tiles):
            stage = it % S
            # The first tiles load inside the loop, so every TMA is followed by a wait on its
            # ring on every path: kiln-insert-waits then adds no wait before the merge (one
            # of fixed parity after the loop would hang a CTA whose stage 0 completed an even
            # number of phases, none included).
            if (it == 0) & (warp == 0):
                if shape.pages > MAX_UNROLLED_PAGES:  # one copy of the look-up loop
                    for t in kiln.range(0, kiln.minimum(num_tiles, S)):
                        _load_tile(shape.rows_params, None, page_table, b, tile_begin + t,
                                   table_len, k_map, v_map, slots, full, t, kv_head * D,
                                   producer, shape)
                else:
                    for t in kiln.static_range(S):
                        if t < num_tiles:
                            _load_tile(shape.rows_params, first_rows[t], page_table, b,
                                       tile_begin + t, table_len, k_map, v_map, slots, full, t,
                                       kv_head * D, producer, shape)
                    if producer:
                        for t, rows in enumerate(ahead_rows):
                            if prefetch_tiles + t < num_tiles:
                                _prefetch_tile(k_map, v_map, kv_head * D, rows.row(0), shape)
            # The ring stage freed last: tile it - 1's, or with wgmma tile it - 2's (a tile's
            # P V product is issued one iteration later, so it holds its stage that long).
            lag = 1 if shape.wgmma else 0
            ahead = it + S - 1 - lag
            if (it > lag) & (ahead < num_tiles):
                if warp == 0:  # warp-uniform: the whole producer warp waits, one lane issues
                    rows = _tile_rows(shape.rows_params, page_table, b, tile_begin + ahead,
                                      table_len)
                    empty.try_wait(ahead % S, ((it - 1 - lag) // S) % 2)
                    _load_tile(shape.rows_params, rows, page_table, b, tile_begin + ahead,
                               table_len, k_map, v_map, slots, full, ahead % S, kv_head * D,
                               producer, shape)
            full.try_wait(stage, (it // S) % 2)
            key0 = (tile_begin + it) * config.block_n
            if shape.wgmma:
                # S of this tile and P V of the previous one go to the tensor cores together;
                # this tile's softmax runs while P V does. O is rescaled first: registers a
                # WGMMA reads must not be written while an earlier group is in flight (ptxas
                # would serialise every WGMMA).
                o = wgmma.scale_rows(o, alphas)
                scores = _issue_qk_wgmma(descs, q_frags, stage, shape)
                previous = (it + S - 1) % S
                if it > 0:
                    o = _issue_pv_wgmma(descs, o, probs, previous, shape)
                    wgmma.wait_group(1)
                else:
                    wgmma.wait_group(0)
                if key0 + config.block_n <= seq_len - seq_q + 1:
                    m, l, probs, alphas = _softmax_wgmma(scores, m, l, key0, tid, key_limit,
                                                         scale_log2, shape, False)
                else:
                    _zero_rows_past_end(slots, stage, seq_len - key0, tid, shape)
                    m, l, probs, alphas = _softmax_wgmma(scores, m, l, key0, tid, key_limit,
                                                         scale_log2, shape, True)
                wgmma.wait_group(0)  # on every path: ptxas then knows O is ready after it
                if it > 0:
                    empty.arrive(previous)
            else:
                kv_row = stage * 2 * config.block_n + key_slice * shape.keys
                first_key = key0 + key_slice * shape.keys
                if key0 + config.block_n <= seq_len - seq_q + 1:  # no key of the tile is masked
                    m, l, o = _attend(kv_s, q_frags, kv_row, first_key, lane, key_limit,
                                      seq_len, scale_log2, m, l, o, shape, False)
                else:
                    m, l, o = _attend(kv_s, q_frags, kv_row, first_key, lane, key_limit,
                                      seq_len, scale_log2, m, l, o, shape, True)
                empty.arrive(stage)
        if shape.wgmma:
            if num_tiles > 0:  # the last tile's P V product
                last_stage = (num_tiles - 1) % S
                o = _issue_pv_wgmma(descs, wgmma.scale_rows(o, alphas), probs, last_stage,
                                    shape)
                wgmma.wait_group(0)
                empty.arrive(last_stage)

        arrival = None
        if fused_slots and merge_slices == 1:
            # This CTA's place among its (batch, KV head, row block)'s splits to end their
            # loops; only read after the merge below, so the atomic's round trip overlaps it.
            arrival = kiln.cast(0, kiln.i64)
            if tid == 0:
                arrival = tickets.atomic_add(kiln.block_id(2), kiln.block_id(1), ARRIVED, 1)
        l = [kiln.shuffle.butterfly_reduce(x, (1, 2), operator.add) for x in l]
        if shape.wgmma:  # each row is one thread quad's: no merge between warps
            _store_fragment_rows(m, l, o, sinks, block_table, o_part, lse_part, counts, split,
                                 b, q_first, kv_head, row0 + warp_row0, lane, seq_len, seq_q,
                                 tiles_per_split, shape, block_sparse, has_sinks)
        else:
            kiln.barrier()  # every warp's last ldmatrix is done: the ring becomes merge scratch
            scratch = ring.reinterpret((shape.merge_floats,), kiln.f32)
            _write_warp_state(scratch, m, l, o, key_slice, warp_row0, lane, shape)
            kiln.barrier()
            _merge_and_store(scratch, sinks, block_table, o_part, lse_part, counts, split, b,
                             q_first, kv_head, row0, tid, seq_len, seq_q, tiles_per_split,
                             shape, block_sparse, has_sinks)
        if fused_slots:
            last = kiln.shared((1,), kiln.i32)
            _combine_if_last(o_part, lse_part, o_out, lse_out, tickets, arrival, last, b,
                             q_first, kv_head, row0, tid, shape, fused_slots, merge_slices)

    paged_decode.__name__ = paged_decode.__qualname__ = (
        f"paged_decode_d{D}_g{group}_q{q_rows}_p{page_size}{'_sparse' if block_sparse else ''}"
        f"{'_sinks' if has_sinks else ''}{f'_fused{fused_slots}' if fused_slots else ''}"
        f"{f'x{merge_slices}' if merge_slices > 1 else ''}"
        f"{f'_pf{prefetch_tiles}' if prefetch_tiles else ''}")
    # Each exp2 is then one MUFU op, not four with the denormal range fix-up around it.
    return kiln.kernel(paged_decode, flush_denormals=True)


def _split_tiles(seq_len, num_splits, split, block_n):
    """``(tiles_total, tiles_per_split, tile_begin, tile_end)``: a sequence of ``seq_len``
    keys in ``block_n``-key tiles, split evenly (every split at least one tile), and the
    range of split ``split``."""
    tiles_total = (seq_len + block_n - 1) // block_n
    tiles_per_split = kiln.maximum((tiles_total + num_splits - 1) // num_splits, 1)
    tile_begin = split * tiles_per_split
    return (tiles_total, tiles_per_split, tile_begin,
            kiln.minimum(tile_begin + tiles_per_split, tiles_total))


@kiln.func
def _prefetch_split_start(k_map, v_map, page_table, seq_lens, num_splits, split, b, column,
                          tiles, shape):
    """TMA prefetches into L2 of K's and V's boxes of split ``split``'s first ``tiles`` tiles
    (one page a tile). Its page look-ups go out together, bounded by the page table's width,
    so a stale ``seq_lens`` entry only aims the prefetches wrong."""
    _, _, tile_begin, tile_end = _split_tiles(seq_lens[b], num_splits, split,
                                              shape.config.block_n)
    table_rows = page_table.shape[1] * shape.page_size
    rows = [_tile_rows(shape.rows_params, page_table, b, tile_begin + t, table_rows).row(0)
            for t in range(tiles)]
    for t in kiln.static_range(tiles):
        if tile_begin + t < tile_end:
            _prefetch_tile(k_map, v_map, column, rows[t], shape)


def _prefetch_tile(k_map, v_map, column, row, shape):
    """TMA prefetches into L2 of one page-sized tile's K and V boxes from cache row ``row``."""
    for h in range(shape.halves):
        kiln.tma.prefetch(k_map, (column + h * HALF, row))
        kiln.tma.prefetch(v_map, (column + h * HALF, row))


def _load_q_fragments(q, b, q_first, kv_head, warp_row0, lane, shape):
    """``[m tile][k16 step]`` m16n8k16 A fragments (``vector<8xbf16>``) of packed q rows
    ``warp_row0 ..``, read from global memory in the order ``ldmatrix.x4`` gives: lane holds
    rows ``lane // 4`` (+ 8) and columns ``2 (lane % 4)`` (+ 8) of each 16 x 16 block, as
    ``(row, col)``, ``(row + 8, col)``, ``(row, col + 8)``, ``(row + 8, col + 8)`` pairs.
    Padding rows past the packed rows are zeros."""
    group, packed = shape.group, shape.packed
    frags = []
    for i in range(shape.m_tiles):
        heads, tokens, live = [], [], []
        for half in range(2):
            r = warp_row0 + 16 * i + lane // 4 + 8 * half
            row = kiln.minimum(r, packed - 1)
            tokens.append(q_first + row // group)
            heads.append(kv_head * group + row % group)
            live.append(r < packed)
        frags.append([])
        for kk in range(shape.head_dim // 16):
            parts = []
            for col_half, half in ((0, 0), (0, 1), (1, 0), (1, 1)):
                pair = q.load(b, tokens[half], heads[half], 16 * kk + 8 * col_half
                              + 2 * (lane % 4), width=2, align=4)
                parts += kiln.unpack(kiln.where(live[half], pair, 0.0))
            frags[i].append(kiln.pack(parts))
    return frags


def _tile_rows(rows_params, page_table, b, tile, seq_len):
    """The :class:`PagedRowIndices` of tile ``tile`` (its page-table loads), or None where
    the tile has more pages than are unrolled (:func:`_load_tile` looks those up itself).
    A tile past the sequence reads the last page's entry and maps to out-of-bounds rows."""
    Rows = PagedRowIndices[rows_params]
    if Rows.num_pages > MAX_UNROLLED_PAGES:
        return None
    return Rows.populate(PageTableRow(page_table, b), tile * Rows.BN, seq_len)


@kiln.func
def _load_tile(rows_params, rows, page_table, b, tile, seq_len, k_map, v_map, slots, full,
               stage, column, producer, shape):
    """TMA tile ``tile``'s K and V into ring ``stage`` from its looked-up ``rows`` (see
    :func:`_tile_rows`; None: look the pages up here): one box per page and 64-column half,
    slot ``shape.first_slot(stage, kv, half) + page``.
    ``rows_params`` is ``(BN, page_size)``: a struct class cannot be captured by a traced if."""
    Rows = PagedRowIndices[rows_params]
    full.arrive_expect_tx(stage, shape.tile_bytes, predicate=producer)
    if Rows.num_pages > MAX_UNROLLED_PAGES:
        # Many small pages: a run-time loop keeps the code and the live rows (registers beside
        # O) small.
        for p in kiln.range(0, Rows.num_pages):
            logical = tile * Rows.BN + p * Rows.eff_page
            page = kiln.minimum(logical // Rows.page_size,
                                kiln.maximum((seq_len - 1) // Rows.page_size, 0))
            row = kiln.where(logical < seq_len, page_table[b, page] * Rows.page_size
                             + logical % Rows.page_size, OOB_ROW)
            for h in kiln.static_range(shape.halves):
                for kv in kiln.static_range(2):
                    kiln.tma.load(v_map if kv else k_map,
                                  slots.tile(shape.first_slot(stage, kv, h) + p),
                                  (column + h * HALF, row), full, stage, predicate=producer,
                                  eviction_policy=KV_EVICTION)
        return
    for h in kiln.static_range(shape.halves):
        rows.tma_copy_k(k_map, slots, full, stage, column=column + h * HALF, elect=producer,
                        needs_partial=False, eviction_policy=KV_EVICTION,
                        first_slot=shape.first_slot(stage, 0, h))
        rows.tma_copy_v(v_map, slots, full, stage, column=column + h * HALF, elect=producer,
                        needs_partial=False, eviction_policy=KV_EVICTION,
                        first_slot=shape.first_slot(stage, 1, h))


@kiln.func
def _attend(kv_s, q_frags, kv_row, first_key, lane, key_limit, seq_len, scale_log2, m, l,
            o, shape, masked):
    """One tile's slice of this warp (``shape.keys`` keys from ring row ``kv_row``, the
    first being key ``first_key``): S = Q K^T, masked streaming softmax, O += P V. ``masked``
    (Python bool): apply the causal/length mask and zero V rows past the sequence."""
    D, MT = shape.head_dim, shape.m_tiles
    keys = shape.keys
    BN = shape.config.block_n
    atom = kiln.mma.atom(16, 8, 16, kiln.bf16)
    o = [list(row) for row in o]  # a fresh list: both branches of the caller's if trace this
    s = [[kiln.vector_constant([0.0] * 4, kiln.f32) for _ in range(keys // 8)]
         for _ in range(MT)]
    for kk in kiln.static_range(D // 16):
        k_frags = []
        for jj in kiln.static_range(keys // 16):
            pair = ldmatrix.ldmatrix(kv_s, (kv_row + 16 * jj, 16 * kk), K_PAIR_BLOCKS)
            k_frags += [kiln.vector_slice(pair, 0, 4), kiln.vector_slice(pair, 4, 4)]
        for i in kiln.static_range(MT):
            a = q_frags[i][kk]
            for j in kiln.static_range(keys // 8):
                s[i][j] = atom(a, k_frags[j], s[i][j])

    # Accumulator element e of key atom j: key first_key + 8j + 2(lane % 4) + e % 2, row half
    # e // 2 (rows lane // 4 and lane // 4 + 8). State index 2i + half: m tile i, row half.
    col = first_key + 2 * (lane % 4)
    raw, lane_max = [], []
    for i in kiln.static_range(MT):
        limits = kiln.pack([key_limit[2 * i], key_limit[2 * i],
                            key_limit[2 * i + 1], key_limit[2 * i + 1]])
        raw.append([])
        for j in kiln.static_range(keys // 8):
            x = s[i][j]
            if masked:
                key = kiln.pack([col + 8 * j, col + 8 * j + 1, col + 8 * j, col + 8 * j + 1])
                x = kiln.where(key <= limits, x, -math.inf)
            raw[i].append(x)
        for half in kiln.static_range(2):
            top = kiln.unpack(raw[i][0])[2 * half]
            for x in raw[i]:
                parts = kiln.unpack(x)
                top = kiln.maximum(top, kiln.maximum(parts[2 * half], parts[2 * half + 1]))
            lane_max.append(top * scale_log2)  # the scale is positive: max commutes with it
    if shape.config.lazy_rescale:
        # The row maxima are reduced, and O and l rescaled, only when a score of the warp
        # passed its row's max by LAZY_RESCALE_THRESHOLD: otherwise P = 2^(x - stale max)
        # stays below 2^threshold and the tile costs no shuffle and no O multiply.
        grew = lane_max[0] > m[0] + LAZY_RESCALE_THRESHOLD
        for k in range(1, 2 * MT):
            grew = grew | (lane_max[k] > m[k] + LAZY_RESCALE_THRESHOLD)
        if kiln.shuffle.any_lane(grew):
            m, l, o = _rescale_to_tile_max(m, l, o, lane_max)
    else:
        m, l, o = _rescale_to_tile_max(m, l, o, lane_max)
    # A row with no key yet keeps m = -inf; shifting by 0 instead avoids inf - inf.
    shifts = [kiln.where(x == -math.inf, 0.0, x) for x in m]
    new_l, p16 = [], []
    for i in kiln.static_range(MT):
        shift = kiln.pack([-shifts[2 * i], -shifts[2 * i], -shifts[2 * i + 1],
                           -shifts[2 * i + 1]])
        probs = [kiln.exp2(kiln.fma(x, scale_log2, shift)) for x in raw[i]]
        for half in kiln.static_range(2):
            total = l[2 * i + half]
            for pj in probs:
                parts = kiln.unpack(pj)
                total = total + parts[2 * half] + parts[2 * half + 1]
            new_l.append(total)
        # Two n8 accumulators (keys 16k.., 16k+8..) are one k16 A fragment of P.
        p16.append([kiln.cast(kiln.pack(kiln.unpack(probs[2 * k]) + kiln.unpack(probs[2 * k + 1])),
                              kiln.bf16) for k in range(keys // 16)])

    for k in kiln.static_range(keys // 16):
        if masked:
            # B fragment element e of lane: key 16k + 2(lane % 4) + e % 2 + 8 (e // 2).
            base = first_key + 16 * k + 2 * (lane % 4)
            v_keys = kiln.pack([base, base + 1, base + 8, base + 9])
            v_live = v_keys < seq_len
        for nn in kiln.static_range(D // 16):
            pair = ldmatrix.ldmatrix(kv_s, (kv_row + BN + 16 * k, 16 * nn), V_PAIR_BLOCKS,
                                     trans=True)
            for half in kiln.static_range(2):
                v = kiln.vector_slice(pair, 4 * half, 4)
                if masked:
                    v = kiln.where(v_live, v, 0.0)
                for i in kiln.static_range(MT):
                    o[i][2 * nn + half] = atom(p16[i][k], v, o[i][2 * nn + half])
    return m, new_l, o


ZERO_ROWS_BARRIER = 1  # named barrier: V rows past the sequence zeroed before the PV product


def _stage_descriptors(descs, stage, shape):
    """K and V descriptors of ring ``stage`` from stage 0's."""
    units = kiln.cast(stage * (shape.tile_bytes // 16), kiln.i64)
    return descs[0] + units, descs[1] + units


def _issue_qk_wgmma(descs, q_frags, stage, shape):
    """Issue ``S = Q K^T`` for ring ``stage`` as one WGMMA group (``consumer='wgmma'``:
    ``m64nBNk16``, Q's A fragments from registers, K K-major: a 16-deep step moves 32 bytes
    inside a 64-column half, every 4 steps the next half)."""
    BN, D = shape.config.block_n, shape.head_dim
    half_units = BN * HALF * 2 // 16  # one 64-column half of a tile, in descriptor units
    k, _ = _stage_descriptors(descs, stage, shape)
    scores = wgmma.fragment_zeros(BN)
    wgmma.fence()
    for kk in kiln.static_range(D // 16):
        scores = wgmma.mma_async_regs(scores, q_frags[0][kk],
                                      k + (kk // 4) * half_units + (kk % 4) * 2,
                                      dtype=kiln.bf16, b_major="k")
    wgmma.commit()
    return scores


def _issue_pv_wgmma(descs, o, probs, stage, shape):
    """Issue ``O += P V`` for ring ``stage`` as one WGMMA group: P from registers (one A
    operand per 16 keys), V MN-major (16 keys further is 16 rows of 128 bytes; the
    descriptor's leading byte offset steps over the 64-column halves)."""
    _, v = _stage_descriptors(descs, stage, shape)
    wgmma.fence()  # orders O's rescale and P's registers before the asynchronous reads
    for kk in kiln.static_range(shape.config.block_n // 16):
        o = wgmma.mma_async_regs(o, probs[kk], v + kk * 16 * HALF * 2 // 16, dtype=kiln.bf16,
                                 b_major="mn")
    wgmma.commit()
    return o


@kiln.func
def _softmax_wgmma(scores, m, l, key0, tid, key_limit, scale_log2, shape, masked):
    """The streaming softmax of one tile's scores (a ``64 x BN`` accumulator; each row is a
    thread quad's): new ``(m, l)`` (base 2; ``l`` per lane until the end), P as the bf16 A
    operands of the P V product, and the factors O must be rescaled by before it.
    ``masked`` (Python bool): scores past each row's last key (``key_limit``) become -inf."""
    BN = shape.config.block_n
    # Register i: row half (i // 2) % 2, key key0 + 8 (i // 4) + 2 (lane % 4) + i % 2.
    col = key0 + 2 * (tid % 4)
    x = []
    for i in kiln.static_range(BN // 2):
        xi = scores.element(i) * scale_log2
        if masked:
            xi = kiln.where(col + 8 * (i // 4) + i % 2 <= key_limit[(i // 2) % 2], xi,
                            -math.inf)
        x.append(xi)
    alphas, safes, new_m, new_l = [], [], [], []
    for half in kiln.static_range(2):
        mine = [x[i] for i in range(BN // 2) if (i // 2) % 2 == half]
        row_max = mine[0]
        for xi in mine[1:]:
            row_max = kiln.maximum(row_max, xi)
        m_next, m_safe, alpha = _advance_row_max(m[half], row_max)
        alphas.append(alpha)
        safes.append(m_safe)
        new_m.append(m_next)
    probs = [kiln.exp2(x[i] - safes[(i // 2) % 2]) for i in range(BN // 2)]
    for half in kiln.static_range(2):
        total = l[half] * alphas[half]
        for i in kiln.static_range(BN // 2):
            if (i // 2) % 2 == half:
                total = total + probs[i]
        new_l.append(total)
    p = wgmma.a_fragment_from_accumulator(wgmma.fragment_from_elements(probs), kiln.bf16)
    return new_m, new_l, p, alphas


@kiln.func
def _zero_rows_past_end(slots, stage, valid_keys, tid, shape):
    """Zero the V rows of ring ``stage`` from key ``valid_keys`` of the tile on (keys past the
    sequence), 16 bytes a store, then make the writes visible to the tensor core's reads
    (async proxy) and to the whole warp group."""
    BN, eff = shape.config.block_n, shape.eff
    units = BN * shape.halves * HALF // 8  # 16-byte units of the tile's V
    zeros = kiln.vector_constant([0.0] * 8, kiln.bf16)
    for step in kiln.static_range(-(-units // shape.threads)):
        index = step * shape.threads + tid
        key = index // (HALF // 8) % BN
        half = index // (HALF // 8) // BN
        if (index < units) & (key >= valid_keys):
            slots.store(shape.first_slot(stage, 1, half) + key // eff, key % eff,
                        index % (HALF // 8) * 8, zeros, align=16)
    nvidia_asm.fence_proxy_async()
    nvidia_asm.named_barrier(ZERO_ROWS_BARRIER, shape.threads)


def _advance_row_max(m, lane_max):
    """One row's running max after a tile whose scores this lane saw up to ``lane_max`` (a
    row is a thread quad's): ``(m_next, m_safe, alpha)``, where ``m_safe`` is what the tile's
    scores are shifted by and ``alpha = 2^(m - m_safe)`` rescales the row's earlier sums.
    A row with no key yet keeps m = -inf; shifting by 0 instead avoids inf - inf."""
    m_next = kiln.maximum(m, kiln.shuffle.butterfly_reduce(lane_max, (1, 2), kiln.maximum))
    m_safe = kiln.where(m_next == -math.inf, 0.0, m_next)
    return m_next, m_safe, kiln.exp2(m - m_safe)


@kiln.func
def _rescale_to_tile_max(m, l, o, lane_max):
    """The mma.sync consumer's states moved to the maxima of a tile whose scaled scores each
    lane saw up to ``lane_max[2 i + half]``: every row's max reduced over its thread quad,
    and its ``l`` and O rows rescaled to it. Returns ``(m, l, o)``."""
    new_m, new_l, new_o = [], [], []
    for i in kiln.static_range(len(o)):
        alphas = []
        for half in kiln.static_range(2):
            m_next, _, alpha = _advance_row_max(m[2 * i + half], lane_max[2 * i + half])
            new_m.append(m_next)
            new_l.append(l[2 * i + half] * alpha)
            alphas.append(alpha)
        scale_o = kiln.pack([alphas[0], alphas[0], alphas[1], alphas[1]])
        new_o.append([acc * scale_o for acc in o[i]])
    return new_m, new_l, new_o


@kiln.func
def _write_warp_state(scratch, m, l, o, key_slice, warp_row0, lane, shape):
    """This warp's unnormalised O rows and (m, l) into the merge scratch: CTA row ``r`` of key
    slice ``k`` at ``(k * rows + r) * merge_row``, the (m, l) pairs after all O rows."""
    rows, stride = shape.rows, shape.merge_row
    ml_base = shape.group_warps * rows * stride
    for i in kiln.static_range(shape.m_tiles):
        for half in kiln.static_range(2):
            if shape.warp_groups == 1 and 16 * i + 8 * half >= shape.packed:
                continue  # only padding rows, which the merge skips
            r = key_slice * rows + warp_row0 + 16 * i + lane // 4 + 8 * half
            for n in kiln.static_range(shape.head_dim // 8):
                scratch.store(r * stride + 8 * n + 2 * (lane % 4),
                              kiln.vector_slice(o[i][n], 2 * half, 2))
            if lane % 4 == 0:
                scratch[ml_base + 2 * r] = m[2 * i + half]
                scratch[ml_base + 2 * r + 1] = l[2 * i + half]


def _interleaved_columns(tid, per_row: int, head_dim: int) -> list:
    """The first columns of the 4-column chunks that thread ``tid`` takes of its row, when
    ``per_row`` threads share each row: ``4 j + 4 per_row k`` for ``j = tid % per_row``. One
    instruction of a row's threads then covers ``16 per_row`` contiguous bytes of f32 (whole
    sectors). With each thread's chunks side by side instead, 4-byte stores 64 bytes apart
    made ``decode`` alone 5-6 us slower at Sq 4, batch 1 on an H200 (ctx 4k: 15.3 vs
    9.5 us)."""
    return [4 * (tid % per_row) + 4 * per_row * k for k in range(head_dim // (4 * per_row))]


@kiln.func
def _merge_and_store(scratch, sinks, block_table, o_part, lse_part, counts, split, b, q_first,
                     kv_head, row0, tid, seq_len, seq_q, tiles_per_split, shape, block_sparse,
                     has_sinks):
    """Thread ``tid`` merges the states of one packed row's warps (one per key slice) over
    ``D / (threads / rows)`` columns and writes O_partial; the row's first thread writes LSE
    (and, on split 0, the split count).

    A row's threads take :func:`_interleaved_columns`, so each store instruction writes whole
    32-byte sectors with 16-byte stores. Only rows that exist get threads (the m16 padding
    rows get none), so with 8 packed rows each row has 16 threads, not 8."""
    rows, stride, D = shape.rows, shape.merge_row, shape.head_dim
    slices = shape.group_warps  # warps holding parts of each row
    per_row = shape.combine_threads_per_row
    ml_base = slices * rows * stride
    r = tid // per_row
    columns = _interleaved_columns(tid, per_row, D)
    row = row0 + r
    if (r < shape.combine_rows) & (row < shape.packed):
        q_index = q_first + row // shape.group
        head = kv_head * shape.group + row % shape.group
        ms = [scratch[ml_base + 2 * (w * rows + r)] for w in range(slices)]
        ls = [scratch[ml_base + 2 * (w * rows + r) + 1] for w in range(slices)]
        m_all, weights, total, inv = _row_weights(ms, ls, sinks, head, split, has_sinks)
        for c in columns:
            acc = scratch.load((0 * rows + r) * stride + c, width=4, align=16) * weights[0]
            for w in kiln.static_range(1, slices):
                acc = kiln.fma(scratch.load((w * rows + r) * stride + c, width=4, align=16),
                               weights[w], acc)
            o_part.store(split, b, q_index, head, c, acc * inv, align=16)
        if tid % per_row == 0:
            _store_row_lse(m_all, total, block_table, lse_part, counts, split, b, q_index,
                           head, kv_head, seq_len, seq_q, tiles_per_split, shape, block_sparse)


@kiln.func
def _store_fragment_rows(m, l, o, sinks, block_table, o_part, lse_part, counts, split, b,
                         q_first, kv_head, warp_row0, lane, seq_len, seq_q, tiles_per_split,
                         shape, block_sparse, has_sinks):
    """``consumer='wgmma'``: this thread's two rows of the warp group's O (packed rows
    ``warp_row0 + lane // 4`` and ``+ 8``; each row is one quad's), normalised, straight from
    the accumulator into O_partial: a quad's 8-byte stores fill 32-byte sectors. The quad's
    first lane writes LSE (and, on split 0, the split count)."""
    for half in kiln.static_range(2):
        row = warp_row0 + lane // 4 + 8 * half
        if row < shape.packed:
            q_index = q_first + row // shape.group
            head = kv_head * shape.group + row % shape.group
            m_all, weights, total, inv = _row_weights([m[half]], [l[half]], sinks, head,
                                                      split, has_sinks)
            scale = weights[0] * inv
            for n in kiln.static_range(shape.head_dim // 8):
                pair = kiln.pack([o.element(4 * n + 2 * half), o.element(4 * n + 2 * half + 1)])
                o_part.store(split, b, q_index, head, 8 * n + 2 * (lane % 4), pair * scale,
                             align=8)
            if lane % 4 == 0:
                _store_row_lse(m_all, total, block_table, lse_part, counts, split, b, q_index,
                               head, kv_head, seq_len, seq_q, tiles_per_split, shape,
                               block_sparse)


def _row_weights(ms, ls, sinks, head, split, has_sinks):
    """One row's states ``(m_w, l_w)`` (base 2, ``m = -inf`` for none) merged: the row max
    (split 0's sink included), each state's weight ``2^(m_w - max)``, the denominator and its
    inverse (0 for a row without mass)."""
    m_all = ms[0]
    for x in ms[1:]:
        m_all = kiln.maximum(m_all, x)
    if has_sinks:
        sink = kiln.where(split == 0, sinks[head] * LOG2E, -math.inf)
        m_all = kiln.maximum(m_all, sink)
    m_safe = kiln.where(m_all == -math.inf, 0.0, m_all)
    weights = [kiln.exp2(x - m_safe) for x in ms]
    total = weights[0] * ls[0]
    for w, x in zip(weights[1:], ls[1:]):
        total = kiln.fma(w, x, total)
    if has_sinks:
        total = total + kiln.exp2(sink - m_safe)
    return m_all, weights, total, kiln.where(total > 0.0, 1.0 / kiln.maximum(total, 1e-30), 0.0)


@kiln.func
def _store_row_lse(m_all, total, block_table, lse_part, counts, split, b, q_index, head,
                   kv_head, seq_len, seq_q, tiles_per_split, shape, block_sparse):
    """LSE_partial of one row (natural log, ``-inf`` without mass) and, on split 0, its
    split count."""
    lse_part[split, b, q_index, head] = kiln.where(
        total > 0.0, (m_all + kiln.log2(kiln.maximum(total, 1e-30))) * LN2, -math.inf)
    if split == 0:
        counts[b, q_index, head] = _split_count(
            block_table, b, q_index, kv_head, seq_len - seq_q + q_index + 1,
            tiles_per_split, shape.config.block_n, block_sparse)


@kiln.func
def _combine_if_last(o_part, lse_part, o_out, lse_out, tickets, arrival, last, b, q_first,
                     kv_head, row0, tid, shape, slots, merge_slices):
    """Merge all ``slots`` splits of this CTA's rows into ``o_out`` / ``lse_out`` if this CTA
    is (one of) the last of its (batch, KV head, row block), as
    :func:`kiln.kernels.attention.combine` would (every slot read: a split that saw no key
    has LSE ``-inf`` and weight 0). Each (batch, KV head, row block) has two i64 counters,
    ``tickets[z, y, ARRIVED]`` and ``tickets[z, y, PUBLISHED]``; they only grow (every launch
    adds ``slots`` to each), so ``ticket % slots`` is a CTA's place in its launch.

    - ``merge_slices == 1``: thread 0 took ``arrival``, its ARRIVED ticket, when the main loop
      ended, and its round trip overlapped the CTA's own merge. The CTA that arrived last
      merges: it waits (:func:`kiln.nvidia_asm.wait_for_count`) until the other ``slots - 1``
      have published, and so skips the fence after its own stores and the atomic round trip
      of a ticket drawn after them. The others fence and add to PUBLISHED (the last adds
      after its wait). It waits only for CTAs that arrived before it, so are running. On an
      H200 this took 0.1-0.6 us off Sq 1 at ctx >= 16k (batch 1, 16k: 19.72 -> 19.60 us;
      batch 4, 16k: 63.70 -> 63.30) and left 4k unchanged.
    - ``merge_slices > 1``: every CTA fences and draws a PUBLISHED ticket; the CTAs that drew
      the last ``merge_slices`` each merge ``D / merge_slices`` columns: slice ``k`` goes to
      the CTA ``k`` places before the last, which waits until PUBLISHED reaches the end of the
      launch. It waits for at most ``k`` CTAs of its (batch, KV head, row block), the ones
      without a ticket yet; CTAs start in block order and those splits are adjacent in it
      (``x``), so they are running or next to start.

    Ordering (CUTLASS's split-K semaphore pattern): the CTA barrier puts every thread's
    partial stores before thread 0's gpu-scope fence and PUBLISHED ticket; in a merging CTA
    thread 0 acquires (the wait's acquire loads, or a fence after the last ticket), and the
    second barrier orders its threads' reads of the other splits' partials (just written, so
    from L2) after that; its own partials are ordered by the barriers alone. Each of
    ``per_row`` threads of a row takes its 4-column chunks (:func:`_interleaved_columns`, so
    a load instruction reads whole sectors); its loads of a chunk of splits are independent,
    so up to ``MAX_COMBINE_LOADS`` 16-byte loads a thread are in flight."""
    cta = (kiln.block_id(2), kiln.block_id(1))
    kiln.barrier()
    if tid == 0:
        if merge_slices == 1:
            ticket = arrival
        else:
            kiln.fence("gpu")
            ticket = tickets.atomic_add(*cta, PUBLISHED, 1)
        place = ticket % slots
        slice_index = kiln.cast(slots - 1 - place, kiln.i32)  # 0: the last to arrive or publish
        last[0] = slice_index
        if merge_slices == 1:
            if slice_index == 0:
                # Every other split arrived first (and is running): wait until they published.
                nvidia_asm.wait_for_count(tickets, *cta, PUBLISHED,
                                          target=ticket - place + slots - 1)
            else:
                kiln.fence("gpu")
            tickets.atomic_add(*cta, PUBLISHED, 1)
        else:
            if slice_index == 0:
                kiln.fence("gpu")
            if (slice_index > 0) & (slice_index < merge_slices):
                nvidia_asm.wait_for_count(tickets, *cta, PUBLISHED,
                                          target=ticket - place + slots)
    kiln.barrier()
    width = shape.head_dim // merge_slices
    per_row = min(shape.combine_threads_per_row, width // 4)
    r = tid // per_row
    slice_index = last[0]
    columns = [slice_index * width + c for c in _interleaved_columns(tid, per_row, width)]
    row = row0 + r
    if (slice_index < merge_slices) & (r < shape.combine_rows) & (row < shape.packed):
        q_index = q_first + row // shape.group
        head = kv_head * shape.group + row % shape.group
        m = lse_part[0, b, q_index, head]
        for s in kiln.static_range(1, slots):
            m = kiln.maximum(m, lse_part[s, b, q_index, head])
        m_safe = kiln.where(m == -math.inf, 0.0, m)  # every split empty: no -inf - -inf
        total = kiln.cast(0.0, kiln.f32)
        acc = [kiln.vector_constant([0.0] * 4, kiln.f32) for _ in columns]
        chunk = max(1, MAX_COMBINE_LOADS // len(columns))
        for first in kiln.static_range(0, slots, chunk):
            splits = range(first, min(first + chunk, slots))
            lses = [lse_part[s, b, q_index, head] for s in splits]
            parts = [[o_part.load(s, b, q_index, head, c, width=4, align=16)
                      for c in columns] for s in splits]
            for x, vectors in zip(lses, parts):
                w = kiln.exp2((x - m_safe) * LOG2E)
                total = total + w
                # One instruction a column: this merge is issue-bound, not bandwidth-bound
                # (bf16 partials, half the bytes, took as long on an H200).
                acc = [kiln.fma(v, w, a) for a, v in zip(acc, vectors)]
        valid = (total > 0.0) & (total < math.inf)
        inv = kiln.where(valid, 1.0 / kiln.maximum(total, 1e-30), 0.0)
        for c, a in zip(columns, acc):  # combine's contract: no valid denominator, O = 0
            o_out.store(b, q_index, head, c, kiln.cast(kiln.where(valid, a * inv, 0.0),
                                                       kiln.bf16), align=8)
        if (tid % per_row == 0) & (slice_index == 0):
            lse_out[b, q_index, head] = kiln.where(
                valid, m_safe + kiln.log2(kiln.maximum(total, 1e-30)) * LN2, -math.inf)


@kiln.func
def _split_count(block_table, b, q_index, kv_head, visible_keys, tiles_per_split, BN,
                 block_sparse):
    """Partial slots holding keys for a row: its selected blocks (``-1`` padded), or the
    splits that cover its first ``visible_keys`` keys."""
    if block_sparse:
        selected = 0
        for j in kiln.range(0, block_table.shape[3]):
            selected = selected + kiln.where(block_table[b, q_index, kv_head, j] >= 0, 1, 0)
        return selected
    visible_tiles = (kiln.maximum(visible_keys, 0) + BN - 1) // BN
    return (visible_tiles + tiles_per_split - 1) // tiles_per_split


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, block_n: int = 64,
                       sms: int = DEFAULT_SMS, row_blocks: int = 1) -> int:
    """Splits that fill one wave of ``CTAS_PER_SM`` CTAs per SM (rounded down, so no second
    wave of a few CTAs), without splitting below one tile each.
    Example: ``default_num_splits(1, 8, 16384) == 16`` (128 CTAs of 16 tiles on 132 SMs)."""
    tiles = max(1, -(-max_seq_len // block_n))
    per_split = batch * kv_heads * row_blocks
    return max(1, min(tiles, CTAS_PER_SM * sms // per_split, MAX_DEFAULT_SPLITS))


def decode(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None, block_table=None,
           scale=None, sinks=None, target=None, backend=None, config=None, validate=False):
    """Split-KV paged decode attention; returns ``(o_partial, lse_partial, split_counts)``
    (see the module docs) for :func:`kiln.kernels.attention.combine`.

    ``q``: ``[B, Sq, Hq, D]`` bf16 (a 4-byte aligned address); ``k_cache``/``v_cache``:
    ``[num_pages, page_size, Hkv, D]`` bf16; ``page_table``: ``[B, max_pages]`` int32;
    ``seq_lens``: ``[B]`` int32 (including the ``Sq`` new tokens); ``block_table``: optional
    ``[B, Sq, Hkv, top_k]`` int32 block indices; ``sinks``: optional ``[Hq]`` f32; ``scale``
    defaults to ``D ** -0.5``; ``config``: a :class:`DecodeConfig` (None:
    :func:`default_config` of the shape).
    numpy inputs give numpy outputs; torch CUDA tensors stay on the device (the three torch
    partials are views of one allocation).

    Inputs are validated (a :class:`kiln.KilnError` naming the argument): kinds, ranks, dtypes
    and agreeing sizes once per shape class; ``num_splits >= 1``, ``scale > 0``; per call,
    ``0 <= seq_lens[b] <= max_pages * page_size`` and every page id a sequence uses in
    ``[0, num_pages)``. That per-call check always runs for numpy inputs; for torch CUDA
    tensors it costs a device-side reduction and a synchronisation, so it runs only with
    ``validate=True`` (not inside a CUDA graph capture). Unchecked, an out-of-range id inside
    a sequence reads a NaN-filled box (never another page or zeros), so its rows' outputs are
    NaN. An empty batch (``B``, ``Sq`` or ``Hq`` of
    0) returns empty partials and launches nothing.
    Example::

        o_part, lse_part, counts = decode(q, k_cache, v_cache, page_table, seq_lens)
        o, lse = kiln.kernels.attention.combine(o_part, lse_part, counts)
    """
    plan = _plan(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale,
                 sinks, target, backend, config, fused=False)
    if plan.kernel is None:
        return plan.torch_partials() if plan.device is not None else plan.numpy_partials()
    _check_values(k_cache, page_table, seq_lens, block_table, validate)
    if plan.bound is not None and _bindable(plan, q, k_cache, v_cache, page_table, seq_lens,
                                            block_table, sinks):
        words, partials = plan.torch_partial_words()
        plan.bound(*_input_pointers(plan, q, k_cache, v_cache, page_table, seq_lens,
                                    block_table, sinks), *partials,
                   *(t.data_ptr() for t in plan.no_outputs))
        return plan.torch_partials(words)
    return _run_unbound(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                        backend)


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None,
                     block_table=None, scale=None, sinks=None, target=None, backend=None,
                     config=None, fused_combine=None, validate=False):
    """Split-KV decode attention with the splits merged: the attention output
    ``[B, Sq, Hq, D]`` (bf16) and its natural-log LSE ``[B, Sq, Hq]`` (f32). Same keywords as
    :func:`decode`.

    ``fused_combine=True``: one kernel. Each split CTA stores its partials and takes tickets
    (gpu-scope atomic counters per batch, KV head and row block); the last CTA (or the last
    few, for large merges) merges the splits of its rows as
    :func:`kiln.kernels.attention.combine` would, saving the combine's launch. ``False``:
    :func:`decode`, then ``combine`` (two kernels, the merge spread over many CTAs). Inputs are
    validated as :func:`decode` describes (``validate=True`` adds the per-call check of device
    tensors' page ids and lengths); an empty batch returns empty ``o`` and ``lse``.
    ``None`` (default): fused while one CTA merges at most ``FUSED_COMBINE_MAX_BYTES`` of
    partials (every shape of ``bench/decode.py``'s grid).

    With contiguous torch CUDA tensors a repeat call of one shape class is one bound launch
    and three allocations (the partials, freed to torch's stream-ordered allocator once the
    launch is queued, and the returned ``o`` and ``lse``), and it can be captured in a CUDA
    graph (``torch.cuda.graph``) and replayed with no host work per step (check the page table
    before capturing, e.g. with one ``validate=True`` call; the kernel poisons rows with bad
    ids). The
    ticket counters are kept per plan and per stream; each launch adds the split count to each
    of them.
    Example: ``o, lse = decode_attention(q, k_cache, v_cache, page_table, seq_lens)``.
    """
    plan = _plan(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale,
                 sinks, target, backend, config, fused=fused_combine)
    if plan.kernel is None:
        shape = plan.partial_shape[1:]
        return empty_like(q, shape, kiln.bf16), empty_like(q, shape[:3], kiln.f32)
    _check_values(k_cache, page_table, seq_lens, block_table, validate)
    bindable = plan.bound is not None and _bindable(plan, q, k_cache, v_cache, page_table,
                                                    seq_lens, block_table, sinks)
    if bindable and plan.fused:
        words, partials = plan.torch_partial_words()  # freed once the launch is queued
        o, lse = plan.outputs(like=words)
        stream = plan.bound.current_stream()
        plan.bound(*_input_pointers(plan, q, k_cache, v_cache, page_table, seq_lens,
                                    block_table, sinks), *partials, o.data_ptr(),
                   lse.data_ptr(), plan.torch_tickets(stream).data_ptr(), stream=stream)
        return o, lse
    if bindable and plan.merge is not None:
        words, partials = plan.torch_partial_words()
        o, lse = plan.merge.new_outputs(words)
        plan.bound(*_input_pointers(plan, q, k_cache, v_cache, page_table, seq_lens,
                                    block_table, sinks), *partials,
                   *(t.data_ptr() for t in plan.no_outputs))
        plan.merge.bound(*partials, o.data_ptr(), lse.data_ptr())
        return o, lse
    if plan.fused:
        return _run_unbound(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                            backend)
    from .combine import combine

    o_part, lse_part, counts = decode(q, k_cache, v_cache, page_table, seq_lens,
                                      num_splits=num_splits, block_table=block_table,
                                      scale=scale, sinks=sinks, target=target, backend=backend,
                                      config=config, validate=False)  # checked above
    slots = o_part.shape[0]
    return combine(o_part, lse_part, counts, max_splits=slots, partials=decode_partials(slots),
                   target=target, backend="interpret" if backend == "interpret" else None)


def _run_unbound(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, backend):
    """The launch (or interpretation) of ``plan`` through the general path: numpy inputs,
    the interpreter, or torch tensors the bound launch cannot take. Returns the partials,
    or ``(o, lse)`` for a fused plan."""
    _check_torch_inputs(q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                        seq_lens=seq_lens, block_table=block_table, sinks=sinks)
    lib = _ArrayLib(q)
    o_part, lse_part, counts = plan.torch_partials() if lib.torch else plan.numpy_partials()
    if plan.fused:
        o, lse = plan.outputs(like=lse_part if lib.torch else None)
        outputs = [o, lse, lib.full(plan.grid_cells, 0, "i64")]
    else:
        outputs = list(plan.no_outputs)
    args = [q, lib.rows(k_cache, plan.cache_rows, plan.cache_cols),
            lib.rows(v_cache, plan.cache_rows, plan.cache_cols), page_table, seq_lens,
            block_table if block_table is not None else plan.no_block_table,
            sinks if sinks is not None else plan.no_sinks,
            o_part, lse_part, counts, *outputs, plan.slots, plan.scale_log2]
    results = (10, 11) if plan.fused else (7, 8, 9)
    if backend == "interpret":
        from kiln.lowering.interpret import interpret_kernel

        numpy_args = [lib.numpy(a) for a in args]
        traced = plan.kernel.trace(*numpy_args, target=plan.chip.name, num_warps=plan.num_warps)
        interpret_kernel(traced, plan.grid, numpy_args, plan.chip)
        return tuple(lib.like(numpy_args[i], args[i]) for i in results)
    # numpy arrays (copied per launch) and non-contiguous torch tensors (strides read per call)
    plan.kernel[plan.grid](*args, target=plan.chip.name, num_warps=plan.num_warps)
    return tuple(args[i] for i in results)


def _bindable(plan, q, *tensors) -> bool:
    """Whether the bound launch may take these torch tensors' raw addresses: each contiguous
    and on the plan's device (the plan's key reads only q's device), q 4-byte aligned."""
    index = plan.device.index
    return q.data_ptr() % Q_ALIGN == 0 and all(
        t is None or (t.is_contiguous() and t.get_device() == index) for t in (q, *tensors))


def _check_torch_inputs(q, **tensors) -> None:
    """torch inputs must share q's device: a kernel given another device's address faults.
    q must be 4-byte aligned: the kernel reads its bf16 pairs as 32-bit words."""
    if not type(q).__module__.startswith("torch"):
        return
    if q.data_ptr() % Q_ALIGN:
        raise kiln.KilnValueError(f"q's address {q.data_ptr():#x} is not {Q_ALIGN}-byte "
                                  "aligned (a view starting at an odd element?)",
                                  fix="pass q.clone(), or a view that starts at an even element")
    for name, t in tensors.items():
        if type(t).__module__.startswith("torch") and t.device != q.device:
            raise kiln.KilnValueError(f"{name} is on {t.device} but q is on {q.device}",
                                      fix=f"move {name} to {q.device}")


def _input_pointers(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks):
    """Device addresses of the seven inputs of the bound launch (the caches' row views share
    their tensors' addresses; absent features read the plan's placeholders)."""
    return (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(),
            seq_lens.data_ptr(),
            (block_table if block_table is not None else plan.no_block_table).data_ptr(),
            (sinks if sinks is not None else plan.no_sinks).data_ptr())


@dataclass(frozen=True)
class _DecodePlan:
    """What a decode call of one shape class needs, worked out once (see :data:`_PLANS`)."""

    kernel: object  # the @kiln.kernel of make_kernel
    chip: object  # kiln.lowering.targets.Target
    grid: tuple[int, int, int]
    num_warps: int
    slots: int
    partial_shape: tuple[int, int, int, int, int]  # O_partial; LSE_partial drops D
    cache_rows: int
    cache_cols: int
    scale_log2: float
    no_block_table: object  # placeholders read by no kernel that lacks the feature
    no_sinks: object
    no_outputs: tuple  # (o_out, lse_out, tickets) of a kernel that does not combine
    fused: bool = False  # decode_attention's kernel: the last split CTA combines
    device: object = None  # torch device of q, or None for numpy
    # kiln.lowering.launch.bind_launch of the first contiguous torch call: a repeat call only
    # writes ten addresses into a prepared argument block.
    bound: object = None
    merge: object = None  # the combine plan (bound) for these partials, bound with `bound`
    # Fused torch plans: the ticket counters (zeroed once) per stream handle. Each launch adds
    # `slots` to each; calls on one stream are ordered, calls on two use two counter sets.
    tickets: dict = field(default_factory=dict)

    @property
    def grid_cells(self) -> tuple[int, int, int]:
        """Shape of the ticket counters: ``ARRIVED`` and ``PUBLISHED`` per (grid z, grid y)."""
        return self.grid[2], self.grid[1], 2

    def torch_tickets(self, stream: int | None):
        counters = self.tickets.get(stream)
        if counters is None:
            import torch

            counters = self.tickets[stream] = torch.zeros(self.grid_cells, dtype=torch.int64,
                                                          device=self.device)
        return counters

    def outputs(self, like=None):
        """Fresh ``(o, lse)`` of a fused call: bf16 ``[B, Sq, Hq, D]`` and f32 ``[B, Sq, Hq]``.
        ``like``: an f32 torch tensor on the plan's device (the partials), whose ``new_empty``
        skips parsing a device and a dtype, as :meth:`_CombinePlan.new_outputs` does; None:
        numpy arrays, NaN-poisoned so an element the kernel missed shows."""
        shape = self.partial_shape[1:]
        if like is not None:
            import torch

            return like.new_empty(shape, dtype=torch.bfloat16), like.new_empty(shape[:3])
        return (np.full(shape, np.nan, kiln.bf16.numpy), np.full(shape[:3], np.nan, np.float32))

    @property
    def lse_offset(self) -> int:
        """f32 words before LSE_partial in the one partials allocation (after O_partial)."""
        return math.prod(self.partial_shape)

    @property
    def counts_offset(self) -> int:
        """f32 words before split_counts (after LSE_partial, 16-byte aligned)."""
        return -(-(self.lse_offset + math.prod(self.partial_shape[:4])) // 4) * 4

    @property
    def partial_words(self) -> int:
        return self.counts_offset + math.prod(self.partial_shape[1:4])

    def torch_partial_words(self):
        """One uninitialised device allocation for O_partial, LSE_partial and split_counts,
        and their three addresses in it (what the bound launches take); the kernel writes
        every element (each split all its rows, split 0 the counts)."""
        import torch

        words = torch.empty(self.partial_words, dtype=torch.float32, device=self.device)
        base = words.data_ptr()
        return words, (base, base + 4 * self.lse_offset, base + 4 * self.counts_offset)

    def torch_partials(self, words=None):
        """O_partial, LSE_partial (f32) and split_counts (int32): contiguous views of
        ``words`` (default: a fresh :meth:`torch_partial_words` allocation)."""
        import torch

        shape = self.partial_shape
        if words is None:
            words = self.torch_partial_words()[0]
        return (words[:self.lse_offset].view(shape),
                words[self.lse_offset:self.lse_offset + math.prod(shape[:4])].view(shape[:4]),
                words[self.counts_offset:].view(torch.int32).view(shape[1:4]))

    def numpy_partials(self):
        """The partials as numpy arrays filled with NaN / -1, so an element the kernel did
        not write shows in the interpreter tests."""
        shape = self.partial_shape
        return (np.full(shape, np.nan, np.float32), np.full(shape[:4], np.nan, np.float32),
                np.full(shape[1:4], -1, np.int32))


# Plans by (array type, device, shapes, dtypes, options): a repeat call skips re-validation,
# kernel selection and the placeholder and poison allocations.
_PLANS: dict[tuple, _DecodePlan] = {}


def _plan(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale, sinks,
          target, backend, config, fused) -> _DecodePlan:
    """The cached plan of this call's shape class. The key reads each tensor's shape and dtype
    (any change is a new plan: the bound launch assumes them) and q's device."""
    try:
        key = (type(q), getattr(q, "device", None), q.shape, q.dtype, k_cache.shape,
               k_cache.dtype, v_cache.shape, v_cache.dtype, page_table.shape, page_table.dtype,
               seq_lens.shape, seq_lens.dtype,
               None if block_table is None else (block_table.shape, block_table.dtype),
               None if sinks is None else (sinks.shape, sinks.dtype),
               num_splits, scale, target, backend, config, fused)
        plan = _PLANS.get(key)
    except (TypeError, AttributeError):  # unhashable or not an array: validation reports it
        key, plan = None, None
    fresh = plan is None
    if fresh:
        plan = _make_plan(_ArrayLib(q), q, k_cache, v_cache, page_table, seq_lens, num_splits,
                          block_table, scale, sinks, target, backend, config, fused)
    if plan.bound is None and plan.device is not None and backend != "interpret" and \
            plan.kernel is not None and \
            _bindable(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks):
        plan, fresh = _bind(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                            target), True
    if fresh and key is not None:
        _PLANS[key] = plan
    return plan


def _bind(plan: _DecodePlan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
          target) -> _DecodePlan:
    """``plan`` with its decode launch bound to these contiguous torch tensors' layouts, and
    (unless the kernel combines itself) the bound combine plan of its partials."""
    from kiln.lowering.launch import bind_launch

    from .combine import plan_combine

    partials = plan.torch_partials()
    outputs = (*plan.outputs(like=partials[1]), plan.torch_tickets(None)) if plan.fused \
        else plan.no_outputs
    args = [q, k_cache.reshape(plan.cache_rows, plan.cache_cols),
            v_cache.reshape(plan.cache_rows, plan.cache_cols), page_table, seq_lens,
            block_table if block_table is not None else plan.no_block_table,
            sinks if sinks is not None else plan.no_sinks, *partials, *outputs, plan.slots,
            plan.scale_log2]
    ck = plan.kernel.compile(*args, target=plan.chip.name, num_warps=plan.num_warps)
    if plan.fused:
        return replace(plan, bound=bind_launch(ck, plan.grid, args))
    merge = plan_combine(*partials, max_splits=plan.slots, partials=decode_partials(plan.slots),
                         target=target)
    return replace(plan, bound=bind_launch(ck, plan.grid, args),
                   merge=merge if merge.bound is not None else None)


def _make_plan(lib, q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale,
               sinks, target, backend, config, fused) -> _DecodePlan:
    dims = _check_inputs(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                         num_splits, scale)
    B, Sq, Hq, D = (dims[d] for d in ("B", "Sq", "Hq", "D"))
    num_pages, page_size, Hkv = dims["num_pages"], dims["page_size"], dims["Hkv"]
    check_backend(backend)
    if B * Sq * Hq == 0:  # nothing to attend: empty outputs, no kernel
        slots = block_table.shape[3] if block_table is not None else num_splits or 1
        return _DecodePlan(kernel=None, chip=None, grid=(0, 0, 0), num_warps=0, slots=slots,
                           partial_shape=(slots, B, Sq, Hq, D), cache_rows=0, cache_cols=0,
                           scale_log2=0.0, no_block_table=None, no_sinks=None, no_outputs=(),
                           fused=bool(fused), device=lib.device if lib.torch else None)
    group = Hq // Hkv
    q_rows = 1 if block_table is not None else Sq
    chosen = config
    config = config or default_config(q_rows * group, D, page_size,
                                      block_sparse=block_table is not None)
    kv_sub_tile_rows(config.block_n, page_size)  # page size must tile the key block
    row_blocks = config.row_blocks(q_rows * group, D)
    if block_table is not None:
        slots = block_table.shape[3]
        grid = (slots, Hkv * row_blocks, B * Sq)
    else:
        slots = num_splits or default_num_splits(B, Hkv, num_pages * page_size, config.block_n,
                                                 sms=_launch_sms(backend),
                                                 row_blocks=row_blocks)
        grid = (slots, Hkv * row_blocks, B)
        if chosen is None:  # with the split count known only the stages can change
            tiles = _tiles_per_split(page_table.shape[1] * page_size, config.block_n, slots)
            config = default_config(q_rows * group, D, page_size, tiles_per_split=tiles)
    rows = _Shape(D, group, q_rows, page_size, config).combine_rows
    if fused is None:
        fused = slots * rows * D * 4 <= FUSED_COMBINE_MAX_BYTES
    # The interpreter runs one CTA at a time: a CTA waiting for a later one would never return.
    # The slices split D, so their count is a power of two, and at most one slice a split.
    merge_slices = min(MERGE_SLICES, 1 << (int(slots).bit_length() - 1)) \
        if fused and backend != "interpret" and rows >= MERGE_HELPER_MIN_ROWS else 1
    prefetch_tiles = 0 if block_table is not None else early_launch_tiles(
        config, D, page_size, page_table.shape[1] * page_size, int(slots))
    kernel = make_kernel(D, group, q_rows, page_size, block_table is not None,
                         sinks is not None, config, int(slots) if fused else 0, merge_slices,
                         prefetch_tiles)
    return _DecodePlan(kernel=kernel, chip=_target(target), grid=grid,
                       num_warps=config.num_warps, slots=int(slots),
                       partial_shape=(slots, B, Sq, Hq, D), cache_rows=num_pages * page_size,
                       cache_cols=Hkv * D,
                       scale_log2=float((D ** -0.5 if scale is None else scale) * LOG2E),
                       no_block_table=lib.full((1, 1, 1, 1), -1, "i32"),
                       no_sinks=lib.full((1,), 0.0, "f32"),
                       no_outputs=(lib.full((1, 1, 1, 1), 0.0, "bf16"),
                                   lib.full((1, 1, 1), 0.0, "f32"), lib.full((1, 1, 2), 0, "i64")),
                       fused=bool(fused), device=lib.device if lib.torch else None)


def early_launch_tiles(config: DecodeConfig, head_dim: int, page_size: int, max_seq_len: int,
                       num_splits: int) -> int:
    """Tiles of K and V a split of a dense (not block-sparse) decode prefetches into L2 before
    its grid-dependency wait, 0 for none (and then no early launch): ``PREFETCH_BYTES`` worth,
    at most ``SHORT_SPLIT_PREFETCH_TILES`` where a split holds at most ``SHORT_SPLIT_TILES``,
    where the splits of a ``max_seq_len`` sequence (the page table's width) hold
    ``EARLY_LAUNCH_TILES`` tiles each and a tile is one page or less.
    Example: ``early_launch_tiles(DecodeConfig(), 128, 64, 65536, 16) == 6`` (64 tiles a
    split), ``... 16384, 16) == 3`` (16), ``... 4096, 16) == 0`` (4)."""
    tiles_per_split = _tiles_per_split(max_seq_len, config.block_n, num_splits)
    if page_size < config.block_n or tiles_per_split not in EARLY_LAUNCH_TILES:
        return 0
    tiles = PREFETCH_BYTES // config.tile_bytes(head_dim)
    if tiles_per_split <= SHORT_SPLIT_TILES:
        tiles = min(tiles, SHORT_SPLIT_PREFETCH_TILES)
    return max(1, min(tiles, tiles_per_split))


def _tiles_per_split(max_seq_len: int, block_n: int, num_splits: int) -> int:
    """Tiles of ``block_n`` keys of the longest split of a ``max_seq_len``-key sequence."""
    tiles = -(-max_seq_len // block_n)
    return -(-tiles // num_splits)


def _launch_sms(backend) -> int:
    """The SMs whose one wave of CTAs the default split count fills: those of the GPU the call
    launches on (device 0, as every Kiln launch), or ``DEFAULT_SMS`` when interpreted. With
    132 assumed, a GPU of 114 SMs (H100 PCIe) would run a second wave of 14 CTAs, doubling the
    time."""
    if backend == "interpret":
        return DEFAULT_SMS
    from kiln.lowering.cuda import driver

    return driver().multiprocessor_count()


def compile_decode(dtype="bf16", *, target, head_dim=128, group=8, sq=1, page_size=64,
                   block_sparse=False, sinks=False, config=None, fused_slots=0,
                   merge_slices=1, prefetch_tiles=0):
    """Compile (without running) the decode kernel of one shape class (``config`` None: the
    :func:`default_config` :func:`decode` would use; ``fused_slots``: the kernel of
    :func:`decode_attention` that merges that many splits itself, shared by
    ``merge_slices`` CTAs; ``prefetch_tiles``: early launch, see
    :func:`early_launch_tiles`); returns the
    ``CompiledKernel`` (``.asm`` stages, ``.metadata``).
    Example: ``compile_decode(target="sm_90a", page_size=16, sq=4).metadata["registers"]``."""
    if kiln.dtype(dtype) is not kiln.bf16:
        raise kiln.UnsupportedError(f"paged decode reads bf16 caches, not {kiln.dtype(dtype)}",
                                    fix="use dtype='bf16'")
    if merge_slices not in (1, 2, 4, 8) or merge_slices > max(fused_slots, 1):
        raise kiln.KilnValueError(f"merge_slices={merge_slices} must be 1, 2, 4 or 8 and at "
                                  f"most fused_slots={fused_slots}",
                                  fix="pass merge_slices=1, or fused_slots >= merge_slices")
    chip = _target(target)
    q_rows = 1 if block_sparse else sq
    config = config or default_config(q_rows * group, head_dim, page_size,
                                      block_sparse=block_sparse)
    rows = 2 * max(page_size, 1)  # placeholder arrays carry dtype and rank only
    bf16, hkv = kiln.bf16.numpy, 1
    hq = hkv * group
    args = [np.zeros((1, sq, hq, head_dim), bf16), np.zeros((rows, hkv * head_dim), bf16),
            np.zeros((rows, hkv * head_dim), bf16), np.zeros((1, 2), np.int32),
            np.zeros(1, np.int32), np.zeros((1, sq, hkv, 1), np.int32), np.zeros(1, np.float32),
            np.zeros((1, 1, sq, hq, head_dim), np.float32), np.zeros((1, 1, sq, hq), np.float32),
            np.zeros((1, sq, hq), np.int32), np.zeros((1, sq, hq, head_dim), bf16),
            np.zeros((1, sq, hq), np.float32), np.zeros((1, 1, 2), np.int64), 1, 0.1]
    kernel = make_kernel(head_dim, group, q_rows, page_size, block_sparse, sinks, config,
                         fused_slots, merge_slices, prefetch_tiles)
    return kernel.compile(*args, target=chip.name, num_warps=config.num_warps)


def _check_inputs(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                  scale) -> Dims:
    """Kinds, ranks, dtypes and agreeing sizes of a call's arguments (checked once per shape
    class: the plan caches the result); values are checked per call (:func:`_check_values`)."""
    dims = Dims()
    dims.tensor("q", q, "B Sq Hq D", dtype=kiln.bf16)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        dims.tensor(name, cache, "num_pages page_size Hkv D", dtype=kiln.bf16)
    dims.tensor("page_table", page_table, "B max_pages", dtype=kiln.i32)
    dims.tensor("seq_lens", seq_lens, "B", dtype=kiln.i32)
    if block_table is not None:
        dims.tensor("block_table", block_table, "B Sq Hkv top_k", dtype=kiln.i32)
        check_positive("block_table's top_k", dims["top_k"], integer=True,
                       fix="give every row at least one slot (-1 selects nothing)")
    if sinks is not None:
        dims.tensor("sinks", sinks, "Hq", dtype=kiln.f32)
    check_heads(dims["Hq"], dims["Hkv"], q_name="q", kv_name="k_cache",
                error=kiln.UnsupportedError)
    if dims["D"] not in SUPPORTED_HEAD_DIMS:
        raise kiln.UnsupportedError(f"head dim {dims['D']} is not supported",
                                    fix=f"use one of {SUPPORTED_HEAD_DIMS}")
    if dims["Sq"] > 16:
        raise kiln.UnsupportedError(f"q has Sq={dims['Sq']} tokens; decode takes 0..16",
                                    fix="use prefill for long Sq")
    for dim in ("num_pages", "page_size"):
        check_positive(f"k_cache's {dim}", dims[dim], integer=True,
                       fix="a paged cache needs at least one page of at least one row")
    if num_splits is not None:
        check_positive("num_splits", num_splits, integer=True,
                       fix="leave num_splits=None for the default")
    if scale is not None:  # the kernel takes row maxima of unscaled scores
        check_positive("scale", scale, fix="pass a positive softmax scale, or None for 1/sqrt(D)")
    return dims


def _check_values(k_cache, page_table, seq_lens, block_table, validate) -> None:
    """Page ids and lengths against the cache (see
    :func:`kiln.kernels.inputs.check_paged_lengths`), block-sparse indices at least -1 (numpy
    only: a larger index selects a block past the sequence, which the kernel skips)."""
    check_paged_lengths(page_table, seq_lens, num_pages=int(k_cache.shape[0]),
                        page_size=int(k_cache.shape[1]), validate=validate)
    if block_table is not None and not is_torch(block_table) and \
            np.asarray(block_table).size and int(np.asarray(block_table).min()) < -1:
        raise kiln.KilnValueError("block_table holds an entry below -1",
                                  fix="list selected block indices, padded with -1 at the end")


def _target(target):
    chip = resolve_target(target)
    if not chip.has_tma:
        raise kiln.UnsupportedError(f"paged decode loads pages with TMA, which {chip.name} "
                                    "lacks", fix="use target='sm_90a'")
    return chip


class _ArrayLib:
    """Allocation and views in the caller's array library (numpy, or torch on q's device)."""

    def __init__(self, like):
        self.torch = type(like).__module__.startswith("torch")
        self.device = getattr(like, "device", None)

    def full(self, shape, value, dtype):
        if self.torch:
            import torch

            torch_dtype = {"f32": torch.float32, "i32": torch.int32, "i64": torch.int64,
                           "bf16": torch.bfloat16}[dtype]
            return torch.full(shape, value, dtype=torch_dtype, device=self.device)
        return np.full(shape, value, kiln.dtype(dtype).numpy)

    def rows(self, cache, rows, cols):
        return cache.reshape(rows, cols)

    @staticmethod
    def numpy(x):
        if type(x).__module__.startswith("torch"):
            import torch

            if x.dtype == torch.bfloat16:
                return x.cpu().view(torch.int16).numpy().view(kiln.bf16.numpy)
            return x.cpu().numpy()
        return x

    def like(self, array, template):
        if type(template).__module__.startswith("torch"):
            import torch

            template.copy_(torch.from_numpy(array))
            return template
        return array
