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

import functools
import struct
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np

from kiln.arrays import is_torch_tensor
from kiln.launch_args import normalize_grid
from kiln.launch_key import launch_guard, launch_key_part
from kiln.runtime.arguments import convert_tensor, device_view, scalar_converter
from kiln.runtime.driver_launch import DriverLauncher
from kiln.runtime.host import HostLauncher
from kiln.runtime.launch import _PLAN_ATTRIBUTE
from kiln.runtime.native_torch import torch_bridge
from kiln.runtime.streams import no_stream, stream_handle, stream_source
from kiln.signature import ScalarParam, TensorMapParam, TensorParam

# Scalars of these dtypes given as a Python int (float) go straight into struct, whose range
# check (struct.error) matches check_int_argument's; i1 and bit-pattern dtypes convert first.
_DIRECT_INTS = frozenset({"i8", "i16", "i32", "i64", "index"})
_INT_BITS = {"i8": 8, "i16": 16, "i32": 32, "i64": 64, "index": 64}
_DIRECT_FLOATS = frozenset({"f32", "f64"})


def specialized_launcher(ck, args: Sequence, positions: Sequence[int]
                         ) -> Callable[[Any, Sequence, Any], None] | None:
    """A launcher of ``ck`` for arguments of the same kinds as ``args`` (a call's positional
    arguments; ``positions[i]`` is where the kernel's i-th run-time parameter sits in them), or
    None when there is none to make: ``ck`` has not launched yet, its launcher is not a
    :class:`HostLauncher`, or an argument is a numpy array. The result is called as
    ``fast(grid, args, stream)`` with the same ``stream`` values as ``ck.launch``."""
    made = _prepared(ck, args, positions)
    if made is None:
        return None
    plan, values, namespace = made
    loads, pointers, fields = [], [], []
    for i, (param, value, position) in enumerate(zip(ck.signature.params, values, positions)):
        loads.append(f"a{i} = args[{position}]")
        fields.append(_fields(i, param, value, plan, namespace, pointers))
    source = "\n".join([
        "def launch(grid, args, stream):",
        *(f"    {line}" for line in loads),
        *_launch_lines(ck, plan, pointers, fields),
    ])
    return _compiled(source, ck, namespace)


def guarded_launcher(ck, args: tuple, kwargs: dict, positions: Sequence[int],
                     constexpr_flags: Sequence[bool], meta: dict
                     ) -> Callable[[Any, tuple, dict, Any], bool] | None:
    """:func:`specialized_launcher` fused with the launch's guard
    (:func:`kiln.launch_key.launch_guard`): ``launch(grid, args, kwargs, stream)`` launches and
    returns True when this call's launch key equals that of ``(args, kwargs)`` (the default
    target aside), else returns False having done nothing. Each torch tensor's shape and
    strides are read once, for the key's rank and innermost stride and for the packing. A
    callable ``grid`` is called with ``meta``. None where there is no exact guard
    (``launch_guard``'s cases) or no specialised launcher."""
    # With no positional constexpr (launch_guard's condition) the i-th argument is the i-th
    # run-time parameter.
    if launch_guard(args, kwargs, constexpr_flags) is None or \
            list(positions) != list(range(len(args))):
        return None
    made = _prepared(ck, args, positions)
    if made is None:
        return None
    plan, values, namespace = made
    native = _native_guarded(ck, plan, values, kwargs, meta, namespace)
    if native is not None:
        return native
    namespace.update(KW=dict(kwargs), META=meta)
    types, checks, reads, pointers, fields = [], [], [], [], []
    for i, a in enumerate(args):
        namespace[f"T{i}"] = type(a)
        types.append(f"type(a{i}) is T{i}")
    types.append("kwargs == KW")
    for j, (name, value) in enumerate(kwargs.items()):
        namespace[f"K{j}"] = type(value)
        types.append(f"type(kwargs[{name!r}]) is K{j}")
    for i, (param, value) in enumerate(zip(ck.signature.params, values)):
        a = f"a{i}"
        if type(value) in (int, float, bool) or isinstance(param, TensorMapParam):
            fields.append(_fields(i, param, value, plan, namespace, pointers))
            if type(value) in (int, float, bool):
                continue
        # A torch tensor (launch_guard takes no other array): its key part, from one read of
        # its shape and strides.
        dtype, rank, on_device, contiguous_last = launch_key_part(value, False)[1:]
        if type(on_device) is not bool or type(contiguous_last) is not bool:
            return None
        namespace[f"D{i}"] = dtype
        reads.append(f"s{i} = {a}.shape; r{i} = {a}.stride()")
        check = f"{a}.dtype == D{i} and len(s{i}) == {int(rank)} and {a}.is_cuda is {on_device}"
        if rank:
            check += f" and {'' if contiguous_last else 'not '}(r{i}[-1] == 1 or s{i}[-1] <= 1)"
        checks.append(check)
        if isinstance(param, TensorParam):
            pointers.append(f"p{i} = {a}.data_ptr()")
            fields.append(f"p{i}, p{i}, 0, *s{i}, *r{i}")
    unpack = "".join(f"a{i}, " for i in range(len(args)))
    source = "\n".join([
        "def launch(grid, args, kwargs, stream):",
        f"    if len(args) != {len(args)}:",
        "        return False",
        *([f"    {unpack}= args"] if args else []),
        f"    if not ({' and '.join(types)}):",
        "        return False",
        *(f"    {line}" for line in reads),
        *([f"    if not ({' and '.join(checks)}):", "        return False"] if checks else []),
        "    if callable(grid):",
        "        grid = grid(META)",
        *_launch_lines(ck, plan, pointers, fields, launched="True"),
        "    return True",
    ])
    return _compiled(source, ck, namespace)


def _native_guarded(ck, plan, values: list, kwargs: dict, meta: dict, namespace: dict
                    ) -> Callable[[Any, tuple, dict, Any], bool] | None:
    """The guarded launcher as one call into the native shim (``launch_guarded`` of
    native_guard.c, on an argument block of its own: the call holds the GIL from the first
    write to the launch), or None where the shim is not there or cannot pack every parameter
    (tensor maps, i1 and bit-pattern scalars, cluster grids, ``KILN_LAUNCH_BLOCKING``).

    Its spec: ``(keywords, ((name, type), ...), arguments, meta, current_stream,
    stream_handle)``, one argument spec per parameter: ``(0, type, dtype, rank, is_cuda,
    contiguous_last, slot[, scalar_type])`` for a torch tensor (its launch key part; with the
    torch bridge loaded or cached, :mod:`kiln.runtime.native_torch`, its dtype's code there, so
    the shim reads the tensor's C++ metadata instead of its Python attributes), ``(kind, type,
    bits, slot)`` for a scalar (kind 1: an int of ``bits``; 2: f32; 3: f64)."""
    launcher = plan.launcher
    shim = getattr(launcher, "shim", None)
    if shim is None or not hasattr(shim, "launch_guarded") or ck.signature.cluster or \
            plan.after_launch is not None:
        return None
    specs, slot = [], 0
    bridge = torch_bridge(build=False) if any(is_torch_tensor(v) for v in values) else None
    for param, value in zip(ck.signature.params, values):
        kind = type(value)
        if isinstance(param, TensorParam):
            part = launch_key_part(value, False)
            # The bridge's dtype code: the shim reads such a tensor's C++ metadata.
            code = () if bridge is None else (bridge.scalar_type(value),)
            specs.append((0, kind, *part[1:], slot, *code))
            slot += 3 + 2 * part[2]
        elif isinstance(param, ScalarParam) and kind is int and param.dtype in _INT_BITS:
            specs.append((1, kind, _INT_BITS[param.dtype], slot))
            slot += 1
        elif isinstance(param, ScalarParam) and kind in (int, float) and \
                param.dtype in _DIRECT_FLOATS:
            specs.append((2 if param.dtype == "f32" else 3, kind, 0, slot))
            slot += 1
        else:
            return None
    if slot != launcher.grid_slot:  # the flat layout is not the one written here
        return None
    block = launcher.new_arguments()
    block.words[launcher.grid_slot + 3] = ck.signature.dynamic_shared_bytes
    spec = (dict(kwargs), tuple((name, type(v)) for name, v in kwargs.items()), tuple(specs),
            meta, _raw_stream_getter(values, namespace["current_stream"]), stream_handle)
    launch = functools.partial(shim.launch_guarded, block.address, spec)
    launch.block = block  # the record's memory lives as long as the launcher
    return launch


def _raw_stream_getter(values: Sequence, getter: Callable) -> Callable:
    """A guarded launch's current-stream getter: where the stream is a torch CUDA tensor's
    (the first device array among ``values``), torch's raw getter of the current device's
    stream as a C partial (``_cuda_getCurrentRawStream(-1)``: no Python frame, 0.17 against
    0.29 µs on an H200 host; 0 for the legacy stream, which the shim takes as None), else
    ``getter``."""
    for value in values:
        if isinstance(value, np.ndarray) or type(value) in (int, float, bool):
            continue
        torch_c = getattr(sys.modules.get("torch"), "_C", None)
        raw = getattr(torch_c, "_cuda_getCurrentRawStream", None)
        if raw is not None and is_torch_tensor(value) and getattr(value, "is_cuda", False) \
                and getter is not no_stream:  # (torch without a usable GPU: no stream)
            return functools.partial(raw, -1)
        break
    return getter


def _prepared(ck, args: Sequence, positions: Sequence[int]) -> tuple | None:
    """``(plan, run-time values, namespace)`` of a generated launcher of ``ck``, or None when
    there is none to make (see :func:`specialized_launcher`)."""
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
        "get_ident": threading.get_ident, "current_stream": stream_source(values),
        "stream_handle": stream_handle,
        # Without a cluster shape to divide, the grid check is normalize_grid's alone.
        "check_grid": plan.check_grid if ck.signature.cluster else normalize_grid,
        "after_launch": plan.after_launch, "struct": struct,
        "fallback": lambda grid, call, stream: ck.launch(
            grid, [call[p] for p in positions], stream=stream),
    }
    return plan, values, namespace


def _launch_lines(ck, plan, pointers: list, fields: list, launched: str = "") -> list[str]:
    """The body of a generated launcher after its arguments are loaded: stream, grid check,
    this thread's argument block, one pack of every field, one call into the launcher
    (``launched``: what the launcher returns after the checked path launched instead)."""
    return [
        "    handle = current_stream() if stream is None else stream_handle(stream)",
        "    grid = check_grid(grid)",
        "    arguments = blocks.get(get_ident()) or thread_block()",
        *(f"    {line}" for line in pointers),
        "    try:",
        f"        pack_into(arguments.words, 0, {''.join(f + ', ' for f in fields)}*grid, "
        f"{ck.signature.dynamic_shared_bytes}, handle or 0)",
        "    except (struct.error, OverflowError, TypeError):",
        "        fallback(grid, args, stream)",
        f"        return {launched}".rstrip(),
        "    entry(arguments.address)",
        *(["    after_launch()"] if plan.after_launch is not None else []),
    ]


def _compiled(source: str, ck, namespace: dict) -> Callable:
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
            param, *device_view(param, v, None), stream=stream)
        return f"tensor_map{i}(a{i}, handle)"
    assert isinstance(param, ScalarParam)
    if (type(value) is int and param.dtype in _DIRECT_INTS) or (
            type(value) in (int, float) and param.dtype in _DIRECT_FLOATS):
        return f"a{i}"
    convert = scalar_converter(param)
    namespace[f"scalar{i}"] = lambda v: _converted(convert, v)
    return f"scalar{i}(a{i})"


def _tensor_fields(param: TensorParam) -> Callable[[Any], list]:
    """Flat fields of a device array that is not a torch tensor (``__cuda_array_interface__``,
    DLPack), with the launch's checks."""
    def fields(value) -> list:
        flat: list = []
        convert_tensor(param, value, flat, None)
        return flat

    return fields


def _converted(convert, value):
    flat: list = []
    convert(value, flat, None)
    return flat[0]
