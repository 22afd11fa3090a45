"""Register-level ``vector`` ops: broadcast, extract/insert, reductions, reshapes.

A ``vector<n x T>`` value is an array of shape ``(threads, n)``; positions index the trailing axes.
"""

from __future__ import annotations

import numpy as np
from mlir import ir

from .plan import defining_op, np_dtype, semantics, vector_shape

_DYNAMIC_POSITION = ir.ShapedType.get_dynamic_size()


@semantics("vector.broadcast", "vector.splat")
def _broadcast(op, p):
    (src,) = p.operands(op)
    out = p.result(op)
    shape = vector_shape(op.results[0].type)

    def run(env, ctx):
        x = env[src]
        lead = x.shape[0]
        x = x.reshape((lead,) + (1,) * (len(shape) + 1 - x.ndim) + x.shape[1:])
        env[out] = np.broadcast_to(x, (lead,) + shape)

    return run


def _position(op, p, dynamic_slots):
    """A function of ``env`` giving the index tuple (threads first) of the op's position."""
    static = list(ir.DenseI64ArrayAttr(op.attributes["static_position"]))
    if _DYNAMIC_POSITION not in static:
        index = (slice(None),) + tuple(static)
        return lambda env: index

    def resolve(env):
        dyn = iter(dynamic_slots)
        return (slice(None),) + tuple(int(env[next(dyn)][0]) if s == _DYNAMIC_POSITION else s
                                      for s in static)

    return resolve


@semantics("vector.extract")
def _extract(op, p):
    src, *dyn = p.operands(op)
    out = p.result(op)
    position = _position(op, p, dyn)

    def run(env, ctx):
        env[out] = env[src][position(env)]

    return run


@semantics("vector.insert")
def _insert(op, p):
    fields = _struct_fields(op)
    if fields is not None:  # the chain's result is fields of the struct: read them at once
        struct, first, n, chain = fields
        for link in chain:
            p.drop_unused([link.results[0]] + [link.operands[0]], chain)
        src, part, out = p.slot(struct), slice(first, first + n), p.result(op)
        dtype = np_dtype(op.results[0].type)

        def run(env, ctx):
            env[out] = env[src][:, part].astype(dtype, copy=False)

        return run
    value, dest, *dyn = p.operands(op)
    out = p.result(op)
    position = _position(op, p, dyn)

    def run(env, ctx):
        v, d = env[value], env[dest]
        if d.shape[0] >= v.shape[0]:
            result = d.copy()
        else:
            result = np.array(np.broadcast_to(d, (v.shape[0],) + d.shape[1:]))
        result[position(env)] = v
        env[out] = result

    return run


def _struct_fields(op):
    """``(struct, first, n, chain)`` when ``op`` ends a chain of ``vector.insert`` ops that put
    fields ``first .. first + n - 1`` of one ``llvm.extractvalue``-d struct at positions
    ``0 .. n - 1`` of a 1-D ``vector<n>`` (how MMA results return to registers), each link
    used only by the next; else None."""
    shape = vector_shape(op.results[0].type)
    if len(shape) != 1:
        return None
    chain, struct, first, link = [], None, None, op
    for i in reversed(range(shape[0])):
        if link is None or link.name != "vector.insert" or len(link.operands) != 2 or \
                list(ir.DenseI64ArrayAttr(link.attributes["static_position"])) != [i]:
            return None
        field = defining_op(link.operands[0])
        if field is None or field.name != "llvm.extractvalue":
            return None
        (pos,) = ir.DenseI64ArrayAttr(field.attributes["position"])
        if struct is None:
            struct, first = field.operands[0], pos - i
        elif field.operands[0] != struct or pos - i != first:
            return None
        chain.append(link)
        if i:
            dest = link.operands[1]
            if len(list(dest.uses)) != 1:
                return None
            link = defining_op(dest)
    return struct, first, shape[0], chain


_REDUCTIONS = {"add": np.sum, "mul": np.prod, "maximumf": np.max, "minimumf": np.min,
               "maxnumf": np.nanmax, "minnumf": np.nanmin, "maxsi": np.max, "minsi": np.min,
               "and": np.bitwise_and.reduce, "or": np.bitwise_or.reduce,
               "xor": np.bitwise_xor.reduce}


@semantics("vector.reduction")
def _reduction(op, p):
    src, *acc = p.operands(op)
    out = p.result(op)
    kind = str(op.attributes["kind"]).split("<")[-1].rstrip(">")
    fn = _REDUCTIONS[kind]
    dtype = np_dtype(op.results[0].type)
    combine = {"add": np.add, "mul": np.multiply}.get(kind, None)

    def run(env, ctx):
        x = env[src]
        wide = x.astype(np.float64) if dtype.kind == "f" and kind in ("add", "mul") else x
        r = fn(wide, axis=-1)
        if acc:
            a = env[acc[0]]
            r = combine(r, a) if combine else fn(np.stack(np.broadcast_arrays(r, a), -1), axis=-1)
        env[out] = np.asarray(r).astype(dtype)

    return run


@semantics("vector.shape_cast")
def _shape_cast(op, p):
    (src,) = p.operands(op)
    out = p.result(op)
    shape = vector_shape(op.results[0].type)

    def run(env, ctx):
        x = env[src]
        env[out] = x.reshape((x.shape[0],) + shape)

    return run


@semantics("vector.from_elements")
def _from_elements(op, p):
    elems = p.operands(op)
    out = p.result(op)
    shape = vector_shape(op.results[0].type)

    def run(env, ctx):
        parts = np.broadcast_arrays(*(env[e] for e in elems))
        env[out] = np.stack(parts, axis=-1).reshape((parts[0].shape[0],) + shape)

    return run


@semantics("vector.shuffle")
def _shuffle(op, p):
    a, b = p.operands(op)
    out = p.result(op)
    mask = list(ir.DenseI64ArrayAttr(op.attributes["mask"]))
    first = vector_shape(op.operands[0].type)[0]
    if max(mask) < first and mask == list(range(mask[0], mask[0] + len(mask))):
        part = slice(mask[0], mask[0] + len(mask))  # a run of the first operand: a view

        def run(env, ctx):
            env[out] = env[a][:, part]

        return run

    pick = None if mask == list(range(len(mask))) else mask  # None: the two side by side

    def run(env, ctx):
        x, y = np.broadcast_arrays(env[a], env[b]) if env[a].shape[0] != env[b].shape[0] \
            else (env[a], env[b])
        both = np.concatenate([x, y], axis=1)
        env[out] = both if pick is None else both[:, pick]

    return run
