"""Threads per block, stated once and vendor-neutral, and a check of the usual index formula.

A block has ``num_warps * warp_size`` threads, and the warp is 32 threads on NVIDIA but 64 on
AMD: ``num_warps=8`` is 256 threads on sm_90a and 512 on gfx950. A kernel whose indexing
assumes a thread count is therefore right on one vendor only, unless the count is given in
threads:

- ``num_threads=256`` (a compile/launch option, like ``num_warps``) asks for 256 threads on
  every target (it must be a multiple of the target's warp size);
- ``@kiln.kernel(num_threads="BLOCK")`` (or an int) declares the kernel's thread count once,
  here tied to its constexpr ``BLOCK``; launches derive the block from it, and a launch asking
  for a different count is a :class:`~kiln.core.errors.KilnValueError`.

``kiln.block_dim(0)`` is the block's thread count as a constant, so indexing written as
``kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)`` follows whatever block the launch
has. When a traced kernel computes ``kiln.block_id(0) * C + kiln.thread_id(0)`` with a constant
``C`` that is not the block's thread count, blocks overlap (``C`` smaller) or leave gaps (``C``
larger); :func:`check_thread_indexing` reports that as a :class:`ThreadCountWarning` at the line.

Example::

    @kiln.kernel(num_threads="BLOCK")
    def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
        ...
    saxpy[(n + 255) // 256](x, y, n, 2.0, BLOCK=256)   # 256 threads on sm_90a and gfx950
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from mlir import ir

from .core.errors import KilnValueError, source_loc_from_mlir

DEFAULT_NUM_WARPS = 4


class ThreadCountWarning(UserWarning):
    """A kernel indexes ``block_id(0) * C + thread_id(0)`` with ``C`` unlike its block size."""


def check_declaration(kernel: str, num_threads: Any, constexprs: tuple[str, ...]) -> None:
    """Validate ``@kiln.kernel(num_threads=...)``: a positive int or a constexpr's name."""
    if num_threads is None or isinstance(num_threads, str) and num_threads in constexprs:
        return
    if isinstance(num_threads, int) and not isinstance(num_threads, bool) and num_threads > 0:
        return
    raise KilnValueError(f"@kiln.kernel(num_threads={num_threads!r}) on {kernel}: expected a "
                         f"positive int or the name of a kiln.constexpr parameter "
                         f"({', '.join(constexprs) or 'the kernel has none'})",
                         fix='e.g. @kiln.kernel(num_threads="BLOCK") with a parameter '
                             "`BLOCK: kiln.constexpr`, or @kiln.kernel(num_threads=256)")


def _threads_to_warps(threads: Any, target, what: str) -> int:
    if isinstance(threads, np.integer):  # a constexpr computed with numpy
        threads = int(threads)
    if (isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0
            or threads % target.warp_size):
        raise KilnValueError(f"{what} is not a positive multiple of {target.name}'s warp size "
                             f"({target.warp_size} threads)",
                             fix=f"use a multiple of {target.warp_size} threads per block")
    return threads // target.warp_size


def resolve_num_warps(kernel: str, declared: Any, constexprs: dict[str, Any], target,
                      num_warps: int | None, num_threads: int | None) -> int:
    """The warps per block of one compile or launch from the kernel's declaration and the
    ``num_warps`` / ``num_threads`` options (at most one of which may be given)."""
    if num_warps is not None and num_threads is not None:
        raise KilnValueError(f"both num_warps={num_warps} and num_threads={num_threads} given",
                             fix="give one: num_threads counts threads on every vendor")
    asked = None
    if num_threads is not None:
        asked = _threads_to_warps(num_threads, target, f"num_threads={num_threads}")
    elif num_warps is not None:
        # trace and interpret get here without CompileOptions, which checks compile's
        if isinstance(num_warps, bool) or not isinstance(num_warps, int) or num_warps < 1:
            raise KilnValueError(f"num_warps must be a positive int, got {num_warps!r}",
                                 fix="e.g. num_warps=4, or num_threads=128 for the same "
                                     "count on every vendor")
        asked = num_warps
    if declared is None:
        return DEFAULT_NUM_WARPS if asked is None else asked
    threads = constexprs[declared] if isinstance(declared, str) else declared
    source = f"num_threads={declared!r}" + (f" (= {threads})" if isinstance(declared, str) else "")
    warps = _threads_to_warps(threads, target, f"{kernel}'s declared {source}")
    if asked is not None and asked != warps:
        raise KilnValueError(
            f"kernel {kernel} declares {source} but the launch asks for {asked} warps "
            f"({asked * target.warp_size} threads on {target.name}, warp size "
            f"{target.warp_size})",
            fix="drop num_warps=/num_threads=: the declaration sets the block size")
    return warps


_CASTS = ("arith.index_cast", "arith.extsi", "arith.extui", "arith.trunci")


def _source(value: ir.Value) -> ir.Operation | None:
    """The op defining ``value``, looking through integer casts (None for block arguments)."""
    while True:
        owner = value.owner
        if not isinstance(owner, ir.OpView) and not isinstance(owner, ir.Operation):
            return None
        op = owner.operation
        if op.name not in _CASTS:
            return op
        value = op.operands[0]


def _is_id_x(op: ir.Operation | None, name: str) -> bool:
    return op is not None and op.name == name and str(op.attributes["dimension"]).endswith("x>")


def _block_stride(op: ir.Operation | None) -> int | None:
    """``C`` when ``op`` is ``block_id(0) * C`` with a constant ``C``."""
    if op is None or op.name != "arith.muli":
        return None
    a, b = (_source(v) for v in op.operands)
    for ids, const in ((a, b), (b, a)):
        if _is_id_x(ids, "gpu.block_id") and const is not None and const.name == "arith.constant":
            return ir.IntegerAttr(const.attributes["value"]).value
    return None


def _index_sums(thread_ids: list[ir.Value]) -> list[ir.Operation]:
    """The ``arith.addi`` ops with an operand ``_source`` traces to one of ``thread_ids``,
    found forward through their uses (a walk of the whole module cost ten times more)."""
    sums, pending, seen = [], list(thread_ids), set()
    while pending:
        for use in pending.pop().uses:
            op = use.owner.operation
            if op.name in _CASTS:
                pending.extend(op.results)
            elif op.name == "arith.addi" and op not in seen:
                seen.add(op)
                sums.append(op)
    return sums


def check_thread_indexing(thread_ids: list[ir.Value], kernel: str, block_threads: int, target,
                          num_warps: int) -> None:
    """Warn at each ``block_id(0) * C + thread_id(0)`` whose ``C`` is not ``block_threads``;
    ``thread_ids`` are the trace's ``gpu.thread_id x`` results."""
    found = []
    for op in _index_sums(thread_ids):
        a, b = (_source(v) for v in op.operands)
        for prod, tid in ((a, b), (b, a)):
            stride = _block_stride(prod)
            if stride is not None and stride != block_threads and _is_id_x(tid, "gpu.thread_id"):
                found.append((op.location, stride))
    for location, stride in found:
        what = ("consecutive blocks overlap, so threads of two blocks get the same index"
                if stride < block_threads else
                f"indices {block_threads}..{stride - 1} of each block's range are never reached")
        message = (f"kernel {kernel} indexes kiln.block_id(0) * {stride} + kiln.thread_id(0) but "
                   f"its blocks have {block_threads} threads ({num_warps} warps of "
                   f"{target.warp_size} on {target.name}): {what}. Fix: index with "
                   f"kiln.block_dim(0), and declare the thread count once with "
                   f"@kiln.kernel(num_threads=...) or launch with num_threads={stride}")
        loc = source_loc_from_mlir(location)
        if loc is None:
            warnings.warn(message, ThreadCountWarning, stacklevel=2)
        else:
            warnings.warn_explicit(message, ThreadCountWarning, loc.filename, loc.line)
