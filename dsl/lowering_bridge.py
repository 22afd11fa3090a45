"""What the front end hands to lowering: the kernel signature, the cache key, argument specs.

Kept apart from :mod:`kiln.kernel` so the tracing code does not import lowering modules
(``kiln.lowering.signature``/``arrays``/``cache`` are imported here, lazily where heavy).

The on-disk cache key is ``make_key(kernel source, sources of referenced @kiln.func helpers and
@kiln.struct classes, captured closure/global values, argument specs, constexpr values,
options.key())``, each source after the file and line it starts at; helpers are found through
the kernel's globals and closure (names it uses directly; ``module.helper`` attribute
references are not followed).
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

from .dtypes import DType
from .errors import KilnTypeError

def tensor_arg_spec(name: str, value: Any) -> tuple[DType, int, bool]:
    """(dtype, rank, innermost-stride-is-1) of an array argument."""
    from kiln.lowering.arrays import describe_array, is_array

    if not is_array(value):
        raise KilnTypeError(f"argument '{name}' expects an array, got {type(value).__name__}",
                            fix="pass a numpy array or a torch/cupy CUDA tensor")
    info = describe_array(value)
    if info.rank == 0:
        raise KilnTypeError(f"argument '{name}' is a 0-d array", fix="pass a scalar instead")
    return info.dtype, info.rank, info.contiguous_last


def lowering_signature(name: str, specs, block, constexprs, *, dynamic_shared_bytes: int = 0,
                       cluster=None, programmatic_launch: bool = False):
    """The :class:`~kiln.lowering.signature.KernelSignature` of a traced specialisation."""
    from kiln.lowering.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam

    params = []
    for s in specs:
        if s.kind == "tensor":
            params.append(TensorParam(s.name, s.dtype.name, s.rank, s.contiguous))
        elif s.kind == "tensormap":
            params.append(TensorMapParam(s.name, s.dtype.name, s.rank, s.tensormap.box,
                                         s.tensormap.swizzle, s.tensormap.oob_fill_nan))
        elif s.kind == "scalar":
            params.append(ScalarParam(s.name, s.dtype.name))
    return KernelSignature(name, tuple(params), block=block, constexprs=constexprs,
                           dynamic_shared_bytes=dynamic_shared_bytes, cluster=cluster,
                           programmatic_launch=programmatic_launch)


def _source(obj) -> str:
    """``obj``'s source text after the file and line it starts at: compiled kernels carry source
    locations (error messages, the AMD line tables), so a kernel that moves must miss the cache,
    even with the same text."""
    try:
        lines, first = inspect.getsourcelines(obj)
    except (OSError, TypeError):
        return repr(obj)
    return f"{inspect.getsourcefile(obj)}:{first}\n{''.join(lines)}"


def _referenced(fn: Callable) -> dict[str, Any]:
    """Objects the function's code names directly, resolved through closure then globals."""
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        names.update(code.co_freevars)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    scope = dict(fn.__globals__)
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            scope[var] = cell.cell_contents
        except ValueError:
            pass
    return {n: scope[n] for n in names if n in scope}


def dependency_sources(fn: Callable) -> list[str]:
    """Sources of every @kiln.func / @kiln.struct reachable from ``fn`` (sorted, deduplicated)."""
    seen: dict[int, str] = {}
    todo = [fn]
    while todo:
        current = todo.pop()
        for obj in _referenced(current).values():
            target = getattr(obj, "fn", None) if type(obj).__name__ == "KilnFunc" else None
            if target is not None and id(target) not in seen:
                seen[id(target)] = _source(target)
                todo.append(target)
            elif isinstance(obj, type) and hasattr(obj, "__kiln_fields__") and id(obj) not in seen:
                seen[id(obj)] = _source(obj)
                todo.extend(v.__wrapped__ for v in vars(obj).values()
                            if hasattr(v, "__wrapped__"))
    return sorted(seen.values())


def _value_fingerprint(value) -> str | None:
    """A stable text for a captured value that can change what a kernel traces, else None.

    Plain data (numbers, strings, dtypes, tuples of them) and frozen dataclasses (configs,
    layouts, swizzles) by ``repr``; plain Python functions a kernel may call at trace time by
    source. Modules, kernels and arrays are left out (kernels and helpers are keyed by source
    elsewhere; arrays are run-time arguments).
    """
    simple = (int, float, str, bool, DType, type(None))
    if isinstance(value, simple):
        return repr(value)
    if isinstance(value, tuple):
        parts = [_value_fingerprint(v) for v in value]
        return None if None in parts else f"({', '.join(parts)})"
    params = getattr(type(value), "__dataclass_params__", None)
    if params is not None and params.frozen:
        return repr(value)
    if isinstance(value, (types.FunctionType, types.MethodType)):
        # Source text alone cannot tell apart two lambdas written on one line.
        code = value.__code__
        return f"{_source(value)}|{code.co_code.hex()}|{code.co_consts!r}"
    return None


def captured_values(fn: Callable) -> list[str]:
    """``name=fingerprint`` of the closure variables and module globals ``fn`` names: a kernel
    made by a factory, or one reading a module-level constant, traces differently for each of
    them although its source text is the same."""
    found = []
    for name, value in sorted(_referenced(fn).items()):
        fingerprint = _value_fingerprint(value)
        if fingerprint is not None:
            found.append(f"{name}={fingerprint}")
    return found


def source_key(fn: Callable) -> str:
    """The part of the cache key that depends on source text (kernel and its helpers) and on
    the constants a factory-made kernel closes over."""
    return "\0".join([_source(fn), *dependency_sources(fn), *captured_values(fn)])


def cache_key(source_part: str, specs, options_key: str) -> str:
    from kiln.lowering.cache import make_key

    return make_key(source_part, *(s.key() for s in specs), options_key)
