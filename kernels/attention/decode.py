"""Split-KV paged decode attention (Hopper): TMA page loads, GQA-packed rows, split partials.

``decode(q, k_cache, v_cache, page_table, seq_lens)`` attends ``q[B, Sq, Hq, D]`` (``Sq`` 1–16
draft tokens, causal within the cache: query ``i`` sees keys ``0 .. L - Sq + i``) to a paged
bf16 cache ``[num_pages, page_size, Hkv, D]`` and returns per-split partials for
:func:`kiln.kernels.attention.combine`:

``O_partial[split, b, i, h, :]`` (f32, normalised within the split), ``LSE_partial[split, b, i,
h]`` (natural log, ``-inf`` for a split that saw no key) and ``split_counts[b, i, h]`` (the
splits holding keys for that row; slots past it are ignored by ``combine``).

Schedule: grid ``(num_splits, Hkv, B)`` (block-sparse: ``(top_k, Hkv, B * Sq)``); one CTA of
4 to 16 warps (``DecodeConfig.rows_per_warp`` rows each) serves the whole GQA group of one KV
head: ``Sq * (Hq / Hkv)`` packed query rows, so every K/V page is read once per CTA.

| phase | who | what |
| --- | --- | --- |
| page look-up | all threads | ``PagedRowIndices.populate``: one physical row per page of the BN-key tile (pages past the sequence map out of bounds) |
| load | elected lane of warp 0 | one TMA per page for K and V of tile ``t + 1`` into the other stage (2-stage ring, one mbarrier per stage expecting the full tile: out-of-bounds pages arrive as zeros) |
| scores | warp ``w`` owns rows ``w, w + num_warps, ..``; lane ``l`` owns ``D / 32`` depth columns | per key: partial dot product, butterfly sum over the warp, causal mask |
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
from kiln.shared import dynamic_shared  # kiln.dynamic_shared once exported

from .paged import PagedRowIndices, PageTableRow, kv_sub_tile_rows
from .partials import Partials

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
WARP = 32
DEFAULT_SMS = 132  # H100 SXM: split count heuristic when no device is queried
MAX_DEFAULT_SPLITS = 64
PRODUCER = "kiln.kernels.attention.decode"


@functools.lru_cache(maxsize=None)
def decode_partials(num_slots: int) -> Partials:
    """The :class:`Partials` contract of a :func:`decode` call with ``num_slots`` partial slots:
    split-major f32 O, natural-log LSE, natural depth order, empty split = (-inf, zeros).
    Example: ``combine(o, lse, counts, partials=decode_partials(o.shape[0]))``."""
    return Partials(producer=PRODUCER, max_splits=num_slots)


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` keys per tile (also the block size of ``block_table``), ``rows_per_warp``
    packed query rows each warp keeps in registers (the CTA has ``ceil(rows / rows_per_warp)``
    warps, 4 to 16). The K/V ring has two stages: tile ``t + 1`` loads while ``t`` is used."""

    block_n: int = 64
    rows_per_warp: int = 8

    def num_warps(self, packed_rows: int) -> int:
        """Warps of a CTA serving ``packed_rows`` rows. Example: ``num_warps(128) == 16``."""
        return min(16, max(4, -(-packed_rows // self.rows_per_warp)))

    def __post_init__(self):
        if not isinstance(self.rows_per_warp, int) or self.rows_per_warp < 1:
            raise kiln.KilnValueError(f"rows_per_warp={self.rows_per_warp!r} must be >= 1",
                                      fix="use 8 (registers for 8 rows of q and o per lane)")
        if self.block_n not in (64, 128):
            raise kiln.UnsupportedError(f"block_n={self.block_n} is not supported",
                                        fix="use 64 or 128")


SUPPORTED_HEAD_DIMS = (64, 128, 256)


@functools.lru_cache(maxsize=None)
def make_kernel(head_dim: int, group: int, q_rows: int, page_size: int, block_sparse: bool,
                has_sinks: bool, config: DecodeConfig = DecodeConfig()):
    """The ``@kiln.kernel`` for one shape class: ``q_rows`` query tokens per CTA (``Sq``, or 1
    when block-sparse) times ``group`` query heads per KV head."""
    BN = config.block_n
    rows_params = (BN, page_size)
    Rows = PagedRowIndices[rows_params]
    eff, pages = Rows.eff_page, Rows.num_pages
    D, E = head_dim, head_dim // WARP
    packed = q_rows * group
    NW = config.num_warps(packed)
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
        k_smem = dynamic_shared((2 * pages, eff, D), kiln.bf16, align=128)  # 2 stages of pages
        v_smem = dynamic_shared((2 * pages, eff, D), kiln.bf16, align=128)
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
            _load_tile(rows_params, page_table, b, tile_begin, seq_len, k_map, v_map, k_smem,
                       v_smem, full, 0, kv_head * D, elect, leader, tile_bytes)
        for it in kiln.range(0, num_tiles):
            stage = it % 2
            if it + 1 < num_tiles:
                _load_tile(rows_params, page_table, b, tile_begin + it + 1, seq_len, k_map,
                           v_map, k_smem, v_smem, full, 1 - stage, kv_head * D, elect, leader,
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


@kiln.func
def _load_tile(rows_params, page_table, b, tile, seq_len, k_map, v_map, k_smem, v_smem, full,
               stage, column, elect, leader, tile_bytes):
    """Look up tile ``tile``'s pages and TMA them into ``stage`` (K and V share the rows).
    ``rows_params`` is ``(BN, page_size)``: a struct class cannot be captured by a traced if."""
    Rows = PagedRowIndices[rows_params]
    rows = Rows.populate(PageTableRow(page_table, b), tile * Rows.BN, seq_len)
    full.arrive_expect_tx(stage, tile_bytes, predicate=leader)
    first_slot = stage * Rows.num_pages
    rows.tma_copy_k(k_map, k_smem, full, stage, column=column, elect=elect,
                    needs_partial=False, first_slot=first_slot)
    rows.tma_copy_v(v_map, v_smem, full, stage, column=column, elect=elect,
                    needs_partial=False, first_slot=first_slot)


@kiln.func
def _attend_key(q_vals, k_vals, v_vals, m, l, o, key, key_limit):
    """One key for every row of this warp: score (base 2, pre-scaled q), causal mask, streaming
    softmax update. Returns the new ``(m, l, o)``."""
    new_m, new_l, new_o = [], [], []
    for i in range(len(q_vals)):
        partial = q_vals[i][0] * k_vals[0]
        for e in range(1, len(k_vals)):
            partial = kiln.fma(q_vals[i][e], k_vals[e], partial)
        score = kiln.shuffle.butterfly_reduce(partial, (1, 2, 4, 8, 16), _add)
        score = kiln.where(key <= key_limit[i], score, -math.inf)
        m_next = kiln.maximum(m[i], score)
        # A row with no key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_safe = kiln.where(m_next == -math.inf, 0.0, m_next)
        alpha = kiln.exp2(m[i] - m_safe)
        p = kiln.exp2(score - m_safe)
        new_m.append(m_next)
        new_l.append(kiln.fma(l[i], alpha, p))
        new_o.append([kiln.fma(o[i][e], alpha, p * v_vals[e]) for e in range(len(v_vals))])
    return new_m, new_l, new_o


def _add(a, b):
    return a + b


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
                       sms: int = DEFAULT_SMS) -> int:
    """Splits that give about two CTAs per SM without splitting below one tile each.
    Example: ``default_num_splits(1, 8, 65536) == 33``."""
    tiles = max(1, -(-max_seq_len // block_n))
    return max(1, min(tiles, -(-2 * sms // (batch * kv_heads)), MAX_DEFAULT_SPLITS))


def decode(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None, block_table=None,
           scale=None, sinks=None, target=None, backend=None, config=DecodeConfig()):
    """Split-KV paged decode attention; returns ``(o_partial, lse_partial, split_counts)``
    (see the module docs) for :func:`kiln.kernels.attention.combine`.

    ``q``: ``[B, Sq, Hq, D]`` bf16; ``k_cache``/``v_cache``: ``[num_pages, page_size, Hkv, D]``
    bf16; ``page_table``: ``[B, max_pages]`` int32; ``seq_lens``: ``[B]`` int32 (including the
    ``Sq`` new tokens); ``block_table``: optional ``[B, Sq, Hkv, top_k]`` int32 block indices;
    ``sinks``: optional ``[Hq]`` f32; ``scale`` defaults to ``D ** -0.5``.
    numpy inputs give numpy outputs; torch CUDA tensors stay on the device.
    Example::

        o_part, lse_part, counts = decode(q, k_cache, v_cache, page_table, seq_lens)
        o, lse = kiln.kernels.attention.combine(o_part, lse_part, counts)
    """
    lib = _ArrayLib(q)
    try:
        key = (type(q), lib.device, *(_shape_dtype(x) for x in (q, k_cache, v_cache, page_table,
                                                               seq_lens, block_table, sinks)),
               num_splits, scale, target, backend, config)
        plan = _PLANS.get(key)
    except (TypeError, AttributeError):  # unhashable or not an array: validation reports it
        key, plan = None, None
    if plan is None:
        plan = _make_plan(lib, q, k_cache, v_cache, page_table, seq_lens, num_splits,
                          block_table, scale, sinks, target, backend, config)
        if key is not None:
            _PLANS[key] = plan
    o_part, lse_part, counts = plan.outputs(lib)
    args = [q, lib.rows(k_cache, plan.cache_rows, plan.cache_cols),
            lib.rows(v_cache, plan.cache_rows, plan.cache_cols), page_table, seq_lens,
            block_table if block_table is not None else plan.no_block_table,
            sinks if sinks is not None else plan.no_sinks,
            o_part, lse_part, counts, plan.slots, plan.scale_log2]
    if backend == "interpret":
        from kiln.lowering.interpret import interpret_kernel

        numpy_args = [lib.numpy(a) for a in args]
        traced = plan.kernel.trace(*numpy_args, target=plan.chip.name, num_warps=plan.num_warps)
        interpret_kernel(traced, plan.grid, numpy_args, plan.chip)
        return tuple(lib.like(numpy_args[i], args[i]) for i in (7, 8, 9))
    plan.kernel[plan.grid](*args, target=plan.chip.name, num_warps=plan.num_warps)
    return o_part, lse_part, counts


def _shape_dtype(x):
    return None if x is None else (x.shape, x.dtype)


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

    def outputs(self, lib: "_ArrayLib"):
        """O_partial, LSE_partial, split_counts. Every element is written by the kernel (each
        split writes all rows, split 0 the counts); numpy outputs start as NaN / -1 so an
        unwritten one shows in the interpreter tests, device ones skip the fill kernels."""
        shape = self.partial_shape
        return (lib.output(shape, np.nan, "f32"), lib.output(shape[:4], np.nan, "f32"),
                lib.output(shape[1:4], -1, "i32"))


# Plans by (array type, device, shapes, dtypes, options): a repeat call skips re-validation,
# kernel selection and the placeholder and poison allocations.
_PLANS: dict[tuple, _DecodePlan] = {}


def _make_plan(lib, q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale,
               sinks, target, backend, config) -> _DecodePlan:
    B, Sq, Hq, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    _check_inputs(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, config)
    group = Hq // Hkv
    if block_table is not None:
        slots = block_table.shape[3]
        grid = (slots, Hkv, B * Sq)
        q_rows = 1
    else:
        slots = num_splits or default_num_splits(B, Hkv, num_pages * page_size, config.block_n)
        if not isinstance(slots, int) or slots < 1:
            raise kiln.KilnValueError(f"num_splits={num_splits!r} must be a positive int",
                                      fix="leave num_splits=None for the default")
        grid = (slots, Hkv, B)
        q_rows = Sq
    if backend not in (None, "gpu", "interpret"):
        raise kiln.KilnValueError(f"backend={backend!r} is not one of None, 'gpu', 'interpret'",
                                  fix="leave backend=None to run on the GPU")
    kernel = make_kernel(D, group, q_rows, page_size, block_table is not None,
                         sinks is not None, config)
    return _DecodePlan(kernel=kernel, chip=_target(target), grid=grid,
                       num_warps=config.num_warps(q_rows * group), slots=int(slots),
                       partial_shape=(slots, B, Sq, Hq, D), cache_rows=num_pages * page_size,
                       cache_cols=Hkv * D,
                       scale_log2=float((D ** -0.5 if scale is None else scale) * LOG2E),
                       no_block_table=lib.full((1, 1, 1, 1), -1, "i32"),
                       no_sinks=lib.full((1,), 0.0, "f32"))


def compile_decode(dtype="bf16", *, target, head_dim=128, group=8, sq=1, page_size=64,
                   block_sparse=False, sinks=False, config=DecodeConfig()):
    """Compile (without running) the decode kernel of one shape class; returns the
    ``CompiledKernel`` (``.asm`` stages, ``.metadata``).
    Example: ``compile_decode(target="sm_90a", page_size=16, sq=4).metadata["registers"]``."""
    if kiln.dtype(dtype) is not kiln.bf16:
        raise kiln.UnsupportedError(f"paged decode reads bf16 caches, not {kiln.dtype(dtype)}",
                                    fix="use dtype='bf16'")
    chip = _target(target)
    q_rows = 1 if block_sparse else sq
    rows = 2 * max(page_size, 1)  # placeholder arrays carry dtype and rank only
    bf16, hkv = kiln.bf16.numpy, 1
    hq = hkv * group
    args = [np.zeros((1, sq, hq, head_dim), bf16), np.zeros((rows, hkv * head_dim), bf16),
            np.zeros((rows, hkv * head_dim), bf16), np.zeros((1, 2), np.int32),
            np.zeros(1, np.int32), np.zeros((1, sq, hkv, 1), np.int32), np.zeros(1, np.float32),
            np.zeros((1, 1, sq, hq, head_dim), np.float32), np.zeros((1, 1, sq, hq), np.float32),
            np.zeros((1, sq, hq), np.int32), 1, 0.1]
    kernel = make_kernel(head_dim, group, q_rows, page_size, block_sparse, sinks, config)
    return kernel.compile(*args, target=chip.name, num_warps=config.num_warps(q_rows * group))


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, **options):
    """:func:`decode` followed by :func:`kiln.kernels.attention.combine`: the attention output
    ``[B, Sq, Hq, D]`` (bf16) and its natural-log LSE. Same keywords as :func:`decode`."""
    from .combine import combine

    o_part, lse_part, counts = decode(q, k_cache, v_cache, page_table, seq_lens, **options)
    slots = o_part.shape[0]
    return combine(o_part, lse_part, counts, max_splits=slots, partials=decode_partials(slots),
                   target=options.get("target"), backend=options.get("backend"))


def _check_inputs(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, config):
    if len(q.shape) != 4 or len(k_cache.shape) != 4:
        raise kiln.KilnValueError(f"q must be [B, Sq, Hq, D] and the caches [num_pages, "
                                  f"page_size, Hkv, D]; got {tuple(q.shape)} and "
                                  f"{tuple(k_cache.shape)}", fix="reshape the inputs")
    B, Sq, Hq, D = q.shape
    _, page_size, Hkv, Dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or Dk != D:
        raise kiln.KilnValueError(f"k_cache {tuple(k_cache.shape)}, v_cache "
                                  f"{tuple(v_cache.shape)} and q's head dim {D} disagree",
                                  fix="use caches of one shape with q's head dim")
    if D not in SUPPORTED_HEAD_DIMS:
        raise kiln.UnsupportedError(f"head dim {D} is not supported",
                                    fix=f"use one of {SUPPORTED_HEAD_DIMS}")
    if Hq % Hkv or not 1 <= Sq <= 16:
        raise kiln.UnsupportedError(f"Hq={Hq}, Hkv={Hkv}, Sq={Sq}: decode needs Hq a multiple "
                                    "of Hkv and 1..16 query tokens",
                                    fix="pack heads so Hq % Hkv == 0; use prefill for long Sq")
    kv_sub_tile_rows(config.block_n, page_size)  # page size must tile the key block
    names = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in names.items():
        if kiln.dtype(x.dtype) is not kiln.bf16:
            raise kiln.KilnTypeError(f"{name} must be bf16, got {kiln.dtype(x.dtype)}",
                                     fix=f"convert {name} to bfloat16")
    if tuple(seq_lens.shape) != (B,) or page_table.shape[0] != B:
        raise kiln.KilnValueError(f"seq_lens {tuple(seq_lens.shape)} / page_table "
                                  f"{tuple(page_table.shape)} must have {B} rows",
                                  fix="one sequence length and one page-table row per batch")
    if block_table is not None and tuple(block_table.shape[:3]) != (B, Sq, Hkv):
        raise kiln.KilnValueError(f"block_table {tuple(block_table.shape)} must be "
                                  f"[{B}, {Sq}, {Hkv}, top_k]",
                                  fix="select blocks per (batch, query token, kv head)")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise kiln.KilnValueError(f"sinks {tuple(sinks.shape)} must be [{Hq}]",
                                  fix="one f32 sink logit per query head")


def _target(target):
    from kiln.kernel import default_target
    from kiln.lowering.targets import get_target

    chip = get_target(target or default_target())
    if not chip.has_tma:
        raise kiln.UnsupportedError(f"paged decode loads pages with TMA, which {chip.name} "
                                    "lacks", fix="use target='sm_90a'")
    return chip


class _ArrayLib:
    """Allocation and views in the caller's array library (numpy, or torch on q's device)."""

    def __init__(self, like):
        self.torch = type(like).__module__.startswith("torch")
        self.device = getattr(like, "device", None)

    def output(self, shape, poison, dtype):
        """An output the kernel overwrites entirely: ``poison``-filled on the host (the
        interpreter shows unwritten elements), uninitialised on the device."""
        if self.torch:
            import torch

            torch_dtype = {"f32": torch.float32, "i32": torch.int32}[dtype]
            return torch.empty(shape, dtype=torch_dtype, device=self.device)
        return np.full(shape, poison, kiln.dtype(dtype).numpy)

    def full(self, shape, value, dtype):
        if self.torch:
            import torch

            torch_dtype = {"f32": torch.float32, "i32": torch.int32}[dtype]
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
