"""The combine's kernel: ``lse_merge`` (dense partials) and ``lse_merge_ragged`` (token-ragged
partials with ``cu_seqlens_q``), one body, and the schedules :func:`choose_config` picks.

Schedule (grid ``(ceil(Sq * H / rows_per_cta), 1, B)``, ragged: ``max_seqlen_q`` for ``Sq``; a
CTA reduces ``rows_per_cta`` flat ``(q, h)`` rows of one batch with ``8 * split_groups``
threads per row). The plan picks one of two :class:`CombineConfig` specialisations:

- *wide* (``rows_per_cta = 64``, ``split_groups = 1``): for many rows. 8 threads per row walk
  all of the row's splits; many CTAs per SM hide the latency.
- *split-parallel* (``split_groups`` up to 64, ``rows_per_cta * split_groups = 64``, fewer
  for ``D > 128``): for few rows with many splits (decode at batch 1: 64 rows x 33 splits is
  ONE wide CTA whose threads walk 17 dependent DRAM round trips). Group ``g`` of a row
  merges split pairs ``g, g + G, ...`` so a row's loads are all in flight at once; the
  groups' partial sums meet in shared memory.

=======  ===================================================================================
phase    work
=======  ===================================================================================
LSE      each thread loads ``max_splits / 8`` LSE slots of its row (slots ``>= C`` masked to
         ``-inf``), max and sum of ``exp2`` over the row's 8 threads with XOR shuffles; group
         0 writes the normalised weights ``w_s / Z`` to a ``rows x max_splits`` f32 shared
         tile (the other groups computed the same sums from the same, cached, LSE loads)
merge    loop over this group's ``s < C`` only, two splits per iteration: 16-byte vector
         loads of both splits' ``O_partial`` rows are issued before either is accumulated,
         so every thread keeps ``2 * D / 16`` loads in flight (``stg128`` depth order: one
         load per depth pair, at the column the producer stored it)
reduce   split-parallel only: every group stores its ``rows x D`` f32 sums to shared memory;
         after a barrier each thread adds one ``WIDTH``-vector column over the groups
store    ``O`` cast to ``out_dtype`` in vector stores, ``LSE`` by one thread per row
=======  ===================================================================================

Why plain vector loads (not cp.async or TMA): every ``O_partial`` byte is read exactly once
and consumed straight from registers, so staging through shared memory would only add
traffic; the eight threads of a row read 128 contiguous bytes per step, which keeps every
32-byte sector fully used. Eight (not four) threads per row keep a thread's two splits of
in-flight vectors at 32 registers: with four, ptxas spilled at D = 128. Latency is hidden
by the two-split unroll (all loads of an iteration are independent) and several CTAs per SM
(wide), or by spreading the splits over the groups (split-parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import kiln
from kiln import f32, i32

from .partials import real_to_fake

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
THREADS_PER_ROW = 8
VECTOR_BYTES = 16
_ROW_LANE_MASKS = tuple(1 << b for b in range(THREADS_PER_ROW.bit_length() - 1))
# The wide schedule is kept while it launches at least this many CTAs (two per SM of an
# H100/H200): enough CTAs in flight hide the latency of its sequential split walk.
WIDE_MIN_CTAS = 264
# Row-groups per split-parallel CTA: 64 (512 threads) with the partial sums' shared tile capped
# at 32 KB, so D = 256 runs 32 row-groups (256 threads).
MAX_ROW_GROUPS = 64
PARTIAL_SUM_BYTES = 32 * 1024


@dataclass(frozen=True)
class CombineConfig:
    """Tile shape: ``rows_per_cta`` flat rows, each reduced by ``split_groups`` groups of
    ``THREADS_PER_ROW`` threads (group ``g`` merges split pairs ``g, g + split_groups, ...``).

    Example: ``CombineConfig(rows_per_cta=2, split_groups=32).threads == 512``.
    """

    rows_per_cta: int = 64
    split_groups: int = 1

    def __post_init__(self):
        if self.rows_per_cta < 1 or self.split_groups < 1:
            raise kiln.KilnValueError(f"{self} needs positive rows and groups",
                                      fix="use CombineConfig() or choose_config(...)")

    @property
    def threads(self) -> int:
        return self.rows_per_cta * self.split_groups * THREADS_PER_ROW

    def num_warps(self, target: str) -> int:
        return -(-self.threads // (64 if target.startswith("gfx") else 32))

    def grid(self, rows: int, batch: int) -> tuple[int, int, int]:
        return (-(-rows // self.rows_per_cta), 1, batch)

    def constexprs(self) -> dict:
        return dict(ROWS_PER_CTA=self.rows_per_cta, SPLIT_GROUPS=self.split_groups)


WIDE = CombineConfig()


def choose_config(rows: int, batch: int, max_splits: int, head_dim: int) -> CombineConfig:
    """The wide schedule unless it would launch fewer than :data:`WIDE_MIN_CTAS` CTAs for more
    than one split pair per row; then enough split groups to give each pair its own group.

    Example: ``choose_config(64, 1, 33, 128) == CombineConfig(rows_per_cta=2, split_groups=32)``.
    """
    pairs = -(-max_splits // 2)
    if pairs == 1 or WIDE.grid(rows, batch)[0] * batch >= WIDE_MIN_CTAS:
        return WIDE
    row_groups = max(1, min(MAX_ROW_GROUPS, PARTIAL_SUM_BYTES // (head_dim * 4)))
    groups = min(1 << (pairs - 1).bit_length(), 1 << (row_groups.bit_length() - 1))
    return CombineConfig(rows_per_cta=max(1, row_groups // groups), split_groups=groups)


@kiln.func
def _merge(o_part, lse_part, counts, o_out, lse_out, heads, rows, b, q_start, HEAD_DIM,
           MAX_SPLITS, LOG2_PER_UNIT, WIDTH, ROWS_PER_CTA, SPLIT_GROUPS, DEPTH_VEC):
    """``ROWS_PER_CTA`` rows of one batch, ``SPLIT_GROUPS`` groups each (module schedule).
    Dense (``q_start`` None): rows ``(b, q, h)`` of ``[.., B, Sq, H, ..]`` partials, ``b`` the
    grid's z. Ragged: token rows ``(q_start + q, h)`` of ``[.., total_q, H, ..]`` partials,
    ``rows`` this sequence's ``Sq * H``; ``counts`` is ``[B, max_seqlen_q, H]`` either way.
    ``DEPTH_VEC``: 0 for natural depth order, else the ``stg128`` vector (:mod:`.partials`)."""
    tpr = THREADS_PER_ROW
    tid = kiln.thread_id(0)
    part = tid % tpr
    local_row = (tid // tpr) % ROWS_PER_CTA
    group = tid // (tpr * ROWS_PER_CTA)
    if b is None:
        b = kiln.block_id(2)
    row = kiln.block_id(0) * ROWS_PER_CTA + local_row
    # Rows past the end compute on the last row (every lane joins the shuffles); no store.
    q = kiln.min(row, rows - 1) // heads
    h = kiln.min(row, rows - 1) % heads
    token = (b, q) if q_start is None else (q_start + q,)  # the partials' row index
    count = kiln.min(kiln.min(counts[b, q, h], MAX_SPLITS), lse_part.shape[0])

    # --- LSE phase: this thread's slots part, part + tpr, ...
    slots = (MAX_SPLITS + tpr - 1) // tpr
    lse = []
    for k in kiln.static_range(slots):
        s = part + k * tpr
        lse.append(lse_part.load(s, *token, h, mask=s < count, other=-float("inf")))
    m = lse[0]
    for x in lse[1:]:
        m = kiln.max(m, x)
    m = kiln.shuffle.butterfly_reduce(m, _ROW_LANE_MASKS, kiln.max)
    m_safe = kiln.where(m == -float("inf"), 0.0, m)       # no (-inf) - (-inf) = NaN
    # Subtract in the producer's units, then go to base 2: exact for the large LSEs of long
    # contexts, where scaling first would round away the small differences.
    w = [kiln.exp2((x - m_safe) * LOG2_PER_UNIT) for x in lse]
    z = w[0]
    for x in w[1:]:
        z = z + x
    z = kiln.shuffle.butterfly_reduce(z, _ROW_LANE_MASKS, lambda a, c: a + c)
    valid = (z > 0.0) & (z < float("inf"))                  # NaN compares false
    inv_z = kiln.where(valid, kiln.rcp(z), 0.0)
    weights = kiln.shared((ROWS_PER_CTA, slots * tpr), f32)
    if group == 0:
        for k in kiln.static_range(slots):
            # A NaN or +inf LSE makes z NaN: its row gets O = 0 (w * 0 would stay NaN).
            weights[local_row, part + k * tpr] = kiln.where(valid, w[k] * inv_z, 0.0)
    kiln.barrier()

    # --- merge phase: this group's split pairs, two splits per iteration, loads first
    chunks = HEAD_DIM // (WIDTH * tpr)
    ALIGN = WIDTH * o_part.dtype.itemsize  # contiguous rows, HEAD_DIM % (tpr * WIDTH) == 0
    cols = [(part + k * tpr) * WIDTH for k in range(chunks)]
    acc = [kiln.values.constant(0.0, f32, (WIDTH,)) for _ in range(chunks)]
    for s in kiln.range(2 * group, count, 2 * SPLIT_GROUPS):
        s1 = kiln.min(s + 1, count - 1)
        x0 = [_load_depths(o_part, (s, *token, h), c, WIDTH, ALIGN, DEPTH_VEC) for c in cols]
        x1 = [_load_depths(o_part, (s1, *token, h), c, WIDTH, ALIGN, DEPTH_VEC) for c in cols]
        w0 = weights[local_row, s]
        w1 = kiln.where(s + 1 < count, weights[local_row, s1], 0.0)
        acc = [kiln.fma(kiln.cast(b1, f32), w1, kiln.fma(kiln.cast(a0, f32), w0, a))
               for a, a0, b1 in zip(acc, x0, x1)]

    # --- reduce over the groups (split-parallel) and store
    out_align = WIDTH * o_out.dtype.itemsize
    if SPLIT_GROUPS == 1:
        if row < rows:
            for c, a in zip(cols, acc):
                o_out.store(*token, h, c, kiln.cast(a, o_out.dtype), align=out_align)
    else:
        sums = kiln.shared((SPLIT_GROUPS, ROWS_PER_CTA, HEAD_DIM), f32)
        for c, a in zip(cols, acc):
            sums.store(group, local_row, c, a, align=WIDTH * 4)
        kiln.barrier()
        vectors_per_row = HEAD_DIM // WIDTH
        threads = tpr * ROWS_PER_CTA * SPLIT_GROUPS
        for k in kiln.static_range(-(-ROWS_PER_CTA * vectors_per_row // threads)):
            v = tid + k * threads
            out_local = kiln.min(v // vectors_per_row, ROWS_PER_CTA - 1)
            c = (v % vectors_per_row) * WIDTH
            total = sums.load(0, out_local, c, width=WIDTH, align=WIDTH * 4)
            for g in kiln.static_range(1, SPLIT_GROUPS):
                total = total + sums.load(g, out_local, c, width=WIDTH, align=WIDTH * 4)
            out_row = kiln.block_id(0) * ROWS_PER_CTA + out_local
            if (v < ROWS_PER_CTA * vectors_per_row) & (out_row < rows):
                out_token = (b, out_row // heads) if q_start is None else \
                    (q_start + out_row // heads,)
                o_out.store(*out_token, out_row % heads, c, kiln.cast(total, o_out.dtype),
                            align=out_align)
    if (row < rows) & (part == 0) & (group == 0):
        nat_per_unit = 1.0 if LOG2_PER_UNIT != 1.0 else LN2
        lse_out[(*token, h)] = kiln.where(valid, kiln.fma(m_safe, nat_per_unit,
                                                      kiln.log2(z) * LN2), -float("inf"))


@kiln.kernel
def lse_merge(o_part, lse_part, counts, o_out, lse_out, heads: i32, rows: i32,
              HEAD_DIM: kiln.constexpr, MAX_SPLITS: kiln.constexpr, LOG2_PER_UNIT: kiln.constexpr,
              WIDTH: kiln.constexpr, ROWS_PER_CTA: kiln.constexpr, SPLIT_GROUPS: kiln.constexpr,
              DEPTH_VEC: kiln.constexpr = 0):
    """Dense partials ``[split, B, Sq, H, D]``: ``rows = Sq * H`` flat rows per batch."""
    _merge(o_part, lse_part, counts, o_out, lse_out, heads, rows, None, None, HEAD_DIM,
           MAX_SPLITS, LOG2_PER_UNIT, WIDTH, ROWS_PER_CTA, SPLIT_GROUPS, DEPTH_VEC)


@kiln.kernel
def lse_merge_ragged(o_part, lse_part, counts, o_out, lse_out, cu_q, heads: i32,
                     HEAD_DIM: kiln.constexpr, MAX_SPLITS: kiln.constexpr,
                     LOG2_PER_UNIT: kiln.constexpr, WIDTH: kiln.constexpr,
                     ROWS_PER_CTA: kiln.constexpr, SPLIT_GROUPS: kiln.constexpr,
                     DEPTH_VEC: kiln.constexpr = 0):
    """Ragged partials ``[split, total_q, H, D]``, sequence ``b`` at rows ``cu_q[b] ..``: the
    grid covers ``max_seqlen_q * H`` rows per sequence, and the tiles past this sequence's
    ``Sq * H`` return at once."""
    b = kiln.block_id(2)
    q_start = cu_q[b]
    rows = (cu_q[b + 1] - q_start) * heads
    if kiln.block_id(0) * ROWS_PER_CTA < rows:
        _merge(o_part, lse_part, counts, o_out, lse_out, heads, rows, b, q_start, HEAD_DIM,
               MAX_SPLITS, LOG2_PER_UNIT, WIDTH, ROWS_PER_CTA, SPLIT_GROUPS, DEPTH_VEC)


def _load_depths(o_part, index, c, width, align, depth_vec):
    """``width`` partial values of natural depths ``c ..``: one vector load in natural depth
    order; for ``stg128`` partials one load per depth pair at its stored column (pairs stay
    adjacent in both orders, and a row's 8 threads still read whole 32-byte sectors)."""
    if not depth_vec:
        return o_part.load(*index, c, width=width, align=align)
    pairs = [o_part.load(*index, real_to_fake(c + 2 * i, depth_vec), width=2,
                         align=2 * o_part.dtype.itemsize) for i in range(width // 2)]
    return kiln.pack([x for pair in pairs for x in kiln.unpack(pair)])


def _vector_width(head_dim: int, dtype: kiln.DType) -> int:
    width = max(VECTOR_BYTES // dtype.itemsize, 1)
    while width > 1 and head_dim % (width * THREADS_PER_ROW):
        width //= 2
    if head_dim % (width * THREADS_PER_ROW):
        raise kiln.UnsupportedError(f"combine needs a head dim divisible by "
                                    f"{THREADS_PER_ROW}, got {head_dim}",
                                    fix=f"pad the head dimension to a multiple of "
                                        f"{THREADS_PER_ROW}")
    return width


