"""Where an op sits: the ``gpu.func`` and the loops around it (helpers of Kiln's passes).

Example::

    func = enclosing_gpu_func(op)      # None outside any gpu.func
    loops = enclosing_loops(op)        # innermost first; [] when op is in no loop
    where(op)                          # "kernel.py:12", for messages
"""

from __future__ import annotations

import itertools

from mlir import ir

from kiln.core.errors import source_loc_from_mlir

LOOPS = ("scf.for", "scf.while")
MMA_PREFIXES = ("amdgpu.mfma", "amdgpu.scaled_mfma", "rocdl.mfma", "amdgpu.wmma",
                "nvvm.wgmma.mma_async")


def _ancestors(op: ir.Operation):
    """The ops enclosing ``op``, innermost first."""
    parent = op.parent
    while parent is not None:
        yield parent.operation
        parent = parent.operation.parent


def enclosing_gpu_func(op: ir.Operation) -> ir.Operation | None:
    """The ``gpu.func`` that holds ``op``, or None."""
    return next((parent for parent in _ancestors(op) if parent.name == "gpu.func"), None)


def enclosing_loops(op: ir.Operation) -> list[ir.Operation]:
    """The ``scf.for`` / ``scf.while`` loops around ``op`` inside its ``gpu.func``, innermost
    first."""
    inside = itertools.takewhile(lambda parent: parent.name != "gpu.func", _ancestors(op))
    return [parent for parent in inside if parent.name in LOOPS]


def where(op: ir.Operation) -> str:
    """``file:line`` of ``op``'s user location, for messages."""
    loc = source_loc_from_mlir(op.location)
    return f"{loc.filename.rsplit('/', 1)[-1]}:{loc.line}" if loc else "an unknown line"


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
