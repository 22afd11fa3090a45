"""Guards of the library's plan caches: the steady-state look-up of a repeat call.

A :class:`kiln.kernels.runtime.PlanCache` finds a plan by a key built from every argument
(:func:`~kiln.kernels.runtime.spec`: a torch tensor's shape, dtype, strides and device), then
hashed: about 2 µs for decode's five tensors on a fast host. A serving loop calls an entry
point with one shape class over and over, so the cache also keeps the guard of the last plan
it returned: a function generated for that call's values that is true exactly when another
call's values would make an equal key (tensors compared field by field, without building or
hashing a key; other values by type and ``==``). A call whose guard fails takes the keyed
look-up, which then makes its plan's guard the last one. Where the native launch shim was
built (:mod:`kiln.runtime.native`), :func:`kiln.kernels.runtime.guard_of` makes the same
checks in one C call (``guard_values``, a partial application to the values' spec), not in
generated Python, and hands the torch tensors to torch's own C++ tensor guard
(:func:`torch_tensor_check`) in one call where this torch has one.

Example::

    guard = make_guard((q, None, 2, "sm_90a"))
    guard((q2, None, 2, "sm_90a"))   # True: q2 has q's shape, dtype, strides and device
    guard((q2.T, None, 2, "sm_90a"))  # False: other strides
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from kiln.arrays import is_torch_tensor

GUARD_VALUE, GUARD_TENSOR, GUARD_CHECKED = 0, 1, 2  # guard_values' kinds (native_launch.h)
# The part of a guard that checks a torch tensor ``{a}`` against the call it was made for:
# what spec() keys it by (shape, dtype, strides, device), and its type. A contiguous tensor's
# strides are its shape's (``is_contiguous()`` reads no tuple: half the time of ``stride()``),
# up to those of size-1 dimensions, which no index reaches.
_TORCH_CHECK = ("type({a}) is T{i} and {a}.shape == S{i} and {a}.dtype is D{i} and "
                "{strides} and {a}.get_device() == G{i}")


def make_guard(values: tuple, native: Callable | None = None,
               tensor_check: Callable | None = None) -> Callable[[tuple], bool] | None:
    """A function of a values tuple, true exactly when each value matches ``values``' (torch
    tensors by type, shape, dtype, strides and device, a contiguous one's strides by
    contiguity; None by identity; other values by type and ``==``); None when some value
    cannot be guarded exactly (a numpy or other array, a value not equal to itself such as
    NaN). ``native``: the native launch shim's ``guard_values``, which makes the same checks
    in one C call (a partial application of it to the spec); else a generated function.
    ``tensor_check`` (with ``native``): makes, from the torch tensors among ``values``, a
    checker of tensors in their order that is at least as strict (torch's C++ guard,
    :func:`torch_tensor_check`), or returns None; the native guard then
    hands the tensors to it instead of reading their attributes one by one."""
    if native is not None and tensor_check is not None:
        tensors = tuple(v for v in values if is_torch_tensor(v))
        checker = tensor_check(tensors) if tensors else None
        if checker is not None:
            guard = make_guard(values, native)
            if guard is None:
                return None
            spec = tuple((GUARD_CHECKED, type(v)) if is_torch_tensor(v) else entry
                         for v, entry in zip(values, guard.args[0]))
            return functools.partial(native, spec, checker)
    namespace: dict[str, Any] = {}
    checks = [f"len(values) != {len(values)}"]
    spec: list = []  # guard_values' entries (see native_guard.c)
    for i, value in enumerate(values):
        a = f"v{i}"
        if value is None:
            checks.append(f"{a} is None")
            spec.append(None)
        elif is_torch_tensor(value):
            contiguous = value.is_contiguous()
            namespace.update({f"T{i}": type(value), f"S{i}": value.shape, f"D{i}": value.dtype,
                              f"R{i}": value.stride(), f"G{i}": value.get_device()})
            strides = f"{a}.is_contiguous()" if contiguous else f"{a}.stride() == R{i}"
            checks.append(_TORCH_CHECK.format(a=a, i=i, strides=strides))
            spec.append((GUARD_TENSOR, type(value), tuple(value.shape), value.dtype,
                         value.get_device(), None if contiguous else tuple(value.stride())))
        elif _exact(value):
            namespace.update({f"T{i}": type(value), f"C{i}": value})
            checks.append(f"type({a}) is T{i} and {a} == C{i}")
            spec.append((GUARD_VALUE, type(value), value))
        else:
            return None
    if native is not None:
        return functools.partial(native, tuple(spec))
    lines = ["def guard(values):", f"    if {checks[0]}:", "        return False"]
    if values:
        lines.append(f"    {''.join(f'v{i}, ' for i in range(len(values)))}= values")
    lines.append(f"    return {' and '.join(checks[1:]) or 'True'}")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<kiln plan guard>", "exec"), namespace)
    return namespace.pop("guard")


def _exact(value: Any) -> bool:
    """Whether ``value`` is a plain value whose ``==`` with itself is exactly True (not an
    array, not NaN): a guard may compare another call's value with it."""
    if hasattr(value, "__array__") or hasattr(value, "__cuda_array_interface__") or \
            hasattr(value, "__dlpack__") or hasattr(value, "data_ptr"):
        return False
    try:
        hash(value)
        return (value == value) is True
    except Exception:  # an unhashable or odd __eq__: not guarded, the keyed look-up decides
        return False


def torch_tensor_check(tensors: tuple):
    """A C++ check that torch tensors match ``tensors`` in order, or None where this torch has
    none that works: torch dynamo's ``TensorGuards`` (type, dtype, device, dispatch keys,
    ``requires_grad``, exact sizes and strides: stricter than a plan key, so a call it refuses
    takes the keyed look-up), which reads each tensor's metadata in C++, not through its
    Python attributes.
    Example: ``torch_tensor_check((q, k))(q2, k2)`` is True for tensors laid out as q and k."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:  # noqa: BLE001  (a torch without dynamo, or one that fails to load it)
        return None
    for options in (dict(dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors]),
                    dict(dynamic_shapes=False)):  # the constructor of newer / older torch
        try:
            check = TensorGuards(*tensors, **options).check
            # It must pass the examples and refuse another rank (a check that checks).
            if check(*tensors) is True and check(tensors[0][None], *tensors[1:]) is False:
                return check
        except Exception:  # noqa: BLE001  (another constructor signature: the next one)
            continue
    return None
