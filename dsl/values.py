"""Traced values: :class:`Value` (a scalar or vector with a Kiln dtype) and :class:`Handle`.

Inside a kernel every scalar is a ``Value`` wrapping an MLIR ``ir.Value``. Python operators build
``arith``/``math`` ops::

    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)   # i32 Value
    y = a * x[i] + 1.0                                 # 1.0 is a weak literal: takes a's dtype

Promotion follows :func:`kiln.core.dtypes.promote` (same dtype unchanged; a Python literal takes the
other side's dtype; bool < int < float; the wider integer or float wins; f16 with bf16 is f32;
fp8 computes in f32). Integer ``/`` gives f32 like Python's true division; ``//`` and ``%`` on
integers truncate toward zero as in C/CUDA (not Python's floor). Comparisons are signed for
integers, unsigned for ``index``, ordered for floats except ``!=`` (unordered, so NaN != NaN as
in Python). ``x ** n`` needs a constant non-negative Python int ``n``.

``bool(value)`` is an error: write ``if`` (rewritten to ``scf.if``) or ``kiln.where``. So is any
use that needs a Python value at trace time, each naming the Kiln spelling (:mod:`kiln.pyhints`):
``math.exp(v)`` / ``np.exp(v)`` (use ``kiln.exp``), ``float(v)`` (``kiln.cast``), ``str(v)`` and
``f"{v}"`` (``kiln.print``; ``repr(v)`` still shows the dtype).
"""

from __future__ import annotations

from math import copysign as math_copysign
from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import arith, math, vector

from . import builder
from .core import dtypes as dt
from . import pyhints
from .core.dtypes import DType
from .core.errors import KilnTypeError, KilnValueError, UnsupportedError


_SCALAR_TYPE_NAMES = {"i1", "i8", "i16", "i32", "i64", "index", "f16", "bf16", "f32", "f64",
                      "f8E4M3FN", "f8E5M2"}


class Value:
    """A traced scalar or vector. ``.ir`` is the MLIR value, ``.dtype`` its (element) DType,
    ``.shape`` is ``()`` for scalars and ``(N,)`` for ``vector<NxT>``.

    ``Value(ir_value)`` wraps any scalar/vector ``ir.Value`` (dtype read from its type).
    """

    __slots__ = ("ir", "dtype", "shape")

    def __init__(self, ir_value: ir.Value, dtype: DType | None = None):
        builder.count_value()
        self.ir = ir_value
        t = ir_value.type
        is_vector = isinstance(t, ir.VectorType)
        self.shape = tuple(t.shape) if is_vector else ()
        if dtype is None:
            elem = t.element_type if is_vector else t
            if str(elem) not in _SCALAR_TYPE_NAMES:
                raise KilnTypeError(f"kiln.Value wraps numbers and vectors of numbers, not {t}",
                                    fix="wrap other MLIR values in kiln.values.Handle")
            dtype = dt.from_mlir(elem)
        self.dtype = dtype

    @property
    def is_vector(self) -> bool:
        return bool(self.shape)

    def __repr__(self) -> str:
        kind = f"vector{list(self.shape)}x{self.dtype}" if self.shape else str(self.dtype)
        return f"kiln.Value({kind})"

    # The flatten protocol lets Values flow through traced ``if``/``for``.
    def __kiln_flatten__(self):
        return [self.ir], None

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0])

    def __bool__(self):
        raise pyhints.truth_value_error()

    def __index__(self):
        raise pyhints.python_number_error("int")

    def __float__(self):  # math.exp(v), float(v): say which Kiln function to use instead
        raise pyhints.python_number_error("float")

    def __format__(self, spec: str = ""):  # f"{v}" would print a trace-time placeholder
        raise pyhints.format_error()

    __str__ = __format__

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """``np.float32(2) * v`` stays ``2.0 * v``; ``np.exp(v)`` is a KilnTypeError."""
        operator = pyhints.UFUNC_OPERATORS.get(ufunc.__name__)
        if (operator is None or method != "__call__" or kwargs
                or any(isinstance(x, np.ndarray) for x in inputs)):
            raise pyhints.numpy_error(ufunc.__name__)
        return operator(*(x.item() if isinstance(x, np.generic) else x for x in inputs))

    def __array_function__(self, func, types, args, kwargs):
        raise pyhints.numpy_error(func.__name__)

    __hash__ = object.__hash__

    # arithmetic
    def __add__(self, o): return binary("add", self, o)
    def __radd__(self, o): return binary("add", o, self)
    def __sub__(self, o): return binary("sub", self, o)
    def __rsub__(self, o): return binary("sub", o, self)
    def __mul__(self, o): return binary("mul", self, o)
    def __rmul__(self, o): return binary("mul", o, self)
    def __truediv__(self, o): return binary("truediv", self, o)
    def __rtruediv__(self, o): return binary("truediv", o, self)
    def __floordiv__(self, o): return binary("floordiv", self, o)
    def __rfloordiv__(self, o): return binary("floordiv", o, self)
    def __mod__(self, o): return binary("mod", self, o)
    def __rmod__(self, o): return binary("mod", o, self)
    def __and__(self, o): return binary("and", self, o)
    def __rand__(self, o): return binary("and", o, self)
    def __or__(self, o): return binary("or", self, o)
    def __ror__(self, o): return binary("or", o, self)
    def __xor__(self, o): return binary("xor", self, o)
    def __rxor__(self, o): return binary("xor", o, self)
    def __lshift__(self, o): return binary("shl", self, o)
    def __rlshift__(self, o): return binary("shl", o, self)
    def __rshift__(self, o): return binary("shr", self, o)
    def __rrshift__(self, o): return binary("shr", o, self)

    def __pow__(self, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UnsupportedError(
                f"x ** {n!r}: only a constant non-negative Python int exponent is supported",
                fix="use kiln.exp2(y * kiln.log2(x)) for real powers")
        if n.bit_length() > 64:
            raise KilnValueError(f"x ** {n}: the exponent has more than 64 bits",
                                 fix="use kiln.exp2(y * kiln.log2(x)), or a smaller exponent")
        # Square-and-multiply: about 2 * log2(n) multiplies, so x ** 10**6 traces instantly.
        result, base = None, self
        while n:
            if n & 1:
                result = base if result is None else result * base
            n >>= 1
            if n:
                base = base * base
        return constant(1, self.dtype, self.shape) if result is None else result

    def __neg__(self):
        if self.dtype.is_float:
            return known(generic_op("arith.negf", self.ir.type, self.ir), self.dtype, self.shape)
        return binary("sub", constant(0, self.dtype, self.shape), self)

    def __pos__(self):
        return self

    def __invert__(self):
        if self.dtype.is_float:
            raise KilnTypeError(f"~ needs an integer value, got {self.dtype}",
                                fix="use -x for floats, or kiln.cast to an integer dtype first")
        return binary("xor", self, constant(-1 if self.dtype.kind != "bool" else 1, self.dtype,
                                            self.shape))

    def __abs__(self):
        if self.dtype.is_float:
            return known(math.absf(self.ir), self.dtype, self.shape)
        return known(math.absi(self.ir), self.dtype, self.shape)

    # comparisons
    def __lt__(self, o): return compare("lt", self, o)
    def __le__(self, o): return compare("le", self, o)
    def __gt__(self, o): return compare("gt", self, o)
    def __ge__(self, o): return compare("ge", self, o)
    def __eq__(self, o): return compare("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return compare("ne", self, o)  # type: ignore[override]


def known(ir_value: ir.Value, dtype: DType, shape: tuple[int, ...]) -> Value:
    """``Value(ir_value, dtype)`` for a caller that knows the value's shape (an op's result
    shaped like its operands): no read of the MLIR type, a third of the constructor's cost,
    on the path of every traced operator.

    Example: ``known(arith.addf(x.ir, y.ir), x.dtype, x.shape)``."""
    builder.count_value()
    value = _new_value(Value)
    value.ir, value.dtype, value.shape = ir_value, dtype, shape
    return value


_new_value = object.__new__


class Handle:
    """An opaque traced MLIR value that is not a number: an mbarrier group, a TMA descriptor,
    a WGMMA accumulator. It flows through ``if``/``kiln.range`` like a Value.

    Example: ``bar = kiln.values.Handle(nvgpu.mbarrier_create(group_type))``.
    """

    __slots__ = ("ir",)

    def __init__(self, ir_value: ir.Value):
        self.ir = ir_value

    @property
    def type(self) -> ir.Type:
        return self.ir.type

    def __repr__(self) -> str:
        return f"kiln.Handle({self.ir.type})"

    def __kiln_flatten__(self):
        return [self.ir], None

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0])


def _mlir_type(dtype: DType, shape: tuple[int, ...]) -> ir.Type:
    elem = dtype.mlir_type()
    return ir.VectorType.get(list(shape), elem) if shape else elem


def constant(value: Any, dtype: DType, shape: tuple[int, ...] = ()) -> Value:
    """An ``arith.constant`` of ``dtype`` (splat to ``vector<shape>`` when ``shape`` is given).
    In a kernel trace each distinct constant is made once, at the top of the kernel's entry
    block (it dominates every use there): a large kernel asks for ~1500 constants of ~100
    values, and building an op costs more than finding it (or than making its attribute: a
    Python number is looked up first)."""
    state = builder.current_or_none()
    made = state.constants if state is not None and state.entry_block is not None else None
    if made is None:
        return Value(_constant_op(scalar_attr(value, dtype), dtype, shape), dtype)
    number = _number_key(value)
    if number is not None:
        found = made.get((dtype, shape, number))
        if found is not None:
            return known(found, dtype, shape)
    attr = scalar_attr(value, dtype)
    key = (dtype, shape, attr)
    found = made.get(key)
    if found is None:
        with ir.InsertionPoint.at_block_begin(state.entry_block):
            found = made[key] = _constant_op(attr, dtype, shape)
    if number is not None:
        made[(dtype, shape, number)] = found
    return known(found, dtype, shape)


def _number_key(value: Any) -> tuple | None:
    """What decides a Python int, bool or float's attribute: its type and value, and a float's
    sign (0.0 == -0.0); None for other numbers (numpy scalars: their attribute is the key)."""
    kind = type(value)
    if kind is float:
        return (kind, value, math_copysign(1.0, value))
    if kind is int or kind is bool:
        return (kind, value)
    return None


def _constant_op(attr: ir.Attribute, dtype: DType, shape: tuple[int, ...]) -> ir.Value:
    elem = dtype.mlir_type()
    if shape:
        vtype = ir.VectorType.get(list(shape), elem)
        return generic_op("arith.constant", vtype,
                          attributes={"value": ir.DenseElementsAttr.get_splat(vtype, attr)})
    return generic_op("arith.constant", elem, attributes={"value": attr})


def scalar_attr(value: Any, dtype: DType) -> ir.Attribute:
    """The ``FloatAttr``/``IntegerAttr`` of a Python number as ``dtype``; KilnValueError when it
    cannot be one (an int past the dtype's bits, NaN for an integer, 2**2000 for a float)."""
    if dtype.is_float:
        try:
            return ir.FloatAttr.get(dtype.mlir_type(), float(value))
        except OverflowError:
            raise KilnValueError(f"the constant {value} is too large for {dtype}",
                                 fix="use a smaller value, or float('inf')") from None
    return ir.IntegerAttr.get(dtype.mlir_type(), checked_int(value, dtype))


def checked_int(value: Any, dtype: DType) -> int:
    """``value`` as an int that fits ``dtype``'s bits (signed or unsigned; integers are
    signless), else KilnValueError: MLIR's attribute builder takes at most 64 bits.
    Example: ``checked_int(255, kiln.i8)`` is 255; ``checked_int(256, kiln.i8)`` raises."""
    if isinstance(value, float) and not -float("inf") < value < float("inf"):  # nan, inf
        raise KilnValueError(f"{value} has no {dtype} value",
                             fix="use a finite number for an integer constant")
    v = int(value)
    low, high = -(1 << (dtype.bits - 1)) if dtype.bits > 1 else -1, (1 << dtype.bits) - 1
    if not low <= v <= high:
        raise KilnValueError(f"the constant {value} does not fit {dtype} (range {low}..{high})",
                             fix="use a value in range, or a wider dtype")
    return v


def _check_literal_range(value: int, dtype: DType) -> None:
    """A weak int literal must fit its operand's dtype (signed or unsigned range: integers
    are signless), instead of silently wrapping (``x_i8 + 1000``)."""
    bits = dtype.bits
    low, high = (0, 1) if dtype.kind == "bool" else (-(1 << (bits - 1)), (1 << bits) - 1)
    if not low <= value <= high:
        raise KilnValueError(f"the literal {value} does not fit {dtype} (range {low}..{high})",
                             fix=f"cast the other operand to a wider type first, e.g. "
                                 f"kiln.cast(x, kiln.i32)")


def is_literal(x: Any) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, Value)


def to_value(x: Any, like: DType | None = None) -> Value:
    """``x`` as a Value: Values pass through, Python literals become weak constants."""
    if isinstance(x, Value):
        return x
    if is_literal(x):
        dtype = dt.literal_dtype(x, like)
        if isinstance(x, int) and not isinstance(x, bool) and dtype.is_int:
            _check_literal_range(x, dtype)
        return constant(x, dtype)
    check_defined(x)
    raise KilnTypeError(f"cannot use {type(x).__name__} {x!r} as a kernel value",
                        fix="use a traced value, a tensor element or a Python int/float/bool")


class Undefined:
    """Stands for a variable that has no value after a traced ``if``/``for``; any use fails."""

    __slots__ = ("name", "reason")

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def fail(self):
        raise KilnTypeError(f"variable '{self.name}' is {self.reason} and has no value here",
                            fix=f"assign '{self.name}' before the if/loop (e.g. "
                                f"{self.name} = 0.0) so it has a value on every path")


def check_defined(x: Any) -> None:
    """Raise the deferred error of a variable that is undefined after a traced if/for."""
    if isinstance(x, Undefined):
        x.fail()


def cast(x: Any, dtype: Any) -> Value:
    """Convert ``x`` to ``dtype`` (sign-extending ints, rounding floats to nearest, float->int
    truncating toward zero). Works on scalars and vectors.

    Example: ``kiln.cast(acc, kiln.bf16)``.
    """
    if type(x) is Value and x.dtype is dtype:  # already that dtype (most casts of a trace)
        return x
    target = dt.dtype(dtype)
    if hasattr(x, "__kiln_elementwise__"):  # a register tile (kiln.tiles): RegTile.cast
        return x.cast(target)
    if not isinstance(x, Value):
        return constant(x, target) if is_literal(x) else to_value(x)
    src = x.dtype
    if src is target:
        return x
    shape = x.shape
    rtype = _mlir_type(target, shape)
    v = x.ir
    if src.is_float and target.is_float:
        op = "arith.extf" if target.bits > src.bits else "arith.truncf"
        if target.bits == src.bits:  # f16 <-> bf16 goes through f32
            return cast(cast(x, dt.f32), target)
        return known(generic_op(op, rtype, v), target, shape)
    if src.is_int and target.is_float:
        if src.kind == "index":
            return cast(cast(x, dt.i64), target)
        op = "arith.uitofp" if src.kind == "bool" else "arith.sitofp"
        return known(generic_op(op, rtype, v), target, shape)
    if src.is_float and target.is_int:
        if target.kind == "index":
            return cast(cast(x, dt.i64), target)
        if target.kind == "bool":
            return compare("ne", x, 0.0)
        return known(generic_op("arith.fptosi", rtype, v), target, shape)
    # integer <-> integer
    if src.kind == "index" or target.kind == "index":
        if target.kind == "bool":
            return compare("ne", x, 0)
        if src.kind == "bool":
            return cast(cast(x, dt.i32), target)
        return known(generic_op("arith.index_cast", rtype, v), target, shape)
    if target.kind == "bool":
        return compare("ne", x, 0)
    if target.bits > src.bits:
        op = "arith.extui" if src.kind == "bool" else "arith.extsi"
        return known(generic_op(op, rtype, v), target, shape)
    return known(generic_op("arith.trunci", rtype, v), target, shape)


def broadcast(x: Value, shape: tuple[int, ...]) -> Value:
    if x.shape == shape:
        return x
    if x.shape:
        raise KilnTypeError(f"vector shapes {x.shape} and {shape} do not match",
                            fix="combine vectors of the same width")
    return known(vector.broadcast(_mlir_type(x.dtype, shape), x.ir), x.dtype, shape)


_WEAK = (int, float)  # literal types of unify's fast path (not bool: it has rules of its own)


def _literal_joins(dtype: DType, literal: int | float) -> bool:
    """Whether ``literal`` next to a Value of ``dtype`` promotes to ``dtype`` itself (an int
    literal checked to fit it, as the general path does)."""
    kind = type(literal)
    joins = _JOINS.get((dtype, kind))
    if joins is None:  # the promotion depends on the literal's type only
        joins = _JOINS[dtype, kind] = dt.promote(dtype, dt.literal_dtype(literal, dtype)) is dtype
    if joins and kind is int and dtype.is_int:
        _check_literal_range(literal, dtype)
    return joins


_JOINS: dict[tuple[DType, type], bool] = {}


def unify(a: Any, b: Any) -> tuple[Value, Value]:
    """Both operands as Values of the promoted dtype and common shape."""
    if (type(a) is Value and type(b) is Value and a.dtype is b.dtype
            and a.shape == b.shape):  # most traced arithmetic: nothing to promote or broadcast
        return a, b
    # a Value and a literal that takes its dtype (x * 0.5): the general path's result, sooner
    if type(a) is Value and type(b) in _WEAK:
        if _literal_joins(a.dtype, b):
            return a, broadcast(constant(b, a.dtype), a.shape)
    elif type(b) is Value and type(a) in _WEAK:
        if _literal_joins(b.dtype, a):
            return broadcast(constant(a, b.dtype), b.shape), b
    check_defined(a)
    check_defined(b)
    if not isinstance(a, Value) and not isinstance(b, Value):
        raise KilnTypeError("an operation needs at least one traced value",
                            fix="compute Python-only expressions in Python")
    if isinstance(a, Value) and isinstance(b, Value):
        dtype = dt.promote(a.dtype, b.dtype)
    elif isinstance(a, Value):
        dtype = dt.promote(a.dtype, dt.literal_dtype(b, a.dtype)) if is_literal(b) else None
    else:
        dtype = dt.promote(b.dtype, dt.literal_dtype(a, b.dtype)) if is_literal(a) else None
    if dtype is None:
        other = b if isinstance(a, Value) else a
        to_value(other)  # raises the "cannot use" error
    for operand in (a, b):
        if isinstance(operand, int) and not isinstance(operand, bool) and dtype.is_int:
            _check_literal_range(operand, dtype)
    shape = (a.shape if isinstance(a, Value) and a.shape else
             b.shape if isinstance(b, Value) else ())
    return (broadcast(cast(a, dtype), shape), broadcast(cast(b, dtype), shape))


_INT_OPS = {"add": "arith.addi", "sub": "arith.subi", "mul": "arith.muli",
            "floordiv": "arith.divsi", "mod": "arith.remsi", "and": "arith.andi",
            "or": "arith.ori", "xor": "arith.xori", "shl": "arith.shli", "shr": "arith.shrsi"}
_INDEX_OPS = _INT_OPS | {"floordiv": "arith.divui", "mod": "arith.remui", "shr": "arith.shrui"}
_FLOAT_OPS = {"add": "arith.addf", "sub": "arith.subf", "mul": "arith.mulf",
              "truediv": "arith.divf", "mod": "arith.remf"}
_create = ir.Operation.create


def generic_op(name: str, result_type: ir.Type, *operands: ir.Value,
               attributes: dict | None = None) -> ir.Value:
    """The one result of op ``name`` built by MLIR's generic builder at the current insertion
    point and location: the generated builders' Python layers cost 3x as much, on the path of
    every traced operator (the op is the same).

    Example: ``generic_op("arith.addf", x.ir.type, x.ir, y.ir)``."""
    return _create(name, results=[result_type], operands=list(operands),
                   attributes=attributes).result


def binary(op: str, a: Any, b: Any) -> Value:
    """Apply a binary operator with Kiln's promotion rules (see module docs)."""
    x, y = unify(a, b)
    dtype = x.dtype
    if op == "truediv" and not dtype.is_float:
        return binary("truediv", cast(x, dt.f32), cast(y, dt.f32))
    if dtype.is_float:
        if op == "floordiv":
            return known(math.floor(binary("truediv", x, y).ir), dtype, x.shape)
        if op not in _FLOAT_OPS:
            raise KilnTypeError(f"operator '{op}' needs integer operands, got {dtype}",
                                fix="kiln.cast the operands to an integer dtype first")
        return known(generic_op(_FLOAT_OPS[op], x.ir.type, x.ir, y.ir), dtype, x.shape)
    table = _INDEX_OPS if dtype.kind == "index" else _INT_OPS
    return known(generic_op(table[op], x.ir.type, x.ir, y.ir), dtype, x.shape)


# the predicates as their enum values (the attribute arith.cmpi/cmpf carry, an i64)
_ICMP = {k: int(getattr(arith.CmpIPredicate, v)) for k, v in
         {"lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge", "eq": "eq", "ne": "ne"}.items()}
_UCMP = {k: int(getattr(arith.CmpIPredicate, v)) for k, v in
         {"lt": "ult", "le": "ule", "gt": "ugt", "ge": "uge", "eq": "eq", "ne": "ne"}.items()}
_FCMP = {k: int(getattr(arith.CmpFPredicate, v)) for k, v in
         {"lt": "OLT", "le": "OLE", "gt": "OGT", "ge": "OGE", "eq": "OEQ", "ne": "UNE"}.items()}


def compare(op: str, a: Any, b: Any) -> Value:
    """A comparison producing an i1 Value (signed ints, unsigned index, ordered floats)."""
    x, y = unify(a, b)
    if x.dtype.is_float:
        return _compare("arith.cmpf", _FCMP[op], x, y)
    names = _UCMP if x.dtype.kind in ("index", "bool") else _ICMP
    return _compare("arith.cmpi", names[op], x, y)


def _compare(name: str, predicate: int, x: Value, y: Value) -> Value:
    i64 = ir.IntegerType.get_signless(64)
    result = generic_op(name, _mlir_type(dt.i1, x.shape), x.ir, y.ir,
                    attributes={"predicate": ir.IntegerAttr.get(i64, predicate)})
    return known(result, dt.i1, x.shape)
