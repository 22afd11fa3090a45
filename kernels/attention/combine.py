"""Split-KV combine: merge ``C`` partial attention outputs per query row by their LSE.

For each query row ``(b, q, h)`` with ``C = split_counts[b, q, h]`` valid slots::

    m = max_s LSE_s;  w_s = exp(LSE_s - m);  Z = sum_s w_s
    O = sum_s w_s * O_s / Z   (f32 accumulate);   LSE = ln Z + m

``C == 0``, or ``Z`` zero / non-finite, gives ``O = 0``, ``LSE = -inf``. The reduction runs
in base 2 (``exp2``/``log2``; one multiply by ``log2 e`` per LSE difference when the
producer's LSE is natural-log). Partials follow the :class:`~kiln.kernels.attention.partials.Partials`
contract the producer declares; ``combine`` checks it when it compiles.

Layouts: dense partials ``O_partial [split, B, Sq, H, D]``, ``LSE_partial [split, B, Sq, H]``,
``split_counts [B, Sq, H]`` give ``o [B, Sq, H, D]``, ``lse [B, Sq, H]``; ragged ones (the MSA
seed's: ``cu_seqlens_q`` of ``B + 1`` prefix sums) are token-major, ``O_partial [split,
total_q, H, D]``, ``LSE_partial [split, total_q, H]``, with ``split_counts [B, max_seqlen_q, H]``
indexed by the query's position inside its sequence, and give ``o [total_q, H, D]``, ``lse
[total_q, H]``. A producer whose partials keep the ``stg128`` depth order
(:mod:`.partials`) declares it in its ``Partials``; ``o`` is always in natural order.

The kernel and its schedules: :mod:`.combine_kernel`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import kiln
from kiln import f32, i32

from .. import dlpack, runtime
from ..runtime import PlanCache, check_backend, check_counts, dtype_of, is_torch, key_of
from ..one_call import OneCallSlot, one_call, output, value
from ..workspaces import SEPARATE
from .combine_kernel import (LOG2E, THREADS_PER_ROW, VECTOR_BYTES, WIDE, CombineConfig,
                             choose_config, lse_merge, lse_merge_ragged, _vector_width)
from .partials import DEPTH_ORDERS, STG128_DEPTH, Partials, partials_of, stg128_vector

__all__ = ["combine", "plan_combine", "compile_combine", "CombineConfig", "choose_config", "WIDE",
           "THREADS_PER_ROW", "VECTOR_BYTES", "lse_merge", "lse_merge_ragged"]

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
    """What this combine reads: the producer's log base and depth order are followed (both
    of each are supported; an unknown depth order stays natural and fails the check)."""
    depth = producer.depth_order if producer and producer.depth_order in DEPTH_ORDERS \
        else DEPTH_ORDERS[0]
    return Partials(producer="kiln.kernels.attention.combine", max_splits=max_splits,
                    dtype=o_dtype, log_base=producer.log_base if producer else "e",
                    depth_order=depth)


@dataclass(frozen=True)
class _CombinePlan:
    """What a combine call of one shape class needs, worked out once (see :data:`_PLANS`):
    validated sizes, grid, constexprs and, for torch CUDA tensors, the bound launch."""

    out_shape: tuple[int, ...]  # [B, Sq, H, D], ragged [total_q, H, D]
    grid: tuple[int, int, int]
    target: str
    num_warps: int
    constexprs: dict
    max_splits: int
    out_dtype: kiln.DType
    backend: str | None
    scalars: tuple = ()  # the kernel's trailing i32 arguments
    ragged: bool = False  # lse_merge_ragged, with cu_seqlens_q after the outputs
    torch_out_dtype: Any = None
    device: Any = None
    bound: Any = None  # kiln.kernels.runtime.bind's launch (torch on the GPU, rows > 0)
    calls: dict = field(default_factory=dict)  # its one-call object (kiln.kernels.one_call)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return self.out_shape[:-1]

    @property
    def kernel(self):
        return lse_merge_ragged if self.ragged else lse_merge

    def args(self, o_partial, lse_partial, split_counts, o, lse, cu_q) -> tuple:
        """The kernel's arguments in order (``cu_q`` only for ragged partials)."""
        ragged = (cu_q,) if self.ragged else ()
        return (o_partial, lse_partial, split_counts, o, lse, *ragged, *self.scalars)

    @functools.cached_property
    def empty(self) -> bool:
        return self.grid[0] == 0 or self.grid[2] == 0

    def new_outputs(self, lse_partial):
        """Fresh ``(o, lse)`` torch tensors on the device of ``lse_partial`` (an f32 tensor on
        the plan's device)."""
        return self.fresh_outputs(lse_partial)()

    def fresh_outputs(self, lse_partial) -> runtime.TorchOutputs:
        """The plan's maker of fresh ``(o, lse)`` (built on first use, like ``lse_partial``)."""
        fresh = self.__dict__.get("fresh")
        if fresh is None:  # a frozen dataclass: its __dict__ holds the cache, as cached_property
            fresh = self.__dict__["fresh"] = runtime.TorchOutputs(
                lse_partial, (self.out_shape, self.torch_out_dtype),
                (self.lse_shape, lse_partial.dtype))
        return fresh

    def run_torch(self, o_partial, lse_partial, split_counts, out=None, lse_out=None,
                  cu_q=None):
        if o_partial.data_ptr() % VECTOR_BYTES:  # layouts were checked with the plan
            _refuse_layout()
        if out is None and lse_out is None:
            out, lse_out = self.fresh_outputs(lse_partial)()
        else:
            out, lse_out = self._given_outputs(lse_partial, out, lse_out)
        if self.empty:  # no rows, or no split slots: every row is O = 0, LSE = -inf
            out.zero_()
            lse_out.fill_(-math.inf)
        bound = self.bound
        if bound is not None:
            if self.ragged:
                bound.launch_on(bound.current_stream(), o_partial.data_ptr(),
                                lse_partial.data_ptr(), split_counts.data_ptr(),
                                out.data_ptr(), lse_out.data_ptr(), cu_q.data_ptr())
            else:
                bound.launch_on(bound.current_stream(), o_partial.data_ptr(),
                                lse_partial.data_ptr(), split_counts.data_ptr(),
                                out.data_ptr(), lse_out.data_ptr())
        return out, lse_out

    def _given_outputs(self, lse_partial, out, lse_out) -> tuple:
        """``(out, lse_out)`` with the caller's checked and the missing one fresh."""
        import torch

        if out is None:
            out = self.fresh_outputs(lse_partial).one(0)
        else:
            self.check_output(out, "out", self.out_shape, self.torch_out_dtype)
        if lse_out is None:
            lse_out = self.fresh_outputs(lse_partial).one(1)  # f32, as checked
        else:
            self.check_output(lse_out, "lse_out", self.lse_shape, torch.float32)
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

    def run_numpy(self, o_partial, lse_partial, split_counts, out=None, lse_out=None,
                  cu_q=None):
        if isinstance(split_counts, np.ndarray) and split_counts.size and \
                int(split_counts.max()) > self.max_splits:
            raise kiln.KilnValueError(f"split_counts holds {int(split_counts.max())} splits, "
                                      f"more than max_splits={self.max_splits}",
                                      fix=f"pass max_splits={int(split_counts.max())} or more")
        o_partial, lse_partial, split_counts = (np.ascontiguousarray(a) for a in
                                                (o_partial, lse_partial, split_counts))
        o = np.empty(self.out_shape, self.out_dtype.numpy) if out is None else out
        lse = np.empty(self.lse_shape, np.float32) if lse_out is None else lse_out
        for array, name, shape, dtype in ((o, "out", self.out_shape, self.out_dtype.numpy),
                                          (lse, "lse_out", self.lse_shape, np.float32)):
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
            args = self.args(o_partial, lse_partial, split_counts, o, lse,
                             None if cu_q is None else np.ascontiguousarray(cu_q, np.int32))
            run = runtime.interpret if self.backend == "interpret" else runtime.launch
            run(self.kernel, self.grid, args, target=self.target, num_warps=self.num_warps,
                **self.constexprs)
        return o, lse


# Plans by the partials' specs and the options (see kiln.kernels.runtime): a repeat call
# costs a dict look-up, one allocation for o and lse (none with out= and lse_out=) and one
# bound launch, not a re-validation and specialisation.
_PLANS = PlanCache("combine")


def _refuse_layout():
    raise kiln.KilnValueError("combine reads contiguous partials with a 16-byte aligned "
                              "O_partial (its rows are read in 16-byte vectors)",
                              fix="pass .contiguous() tensors")


def _check_ragged(o_partial, lse_partial, split_counts, cu_q, max_seqlen_q):
    """Shapes of token-ragged partials (module docs): ``(splits, batch, max_seqlen_q, heads,
    head_dim, total_q)``; numpy ``cu_seqlens_q`` are checked against ``max_seqlen_q`` too."""
    for name, x in (("O_partial", o_partial), ("LSE_partial", lse_partial),
                    ("split_counts", split_counts), ("cu_seqlens_q", cu_q)):
        dtype_of(name, x)
    if len(o_partial.shape) != 4 or len(lse_partial.shape) != 3 or \
            len(split_counts.shape) != 3 or len(cu_q.shape) != 1 or cu_q.shape[0] < 1:
        raise kiln.KilnValueError(
            f"ragged combine expects O_partial [split, total_q, h, D], LSE_partial "
            f"[split, total_q, h], split_counts [b, max_seqlen_q, h] and cu_seqlens_q [b + 1]; "
            f"got {tuple(o_partial.shape)}, {tuple(lse_partial.shape)}, "
            f"{tuple(split_counts.shape)}, {tuple(cu_q.shape)}",
            fix="pass token-major partials with cu_seqlens_q, or dense [split, b, q, h, D] ones "
                "without it")
    splits, total_q, heads, head_dim = (int(d) for d in o_partial.shape)
    batch, max_sq = int(cu_q.shape[0]) - 1, int(split_counts.shape[1])
    if max_seqlen_q is None:
        max_seqlen_q = max_sq
    if tuple(lse_partial.shape) != (splits, total_q, heads) or \
            tuple(split_counts.shape) != (batch, max_sq, heads) or \
            not isinstance(max_seqlen_q, int) or not 0 <= max_seqlen_q <= max_sq:
        raise kiln.KilnValueError(
            f"ragged partials disagree: O_partial {tuple(o_partial.shape)}, LSE_partial "
            f"{tuple(lse_partial.shape)}, split_counts {tuple(split_counts.shape)}, "
            f"cu_seqlens_q of {batch + 1}, max_seqlen_q={max_seqlen_q!r}",
            fix="split_counts must be [len(cu_seqlens_q) - 1, max_seqlen_q, h] and "
                "max_seqlen_q an int up to its second dimension")
    if isinstance(cu_q, np.ndarray):
        cu = cu_q.astype(np.int64)
        if cu[0] != 0 or cu[-1] != total_q or np.any(np.diff(cu) < 0) or \
                np.diff(cu).max(initial=0) > max_seqlen_q:
            raise kiln.KilnValueError(
                f"cu_seqlens_q must be non-decreasing prefix sums from 0 to total_q={total_q} "
                f"with no sequence longer than max_seqlen_q={max_seqlen_q}",
                fix="build it as concatenate([[0], cumsum(lengths)]) and pass max_seqlen_q="
                    "max(lengths)")
    if kiln.dtype(cu_q.dtype) is not i32:
        raise kiln.KilnTypeError(f"cu_seqlens_q must be int32, got {cu_q.dtype}",
                                 fix="cast it with .astype(np.int32)")
    return splits, batch, max_seqlen_q, heads, head_dim, total_q


def _make_plan(o_partial, lse_partial, split_counts, max_splits, out_dtype, partials, target,
               backend, cu_q=None, max_seqlen_q=None) -> _CombinePlan:
    ragged = cu_q is not None
    if ragged:
        splits, batch, sq, heads, head_dim, total_q = _check_ragged(
            o_partial, lse_partial, split_counts, cu_q, max_seqlen_q)
    else:
        if max_seqlen_q is not None:
            raise kiln.KilnValueError("max_seqlen_q is for ragged partials",
                                      fix="pass cu_seqlens_q with it, or neither")
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
        out_shape=(total_q, heads, head_dim) if ragged else (batch, sq, heads, head_dim),
        grid=config.grid(rows, batch) if splits else (0, 1, batch),
        target=target, num_warps=config.num_warps(target),
        constexprs=_constexprs(head_dim, max_splits, contract, o_dtype, config),
        max_splits=max_splits, out_dtype=out_dtype, backend=backend,
        scalars=(heads,) if ragged else (heads, sq * heads), ragged=ragged)
    if not is_torch(o_partial) or backend == "interpret":
        return plan
    tensors = (o_partial, lse_partial, split_counts) + ((cu_q,) if ragged else ())
    if not all(t.is_contiguous() for t in tensors):
        _refuse_layout()
    if not runtime.bindable(*tensors):
        raise kiln.KilnTypeError("LSE_partial, split_counts (and cu_seqlens_q) must be CUDA "
                                 "tensors like O_partial", fix="move them to O_partial's device")
    plan = replace(plan, device=o_partial.device,
                   torch_out_dtype=runtime.torch_dtype(out_dtype))
    if plan.empty:
        return plan
    args = plan.args(o_partial, lse_partial, split_counts, *plan.new_outputs(lse_partial), cu_q)
    plan = replace(plan, bound=runtime.bind(plan.kernel, plan.grid, args, target=target,
                                            num_warps=plan.num_warps, **plan.constexprs))
    plan.fresh_outputs(lse_partial)  # `fresh`, which a bound repeat call reads
    return plan


def _constexprs(head_dim: int, max_splits: int, contract: Partials, o_dtype: kiln.DType,
                config: CombineConfig) -> dict:
    depth = {}
    if contract.depth_order == STG128_DEPTH:
        vector = stg128_vector(o_dtype)
        if head_dim % (4 * vector):
            raise kiln.UnsupportedError(
                f"stg128 partials of {o_dtype} permute depths in groups of {4 * vector} "
                f"columns; head dim {head_dim} is not a multiple", fix="pad the head dim, or "
                "write the partials in natural depth order")
        depth = dict(DEPTH_VEC=vector)
    return dict(HEAD_DIM=head_dim, MAX_SPLITS=max_splits,
                LOG2_PER_UNIT=LOG2E if contract.log_base == "e" else 1.0,
                WIDTH=_vector_width(head_dim, o_dtype), **config.constexprs(), **depth)


def plan_combine(o_partial, lse_partial, split_counts, *, max_splits: int = 32,
                 out_dtype=kiln.bf16, partials: Any = None, target: str | None = None,
                 backend: str | None = None, cu_seqlens_q=None,
                 max_seqlen_q: int | None = None) -> _CombinePlan:
    """The (cached) plan :func:`combine` runs for these arguments' shape class. A producer
    that calls combine in a loop keeps it and calls ``plan.new_outputs(lse_partial)`` and
    ``plan.bound(o_partial_ptr, lse_partial_ptr, counts_ptr, o_ptr, lse_ptr)`` itself
    (torch CUDA tensors, contiguous and laid out like the first call's; ragged partials add
    ``cu_seqlens_q``'s address last). Numpy ``cu_seqlens_q`` are checked when the plan is
    made, so the plan of a ragged numpy call is not cached.

    Example: ``plan_combine(o_p, lse_p, counts, max_splits=33).grid``.
    """
    args = (o_partial, lse_partial, split_counts, max_splits, out_dtype, partials, target,
            backend, cu_seqlens_q, max_seqlen_q)
    if isinstance(cu_seqlens_q, np.ndarray):  # its values are checked: no cached plan
        return _make_plan(*args)
    values = (o_partial, lse_partial, split_counts, max_splits, out_dtype,
              partials_of(partials), target, backend, cu_seqlens_q, max_seqlen_q)
    plan = _PLANS.find(values)
    if plan is None:
        plan = _PLANS.add(key_of(values), _make_plan(*args), values)
    return plan


def combine(o_partial, lse_partial, split_counts, *, max_splits: int = 32,
            out_dtype=kiln.bf16, partials: Any = None, target: str | None = None,
            backend: str | None = None, out=None, lse_out=None, cu_seqlens_q=None,
            max_seqlen_q: int | None = None):
    """Merge split-KV partials into ``(o [b, q, h, D] out_dtype, lse [b, q, h] f32)``.

    Ragged partials (the module docs' layouts): with ``cu_seqlens_q`` (int32 ``[B + 1]``
    prefix sums over the token rows of ``O_partial [split, total_q, h, D]``), ``split_counts``
    is ``[B, max_seqlen_q, h]`` by position in the sequence and the results are ``o
    [total_q, h, D]``, ``lse [total_q, h]``; ``max_seqlen_q`` (default: ``split_counts``'
    second dimension) sizes the grid, and no sequence may be longer (checked for numpy).
    A producer writing the ``stg128`` depth order says so in ``partials``
    (``Partials(..., depth_order="stg128")``); ``o`` comes out in natural order.

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
    call = _ONE_CALL.call
    if call is not None and not SEPARATE.depth:  # one C call (kiln.kernels.one_call)
        made = call(o_partial, lse_partial, split_counts, max_splits, out_dtype, partials,
                    target, backend, out, lse_out, cu_seqlens_q, max_seqlen_q)
        if made is not None:
            return made
    values = (o_partial, lse_partial, split_counts, max_splits, out_dtype,
              partials if partials is None else partials_of(partials), target, backend,
              cu_seqlens_q, max_seqlen_q)
    guard, plan = _PLANS.last
    if not guard(values):
        plan = _PLANS.find(values)
    if plan is None:  # not a repeat call of a cached shape class
        if dlpack.foreign(o_partial):  # cupy / JAX / DLPack device arrays: zero-copy via torch
            return dlpack.through_torch(combine, o_partial, lse_partial, split_counts,
                                        max_splits=max_splits, out_dtype=out_dtype,
                                        partials=partials, target=target, backend=backend,
                                        out=out, lse_out=lse_out)
        plan = plan_combine(o_partial, lse_partial, split_counts, max_splits=max_splits,
                            out_dtype=out_dtype, partials=partials, target=target,
                            backend=backend, cu_seqlens_q=cu_seqlens_q,
                            max_seqlen_q=max_seqlen_q)
    if plan.device is not None:  # torch tensors on the GPU
        bound = plan.bound
        if out is None and lse_out is None and bound is not None and not plan.ragged:
            o_address = o_partial.data_ptr()
            if not o_address % VECTOR_BYTES:
                # a bound repeat call: one C call makes the outputs, takes the addresses and
                # launches
                _ONE_CALL.install(plan.calls, "combine", lambda: one_call(
                    (o_partial, lse_partial, split_counts, max_splits, out_dtype, partials,
                     target, backend, None, None, cu_seqlens_q, max_seqlen_q),
                    [(bound, [value(0), value(1), value(2), output(0), output(1)])],
                    stream=bound.current_stream, makers=plan.fresh_outputs(lse_partial).fast,
                    aligns=((0, VECTOR_BYTES),)))
                fresh = plan.fresh  # one allocation for o and lse, but in a custom op
                return bound.launch_outputs(fresh.makers if SEPARATE.depth else fresh.fast,
                                            bound.current_stream(),
                                            o_address, lse_partial, split_counts, None, None)
        return plan.run_torch(o_partial, lse_partial, split_counts, out, lse_out, cu_seqlens_q)
    return plan.run_numpy(o_partial, lse_partial, split_counts, out, lse_out, cu_seqlens_q)


_ONE_CALL = OneCallSlot()  # the one-call object of the last bound plan


def compile_combine(dtype=f32, *, head_dim: int = 128, max_splits: int = 32,
                    out_dtype=kiln.bf16, log_base: str = "e", target: str = "sm_90a",
                    config: CombineConfig = WIDE, depth_order: str = "natural",
                    ragged: bool = False):
    """The compiled combine kernel (stages, metadata) for ``dtype`` partials, without running;
    ``config`` picks the schedule (:data:`WIDE`, or a split-parallel one of
    :func:`choose_config`); ``depth_order`` is the partials' (``"natural"`` or ``"stg128"``),
    ``ragged`` compiles the token-ragged kernel.

    Example: ``print(compile_combine("f32", target="gfx950", depth_order="stg128").metadata)``.
    """
    dtype, out_dtype = kiln.dtype(dtype), kiln.dtype(out_dtype)
    if depth_order not in DEPTH_ORDERS:
        raise kiln.KilnValueError(f"depth_order={depth_order!r} is not one of {DEPTH_ORDERS}",
                                  fix="use 'natural' or 'stg128'")
    contract = Partials(producer="compile_combine", max_splits=max_splits, dtype=dtype,
                        log_base=log_base, depth_order=depth_order)
    lead = (1,) if ragged else (1, 1)
    args = (np.zeros((1, *lead, 1, head_dim), dtype.numpy), np.zeros((1, *lead, 1), np.float32),
            np.zeros((1, 1, 1), np.int32), np.zeros((*lead, 1, head_dim), out_dtype.numpy),
            np.zeros((*lead, 1), np.float32))
    args += (np.zeros(2, np.int32), 1) if ragged else (1, 1)
    kernel = lse_merge_ragged if ragged else lse_merge
    return kernel.compile(*args, target=target, num_warps=config.num_warps(target),
                          **_constexprs(head_dim, max_splits, contract, dtype, config))
