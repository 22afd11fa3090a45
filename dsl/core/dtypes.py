"""Kiln's scalar dtypes, how other libraries' dtype names map to them, and promotion rules.

Wherever Kiln asks for a dtype it accepts a :class:`DType` (``kiln.f32``), a name
(``"f32"``, ``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``), a numpy dtype (bf16/fp8 via
``ml_dtypes``) or a torch dtype::

    >>> kiln.dtype("bfloat16") is kiln.bf16
    True

Promotion rules for binary operators on traced values (``a + b``, ``a < b``, ...):

1. Same dtype: unchanged.
2. A Python ``int``/``float``/``bool`` literal takes the other operand's dtype ("weak" literal);
   a ``float`` literal next to an integer value makes the result ``f32``.
3. ``i1`` with any integer: the integer. Two integers: the wider (``index`` counts as 64-bit and
   wins over ``i64``).
4. Integer with float: the float.
5. Two floats: the wider; ``f16`` with ``bf16`` gives ``f32``. fp8 dtypes are storage types:
   arithmetic on them promotes to ``f32``.

Integers are signless in IR; comparisons, division and shifts treat them as signed except
``index``, which is unsigned-compared like Triton's offsets. Convert explicitly with
``kiln.cast(x, dtype)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np

from .errors import InternalError, KilnTypeError


@dataclass(frozen=True)
class DType:
    """A Kiln scalar type. ``kind`` is one of ``"bool"``, ``"int"``, ``"index"``, ``"float"``."""

    name: str
    bits: int
    kind: str
    numpy: Any  # numpy dtype used for host arrays and by the interpreter
    _mlir_getter: Callable[[], Any]

    def mlir_type(self):
        """The MLIR type (needs an active ``ir.Context``)."""
        return self._mlir_getter()

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind in ("int", "index", "bool")

    @property
    def is_fp8(self) -> bool:
        return self.is_float and self.bits == 8

    @property
    def storage(self) -> "DType":
        """The dtype of this dtype's elements in memory: i1 is stored as i8 bytes (0 or 1, as
        numpy stores bool), everything else as itself. ``kiln.i1.storage is kiln.i8``."""
        return i8 if self.kind == "bool" else self

    @property
    def itemsize(self) -> int:
        return max(self.bits // 8, 1)

    def __repr__(self) -> str:
        return f"kiln.{self.name}"

    def __str__(self) -> str:
        return self.name


_IR: list = []  # mlir.ir once imported: an import statement per call costs a microsecond


def _ir():
    if not _IR:
        from mlir import ir  # imported lazily: dtypes are usable without an MLIR context

        _IR.append(ir)
    return _IR[0]


i1 = DType("i1", 1, "bool", np.dtype(np.bool_), lambda: _ir().IntegerType.get_signless(1))
i8 = DType("i8", 8, "int", np.dtype(np.int8), lambda: _ir().IntegerType.get_signless(8))
i16 = DType("i16", 16, "int", np.dtype(np.int16), lambda: _ir().IntegerType.get_signless(16))
i32 = DType("i32", 32, "int", np.dtype(np.int32), lambda: _ir().IntegerType.get_signless(32))
i64 = DType("i64", 64, "int", np.dtype(np.int64), lambda: _ir().IntegerType.get_signless(64))
index = DType("index", 64, "index", np.dtype(np.int64), lambda: _ir().IndexType.get())
f16 = DType("f16", 16, "float", np.dtype(np.float16), lambda: _ir().F16Type.get())
bf16 = DType("bf16", 16, "float", np.dtype(ml_dtypes.bfloat16), lambda: _ir().BF16Type.get())
f32 = DType("f32", 32, "float", np.dtype(np.float32), lambda: _ir().F32Type.get())
f64 = DType("f64", 64, "float", np.dtype(np.float64), lambda: _ir().F64Type.get())
f8e4m3 = DType("f8e4m3", 8, "float", np.dtype(ml_dtypes.float8_e4m3fn),
               lambda: _ir().Float8E4M3FNType.get())
f8e5m2 = DType("f8e5m2", 8, "float", np.dtype(ml_dtypes.float8_e5m2),
               lambda: _ir().Float8E5M2Type.get())

ALL_DTYPES = (i1, i8, i16, i32, i64, index, f16, bf16, f32, f64, f8e4m3, f8e5m2)

_ALIASES = {
    "bool": i1, "int1": i1, "int8": i8, "int16": i16, "int32": i32, "int64": i64,
    "float16": f16, "half": f16, "bfloat16": bf16, "float32": f32, "float": f32,
    "float64": f64, "double": f64, "float8_e4m3fn": f8e4m3, "float8_e4m3": f8e4m3,
    "e4m3": f8e4m3, "float8_e5m2": f8e5m2, "e5m2": f8e5m2,
}
_BY_NAME = {d.name: d for d in ALL_DTYPES} | _ALIASES
_BY_NUMPY = {d.numpy: d for d in ALL_DTYPES if d is not index}


def dtype(spec: Any) -> DType:
    """Resolve a dtype spelled any supported way (see module docs) to a :class:`DType`.

    Example: ``kiln.dtype("torch.bfloat16") is kiln.bf16``.
    """
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        for prefix in ("torch.", "numpy.", "np.", "kiln."):
            if key.startswith(prefix):
                key = key[len(prefix):]
        if key in _BY_NAME:
            return _BY_NAME[key]
    else:
        try:
            np_dtype = np.dtype(spec)
        except TypeError:
            np_dtype = None
        if np_dtype is not None and np_dtype in _BY_NUMPY:
            return _BY_NUMPY[np_dtype]
        if type(spec).__module__ == "torch":  # torch.dtype prints as "torch.float32"
            return dtype(str(spec))
    names = ", ".join(d.name for d in ALL_DTYPES)
    raise KilnTypeError(f"unknown dtype {spec!r}",
                        fix=f"use one of {names} (or numpy/torch names such as 'bfloat16')")


def from_mlir(t) -> DType:
    """The Kiln dtype of an MLIR scalar type."""
    text = str(t)
    table = {"i1": i1, "i8": i8, "i16": i16, "i32": i32, "i64": i64, "index": index,
             "f16": f16, "bf16": bf16, "f32": f32, "f64": f64,
             "f8E4M3FN": f8e4m3, "f8E5M2": f8e5m2}
    if text not in table:
        raise InternalError(f"no Kiln dtype for MLIR type {text}")
    return table[text]


def promote(a: DType, b: DType) -> DType:
    """The result dtype of a binary op on two traced values of dtypes ``a`` and ``b``."""
    if a.is_fp8:  # fp8 is a storage type: arithmetic happens in f32 (rule 5)
        a = f32
    if b.is_fp8:
        b = f32
    if a is b:
        return a
    if a.is_float and b.is_float:
        if {a, b} == {f16, bf16}:
            return f32
        return a if a.bits >= b.bits else b
    if a.is_float:
        return a
    if b.is_float:
        return b
    # both integer-like
    if a.kind == "bool":
        return b
    if b.kind == "bool":
        return a
    if a.kind == "index" or b.kind == "index":
        return index
    return a if a.bits >= b.bits else b


def literal_dtype(value: Any, other: DType | None) -> DType:
    """The dtype a Python literal takes next to a traced value of dtype ``other`` (rule 2)."""
    if isinstance(value, bool):
        return other if other is not None else i1
    if isinstance(value, int):
        if other is not None and other.is_fp8:
            return f32
        return other if other is not None else i32
    if isinstance(value, float):
        if other is not None and other.is_float and not other.is_fp8:
            return other
        return f32

    raise KilnTypeError(f"cannot use {type(value).__name__} value {value!r} in a kernel expression",
                        fix="use a Python int/float/bool, a traced value or a kiln.constexpr")
