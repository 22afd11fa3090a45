"""``kiln-insert-waits``: place the fewest counter waits that make every async read safe.

The analysis is :mod:`kiln.passes.wait_analysis` (shared with ``kiln-verify-waits``; what is
tracked, what counts as a read, where a wait goes). This pass runs it with placement on: every
gap is closed where it is found by the loosest wait that covers it (``vmcnt(N)`` with N the
event's younger same-counter events), and the wait is applied to the state at once, so later
reads are checked against it. One walk places every wait; a second walk confirms nothing is
left (it places nothing unless a loop body's new wait changed what flows across a back-edge,
which can only retire more). Cost: a few walks of the function, linear in its ops times the
outstanding events (the gfx950 prefill kernel: about 0.1 s).

Waits already in the IR (``rocdl.s.waitcnt``, ``nvgpu.device_async_wait``, ``amdgpu.lds_barrier``,
``nvvm.wgmma.wait.group.sync.aligned``, ``nvgpu.mbarrier.try_wait.parity``) are kept and counted.
NVIDIA: ``wgmma.wait_group N`` before a consumer of a committed ``mma_async`` result, and a
``mbarrier.try_wait.parity`` with the statically known phase before a read of a TMA-loaded
buffer (:func:`static_phase`; unknown phase: ``WaitError`` naming the barrier). Under ``kiln.consumer_drain`` (or a recipe's ``drain``) every cluster that
holds MFMA work opens with ``s_waitcnt lgkmcnt(0)``. Functions marked ``kiln.manual_waits`` are
left alone (the verifier still checks them).

Example::

    rocdl.global.load.lds %g, %lds, 16, 0, 0 : !llvm.ptr<1>    // DMA into @tile
    rocdl.global.load.lds %g2, %lds2, 16, 0, 0 : !llvm.ptr<1>  // DMA into @other
    // inserted: rocdl.s.waitcnt 3953   (vmcnt(1): one younger DMA may stay in flight)
    %x = memref.load %tile[%i] : memref<256xf32, 3>
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, nvgpu, nvvm, rocdl

from kiln.core.errors import InternalError, WaitError, source_loc_from_mlir
from kiln.nvidia.mbarrier import DEFAULT_TICKS
from kiln.passes import register_pass
from kiln.passes.cluster_schedule import cluster_spans, recipes_of
from kiln.passes.enclosing import enclosing_gpu_func, enclosing_loops, func_vendor, gpu_funcs, where
from kiln.passes.verify_waits import gap_error
from kiln.passes.wait_analysis import (CP_ASYNC, MBARRIER, WGMMA, Gap, WaitAnalysis,
                                       encode_gfx9_waitcnt, is_mbarrier_wait, mbarrier_of,
                                       op_counter, op_label, same_mbarrier, wait_limits)

NAME = "kiln-insert-waits"
# Placement converges in two walks (see above); more means the analysis is wrong.
MAX_ROUNDS = 4


def _in_loop(op: ir.Operation) -> bool:
    return bool(enclosing_loops(op))


def static_phase(tma_load: ir.Operation) -> int | None:
    """The parity of the phase a TMA load completes, when the program fixes it: the load and
    every earlier try_wait on its mbarrier (constant index) are outside loops, so the phase is
    the number of those waits, mod 2. None otherwise."""
    signal = mbarrier_of(tma_load)
    if signal[1] is None or _in_loop(tma_load):
        return None
    func = enclosing_gpu_func(tma_load)
    earlier, done = [], []

    def visit(op):
        if op == tma_load:
            done.append(op)
            return ir.WalkResult.INTERRUPT
        if is_mbarrier_wait(op) and same_mbarrier(mbarrier_of(op), signal):
            earlier.append(op)
        return ir.WalkResult.ADVANCE

    func.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if any(_in_loop(op) for op in earlier):
        return None
    return len(earlier) % 2


def later_phase_load(event: ir.Operation, place_before: ir.Operation) -> ir.Operation | None:
    """A TMA load other than ``event`` that may complete a later phase of ``event``'s mbarrier
    before a wait placed before ``place_before`` runs: one between them in program order, or
    one in a loop around ``place_before``. A wait for ``event``'s phase parity there could
    then wait for a later phase of the same parity, which may never come."""
    signal = mbarrier_of(event)
    stop = place_before.operation
    func = enclosing_gpu_func(event)
    found, started = [], []

    def later(op):
        return (op != event and op_counter(op) == MBARRIER
                and same_mbarrier(mbarrier_of(op), signal))

    def visit(op):
        if op == stop:
            return ir.WalkResult.INTERRUPT
        if op == event:
            started.append(op)
        elif started and later(op):
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    def anywhere(op):
        if later(op):
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    func.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    for loop in enclosing_loops(stop):
        if found:
            break
        loop.walk(anywhere, ir.WalkOrder.PRE_ORDER)
    return found[0] if found else None


def _wait_error(gap: Gap, what: str, fix: str) -> WaitError:
    return WaitError(f"this {op_label(gap.reader)} may read before the {op_label(gap.event)} at "
                     f"{where(gap.event)} {what}", fix=fix, loc=source_loc_from_mlir(gap.reader.location))


def _build_mbarrier_wait(gap: Gap) -> None:
    barriers, index = mbarrier_of(gap.event)
    phase = static_phase(gap.event)
    if phase is None:
        raise _wait_error(gap, "lands, and the phase of its mbarrier is not known statically",
                          f"wait on mbarrier {index if index is not None else '(computed index)'} "
                          "of its group before the read: barriers.try_wait(i, phase), or a "
                          "kiln.mbarrier.PhaseTracker in loops")
    later = later_phase_load(gap.event, gap.place_before)
    if later is not None:
        raise _wait_error(gap, f"lands, and the {later.name} at {where(later)} may "
                          f"complete a later phase of its mbarrier first, so a wait for parity "
                          f"{phase} here could wait for a phase that never comes",
                          "wait for the load before the later loads on its mbarrier (e.g. "
                          "before the loop that issues them): barriers.try_wait(i, phase)")
    index_type = ir.IndexType.get()
    nvgpu.mbarrier_try_wait_parity(barriers, arith.constant(ir.IntegerType.get_signless(1), phase),
                                   arith.constant(index_type, DEFAULT_TICKS),
                                   arith.constant(index_type, index))


def _dominating_group(gap: Gap) -> ir.Value:
    """A cp.async group token defined before ``gap.place_before``: the event's own where it
    dominates the wait, else a group committed earlier in the wait's block or an
    enclosing one. The wait's count says what it retires (the token is only an operand); a
    group from a later iteration of a loop (a software pipeline's next stage) does not dominate
    the wait, so an earlier one stands in."""
    nearest = None
    op = gap.place_before
    while op is not None and op.name != "gpu.func":
        for candidate in op.block.operations:
            candidate = candidate.operation
            if candidate == op:
                break
            if candidate == gap.event:
                return gap.event.result
            if nearest is None and candidate.name == gap.event.name:
                nearest = candidate
        op = op.parent
    if nearest is None:
        raise gap_error(gap)
    return nearest.result


def build_wait(gap: Gap) -> None:
    """Build the wait that closes ``gap`` before ``gap.place_before``, at the reader's location."""
    if gap.overwrite:  # the phase of the readers' hand-over is the program's to compute
        raise gap_error(gap)
    with ir.InsertionPoint(gap.place_before), gap.reader.location:
        if gap.counter == CP_ASYNC:
            nvgpu.device_async_wait(_dominating_group(gap), num_groups=gap.count)
        elif gap.counter == WGMMA:
            if gap.count < 0:
                raise _wait_error(gap, "is committed (no wgmma.wait_group can cover it)",
                                  "call kiln.wgmma.commit() after the last mma_async, then "
                                  "read the accumulator")
            nvvm.wgmma_wait_group_sync_aligned(gap.count)
        elif gap.counter == MBARRIER:
            _build_mbarrier_wait(gap)
        else:
            rocdl.s_waitcnt(encode_gfx9_waitcnt(**{gap.counter: gap.count}))


def _insert_drains(func: ir.Operation) -> None:
    recipes = recipes_of(func)
    drain_all = "kiln.consumer_drain" in func.attributes
    for span in cluster_spans(func):
        recipe = recipes.get(span.cluster)
        if not (drain_all and span.has_mma() or recipe is not None and recipe.drain_lgkm):
            continue
        first = span.first_work_op()
        if first is not None and wait_limits(first) != {"lgkmcnt": 0}:
            with ir.InsertionPoint(first), first.location:
                drain = rocdl.s_waitcnt(encode_gfx9_waitcnt(lgkmcnt=0))
            drain.operation.attributes["kiln.cluster"] = first.attributes["kiln.cluster"]


def insert_waits(module_op: ir.Operation, pass_=None) -> None:
    """Place the waits that close every gap, in every gpu.func not marked manual."""
    for func in gpu_funcs(module_op):
        vendor = func_vendor(func)
        if vendor is None or "kiln.manual_waits" in func.attributes:
            continue
        if vendor == "amd":
            _insert_drains(func)
        for _ in range(MAX_ROUNDS):
            if not WaitAnalysis(func, place=build_wait).placed:
                break
        else:
            raise InternalError(
                f"kiln-insert-waits did not converge in {MAX_ROUNDS} rounds on "
                f"{ir.StringAttr(func.attributes['sym_name']).value}",
                fix="set KILN_DUMP_DIR and attach the kernel's .gpu.mlir to the report")


register_pass(NAME, insert_waits,
              "Insert the fewest s_waitcnt / cp.async / wgmma / mbarrier waits covering every async read")
