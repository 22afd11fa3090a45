"""``kiln-insert-waits``: place the fewest counter waits that make every async read safe.

The analysis (shared with ``kiln-verify-waits``) is a forward dataflow over each ``gpu.func``.
Its state maps every *tracked* asynchronous operation that may still be outstanding to the
number of same-counter operations issued after it ("younger"), minimised over paths. A wait
``counter(N)`` retires every event with ``younger >= N`` (the counters retire in order).

Tracked events (each is exactly one hardware instruction, so counts are exact):

- AMD ``vmcnt``: ``rocdl.global.load.lds``, ``rocdl.raw.ptr.buffer.load[.lds]``,
  ``rocdl.load.to.lds``, ``rocdl.global.load.tr*``, ``amdgpu.raw_buffer_load``,
  ``amdgpu.gather_to_lds``, and any op tagged ``kiln.async = "vmcnt"``;
- AMD ``lgkmcnt``: ``rocdl.ds.read.tr*``, ``rocdl.ds_bpermute``, ops tagged ``kiln.async = "lgkmcnt"``;
- NVIDIA ``cp.async`` groups: ``nvgpu.device_async_create_group`` over ``nvgpu.device_async_copy``.

Plain ``memref``/``vector`` loads and stores (global and LDS) also use ``vmcnt``/``lgkmcnt``
but LLVM may merge, split or scalarise them, so they are *not counted*: leaving them out only
makes a computed wait stricter, never unsafe. Their register results are LLVM's job
(SIInsertWaitcnts); ``kiln-verify-waits`` re-checks them on the final assembly.

A read needs an event retired when it uses the event's result (through ``scf`` yields too),
when it touches a buffer the event writes asynchronously (global->LDS DMA, ``cp.async``;
buffers are told apart by their root: ``memref.get_global`` symbol or kernel argument), or
when it carries ``kiln.waits_for = [tokens]`` naming ``kiln.token`` ids. The wait goes before
the last barrier between the write and the read when one exists on that path (other waves read
what this wave's DMA wrote only after the barrier), else right before the read. ``scf.for``
bodies run to a fixed point (steady state across the back-edge); ``scf.if`` joins both arms.

Waits already in the IR (``rocdl.s.waitcnt``, ``nvgpu.device_async_wait``, ``amdgpu.lds_barrier``)
are kept and counted. Under ``kiln.consumer_drain`` (or a recipe's ``drain``) every cluster that
holds MFMA work opens with ``s_waitcnt lgkmcnt(0)``. Functions marked ``kiln.manual_waits`` are
left alone (the verifier still checks them).

Example::

    rocdl.global.load.lds %g, %lds, 16, 0, 0 : !llvm.ptr<1>    // DMA into @tile
    rocdl.global.load.lds %g2, %lds2, 16, 0, 0 : !llvm.ptr<1>  // DMA into @other
    // inserted: rocdl.s.waitcnt 3953   (vmcnt(1): one younger DMA may stay in flight)
    %x = memref.load %tile[%i] : memref<256xf32, 3>
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import nvgpu, rocdl

from kiln.passes import register_pass

NAME = "kiln-insert-waits"

# GFX9 (gfx90a/gfx942/gfx950) s_waitcnt simm16 layout:
#   bits 3:0 vmcnt[3:0], 6:4 expcnt, 11:8 lgkmcnt, 15:14 vmcnt[5:4].
GFX9_MAX = {"vmcnt": 63, "expcnt": 7, "lgkmcnt": 15}
CP_ASYNC = "cp_async_group"


def encode_gfx9_waitcnt(*, vmcnt: int = 63, expcnt: int = 7, lgkmcnt: int = 15) -> int:
    """The ``s_waitcnt`` immediate for gfx942/gfx950 (an omitted counter is not waited on).

    >>> encode_gfx9_waitcnt(vmcnt=0) == 0x0F70
    True
    """
    return (vmcnt & 0xF) | ((expcnt & 0x7) << 4) | ((lgkmcnt & 0xF) << 8) | ((vmcnt >> 4) << 14)


def decode_gfx9_waitcnt(imm: int) -> dict[str, int]:
    """Inverse of :func:`encode_gfx9_waitcnt`."""
    return {"vmcnt": (imm & 0xF) | ((imm >> 14) & 0x3) << 4, "expcnt": (imm >> 4) & 0x7,
            "lgkmcnt": (imm >> 8) & 0xF}


VMCNT_OPS = ("rocdl.global.load.lds", "rocdl.raw.ptr.buffer.load", "rocdl.raw.ptr.buffer.load.lds",
             "rocdl.load.to.lds", "amdgpu.raw_buffer_load", "amdgpu.gather_to_lds")
LDS_WRITING_OPS = ("rocdl.global.load.lds", "rocdl.raw.ptr.buffer.load.lds", "rocdl.load.to.lds",
                   "amdgpu.gather_to_lds")
BARRIER_OPS = ("rocdl.s.barrier", "gpu.barrier", "amdgpu.lds_barrier", "nvvm.barrier",
               "nvvm.barrier0")
MMA_PREFIXES = ("amdgpu.mfma", "amdgpu.scaled_mfma", "rocdl.mfma", "amdgpu.wmma",
                "nvgpu.warpgroup.mma", "nvvm.wgmma.mma_async")
# Ops that only forward a pointer/buffer: the root of a buffer is found through them.
_FORWARDING = ("memref.subview", "memref.cast", "memref.reinterpret_cast", "memref.view",
               "memref.extract_aligned_pointer_as_index", "memref.memory_space_cast",
               "memref.assume_alignment", "memref.collapse_shape", "memref.expand_shape",
               "arith.index_cast", "arith.index_castui", "arith.addi", "llvm.inttoptr",
               "llvm.ptrtoint", "llvm.getelementptr", "llvm.addrspacecast",
               "builtin.unrealized_conversion_cast", "amdgpu.fat_raw_buffer_cast",
               "rocdl.make.buffer.rsrc")


def op_counter(op: ir.Operation) -> str | None:
    """The counter a tracked async op increments, or None if the op is not tracked."""
    if "kiln.async" in op.attributes:
        return ir.StringAttr(op.attributes["kiln.async"]).value
    name = op.name
    if name in VMCNT_OPS or name.startswith("rocdl.global.load.tr"):
        return "vmcnt"
    if name.startswith("rocdl.ds.read.tr") or name == "rocdl.ds_bpermute":
        return "lgkmcnt"
    if name == "nvgpu.device_async_create_group":
        return CP_ASYNC
    return None


def buffer_root(value: ir.Value):
    """A hashable name for the buffer ``value`` points into: ``("global", sym)``,
    ``("arg", n)`` or ``("op", op)``; None when unknown (aliases every buffer)."""
    seen = 0
    while seen < 64:
        seen += 1
        if isinstance(value.owner, ir.Block):
            return ("arg", ir.BlockArgument(value).arg_number) if _is_entry(value.owner) else None
        op = value.owner.operation  # OpView.name may be an attribute (memref.get_global's)
        if op.name == "memref.get_global":
            return ("global", ir.FlatSymbolRefAttr(op.attributes["name"]).value)
        if op.name in ("memref.alloc", "memref.alloca"):
            return ("op", op)
        if op.name not in _FORWARDING or not op.operands:
            return None
        value = op.operands[0]
    return None


def _is_entry(block: ir.Block) -> bool:
    owner = block.owner
    return owner is not None and owner.operation.name == "gpu.func"


def _is_lds(value: ir.Value) -> bool:
    """Shared memory (LDS) memref or pointer: the only memory async copies write here."""
    return _space(value) == 3 or str(value.type) == "!llvm.ptr<3>"


def written_roots(op: ir.Operation) -> tuple | None:
    """Buffers an async op writes behind the program's back; None if it only writes registers."""
    if op.name == "nvgpu.device_async_create_group":
        copies = [t.owner.operation for t in op.operands if not isinstance(t.owner, ir.Block)]
        return tuple(buffer_root(c.operands[0]) for c in copies
                     if c.name == "nvgpu.device_async_copy")
    if op.name in LDS_WRITING_OPS:
        lds = [v for v in op.operands if _is_lds(v)]
        return tuple(buffer_root(v) for v in lds) or (None,)
    if "kiln.async" in op.attributes and len(op.results) == 0:
        return tuple(buffer_root(v) for v in op.operands if _space(v) == 3) or (None,)
    return None


def _space(value: ir.Value) -> int | None:
    if not isinstance(value.type, ir.MemRefType):
        return None
    space = ir.MemRefType(value.type).memory_space
    if space is None:
        return None
    if isinstance(space, ir.IntegerAttr):
        return space.value
    return 3 if "workgroup" in str(space) else None  # #gpu.address_space<workgroup> is LDS


@dataclass(frozen=True)
class Pending:
    """One outstanding event: younger same-counter events, the last barrier since it issued."""

    younger: int
    barrier: object = None  # ir.Operation or None


@dataclass
class Gap:
    """A read that no wait covers: the read, the event, and where the wait should go."""

    reader: ir.Operation
    event: ir.Operation
    counter: str
    count: int
    place_before: ir.Operation


State = dict  # event op -> Pending


def _join(a: State, b: State) -> State:
    out = dict(a)
    for key, pend in b.items():
        if key in out:
            other = out[key]
            out[key] = Pending(min(pend.younger, other.younger),
                               pend.barrier if pend.barrier == other.barrier else None)
        else:
            out[key] = pend
    return out


class WaitAnalysis:
    """Forward dataflow over one ``gpu.func``; ``gaps`` lists the uncovered reads in walk order."""

    def __init__(self, func: ir.Operation, vendor: str):
        self.vendor = vendor
        self.counters: dict = {}  # event op -> counter
        self.roots: dict = {}     # event op -> written roots or None
        self.tokens: dict = {}    # kiln.token id -> event op
        self.gaps: list[Gap] = []
        self._record = True
        body = func.regions[0].blocks[0]
        self._walk_block(body, {})

    # -- transfer functions ------------------------------------------------------------------
    def _walk_block(self, block: ir.Block, state: State) -> State:
        for op in block.operations:
            state = self._transfer(op.operation, state)
        return state

    def _transfer(self, op: ir.Operation, state: State) -> State:
        name = op.name
        if name == "scf.for":
            return self._loop(op, state)
        if name == "scf.if":
            arms = [self._walk_block(r.blocks[0], dict(state)) for r in op.regions if r.blocks]
            if len(arms) == 1:
                arms.append(state)  # no else arm: the condition may skip the then arm
            return _join(arms[0], arms[1])
        self._check_reads(op, state)
        state = self._apply_wait(op, state)
        if name in BARRIER_OPS:
            state = {k: Pending(p.younger, op) for k, p in state.items()}
        counter = op_counter(op)
        if counter is not None:
            state = self._issue(op, counter, state)
        for region in op.regions:  # unknown region ops: walk once from the current state
            for block in region.blocks:
                state = _join(state, self._walk_block(block, dict(state)))
        return state

    def _loop(self, op: ir.Operation, state: State) -> State:
        body = op.regions[0].blocks[0]
        record, self._record = self._record, False
        header = dict(state)
        for _ in range(64):  # the state lattice is finite; this bound is never reached in practice
            nxt = _join(state, self._walk_block(body, dict(header)))
            if nxt == header:
                break
            header = nxt
        self._record = record
        return _join(state, self._walk_block(body, dict(header)))

    def _issue(self, op: ir.Operation, counter: str, state: State) -> State:
        self.counters[op] = counter
        self.roots[op] = written_roots(op)
        if "kiln.token" in op.attributes:
            self.tokens[ir.IntegerAttr(op.attributes["kiln.token"]).value] = op
        out = {k: (Pending(p.younger + 1, p.barrier) if self.counters[k] == counter else p)
               for k, p in state.items() if k != op}
        out[op] = Pending(0)
        return out

    def _apply_wait(self, op: ir.Operation, state: State) -> State:
        limits = wait_limits(op)
        if not limits:
            return state
        return {k: p for k, p in state.items()
                if not (self.counters[k] in limits and p.younger >= limits[self.counters[k]])}

    # -- reads ------------------------------------------------------------------------------
    def _check_reads(self, op: ir.Operation, state: State) -> None:
        if not state or not self._record:
            return
        needed = set()
        for operand in op.operands:
            needed |= self._producers(operand, state)
            if _is_lds(operand) and op_counter(op) is None:
                root = buffer_root(operand)
                needed |= {k for k in state if self.roots[k] is not None
                           and _aliases(root, self.roots[k])}
        if "kiln.waits_for" in op.attributes:
            for token in ir.ArrayAttr(op.attributes["kiln.waits_for"]):
                event = self.tokens.get(ir.IntegerAttr(token).value)
                if event is not None and event in state:
                    needed.add(event)
        for event in sorted(needed, key=lambda k: state[k].younger):
            pend = state[event]
            counter = self.counters[event]
            cap = GFX9_MAX.get(counter, 7)
            self.gaps.append(Gap(op, event, counter, min(pend.younger, cap),
                                 pend.barrier if self.roots[event] and pend.barrier else op))

    def _producers(self, value: ir.Value, state: State, depth: int = 0) -> set:
        if depth > 8:
            return set()
        owner = value.owner
        if isinstance(owner, ir.Block):
            parent = owner.owner.operation if owner.owner is not None else None
            if parent is not None and parent.name == "scf.for":
                n = ir.BlockArgument(value).arg_number - 1  # argument 0 is the induction variable
                if n < 0:
                    return set()
                yielded = owner.operations[len(owner.operations) - 1].operands[n]
                return (self._producers(parent.operands[3 + n], state, depth + 1)
                        | self._producers(yielded, state, depth + 1))
            return set()
        owner = owner.operation
        if owner in state and self.roots.get(owner) is None:
            return {owner}
        if owner.name in ("scf.for", "scf.if"):
            n = ir.OpResult(value).result_number
            found = set()
            for region in owner.regions:
                for block in region.blocks:
                    term = block.operations[len(block.operations) - 1]
                    if n < len(term.operands):
                        found |= self._producers(term.operands[n], state, depth + 1)
            return found
        return set()


def _aliases(root, written: tuple) -> bool:
    return any(root is None or w is None or root == w for w in written)


def wait_limits(op: ir.Operation) -> dict[str, int]:
    """Counter -> N for a wait op (the counters it does not wait on are absent)."""
    if op.name == "rocdl.s.waitcnt":
        decoded = decode_gfx9_waitcnt(ir.IntegerAttr(op.attributes["bitfield"]).value)
        return {c: n for c, n in decoded.items() if n < GFX9_MAX[c]}
    if op.name == "amdgpu.lds_barrier":
        return {"lgkmcnt": 0}
    if op.name == "nvgpu.device_async_wait":
        groups = op.attributes["numGroups"] if "numGroups" in op.attributes else None
        return {CP_ASYNC: ir.IntegerAttr(groups).value if groups is not None else 0}
    return {}


def func_vendor(func: ir.Operation) -> str | None:
    """``"amd"``/``"nvidia"`` from ``kiln.target``, the gpu.module target, or the ops used."""
    if "kiln.target" in func.attributes:
        return "nvidia" if ir.StringAttr(func.attributes["kiln.target"]).value.startswith("sm_") else "amd"
    module = func.parent.operation if func.parent is not None else None
    if module is not None and "targets" in module.attributes:
        text = str(module.attributes["targets"])
        if "rocdl" in text or "nvvm" in text:
            return "amd" if "rocdl" in text else "nvidia"
    seen = []

    def visit(op):
        if op.name.startswith(("rocdl.", "amdgpu.")):
            seen.append("amd")
        elif op.name.startswith(("nvgpu.", "nvvm.")):
            seen.append("nvidia")
        return ir.WalkResult.ADVANCE

    func.walk(visit, ir.WalkOrder.PRE_ORDER)
    return seen[0] if seen else None


def gpu_funcs(module_op: ir.Operation) -> list[ir.Operation]:
    funcs = []

    def visit(op):
        if op.name == "gpu.func":
            funcs.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    module_op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return funcs


def _build_wait(gap: Gap) -> None:
    with ir.InsertionPoint(gap.place_before), gap.reader.location:
        if gap.counter == CP_ASYNC:
            nvgpu.device_async_wait(gap.event.result, num_groups=gap.count)
        else:
            rocdl.s_waitcnt(encode_gfx9_waitcnt(**{gap.counter: gap.count}))


def _insert_drains(func: ir.Operation) -> None:
    from kiln.passes.cluster_schedule import cluster_spans, recipes_of

    recipes = recipes_of(func)
    drain_all = "kiln.consumer_drain" in func.attributes
    for span in cluster_spans(func):
        recipe = recipes.get(span.cluster)
        if not (drain_all and span.has_mma() or recipe is not None and recipe.drain_lgkm):
            continue
        first = span.first_work_op()
        if first is not None and wait_limits(first) != {"lgkmcnt": 0}:
            with ir.InsertionPoint(first), first.location:
                drain = rocdl.s_waitcnt(encode_gfx9_waitcnt(lgkmcnt=0))
            drain.operation.attributes["kiln.cluster"] = first.attributes["kiln.cluster"]


def insert_waits(module_op: ir.Operation, pass_=None) -> None:
    """Insert waits until the analysis finds no gap, in every gpu.func not marked manual."""
    for func in gpu_funcs(module_op):
        vendor = func_vendor(func)
        if vendor is None or "kiln.manual_waits" in func.attributes:
            continue
        if vendor == "amd":
            _insert_drains(func)
        for _ in range(10_000):
            gaps = WaitAnalysis(func, vendor).gaps
            if not gaps:
                break
            _build_wait(gaps[0])


register_pass(NAME, insert_waits,
              "Insert the fewest s_waitcnt / cp.async waits covering every async read")
