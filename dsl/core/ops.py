"""The op registry: every hardware op Kiln emits is declared once, as an :class:`OpDef`.

A declaration sits in its instruction family's module (``kiln.nvidia.wgmma``,
``kiln.amd.buffer``, ...) beside the function that emits the op, and holds the op's four
faces:

- **identity and emission**: ``name`` (``"nvidia.wgmma.mma_async.rs"``); inline asm is built
  through :meth:`OpDef.inline_asm`, which stamps ``kiln.op = name`` on the op; upstream ops
  (``nvvm.wgmma.mma_async``, ``rocdl.s.waitcnt``) are recognised by their MLIR names
  (``mlir_names``), so their IR is unchanged;
- **chips**: ``feature``, a feature of the one target model (``Target.has/require``: ``"sm80"``,
  ``"sm90"``, ``"tma"``, ``"wgmma"``, ``"gfx9"``, ``"gfx950"``); :meth:`OpDef.require` checks it;
- **effects** (:class:`Effects`): the async counter or group it adds to, what it writes behind
  the program's back, what it reads through descriptors, what it commits, waits on or blocks on;
  ``kiln-insert-waits`` / ``kiln-verify-waits`` read nothing else;
- **interpreter semantics**: ``interpret(op, plan)`` returns ``run(env, ctx)``, the same
  contract as the interpreter's own op builders; ``plan`` and ``ctx`` are objects the
  interpreter passes in, so family modules never import it. A declaration without one is run by
  the interpreter's builder registered under its ``name``.

:func:`lookup` maps an ``ir.Operation`` to its declaration. Example::

    OP = OpDef("nvidia.sync.named_barrier", feature="ptx", effects=Effects())
    OP.inline_asm(None, operands, "bar.sync $0, $1;", "r,r")   # carries kiln.op
    lookup(op) is OP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mlir import ir
from mlir.dialects import llvm

from kiln.core.errors import InternalError

OP_ATTR = "kiln.op"
# Marks async ops whose waits the program leaves to kiln-insert-waits (kiln.copy's cp.async
# groups, kiln.gemm's WGMMA groups): the interpreter runs that pass on modules carrying it.
AUTO_WAIT_ATTR = "kiln.auto_wait"
ARGS_ATTR = "kiln.op_args"  # the parameters of a parameterised inline-asm op (shape, dtype, ...)

# Async counters and groups an op may add to (Effects.counter).
VMCNT = "vmcnt"                  # AMD vector-memory counter (s_waitcnt vmcnt)
LGKMCNT = "lgkmcnt"              # AMD LDS/GDS/constant/message counter (s_waitcnt lgkmcnt)
CP_ASYNC = "cp_async_group"      # NVIDIA cp.async groups (cp.async.wait_group N)
WGMMA = "wgmma"                  # NVIDIA WGMMA commit groups (wgmma.wait_group N)
MBARRIER = "mbarrier"            # NVIDIA mbarrier transactions (try_wait on the barrier)
COUNTERS = (VMCNT, LGKMCNT, CP_ASYNC, WGMMA, MBARRIER)


@dataclass(frozen=True)
class Effects:
    """What an op does besides computing its results, as the wait proofs need it.

    ``counter``: the async counter or group each issue adds one event to (:data:`COUNTERS`).
    ``writes(op)``: the shared-memory operands it writes asynchronously (None: it writes only
    registers, which its consumers read). ``indirect_shared``: it accesses shared memory through
    the matrix descriptors or i64 addresses among its operands (found by walking them back
    to their buffers). ``accumulates``: a result chained into the next
    op of the same counter (a WGMMA accumulator) is not a read. ``commits``: it closes the
    uncommitted events of that counter into a group. ``waits(op)``: counter -> N, the events
    it retires (all but the N youngest). ``mbarrier(op)``: ``(barrier group value, constant index
    or None)`` the op signals (with a counter) or waits on (without). ``arrives(op)``: the
    mbarrier group it arrives on (a consumer handing a buffer back). ``releases(op)``: counter ->
    N, the groups of that counter older than the newest N read the buffers the op hands back, so
    they must be retired when it runs (checked like a wait's limit). ``barrier``: every thread
    of the block meets here. ``blocks``: a thread may stop here until others progress. ``data``: False
    when its shared operands are mbarriers only (it reads or writes no shared data).
    ``ring(op)``: its place in an mbarrier ring, ``(role, group, slot index value, parity value
    or None)`` with role ``"wait"`` (try_wait), ``"arm"`` (arrive + expect_tx: opens a use),
    ``"fill"`` (a TMA load completing that use) or ``"release"`` (a consumer's arrive); the
    passes derive which use each names (:mod:`kiln.passes.mbarrier_rings`).
    """

    counter: str | None = None
    writes: Callable[[ir.Operation], tuple] | None = None
    indirect_shared: bool = False
    accumulates: bool = False
    commits: str | None = None
    waits: Callable[[ir.Operation], dict] | None = None
    mbarrier: Callable[[ir.Operation], tuple] | None = None
    arrives: Callable[[ir.Operation], ir.Value] | None = None
    releases: Callable[[ir.Operation], dict] | None = None
    ring: Callable[[ir.Operation], tuple] | None = None
    barrier: bool = False
    blocks: bool = False
    data: bool = True

    def __post_init__(self):
        for counter in (self.counter, self.commits):
            if counter is not None and counter not in COUNTERS:
                raise InternalError(f"unknown async counter {counter!r}",
                                    fix=f"use one of {', '.join(COUNTERS)}")


NO_EFFECTS = Effects()


@dataclass(frozen=True)
class OpDef:
    """One hardware op: its name, the target feature it needs, its effects and semantics."""

    name: str
    feature: str | None = None
    effects: Effects = NO_EFFECTS
    mlir_names: tuple = ()
    interpret: Callable | None = field(default=None, compare=False)
    doc: str = ""

    def require(self, target, what: str | None = None):
        """``target`` if it has this op's feature, else TargetError naming ``what`` (default:
        the op) and the chips that have it. Example: ``OP.require(current_target())``."""
        return target if self.feature is None else target.require(self.feature, what or self.name)

    def tag(self, op) -> None:
        """Stamp this op's identity (``kiln.op``) on an emitted op or OpView."""
        operation = getattr(op, "operation", op)
        operation.attributes[OP_ATTR] = ir.StringAttr.get(self.name)

    def inline_asm(self, result_type, operands: list, asm: str, constraints: str, *,
                   args: dict | None = None, has_side_effects: bool = True):
        """Build ``llvm.inline_asm`` carrying ``kiln.op = name`` and, when given, its parameters
        ``kiln.op_args = {...}`` (ints and strings, read back by :func:`op_args`), so passes and
        the interpreter never parse the asm text. Returns its result, or None."""
        result = llvm.inline_asm(result_type, operands, asm, constraints,
                                 has_side_effects=has_side_effects)
        owner = result.owner if isinstance(result, ir.Value) else result
        self.tag(owner)
        if args:
            i64 = ir.IntegerType.get_signless(64)
            owner.operation.attributes[ARGS_ATTR] = ir.DictAttr.get({
                k: ir.IntegerAttr.get(i64, v) if isinstance(v, int) else ir.StringAttr.get(v)
                for k, v in args.items()})
        return result if isinstance(result, ir.Value) else None


_BY_NAME: dict[str, OpDef] = {}
_BY_MLIR_NAME: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Declare ``opdef`` (once per name and per matched MLIR op name); returns it."""
    clash = _BY_NAME.get(opdef.name)
    if clash is not None and clash is not opdef:
        raise InternalError(f"op {opdef.name} is declared twice", fix="declare each op once")
    for mlir_name in opdef.mlir_names:
        other = _BY_MLIR_NAME.get(mlir_name)
        if other is not None and other is not opdef:
            raise InternalError(f"{mlir_name} is declared by both {other.name} and {opdef.name}",
                                fix="declare each MLIR op once")
        _BY_MLIR_NAME[mlir_name] = opdef
    _BY_NAME[opdef.name] = opdef
    return opdef


def declare(name: str, **kwargs) -> OpDef:
    """``register(OpDef(name, ...))``: the form family modules use."""
    return register(OpDef(name, **kwargs))


def declared(name: str) -> OpDef:
    """The declaration named ``name``; InternalError if none (a module was not imported)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise InternalError(f"no op is declared as {name!r}",
                            fix="import the family module that declares it") from None


def lookup(op: ir.Operation) -> OpDef | None:
    """The declaration of ``op``: by its ``kiln.op`` attribute, else by its MLIR name."""
    return lookup_named(op.name, op.attributes)


def lookup_named(name: str, attrs) -> OpDef | None:
    """:func:`lookup` given an op's name and attributes (for walks that read them once)."""
    if OP_ATTR in attrs:
        return declared(ir.StringAttr(attrs[OP_ATTR]).value)
    return _BY_MLIR_NAME.get(name)


def effects_of(op: ir.Operation) -> Effects:
    """``lookup(op).effects``, or no effects for an undeclared op."""
    opdef = lookup(op)
    return NO_EFFECTS if opdef is None else opdef.effects


def op_args(op: ir.Operation) -> dict:
    """The ``kiln.op_args`` of an op built by :meth:`OpDef.inline_asm` (empty if none)."""
    if ARGS_ATTR not in op.attributes:
        return {}
    out = {}
    for named in ir.DictAttr(op.attributes[ARGS_ATTR]):
        attr = named.attr
        out[named.name] = ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) \
            else ir.StringAttr(attr).value
    return out


def all_ops() -> list[OpDef]:
    """Every declaration, in declaration order."""
    return list(_BY_NAME.values())


# ---- operand helpers the family modules' effects use ------------------------------------------

def is_shared(value: ir.Value) -> bool:
    """A shared-memory (LDS, address space 3) memref or pointer."""
    kind = value.type  # tested by class: printing types was a third of the wait pass
    if isinstance(kind, ir.MemRefType):
        space = kind.memory_space
        if isinstance(space, ir.IntegerAttr):
            return space.value == 3
        return space is not None and "workgroup" in str(space)
    return isinstance(kind, llvm.PointerType) and kind.address_space == 3


def shared_operands(op: ir.Operation) -> tuple:
    """The shared-memory operands of ``op`` (what an LDS-writing DMA writes)."""
    return tuple(v for v in op.operands if is_shared(v))


def constant_int(value: ir.Value) -> int | None:
    """The integer of an ``arith.constant`` value, else None."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.name != "arith.constant":
        return None
    attr = owner.operation.attributes["value"]
    return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else None


def int_attr(name: str, default: int | None = None) -> Callable[[ir.Operation], int]:
    """A reader of the integer attribute ``name`` of an op (``default`` when absent)."""
    def read(op: ir.Operation) -> int:
        if name not in op.attributes:
            return default
        return ir.IntegerAttr(op.attributes[name]).value
    return read


# ``gpu.barrier`` (kiln.barrier()): the vendor-neutral block-wide barrier.
BARRIER = declare("gpu.barrier", mlir_names=("gpu.barrier",), effects=Effects(barrier=True),
                  doc="every thread of the block meets here")
