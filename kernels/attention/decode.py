"""Split-KV paged decode attention (Hopper): TMA page loads, GQA-packed rows, split partials.

``decode(q, k_cache, v_cache, page_table, seq_lens)`` attends ``q[B, Sq, Hq, D]`` (``Sq`` 1–16
draft tokens, causal within the cache: query ``i`` sees keys ``0 .. L - Sq + i``) to a paged
bf16 cache ``[num_pages, page_size, Hkv, D]`` and returns per-split partials for
:func:`kiln.kernels.attention.combine`:

``O_partial[split, b, i, h, :]`` (f32, normalised within the split), ``LSE_partial[split, b, i,
h]`` (natural log, ``-inf`` for a split that saw no key) and ``split_counts[b, i, h]`` (the
splits holding keys for that row; slots past it are ignored by ``combine``).

Schedule: grid ``(num_splits, Hkv, B)`` (block-sparse: ``(top_k, Hkv, B * Sq)``); one CTA of
4 warps serves the whole GQA group of one KV head, ``Sq * (Hq / Hkv)`` packed query rows.

| phase | who | what |
| --- | --- | --- |
| page look-up | all threads | ``PagedRowIndices.populate``: one physical row per page of the BN-key tile (pages past the sequence map out of bounds) |
| load | elected lane of warp 0 | one TMA per page for K and V of tile ``t + 1`` into the other stage (2-stage ring, one mbarrier per stage expecting the full tile: out-of-bounds pages arrive as zeros) |
| scores | warp ``w`` owns rows ``w, w + 4, ..``; lane ``l`` owns ``D / 32`` depth columns | per key: partial dot product, butterfly sum over the warp, causal mask |
| softmax | same | streaming update in the base-2 domain (``scale * log2 e`` folded into q), ``o = o * 2^(m - m') + p * v`` |
| release | all | block barrier before the stage is refilled |
| epilogue | lanes | ``O / l``, ``LSE = (m + log2 l) * ln 2``; split 0 writes ``split_counts`` |

Keys past the sequence end are never read (the key loop stops at the tile's last valid key),
so stale rows of a partially filled page cannot reach the sums. Attention sinks
(``sinks[Hq]``, natural-log logits that only enlarge the denominator) seed split 0's state.

Block-sparse selection (``block_table[B, Sq, Hkv, top_k]`` of BN-key block indices, ``-1``
padded at the end): slot ``j`` of row ``(b, i, kv head)`` is the partial over block
``block_table[b, i, h_kv, j]``; ``split_counts`` is the number of non-negative entries, so a
row that selects nothing has ``C = 0`` (combine returns ``O = 0``, ``LSE = -inf``).

The scores and ``P·V`` run on CUDA cores: correct for every page size and GQA packing, but
not yet the tensor-core (mma.sync / WGMMA) consumer the bandwidth goal needs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

import kiln
from kiln import mbarrier, nvidia_asm

from .paged import PagedRowIndices, PageTableRow, kv_sub_tile_rows

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
WARP = 32
DEFAULT_SMS = 132  # H100 SXM: split count heuristic when no device is queried


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` keys per tile (also the block size of ``block_table``), ``num_warps`` per
    CTA, ``stages`` of the K/V ring."""

    block_n: int = 64
    num_warps: int = 4
    stages: int = 2

    def __post_init__(self):
        if self.block_n not in (64, 128):
            raise kiln.UnsupportedError(f"block_n={self.block_n} is not supported",
                                        fix="use 64 or 128")
        if self.stages != 2:
            raise kiln.UnsupportedError("the decode ring has exactly 2 stages",
                                        fix="use stages=2")


SUPPORTED_HEAD_DIMS = (64, 128, 256)


@functools.lru_cache(maxsize=None)
def make_kernel(head_dim: int, group: int, q_rows: int, page_size: int, block_sparse: bool,
                has_sinks: bool, config: DecodeConfig = DecodeConfig()):
    """The ``@kiln.kernel`` for one shape class: ``q_rows`` query tokens per CTA (``Sq``, or 1
    when block-sparse) times ``group`` query heads per KV head."""
    BN, NW = config.block_n, config.num_warps
    Rows = PagedRowIndices[BN, page_size]
    eff, pages = Rows.eff_page, Rows.num_pages
    D, E = head_dim, head_dim // WARP
    packed = q_rows * group
    rows_per_warp = -(-packed // NW)
    tile_bytes = 2 * BN * D * 2  # K and V boxes of the whole tile, out-of-bounds pages included

    def paged_decode(q: kiln.Tensor[kiln.bf16, 4],
                     k_map: kiln.TensorMap[kiln.bf16, (eff, D), 0],
                     v_map: kiln.TensorMap[kiln.bf16, (eff, D), 0],
                     page_table: kiln.Tensor[kiln.i32, 2], seq_lens: kiln.Tensor[kiln.i32, 1],
                     block_table: kiln.Tensor[kiln.i32, 4], sinks: kiln.Tensor[kiln.f32, 1],
                     o_part: kiln.Tensor[kiln.f32, 5], lse_part: kiln.Tensor[kiln.f32, 4],
                     counts: kiln.Tensor[kiln.i32, 3], num_splits: kiln.i32,
                     scale_log2: kiln.f32):
        k_smem = kiln.shared.dynamic_shared((2 * pages, eff, D), kiln.bf16, align=128) \
            if False else _dynamic((2 * pages, eff, D))
        v_smem = _dynamic((2 * pages, eff, D))
        full = mbarrier.group(num_barriers=2)
        tid = kiln.thread_id(0)
        warp = tid // WARP
        lane = tid % WARP
        leader = tid == 0
        full.init(0, count=1, predicate=leader)
        full.init(1, count=1, predicate=leader)
        nvidia_asm.fence_mbarrier_init()
        kiln.barrier()

        split = kiln.block_id(0)
        kv_head = kiln.block_id(1)
        seq_q = q.shape[1]
        if block_sparse:
            b = kiln.block_id(2) // seq_q
            q_first = kiln.block_id(2) % seq_q
        else:
            b = kiln.block_id(2)
            q_first = 0
        seq_len = seq_lens[b]
        tiles = (seq_len + BN - 1) // BN
        tiles_per_split = kiln.maximum((tiles + num_splits - 1) // num_splits, 1)
        if block_sparse:
            block = block_table[b, q_first, kv_head, split]
            tile_begin = kiln.maximum(block, 0)
            tile_end = kiln.where(block >= 0, kiln.minimum(block + 1, tiles), 0)
        else:
            tile_begin = split * tiles_per_split
            tile_end = kiln.minimum(tile_begin + tiles_per_split, tiles)
        num_tiles = kiln.maximum(tile_end - tile_begin, 0)

        # Packed row r = query token r // group, head kv_head * group + r % group.
        rows = [kiln.minimum(warp + NW * i, packed - 1) for i in range(rows_per_warp)]
        live = [warp + NW * i < packed for i in range(rows_per_warp)]
        q_index = [q_first + r // group for r in rows]
        heads = [kv_head * group + r % group for r in rows]
        key_limit = [seq_len - seq_q + qi for qi in q_index]  # last key each row may see
        q_vals = [[kiln.cast(q[b, q_index[i], heads[i], lane * E + e], kiln.f32) * scale_log2
                   for e in range(E)] for i in range(rows_per_warp)]
        if has_sinks:
            first = split == 0
            m = [kiln.where(first, sinks[h] * LOG2E, -math.inf) for h in heads]
            l = [kiln.where(first, 1.0, 0.0) for _ in heads]
        else:
            m = [kiln.cast(-math.inf, kiln.f32) for _ in heads]
            l = [kiln.cast(0.0, kiln.f32) for _ in heads]
        o = [[kiln.cast(0.0, kiln.f32) for _ in range(E)] for _ in heads]

        elect = nvidia_asm.elect_sync() & (warp == 0)
        if num_tiles > 0:
            _load_tile(Rows, page_table, b, tile_begin, seq_len, k_map, v_map, k_smem, v_smem,
                       full, 0, kv_head * D, elect, leader, tile_bytes)
        for it in kiln.range(0, num_tiles):
            stage = it % 2
            if it + 1 < num_tiles:
                _load_tile(Rows, page_table, b, tile_begin + it + 1, seq_len, k_map, v_map,
                           k_smem, v_smem, full, 1 - stage, kv_head * D, elect, leader,
                           tile_bytes)
            full.try_wait(stage, (it // 2) % 2)
            key0 = (tile_begin + it) * BN
            for j in kiln.range(0, kiln.minimum(BN, seq_len - key0)):
                slot = stage * pages + j // eff
                k_vals = [kiln.cast(k_smem[slot, j % eff, lane * E + e], kiln.f32)
                          for e in range(E)]
                v_vals = [kiln.cast(v_smem[slot, j % eff, lane * E + e], kiln.f32)
                          for e in range(E)]
                m, l, o = _attend_key(q_vals, k_vals, v_vals, m, l, o, key0 + j, key_limit)
            kiln.barrier()  # every warp is done with this stage before it is refilled

        for i in range(rows_per_warp):
            if live[i]:
                has_mass = l[i] > 0.0
                inv = kiln.where(has_mass, 1.0 / l[i], 0.0)
                for e in range(E):
                    o_part[split, b, q_index[i], heads[i], lane * E + e] = o[i][e] * inv
                if lane == 0:
                    lse_part[split, b, q_index[i], heads[i]] = kiln.where(
                        has_mass, (m[i] + kiln.log2(kiln.maximum(l[i], 1e-30))) * LN2,
                        -math.inf)
                    if split == 0:
                        counts[b, q_index[i], heads[i]] = _split_count(
                            block_table, b, q_index[i], kv_head, key_limit[i] + 1,
                            tiles_per_split, BN, block_sparse)

    paged_decode.__name__ = paged_decode.__qualname__ = (
        f"paged_decode_d{D}_g{group}_q{q_rows}_p{page_size}{'_sparse' if block_sparse else ''}"
        f"{'_sinks' if has_sinks else ''}")
    return kiln.kernel(paged_decode)
