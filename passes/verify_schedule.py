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

A mismatch is a :class:`kiln.errors.ScheduleWarning` naming the cluster, expected and found
counts, or a :class:`kiln.errors.ScheduleError` with ``strict=True``.

Example::

    verify_schedule(ck.asm["amdgcn"], {0: QK_RECIPE, 1: DMA_RECIPE}, "attn", strict=True)
"""

from __future__ import annotations

import warnings

from kiln.cluster import ClusterRecipe
from kiln.errors import ScheduleError, ScheduleWarning
from kiln.lowering.isa_amdgpu import Program, class_counts, cluster_instances, parse

NAME = "kiln-verify-schedule"
EXACT = ("mfma", "ds_read", "ds_write", "vmem_read", "dma", "vmem_write")
AT_LEAST = ("valu", "trans")


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
    if report:
        text = f"kernel {kernel or '?'}: the final assembly differs from the cluster recipes:\n  " + \
            "\n  ".join(report)
        if strict:
            loc = next((m.loc for m, _ in cluster_instances(program) if m.loc), None)
            raise ScheduleError(text, fix="adjust the recipe to what the cluster holds, or change "
                                          "the cluster's code", loc=loc)
        warnings.warn(ScheduleWarning(text), stacklevel=2)
    return report
