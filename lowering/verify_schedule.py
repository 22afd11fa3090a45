"""``kiln-verify-schedule``: check each cluster of the final AMDGPU assembly against its recipe.

It works on the verbose ``amdgcn`` text (run by ``compile_kernel`` after that stage), not on
MLIR: the markers that ``kiln-cluster-schedule`` plants delimit every cluster instance, and the
recipes come from the kernel's ``kiln.cluster_recipes``. Per instance it checks:

- exact counts of ``mfma`` (``v_mfma*``), ``ds_read``, ``ds_write``, ``vmem_read``
  (``global_load*``/``buffer_load*``), ``dma`` (``... lds``) and ``vmem_write``; at-least counts
  of ``valu``/``trans`` (LLVM adds address arithmetic);
- with an interleave, that the declared classes appear in the expanded group order;
- ``s_setprio P`` before the first work instruction and ``s_setprio 0`` after the last;
- ``s_barrier`` present iff ``barrier_at_end``, with no work after it.

A mismatch is a :class:`kiln.core.errors.ScheduleWarning` naming the cluster, expected and found
counts, or a :class:`kiln.core.errors.ScheduleError` with ``strict=True``.

:func:`verify_schedule_sass` is the NVIDIA half, on ``cuobjdump --dump-sass`` text
(``lowering/isa_sass.py``; run after the ``cubin`` stage when ``cuobjdump`` is found). Only
ping-pong clusters are visible there (their named barriers delimit each instance). Per instance
it checks exact counts of the memory and tensor-core classes (:data:`SASS_CLASSES`) and the
``bar.sync 0`` iff ``barrier_at_end``. ``valu``/``trans`` are not checked: ``ptxas`` moves ALU
work across named barriers, which order memory only.

Example::

    verify_schedule(ck.asm["amdgcn"], {0: QK_RECIPE, 1: DMA_RECIPE}, "attn", strict=True)
    verify_schedule_sass(sass_text, {0: PINGPONG_RECIPE}, "gemm")
"""

from __future__ import annotations

import warnings

from kiln.cluster import ClusterRecipe
from kiln.core.errors import ScheduleError, ScheduleWarning
from kiln.lowering import isa_sass
from kiln.lowering.isa_amdgpu import Program, class_counts, cluster_instances, parse

NAME = "kiln-verify-schedule"
EXACT = ("mfma", "ds_read", "ds_write", "vmem_read", "dma", "vmem_write")
AT_LEAST = ("valu", "trans")
# Recipe class -> the isa_sass kinds it counts; classes not listed are not checked on SASS.
SASS_CLASSES = {
    "wgmma": ("wgmma",), "mfma": ("wgmma", "mma"),
    "ds_read": ("ds_read",), "ds_write": ("ds_write",), "ds": ("ds_read", "ds_write"),
    "vmem_read": ("vmem_read",), "vmem_write": ("vmem_write",), "vmem": ("vmem_read", "vmem_write"),
    "tma": ("tma",), "cp_async": ("cp_async",), "dma": ("cp_async", "tma"),
}


def _order(instrs: list, classes: set) -> list[str]:
    return [w for w in (i.work_class() for i in instrs) if w in classes]


def instance_problems(recipe: ClusterRecipe, instrs: list) -> list[str]:
    """What differs between one cluster instance's instructions and ``recipe``."""
    found = class_counts(instrs)
    problems = []
    for work, want in recipe.counts.items():
        have = found.get(work, 0)
        if (work in EXACT and have != want) or (work in AT_LEAST and have < want):
            problems.append(f"{work}: expected {want}, found {have}")
    if recipe.interleave is not None:
        expected = [w for w, n in recipe.sched_groups() for _ in range(n)]
        actual = _order(instrs, {w for w, _ in recipe.interleave})
        if actual != expected:
            problems.append(f"order: expected {' '.join(expected)}, found {' '.join(actual)}")
    work_at = [i for i, ins in enumerate(instrs) if ins.work_class() is not None]
    prios = [(i, ins.text.strip()) for i, ins in enumerate(instrs) if ins.mnemonic == "s_setprio"]
    if recipe.priority is not None and work_at:
        first_ok = any(i < work_at[0] and t == str(recipe.priority) for i, t in prios)
        last_ok = any(i > work_at[-1] and t == "0" for i, t in prios)
        if not (first_ok and last_ok):
            problems.append(f"s_setprio: expected {recipe.priority} before the work and 0 after, "
                            f"found {[t for _, t in prios]}")
    barriers = [i for i, ins in enumerate(instrs) if ins.mnemonic == "s_barrier"]
    if recipe.barrier_at_end and (not barriers or (work_at and work_at[-1] > barriers[-1])):
        problems.append("s_barrier: expected at the end of the cluster")
    if not recipe.barrier_at_end and barriers:
        problems.append(f"s_barrier: expected none, found {len(barriers)}")
    return problems


def verify_schedule(asm: str | Program, recipes: dict[int, ClusterRecipe], kernel: str | None = None,
                    *, strict: bool = False) -> list[str]:
    """Check every cluster instance in ``asm`` against ``recipes`` (cluster -> recipe);
    return the problems (also warned, or raised under ``strict``)."""
    program = parse(asm, kernel) if isinstance(asm, str) else asm
    report = []
    for marker, instrs in cluster_instances(program):
        recipe = recipes.get(marker.cluster)
        if recipe is None:
            continue
        for problem in instance_problems(recipe, instrs):
            report.append(f"cluster {marker.cluster} ({recipe}): {problem}")
    loc = next((m.loc for m, _ in cluster_instances(program) if m.loc), None) if strict else None
    _report(report, kernel, strict, loc, "assembly")
    return report


def _report(report: list[str], kernel: str | None, strict: bool, loc, what: str) -> None:
    if not report:
        return
    text = f"kernel {kernel or '?'}: the final {what} differs from the cluster recipes:\n  " + \
        "\n  ".join(report)
    if strict:
        raise ScheduleError(text, fix="adjust the recipe to what the cluster holds, or change "
                                      "the cluster's code", loc=loc)
    warnings.warn(ScheduleWarning(text), stacklevel=3)


def sass_instance_problems(recipe: ClusterRecipe, instance: isa_sass.ClusterInstance) -> list[str]:
    """What differs between one ping-pong instance's SASS and ``recipe``."""
    found = isa_sass.class_counts(instance.instructions)
    problems = []
    for work, kinds in SASS_CLASSES.items():
        want = recipe.counts.get(work, 0)
        have = sum(found.get(kind, 0) for kind in kinds)
        if work in recipe.counts and have != want:
            problems.append(f"{work}: expected {want}, found {have}")
    block_barriers = [i for i in instance.instructions
                      if i.opcode.startswith("BAR.SYNC") and i.barrier_threads is None]
    if recipe.barrier_at_end and not block_barriers:
        problems.append("bar.sync 0: expected at the end of the cluster, found none")
    if not recipe.barrier_at_end and block_barriers:
        problems.append(f"bar.sync 0: expected none, found {len(block_barriers)}")
    if not instance.closed:
        problems.append(f"bar.arrive: the turn opened on barrier {instance.barrier_id} never ends")
    return problems


def _pingpong_owner(recipes: dict[int, ClusterRecipe], barrier_id: str) -> int | None:
    """The cluster whose ping-pong opens on ``barrier_id``: the recipe whose pair holds an
    immediate id, else the only ping-pong recipe (ptxas keeps a per-group id in a register)."""
    pingpong = {k: r for k, r in recipes.items() if r.pingpong is not None}
    if barrier_id.startswith("0x"):
        matches = [k for k, r in pingpong.items() if int(barrier_id, 16) in r.pingpong]
    else:
        matches = list(pingpong)
    return matches[0] if len(matches) == 1 else None


def verify_schedule_sass(sass: str | isa_sass.SassKernel, recipes: dict[int, ClusterRecipe],
                         kernel: str | None = None, *, strict: bool = False) -> list[str]:
    """Check every ping-pong cluster instance of a SASS listing against ``recipes``; return the
    problems (also warned, or raised under ``strict``). Instances that cannot be told apart
    (several ping-pong recipes, register barrier ids) are not checked."""
    program = isa_sass.parse(sass, kernel) if isinstance(sass, str) else sass
    report = []
    for instance in isa_sass.cluster_instances(program):
        cluster = _pingpong_owner(recipes, instance.barrier_id)
        if cluster is None:
            continue
        recipe = recipes[cluster]
        for problem in sass_instance_problems(recipe, instance):
            report.append(f"cluster {cluster} ({recipe}): {problem}")
    _report(report, kernel, strict, None, "SASS")
    return report
