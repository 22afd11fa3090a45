"""Which asynchronous events' register results reach a value, through forwarding ops and
loop-carried values (the read side of :class:`~kiln.passes.wait_analysis.WaitAnalysis`).

A value read by an op waits on every event whose result flows into it: through register data
movement (:data:`DATA_MOVES`), ``scf.for`` iter_args (the initial value and the yielded one)
and ``scf.if`` / ``scf.for`` results (each branch's yield; a loop's initial value, for a
zero-trip loop). The sets flow forward once over the op tree in program order (SSA: an operand
is defined before its use), each loop body again until its iter_args stop growing: the least
solution of those equations. Only the ops that forward or produce an event are kept for the
loops' later rounds, each as its operand and result values, read from the IR once; the other
values reach no event and are not stored.

Example::

    reaching = ReachingEvents({wgmma_op: step}, steps)   # steps: the analysis's op tree
    reaching(acc_value)          # {step} when acc_value forwards wgmma_op's result
"""

from __future__ import annotations

from mlir import ir

# Register data movement: the result is pending on whatever its operands are pending on.
DATA_MOVES = frozenset((
    "vector.shuffle", "vector.extract", "vector.extractelement", "vector.extract_strided_slice",
    "vector.insert", "vector.insertelement", "vector.insert_strided_slice", "vector.bitcast",
    "vector.shape_cast", "vector.broadcast", "vector.splat", "vector.from_elements",
    "vector.transpose", "vector.interleave", "vector.deinterleave", "arith.bitcast",
    "llvm.bitcast", "llvm.extractvalue", "llvm.insertvalue", "builtin.unrealized_conversion_cast"))

_NONE: frozenset = frozenset()


def _op_of(item) -> ir.Operation:
    """The op of an op tree item (a bare op, or an item with ``op``)."""
    return item if isinstance(item, ir.Operation) else item.op


class ReachingEvents:
    """``reaching(value)``: the set of events reaching ``value``. ``events`` maps each op whose
    register result is an event (an async MMA, a register load in flight) to that event;
    ``steps`` is the op tree (items with ``op``, ``kind`` and ``blocks``, lists of the same;
    or bare ops, with no region and no event)."""

    def __init__(self, events: dict, steps: list):
        self._events = events
        self._found: dict = {}  # ir.Value -> the events reaching it (values reaching some only)
        self.rounds = 0  # block programs run (the loops' rounds included), for tests
        self._run(self._program(steps))

    def __call__(self, value: ir.Value) -> frozenset:
        return self._found.get(value, _NONE)

    # -- the program: the ops that forward or produce events, with their values --------------
    def _program(self, steps: list) -> list:
        """``steps`` as instructions: ``("event", results, event)``, ``("move", results,
        operands)``, ``("for", results, inits, args, yields, body)``, ``("if", results,
        [(yields, body), ...])``, ``("region", bodies)``."""
        program = []
        for step in steps:
            if isinstance(step, ir.Operation):  # a plain op (no region, no declared effect)
                if step.name in DATA_MOVES:
                    program.append(("move", list(step.results), list(step.operands)))
                continue
            op = step.op
            if step.blocks:
                bodies = [self._program(block) for block in step.blocks]
                if step.kind == "for" and len(op.results):
                    term = _op_of(step.blocks[0][-1])
                    program.append(("for", list(op.results), list(op.operands)[3:],
                                    list(op.regions[0].blocks[0].arguments)[1:],
                                    list(term.operands), bodies[0]))
                elif step.kind == "if" and len(op.results):
                    program.append(("if", list(op.results),
                                    [(list(_op_of(block[-1]).operands), body)
                                     for block, body in zip(step.blocks, bodies)]))
                elif any(bodies):
                    program.append(("region", bodies))
                continue
            event = self._events.get(op)
            if event is not None:
                program.append(("event", list(op.results), frozenset((event,))))
            elif op.name in DATA_MOVES:
                program.append(("move", list(op.results), list(op.operands)))
        return program

    # -- running it ----------------------------------------------------------------------------
    def _union(self, values) -> frozenset:
        found = self._found
        out = _NONE
        for value in values:
            more = found.get(value)
            if more is not None and not more <= out:
                out = out | more
        return out

    def _set(self, values, events: frozenset) -> None:
        if events:
            for value in values:
                self._found[value] = events

    def _run(self, program: list) -> None:
        self.rounds += 1
        for item in program:
            kind = item[0]
            if kind == "move":
                self._set(item[1], self._union(item[2]))
            elif kind == "event":
                self._set(item[1], item[2])
            elif kind == "for":
                self._loop(*item[1:])
            elif kind == "if":
                _, results, arms = item
                for _, body in arms:
                    self._run(body)
                for n, result in enumerate(results):
                    self._set((result,), self._union(
                        [yields[n] for yields, _ in arms if n < len(yields)]))
            else:
                for body in item[1]:
                    self._run(body)

    def _loop(self, results, inits, args, yields, body) -> None:
        """Run ``body`` until its iter_args (initial value and yielded value) stop growing;
        each result is its initial value and its yielded value (a zero-trip loop)."""
        first = True
        while True:
            changed = False
            for init, arg, yielded in zip(inits, args, yields):
                now = self._union((arg, init, yielded))
                if now != self._found.get(arg, _NONE):
                    self._set((arg,), now)
                    changed = True
            if not (changed or first):
                break
            first = False
            self._run(body)
        for n, result in enumerate(results):
            self._set((result,), self._union((inits[n], yields[n])))
