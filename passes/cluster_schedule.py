"""``kiln-cluster-schedule``: turn ``kiln.cluster`` annotations into scheduling fences and hints.

For every cluster instance (a maximal run of ops tagged ``kiln.cluster = k`` in one block) of a
``gpu.func`` whose ``kiln.cluster_recipes`` holds recipe ``c<k>`` (see ``kiln.cluster``):

AMD (``kiln.target = "gfx9.."``)::

    rocdl.sched.barrier 0                  // nothing is scheduled across a cluster boundary
    rocdl.sched.group.barrier 0, 0, 0x4B0000+k    // begin marker, visible in the assembly
    rocdl.sched.barrier 0
    rocdl.s.setprio P                      // recipe.priority
    ...the cluster's ops...
    rocdl.sched.group.barrier M, n, k      // one per interleave group, in order (or rocdl.iglp.opt)
    rocdl.sched.barrier 0                  // no work sinks below the priority drop / barrier
    rocdl.s.setprio 0
    rocdl.s.barrier                        // recipe.barrier_at_end
    rocdl.sched.barrier 0
    rocdl.sched.group.barrier 0, 0, 0x4B8000+k    // end marker
    rocdl.sched.barrier 0

NVIDIA: the cluster-ending barrier is ``gpu.barrier`` (``bar.sync 0``); recipes with an
interleave or iglp variant are rejected (NVPTX has no sched-group intrinsics). A recipe's
``pingpong=(a, b)`` makes two consumer warp groups alternate through named barriers::

    bar.sync own, 256       // own = a for even tid.x // 128, b for odd
    ...the cluster's ops...
    bar.arrive other, 256   // once before the loop, the odd group arrives on a

The pass moves no op: ops stay in program order inside their cluster, and the ``sched.barrier 0``
fences keep LLVM's machine scheduler from moving any across a boundary. Every op it adds is
tagged with its cluster, so later passes (``kiln-insert-waits``) see the same spans.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, gpu, llvm, rocdl, scf

from kiln.cluster import CLUSTER_ATTR, RECIPES_ATTR, SCHED_GROUP_MASKS, ClusterRecipe
from kiln.core.errors import (CompilationError, KilnValueError, UnsupportedError,
                              source_loc_from_mlir)
from kiln.passes import register_pass
from kiln.passes.enclosing import MMA_PREFIXES, enclosing_loops, func_vendor, gpu_funcs


NAME = "kiln-cluster-schedule"
MARKER_ATTR = "kiln.cluster_marker"
_FENCE_OPS = ("rocdl.sched.barrier", "rocdl.s.setprio", "rocdl.sched.group.barrier",
              "rocdl.iglp.opt")


@dataclass
class ClusterSpan:
    """One instance of cluster ``cluster``: its ops, in order, in one block."""

    cluster: int
    ops: list

    def has_mma(self) -> bool:
        found = []

        def visit(op):
            if op.name.startswith(MMA_PREFIXES):
                found.append(op)
            return ir.WalkResult.ADVANCE

        for op in self.ops:
            op.walk(visit, ir.WalkOrder.PRE_ORDER)
        return bool(found)

    def first_work_op(self) -> ir.Operation | None:
        """The first op that is not a marker, fence or priority change."""
        for op in self.ops:
            if op.name not in _FENCE_OPS:
                return op
        return None

    def is_scheduled(self) -> bool:
        return any(MARKER_ATTR in op.attributes for op in self.ops)


def cluster_spans(func: ir.Operation) -> list[ClusterSpan]:
    """Every cluster instance in ``func``, in walk order (blocks inside a cluster are not split)."""
    spans: list[ClusterSpan] = []

    def scan(block: ir.Block):
        current = None
        for view in block.operations:
            op = view.operation
            attrs = op.attributes  # read once: each access builds a new dictionary view
            k = ir.IntegerAttr(attrs[CLUSTER_ATTR]).value if CLUSTER_ATTR in attrs else None
            if k is None:
                current = None
                if len(op.regions):  # listing the regions costs ten times asking their number
                    for region in op.regions:
                        for inner in region.blocks:
                            scan(inner)
                continue
            if current is None or current.cluster != k:
                current = ClusterSpan(k, [])
                spans.append(current)
            current.ops.append(op)

    for block in func.regions[0].blocks:
        scan(block)
    return spans


def recipes_of(func: ir.Operation) -> dict[int, ClusterRecipe]:
    """``kiln.cluster_recipes`` of ``func`` parsed back into :class:`ClusterRecipe` objects."""
    if RECIPES_ATTR not in func.attributes:
        return {}
    recipes = {}
    for entry in ir.DictAttr(func.attributes[RECIPES_ATTR]):
        if not entry.name.startswith("c") or not entry.name[1:].isdigit():
            raise KilnValueError(f"bad cluster key {entry.name!r} in {RECIPES_ATTR}",
                                 fix="keys are c<k>, e.g. c0, c1",
                                 loc=source_loc_from_mlir(func.location))
        recipes[int(entry.name[1:])] = ClusterRecipe.parse(ir.StringAttr(entry.attr).value)
    return recipes


def _tag(op, cluster: ir.Attribute, marker: str | None = None) -> None:
    op = op.operation if hasattr(op, "operation") else op
    op.attributes[CLUSTER_ATTR] = cluster
    if marker is not None:
        op.attributes[MARKER_ATTR] = ir.StringAttr.get(marker)


MARKER_SYNC_BASE = 0x4B0000  # "K": begin markers use SyncID base + k, end markers base + 0x8000 + k


def marker_sync_id(kind: str, cluster: int) -> int:
    """The SyncID of the empty ``sched.group.barrier`` (mask 0, size 0) that marks a cluster
    boundary. It constrains nothing and LLVM prints it in the assembly as
    ``; sched_group_barrier mask(0x00000000) size(0) SyncID(N)``; inline-asm comments would
    read better but llvmlite cannot assemble inline asm for AMDGPU."""
    return MARKER_SYNC_BASE + (0x8000 if kind == "end" else 0) + cluster


def _marker(cluster_id: int, cluster: ir.Attribute, kind: str) -> None:
    # Fenced on both sides: the marker is a scheduling pseudo and would float inside a region.
    _tag(rocdl.sched_barrier(0), cluster)
    _tag(rocdl.sched_group_barrier(0, 0, marker_sync_id(kind, cluster_id)), cluster, kind)
    _tag(rocdl.sched_barrier(0), cluster)


def _schedule_amd(span: ClusterSpan, recipe: ClusterRecipe, first_instance: bool) -> None:
    if recipe.pingpong is not None:
        raise UnsupportedError(f"cluster {span.cluster}: pingpong is NVIDIA-only (recipe: {recipe})",
                               fix="drop pingpong on AMD targets; use setprio to favour a wave",
                               loc=source_loc_from_mlir(span.ops[0].location))
    tag = span.ops[0].attributes[CLUSTER_ATTR]
    first, last = span.ops[0], span.ops[-1]
    with ir.InsertionPoint(first), first.location:
        _marker(span.cluster, tag, "begin")
        if recipe.priority is not None:
            _tag(rocdl.s_setprio(recipe.priority), tag)
    with ir.InsertionPoint.after(last), last.location:
        for work, size in recipe.sched_groups():
            _tag(rocdl.sched_group_barrier(SCHED_GROUP_MASKS[work], size, span.cluster), tag)
        if recipe.iglp is not None:
            _tag(rocdl.iglp_opt(recipe.iglp), tag)
        # LLVM would otherwise sink the cluster's ALU work below its s_setprio 0 / s_barrier.
        _tag(rocdl.sched_barrier(0), tag)
        if recipe.priority is not None:
            _tag(rocdl.s_setprio(0), tag)
        if recipe.barrier_at_end:
            _tag(rocdl.s_barrier(), tag)
        _marker(span.cluster, tag, "end")


PINGPONG_THREADS = 256  # two consumer warp groups meet at each named barrier


def _named_barrier(asm: str, barrier_id: ir.Value, tag: ir.Attribute | None,
                   marker: str | None = None) -> None:
    # The same inline PTX as kiln.nvidia_asm.named_barrier[_arrive] (the DSL needs a trace).
    i32 = ir.IntegerType.get_signless(32)
    threads = arith.constant(i32, PINGPONG_THREADS)
    barrier = llvm.inline_asm(None, [barrier_id, threads], f"{asm} $0, $1;", "r,r",
                              has_side_effects=True)
    if tag is not None:
        _tag(threads.owner, tag)
        _tag(barrier, tag, marker)


def _turn_ids(pingpong: tuple, tag: ir.Attribute | None) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(own barrier id, other's barrier id, is-odd-group) for the calling warp group."""
    i32 = ir.IntegerType.get_signless(32)
    tid = gpu.thread_id(gpu.Dimension.x)
    thread = arith.index_cast(i32, tid)
    seven = arith.constant(i32, 7)  # log2(128 threads per warp group)
    group = arith.shrui(thread, seven)
    odd = arith.trunci(ir.IntegerType.get_signless(1), group)
    first, second = (arith.constant(i32, i) for i in pingpong)
    own, other = arith.select(odd, second, first), arith.select(odd, first, second)
    if tag is not None:
        for value in (tid, thread, seven, group, odd, first, second, own, other):
            _tag(value.owner, tag)
    return own, other, odd


def _outermost_loop(op: ir.Operation) -> ir.Operation:
    loops = enclosing_loops(op)
    return loops[-1] if loops else op


def _schedule_pingpong(span: ClusterSpan, recipe: ClusterRecipe, first_instance: bool) -> None:
    tag = span.ops[0].attributes[CLUSTER_ATTR]
    first, last = span.ops[0], span.ops[-1]
    if first_instance:  # the odd group hands the first turn to the even one, once
        start = _outermost_loop(first)
        with ir.InsertionPoint(start), start.location:
            _, _, odd = _turn_ids(recipe.pingpong, None)  # untagged: not part of the cluster
            handover = scf.IfOp(odd)
            with ir.InsertionPoint(handover.then_block):
                first_id = arith.constant(ir.IntegerType.get_signless(32), recipe.pingpong[0])
                _named_barrier("bar.arrive", first_id, None)
                scf.YieldOp([])
    with ir.InsertionPoint(first), first.location:
        own, other, _ = _turn_ids(recipe.pingpong, tag)
        _named_barrier("bar.sync", own, tag, "begin")
    with ir.InsertionPoint.after(last), last.location:
        _named_barrier("bar.arrive", other, tag)


def _schedule_nvidia(span: ClusterSpan, recipe: ClusterRecipe, first_instance: bool) -> None:
    if recipe.interleave is not None or recipe.iglp is not None or recipe.priority is not None:
        raise UnsupportedError(
            f"cluster {span.cluster}: interleave/iglp/priority are AMD-only (recipe: {recipe})",
            fix="on NVIDIA declare only work, barrier_at_end and pingpong",
            loc=source_loc_from_mlir(span.ops[0].location))
    if recipe.pingpong is not None:
        _schedule_pingpong(span, recipe, first_instance)
    if recipe.barrier_at_end:
        last = span.ops[-1]
        with ir.InsertionPoint.after(last), last.location:
            _tag(gpu.barrier(), last.attributes[CLUSTER_ATTR])


def cluster_schedule(module_op: ir.Operation, pass_=None) -> None:
    """Fence, mark and annotate every cluster instance of every gpu.func."""
    for func in gpu_funcs(module_op):
        spans = [s for s in cluster_spans(func) if not s.is_scheduled()]
        if not spans:
            continue
        recipes = recipes_of(func)
        vendor = func_vendor(func)
        seen = set()
        for span in spans:
            if span.cluster not in recipes:
                raise CompilationError(f"cluster {span.cluster} has no recipe in {RECIPES_ATTR}",
                                     fix="open it with kiln.cluster(k, recipe) (or add c<k>)",
                                     loc=source_loc_from_mlir(span.ops[0].location))
            schedule = _schedule_nvidia if vendor == "nvidia" else _schedule_amd
            schedule(span, recipes[span.cluster], span.cluster not in seen)
            seen.add(span.cluster)


register_pass(NAME, cluster_schedule,
              "Fence kiln.cluster spans, add their end barrier, setprio and sched.group.barrier hints")
