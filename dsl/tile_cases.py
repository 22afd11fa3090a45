"""``for r in kiln.cases(value, n)``: run the body once, for ``r == value``, with ``r`` a Python int.

A software-pipelined loop over ``N`` stages unrolls its body ``N`` times so every stage index
is a Python int (each stage's shared tiles are their own allocations, which the wait analysis
tells apart, and each TMA-loaded tile's mbarrier parity is counted by induction on the loop).
A trip count that is not a multiple of ``N`` leaves ``count % N`` steps over. Running whole
groups anyway computes up to ``N - 1`` steps past the end (the causal attention's padding
tiles past the diagonal); ``kiln.cases`` runs the remainder *first*, with the stages rotated so
the whole groups after it start at stage 0::

    for r in kiln.cases(n % STAGES, STAGES):    # exactly one arm runs; r is a Python int
        p, acc = first_steps(r, p, acc)         # its r steps use stages (j - r) % STAGES
    for g in kiln.range(0, n // STAGES):        # whole groups, stage 0 first
        ...

Each arm is traced once, with ``r`` an int in ``0 .. n - 1``, inside a loop of one trip when
``value == r`` and none otherwise (an ``scf.for`` whose uniform trip count is
``kiln.max(kiln.where(value == r, 1, 0), 0)``): a loop, not an ``scf.if``, because the
mbarrier proofs count an arm's TMA uses by its trip count (:mod:`kiln.passes.mbarrier_rings`;
the arms of an ``scf.if`` must agree on their counts) and every thread of the block takes the
same arm (no lane-divergent branch around a WGMMA's ``.aligned`` wait). Variables assigned in
the body are carried through every arm (an arm that does not run passes them on), as in a
``kiln.range`` loop; ``value`` outside ``0 .. n - 1`` runs no arm.

Example (``tests/test_tile_cases.py``' ring: the first ``n % 3`` blocks, stages rotated)::

    for r in kiln.cases(n % 3, 3):
        acc = first(r, acc)
"""

from __future__ import annotations

from typing import Any, Callable

from . import ops
from .core.errors import KilnTypeError, KilnValueError
from .trace_runtime import _MISSING, TracedRange, for_stmt
from .values import Value

MAX_CASES = 16   # each arm is traced and compiled: a handful of stages, not a jump table


class Cases(TracedRange):
    """The loop object :func:`cases` returns; drives a ``for`` statement in a kernel (a
    TracedRange, so the kernel's ``for`` rewrite hands it the body)."""

    def __init__(self, value: Any, n: int):
        super().__init__(0, n)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CASES:
            raise KilnValueError(f"kiln.cases n={n!r} must be an int in 1..{MAX_CASES}",
                                 fix="pass the stage count, e.g. kiln.cases(n % STAGES, STAGES)")
        if not isinstance(value, (Value, int)) or isinstance(value, bool) or \
                isinstance(value, Value) and value.dtype.kind not in ("int", "index"):
            raise KilnTypeError(f"kiln.cases value must be an integer, got {value!r}",
                                fix="pass a traced int, e.g. kiln.cases(n % STAGES, STAGES)")
        self.value, self.n = value, n

    def __iter__(self):
        raise KilnTypeError("kiln.cases can only drive a `for` statement in a kernel body",
                            fix="write `for r in kiln.cases(value, n):` directly")

    def __kiln_for__(self, body_fn: Callable, names, initial: list, objects: list) -> tuple:
        """One ``scf.for`` of 0 or 1 trips per arm, the carried values chained through them;
        returns the values of ``names`` after the last (as ``for_stmt``)."""
        values, outputs = list(initial), tuple(initial)
        for r in range(self.n):
            # a traced count >= 0 for the proofs (a max); a Python int: the arm or nothing
            trips = int(self.value == r) if isinstance(self.value, int) else \
                ops.maximum(ops.where(self.value == r, 1, 0), 0)
            outputs = for_stmt(TracedRange(0, trips), lambda _, *args, r=r: body_fn(r, *args),
                               names, values, objects)
            values = [_MISSING if before is _MISSING else after
                      for before, after in zip(initial, outputs)]
        return outputs


def cases(value: Any, n: int) -> Cases:
    """``for r in kiln.cases(value, n)``: the body runs once, with ``r`` the Python int equal to
    ``value`` (a block-uniform traced int in ``0 .. n - 1``); see the module docs.

    Example: ``for r in kiln.cases(n % STAGES, STAGES): p, acc = first_steps(r, p, acc)``.
    """
    return Cases(value, n)


__all__ = ["cases", "Cases"]
