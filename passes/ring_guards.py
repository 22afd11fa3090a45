"""Counting a ring's arms that run under conditions (:mod:`kiln.passes.mbarrier_rings`).

The path count of :class:`~kiln.passes.mbarrier_rings.Rings` loses an arm under an ``scf.if``
whose arms disagree. A look-ahead producer opens its first S uses in the loop's first
iteration and use ``it + S - 1 - lag`` later, each under a condition::

    for it in range(0, n):
        if (it == 0) & (warp == 0):
            for t in static_range(S):
                if t < n: arm(t)                       # uses 0 .. S-1
        if (it > lag) & (it + S - 1 - lag < n):
            if warp == 0: arm((it + S - 1 - lag) % S)  # use it + S - 1 - lag

:func:`guarded_count` counts the arms that ran before one arm X *where X runs*: each
condition is evaluated under X's facts. All arms of the ring must sit in one loop L, under
``scf.if`` then-arms only. An arm Y ran in earlier iterations ``it' < it``: once if its
condition holds only in L's first iteration (``iv == lo``) and X runs in a later one; else for
``it' in [a, it)`` when its lower bounds are one ``iv >= a`` (``a >= lo``) and each upper bound
(``f(iv) >= 0``, f falling in iv) holds at X's iteration, so at every earlier one. Y ran earlier
in X's iteration when it comes first in the body and its condition holds at X's facts.
Conditions on values defined outside L (``warp == 0``) must be X's own or provable. Anything
else: not counted (None).
"""

from __future__ import annotations

from mlir import ir

from kiln.passes.ring_exprs import Exprs, Lin, cond_facts, nonneg


def _conjuncts(cond: ir.Value) -> list[ir.Value]:
    """The terms of an ``arith.andi`` chain."""
    owner = cond.owner
    if not isinstance(owner, ir.Block) and owner.operation.name == "arith.andi":
        return [c for arg in owner.operation.operands for c in _conjuncts(arg)]
    return [cond]


def _guards(op: ir.Operation, loop: ir.Operation) -> list[ir.Value] | None:
    """The conditions between ``loop``'s body and ``op`` (then-arms only), or None."""
    out, inner = [], op
    while inner.parent is not None and inner.parent.operation != loop:
        parent = inner.parent.operation
        if parent.name != "scf.if" or inner.block.region != parent.regions[0]:
            return None  # an else arm, or a region op that is no scf.if
        out.extend(_conjuncts(parent.operands[0]))
        inner = parent
    return out if inner.parent is not None else None


def _defined_in(value: ir.Value, loop: ir.Operation) -> bool:
    """Whether ``value`` is a block argument or result inside ``loop`` (or its iv)."""
    owner = value.owner
    op = owner.owner if isinstance(owner, ir.Block) else owner.operation
    while op is not None:
        if op == loop:
            return True
        op = op.parent.operation if op.parent is not None else None
    return False


def _varies(e: Lin, loop: ir.Operation) -> bool:
    """Whether ``e`` has an atom defined in ``loop`` (its induction variable included)."""
    return any(_defined_in(atom[1], loop) if atom[0] == "v" else _varies(atom[1], loop)
               for atom, _ in e.terms)


class _Counter:
    """Evaluates arms' conditions where X runs (``facts``, its conditions ``own``)."""

    def __init__(self, exprs: Exprs, loop: ir.Operation, facts: tuple, own: list):
        self.exprs, self.loop, self.facts, self.own = exprs, loop, facts, set(own)
        self.iv_atom = ("v", loop.regions[0].blocks[0].arguments[0])
        self.iv = Lin.atom(self.iv_atom)
        self.lo = exprs.lin(loop.operands[0])

    def first_only(self, cond: ir.Value) -> bool:
        """Whether ``cond`` is ``iv == lo``."""
        return set(cond_facts(self.exprs, cond)) == {self.iv - self.lo, self.lo - self.iv}

    def invariant_holds(self, cond: ir.Value) -> bool | None:
        """For a condition on values defined outside the loop: whether it holds at X (its own,
        or proven); None when ``cond`` depends on the loop."""
        found = cond_facts(self.exprs, cond)
        if not found or any(_varies(f, self.loop) for f in found):
            return None
        return cond in self.own or all(nonneg(f, self.facts) for f in found)

    def now(self, cond: ir.Value) -> bool | None:
        """Whether ``cond`` holds in X's iteration (None: not known)."""
        if cond in self.own:
            return True
        if self.first_only(cond):
            return True if nonneg(self.lo - self.iv, self.facts) else \
                False if nonneg(self.iv - self.lo - 1, self.facts) else None
        found = cond_facts(self.exprs, cond)
        if found and all(nonneg(f, self.facts) for f in found):
            return True
        return False if any(nonneg(Lin() - f - 1, self.facts) for f in found) else None

    def earlier_iterations(self, guards: list) -> Lin | None:
        """How many times an arm under ``guards`` ran in iterations before X's."""
        if any(self.first_only(c) for c in guards) and nonneg(self.lo - self.iv, self.facts):
            return Lin()  # X runs in the first iteration: there is none before
        start, once, falling = self.lo, False, []
        for cond in guards:
            invariant = self.invariant_holds(cond)
            if invariant is not None:
                if not invariant:
                    return None
                continue
            if self.first_only(cond):
                once = True
                continue
            for fact in cond_facts(self.exprs, cond):
                coeff = dict(fact.terms).get(self.iv_atom, 0)
                if _varies(fact - self.iv.scale(coeff), self.loop):
                    return None
                if coeff == 1:  # iv >= bound
                    bound = self.iv - fact
                    if start != self.lo or not nonneg(bound - self.lo, self.facts):
                        return None
                    start = bound
                elif coeff < 0:
                    falling.append(fact)
                else:
                    return None
        if once:
            if start != self.lo or falling:
                return None
            return Lin(const=1) if nonneg(self.iv - self.lo - 1, self.facts) else None
        if nonneg(start - self.iv, self.facts):
            return Lin()  # no earlier iteration reached its lower bound
        ran = self.iv - start  # each upper bound holds now, so at every earlier iteration
        return ran if nonneg(ran, self.facts) and all(
            nonneg(f, self.facts) for f in falling) else None


def guarded_count(exprs: Exprs, arm: ir.Operation, facts: tuple, arms: list,
                  loops_of, orders: dict) -> Lin | None:
    """The number of ``arms`` (one ring's) that ran before ``arm`` (module docstring), or
    None. ``loops_of(op)``: the loops around an op, innermost first; ``orders``: each loop's
    ops numbered in program order, filled as needed (the arms of a loop share it)."""
    loops = loops_of(arm)  # one loop, the outermost: no earlier iteration of another
    if len(loops) != 1 or any(loops_of(other) != loops for other in arms):
        return None
    loop = loops[0]
    own = _guards(arm, loop)
    if own is None:
        return None
    counter = _Counter(exprs, loop, facts, own)
    order = orders.get(loop)
    if order is None:
        order = orders[loop] = {}

        def number(op):
            order.setdefault(op.operation, len(order))
            return ir.WalkResult.ADVANCE

        loop.walk(number, ir.WalkOrder.PRE_ORDER)
    total = Lin()
    for other in arms:
        guards = _guards(other, loop)
        before = None if guards is None else counter.earlier_iterations(guards)
        if before is None:
            return None
        total = total + before
        if order[other] < order[arm]:  # earlier in X's iteration
            now = [counter.now(c) for c in guards]
            if False in now:
                continue
            if None in now:
                return None
            total = total + 1
    return total
