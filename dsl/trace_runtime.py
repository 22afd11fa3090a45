"""Run-time half of the AST rewrite: builds ``scf.if`` / ``scf.for`` for traced control flow.

:mod:`kiln.ast_rewrite` turns a traced ``if`` into two nested functions (one per branch) that
take the variables the branches assign and return their new values, then calls
:func:`if_stmt`; a ``for ... in kiln.range(...)`` becomes a body function and :func:`for_stmt`.
Conditions and ranges that turn out to be plain Python values run as ordinary Python instead.

Values crossing a region boundary are flattened with :func:`flatten` (Values, Handles, tuples,
lists and any object with ``__kiln_flatten__`` / ``__kiln_unflatten__``, e.g. ``@kiln.struct``).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

from mlir import ir
from mlir.dialects import scf
from mlir.dialects._scf_ops_gen import IfOp as _IfOpRegions  # scf.IfOp without its blocks

from . import builder
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError, SourceLoc, UnsupportedError
from .values import Undefined, Value, cast, constant, is_literal

# Loop iterations one kernel trace may run in Python (every ``for`` not over kiln.range, and
# ``while``, nested loops counting each inner iteration). The shipped kernels unroll at most
# ~1000; 65536 iterations of a three-statement body took over a minute to trace. A loop past
# the budget raises KilnValueError naming it.
MAX_UNROLLED_ITERATIONS = 1 << 13


_MISSING = Undefined("?", "not defined")
MISSING = _MISSING  # what capture() gives an unbound name (the rewrite unbinds it again)


def capture(frame_locals: dict, names: Sequence[str]) -> list:
    """Current values of ``names`` (``_MISSING`` for names not bound yet)."""
    return [frame_locals.get(n, _MISSING) for n in names]


def is_traced(x: Any) -> bool:
    return isinstance(x, Value)


def static_while_cond(cond: Any, filename: str, line: int, col: int,
                      end_col: int | None) -> Any:
    if isinstance(cond, Value):
        raise UnsupportedError("`while` on a traced condition is not supported",
                               fix="use `for i in kiln.range(lo, hi)` with a traced bound, and "
                                   "`if` inside the body",
                               loc=SourceLoc(filename, line, col, end_col))
    if cond:
        _count_unrolled(filename, line, "while loop")
    return cond


def unrolled(iterable: Any, filename: str, line: int):
    """Iterate a Python-unrolled ``for`` (the rewrite wraps every one), counting its iterations
    against :data:`MAX_UNROLLED_ITERATIONS`."""
    for item in iterable:
        _count_unrolled(filename, line, "for loop")
        yield item


def static_for(iterable: Any, body_fn: Callable, target: Any, initial: list, filename: str,
               line: int) -> tuple:
    """A Python-unrolled ``for`` whose body the rewrite made one function, shared with the
    traced path (:func:`for_stmt`): ``body_fn(item, *values)`` per item; the loop target's
    last item (``target``, its value before the loop, when there was none) and the names' values."""
    values = tuple(initial)
    for target in unrolled(iterable, filename, line):
        values = body_fn(target, *values)
    return (target, *values)


def _count_unrolled(filename: str, line: int, what: str) -> None:
    if not builder.is_tracing():
        return
    state = builder.current()
    state.unrolled_iterations += 1
    if state.unrolled_iterations > MAX_UNROLLED_ITERATIONS:
        raise KilnValueError(
            f"this {what} unrolls at trace time and the kernel's unrolled loops passed "
            f"{MAX_UNROLLED_ITERATIONS} iterations (kiln.MAX_UNROLLED_ITERATIONS)",
            fix="use `for i in kiln.range(...)` for a loop that runs on the GPU",
            loc=SourceLoc(filename, line))


def traced_return():
    raise UnsupportedError("`return` inside an `if` whose condition is a traced value",
                           fix="assign the result to a variable in both branches and return it "
                               "after the if")


def traced_raise():
    raise UnsupportedError("`raise` inside an `if` whose condition is a traced value: both "
                           "branches are traced, so it would raise whatever the condition is "
                           "at run time",
                           fix="check the condition on the host before the launch, or make it "
                               "a kiln.constexpr so the `if` runs in Python")


def traced_break():
    raise UnsupportedError("`break`/`continue` inside a kiln.range loop",
                           fix="guard the rest of the body with an `if` instead")


# ---- flattening ---------------------------------------------------------------------------

def flatten(obj: Any) -> tuple[list[ir.Value], Any]:
    """Leaves and a tree spec of a loop-carried / yielded object."""
    if isinstance(obj, (tuple, list)):
        leaves, specs = [], []
        for item in obj:
            sub, spec = flatten(item)
            leaves += sub
            specs.append((spec, len(sub)))
        return leaves, ("seq", type(obj), tuple(specs))
    if isinstance(obj, Undefined):
        obj.fail()
    if hasattr(type(obj), "__kiln_flatten__"):
        leaves, aux = obj.__kiln_flatten__()
        return list(leaves), ("leaf", type(obj), aux)
    raise KilnTypeError(f"a {type(obj).__name__} cannot be carried through a traced if/loop",
                        fix="carry Values, Handles, tuples or @kiln.struct instances only")


def unflatten(spec: Any, values: Sequence[ir.Value]) -> Any:
    if spec[0] == "seq":
        items, pos = [], 0
        for sub, n in spec[2]:
            items.append(unflatten(sub, values[pos:pos + n]))
            pos += n
        return spec[1](items)
    return spec[1].__kiln_unflatten__(spec[2], list(values))


def _describe(spec: Any) -> str:
    if spec[0] == "seq":
        return f"{spec[1].__name__}({', '.join(_describe(s) for s, _ in spec[2])})"
    return spec[1].__name__


def materialize(obj: Any, like: Any = None) -> Any:
    """Turn Python literals inside ``obj`` into Values (matching ``like``'s dtype when given)."""
    if is_literal(obj):
        if isinstance(like, Value):
            return cast(constant(obj, dt.literal_dtype(obj, like.dtype)), like.dtype)
        return constant(obj, dt.literal_dtype(obj, None))
    if isinstance(obj, (tuple, list)):
        same_shape = isinstance(like, (tuple, list)) and len(like) == len(obj)
        likes = like if same_shape else [None] * len(obj)
        return type(obj)(materialize(o, l) for o, l in zip(obj, likes))
    return obj


def _check_same(name: str, spec_a, types_a, spec_b, types_b, what: str):
    if spec_a != spec_b or types_a != types_b:
        ta = ", ".join(str(t) for t in types_a)
        tb = ", ".join(str(t) for t in types_b)
        raise KilnTypeError(
            f"variable '{name}' changes type {what}: {_describe(spec_a)}[{ta}] vs "
            f"{_describe(spec_b)}[{tb}]",
            fix=f"kiln.cast '{name}' to one dtype (e.g. kiln.cast({name}, kiln.f32)) so both "
                "paths agree")


def _ir_types(values):
    return [v.type for v in values]  # compared as types (printing a 64-field struct is slow)


def reachable_structs(frame_locals: dict, names: Sequence[str]) -> list:
    """The ``@kiln.struct`` objects a region reads: it may mutate them in place."""
    seen, out = set(), []
    for n in names:
        obj = frame_locals.get(n)
        # A struct *class* named in the region (e.g. a constructor call) is not a carried value.
        if (hasattr(obj, "__kiln_assign__") and not isinstance(obj, type)
                and id(obj) not in seen):
            seen.add(id(obj))
            out.append(obj)
    return out


def _copy(obj: Any) -> Any:
    leaves, spec = flatten(obj)
    return unflatten(spec, leaves)


def _same_leaves(a: Any, b: Any) -> bool:
    la, sa = flatten(a)
    lb, sb = flatten(b)
    return sa == sb and len(la) == len(lb) and all(x == y for x, y in zip(la, lb))


# ---- if -----------------------------------------------------------------------------------

def if_stmt(cond: Value, then_fn: Callable, else_fn: Callable | None, names: Sequence[str],
            initial: list, objects: list) -> tuple:
    """Build ``scf.if`` for a traced condition; returns the new values of ``names``.

    Struct ``objects`` the branches may mutate are restored between the branches and get the
    ``scf.if`` results assigned in place afterwards.
    """
    cond = cast(cond, dt.i1) if cond.dtype is not dt.i1 else cond
    if cond.shape:
        raise KilnTypeError("an `if` condition must be a scalar, got a vector",
                            fix="reduce the vector first or use kiln.where(mask, a, b)")
    saved = [_copy(o) for o in objects]
    draft = scf.IfOp(cond.ir, [], has_else=True)
    with ir.InsertionPoint(draft.then_block):
        then_out = list(then_fn(*_fresh(initial)))
    then_objects = [_copy(o) for o in objects]
    for obj, old in zip(objects, saved):
        obj.__kiln_assign__(old)
    with ir.InsertionPoint(draft.else_block):
        else_out = list(else_fn(*_fresh(initial))) if else_fn else list(_fresh(initial))
    else_objects = [_copy(o) for o in objects]

    # slots: (label, value before, then value, else value); objects come after the names
    slots = list(zip(names, initial, then_out, else_out))
    slots += [(type(o).__name__, old, t, e)
              for o, old, t, e in zip(objects, saved, then_objects, else_objects)]
    outputs = list(initial) + list(saved)
    results_of, yields_then, yields_else, result_types = [], [], [], []
    for k, (name, before, t_val, e_val) in enumerate(slots):
        if k >= len(names) and _same_leaves(t_val, before) and _same_leaves(e_val, before):
            continue
        if t_val is before and e_val is before:
            continue
        if isinstance(t_val, Undefined) or isinstance(e_val, Undefined):
            outputs[k] = Undefined(name, "assigned in only one branch of a traced `if`")
            continue
        if (is_literal(t_val) and is_literal(e_val) and type(t_val) is type(e_val)
                and t_val == e_val):
            outputs[k] = t_val
            continue
        with ir.InsertionPoint(draft.then_block):
            t_val = materialize(t_val, e_val)
            t_leaves, t_spec = flatten(t_val)
        with ir.InsertionPoint(draft.else_block):
            e_val = materialize(e_val, t_val)
            e_leaves, e_spec = flatten(e_val)
        _check_same(name, t_spec, _ir_types(t_leaves), e_spec, _ir_types(e_leaves),
                    "between the branches of a traced `if`")
        results_of.append((k, t_spec, len(t_leaves)))
        yields_then += t_leaves
        yields_else += e_leaves
        result_types += [v.type for v in t_leaves]

    with ir.InsertionPoint(draft.then_block):
        scf.YieldOp(yields_then)
    with ir.InsertionPoint(draft.else_block):
        scf.YieldOp(yields_else)
    final = draft
    if result_types:  # result types are known only after tracing: move the bodies over
        # the generated builder leaves both regions empty; whole blocks move (moving their ops
        # one by one cost each nesting level a pass over every op inside it)
        final = _IfOpRegions(result_types, cond.ir, ip=ir.InsertionPoint(draft))
        draft.then_block.append_to(final.regions[0])
        draft.else_block.append_to(final.regions[1])
        draft.operation.erase()
    pos = 0
    results = list(final.results)
    for k, spec, n in results_of:
        outputs[k] = unflatten(spec, results[pos:pos + n])
        pos += n
    for obj, new in zip(objects, outputs[len(names):]):
        obj.__kiln_assign__(new)
    return tuple(outputs[:len(names)])


def static_if(cond: Any, then_fn: Callable, else_fn: Callable | None, initial: list) -> tuple:
    """An ``if`` on a plain Python condition: the taken branch's function on the current
    values of the names the branches assign (``MISSING`` for unbound ones); their new values."""
    if cond:
        return then_fn(*initial)
    return else_fn(*initial) if else_fn is not None else tuple(initial)


def _fresh(values: list) -> list:
    """Copies of struct-like objects so each branch mutates its own instance."""
    return [_copy(v) if hasattr(v, "__kiln_assign__") else v for v in values]


# ---- for ----------------------------------------------------------------------------------

class TracedRange:
    """``kiln.range(lo, hi, step=1)``: an ``scf.for`` loop with a traced induction variable.

    Bounds may be Python ints or traced integers; the induction variable is an i32 Value (i64 or
    index if a bound is). Variables assigned in the body that exist before the loop become
    loop-carried values automatically and must keep their dtype.

    Example::

        acc = 0.0
        for k in kiln.range(0, K, 16):
            acc += a[row, k] * b[k, col]
    """

    def __init__(self, *args, step=1):
        if len(args) == 1:
            lo, hi = 0, args[0]
        elif len(args) == 2:
            lo, hi = args
        elif len(args) == 3:
            lo, hi, step = args
        else:
            raise KilnTypeError(f"kiln.range takes 1 to 3 positional bounds, got {len(args)}",
                                fix="kiln.range(hi), kiln.range(lo, hi) or "
                                    "kiln.range(lo, hi, step)")
        # A traced step is not known until run time; scf.for with step <= 0 never ends.
        if isinstance(step, int) and not isinstance(step, bool) and step <= 0:
            raise KilnValueError(f"kiln.range step must be positive, got {step}",
                                 fix="count up with a positive step (kiln.range(lo, hi, 1)); "
                                     "index from the end, e.g. hi - 1 - i, to go down")
        self.lo, self.hi, self.step = lo, hi, step

    def __iter__(self):
        raise KilnTypeError("kiln.range can only drive a `for` statement in a kernel body",
                            fix="write `for i in kiln.range(...)` directly, or use "
                                "kiln.static_range to unroll in Python")


def static_range(*args):
    """A loop unrolled at trace time (bounds must be Python ints / constexprs).

    Its iterations count against :data:`MAX_UNROLLED_ITERATIONS` with every other Python loop
    of the trace. Example: ``for s in kiln.static_range(STAGES): ...``.
    """
    for a in args:
        if isinstance(a, Value):
            raise KilnTypeError("kiln.static_range needs Python int bounds, got a traced value",
                                fix="use kiln.range(...) for traced bounds")
        # Integers as Python's range takes them (numpy ints too, as before the budget); no bools.
        if isinstance(a, bool) or not hasattr(type(a), "__index__"):
            raise KilnTypeError(f"kiln.static_range needs Python int bounds, got "
                                f"{type(a).__name__} {a!r}", fix="pass ints or constexprs")
    args = tuple(operator.index(a) for a in args)
    if not 1 <= len(args) <= 3:
        raise KilnTypeError(f"kiln.static_range takes 1 to 3 ints, got {len(args)}",
                            fix="kiln.static_range(hi), (lo, hi) or (lo, hi, step)")
    if len(args) == 3 and args[2] == 0:
        raise KilnValueError("kiln.static_range step must not be zero", fix="use a step of 1")
    steps = range(*args)
    count = max(0, -((steps.start - steps.stop) // steps.step))  # len() overflows past 2**63
    if count > MAX_UNROLLED_ITERATIONS:
        raise KilnValueError(f"kiln.static_range{args} unrolls {count} iterations at trace "
                             f"time; the limit is {MAX_UNROLLED_ITERATIONS} "
                             "(kiln.MAX_UNROLLED_ITERATIONS)",
                             fix="use `for i in kiln.range(...)` for a loop that runs on the GPU")
    return steps


def _bound_dtype(bounds) -> dt.DType:
    traced = [b.dtype for b in bounds if isinstance(b, Value)]
    for d in traced:
        if not d.is_int or d.kind == "bool":
            raise KilnTypeError(f"kiln.range bounds must be integers, got {d}",
                                fix="kiln.cast the bound to kiln.i32")
    result = dt.i32
    for d in traced:
        result = dt.promote(result, d)
    return result


def for_stmt(rng: TracedRange, body_fn: Callable, names: Sequence[str], initial: list,
             objects: list) -> tuple:
    """Build ``scf.for`` for a kiln.range loop; returns the values of ``names`` after it.

    Names bound before the loop and struct ``objects`` the body reads are loop-carried.
    A loop object with ``__kiln_for__`` (``kiln.pipeline``) builds its own loop.
    """
    custom = getattr(rng, "__kiln_for__", None)
    if custom is not None:
        return custom(body_fn, names, initial, objects)
    idx_dtype = _bound_dtype((rng.lo, rng.hi, rng.step))
    lo, hi, step = (cast(b, idx_dtype) if isinstance(b, Value) else constant(b, idx_dtype)
                    for b in (rng.lo, rng.hi, rng.step))
    carried_pos = [k for k, v in enumerate(initial) if v is not _MISSING]
    labels = [names[k] for k in carried_pos] + [type(o).__name__ for o in objects]
    inits = [materialize(initial[k]) for k in carried_pos] + [_copy(o) for o in objects]
    init_leaves, (_, _, specs) = flatten(inits)  # per init: (its spec, its leaf count)
    loop = scf.ForOp(lo.ir, hi.ir, step.ir, init_leaves)
    block_args = list(loop.inner_iter_args)

    def rebuild(values):
        out, pos = [], 0
        for spec, n in specs:
            out.append(unflatten(spec, values[pos:pos + n]))
            pos += n
        return out

    with ir.InsertionPoint(loop.body):
        inside = rebuild(block_args)
        args = list(initial)
        for k, v in zip(carried_pos, inside):
            args[k] = v
        for obj, v in zip(objects, inside[len(carried_pos):]):
            obj.__kiln_assign__(v)
        out = list(body_fn(Value(loop.induction_variable, idx_dtype), *args))
        news = [out[k] for k in carried_pos] + list(objects)
        yields = []
        for label, (spec, n), init, new in zip(labels, specs, inits, news):
            leaves, new_spec = flatten(materialize(new, init))
            _check_same(label, spec, _ir_types(block_args[len(yields):len(yields) + n]),
                        new_spec, _ir_types(leaves), "inside a kiln.range loop")
            yields += leaves
        scf.YieldOp(yields)
    after = rebuild(list(loop.results))
    outputs = [Undefined(n, "first assigned inside a kiln.range loop body") for n in names]
    for k, v in zip(carried_pos, after):
        outputs[k] = v
    for obj, v in zip(objects, after[len(carried_pos):]):
        obj.__kiln_assign__(v)
    return tuple(outputs)
