"""Turn a traced ``gpu.func`` into a plan: per block, a list of Python closures over value slots.

The MLIR bindings are walked once per kernel. Each op's builder (registered with
``@semantics("dialect.op")``) reads the op's attributes and types at plan time and returns a
closure ``run(env, ctx)`` that reads operand slots of ``env`` (a list) and writes result slots.
Executing a block is then a plain loop over closures, with no MLIR calls.

Values that depend only on constants, thread ids and launch dimensions (most address
arithmetic of unrolled tile ops: fragment offsets, swizzles, lane masks) are the same in every
CTA and every loop trip. The plan hoists the pure ops computing them out of their blocks into
``Plan.hoisted``; :meth:`Plan.start` runs those once per launch and thread range and hands the
(read-only) results to every later CTA.
"""

from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np
from mlir import ir

from kiln.core.ops import lookup
from kiln.core.errors import SourceLoc, UnsupportedError, source_loc_from_mlir

Run = Callable[[list, object], None]
Builder = Callable[[ir.Operation, "Plan"], Run | None]
_SEMANTICS: dict[str, Builder] = {}


def semantics(*names: str):
    """Register the plan builder of one or more MLIR ops, ``@semantics("arith.addf")``, or of
    declared ops (``kiln.core.ops``) by their registry name: ``@semantics("nvidia.wgmma.mma_async.rs")``."""

    def register(fn: Builder) -> Builder:
        for name in names:
            _SEMANTICS[name] = fn
        return fn

    return register


def location(op: ir.Operation) -> SourceLoc | None:
    """The user's source position recorded on ``op`` by the tracer."""
    return source_loc_from_mlir(op.location)


def np_dtype(t: ir.Type) -> np.dtype:
    """The numpy dtype that holds values of the MLIR scalar (or vector element) type ``t``."""
    if isinstance(t, ir.ShapedType):
        t = t.element_type
    if isinstance(t, ir.IndexType):
        return np.dtype(np.int64)
    if isinstance(t, ir.IntegerType):
        if t.width == 1:
            return np.dtype(np.bool_)
        return np.dtype(f"int{t.width}")
    floats = {ir.F32Type: np.float32, ir.F16Type: np.float16, ir.F64Type: np.float64,
              ir.BF16Type: ml_dtypes.bfloat16, ir.Float8E4M3FNType: ml_dtypes.float8_e4m3fn,
              ir.Float8E5M2Type: ml_dtypes.float8_e5m2}
    for cls, dtype in floats.items():
        if isinstance(t, cls):
            return np.dtype(dtype)
    raise UnsupportedError(f"the interpreter has no numpy dtype for the MLIR type {t}")


def vector_shape(t: ir.Type) -> tuple[int, ...]:
    """``(n, ...)`` for ``vector<n x ...>``, ``()`` for scalars."""
    return tuple(ir.VectorType(t).shape) if isinstance(t, ir.VectorType) else ()


# Ops that write only their results, computed from their operands alone: hoisted when every
# operand is launch-invariant (all arith and math ops are pure).
_PURE = {"vector.broadcast", "vector.splat", "vector.extract", "vector.insert", "vector.shuffle",
         "vector.shape_cast", "vector.from_elements", "vector.bitcast", "vector.fma",
         "vector.reduction", "llvm.extractvalue"}
_PURE_DIALECTS = ("arith.", "math.")
# Operand-free ops whose value is fixed for a launch and a context's thread range.
_LAUNCH_IDS = {"gpu.thread_id", "gpu.lane_id", "gpu.block_dim", "gpu.grid_dim"}


def _hoistable(op: ir.Operation, invariant: set, operands: list[int]) -> bool:
    name = op.name
    if name in _LAUNCH_IDS:
        return True
    if not (name.startswith(_PURE_DIALECTS) or name in _PURE) or len(op.regions):
        return False
    return all(s in invariant for s in operands)


class Block:
    """A compiled block: closures plus the slots of its arguments and of its terminator operands."""

    __slots__ = ("runs", "args", "yields")

    def __init__(self, runs: list[Run], args: list[int], yields: list[int]):
        self.runs = runs
        self.args = args
        self.yields = yields

    def run(self, env: list, ctx) -> None:
        for step in self.runs:
            step(env, ctx)


class Plan:
    """The compiled form of one kernel: entry block, number of value slots, shared globals."""

    def __init__(self, func: ir.Operation, shared_globals: dict[str, tuple]):
        self.slots: dict[ir.Value, int] = {}
        self.shared_globals = shared_globals  # symbol -> (byte offset, shape, dtype)
        self.invariant: set[int] = set()  # slots of launch-invariant values
        self.hoisted: list[Run] = []  # their ops, in program order
        self._step_of: dict[int, tuple[list, Run]] = {}  # result slot -> (its block's runs, step)
        self._op, self._op_operands = None, []  # the op being planned and its operand slots
        self._if_depth = 0  # scf.if regions around the op being planned
        # Whether the kernel blocks (declared effect) inside an scf.if, and whether it issues
        # warp-group MMAs: either runs the CTA as one context per warp group.
        self.blocks_in_divergent_code = self.has_warp_group_ops = False
        self.entry = self.block(func.regions[0].blocks[0])
        self.num_slots = len(self.slots)
        self._step_of = {}
        self.hoisted_slots = sorted(self.invariant)

    def start(self, env: list, ctx, cache: dict) -> None:
        """Fill ``env`` with the launch-invariant values of ``ctx``'s threads, computed by the
        first context of a launch with these threads and shared (read-only) after that."""
        key = (int(ctx.thread_ids[0]), ctx.size)
        values = cache.get(key)
        if values is None:
            for step in self.hoisted:
                step(env, ctx)
            values = cache[key] = [env[s] for s in self.hoisted_slots]
            for v in values:
                v.flags.writeable = False  # shared by every CTA: a step writing it is a bug
        for s, v in zip(self.hoisted_slots, values):
            env[s] = v

    location = staticmethod(location)  # for semantics written outside the interpreter

    def slot(self, value: ir.Value) -> int:
        s = self.slots.get(value)
        if s is None:
            s = self.slots[value] = len(self.slots)
        return s

    def operands(self, op: ir.Operation) -> list[int]:
        if op is self._op:  # read once by :meth:`block` before the op's builder asks again
            return list(self._op_operands)
        return [self.slot(v) for v in op.operands]

    def results(self, op: ir.Operation) -> list[int]:
        return [self.slot(v) for v in op.results]

    def result(self, op: ir.Operation) -> int:
        return self.slot(op.results[0])

    def whole_vector(self, values: list) -> ir.Value | None:
        """The 1-D vector ``v`` when ``values`` are ``v[0], v[1], ..., v[n-1]`` (static
        ``vector.extract`` ops of all of ``v``), else None: a consumer reads ``v`` instead."""
        source = None
        for i, value in enumerate(values):
            op = defining_op(value)
            if op is None or op.name != "vector.extract" or len(op.operands) != 1 or \
                    list(ir.DenseI64ArrayAttr(op.attributes["static_position"])) != [i]:
                return None
            if source is None:
                source = op.operands[0]
            elif op.operands[0] != source:
                return None
        shape = vector_shape(source.type) if source is not None else ()
        return source if shape == (len(values),) else None

    def drop_unused(self, values, readers: list) -> None:
        """Drop the steps computing ``values`` (planned before) when every use of them is by one
        of ``readers``, ops that read the data another way (a fused operand): fewer dispatches."""
        readers = [r.operation for r in readers]
        for value in values:
            slot = self.slots.get(value)
            if slot is None or slot in self.invariant or slot not in self._step_of:
                continue
            if all(use.owner.operation in readers for use in value.uses):
                runs, step = self._step_of.pop(slot)
                runs.remove(step)

    def block(self, block: ir.Block) -> Block:
        args = [self.slot(a) for a in block.arguments]
        runs: list[Run] = []
        yields: list[int] = []
        for op in block.operations:
            op = op.operation
            name = op.name
            if name in ("scf.yield", "gpu.return", "gpu.terminator"):
                yields = self.operands(op)
                continue
            opdef = lookup(op)
            builder = _builder(op, opdef)
            if builder is None:
                raise UnsupportedError(f"the interpreter has no semantics for {name} yet",
                                       fix="run this kernel on a GPU, or add the op's semantics "
                                           "to kiln.interpreter", loc=location(op))
            if opdef is not None:
                self.blocks_in_divergent_code |= self._if_depth > 0 and opdef.effects.blocks
                self.has_warp_group_ops |= opdef.name.startswith("nvidia.wgmma.")
            operands = [self.slot(v) for v in op.operands]
            self._op, self._op_operands = op, operands
            hoist = _hoistable(op, self.invariant, operands)
            nested = name == "scf.if"
            self._if_depth += nested
            step = builder(op, self)
            self._if_depth -= nested
            if hoist:
                self.invariant.update(self.results(op))
                if step is not None:
                    self.hoisted.append(step)
            elif step is not None:
                runs.append(step)
                if len(op.results) == 1:
                    self._step_of[self.slot(op.results[0])] = (runs, step)
        return Block(runs, args, yields)


def defining_op(value: ir.Value) -> ir.Operation | None:
    """The op defining ``value`` (None for a block argument)."""
    owner = value.owner
    return owner.operation if isinstance(owner, (ir.Operation, ir.OpView)) else None


def _builder(op: ir.Operation, opdef) -> Builder | None:
    """The declaration's (``opdef``, or None) semantics, else the builder registered under its
    registry name, else the one registered under the MLIR op name."""
    if opdef is not None:
        builder = opdef.interpret or _SEMANTICS.get(opdef.name)
        if builder is not None:
            return builder
    return _SEMANTICS.get(op.name)


def attr_int(op: ir.Operation, name: str, default: int | None = None) -> int | None:
    if name not in op.attributes:
        return default
    return ir.IntegerAttr(op.attributes[name]).value


def has_attr(op: ir.Operation, name: str) -> bool:
    return name in op.attributes
