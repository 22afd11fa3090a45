"""Device built-ins: thread/block ids, barriers, math, ``where`` and ``cast``.

All ids are i32 Values. The block is one-dimensional (``num_warps * warp_size`` threads, or
``num_threads``: see :mod:`kiln.threads`), so ``kiln.block_dim(0)`` is a compile-time constant
(Kiln never emits ``gpu.block_dim``: on AMD it would need a device-library call). Indexing with
it, rather than repeating a constexpr block size, stays right on either warp width.

Example::

    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    y[i] = kiln.exp2(x[i] * 1.4426950408889634)
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import arith, gpu, llvm, math

from . import builder
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError, checked_call
from .values import Value, cast, constant, generic_op, known, to_value, unify

__all__ = ["block_id", "thread_id", "num_blocks", "block_dim", "lane_id", "warp_id", "barrier",
           "fence",
           "cast", "where", "exp2", "log2", "exp", "log", "sqrt", "rsqrt", "rcp", "maximum",
           "minimum", "abs", "fma"]

_DIMS = {0: "x", 1: "y", 2: "z", "x": "x", "y": "y", "z": "z"}


def _dim(d: Any):
    if d not in _DIMS:
        raise KilnValueError(f"dimension {d!r} is not 0, 1 or 2", fix="pass 0, 1 or 2")
    return getattr(gpu.Dimension, _DIMS[d])


def _index_to_i32(v) -> Value:
    return cast(Value(v, dt.index), dt.i32)


@checked_call
def block_id(d: int = 0) -> Value:
    """The block (program) index along grid dimension ``d`` as i32: ``kiln.block_id(0)``."""
    return _index_to_i32(gpu.block_id(_dim(d)))


@checked_call
def thread_id(d: int = 0) -> Value:
    """The thread index inside the block along ``d`` as i32. Example: ``kiln.thread_id(0)``."""
    tid = gpu.thread_id(_dim(d))
    if d == 0:  # threads.check_thread_indexing follows its uses
        builder.current().thread_ids.append(tid)
    return _index_to_i32(tid)


@checked_call
def num_blocks(d: int = 0) -> Value:
    """The grid size along ``d`` (``gpu.grid_dim``) as i32. Example: ``kiln.num_blocks(0)``."""
    return _index_to_i32(gpu.grid_dim(_dim(d)))


@checked_call
def block_dim(d: int = 0) -> Value:
    """The block size along ``d``: a constant from ``num_warps``/``num_threads`` (never
    ``gpu.block_dim``). Example: ``i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)``."""
    _dim(d)
    axis = {"x": 0, "y": 1, "z": 2}.get(d, d)
    return constant(builder.current().block[axis], dt.i32)


@checked_call
def global_id(d: int = 0) -> Value:
    """This thread's index in the whole grid along ``d``:
    ``block_id(d) * block_dim(d) + thread_id(d)``, right for whatever block size the launch has
    on either vendor. Example: ``i = kiln.global_id(0); if i < n: y[i] = x[i]``."""
    return block_id(d) * block_dim(d) + thread_id(d)


@checked_call
def lane_id() -> Value:
    """This thread's lane inside its warp (wavefront on AMD): ``thread_id(0) % warp_size``."""
    return thread_id(0) % builder.current_target().warp_size


@checked_call
def warp_id() -> Value:
    """This thread's warp index inside the block: ``thread_id(0) // warp_size``."""
    return thread_id(0) // builder.current_target().warp_size


@checked_call
def barrier() -> None:
    """Block-wide barrier (``gpu.barrier``): every thread waits, shared memory is visible after."""
    gpu.barrier()


# LLVM sync-scope names of kiln.fence's scopes, per vendor (an empty name is the whole system).
_FENCE_SCOPES = {"nvidia": {"cta": "block", "cluster": "cluster", "gpu": "device"},
                 "amd": {"cta": "workgroup", "gpu": "agent"}}


@checked_call
def fence(scope: str = "gpu") -> None:
    """Acquire-release memory fence (``llvm.fence``) over ``scope``: ``"cta"``, ``"cluster"``
    (NVIDIA) or ``"gpu"`` (``fence.acq_rel.gpu`` / ``__threadfence()`` on NVIDIA, an agent-scope
    fence on AMD). The calling thread's earlier memory operations, and those it saw through a
    barrier, become visible at that scope before its later ones.

    Example (publish a CTA's results, then take a ticket)::

        kiln.barrier()
        if kiln.thread_id(0) == 0:
            kiln.fence("gpu")
            ticket = counters.atomic_add(0, 1)
    """
    target = builder.current_target()
    scopes = _FENCE_SCOPES[target.vendor]
    if scope not in scopes:
        raise KilnValueError(f"fence scope {scope!r} is not one of {sorted(scopes)} on "
                             f"{target.name}",
                             fix='use kiln.fence("gpu") or kiln.fence("cta")')
    if scope == "cluster":  # LLVM aborts on a cluster-scope fence below sm_90
        target.require("sm90", 'kiln.fence("cluster")')
    llvm.fence(llvm.AtomicOrdering.acq_rel, syncscope=scopes[scope])


@checked_call
def where(cond: Any, a: Any, b: Any) -> Value:
    """``a`` where ``cond`` is true else ``b`` (``arith.select``); promotes like ``a + b``.
    An i1 register tile ``cond`` selects per element (:func:`kiln.tiles.where`).

    Example: ``y = kiln.where(x > 0.0, x, 0.0)``.
    """
    if _tile(cond):
        return cond.__kiln_where__(a, b)
    c = to_value(cond)
    if c.dtype is not dt.i1:
        raise KilnTypeError(f"kiln.where needs an i1 condition, got {c.dtype}",
                            fix="compare first, e.g. kiln.where(x != 0, a, b)")
    if not isinstance(a, Value) and not isinstance(b, Value):
        a = to_value(a)
    x, y = unify(a, b)
    return known(generic_op("arith.select", x.ir.type, c.ir, x.ir, y.ir), x.dtype, x.shape)


def _float(x: Any) -> Value:
    v = to_value(x, dt.f32)
    if not v.dtype.is_float:
        v = cast(v, dt.f32)
    return v


def _tile(x: Any) -> bool:
    """A register tile or reduced vector (kiln.tiles): math on it applies per element."""
    return hasattr(x, "__kiln_elementwise__")


def _unary_math(name: str, op, doc: str):
    def fn(x):
        if _tile(x):
            return x.__kiln_elementwise__(fn)
        v = _float(x)
        return Value(op(v.ir), v.dtype)

    fn.__name__ = name
    fn.__doc__ = doc
    return checked_call(fn)


exp2 = _unary_math("exp2", math.exp2, "2**x. Example: ``kiln.exp2(x * LOG2E)``.")
log2 = _unary_math("log2", math.log2, "Base-2 logarithm. Example: ``kiln.log2(x)``.")
exp = _unary_math("exp", math.exp, "e**x. Example: ``kiln.exp(x - m)``.")
log = _unary_math("log", math.log, "Natural logarithm. Example: ``kiln.log(s)``.")
sqrt = _unary_math("sqrt", math.sqrt, "Square root. Example: ``kiln.sqrt(var + eps)``.")
rsqrt = _unary_math("rsqrt", math.rsqrt, "1/sqrt(x). Example: ``kiln.rsqrt(var + eps)``.")


@checked_call
def rcp(x: Any, *, approx: bool = False) -> Value:
    """1/x for floats, correctly rounded; ``approx=True`` allows the hardware's approximate
    reciprocal (``afn``: one ``rcp.approx.f32`` / ``v_rcp_f32``, about 1 ulp), which has no
    slow path for infinities and denormals: ``rcp.rn`` branches to one for every lane whose
    input is huge (a GELU or sigmoid's ``1 + exp(-z)`` overflowing to inf).

    Example: ``inv = kiln.rcp(l)``; ``y = x * kiln.rcp(1.0 + kiln.exp(-z), approx=True)``.
    """
    if not isinstance(approx, bool):
        raise KilnTypeError(f"kiln.rcp approx= must be a bool, got {approx!r}",
                            fix="pass approx=True or approx=False")
    if _tile(x):
        return x.__kiln_elementwise__(lambda v: rcp(v, approx=approx))
    v = _float(x)
    flags = ir.Attribute.parse("#arith.fastmath<afn>") if approx else None
    return Value(arith.divf(constant(1.0, v.dtype, v.shape).ir, v.ir, fastmath=flags), v.dtype)


def _tile_binary(a: Any, b: Any, fn) -> Any:
    if _tile(a):
        return a.__kiln_binary__(b, fn)
    return b.__kiln_binary__(a, lambda y, x: fn(x, y))


@checked_call
def maximum(a: Any, b: Any) -> Value:
    """Elementwise max (NaN-propagating for floats, signed for ints): ``kiln.max(m, x)``;
    on register tiles too (``kiln.max(tile, 0.0)``)."""
    if _tile(a) or _tile(b):
        return _tile_binary(a, b, maximum)
    x, y = unify(a, b)
    if x.dtype.is_float:
        return known(generic_op("arith.maximumf", x.ir.type, x.ir, y.ir), x.dtype, x.shape)
    op = arith.maxui if x.dtype.kind in ("index", "bool") else arith.maxsi
    return Value(op(x.ir, y.ir), x.dtype)


@checked_call
def minimum(a: Any, b: Any) -> Value:
    """Elementwise min (NaN-propagating for floats, signed for ints): ``kiln.min(a, b)``;
    on register tiles too."""
    if _tile(a) or _tile(b):
        return _tile_binary(a, b, minimum)
    x, y = unify(a, b)
    if x.dtype.is_float:
        return Value(arith.minimumf(x.ir, y.ir), x.dtype)
    op = arith.minui if x.dtype.kind in ("index", "bool") else arith.minsi
    return Value(op(x.ir, y.ir), x.dtype)


@checked_call
def abs(x: Any) -> Value:  # noqa: A001 - mirrors Python's abs for kiln.abs
    """Absolute value (``math.absf`` / ``math.absi``). Example: ``kiln.abs(x - y)``."""
    if _tile(x):
        return x.__kiln_elementwise__(abs)
    return to_value(x).__abs__()


@checked_call
def fma(a: Any, b: Any, c: Any) -> Value:
    """a * b + c with one rounding (``math.fma``) for floats. ``a`` (or ``b``) may be a
    register tile times a scalar, ``c`` a tile, a row/column vector of it or a scalar: the
    softmax's ``kiln.fma(s, scale, -m * scale)`` is one FMA per element. Example:
    ``kiln.fma(a, x, y)``."""
    if _tile(b) and not _tile(a):
        a, b = b, a
    if _tile(a):
        if _tile(b):
            raise KilnTypeError("kiln.fma multiplies a register tile by a scalar, got two tiles",
                                fix="write a * b + c for a product of two tiles")
        return a._zip(c, lambda x, z: fma(x, b, z))
    x, y = unify(a, b)
    x, z = unify(x, c)
    y, _ = unify(y, z)
    if not x.dtype.is_float:
        return x * y + z
    return Value(math.fma(x.ir, y.ir, z.ir), x.dtype)
