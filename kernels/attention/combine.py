"""Split-KV combine: merge ``C`` partial attention outputs per query row by their LSE.

For each query row ``(b, q, h)`` with ``C = split_counts[b, q, h]`` valid slots::

    m = max_s LSE_s;  w_s = exp(LSE_s - m);  Z = sum_s w_s
    O = sum_s w_s * O_s / Z   (f32 accumulate);   LSE = ln Z + m

``C == 0``, or ``Z`` zero / non-finite, gives ``O = 0``, ``LSE = -inf``. The reduction runs
in base 2 (``exp2``/``log2``; one multiply by ``log2 e`` per LSE difference when the
producer's LSE is natural-log). Partials follow the :class:`~kiln.kernels.attention.partials.Partials`
contract the producer declares; ``combine`` checks it when it compiles.

Schedule (grid ``(ceil(Sq * H / rows_per_cta), 1, B)``; a CTA reduces ``rows_per_cta`` flat
``(q, h)`` rows of one batch with ``8 * split_groups`` threads per row). The plan picks one
of two :class:`CombineConfig` specialisations of the same kernel:

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
         so every thread keeps ``2 * D / 16`` loads in flight
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

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import kiln
from kiln import f32, i32

from .. import dlpack, runtime
from ..runtime import PlanCache, check_backend, check_counts, dtype_of, is_torch, spec
from .partials import Partials, partials_of

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


@kiln.kernel
def lse_merge(o_part, lse_part, counts, o_out, lse_out, heads: i32, rows: i32,
              HEAD_DIM: kiln.constexpr, MAX_SPLITS: kiln.constexpr, LOG2_PER_UNIT: kiln.constexpr,
              WIDTH: kiln.constexpr, ROWS_PER_CTA: kiln.constexpr, SPLIT_GROUPS: kiln.constexpr):
    """``ROWS_PER_CTA`` rows of one batch, ``SPLIT_GROUPS`` groups each (module schedule)."""
    tpr = THREADS_PER_ROW
    tid = kiln.thread_id(0)
    part = tid % tpr
    local_row = (tid // tpr) % ROWS_PER_CTA
    group = tid // (tpr * ROWS_PER_CTA)
    b = kiln.block_id(2)
    row = kiln.block_id(0) * ROWS_PER_CTA + local_row
    # Rows past the end compute on the last row (every lane joins the shuffles); no store.
    q = kiln.min(row, rows - 1) // heads
    h = kiln.min(row, rows - 1) % heads
    count = kiln.min(kiln.min(counts[b, q, h], MAX_SPLITS), lse_part.shape[0])

    # --- LSE phase: this thread's slots part, part + tpr, ...
    slots = (MAX_SPLITS + tpr - 1) // tpr
    lse = []
    for k in kiln.static_range(slots):
        s = part + k * tpr
        lse.append(lse_part.load(s, b, q, h, mask=s < count, other=-float("inf")))
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
        x0 = [o_part.load(s, b, q, h, c, width=WIDTH, align=ALIGN) for c in cols]
        x1 = [o_part.load(s1, b, q, h, c, width=WIDTH, align=ALIGN) for c in cols]
        w0 = weights[local_row, s]
        w1 = kiln.where(s + 1 < count, weights[local_row, s1], 0.0)
        acc = [kiln.fma(kiln.cast(b1, f32), w1, kiln.fma(kiln.cast(a0, f32), w0, a))
               for a, a0, b1 in zip(acc, x0, x1)]

    # --- reduce over the groups (split-parallel) and store
    out_align = WIDTH * o_out.dtype.itemsize
    if SPLIT_GROUPS == 1:
        if row < rows:
            for c, a in zip(cols, acc):
                o_out.store(b, q, h, c, kiln.cast(a, o_out.dtype), align=out_align)
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
                o_out.store(b, out_row // heads, out_row % heads, c,
                            kiln.cast(total, o_out.dtype), align=out_align)
    if (row < rows) & (part == 0) & (group == 0):
        nat_per_unit = 1.0 if LOG2_PER_UNIT != 1.0 else LN2
        lse_out[b, q, h] = kiln.where(valid, kiln.fma(m_safe, nat_per_unit,
                                                      kiln.log2(z) * LN2), -float("inf"))


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


def _check_inputs(o_partial, lse_partial, split_counts) -> tuple[int, int, int, int, int]:
    for name, x in (("O_partial", o_partial), ("LSE_partial", lse_partial),
                    ("split_counts", split_counts)):
        dtype_of(name, x)
    if len(o_partial.shape) != 5 or len(lse_partial.shape) != 4 or len(split_counts.shape) != 3:
        raise kiln.KilnValueError(
            f"combine expects O_partial [split, b, q, h, D], LSE_partial [split, b, q, h] and "
            f"split_counts [b, q, h]; got shapes {tuple(o_partial.shape)}, "
            f"{tuple(lse_partial.shape)}, {tuple(split_counts.shape)}",
            fix="pass the producer's split-major partials unchanged")
    splits, batch, sq, heads, head_dim = (int(d) for d in o_partial.shape)
    if tuple(lse_partial.shape) != (splits, batch, sq, heads) or \
            tuple(split_counts.shape) != (batch, sq, heads):
        raise kiln.KilnValueError(
            f"partials disagree: O_partial {tuple(o_partial.shape)}, LSE_partial "
            f"{tuple(lse_partial.shape)}, split_counts {tuple(split_counts.shape)}",
            fix="LSE_partial must be O_partial's shape without D; split_counts without split")
    if head_dim == 0:
        raise kiln.KilnValueError("O_partial has head dim D = 0: there is no output to merge",
                                  fix="pass partials of the attention's head dim (a multiple of 8)")
    if kiln.dtype(lse_partial.dtype) is not f32 or kiln.dtype(split_counts.dtype) is not i32:
        raise kiln.KilnTypeError(f"LSE_partial must be float32 and split_counts int32, got "
                                 f"{lse_partial.dtype} and {split_counts.dtype}",
                                 fix="cast them with .astype(np.float32) / .astype(np.int32)")
    return splits, batch, sq, heads, head_dim


def _consumer_contract(producer: Partials | None, o_dtype: kiln.DType,
                       max_splits: int) -> Partials:
    """What this combine reads: the producer's log base is followed (both are supported)."""
    return Partials(producer="kiln.kernels.attention.combine", max_splits=max_splits,
                    dtype=o_dtype, log_base=producer.log_base if producer else "e")


@dataclass(frozen=True)
class _CombinePlan:
    """What a combine call of one shape class needs, worked out once (see :data:`_PLANS`):
    validated sizes, grid, constexprs and, for torch CUDA tensors, the bound launch."""

    out_shape: tuple[int, int, int, int]
    grid: tuple[int, int, int]
    target: str
    num_warps: int
    constexprs: dict
    max_splits: int
    out_dtype: kiln.DType
    backend: str | None
    torch_out_dtype: Any = None
    device: Any = None
    bound: Any = None  # kiln.kernels.runtime.bind's launch (torch on the GPU, rows > 0)

    @functools.cached_property
    def empty(self) -> bool:
        return self.grid[0] == 0 or self.grid[2] == 0

    def new_outputs(self, lse_partial):
        """Fresh ``(o, lse)`` torch tensors on the device of ``lse_partial`` (an f32 tensor):
        ``new_empty`` skips parsing a device and, for ``lse``, a dtype (less host time)."""
        return (lse_partial.new_empty(self.out_shape, dtype=self.torch_out_dtype),
                lse_partial.new_empty(self.out_shape[:3]))

    def run_torch(self, o_partial, lse_partial, split_counts, out=None, lse_out=None):
        if o_partial.data_ptr() % VECTOR_BYTES:  # layouts were checked with the plan
            _refuse_layout()
        if out is None:
            out = lse_partial.new_empty(self.out_shape, dtype=self.torch_out_dtype)
        else:
            self.check_output(out, "out", self.out_shape, self.torch_out_dtype)
        if lse_out is None:
            lse_out = lse_partial.new_empty(self.out_shape[:3])  # f32, as checked
        else:
            import torch

            self.check_output(lse_out, "lse_out", self.out_shape[:3], torch.float32)
        if self.empty:  # no rows, or no split slots: every row is O = 0, LSE = -inf
            out.zero_()
            lse_out.fill_(-math.inf)
        if self.bound is not None:
            self.bound(o_partial.data_ptr(), lse_partial.data_ptr(), split_counts.data_ptr(),
                       out.data_ptr(), lse_out.data_ptr())
        return out, lse_out

    def check_output(self, tensor, name: str, shape: tuple, dtype) -> None:
        """A caller's output tensor must be laid out exactly as the bound launch writes it."""
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or \
                not runtime.bindable(tensor) or \
                not tensor.is_contiguous() or tensor.data_ptr() % VECTOR_BYTES:
            raise kiln.KilnValueError(
                f"combine's {name} must be a contiguous, 16-byte aligned {dtype} CUDA tensor of "
                f"shape {shape}; got {tensor.dtype} of shape {tuple(tensor.shape)}",
                fix=f"allocate it with torch.empty({shape}, dtype={dtype}, device=...) or "
                    f"leave {name}=None")

    def run_numpy(self, o_partial, lse_partial, split_counts, out=None, lse_out=None):
        if isinstance(split_counts, np.ndarray) and split_counts.size and \
                int(split_counts.max()) > self.max_splits:
            raise kiln.KilnValueError(f"split_counts holds {int(split_counts.max())} splits, "
                                      f"more than max_splits={self.max_splits}",
                                      fix=f"pass max_splits={int(split_counts.max())} or more")
        o_partial, lse_partial, split_counts = (np.ascontiguousarray(a) for a in
                                                (o_partial, lse_partial, split_counts))
        o = np.empty(self.out_shape, self.out_dtype.numpy) if out is None else out
        lse = np.empty(self.out_shape[:3], np.float32) if lse_out is None else lse_out
        for array, name, shape, dtype in ((o, "out", self.out_shape, self.out_dtype.numpy),
                                          (lse, "lse_out", self.out_shape[:3], np.float32)):
            if not isinstance(array, np.ndarray) or array.shape != shape or \
                    array.dtype != dtype or not array.flags.c_contiguous:
                raise kiln.KilnValueError(
                    f"combine's {name} must be a contiguous {np.dtype(dtype)} numpy array of "
                    f"shape {shape}", fix=f"allocate it with np.empty({shape}, "
                                          f"np.{np.dtype(dtype).name}) or leave {name}=None")
        check_counts("split_counts", split_counts, slots=o_partial.shape[0])
        if self.empty:  # no rows, or no split slots: every row is O = 0, LSE = -inf
            o[...] = 0
            lse[...] = -np.inf
        else:
            args = (o_partial, lse_partial, split_counts, o, lse, *_scalar_args(self.out_shape))
            run = runtime.interpret if self.backend == "interpret" else runtime.launch
            run(lse_merge, self.grid, args, target=self.target, num_warps=self.num_warps,
                **self.constexprs)
        return o, lse


# Plans by the partials' specs and the options (see kiln.kernels.runtime): a repeat call
# costs a dict look-up, two output allocations (none with out= and lse_out=) and one bound
# launch, not a re-validation and specialisation.
_PLANS = PlanCache("combine")


def _refuse_layout():
    raise kiln.KilnValueError("combine reads contiguous partials with a 16-byte aligned "
                              "O_partial (its rows are read in 16-byte vectors)",
                              fix="pass .contiguous() tensors")


def _scalar_args(out_shape) -> tuple[int, int]:
    _, sq, heads, _ = out_shape
    return heads, sq * heads  # (heads, flat rows per batch)


def _make_plan(o_partial, lse_partial, split_counts, max_splits, out_dtype, partials, target,
               backend) -> _CombinePlan:
    splits, batch, sq, heads, head_dim = _check_inputs(o_partial, lse_partial, split_counts)
    o_dtype = kiln.dtype(o_partial.dtype)
    if o_dtype not in (f32, kiln.bf16, kiln.f16):
        raise kiln.UnsupportedError(f"combine reads f32, bf16 or f16 O_partial, got {o_dtype}",
                                    fix="write the partials in f32")
    out_dtype = kiln.dtype(out_dtype)
    if out_dtype not in (f32, kiln.bf16, kiln.f16):
        raise kiln.UnsupportedError(f"combine writes f32, bf16 or f16, got {out_dtype}",
                                    fix="out_dtype=kiln.bf16 (the default) or kiln.f32")
    if not isinstance(max_splits, int) or max_splits < 1:
        raise kiln.KilnValueError(f"max_splits must be a positive int, got {max_splits!r}",
                                  fix="max_splits=32 covers top-k up to 32")
    producer = partials_of(partials)
    contract = _consumer_contract(producer, o_dtype, max_splits)
    if producer is not None:
        producer.check_consumer(contract)
    check_backend(backend)
    target = "sm_90a" if target is None else target  # "" is the compiler's TargetError
    rows = sq * heads
    config = choose_config(rows, batch, max_splits, head_dim)
    plan = _CombinePlan(
        out_shape=(batch, sq, heads, head_dim),
        grid=config.grid(rows, batch) if splits else (0, 1, batch),
        target=target, num_warps=config.num_warps(target),
        constexprs=_constexprs(head_dim, max_splits, contract.log_base, o_dtype, config),
        max_splits=max_splits, out_dtype=out_dtype, backend=backend)
    if not is_torch(o_partial) or backend == "interpret":
        return plan
    if not all(t.is_contiguous() for t in (o_partial, lse_partial, split_counts)):
        _refuse_layout()
    if not runtime.bindable(o_partial, lse_partial, split_counts):
        raise kiln.KilnTypeError("LSE_partial and split_counts must be CUDA tensors like "
                                 "O_partial", fix="move them to O_partial's device")
    plan = replace(plan, device=o_partial.device,
                   torch_out_dtype=runtime.torch_dtype(out_dtype))
    if plan.empty:
        return plan
    args = (o_partial, lse_partial, split_counts, *plan.new_outputs(lse_partial),
            *_scalar_args(plan.out_shape))
    return replace(plan, bound=runtime.bind(lse_merge, plan.grid, args, target=target,
                                            num_warps=plan.num_warps, **plan.constexprs))


def _constexprs(head_dim: int, max_splits: int, log_base: str, o_dtype: kiln.DType,
                config: CombineConfig) -> dict:
    return dict(HEAD_DIM=head_dim, MAX_SPLITS=max_splits,
                LOG2_PER_UNIT=LOG2E if log_base == "e" else 1.0,
                WIDTH=_vector_width(head_dim, o_dtype), **config.constexprs())


def plan_combine(o_partial, lse_partial, split_counts, *, max_splits: int = 32,
                 out_dtype=kiln.bf16, partials: Any = None, target: str | None = None,
                 backend: str | None = None) -> _CombinePlan:
    """The (cached) plan :func:`combine` runs for these arguments' shape class. A producer
    that calls combine in a loop keeps it and calls ``plan.new_outputs(lse_partial)`` and
    ``plan.bound(o_partial_ptr, lse_partial_ptr, counts_ptr, o_ptr, lse_ptr)`` itself
    (torch CUDA tensors, contiguous and laid out like the first call's).

    Example: ``plan_combine(o_p, lse_p, counts, max_splits=33).grid``.
    """
    key = (spec(o_partial), spec(lse_partial), spec(split_counts), max_splits, out_dtype,
           partials_of(partials), target, backend)
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.add(key, _make_plan(o_partial, lse_partial, split_counts, max_splits,
                                          out_dtype, partials, target, backend))
    return plan


def combine(o_partial, lse_partial, split_counts, *, max_splits: int = 32,
            out_dtype=kiln.bf16, partials: Any = None, target: str | None = None,
            backend: str | None = None, out=None, lse_out=None):
    """Merge split-KV partials into ``(o [b, q, h, D] out_dtype, lse [b, q, h] f32)``.

    ``max_splits`` is compile-time sizing (at least the largest ``split_counts`` entry);
    ``partials`` is the producer's :class:`Partials` (or an object with ``.partials``), checked
    against what this combine reads. Inputs: numpy arrays or torch CUDA tensors (outputs are
    of the same kind; torch launches are asynchronous on torch's current stream, and a repeat
    call with the same shapes costs a few microseconds of host time plus the launch);
    ``backend="interpret"`` runs the kernel on the CPU interpreter.

    ``out`` / ``lse_out``: optional preallocated outputs (contiguous, ``[b, q, h, D]`` of
    ``out_dtype`` and ``[b, q, h]`` float32, same kind and device as the inputs) that are
    written and returned instead of fresh ones; a decode loop that reuses them skips the
    allocation per call. Either may be given alone.

    Inputs are validated (a :class:`kiln.KilnError` naming the argument): kinds, ranks, dtypes
    and agreeing shapes; for numpy ``split_counts`` every entry in ``[0, splits]`` (device
    counts are clamped to ``[0, min(splits, max_splits)]`` in the kernel). ``D = 0`` is refused;
    an empty batch gives empty outputs, and zero split slots give ``O = 0``, ``LSE = -inf``
    without a launch. A row whose denominator is zero or non-finite (no split, only ``-inf``
    LSEs, or a NaN or ``+inf`` LSE in a counted slot) gets ``O = 0``, ``LSE = -inf``.

    Example::

        o, lse = combine(o_partial, lse_partial, split_counts, max_splits=16,
                         out_dtype=kiln.f32, backend="interpret")
        combine(o_partial, lse_partial, split_counts, max_splits=16, out_dtype=kiln.f32,
                backend="interpret", out=o, lse_out=lse)   # writes into o and lse
    """
    if dlpack.foreign(o_partial):  # cupy / JAX / DLPack device arrays: zero-copy via torch
        return dlpack.through_torch(combine, o_partial, lse_partial, split_counts,
                                    max_splits=max_splits, out_dtype=out_dtype,
                                    partials=partials, target=target, backend=backend, out=out,
                                    lse_out=lse_out)
    plan = plan_combine(o_partial, lse_partial, split_counts, max_splits=max_splits,
                        out_dtype=out_dtype, partials=partials, target=target, backend=backend)
    if plan.device is not None:  # torch tensors on the GPU
        return plan.run_torch(o_partial, lse_partial, split_counts, out, lse_out)
    return plan.run_numpy(o_partial, lse_partial, split_counts, out, lse_out)


def compile_combine(dtype=f32, *, head_dim: int = 128, max_splits: int = 32,
                    out_dtype=kiln.bf16, log_base: str = "e", target: str = "sm_90a",
                    config: CombineConfig = WIDE):
    """The compiled combine kernel (stages, metadata) for ``dtype`` partials, without running;
    ``config`` picks the schedule (:data:`WIDE`, or a split-parallel one of
    :func:`choose_config`).

    Example: ``print(compile_combine("f32", target="gfx950").metadata)``.
    """
    dtype, out_dtype = kiln.dtype(dtype), kiln.dtype(out_dtype)
    o_part = np.zeros((1, 1, 1, 1, head_dim), dtype.numpy)
    args = (o_part, np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.int32),
            np.zeros((1, 1, 1, head_dim), out_dtype.numpy), np.zeros((1, 1, 1), np.float32),
            1, 1)
    return lse_merge.compile(*args, target=target, num_warps=config.num_warps(target),
                             **_constexprs(head_dim, max_splits, log_base, dtype, config))
