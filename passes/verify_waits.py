"""``kiln-verify-waits``: prove that every async read is covered by a wait on every path.

It runs :mod:`kiln.passes.wait_analysis` (docs/passes.md) over each ``gpu.func`` without
changing anything: waits already in the IR retire events, and a read that still finds its
event outstanding, or a DMA-written LDS buffer not yet retired, is a gap. The first gap raises
:class:`kiln.core.errors.WaitError` at the Python line of the read, naming the event and the wait
that would cover it. After ``kiln-insert-waits`` there is never a gap unless the kernel opted
out with ``kiln.manual_waits()``; the same proof is repeated on the final AMDGPU assembly by
:func:`kiln.lowering.isa_amdgpu.verify_waits`.

Example (a DMA into ``@tile`` read with no wait)::

    kiln.core.errors.WaitError: k.py:12: this memref.load may read before the async
    rocdl.global.load.lds at k.py:10 lands (vmcnt): no wait covers it on every path
    Fix: add s_waitcnt(vmcnt=0) before the read, or drop kiln.manual_waits() to let Kiln insert it
"""

from __future__ import annotations

from mlir import ir

from kiln.core.errors import WaitError, source_loc_from_mlir
from kiln.core.profile import gc_paused
from kiln.passes import register_pass
from kiln.passes.enclosing import func_vendor, gpu_funcs, where
from kiln.passes.mbarrier_rings import ring_errors
from kiln.passes.op_queries import mbarrier_of, op_label
from kiln.passes.wait_analysis import CP_ASYNC, MBARRIER, WGMMA, Gap, WaitAnalysis


NAME = "kiln-verify-waits"
RINGS_NAME = "kiln-verify-rings"


def gap_error(gap: Gap) -> WaitError:
    """The WaitError for one uncovered read, at the read's user location."""
    if gap.overwrite:
        return WaitError(
            f"this {op_label(gap.reader)} may overwrite the buffer that the "
            f"{op_label(gap.event)} at {where(gap.event)} reads in other threads, before they "
            "hand it back: no wait on an mbarrier the readers arrive on (or block-wide "
            "barrier after their reads) precedes it",
            fix="wait on the buffer's empty mbarrier right before the load: "
                "empty.try_wait(stage, phase)",
            loc=source_loc_from_mlir(gap.reader.location))
    if gap.release:
        return WaitError(
            f"this {op_label(gap.reader)} hands back a buffer before the async "
            f"{op_label(gap.event)} at {where(gap.event)} that may read it is retired (wgmma): "
            f"no wait leaves at most {gap.count} WGMMA group(s) in flight on every path (its "
            "declared wgmma_pending, or fewer where a younger group reads the buffer)",
            fix=f"add kiln.wgmma.wait_group({gap.count}) before the arrive, or drop "
                "kiln.manual_waits() to let Kiln insert it",
            loc=source_loc_from_mlir(gap.reader.location))
    if gap.rewrite:
        return WaitError(
            f"this {op_label(gap.reader)} may overwrite a buffer that the {op_label(gap.event)} "
            f"at {where(gap.event)} still reads: no wgmma.wait_group retires it before the "
            "barrier that precedes the copies, so another warpgroup's may still be in flight",
            fix=f"add kiln.wgmma.wait_group({max(gap.count, 0)}) before that barrier, or drop "
                "kiln.manual_waits() to let Kiln insert it",
            loc=source_loc_from_mlir(gap.reader.location))
    if gap.counter == WGMMA and gap.count < 0:
        return WaitError(
            f"this {op_label(gap.reader)} reads the result of the {op_label(gap.event)} at "
            f"{where(gap.event)} before it is committed: no wgmma.wait_group can cover it",
            fix="call kiln.wgmma.commit() after the last mma_async, then kiln.wgmma.wait_group(0)",
            loc=source_loc_from_mlir(gap.reader.location))
    if gap.counter == MBARRIER:
        index = mbarrier_of(gap.event)[1]
        wait = (f"a try_wait on mbarrier {index if index is not None else '(computed index)'} "
                "of the load's group (kiln.mbarrier.PhaseTracker.wait in loops)")
    elif gap.counter == WGMMA:
        wait = f"kiln.wgmma.wait_group({gap.count})"
    elif gap.counter == CP_ASYNC:
        wait = f"nvgpu.device_async_wait {{numGroups = {gap.count}}}"
    else:
        wait = f"s_waitcnt({gap.counter}={gap.count})"
    return WaitError(
        f"this {op_label(gap.reader)} may read before the async {op_label(gap.event)} at "
        f"{where(gap.event)} "
        f"lands ({gap.counter}): no wait covers it on every path",
        fix=f"add {wait} before the read, or drop kiln.manual_waits() to let Kiln insert it",
        loc=source_loc_from_mlir(gap.reader.location))


def ring_error(op: ir.Operation, why: str) -> WaitError:
    """The WaitError for an mbarrier wait (or arm) that names the wrong use of its ring."""
    return WaitError(f"this {op_label(op)} waits for the wrong phase of its mbarrier ring: {why}",
                     fix="wait for use n on slot n % S with parity (n // S) % 2 (on an empty "
                         "ring before use n's arm: (n // S + 1) % 2), e.g. "
                         "kiln.mbarrier.PhaseTracker(barriers).wait(n)",
                     loc=source_loc_from_mlir(op.location))


def verify_waits(module_op: ir.Operation, pass_=None) -> None:
    """Raise WaitError for the first uncovered async read, or mbarrier wait on the wrong
    slot or parity (:mod:`kiln.passes.mbarrier_rings`), in any gpu.func."""
    for func in gpu_funcs(module_op):
        if func_vendor(func) is None:
            continue
        with gc_paused():
            gaps = WaitAnalysis(func).gaps
            wrong = [] if gaps else ring_errors(func)
        if gaps:
            raise gap_error(gaps[0])
        if wrong:
            raise ring_error(*wrong[0])


def verify_rings(module_op: ir.Operation, pass_=None) -> None:
    """:func:`verify_waits`' mbarrier ring proof alone: what remains to prove of a function
    whose ``kiln-insert-waits`` run ended in a walk that found no gap (the compile pipeline
    runs this instead of ``kiln-verify-waits`` for such modules)."""
    for func in gpu_funcs(module_op):
        if func_vendor(func) is None:
            continue
        with gc_paused():
            wrong = ring_errors(func)
        if wrong:
            raise ring_error(*wrong[0])


register_pass(NAME, verify_waits, "Prove every async read is covered by a wait (WaitError if not)")
register_pass(RINGS_NAME, verify_rings,
              "Prove every mbarrier wait names its ring's slot and parity (WaitError if not)")
