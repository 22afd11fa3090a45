"""``kiln-insert-waits``: place the fewest counter waits that make every async read safe.

The analysis is :mod:`kiln.passes.wait_analysis` (shared with ``kiln-verify-waits``; what is
tracked, what counts as a read, where a wait goes). This pass runs it with placement on: every
gap is closed where it is found by the loosest wait that covers it (``vmcnt(N)`` with N the
event's younger same-counter events), and the wait is applied to the state at once, so later
reads are checked against it. One walk places every same-thread wait, every producer's
empty-ring wait before a TMA load (each found as if those before it were built: a wait before
an arm hands the buffer back for that arm's loads, and changes no arm's count) and the first
consumer's cross-thread (mbarrier hand-over) wait, whose use count depends on the waits before
it; further walks place the rest, and the last confirms nothing is left (a loop body's new wait
may change what flows across a back-edge, which can only retire more). Every walk but the last
closes a gap no earlier walk closed, among the pairs (read, async op) of the function as it
came (a placed wait and its index arithmetic read no async result), so the walks end; a gap
found again after its wait was placed is a compiler bug, reported at once. Cost: a few walks
of the function, linear in its ops times the outstanding events (the gfx950 prefill kernel:
about 0.1 s; the attention tutorial's TMA pipeline, 42 waits: about 1.4 s).

Waits already in the IR (``rocdl.s.waitcnt``, ``nvgpu.device_async_wait``, ``amdgpu.lds_barrier``,
``nvvm.wgmma.wait.group.sync.aligned``, ``nvgpu.mbarrier.try_wait.parity``) are kept and counted.
NVIDIA: ``wgmma.wait_group N`` before a consumer of a committed ``mma_async`` result; before a
read of a TMA-loaded buffer, a ``mbarrier.try_wait.parity`` for the use the reading thread
acquires next, and before a TMA load that may overwrite a buffer other threads read, a wait on
the paired empty ring for the release of that slot's previous use. Slot and parity are derived
by counting the ring's uses along the thread's path (:mod:`kiln.passes.mbarrier_rings`); where
no count is derived the pass refuses with a ``WaitError`` naming the load. Under
``kiln.consumer_drain`` (or a recipe's ``drain``) every cluster that holds MFMA work opens with
``s_waitcnt lgkmcnt(0)``. Functions marked ``kiln.manual_waits`` are
left alone (the verifier still checks them).

Example::

    rocdl.global.load.lds %g, %lds, 16, 0, 0 : !llvm.ptr<1>    // DMA into @tile
    rocdl.global.load.lds %g2, %lds2, 16, 0, 0 : !llvm.ptr<1>  // DMA into @other
    // inserted: rocdl.s.waitcnt 3953   (vmcnt(1): one younger DMA may stay in flight)
    %x = memref.load %tile[%i] : memref<256xf32, 3>
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from mlir import ir
from mlir.dialects import nvgpu, nvvm, rocdl

from kiln.core.errors import InternalError, WaitError, source_loc_from_mlir
from kiln.core.profile import gc_paused
from kiln.passes import register_pass
from kiln.passes.cluster_schedule import cluster_spans, recipes_of
from kiln.passes.enclosing import enclosing_gpu_func, enclosing_loops, func_vendor, gpu_funcs, where
from kiln.nvidia.mbarrier import RING_PAIR_ATTR
from kiln.passes.mbarrier_rings import Rings, build_wait as build_ring_wait
from kiln.passes.verify_waits import gap_error
from kiln.passes.op_queries import op_label, wait_limits
from kiln.passes.wait_analysis import (CP_ASYNC, MBARRIER, WGMMA, Gap, WaitAnalysis,
                                       encode_gfx9_waitcnt)

NAME = "kiln-insert-waits"


def _wait_error(gap: Gap, what: str, fix: str) -> WaitError:
    return WaitError(f"this {op_label(gap.reader)} may read before the {op_label(gap.event)} at "
                     f"{where(gap.event)} {what}", fix=fix, loc=source_loc_from_mlir(gap.reader.location))


def _refuse(gap: Gap, load: ir.Operation, what: str, fix: str) -> WaitError:
    return WaitError(f"kiln-insert-waits cannot derive the mbarrier wait for the "
                     f"{op_label(load)} at {where(load)}: {what}", fix=fix,
                     loc=source_loc_from_mlir(gap.reader.location))


def _build_full_wait(gap: Gap) -> None:
    """A read of a TMA-loaded buffer: wait on the load's ring for the use the reading thread
    acquires next (its count of waits on that ring, the new one included), placed before the
    read or, hoisted, before the op around it that runs once per use."""
    func = enclosing_gpu_func(gap.event)
    base = Rings(func)
    unit = base.unit_of(gap.event)
    point = gap.place_before
    if _dominating_wait(base, point, unit, gap.event):  # placed this walk, before the arms it was found in
        return
    while True:
        rings = Rings(func, virtual=(point, unit), like=base)
        loops = enclosing_loops(point)
        if rings.virtual_count is not None and (
                not loops or rings.steps.get((loops[0], (unit, "wait"))) == 1):
            break
        parent = point.parent
        if parent is None or parent.operation.name == "gpu.func" or _within(
                gap.event, parent.operation) or (parent.operation.name == "scf.if" and any(
                    _within(op, parent.operation) for op, ring in rings.ops
                    if ring[1] == unit and ring[0] in ("arm", "fill"))):  # the producer's side
            raise _refuse(gap, gap.event, "the reading thread's uses of its ring are not "
                          "counted (no loop of one wait per iteration holds the read)",
                          "wait for it by hand before the read, "
                          "kiln.mbarrier.PhaseTracker(barriers).wait(use)")
        point = parent.operation
    point, rings = _hoist_out_of_ifs(func, unit, point, rings, base)
    with ir.InsertionPoint(point), gap.reader.location:
        build_ring_wait(unit, rings.virtual_count, rings.stages[unit], 0)


def _hoist_out_of_ifs(func, unit, point, rings, base):
    """Move a wait for a use whose ring is armed only outside loops (a Q tile) before the
    ``scf.if`` ops around it that hold no other op of its ring (never past the producer's
    side), so reads after them are covered too; the count there is the same. That the use is
    armed at all is the program's (a missing arm hangs: the interpreter reports it)."""
    arms = [op for op, ring in rings.ops if ring[1] == unit and ring[0] in ("arm", "fill")]
    if any(enclosing_loops(op) for op in arms) or not rings.virtual_count.is_const:
        return point, rings
    while point.parent is not None and point.parent.operation.name == "scf.if":
        outer = point.parent.operation
        inside = [op for op, ring in rings.ops if ring[1] == unit and _within(op, outer)]
        hoisted = Rings(func, virtual=(outer, unit), like=base)
        if inside or hoisted.virtual_count != rings.virtual_count:
            break
        point, rings = outer, hoisted
    return point, rings


def _within(op: ir.Operation, outer: ir.Operation) -> bool:
    parent = op.parent
    while parent is not None:
        if parent.operation == outer:
            return True
        parent = parent.operation.parent
    return False


def _dominating_wait(rings: Rings, point: ir.Operation, unit, event) -> bool:
    """Whether a wait on ``unit`` runs after ``event`` and before ``point`` in a block around
    ``point``, inside the innermost loop (an earlier iteration's wait acquired an earlier use)."""
    waits = {op for op, ring in rings.ops if ring[0] == "wait" and ring[1] == unit}
    op = point
    while op is not None and op.name != "gpu.func":
        found = False
        for view in op.block.operations:
            if view.operation == op:
                break
            if view.operation in waits:
                found = True
            elif view.operation == event or _within(event, view.operation):
                found = False  # a wait before the load does not cover it
        if found:
            return True
        op = op.parent.operation if op.parent is not None else None
        if op is not None and op.name == "scf.for":  # this iteration's waits only
            return False
    return False


def _paired(unit):
    """The ``kiln.ring_pair`` id on a ring unit's ``mbarrier.create`` (kiln.tile_tma pairs each
    tile's full and empty barriers so), else None."""
    group = unit[0] if isinstance(unit, tuple) else unit
    owner = group.owner
    if isinstance(owner, ir.Block) or RING_PAIR_ATTR not in owner.operation.attributes:
        return None
    return ir.IntegerAttr(owner.operation.attributes[RING_PAIR_ATTR]).value


def _empty_group(rings: Rings, full):
    """The empty ring paired with ``full``: the one whose create names the same
    ``kiln.ring_pair``, else the one empty ring whose waits guard no other ring's arms, else
    None."""
    pair = _paired(full)
    if pair is not None:
        found = [g for g in rings.empty if _paired(g) == pair]
        return found[0] if len(found) == 1 else None
    taken = set()
    for op, ring in rings.ops:
        if ring[0] == "wait" and ring[1] in rings.empty:
            arm = rings.guarded_arm(op)
            if arm is not None and arm[1][1] != full:
                taken.add(ring[1])
    left = [g for g in rings.empty if g not in taken]
    return left[0] if len(left) == 1 else None


def _build_empty_wait(gap: Gap) -> None:
    """A TMA load that may overwrite a buffer others read: before the arm of its use n, wait on
    the paired empty ring for the release of use n - S (slot n % S, parity (n // S + 1) % 2),
    n being the arm's count on its thread's path."""
    load = gap.reader
    rings = Rings(enclosing_gpu_func(load))
    unit = rings.unit_of(load)
    arms = {op for op, ring in rings.ops if ring[0] == "arm" and ring[1] == unit}
    arm = None
    for view in load.block.operations:
        if view.operation == load:
            break
        if view.operation in arms:
            arm = view.operation
    count = rings.counts.get(arm) if arm is not None else None
    empty = _empty_group(rings, unit)
    if empty is None or rings.stages[empty] != rings.stages[unit]:
        raise gap_error(gap)  # no ring the readers hand the buffer back on: nothing to wait for
    if arm is None or count is None:
        raise _refuse(gap, load, "the arm (arrive_expect_tx) that opens its use is not counted "
                      "on its thread's path (arms under conditions that loop counts do not "
                      "express)", "wait on the ring's empty barrier by hand before the arm: "
                      "empty.try_wait(n % S, (n // S + 1) % 2) for use n")
    with ir.InsertionPoint(arm), load.location:
        build_ring_wait(empty, count, rings.stages[unit], 1)


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
    if gap.overwrite:
        _build_empty_wait(gap)
        return
    if gap.counter == MBARRIER:
        _build_full_wait(gap)
        return
    with ir.InsertionPoint(gap.place_before), gap.reader.location:
        if gap.counter == CP_ASYNC:
            nvgpu.device_async_wait(_dominating_group(gap), num_groups=gap.count)
        elif gap.counter == WGMMA:
            if gap.count < 0:
                raise _wait_error(gap, "is committed (no wgmma.wait_group can cover it)",
                                  "call kiln.wgmma.commit() after the last mma_async, then "
                                  "read the accumulator")
            nvvm.wgmma_wait_group_sync_aligned(gap.count)
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


_RECORDING = threading.local()  # .proved: the set recording_proofs() gives, per thread


@contextmanager
def recording_proofs() -> Iterator[set]:
    """Within it, this thread's ``kiln-insert-waits`` runs add to the set it yields each
    ``gpu.func`` (the op) whose last walk found no gap, so kiln-verify-waits' walk of the
    unchanged function would only repeat that proof. Example::

        with recording_proofs() as proved:
            pm.run(module.operation)    # a pipeline ending in kiln-insert-waits
    """
    previous = getattr(_RECORDING, "proved", None)
    _RECORDING.proved = proved = set()
    try:
        yield proved
    finally:
        _RECORDING.proved = previous


def insert_waits(module_op: ir.Operation, pass_=None) -> None:
    """Place the waits that close every gap, in every gpu.func not marked manual."""
    proved = getattr(_RECORDING, "proved", None)
    for func in gpu_funcs(module_op):
        vendor = func_vendor(func)
        if vendor is None or "kiln.manual_waits" in func.attributes:
            continue
        if vendor == "amd":
            _insert_drains(func)
        with gc_paused():
            _place_all(func, proved)


def _place_all(func: ir.Operation, proved: set | None) -> None:
    """Walk ``func`` until a walk places no wait (then, with ``proved``, record it there)."""
    closed: set = set()  # the gaps earlier walks placed waits for
    while True:
        found: list = []
        if not WaitAnalysis(func, place=lambda gap: _place_new(gap, closed, found)).placed:
            if proved is not None:  # no gap left: proved
                proved.add(func)
            return
        closed.update(found)


def _place_new(gap: Gap, closed: set, found: list) -> None:
    """Build the wait for ``gap`` unless an earlier walk already built one for it (then the
    analysis does not see its own waits: an InternalError, not another walk)."""
    key = (gap.reader, gap.event, gap.counter, gap.overwrite, gap.release, gap.rewrite)
    if key in closed:
        func = enclosing_gpu_func(gap.reader)
        raise InternalError(
            f"kiln-insert-waits found the gap of the {op_label(gap.reader)} at "
            f"{where(gap.reader)} again after placing its wait, in "
            f"{ir.StringAttr(func.attributes['sym_name']).value}",
            fix="set KILN_DUMP_DIR and attach the kernel's .gpu.mlir to the report")
    found.append(key)
    build_wait(gap)


register_pass(NAME, insert_waits,
              "Insert the fewest s_waitcnt / cp.async / wgmma / mbarrier waits covering every async read")
