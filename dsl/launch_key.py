"""The cheap key ``kernel[grid](...)`` looks its launch up by, and guards that re-check it.

:func:`launch_key_part` gives one positional argument's part of the key: a constexpr's typed
key, a Python scalar's type, an array's kind, dtype, rank and whether its innermost stride is
1 (plus ``is_cuda`` for torch tensors). Two calls whose keys are equal (with the keyword values,
their types and the default target) launch the same binary.

:func:`launch_guard` compiles, for one call, a function that is true exactly when another call
would have the same key, without building it: it decides where an exact guard exists, and
:func:`kiln.runtime.launch_fast.guarded_launcher` fuses the same checks with the packing of
the kernel's last launch, so a loop launching one specialisation skips the key, its hashing
and the dict look-up. A torch tensor's part is written once (``_TORCH_PART``).

Example::

    launch_key_part(torch.zeros(4, device="cuda"), False)
    # (<class 'torch.Tensor'>, torch.float32, 1, True, True)
    guard = launch_guard((x, y, 4, 2.0), {"BLOCK": 256}, (False,) * 4)
    guard((x2, y2, 8, 3.0), {"BLOCK": 256})   # True: same dtypes, ranks, layouts, types
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .arrays import describe_array
from .fingerprint import EXACT_KEY_TYPES, constexpr_key

# A torch tensor's key part after its type, as an expression of the tensor ``{a}``.
_TORCH_PART = ("({a}.dtype, {a}.dim(), {a}.is_cuda, "
               "{a}.dim() == 0 or {a}.stride(-1) == 1 or {a}.shape[-1] <= 1)")


def launch_key_part(a: Any, is_constexpr: bool) -> Any:
    """One positional argument's part of the launch key (see the module docs)."""
    if is_constexpr:
        return constexpr_key(a)
    kind = type(a)
    if kind is int or kind is float or kind is bool:
        return kind
    keyer = _key_parts.get(kind)
    if keyer is None:
        keyer = _key_parts.setdefault(kind, _key_part_of_type(kind))
    return keyer(a)


# Array type -> its key part. The kind is in it because each kind of array takes another
# generated launcher (kiln.runtime.launch_fast).
_key_parts: dict[type, Callable[[Any], Any]] = {}


def _is_torch_type(kind: type) -> bool:
    return all(hasattr(kind, name) for name in ("data_ptr", "stride", "is_cuda"))


def _key_part_of_type(kind: type) -> Callable[[Any], Any]:
    if kind is np.ndarray:
        return lambda a: (kind, a.dtype, a.ndim,
                          a.ndim == 0 or a.strides[-1] == a.itemsize or a.shape[-1] <= 1)
    if _is_torch_type(kind):
        return eval(f"lambda a: (kind, *{_TORCH_PART.format(a='a')})", {"kind": kind})
    if issubclass(kind, np.generic):
        return lambda a: a.dtype
    return _instance_key_part


def _instance_key_part(a: Any) -> Any:
    """The key part of a value whose type does not say it is an array (an instance may carry
    its own attributes); anything else is rejected or accepted by the full specialisation."""
    if hasattr(a, "data_ptr") and hasattr(a, "stride"):
        return (type(a), a.dtype, a.dim(), getattr(a, "is_cuda", None),
                a.dim() == 0 or a.stride(-1) == 1 or a.shape[-1] <= 1)
    if hasattr(a, "__cuda_array_interface__") or hasattr(a, "__dlpack__"):
        info = describe_array(a)
        return (type(a), info.dtype, info.rank, info.contiguous_last)
    return type(a)


def exact_keywords(kwargs: dict) -> bool:
    """Whether ``==`` on these keyword values is exact (equal and of the same type means the
    same kernel): not for -0.0 == 0.0, NaN, containers (2 == 2.0 inside) or objects compared
    by identity."""
    return all(type(v) in EXACT_KEY_TYPES or (type(v) is float and v and v == v)
               for v in kwargs.values())


def launch_guard(args: tuple, kwargs: dict, constexpr_flags: tuple[bool, ...]
                 ) -> Callable[[tuple, dict], bool] | None:
    """A function of ``(args, kwargs)`` true exactly when that call's launch key equals this
    one's, keywords in any order (the default target aside, which the caller compares); None
    where a guard would not
    be cheaper or exact: positional constexprs, keyword values whose ``==`` is not exact, and
    argument kinds other than Python scalars and CUDA torch tensors."""
    if any(constexpr_flags[:len(args)]) or not exact_keywords(kwargs):
        return None
    namespace: dict[str, Any] = {"KW": dict(kwargs)}
    checks = []
    for i, a in enumerate(args):
        kind = namespace[f"T{i}"] = type(a)
        checks.append(f"type(a{i}) is T{i}")
        if kind in (int, float, bool):
            continue
        if not _is_torch_type(kind):
            return None
        namespace[f"V{i}"] = launch_key_part(a, False)[1:]
        checks.append(f"{_TORCH_PART.format(a=f'a{i}')} == V{i}")
    checks.append("kwargs == KW")
    for j, (name, value) in enumerate(kwargs.items()):
        namespace[f"K{j}"] = type(value)
        checks.append(f"type(kwargs[{name!r}]) is K{j}")
    unpack = f"    {', '.join(f'a{i}' for i in range(len(args)))}, = args\n" if args else ""
    source = (f"def guard(args, kwargs):\n    if len(args) != {len(args)}:\n"
              f"        return False\n{unpack}    return ({' and '.join(checks)})\n")
    exec(compile(source, "<kiln launch guard>", "exec"), namespace)
    return namespace.pop("guard")
