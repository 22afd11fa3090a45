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
