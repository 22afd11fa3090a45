"""Which asynchronous events' register results reach a value, through forwarding ops and
loop-carried values (the read side of :class:`~kiln.passes.wait_analysis.WaitAnalysis`).

A value read by an op waits on every event whose result flows into it: through register data
movement (:data:`DATA_MOVES`), ``scf.for`` iter_args (the initial value and the yielded one)
and ``scf.if`` / ``scf.for`` results (each branch's yield; a loop's initial value, for a
zero-trip loop). The walk is memoised per strongly connected component (Tarjan), so an
unrolled pipeline's interleaved loop cycles are walked once.

Example::

    reaching = ReachingEvents({wgmma_op: step})
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


class ReachingEvents:
    """``reaching(value)``: the set of events reaching ``value``. ``events`` maps each op whose
    register result is an event (an async MMA, a register load in flight) to that event."""

    def __init__(self, events: dict):
        self._events = events
        self._found: dict = {}  # ir.Value -> the events reaching it

    def __call__(self, value: ir.Value) -> set:
        found = self._found.get(value)
        if found is None:
            self._components(value)
            found = self._found[value]
        return found

    def _components(self, root: ir.Value) -> None:
        """Memoise the events reaching every value met from ``root``, one strongly connected
        component at a time: values of one loop-carried cycle reach the same events, so each
        is walked once however many cycles an unrolled pipeline interleaves."""
        index: dict = {}
        low: dict = {}
        stack: list = []
        edges: dict = {}  # value -> (events it reads directly, values it forwards)

        def visit(value) -> None:
            index[value] = low[value] = len(index)
            stack.append(value)
            direct, forwarded = set(), []
            for source in self.sources(value):
                if not isinstance(source, ir.Value):
                    direct.add(source)
                elif source in self._found:  # a finished component
                    direct |= self._found[source]
                else:
                    if source not in index:
                        visit(source)
                        low[value] = min(low[value], low[source])
                    elif source not in self._found:  # still on the stack
                        low[value] = min(low[value], index[source])
                    forwarded.append(source)
            edges[value] = (direct, forwarded)
            if low[value] != index[value]:
                return
            component = [stack.pop()]
            while component[-1] != value:
                component.append(stack.pop())
            found = set()
            for member in component:
                direct, forwarded = edges[member]
                found |= direct
                for source in forwarded:  # members of this component add nothing new
                    found |= self._found.get(source, set())
            for member in component:
                self._found[member] = found

        visit(root)

    def sources(self, value: ir.Value) -> list:
        """What feeds ``value``: the event that produced it, or the values it forwards."""
        owner = value.owner
        if isinstance(owner, ir.Block):
            parent = owner.owner.operation if owner.owner is not None else None
            n = ir.BlockArgument(value).arg_number - 1  # scf.for argument 0 is the induction var
            if parent is None or parent.name != "scf.for" or n < 0:
                return []
            yielded = owner.operations[len(owner.operations) - 1].operands[n]
            return [parent.operands[3 + n], yielded]
        op = owner.operation
        event = self._events.get(op)
        if event is not None:
            return [event]
        if op.name in DATA_MOVES:
            return list(op.operands)
        if op.name not in ("scf.for", "scf.if"):
            return []
        n = ir.OpResult(value).result_number
        sources = [op.operands[3 + n]] if op.name == "scf.for" else []  # zero-trip loop
        for region in op.regions:
            for block in region.blocks:
                term = block.operations[len(block.operations) - 1]
                if n < len(term.operands):
                    sources.append(term.operands[n])
        return sources
