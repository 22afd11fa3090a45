"""The Hopper prefill kernel's steps (:mod:`.prefill_hopper`): mask bounds, WGMMA issue of
``S = Q K^T`` and ``O += P V``, the two online-softmax schedules and the output store.

Example::

    lo, hi = _key_bounds(row, seq_q, seq_k, MaskSpec(causal=True))   # inside a kernel
"""

import math
import operator

import kiln
from kiln import nvidia_asm, wgmma

from .prefill_config import CHUNK_COLS, K_STEP, WARP_GROUP_ROWS, WARP_GROUP_THREADS, MaskSpec
from .softcap import soft_cap

SWIZZLE = 128  # bytes: one 64-element row of bf16/f16
SWIZZLE_ALIGN = 1024
ROW_BYTES = 128
DESCRIPTOR_UNIT = 16  # matrix descriptors address shared memory in 16-byte units
LOG2E = 1.4426950408889634
# Finite stand-in for -inf as the initial row max: exp2(-inf - sentinel) is 0 and
# sentinel - sentinel is 0, so rows that see no key stay NaN-free.
MAX_SENTINEL = -1.0e30
LAZY_RESCALE_THRESHOLD = 8.0  # log2 units: P stays below 2**8 between rescales
PINGPONG_BARRIER = 3  # named barriers 3, 4: the consumers' turns
OUTPUT_BARRIER = 5  # named barriers 5, 6: one consumer group staging its output
VOTE_BARRIER = 7  # named barriers 7, 8: one consumer group's rescale vote (exp_before_max)


@kiln.func
def _remapped_head(block_x, group, num_kv_heads):
    """Query head of grid column ``block_x``: neighbours in x alternate KV heads."""
    return (block_x % group) * num_kv_heads + block_x // group


def _key_bounds(row, seq_q, seq_k, mask: MaskSpec):
    """``(lo, hi)``: the inclusive key range query ``row`` may read (empty when hi < lo)."""
    pos = row + seq_k - seq_q
    lo = 0
    hi = seq_k - 1
    if mask.causal:
        hi = kiln.minimum(hi, pos)
    if mask.window_left >= 0:
        lo = kiln.maximum(lo, pos - mask.window_left)
    if mask.window_right >= 0:
        hi = kiln.minimum(hi, pos + mask.window_right)
    if mask.chunk:
        chunk_start = pos - (pos % mask.chunk + mask.chunk) % mask.chunk  # floor, pos may be < 0
        lo = kiln.maximum(lo, chunk_start)
        hi = kiln.minimum(hi, chunk_start + mask.chunk - 1)
    return lo, hi


def _fragment_row(i: int) -> int:
    """Which of the thread's two rows register ``i`` of an m64 fragment belongs to."""
    return (i // 2) % 2


def _fragment_col(i: int) -> int:
    """Column of register ``i`` relative to the thread's first column ``2 * (lane % 4)``."""
    return 8 * (i // 4) + i % 2


@kiln.func
def _sequence_span(cu_q, cu_k, batch):
    """``(q_start, k_start, seq_q, seq_k)``: where ``batch``'s queries and keys start in the
    packed rows, and how many there are."""
    q_start = cu_q[batch]
    k_start = cu_k[batch]
    return q_start, k_start, cu_q[batch + 1] - q_start, cu_k[batch + 1] - k_start


def _work_item(item, num_q_tiles, heads, batches, st):
    """``(query head, batch, first row)`` of persistent work item ``item``: query tiles
    fastest without a causal mask (CTAs running together share one head's K/V in L2), with one
    the longest query tiles of every head and batch first, and (``config.zigzag``) every
    second full round of items, one item a CTA, dealt in reverse CTA order, so each CTA's
    share of long and short items evens out."""
    if st.mask.causal:
        if st.config.zigzag:
            ctas = kiln.num_blocks(0)
            rounds = item // ctas
            full = (rounds + 1) * ctas <= num_q_tiles * heads * batches
            item = kiln.where((rounds % 2 == 1) & full, rounds * ctas + ctas - 1 - item % ctas,
                              item)
        per_tile = heads * batches
        q_tile = num_q_tiles - 1 - item // per_tile
        rest = item % per_tile
        head_x = rest % heads
        batch = rest // heads
    else:
        q_tile = item % num_q_tiles
        rest = item // num_q_tiles
        head_x = rest % heads
        batch = rest // heads
    return _remapped_head(head_x, st.group, heads // st.group), batch, q_tile * st.bm


def _tile_range(m0, seq_q, seq_k, st):
    """``(lo_last, hi_first, first_tile, end_tile)``: the last row's first visible key, the
    first row's last one, and the key tiles ``[first_tile, end_tile)`` the query tile visits."""
    last_row = kiln.minimum(m0 + st.bm, seq_q) - 1
    lo_last, _ = _key_bounds(last_row, seq_q, seq_k, st.mask)
    lo_first, hi_first = _key_bounds(m0, seq_q, seq_k, st.mask)
    _, hi_last = _key_bounds(last_row, seq_q, seq_k, st.mask)
    first_tile = lo_first // st.bn
    end_tile = kiln.maximum((hi_last + st.bn) // st.bn, first_tile)
    return lo_last, hi_first, first_tile, end_tile


def _one_tile_at_least(first_tile, end_tile):
    """``(end_tile, empty)``: an overlapped persistent walk visits at least one key tile an
    item (a tile no row sees is masked whole; every item then ends the same way); ``empty``
    says no row of the item sees a key."""
    return kiln.maximum(end_tile, first_tile + 1), end_tile == first_tile


class _TileMask:
    """Where a consumer thread's two rows may look: ``needed(n0)`` says whether key tile
    ``n0 ..`` has any invisible key for any row of the CTA, ``apply`` masks it. The per-row
    bounds are recomputed inside the (rare) masked branch rather than kept live in registers."""

    def __init__(self, rows, seq_q, seq_k, mask, lo_last, hi_first, block_n, cap):
        self.rows, self.seq_q, self.seq_k, self.mask = rows, seq_q, seq_k, mask
        self.lo_last, self.hi_first, self.block_n = lo_last, hi_first, block_n
        self.cap = cap  # soft_cap_constants, or None

    def soft_cap(self, scores):
        """The soft-capped scores (log2 units) with a softcap, else ``scores`` unchanged."""
        if self.cap is None:
            return scores
        return wgmma.fragment_from_elements([soft_cap(scores.element(i), *self.cap)
                                             for i in range(scores.shape[1] // 2)])

    def needed(self, n0):
        return (n0 < self.lo_last) | (n0 + self.block_n - 1 > self.hi_first)

    def apply(self, scores, n0):
        bounds = [_key_bounds(r, self.seq_q, self.seq_k, self.mask) for r in self.rows]
        return _mask_scores(scores, n0 + 2 * (kiln.thread_id(0) % 4), bounds)


def _mask_scores(scores, first_col, bounds):
    """Scores outside each row's visible key interval become -inf."""
    values = []
    for i in range(scores.shape[1] // 2):
        lo, hi = bounds[_fragment_row(i)]
        col = first_col + _fragment_col(i)
        values.append(kiln.where((col >= lo) & (col <= hi), scores.element(i),
                                 kiln.cast(-math.inf, kiln.f32)))
    return wgmma.fragment_from_elements(values)


class _Operands:
    """The consumer's WGMMA operand descriptors (i64 base addresses, see
    :func:`kiln.wgmma.smem_descriptor`) and the strides between their boxes."""

    def __init__(self, *, q, k, v, dtype, config, box_units, q_box_units):
        self.q, self.k, self.v = q, k, v
        self.dtype, self.config, self.block_n = dtype, config, config.block_n
        self.box_units, self.q_box_units = box_units, q_box_units

    def stage_offset(self, stage, width):
        """Descriptor offset of ring stage ``stage`` of a K or V ring of ``width`` columns
        (``width / 64`` boxes per stage)."""
        return kiln.cast(stage * (width // CHUNK_COLS) * self.box_units, kiln.i64)


def _box_view(tiles, padded):
    """The TMA destinations of a ring: one ``[rows, 1, cols]`` box per 3-D (padded) load."""
    if not padded:
        return tiles
    count, rows, cols = tiles.shape
    return tiles.reinterpret((count, rows, 1, cols), tiles.dtype)


def _box_coords(padded, head, d, chunk, row, chunk_cols=CHUNK_COLS):
    """TMA coordinates (innermost first) of box ``chunk`` (``chunk_cols`` wide) of ``head``'s
    columns at ``row``."""
    if padded:
        return (chunk * chunk_cols, head, row)
    return (head * d + chunk * chunk_cols, row)


def _issue_qk(ops: _Operands, stage):
    """Issue ``S = Q K^T`` on ring stage ``stage`` as one WGMMA group (K is K-major: each
    16-wide K step moves 32 bytes inside a 64-column box, every 4 steps the next box)."""
    base = ops.k + ops.stage_offset(stage, ops.config.qk_width)
    scores = wgmma.fragment_zeros(ops.block_n)
    wgmma.fence()
    for ks in range(ops.config.qk_steps):  # columns past the head dim are zeros: skipped
        scores = wgmma.mma_async(scores, ops.q + (ks // 4) * ops.q_box_units + (ks % 4) * 2,
                                 base + (ks // 4) * ops.box_units + (ks % 4) * 2,
                                 dtype=ops.dtype)
    wgmma.commit()
    return scores


def _issue_pv(ops: _Operands, acc, probs, stage):
    """Issue ``O += P V`` on ring stage ``stage`` as one WGMMA group: P from registers (``probs``,
    one A operand per 16 keys), V MN-major (its ``D / 64`` boxes are the descriptor's leading
    dimension; each 16-key step moves 16 rows of 128 bytes)."""
    base = ops.v + ops.stage_offset(stage, ops.config.v_width)
    wgmma.fence()  # orders O's rescale and P's registers before the asynchronous reads
    for ks in range(ops.block_n // K_STEP):
        acc = wgmma.mma_async(acc, probs.fragment(0, ks),
                              base + ks * K_STEP * ROW_BYTES // DESCRIPTOR_UNIT,
                              dtype=ops.dtype, b_major="mn")
    wgmma.commit()
    return acc


@kiln.func
def _softmax_tile(softmax, scores, n0, tile_mask, scale_log2, dtype, lazy_rescale):
    """One tile of the online softmax on raw scores ``S`` of keys ``n0 ..``: mask (boundary
    tiles only), fold ``scale * log2 e`` into the max subtraction, return P in ``dtype`` as the
    ``BLOCK_N / 16`` register A operands of the PV product.
    ``softmax.scale_vec`` then holds the factor O must be rescaled by before ``P V``."""
    scores = tile_mask.soft_cap(scores)
    if tile_mask.needed(n0):
        scores = tile_mask.apply(scores, n0)
    raw = wgmma.fragment_to_tile(scores)
    softmax.col_max_acc_scaled(raw, scale_log2)
    rescale_pending = True
    if lazy_rescale:
        rescale_pending = softmax.lazy_scale_decision(LAZY_RESCALE_THRESHOLD)
    else:
        softmax.update_scale_unconditional()
    probs = softmax.sub_max_scaled(raw, scale_log2).exp2()
    softmax.apply_unconditional_norm_rescale()
    softmax.col_sum_acc(probs)
    return _p_operands(probs, dtype), rescale_pending


@kiln.func
def _softmax_tile_max_on_demand(softmax, scores, n0, tile_mask, scale_log2, dtype, ops, stage,
                                vote_barrier):
    """:func:`_softmax_tile` with a lazy rescale that computes the tile's max only when it is
    needed: P = exp2(scale * S - running max) at once, and while every lane's partial row sums
    stay within ``2**LAZY_RESCALE_THRESHOLD`` (so every P does too) that P stands and the max
    is not reduced at all. Otherwise (rare: a row's max grew, or a row saw its first key) the
    group issues ``S = Q K^T`` again on ``stage`` (K is released after this call) and takes
    the tile the usual way. Returns P's A operands and whether O must be rescaled."""
    scores = tile_mask.soft_cap(scores)
    if tile_mask.needed(n0):
        scores = tile_mask.apply(scores, n0)
    probs = softmax.sub_max_scaled(wgmma.fragment_to_tile(scores), scale_log2).exp2()
    partial = probs.row_reduce(operator.add, across_lanes=False)
    # The whole warp group decides: the redo issues a (warp-group-wide) WGMMA.
    rescale_pending = nvidia_asm.named_barrier_any(
        vote_barrier, WARP_GROUP_THREADS, partial.any_greater(2.0 ** LAZY_RESCALE_THRESHOLD))
    if rescale_pending:
        scores = _issue_qk(ops, stage)
        wgmma.wait_group(0)
        scores = tile_mask.soft_cap(scores)
        if tile_mask.needed(n0):
            scores = tile_mask.apply(scores, n0)
        raw = wgmma.fragment_to_tile(scores)
        softmax.col_max_acc_scaled(raw, scale_log2)
        softmax.update_scale_unconditional()
        probs = softmax.sub_max_scaled(raw, scale_log2).exp2()
        partial = probs.row_reduce(operator.add, across_lanes=False)
    else:
        softmax.reset_scale()
    softmax.apply_unconditional_norm_rescale()
    softmax.norm_vec = softmax.norm_vec + probs.reduce_lanes(partial, operator.add)
    return _p_operands(probs, dtype), rescale_pending


def _p_operands(probs, dtype):
    """P as the register A operands of ``P V``: FP8 ones hold each 32-key block's keys in
    ``wgmma.FP8_A_K_ORDER`` (:mod:`.prefill_hopper_fp8` writes V's transpose in that order)."""
    return wgmma.a_fragment_from_accumulator(probs, dtype, k_permuted=dtype.is_fp8)


@kiln.func
def _write_output(out, lse_rows, max_rows, rows, o, lse, head, d, seq_q, q_start, first_col,
                  lane, lse_row_mult, lse_head_stride, return_lse, q_tiles, m0, consumer,
                  first_box=0):
    """Store the normalised rows inside the sequence with 16-byte stores (``d`` columns: O's
    padding columns past V's head dim stay behind): the group's own 64
    rows of the Q tile (no longer read once its last QK is waited) stage O, with the 16-byte
    units of a row XOR-swizzled by ``row % 8`` so both the fragment-order writes and the
    row-order reads are free of bank conflicts. The quad's first lane writes the LSE (-inf for
    a row whose max never left the sentinel: it saw no key and no sink). ``first_box``: the
    staging Q buffer's first box (a persistent kernel's second Q buffer)."""
    group_thread = kiln.thread_id(0) % WARP_GROUP_THREADS
    staging = OUTPUT_BARRIER + consumer
    first_local = consumer * WARP_GROUP_ROWS
    nvidia_asm.named_barrier(staging, WARP_GROUP_THREADS)  # every warp's QK reads of Q are done
    for r in range(2):
        local = rows[r] - m0 - first_local
        for i in range(0, out.shape[1] // 2, 2):  # registers i, i + 1: adjacent columns of one row
            if _fragment_row(i) == r and 8 * (i // 4) < d:
                unit = 8 * (i // 4)  # first column of the 16-byte unit (static)
                pair = kiln.pack([kiln.cast(out.element(i), o.dtype),
                                  kiln.cast(out.element(i + 1), o.dtype)])
                q_tiles.store(plus(first_box, unit // CHUNK_COLS), first_local + local,
                              ((unit % CHUNK_COLS) // 8 ^ local % 8) * 8 + first_col, pair,
                              align=4)
        if return_lse:
            if (lane % 4 == 0) & (rows[r] < seq_q):
                lse[q_start * lse_row_mult + head * lse_head_stride + rows[r]] = kiln.where(
                    max_rows[r] > MAX_SENTINEL, lse_rows[r], kiln.cast(-math.inf, kiln.f32))
    nvidia_asm.named_barrier(staging, WARP_GROUP_THREADS)
    units_per_row = d // 8
    units = WARP_GROUP_ROWS * units_per_row
    for step in range(-(-units // WARP_GROUP_THREADS)):
        index = step * WARP_GROUP_THREADS + group_thread
        partial = (step + 1) * WARP_GROUP_THREADS > units  # the last step of an odd width
        if partial:  # threads past the last unit re-read it; their store is dropped
            keep = index < units
            index = kiln.minimum(index, units - 1)
        local = index // units_per_row
        unit = index % units_per_row
        values = q_tiles.load(plus(first_box, unit // 8), first_local + local,
                              (unit % 8 ^ local % 8) * 8, width=8, align=16)
        row = m0 + first_local + local
        inside = row < seq_q
        if partial:
            inside = inside & keep
        if inside:
            o.store(q_start + row, head * d + unit * 8, values, align=16)


@kiln.func
def _write_rows(out, lse_rows, max_rows, rows, o, lse, head, d, seq_q, q_start, first_col, lane,
                lse_row_mult, lse_head_stride, return_lse):
    """:func:`_write_output` straight from the fragment, without staging: each register pair
    (two adjacent columns of one row) in one 4-byte store, a quad's 4 lanes 16 contiguous
    bytes; rows past the sequence store nothing."""
    for r in range(2):
        if rows[r] < seq_q:
            for i in range(0, out.shape[1] // 2, 2):
                if _fragment_row(i) == r and 8 * (i // 4) < d:
                    pair = kiln.pack([kiln.cast(out.element(i), o.dtype),
                                      kiln.cast(out.element(i + 1), o.dtype)])
                    o.store(q_start + rows[r], head * d + first_col + _fragment_col(i), pair,
                            align=4)
            if return_lse:
                if lane % 4 == 0:
                    lse[q_start * lse_row_mult + head * lse_head_stride + rows[r]] = kiln.where(
                        max_rows[r] > MAX_SENTINEL, lse_rows[r], kiln.cast(-math.inf, kiln.f32))


def plus(a, b):
    """``a + b``, or ``b`` itself when ``a`` is the Python int 0 (no add traced: the one-tile
    kernel's code stays what it was before the persistent variant shared it)."""
    return b if isinstance(a, int) and a == 0 else a + b
