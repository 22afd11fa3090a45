"""What one op does to the async counters and shared buffers, read from its declaration
(:mod:`kiln.core.ops`): the queries :mod:`kiln.passes.wait_analysis` and the wait passes ask
of single ops, and the buffer roots that tell shared buffers apart."""

from __future__ import annotations

from collections import deque

from mlir import ir
from mlir.dialects import llvm  # also registers the class !llvm.ptr types are returned as

from kiln.core.ops import NO_EFFECTS, OP_ATTR, Effects, all_ops, is_shared, lookup_named

# Ops that only forward a pointer/buffer: the root of a buffer is found through them.
_FORWARDING = ("memref.subview", "memref.cast", "memref.reinterpret_cast", "memref.view",
               "memref.extract_aligned_pointer_as_index", "memref.memory_space_cast",
               "memref.assume_alignment", "memref.collapse_shape", "memref.expand_shape",
               "arith.index_cast", "arith.index_castui", "arith.addi", "llvm.inttoptr",
               "llvm.ptrtoint", "llvm.getelementptr", "llvm.addrspacecast",
               "builtin.unrealized_conversion_cast", "amdgpu.fat_raw_buffer_cast",
               "rocdl.make.buffer.rsrc")
# Ops that take a buffer without touching its memory.
NO_ACCESS = frozenset(_FORWARDING + ("memref.dim", "memref.rank", "memref.get_global",
                                      "memref.extract_strided_metadata"))


def effects(op: ir.Operation) -> Effects:
    """The declared effects of ``op``; an op tagged ``kiln.async`` (mark_async) declares its
    counter on itself, and one without results writes the shared buffers among its operands."""
    return named_effects(op, op.name, op.attributes)


def named_effects(op: ir.Operation, name: str, attrs) -> Effects:
    """:func:`effects` given the op's name and attributes (read once by the caller)."""
    opdef = lookup_named(name, attrs)
    if "kiln.async" not in attrs:
        return NO_EFFECTS if opdef is None else opdef.effects
    counter = ir.StringAttr(attrs["kiln.async"]).value
    writes = None if len(op.results) else (lambda o: tuple(v for v in o.operands if is_shared(v)))
    return Effects(counter=counter, writes=writes)


def may_declare(field: str):
    """A cheap filter before :func:`effects`: ``test(op)`` is False only for ops whose
    declared effects leave ``field`` unset (looked up by MLIR name, not tagged ``kiln.op``),
    from the registry as it is now. Example: ``ringed = may_declare("ring")``."""
    names = frozenset(name for opdef in all_ops() if getattr(opdef.effects, field) is not None
                      for name in opdef.mlir_names)
    return lambda op: op.name in names or OP_ATTR in op.attributes


def op_counter(op: ir.Operation) -> str | None:
    """The counter a tracked async op increments, or None if the op is not tracked."""
    return effects(op).counter


def wait_limits(op: ir.Operation) -> dict[str, int]:
    """Counter -> N for a wait op (the counters it does not wait on are absent)."""
    waits = effects(op).waits
    return {} if waits is None else waits(op)


def mbarrier_of(op: ir.Operation) -> tuple | None:
    """``(group value, constant index or None)`` a TMA load signals or a try_wait waits on."""
    read = effects(op).mbarrier
    return None if read is None else read(op)


def op_label(op: ir.Operation) -> str:
    """How messages name ``op``: its declared name for inline asm (``kiln.op``), else its MLIR
    name."""
    return ir.StringAttr(op.attributes[OP_ATTR]).value if OP_ATTR in op.attributes else op.name


def is_mbarrier_wait(op: ir.Operation) -> bool:
    """Whether ``op`` waits on an mbarrier (declares a barrier and no counter)."""
    found = effects(op)
    return found.mbarrier is not None and found.counter is None


def same_mbarrier(a: tuple, b: tuple) -> bool:
    """Whether two barrier references may name the same mbarrier (indices are told apart only
    when both are constants)."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


NOT_SHARED = object()  # BufferRoots.shared of a value that is no shared-memory buffer


class BufferRoots:
    """The buffer queries of one function's operands, memoised (an operand is read by several
    ops, and WGMMAs' descriptors share most of their slices). Example::

        roots = BufferRoots()
        roots.shared(value)        # buffer_root(value) for a shared buffer, else NOT_SHARED
        roots.descriptors(desc)    # the shared buffers a WGMMA descriptor is computed from
    """

    def __init__(self):
        self._shared: dict = {}       # ir.Value -> buffer_root, or NOT_SHARED
        self._descriptors: dict = {}  # ir.Value -> descriptor roots
        self._edges: dict = {}        # ir.Value -> its owner's operands: (shared roots, others)

    def shared(self, value: ir.Value):
        """:func:`buffer_root` of a shared-memory (LDS) operand, else NOT_SHARED."""
        root = self._shared.get(value, self)
        if root is self:
            root = self._shared[value] = buffer_root(value) if is_shared(value) else NOT_SHARED
        return root

    def descriptors(self, value: ir.Value) -> tuple:
        """Shared buffers a descriptor value is computed from: its backward slice, breadth
        first (the base descriptor sits a hop or two above the stage offset's arithmetic), 256
        values at most. A shared buffer is no descriptor, and register operands (floats, i32 A
        fragments, WGMMA accumulator structs: their slice is the earlier MMAs of the chain,
        not this one's operands) are none: ()."""
        roots = self._descriptors.get(value)
        if roots is None:
            roots = self._descriptors[value] = () if self.shared(value) is not NOT_SHARED \
                else self._slice_roots(value)
        return roots

    def _slice_roots(self, value: ir.Value) -> tuple:
        kind = value.type
        if isinstance(kind, (ir.FloatType, ir.VectorType, llvm.StructType)) or (
                isinstance(kind, ir.IntegerType) and kind.width != 64):
            return ()
        roots, queue, seen = [], deque([value]), set()
        while queue and len(seen) < 256:
            current = queue.popleft()
            if current in seen:
                continue
            edges = self._edges_of(current)
            if edges is None:  # a block argument
                continue
            seen.add(current)
            for operand, root in edges:
                if root is NOT_SHARED:
                    queue.append(operand)
                else:
                    roots.append(root)
        return tuple(roots)

    def _edges_of(self, value: ir.Value):
        """``(operand, its shared root or NOT_SHARED)`` for each operand of ``value``'s owner,
        in order; None for a block argument."""
        edges = self._edges.get(value, self)
        if edges is self:
            owner = value.owner
            edges = self._edges[value] = None if isinstance(owner, ir.Block) else tuple(
                (operand, self.shared(operand)) for operand in owner.operation.operands)
        return edges


def buffer_root(value: ir.Value):
    """A hashable name for the buffer ``value`` points into: ``("global", sym)``,
    ``("arg", n)``, ``("op", op)``, ``("dynamic", offset)`` (a ``kiln.dynamic_shared``
    allocation) or ``("dynamic",)`` (an untagged view: any of them); None when unknown
    (aliases every buffer)."""
    for _ in range(64):
        if isinstance(value.owner, ir.Block):
            owner = value.owner.owner
            entry = owner is not None and owner.operation.name == "gpu.func"
            return ("arg", ir.BlockArgument(value).arg_number) if entry else None
        op = value.owner.operation  # OpView.name may be an attribute (memref.get_global's)
        if op.name == "memref.get_global":
            return ("global", ir.FlatSymbolRefAttr(op.attributes["name"]).value)
        if op.name in ("memref.alloc", "memref.alloca"):
            return ("op", op)
        if op.name == "gpu.dynamic_shared_memory":
            return ("dynamic",)
        if op.name == "memref.view" and "kiln.buffer" in op.attributes:  # kiln.dynamic_shared
            return ("dynamic", ir.IntegerAttr(op.attributes["kiln.buffer"]).value)
        if op.name not in _FORWARDING or not op.operands:
            return None
        value = op.operands[0]
    return None


def written_roots(op: ir.Operation) -> tuple | None:
    """Buffers an async op writes behind the program's back; None if it only writes registers."""
    writes = effects(op).writes
    if writes is None:
        return None
    return tuple(buffer_root(v) for v in writes(op)) or (None,)


def aliases_any(root, written: tuple) -> bool:
    return any(root is None or w is None or root == w or _same_dynamic(root, w) for w in written)


def is_exact_root(root) -> bool:
    """Whether ``root`` names one buffer (not unknown, not any dynamic allocation)."""
    return root is not None and root != ("dynamic",)


def _same_dynamic(a: tuple, b: tuple) -> bool:
    """An untagged view of dynamic shared memory (``("dynamic",)``) may be any allocation."""
    return a[0] == b[0] == "dynamic" and (len(a) == 1 or len(b) == 1)
