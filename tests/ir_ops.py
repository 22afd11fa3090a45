"""Finding operations in a traced module: the waits a test deletes one at a time, in order.

Example: ``ops_where(module, lambda op: op.name == "nvgpu.mbarrier.try_wait.parity")``.
"""

from __future__ import annotations

from typing import Callable

from mlir import ir


def ops_where(module: ir.Module, keep: Callable[[ir.Operation], bool]) -> list[ir.Operation]:
    """The operations of ``module`` for which ``keep(op)`` holds, in program order."""
    found = []

    def visit(op):
        if keep(op):
            found.append(op.operation)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found
