"""Integer values as linear expressions, for the mbarrier ring proofs (:mod:`mbarrier_rings`).

:class:`Lin` is ``const + sum(coeff * atom)``. An atom is an opaque value (``("v", value)``) or
a division / remainder by a constant of another expression (``("div", lin, S)``,
``("mod", lin, S)``). :meth:`Exprs.lin` folds ``arith`` constants, ``addi``/``subi``, ``muli`` by
a constant and the integer casts, so ``(j - first) % 4`` in two places (or ``iv + 1 - 1``) is one
expression. ``divsi``/``remsi`` are read as floor division and modulo: :func:`nonneg` must hold
for their argument before a proof uses that. Facts are expressions known ``>= 0`` at a point
(``scf.for`` bounds, ``scf.if`` conditions); :func:`nonneg` proves a bound from one or two of them.

Example: in ``scf.for %j = %lo to %hi``, ``lin(%j - %lo)`` is ``1*%j - 1*%lo`` and the loop's
facts give ``nonneg(that)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

from kiln.core.ops import constant_int

# Casts that keep an integer's value (the programs' counts are far from any width's limit).
_CASTS = ("arith.index_cast", "arith.index_castui", "arith.extsi", "arith.extui")
_DIVS = ("arith.divsi", "arith.divui", "arith.floordivsi")
_REMS = ("arith.remsi", "arith.remui")
# cmpi predicate -> (sign of a - b, slack): the then-arm knows sign*(a - b) - slack >= 0.
_CMP_FACTS = {2: ((-1, 1),), 3: ((-1, 0),), 4: ((1, 1),), 5: ((1, 0),), 0: ((1, 0), (-1, 0))}


def _constant(value: ir.Value) -> int | None:
    """An ``arith.constant`` integer, ``true``/``false`` (a BoolAttr) included."""
    known = constant_int(value)
    owner = value.owner
    if known is None and not isinstance(owner, ir.Block) and \
            owner.operation.name == "arith.constant":
        attr = owner.operation.attributes["value"]
        return int(ir.BoolAttr(attr).value) if isinstance(attr, ir.BoolAttr) else None
    return known


@dataclass(frozen=True)
class Lin:
    """``const + sum(coeff * atom)`` (``terms``: a frozenset of ``(atom, coeff)``, coeff != 0)."""

    terms: frozenset = frozenset()
    const: int = 0

    @staticmethod
    def atom(atom) -> "Lin":
        return Lin(frozenset({(atom, 1)}))

    def _combine(self, other: "Lin", sign: int) -> "Lin":
        out = dict(self.terms)
        for atom, coeff in other.terms:
            out[atom] = out.get(atom, 0) + sign * coeff
        return Lin(frozenset((a, c) for a, c in out.items() if c), self.const + sign * other.const)

    def __add__(self, other) -> "Lin":
        return self._combine(other if isinstance(other, Lin) else Lin(const=other), 1)

    def __sub__(self, other) -> "Lin":
        return self._combine(other if isinstance(other, Lin) else Lin(const=other), -1)

    def scale(self, k: int) -> "Lin":
        return Lin(frozenset((a, c * k) for a, c in self.terms if c * k), self.const * k)

    @property
    def is_const(self) -> bool:
        return not self.terms

    def single(self, kind: str):
        """``(argument, S)`` when this is exactly ``1 * (kind atom)`` plus a constant, else None."""
        if len(self.terms) != 1:
            return None
        (atom, coeff), = self.terms
        return atom[1:] if coeff == 1 and atom[0] == kind else None


ZERO = Lin()


class Exprs:
    """:meth:`lin` and :meth:`parity` of the values of one function (memoised)."""

    def __init__(self):
        self._memo: dict = {}

    def lin(self, value: ir.Value) -> Lin:
        found = self._memo.get(value)
        if found is None:
            found = self._memo[value] = self._lin(value)
        return found

    def _lin(self, value: ir.Value) -> Lin:
        known = _constant(value)
        if known is not None:
            return Lin(const=known)
        owner = value.owner
        if isinstance(owner, ir.Block):
            return Lin.atom(("v", value))
        op = owner.operation
        name, args = op.name, list(op.operands)
        if name in _CASTS or (name == "arith.trunci" and ir.IntegerType(value.type).width > 1):
            return self.lin(args[0])
        if name in ("arith.addi", "arith.subi"):
            a, b = self.lin(args[0]), self.lin(args[1])
            return a + b if name == "arith.addi" else a - b
        if name == "arith.muli":
            a, b = self.lin(args[0]), self.lin(args[1])
            if a.is_const or b.is_const:
                return b.scale(a.const) if a.is_const else a.scale(b.const)
        if name in _DIVS + _REMS:
            stages = constant_int(args[1])
            if stages is not None and stages > 0:
                x = self.lin(args[0])
                if name in _DIVS:
                    return x if stages == 1 else Lin(const=x.const // stages) if x.is_const \
                        else Lin.atom(("div", x, stages))
                return ZERO if stages == 1 else Lin(const=x.const % stages) if x.is_const \
                    else Lin.atom(("mod", x, stages))
        return Lin.atom(("v", value))

    def parity(self, value: ir.Value) -> tuple[Lin, int]:
        """``(e, flip)``: the low bit of ``value`` is the low bit of ``e`` xor ``flip``, through
        casts, ``xori`` by a constant and ``% 2`` / ``& 1`` (which keep the low bit)."""
        flip = 0
        for _ in range(32):
            owner = value.owner
            if isinstance(owner, ir.Block) or _constant(value) is not None:
                break
            op = owner.operation
            args = list(op.operands)
            two = len(args) == 2 and _constant(args[1])
            if op.name in _CASTS or op.name == "arith.trunci":
                value = args[0]
            elif op.name == "arith.xori" and two is not None and two is not False:
                flip ^= two & 1
                value = args[0]
            elif (op.name in _REMS and two == 2) or (op.name == "arith.andi" and two == 1):
                value = args[0]
            else:
                break
        return self.lin(value), flip


def floor_facts(exprs: Exprs, e: Lin) -> tuple[Lin, ...]:
    """Facts (``>= 0``) of ``e``'s atoms that are an ``arith.maxsi``: ``max(a, b) - a`` and
    ``max(a, b) - b``; e.g. a loop's trip count ``kiln.max(n, 0)``, or ``kiln.max(hi, lo) -
    lo`` for ``kiln.range(lo, kiln.max(hi, lo))``."""
    facts = []
    for atom, _ in e.terms:
        value = atom[1] if atom[0] == "v" else None
        owner = None if value is None else value.owner
        if owner is None or isinstance(owner, ir.Block) or owner.operation.name != "arith.maxsi":
            continue
        facts += [Lin.atom(atom) - exprs.lin(arg) for arg in owner.operation.operands]
    return tuple(facts)


def cond_facts(exprs: Exprs, cond: ir.Value) -> list[Lin]:
    """Facts (``>= 0``) that hold where ``cond`` (an i1) is true: the signed comparisons of its
    ``arith.andi`` conjuncts."""
    owner = cond.owner
    if isinstance(owner, ir.Block):
        return []
    op = owner.operation
    if op.name == "arith.andi":
        return [f for arg in op.operands for f in cond_facts(exprs, arg)]
    if op.name != "arith.cmpi":
        return []
    pred = ir.IntegerAttr(op.attributes["predicate"]).value
    diff = exprs.lin(op.operands[0]) - exprs.lin(op.operands[1])
    return [diff.scale(sign) - slack for sign, slack in _CMP_FACTS.get(pred, ())]


def nonneg(e: Lin, facts) -> bool:
    """Whether ``e >= 0`` follows from one fact, or the sum of two, plus a constant >= 0."""
    # a remainder by a positive constant is >= 0 (the proofs check the argument's sign apart)
    e = Lin(frozenset((a, c) for a, c in e.terms if not (a[0] == "mod" and c > 0)), e.const)
    if e.is_const:
        return e.const >= 0
    facts = list(facts)
    for i, f in enumerate(facts):
        rest = e - f
        if rest.is_const and rest.const >= 0:
            return True
        for g in facts[i:]:
            both = rest - g
            if both.is_const and both.const >= 0:
                return True
    return False
