"""``kiln-insert-waits``: place the fewest counter waits that make every async read safe.

The analysis is :mod:`kiln.passes.wait_analysis` (shared with ``kiln-verify-waits``; what is
tracked, what counts as a read, where a wait goes). This pass runs it with placement on: every
gap is closed where it is found by the loosest wait that covers it (``vmcnt(N)`` with N the
event's younger same-counter events), and the wait is applied to the state at once, so later
reads are checked against it. One walk places every wait; a second walk confirms nothing is
left (it places nothing unless a loop body's new wait changed what flows across a back-edge,
which can only retire more). Cost: a few walks of the function, linear in its ops times the
outstanding events (the gfx950 prefill kernel: about 0.1 s).

Waits already in the IR (``rocdl.s.waitcnt``, ``nvgpu.device_async_wait``, ``amdgpu.lds_barrier``)
are kept and counted. Under ``kiln.consumer_drain`` (or a recipe's ``drain``) every cluster that
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
from mlir.dialects import nvgpu, rocdl

from kiln.errors import InternalError
from kiln.passes import register_pass
from kiln.passes.wait_analysis import CP_ASYNC, Gap, WaitAnalysis, encode_gfx9_waitcnt, wait_limits

NAME = "kiln-insert-waits"
MMA_PREFIXES = ("amdgpu.mfma", "amdgpu.scaled_mfma", "rocdl.mfma", "amdgpu.wmma",
                "nvgpu.warpgroup.mma", "nvvm.wgmma.mma_async")
# Placement converges in two walks (see above); more means the analysis is wrong.
MAX_ROUNDS = 4


def func_vendor(func: ir.Operation) -> str | None:
    """``"amd"``/``"nvidia"`` from ``kiln.target``, the gpu.module target, or the ops used."""
    if "kiln.target" in func.attributes:
        return "nvidia" if ir.StringAttr(func.attributes["kiln.target"]).value.startswith("sm_") else "amd"
    module = func.parent.operation if func.parent is not None else None
    if module is not None and "targets" in module.attributes:
        text = str(module.attributes["targets"])
        if "rocdl" in text or "nvvm" in text:
            return "amd" if "rocdl" in text else "nvidia"
    seen = []

    def visit(op):
        if op.name.startswith(("rocdl.", "amdgpu.")):
            seen.append("amd")
        elif op.name.startswith(("nvgpu.", "nvvm.")):
            seen.append("nvidia")
        return ir.WalkResult.ADVANCE

    func.walk(visit, ir.WalkOrder.PRE_ORDER)
    return seen[0] if seen else None


def gpu_funcs(module_op: ir.Operation) -> list[ir.Operation]:
    funcs = []

    def visit(op):
        if op.name == "gpu.func":
            funcs.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    module_op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return funcs


def build_wait(gap: Gap) -> None:
    """Build the wait that closes ``gap`` before ``gap.place_before``, at the reader's location."""
    with ir.InsertionPoint(gap.place_before), gap.reader.location:
        if gap.counter == CP_ASYNC:
            nvgpu.device_async_wait(gap.event.result, num_groups=gap.count)
        else:
            rocdl.s_waitcnt(encode_gfx9_waitcnt(**{gap.counter: gap.count}))


def _insert_drains(func: ir.Operation) -> None:
    from kiln.passes.cluster_schedule import cluster_spans, recipes_of

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
              "Insert the fewest s_waitcnt / cp.async waits covering every async read")
