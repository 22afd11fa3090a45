"""Per-specialisation launchers: the steady-state path of ``kernel[grid](...)``.

A ``kernel[grid](...)`` call whose cheap key (kinds, dtypes, ranks and contiguity of the
arguments, constexprs, options) hits a launch that already ran once takes this path: a Python
function generated for exactly that specialisation and those kinds of arguments packs every
flat C argument with one ``struct.pack_into`` and makes one call into the launcher: the
native shim's ``cuLaunchKernel`` of the pipeline's cubin
(:class:`~kiln.runtime.driver_launch.DriverLauncher`), or a ctypes call into the host module
the MLIR pipeline produced (:class:`~kiln.runtime.host.HostLauncher`). What the
key already proves (dtype, rank, innermost stride, ``is_cuda``) is not checked again; what it
does not (a scalar's range, a grid) still is. For saxpy on two torch tensors the function is::

    def launch(grid, args, stream):
        a0 = args[0]; a1 = args[1]; a2 = args[2]; a3 = args[3]
        handle = current_stream() if stream is None else stream_handle(stream)
        grid = check_grid(grid)
        arguments = blocks.get(get_ident()) or thread_block()
        p0 = a0.data_ptr(); p1 = a1.data_ptr()
        try:
            pack_into(arguments.words, 0, p0, p0, 0, *a0.shape, *a0.stride(),
                      p1, p1, 0, *a1.shape, *a1.stride(), a2, a3, *grid, 0, handle or 0)
        except (struct.error, OverflowError, TypeError):
            return fallback(grid, args, stream)    # the generic launch reports the bad value
        entry(arguments.address)

Each thread packs its own block: another thread may run between the packing and the launch.

Numpy arguments (staged through device copies) never take this path, nor launchers that are
neither (test doubles of the launcher).

Example::

    ck.launch(grid, [x, y, n, a])                            # first launch: builds the plan
    fast = specialized_launcher(ck, (x, y, n, a), (0, 1, 2, 3))
    fast(grid, (x, y, n, a), None)
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Callable, Sequence

import numpy as np

from kiln.launch_args import normalize_grid
from kiln.runtime.driver_launch import DriverLauncher
from kiln.runtime.host import HostLauncher
from kiln.runtime.launch import (_PLAN_ATTRIBUTE, _convert_tensor, _device_view,
                                  _scalar_converter, _stream_source, stream_handle)
from kiln.signature import ScalarParam, TensorMapParam, TensorParam

# Scalars of these dtypes given as a Python int (float) go straight into struct, whose range
# check (struct.error) matches check_int_argument's; i1 and bit-pattern dtypes convert first.
_DIRECT_INTS = frozenset({"i8", "i16", "i32", "i64", "index"})
_DIRECT_FLOATS = frozenset({"f32", "f64"})


def specialized_launcher(ck, args: Sequence, positions: Sequence[int]
                         ) -> Callable[[Any, Sequence, Any], None] | None:
    """A launcher of ``ck`` for arguments of the same kinds as ``args`` (a call's positional
    arguments; ``positions[i]`` is where the kernel's i-th run-time parameter sits in them), or
    None when there is none to make: ``ck`` has not launched yet, its launcher is not a
    :class:`HostLauncher`, or an argument is a numpy array. The result is called as
    ``fast(grid, args, stream)`` with the same ``stream`` values as ``ck.launch``."""
    plan = getattr(ck, _PLAN_ATTRIBUTE, None)
    if plan is None or not isinstance(plan.launcher, (HostLauncher, DriverLauncher)):
        return None
    params = ck.signature.params
    values = [args[p] for p in positions]
    if len(values) != len(params) or any(isinstance(v, np.ndarray) for v in values):
        return None
    launcher = plan.launcher
    namespace = {
        "pack_into": launcher.layout.pack_into, "entry": launcher.entry,
        "blocks": launcher.thread_blocks, "thread_block": launcher.thread_arguments,
        "get_ident": threading.get_ident, "current_stream": _stream_source(values),
        "stream_handle": stream_handle,
        # Without a cluster shape to divide, the grid check is normalize_grid's alone.
        "check_grid": plan.check_grid if ck.signature.cluster else normalize_grid,
        "after_launch": plan.after_launch, "struct": struct,
        "fallback": lambda grid, call, stream: ck.launch(
            grid, [call[p] for p in positions], stream=stream),
    }
    loads, pointers, fields = [], [], []
    for i, (param, value, position) in enumerate(zip(params, values, positions)):
        loads.append(f"a{i} = args[{position}]")
        fields.append(_fields(i, param, value, plan, namespace, pointers))
    source = "\n".join([
        "def launch(grid, args, stream):",
        *(f"    {line}" for line in loads),
        "    handle = current_stream() if stream is None else stream_handle(stream)",
        "    grid = check_grid(grid)",
        "    arguments = blocks.get(get_ident()) or thread_block()",
        *(f"    {line}" for line in pointers),
        "    try:",
        f"        pack_into(arguments.words, 0, {''.join(f + ', ' for f in fields)}*grid, "
        f"{ck.signature.dynamic_shared_bytes}, handle or 0)",
        "    except (struct.error, OverflowError, TypeError):",
        "        return fallback(grid, args, stream)",
        "    entry(arguments.address)",
        *(["    after_launch()"] if plan.after_launch is not None else []),
    ])
    exec(compile(source, f"<kiln launcher of {ck.name}>", "exec"), namespace)
    # Out of its own globals: a cycle would keep the plan (and its loaded module) alive until
    # the cyclic collector, which may tear the launcher down in any order.
    return namespace.pop("launch")


def _fields(i: int, param, value, plan, namespace: dict, pointers: list) -> str:
    """The source of parameter ``i``'s flat C arguments (``value`` is an example)."""
    if isinstance(param, TensorParam):
        if type(value).__module__.startswith("torch") and hasattr(value, "data_ptr"):
            # The launch key proved dtype, rank, innermost stride and is_cuda.
            pointers.append(f"p{i} = a{i}.data_ptr()")
            return f"p{i}, p{i}, 0, *a{i}.shape, *a{i}.stride()"
        namespace[f"tensor{i}"] = _tensor_fields(param)
        return f"*tensor{i}(a{i})"
    if isinstance(param, TensorMapParam):
        tensor_maps = plan.tensor_maps
        namespace[f"tensor_map{i}"] = lambda v, stream: tensor_maps.descriptor(
            param, *_device_view(param, v, None), stream=stream)
        return f"tensor_map{i}(a{i}, handle)"
    assert isinstance(param, ScalarParam)
    if (type(value) is int and param.dtype in _DIRECT_INTS) or (
            type(value) in (int, float) and param.dtype in _DIRECT_FLOATS):
        return f"a{i}"
    convert = _scalar_converter(param)
    namespace[f"scalar{i}"] = lambda v: _converted(convert, v)
    return f"scalar{i}(a{i})"


def _tensor_fields(param: TensorParam) -> Callable[[Any], list]:
    """Flat fields of a device array that is not a torch tensor (``__cuda_array_interface__``,
    DLPack), with the launch's checks."""
    def fields(value) -> list:
        flat: list = []
        _convert_tensor(param, value, flat, None)
        return flat

    return fields


def _converted(convert, value):
    flat: list = []
    convert(value, flat, None)
    return flat[0]
