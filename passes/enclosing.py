"""Where an op sits: the ``gpu.func`` and the loops around it (helpers of Kiln's passes).

Example::

    func = enclosing_gpu_func(op)      # None outside any gpu.func
    loops = enclosing_loops(op)        # innermost first; [] when op is in no loop
"""

from __future__ import annotations

import itertools

from mlir import ir

LOOPS = ("scf.for", "scf.while")


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
