"""``arith`` and ``math`` ops: elementwise numpy on per-thread arrays.

Results keep the MLIR result type's numpy dtype (so f16/bf16 arithmetic rounds like the GPU's
per-op rounding, and integers wrap at their width). Integer division truncates toward zero like
``arith.divsi``; lanes masked off by an enclosing ``scf.if`` may divide by zero harmlessly.
"""

from __future__ import annotations

import numpy as np
from mlir import ir

from .plan import np_dtype, semantics, vector_shape

_NATIVE_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _elementwise(names_to_fns: dict):
    """Register ops whose result is ``fn(*operands)`` cast to the result dtype."""
    for name, fn in names_to_fns.items():
        def build(op, p, fn=fn):
            args = p.operands(op)
            out = p.result(op)
            dtype = np_dtype(op.results[0].type)
            if len(args) == 1:
                (a,) = args

                def run(env, ctx):
                    env[out] = np.asarray(fn(env[a])).astype(dtype, copy=False)
            elif len(args) == 2:
                a, b = args

                def run(env, ctx):
                    env[out] = np.asarray(fn(env[a], env[b])).astype(dtype, copy=False)
            else:
                def run(env, ctx):
                    env[out] = np.asarray(fn(*(env[s] for s in args))).astype(dtype, copy=False)
            return run

        semantics(name)(build)


def _unsigned(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x
    return x.view(np.dtype(f"uint{x.dtype.itemsize * 8}"))


def _nonzero(b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, np.ones_like(b), b)


def _divsi(a, b):
    b = _nonzero(b)
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def _remsi(a, b):
    return a - _divsi(a, b) * _nonzero(b)


def _float_math(fn):
    """A math function computed in float32 for dtypes numpy has no kernels for (bf16, fp8)."""
    def wrapped(*xs):
        if xs[0].dtype in _NATIVE_FLOATS:
            return fn(*xs)
        return fn(*(x.astype(np.float32) for x in xs))
    return wrapped


_elementwise({
    "arith.addi": np.add, "arith.subi": np.subtract, "arith.muli": np.multiply,
    "arith.addf": np.add, "arith.subf": np.subtract, "arith.mulf": np.multiply,
    "arith.divf": np.divide, "arith.remf": np.fmod, "arith.negf": np.negative,
    "arith.divsi": _divsi, "arith.remsi": _remsi,
    "arith.divui": lambda a, b: _unsigned(a) // _unsigned(_nonzero(b)),
    "arith.remui": lambda a, b: _unsigned(a) % _unsigned(_nonzero(b)),
    "arith.ceildivsi": lambda a, b: -((-a) // _nonzero(b)),
    "arith.floordivsi": lambda a, b: a // _nonzero(b),
    "arith.andi": np.bitwise_and, "arith.ori": np.bitwise_or, "arith.xori": np.bitwise_xor,
    "arith.shli": lambda a, b: np.left_shift(a, b.astype(a.dtype)),
    "arith.shrsi": lambda a, b: np.right_shift(a, b.astype(a.dtype)),
    "arith.shrui": lambda a, b: np.right_shift(_unsigned(a), _unsigned(b.astype(a.dtype))),
    "arith.maxsi": np.maximum, "arith.minsi": np.minimum,
    "arith.maxui": lambda a, b: np.maximum(_unsigned(a), _unsigned(b)),
    "arith.minui": lambda a, b: np.minimum(_unsigned(a), _unsigned(b)),
    "arith.maximumf": np.maximum, "arith.minimumf": np.minimum,  # NaN-propagating
    "arith.maxnumf": np.fmax, "arith.minnumf": np.fmin,  # NaN-ignoring
    "arith.select": lambda c, a, b: np.where(
        c.reshape(c.shape + (1,) * (a.ndim - c.ndim)), a, b),
    "math.exp": _float_math(np.exp), "math.exp2": _float_math(np.exp2),
    "math.log": _float_math(np.log), "math.log2": _float_math(np.log2),
    "math.sqrt": _float_math(np.sqrt), "math.rsqrt": _float_math(lambda x: 1.0 / np.sqrt(x)),
    "math.tanh": _float_math(np.tanh), "math.sin": _float_math(np.sin),
    "math.cos": _float_math(np.cos), "math.floor": _float_math(np.floor),
    "math.ceil": _float_math(np.ceil), "math.absf": np.abs, "math.absi": np.abs,
    "math.powf": _float_math(np.power),
    # one rounding: exact product and sum in float64, rounded once to the result type
    "math.fma": lambda a, b, c: a.astype(np.float64) * b + c.astype(np.float64),
    "vector.fma": lambda a, b, c: a.astype(np.float64) * b + c.astype(np.float64),
    # casts: the result dtype's astype does the work (int truncation wraps, float rounds)
    "arith.extf": lambda a: a, "arith.truncf": lambda a: a,
    "arith.extsi": lambda a: a,
    "arith.extui": lambda a: _unsigned(a), "arith.sitofp": lambda a: a,
    "arith.uitofp": lambda a: _unsigned(a), "arith.fptosi": lambda a: a,
    "arith.fptoui": lambda a: a, "arith.index_cast": lambda a: a,
    "arith.index_castui": lambda a: _unsigned(a),
})

@semantics("arith.trunci")
def _trunci(op, p):
    """Integers wrap at the result's width (``astype``); to i1 the low bit is kept (``astype``
    to bool would test for nonzero: an mbarrier parity ``trunci(n)`` of n = 2 read as 1)."""
    (a,) = p.operands(op)
    out = p.result(op)
    dtype = np_dtype(op.results[0].type)
    low_bit = dtype == np.bool_

    def run(env, ctx):
        x = env[a]
        env[out] = (x & 1 if low_bit and x.dtype != np.bool_ else x).astype(dtype, copy=False)

    return run


# arith.cmpi predicates, in enum order: eq ne slt sle sgt sge ult ule ugt uge
_CMPI = [np.equal, np.not_equal, np.less, np.less_equal, np.greater, np.greater_equal]


@semantics("arith.cmpi")
def _cmpi(op, p):
    a, b = p.operands(op)
    out = p.result(op)
    pred = ir.IntegerAttr(op.attributes["predicate"]).value
    fn = _CMPI[pred if pred < 6 else pred - 4]
    unsigned = pred >= 6

    def run(env, ctx):
        x, y = env[a], env[b]
        env[out] = fn(_unsigned(x), _unsigned(y)) if unsigned else fn(x, y)

    return run


# arith.cmpf predicates, in enum order: false oeq ogt oge olt ole one ord ueq ugt uge ult ule une
# uno true. Ordered ones are false on NaN; unordered ones are true on NaN.
_CMPF = {1: np.equal, 2: np.greater, 3: np.greater_equal, 4: np.less, 5: np.less_equal,
         6: np.not_equal}


@semantics("arith.cmpf")
def _cmpf(op, p):
    a, b = p.operands(op)
    out = p.result(op)
    pred = ir.IntegerAttr(op.attributes["predicate"]).value

    def compare(x, y):
        nan = np.isnan(x) | np.isnan(y)
        if pred in (0, 15):
            return np.full(np.broadcast(x, y).shape, pred == 15)
        if pred == 7:
            return ~nan
        if pred == 14:
            return nan
        if pred <= 6:
            return _CMPF[pred](x, y) & ~nan
        return _CMPF[pred - 7](x, y) | nan if pred != 13 else (x != y) | nan

    def run(env, ctx):
        env[out] = compare(env[a], env[b])

    return run


@semantics("arith.constant")
def _constant(op, p):
    out = p.result(op)
    t = op.results[0].type
    dtype = np_dtype(t)
    attr = op.attributes["value"]
    shape = vector_shape(t)
    if shape:
        dense = ir.DenseElementsAttr(attr)
        if dense.is_splat:
            value = np.full((1,) + shape, _scalar(dense.get_splat_value()), dtype)
        elif dtype.kind in "fV" and dtype.itemsize <= 2:  # f16, bf16, fp8 (ml_dtypes)
            value = _dense_from_text(attr, dtype).reshape((1,) + shape)
        else:
            value = np.array(dense, dtype=np.float64 if dtype.kind == "f" else None
                             ).astype(dtype).reshape((1,) + shape)
    else:
        value = np.array([_scalar(attr)], dtype)

    def run(env, ctx):
        env[out] = value

    return run


def _dense_from_text(attr: ir.Attribute, dtype: np.dtype) -> np.ndarray:
    """The elements of a non-splat f16/bf16/fp8 constant, which the bindings can neither index
    nor export as a buffer: from the printed form, where specials are hex bit patterns (and
    a constant of over 100 elements is one little-endian hex blob, ``dense<"0x...">``)."""
    body = str(attr)
    bits = np.dtype(f"<u{dtype.itemsize}")
    if body.startswith('dense<"0x'):
        blob = body[len('dense<"0x'):body.index('"', len('dense<"0x'))]
        return np.frombuffer(bytes.fromhex(blob), bits).astype(bits.newbyteorder("=")).view(dtype)
    body = body[body.index("[") + 1:body.rindex("]")].replace("[", "").replace("]", "")
    items = [t.strip() for t in body.split(",")]
    return np.concatenate([np.array([int(t, 16)], bits).view(dtype) if t.startswith("0x")
                           else np.array([float(t)]).astype(dtype) for t in items])


def _scalar(attr: ir.Attribute):
    if isinstance(attr, ir.BoolAttr):
        return attr.value
    if isinstance(attr, ir.IntegerAttr):
        return attr.value
    return ir.FloatAttr(attr).value


@semantics("arith.bitcast", "vector.bitcast")
def _bitcast(op, p):
    (a,) = p.operands(op)
    out = p.result(op)
    dtype = np_dtype(op.results[0].type)
    shape = vector_shape(op.results[0].type)

    def run(env, ctx):
        x = np.ascontiguousarray(env[a])
        env[out] = x.view(dtype).reshape((x.shape[0],) + shape)

    return run
