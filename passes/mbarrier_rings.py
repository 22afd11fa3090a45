"""Pipelined mbarrier rings: which use each wait names, and the proof that it is the right one.

A ring is an mbarrier group of S stages (its size, or the ``kiln.ring_stages`` a
:class:`kiln.mbarrier.PhaseTracker` records on it); a group whose ops all name constant
barriers is a set of independent 1-stage rings, one per barrier. Its *uses* are numbered 0, 1, 2, ... in the
order a thread opens them: use n lives on barrier ``n % S`` and completes that barrier's phase
``n // S``, so a wait for it names slot ``n % S`` and parity ``(n // S) % 2``. The ops declare
their part (``Effects.ring``): ``arm`` (arrive + expect_tx: opens a use of a *full* ring, one
that TMA loads ``fill``), ``wait`` and ``release`` (a consumer's arrive on an *empty* ring: no
load completes it). A wait on an empty ring before the arm of use n waits for the release of use
n - S: slot ``n % S``, parity ``(n // S + 1) % 2`` (a fresh barrier passes parity 1 at once).

What is derived, never trusted (:mod:`kiln.passes.ring_exprs` reads the index arithmetic):

- **the use a wait names**: its slot ``x % S`` and its parity ``((x + k*S) // S + c) % 2`` must
  name one use x (a constant slot c and parity b name use ``c + S*b`` modulo 2S); the parity
  offset must be 0 on a full ring and 1 on an empty one; the divisions' arguments must be
  provably >= 0 (loop bounds, ``scf.if`` conditions);
- **the use it must name**, by counting: the k-th wait on a ring along a thread's path must name
  use k, and the k-th arm use k (modulo 2S and S). Counts follow loops by induction: a loop
  whose body adds c events per iteration counts ``before + c*(iv - lo)`` at the top of its body
  (step 1; a constant step S counts ``before + c*((iv - lo) // S)``, with no count after the
  loop), or an ``iter_arg`` that starts at the count and is yielded plus the body's events (a
  ``use = use + 1`` counter carried through nested loops); an ``scf.if`` keeps a count its arms
  agree on. A wait on an empty ring must name the use of the arm after it in its block.

Arms the path count loses under conditions (the decode kernel's first-iteration and
look-ahead loads) are counted where they run by :mod:`kiln.passes.ring_guards`. Where no count
is derived, the count check is skipped: slot and parity are still checked against each other
and against the arm they guard (and ``kiln-insert-waits`` refuses rather than guess). Release arrives'
slots and the loads' barrier indices are not checked (the loads use their arm's value).

Example::

    ring_errors(func)      # [(try_wait op, "its parity is flipped: ...")] for a bad wait
    rings = Rings(func, virtual=(read_op, group))
    rings.virtual_count    # the use a wait placed before read_op would acquire (a Lin)
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, nvgpu

from kiln.nvidia.mbarrier import DEFAULT_TICKS, RING_STAGES_ATTR
from kiln.passes.enclosing import enclosing_loops
from kiln.passes.ring_exprs import ZERO, Exprs, Lin, cond_facts, floor_facts, nonneg
from kiln.passes.ring_guards import guarded_count
from kiln.passes.op_queries import effects, may_declare

UNKNOWN = None
ADVANCE = ir.WalkResult.ADVANCE


@dataclass(frozen=True)
class Named:
    """The use a wait names: ``n`` modulo ``modulus`` (2S when slot and parity both say), and
    the parity offset it waits with (``(n // S + offset) % 2``; -1: slot and parity disagree;
    None: both constant, the parity folded into ``n`` at offset 0)."""

    n: Lin
    modulus: int
    offset: int | None


def ring_of(op: ir.Operation):
    """``(role, group, slot, parity)`` of a ring op, else None."""
    ring = effects(op).ring
    return None if ring is None else ring(op)


def stages_of(group: ir.Value) -> int:
    """The ring's stage count: a PhaseTracker's record on the group, else the group's size."""
    owner = group.owner
    if not isinstance(owner, ir.Block) and RING_STAGES_ATTR in owner.operation.attributes:
        return ir.IntegerAttr(owner.operation.attributes[RING_STAGES_ATTR]).value
    text = str(group.type)  # the bindings have no accessor; the default size 1 is not printed
    return int(text.rsplit("num_barriers = ", 1)[1].split(">")[0]) if "num_barriers" in text else 1


class Rings:
    """The rings of one ``gpu.func``: each ring op's count along its path and the facts there.
    ``virtual=(op, group)`` counts a wait on ``group`` right before ``op`` (one being placed);
    ``like``, the Rings of the same function, unchanged since, lends its ring ops (a wait
    being placed is counted at several candidate points in turn)."""

    def __init__(self, func: ir.Operation, virtual=None, like: "Rings | None" = None):
        self.virtual = virtual
        self.counts: dict = {}   # ring op -> Lin | UNKNOWN (events of its kind before it)
        self.facts: dict = {}    # ring op -> facts at it
        self.steps: dict = {}    # (loop op, key) -> events per iteration (int | UNKNOWN)
        self.virtual_count = UNKNOWN
        if like is None:
            self.exprs = Exprs()
            self.ops: list = []
            ringed = may_declare("ring")  # most ops are not asked for their declaration
            func.operation.walk(lambda op: self._collect(op) if ringed(op) else ADVANCE)
            self.stages = self._units()
            self._around = _with_ancestors([op for op, _ in self.ops])
            self._kept: dict = {}  # ir.Block -> its ring ops and the ops around them, in order
            self._orders: dict = {}  # loop op -> its ops in program order (ring_guards)
        else:
            self.exprs, self.ops, self._by_op, self.stages = (like.exprs, like.ops, like._by_op,
                                                              like.stages)
            self._around, self._kept, self._orders = like._around, like._kept, like._orders
        self.full = {r[1] for _, r in self.ops if r[0] == "fill"}
        self.empty = {r[1] for _, r in self.ops if r[0] == "release"} - self.full
        # the blocks that also hold the virtual wait's op or an op around it
        extra = _with_ancestors([virtual[0]]) - self._around if virtual is not None else set()
        self._extra = {op.block: None for op in extra}
        self._counted = self._around | extra
        if self.ops:
            self._block(func.regions[0].blocks[0], {}, (), record=True)
            self._guarded_arms()

    def _guarded_arms(self) -> None:
        """Count the arms the path count lost under conditions (:mod:`ring_guards`)."""
        arms: dict = {}
        for op, ring in self.ops:
            if ring[0] == "arm":
                arms.setdefault(ring[1], []).append(op)
        for group_arms in arms.values():
            for op in group_arms:
                if self.counts.get(op, UNKNOWN) is UNKNOWN and op in self.facts:
                    self.counts[op] = guarded_count(self.exprs, op, self.facts[op], group_arms,
                                                    enclosing_loops, self._orders)

    def _collect(self, op):
        ring = ring_of(op.operation)
        if ring is not None:
            self.ops.append((op.operation, ring))
        return ADVANCE

    def _units(self) -> dict:
        """Rewrite each ring op's group to its *unit* and give each unit's stage count: a group
        whose ops all name constant barriers is used as independent barriers, each its own
        1-stage ring ``(group, index)``; any other group is one ring of ``stages_of`` stages."""
        constant: dict = {}
        for _, (role, group, slot, _) in self.ops:
            constant[group] = constant.get(group, True) and self.exprs.lin(slot).is_const
        stages, ops = {}, []
        for op, (role, group, slot, parity) in self.ops:
            unit = (group, self.exprs.lin(slot).const) if constant[group] else group
            stages[unit] = 1 if constant[group] else stages_of(group)
            ops.append((op, (role, unit, slot, parity)))
        self.ops = ops
        self._by_op = dict(ops)
        return stages

    def unit_of(self, op: ir.Operation):
        """The ring unit (a group, or ``(group, index)``) of a ring op, else None."""
        ring = self._by_op.get(op)
        return None if ring is None else ring[1]

    @staticmethod
    def _key(ring):
        return (ring[1], ring[0]) if ring[0] in ("wait", "arm") else None

    # -- counting ----------------------------------------------------------------------------
    def _count(self, state, key, op, facts, record):
        now = state.get(key, ZERO)
        if record:
            self.counts[op] = now
            self.facts[op] = facts
        state[key] = UNKNOWN if now is UNKNOWN else now + 1

    def _ops_of(self, block: ir.Block) -> list:
        """``block``'s ring ops, the virtual wait's op and the region ops around any of them:
        the rest leave every count as it is (a loop or ``scf.if`` without ring ops joins a
        state with itself), so the walk skips them. A loop's body is walked several times."""
        cache = self._extra if block in self._extra else self._kept
        kept = cache.get(block)
        if kept is None:
            counted = self._counted
            kept = cache[block] = [op for op in (view.operation for view in block.operations)
                                   if op in counted]
        return kept

    def _block(self, block: ir.Block, state: dict, facts: tuple, record: bool) -> dict:
        state = dict(state)
        for op in self._ops_of(block):
            if self.virtual is not None and op == self.virtual[0]:
                key = (self.virtual[1], "wait")
                if record:
                    self.virtual_count = state.get(key, ZERO)
                    self.facts[None] = facts
                now = state.get(key, ZERO)
                state[key] = UNKNOWN if now is UNKNOWN else now + 1
            ring = self._by_op.get(op)
            if ring is not None and self._key(ring) is not None:
                self._count(state, self._key(ring), op, facts, record)
            if op.name == "scf.for":
                state = self._loop(op, state, facts, record)
            elif op.name == "scf.if":
                cond = cond_facts(self.exprs, op.operands[0])
                arms = [self._block(b, state, facts + tuple(cond) if i == 0 else facts, record)
                        for i, r in enumerate(op.regions) for b in r.blocks]
                if len(arms) == 1:
                    arms.append(state)
                state = _join(*arms)
            else:
                for region in op.regions:
                    for b in region.blocks:
                        state = _join(state, self._block(b, state, facts, record))
        return state

    def _loop(self, op, state: dict, facts: tuple, record: bool) -> dict:
        body = op.regions[0].blocks[0]
        iv = body.arguments[0]
        lo, hi, step = (self.exprs.lin(v) for v in list(op.operands)[:3])
        ivl = self.exprs.lin(iv)
        inner = facts + (ivl - lo, hi - ivl - 1)
        probe = {k: Lin.atom(("entry", k)) if v is not UNKNOWN else UNKNOWN
                 for k, v in state.items()}
        keys = {self._key(r) for o, r in self.ops if self._key(r) is not None and _inside(o, op)}
        if self.virtual is not None and _inside(self.virtual[0], op):
            keys.add((self.virtual[1], "wait"))
        for k in keys:
            probe.setdefault(k, Lin.atom(("entry", k)))
        start, after = dict(state), dict(state)
        ends = self._block(body, probe, inner, record=False)
        for key in keys:
            start[key], after[key], per = self._induction(op, key, state.get(key, ZERO), probe,
                                                          ends, (lo, hi, step, ivl), facts,
                                                          inner)
            self.steps[(op, key)] = per
            if start[key] is not UNKNOWN and not start[key].is_const:
                inner = inner + (start[key],)  # a count is >= 0
        self._block(body, start, inner, record)
        return after

    def _induction(self, op, key, before, probe, ends, bounds, outer, facts):
        """``(count at the top of the body, count after the loop, events per iteration)``."""
        lo, hi, step, ivl = bounds
        if before is UNKNOWN:
            return UNKNOWN, UNKNOWN, UNKNOWN
        body = op.regions[0].blocks[0]
        term = body.operations[len(body.operations) - 1]
        for i, arg in enumerate(list(body.arguments)[1:]):
            if not isinstance(arg.type, (ir.IntegerType, ir.IndexType)):
                continue
            if self.exprs.lin(list(op.operands)[3 + i]) != before:
                continue
            carried = self.exprs.lin(arg)
            end = self._block(body, {**probe, key: carried}, facts, record=False).get(key)
            if end is not UNKNOWN and end == self.exprs.lin(term.operands[i]):
                per = end - carried
                steps = per.const if per.is_const else UNKNOWN
                return carried, self.exprs.lin(op.results[i]), steps
        end = ends.get(key)
        per = UNKNOWN if end is UNKNOWN else end - probe[key]
        if per is UNKNOWN or not per.is_const:
            return UNKNOWN, UNKNOWN, UNKNOWN
        if per.const == 0:
            return before, before, 0
        if step.is_const and step.const > 1:  # iv - lo is a multiple of the step
            return before + Lin.atom(("div", ivl - lo, step.const)).scale(per.const), UNKNOWN, \
                per.const
        if not (step.is_const and step.const == 1):
            return UNKNOWN, UNKNOWN, per.const
        trips = hi - lo
        after = before + trips.scale(per.const) \
            if nonneg(trips, tuple(outer) + floor_facts(self.exprs, trips)) else UNKNOWN
        return before + (ivl - lo).scale(per.const), after, per.const

    # -- what a wait names -------------------------------------------------------------------
    def named(self, op, ring) -> Named | None:
        """The use a wait (or, without parity, an arm) names; None where the index arithmetic
        is not one of the derivable forms (module docstring) or a division may be negative."""
        _, unit, slot, parity = ring
        stages = self.stages[unit]
        facts = self.facts.get(op, ())
        count = self.counts.get(op)
        facts = facts + ((count,) if count is not UNKNOWN and count is not None else ())
        s = Lin() if isinstance(unit, tuple) else self.exprs.lin(slot)
        by_slot = s.single("mod")
        if by_slot is not None and (by_slot[1] != stages or not nonneg(by_slot[0], facts)):
            return None
        if parity is None:
            if by_slot is not None:
                return Named(by_slot[0], stages, 0)
            return Named(s, stages, 0) if s.is_const else None
        e, flip = self.exprs.parity(parity)
        by_div = (e - e.const).single("div")
        if stages == 1 and by_div is None and not e.is_const:
            by_div = (e - e.const, 1)
        if by_div is not None:
            x, divisor = by_div
            if divisor != stages or not nonneg(x, facts):
                return None
            if by_slot is None:
                return Named(x, 2 * stages, (e.const + flip) % 2) if stages == 1 else None
            shift = x - by_slot[0]
            if not shift.is_const or shift.const % stages:
                return Named(by_slot[0], stages, -1)  # slot and parity name different uses
            return Named(by_slot[0], 2 * stages, (e.const + flip + shift.const // stages) % 2)
        if e.is_const and s.is_const:  # offset None: the parity bit is folded into n
            return Named(Lin(const=s.const + stages * ((e.const + flip) % 2)), 2 * stages, None)
        return None

    def guarded_arm(self, wait: ir.Operation):
        """The first arm after ``wait`` in its block (the use an empty wait guards), or None."""
        after = False
        for view in wait.block.operations:
            if view.operation == wait:
                after = True
            elif after:
                ring = self._by_op.get(view.operation)
                if ring is not None and ring[0] == "arm":
                    return view.operation, ring
        return None


def _with_ancestors(ops: list) -> set:
    """``ops`` and every op around one of them inside their ``gpu.func``."""
    found = set()
    for op in ops:
        while op.name != "gpu.func" and op not in found:
            found.add(op)
            op = op.parent.operation
    return found


def _inside(op, loop) -> bool:
    parent = op.parent
    while parent is not None:
        if parent.operation == loop:
            return True
        parent = parent.operation.parent
    return False


def _join(a: dict, b: dict) -> dict:
    """Counts both paths agree on; UNKNOWN elsewhere."""
    out = {}
    for key in set(a) | set(b):
        x, y = a.get(key, ZERO), b.get(key, ZERO)
        out[key] = x if x is not UNKNOWN and x == y else UNKNOWN
    return out


def expected_use(rings: Rings, op, ring):
    """``(use n, modulus)`` that a wait or arm must name (count / guarded arm), or None."""
    role, group = ring[0], ring[1]
    if role == "wait" and group in rings.empty:
        found = rings.guarded_arm(op)
        if found is None:
            return None
        arm, arm_ring = found
        count = rings.counts.get(arm)
        if count is not UNKNOWN and count is not None:
            return count, 1 << 62
        named = rings.named(arm, arm_ring)
        return None if named is None else (named.n, named.modulus)
    count = rings.counts.get(op)
    return None if count is UNKNOWN or count is None else (count, 1 << 62)


def ring_errors(func: ir.Operation) -> list[tuple[ir.Operation, str]]:
    """``(op, why)`` for each wait or arm whose slot or parity is not the use it must name."""
    rings = Rings(func)
    errors = []
    for op, ring in rings.ops:
        role, group = ring[0], ring[1]
        ringed = rings.full | rings.empty
        if role not in ("wait", "arm") or (role == "wait" and group not in ringed):
            continue
        stages = rings.stages[group]
        named = rings.named(op, ring)
        if named is None:
            continue
        full = group not in rings.empty
        want = 0 if full or role == "arm" else 1
        if named.offset == -1:
            errors.append((op, "its slot and its parity name different uses of the "
                               f"{stages}-stage ring"))
            continue
        if named.offset is None:  # constant slot and parity: the use at the expected offset
            named = Named(named.n - stages * want, named.modulus, want)
        elif stages == 1 and named.modulus == 2 and named.offset != want:
            # one slot: a parity's constant is the use's or the offset's; move it to the use
            named = Named(named.n + (named.offset - want), named.modulus, want)
        if named.modulus == 2 * stages and named.offset != want:
            kind, plus = ("a full", "") if full else ("an empty", " + 1")
            errors.append((op, f"its parity is flipped: a wait on {kind} ring for use n waits "
                               f"on parity (n // {stages}{plus}) % 2"))
            continue
        expected = expected_use(rings, op, ring)
        if expected is None:
            continue
        n, modulus = expected
        diff = named.n - n
        period = min(modulus, named.modulus)  # 1: a single-slot ring's arm names any use
        if period != 1 and (not diff.is_const or diff.const % period):
            if role == "wait" and not full:
                what = f"the arm after it opens use {show(n)}"
            else:
                what = f"it is {role} number {show(n)} on that ring in its thread"
            errors.append((op, f"it names use {show(named.n)} of the {stages}-stage ring, but "
                               f"{what}"))
    return errors


def show(e: Lin) -> str:
    """``e`` as text for messages: values by their IR names (``%arg9 + 1``)."""
    parts = []
    for atom, coeff in sorted(e.terms, key=str):
        text = atom[1].get_name() if atom[0] == "v" else \
            f"({show(atom[1])} {'//' if atom[0] == 'div' else '%'} {atom[2]})"
        parts.append(text if coeff == 1 else f"{coeff}*{text}")
    if e.const or not parts:
        parts.append(str(e.const))
    return " + ".join(parts)


# -- building the wait a gap needs -------------------------------------------------------------
def materialise(e: Lin) -> ir.Value:
    """Build ``e`` as an ``index`` value at the current insertion point (divisions unsigned:
    the proofs only divide counts, which are >= 0)."""
    index = ir.IndexType.get()
    total = arith.constant(index, e.const)
    for atom, coeff in sorted(e.terms, key=lambda t: str(t[0][0]) + str(t[1])):
        if atom[0] == "v":
            value = atom[1]
            if not isinstance(value.type, ir.IndexType):
                value = arith.index_cast(index, value)
        else:
            arg, divisor = materialise(atom[1]), arith.constant(index, atom[2])
            value = arith.divui(arg, divisor) if atom[0] == "div" else arith.remui(arg, divisor)
        if coeff != 1:
            value = arith.muli(value, arith.constant(index, coeff))
        total = arith.addi(total, value)
    return total


def build_wait(unit, n: Lin, stages: int, offset: int) -> None:
    """``try_wait`` on ring ``unit`` for use ``n`` at parity offset ``offset``, built here."""
    group, fixed = unit if isinstance(unit, tuple) else (unit, None)
    index, i1 = ir.IndexType.get(), ir.IntegerType.get_signless(1)
    if fixed is not None:  # an independent barrier of its group: a 1-stage ring
        parity = arith.constant(i1, (n.const + offset) % 2) if n.is_const else \
            slot_and_parity(n, 1, offset)[1]
        ticks = arith.constant(index, DEFAULT_TICKS)
        slot = arith.constant(index, fixed)
    else:
        slot, parity = slot_and_parity(n, stages, offset)
        ticks = arith.constant(index, DEFAULT_TICKS)
    nvgpu.mbarrier_try_wait_parity(group, parity, ticks, slot)


def slot_and_parity(n: Lin, stages: int, offset: int) -> tuple[ir.Value, ir.Value]:
    """``(n % S, (n // S + offset) % 2)`` as an index and an i1, built here."""
    index, i1 = ir.IndexType.get(), ir.IntegerType.get_signless(1)
    if n.is_const:
        return (arith.constant(index, n.const % stages),
                arith.constant(i1, (n.const // stages + offset) % 2))
    value = materialise(n)
    divisor = arith.constant(index, stages)
    wraps = arith.divui(value, divisor)
    parity = arith.trunci(i1, arith.index_cast(ir.IntegerType.get_signless(64), wraps))
    if offset:
        parity = arith.xori(parity, arith.constant(i1, 1))
    return arith.remui(value, divisor), parity
