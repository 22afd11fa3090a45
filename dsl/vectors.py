"""Short register vectors: build one from scalars, take it apart, slice or join them, spell a
constant.

Kernels keep most data in tiles and fragments; these ops are for the edges where a kernel
must assemble a vector itself, e.g. eight bf16 outputs into one 16-byte store:

    vec = kiln.pack([kiln.cast(x, kiln.bf16) for x in row])   # vector<8xbf16>
    o.store(r, c, vec, align=16)                              # one st.global.v4.b32
    lo, hi = kiln.vector_slice(vec, 0, 4), kiln.vector_slice(vec, 4, 4)
    kiln.vector_concat([hi, lo])                              # vector<8xbf16> again

They build ``vector.from_elements``, ``vector.extract``, ``vector.shuffle`` and a dense
``arith.constant``, which the interpreter runs like any other vector op, and which lower to
register moves only (no memory).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mlir import ir
from mlir.dialects import arith, vector

from .builder import current_target
from .core.dtypes import DType, dtype as to_dtype
from .core.errors import KilnTypeError, KilnValueError
from .values import Value, checked_int, is_literal, scalar_attr, to_value


def pack(values: Sequence[Any]) -> Value:
    """One 1-D vector of ``values``: scalars of the first Value's dtype (literals take it too).

    Example: ``kiln.pack([a, b, c, d])`` is a ``vector<4xf32>`` when ``a`` is f32.
    """
    if not values:
        raise KilnValueError("kiln.pack needs at least one value", fix="pass a non-empty list")
    typed = [v for v in values if isinstance(v, Value)]
    if not typed:
        raise KilnTypeError("kiln.pack needs at least one traced value to take its dtype from",
                            fix="use kiln.vector_constant for a vector of literals")
    elem = typed[0].dtype
    scalars = []
    for v in values:
        v = to_value(v, like=elem)
        if v.shape:
            raise KilnTypeError(f"kiln.pack takes scalars, got a vector of shape {v.shape}",
                                fix="unpack it first with kiln.unpack")
        if v.dtype != elem:
            raise KilnTypeError(f"kiln.pack got {v.dtype} next to {elem}",
                                fix=f"cast every value to {elem} with kiln.cast first")
        scalars.append(v)
    current_target().check_vector(len(scalars), elem.itemsize, "kiln.pack")
    vtype = ir.VectorType.get([len(scalars)], elem.mlir_type())
    return Value(vector.from_elements(vtype, [s.ir for s in scalars]), elem)


def unpack(vec: Value) -> list[Value]:
    """The elements of a 1-D vector as scalars. Example: ``x, y = kiln.unpack(v2)``."""
    width = _width(vec, "kiln.unpack")
    return [Value(vector.extract(vec.ir, [], [i]), vec.dtype) for i in range(width)]


def vector_slice(vec: Value, start: int, width: int) -> Value:
    """Elements ``start .. start + width`` of a 1-D vector, as a vector (a register re-tag).

    Example: ``kiln.vector_slice(v8, 4, 4)`` is the upper half of an 8-wide vector.
    """
    total = _width(vec, "kiln.vector_slice")
    if not (isinstance(start, int) and isinstance(width, int)) or start < 0 or width < 1 \
            or start + width > total:
        raise KilnValueError(f"slice [{start}, {start}+{width}) is outside a vector of {total}",
                             fix="use Python ints with 0 <= start and start + width <= width "
                                 "of the vector")
    return Value(vector.shuffle(vec.ir, vec.ir, list(range(start, start + width))), vec.dtype)


def vector_concat(parts: Sequence[Value]) -> Value:
    """The 1-D vectors ``parts`` (one dtype) end to end, as one vector (``vector.shuffle``
    pairwise: register re-tags, no data movement).

    Example: ``kiln.vector_concat([lo, hi])`` is a ``vector<8xf8e4m3>`` for two 4-wide halves.
    """
    if not parts:
        raise KilnValueError("kiln.vector_concat needs at least one vector",
                             fix="pass a non-empty list of 1-D vectors")
    widths = [_width(p, "kiln.vector_concat") for p in parts]
    if any(p.dtype != parts[0].dtype for p in parts):
        raise KilnTypeError(f"kiln.vector_concat got {sorted({str(p.dtype) for p in parts})}",
                            fix="cast every part to one dtype with kiln.cast first")
    current_target().check_vector(sum(widths), parts[0].dtype.itemsize, "kiln.vector_concat")
    parts = list(parts)
    while len(parts) > 1:  # pairwise, so each shuffle joins two equal-depth halves
        joined = []
        for a, b in zip(parts[::2], parts[1::2]):
            width = a.shape[0] + b.shape[0]
            joined.append(Value(vector.shuffle(a.ir, b.ir, list(range(width))), a.dtype))
        parts = joined + parts[len(parts) - len(parts) % 2:]
    return parts[0]


def vector_constant(values: Sequence[int | float], dtype: Any) -> Value:
    """A constant 1-D vector. Example: ``kiln.vector_constant([0, 4, 8, 12], kiln.i32)``."""
    elem: DType = to_dtype(dtype)
    if not len(values):
        raise KilnValueError("kiln.vector_constant needs at least one value",
                             fix="pass a non-empty list")
    current_target().check_vector(len(values), elem.itemsize, "kiln.vector_constant")
    for v in values:
        if not is_literal(v):
            raise KilnTypeError(f"kiln.vector_constant takes Python numbers, got {v!r}",
                                fix="use kiln.pack for traced values")
    vtype = ir.VectorType.get([len(values)], elem.mlir_type())
    if elem.is_float and elem.bits == 32:
        attr = ir.DenseElementsAttr.get(np.asarray(values, np.float32), type=vtype)
    elif elem.is_int and elem.bits in (8, 16, 32, 64):
        half = 1 << (elem.bits - 1)  # unsigned spellings of large values wrap to signed
        ints = [(checked_int(v, elem) + half) % (2 * half) - half for v in values]
        attr = ir.DenseElementsAttr.get(np.asarray(ints, getattr(np, f"int{elem.bits}")),
                                        type=vtype)
    else:  # f16/bf16/f64, i1: one typed attribute per element
        attr = ir.DenseElementsAttr.get([scalar_attr(v, elem) for v in values], type=vtype)
    return Value(arith.constant(vtype, attr), elem)


def _width(vec: Value, what: str) -> int:
    if not isinstance(vec, Value) or len(vec.shape) != 1:
        raise KilnTypeError(f"{what} takes a 1-D vector value",
                            fix="build one with kiln.pack or a tensor load with width=")
    return vec.shape[0]
