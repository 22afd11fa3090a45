"""TMA pipelines: reads of a buffer that *another thread* TMA-loads, and its refills.

:class:`~kiln.passes.wait_analysis.WaitAnalysis` follows one thread's path, so a load issued by
a producer warp group (one arm of an ``scf.if``) never reaches the state of the consumer (the
other arm) that reads its buffer, and deleting the consumer's ``mbarrier.try_wait`` went
unnoticed. This module checks the handshake instead, over the same op tree:

- a consumer *acquires* mbarrier group G by waiting on it (``effects.mbarrier``, no counter);
- it *releases* the buffers of the loads signalling G by arriving on G's "empty" group E
  (``effects.arrives``), which ends the acquisition; E is the group the producer waits on just
  before issuing those loads (the nearest wait before the load in its block);
- a read (``Step.reads``) of a buffer TMA-loaded in another arm of an ``scf.if`` must find the
  load's G acquired on every path (a must-analysis: paths join by intersection; loops run to a
  fixed point).

A read that does not is a :class:`~kiln.passes.wait_analysis.Gap` on the load (counter
``mbarrier``). The producer's side of the hand-over (write after read) is checked for every TMA
load whose buffer other threads read: in another arm (warp-specialised) when the load is in a
loop, or on its own path (decode: one warp issues, every warp reads) in a loop around both
(or earlier on the path, outside such loops) unless the load runs only in that loop's first
iteration (under ``iv == lower bound``, e.g. ``it == 0``) and the read comes after it in the
loop body (a read before it runs in that first iteration too). Such a load must follow either, in
its block (or before a loop that reads no loaded buffer) and with no load on another mbarrier
group in between, a wait on an "empty" barrier (one that threads arrive on and no TMA load
completes): it refills the buffer only once the readers gave it back; or, for same-path
readers, a block-wide barrier with no read of its group since on any path (loops run to a
fixed point). Else it is a Gap with ``overwrite``
naming the load and a read it races with. Barrier indices are not told apart (stages of one
group are one group); the ``wgmma.wait_group`` before an arrive (the MMA must be done reading
before the release) is checked by the wait analysis where the arrive declares
``wgmma_pending`` (:meth:`kiln.mbarrier.MBarrierGroup.arrive`). Whether a wait names the right
use of its ring (slot and parity) is :mod:`kiln.passes.mbarrier_rings`'s proof.
"""

from __future__ import annotations

from mlir import ir

from kiln.core.ops import MBARRIER

PLACED = "placed"  # stands for the empty-ring wait kiln-insert-waits builds before a load's arm


def _arms(steps, path, out):
    """Record every step's arm path: ``((if step, arm index), ...)`` from the function down."""
    for step in steps:
        out[step] = path
        for i, block in enumerate(step.blocks):
            _arms(block, path + ((step, i),) if step.kind == "if" else path, out)


def _pairs(steps, out):
    """``out[G]``: the groups producers wait on right before issuing loads that signal G."""
    last_wait = None
    for step in steps:
        if step.signal is not None and step.counter is None:
            last_wait = step.signal[0]
        if step.counter == MBARRIER and last_wait is not None:
            out.setdefault(step.signal[0], set()).add(last_wait)
        for block in step.blocks:
            _pairs(block, out)


def _cross(a: tuple, b: tuple) -> bool:
    """Whether two arm paths part in different arms of one ``scf.if``."""
    arms = dict(a)
    return any(step in arms and arms[step] != arm for step, arm in b)


class _Walk:
    def __init__(self, body, make_gap):
        self.make_gap = make_gap
        self.arms = {}
        _arms(body, (), self.arms)
        self.released = {}  # E -> groups G whose buffers an arrive on E hands back
        pairs = {}
        _pairs(body, pairs)
        for group, empties in pairs.items():
            for empty in empties:
                self.released.setdefault(empty, set()).add(group)
        self.record = False
        self.gaps = []
        self.seen = set()

    def walk(self, steps, state: frozenset) -> frozenset:
        for step in steps:
            state = self.step(step, state)
        return state

    def step(self, step, state: frozenset) -> frozenset:
        if self.record:
            self.check(step, state)
        if step.kind == "for":
            record, self.record = self.record, False
            header = state
            for _ in range(64):  # a finite lattice: the bound is never reached
                nxt = state & self.walk(step.blocks[0], header)
                if nxt == header:
                    break
                header = nxt
            self.record = record
            return state & self.walk(step.blocks[0], header)
        if step.kind == "if":
            arms = [self.walk(b, state) for b in step.blocks]
            return frozenset.intersection(*arms, *([state] if len(arms) == 1 else []))
        if step.signal is not None and step.counter is None:
            state = state | {step.signal[0]}
        if step.arrive is not None:
            state = state - self.released.get(step.arrive, set())
        for block in step.blocks:
            state = state & self.walk(block, state)
        return state

    def check(self, step, state: frozenset) -> None:
        for event in step.reads:
            if event.counter != MBARRIER or event.signal[0] in state:
                continue
            key = (step.op, event.signal[0])
            if key in self.seen or not _cross(self.arms[event], self.arms[step]):
                continue
            self.seen.add(key)
            self.gaps.append(self.make_gap(step.op, event.op, MBARRIER, 0, step.op))


def _constant(value):
    """The value of an ``arith.constant`` index or integer, else None."""
    if not isinstance(value, ir.OpResult) or value.owner.name != "arith.constant":
        return None
    return ir.IntegerAttr(value.owner.attributes["value"]).value


def _first_only(if_step, loop) -> bool:
    """Whether the first arm of ``if_step`` runs only in the first iteration of ``loop``: its
    condition is a conjunction (``arith.andi``) with a term ``iv == lower bound``."""
    iv, lower = loop.op.regions[0].blocks[0].arguments[0], loop.op.operands[0]

    def first(value) -> bool:
        if not isinstance(value, ir.OpResult):
            return False
        op = value.owner
        if op.name == "arith.andi":
            return any(first(operand) for operand in op.operands)
        if op.name != "arith.cmpi" or ir.IntegerAttr(op.attributes["predicate"]).value != 0:
            return False  # predicate 0 is eq
        a, b = op.operands
        for x, y in ((a, b), (b, a)):
            if x == iv and (y == lower or _constant(y) is not None
                            and _constant(y) == _constant(lower)):
                return True
        return False

    return first(if_step.op.operands[0])


def _loops_of(steps, loops: tuple, out: dict) -> None:
    """``out[step]``: the loops around each step, outermost first."""
    for step in steps:
        out[step] = loops
        for block in step.blocks:
            _loops_of(block, loops + ((step,) if step.kind == "for" else ()), out)


def _preorder(steps, out: dict) -> None:
    """``out[step]``: the step's place in program order (a region op before its body)."""
    for step in steps:
        out[step] = len(out)
        for block in step.blocks:
            _preorder(block, out)


def _reads_loads(blocks) -> bool:
    """Whether any step in ``blocks`` reads a TMA-loaded buffer."""
    return any(any(e.counter == MBARRIER for e in step.reads) or _reads_loads(step.blocks)
               for block in blocks for step in block)


def _loaded_groups(blocks) -> set:
    """The mbarrier groups that TMA loads in ``blocks`` signal."""
    return {step.signal[0] for block in blocks for step in block
            if step.counter == MBARRIER} | {g for block in blocks for step in block
                                           for g in _loaded_groups(step.blocks)}


def _producer_gaps(body, arms: dict, make_gap, placed=frozenset()) -> dict:
    """The overwrite gaps of the TMA loads (load Step -> Gap, in walk order; module
    docstring). The loads in ``placed`` count as having a wait on their empty ring before
    their arm (one kiln-insert-waits is about to build): it hands back their buffers and those
    of the same group's loads after them."""
    readers, arrived, signalled = {}, set(), set()
    loops, order = {}, {}
    _loops_of(body, (), loops)
    _preorder(body, order)

    def index(steps):
        for step in steps:
            for event in step.reads:
                if event.counter == MBARRIER:
                    readers.setdefault(event, []).append(step)
            if step.arrive is not None:
                arrived.add(step.arrive)
            if step.counter == MBARRIER:
                signalled.add(step.signal[0])
            for block in step.blocks:
                index(block)

    index(body)
    empty = arrived - signalled  # barriers readers hand buffers back on (no TMA completes them)
    gaps = {}  # load Step -> Gap: loop bodies are walked to a fixed point

    def racing(load, first: frozenset):
        """The first reader that may still read ``load``'s buffer when it issues, if any: one
        in another arm when ``load`` is in a loop, or on its path unless every loop around both
        runs ``load`` only in its first iteration and the read comes after it in the body (the
        read set then tells if it came before; one before it runs in that first iteration
        too, before the load, and races with it)."""
        for reader in readers.get(load, ()):
            common = set(loops[load]) & set(loops[reader])
            if _cross(arms[load], arms[reader]):
                if loops[load]:
                    return reader
            elif common - first or not (common or first) or (
                    common and order[reader] < order[load]):  # read earlier in that iteration
                return reader
        return None

    def visit(steps, last_wait, loaded: set, read: frozenset, first: frozenset) -> frozenset:
        """Walk ``steps`` in order from ``read`` (the groups whose buffers some thread may have
        read since the last block-wide barrier, on some path); returns it after them."""
        for step in steps:
            if step.barrier:
                read = frozenset()
            if step.signal is not None and step.counter is None:
                last_wait, loaded = step.signal[0], set()
            elif step.counter == MBARRIER:
                group = step.signal[0]
                if step in placed:
                    last_wait, loaded = PLACED, set()
                reader = racing(step, first)
                handed_back = (last_wait is PLACED or last_wait in empty) and loaded <= {group}
                fenced = group not in read and not _cross(arms[step], arms[reader or step])
                if reader is not None and not handed_back and not fenced:
                    gaps.setdefault(step, make_gap(step.op, reader.op, MBARRIER, 0, step.op,
                                                   overwrite=True))
                loaded = loaded | {group}
            read = read | {e.signal[0] for e in step.reads if e.counter == MBARRIER}
            if step.kind == "for":  # the body starts from its own end state
                # a loop reading no loaded buffer (a load per page) stays under the wait before it
                start = (None, set()) if _reads_loads(step.blocks) else (
                    last_wait, loaded | _loaded_groups(step.blocks))  # earlier iterations' too
                entry = read
                for _ in range(64):  # a finite lattice: the bound is never reached
                    joined = entry | visit(step.blocks[0], *start, entry, first)
                    if joined == entry:
                        break
                    entry = joined
                read = entry
            else:
                before = read  # each arm starts from the state before the op
                for i, block in enumerate(step.blocks):
                    only = frozenset(loop for loop in loops[step] if i == 0 and
                                     step.kind == "if" and _first_only(step, loop))
                    read = read | visit(block, last_wait, loaded, before, first | only)
        return read

    visit(body, None, set(), frozenset(), frozenset())
    return gaps


def cross_thread_gaps(body, make_gap, *, placing: bool = False) -> list:
    """The reads in ``body`` (a WaitAnalysis op tree) of buffers TMA-loaded by another thread
    with no acquisition of the load's mbarrier on every path (module docstring), each made by
    ``make_gap`` (the analysis's Gap class, passed in so this module need not import it), then
    the loads that may overwrite a buffer before its readers hand it back.

    With ``placing`` (kiln-insert-waits), the loads' gaps are the ones its walks would close
    one at a time, each found as if the waits for those before it were built: a wait before a
    load's arm hands back the buffers of the same group's loads after it too, and no such
    wait changes a read's gap or another load's arm count, so one walk places them all."""
    def has_load(steps) -> bool:
        return any(s.counter == MBARRIER or any(has_load(b) for b in s.blocks) for s in steps)

    if not has_load(body):
        return []
    walk = _Walk(body, make_gap)
    walk.record = True
    walk.walk(body, frozenset())
    if not placing:
        return walk.gaps + list(_producer_gaps(body, walk.arms, make_gap).values())
    if walk.gaps:  # kiln-insert-waits places the first reader's wait; the loads' come later
        return walk.gaps
    placed: dict = {}  # load Step -> its Gap, in the order they are found
    while True:
        found = _producer_gaps(body, walk.arms, make_gap, frozenset(placed))
        if not found:
            return list(placed.values())
        load = next(iter(found))
        placed[load] = found[load]
