"""Launching a compiled kernel: argument conversion, staging of host arrays, streams, TMA maps.

``launch(ck, grid, args, stream=...)`` takes the run-time arguments in ``ck.signature.params``
order (constexprs already removed): numpy arrays are staged through the device (synchronous),
device tensors (torch, cupy, ``__cuda_array_interface__``, DLPack) passed zero-copy, scalars by
value, and a :class:`~kiln.signature.TensorMapParam` takes the tensor (its descriptor is encoded
and cached). ``stream=None`` is the current stream of the arguments' array library, as in
Triton. docs/lowering.md ("Launching (NVIDIA)") has the details.

The launcher and the per-parameter converters are built on the first launch, when the launch
configuration is checked against the device, and kept on the CompiledKernel (attribute
``_launch_plan``); every launch checks the grid. See :mod:`kiln.runtime.cuda` for how driver
errors of the launch itself are reported.

Example::

    ck = compile_kernel(kiln_ir, sig, CompileOptions("sm_90a"))
    launch(ck, ((n + 255) // 256, 1, 1), [x, y, n, 2.0])
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from kiln.core import env
from kiln.core.errors import KilnTypeError, KilnValueError, LaunchError, ResourceError
from kiln.launch_args import normalize_grid
from kiln.lowering.compiler import backend_for
from kiln.runtime.amd_host import build_amd_launcher
from kiln.runtime import cuda
from kiln.runtime.arguments import Staging, convert_tensor, device_view, scalar_converter
from kiln.runtime.driver_launch import load_driver_launcher
from kiln.runtime.host import build_nvidia_launcher
from kiln.runtime.native import native_module
from kiln.runtime.streams import (bound_stream_source, current_stream,  # noqa: F401
                                  stream_handle, stream_source)
from kiln.runtime.tensor_maps import (CAPTURE_ARENA_SLOTS, TENSOR_MAP_CACHE_CAPACITY,  # noqa: F401
                                      TensorMapCache)
from kiln.signature import TensorMapParam, TensorParam

_PLAN_ATTRIBUTE = "_launch_plan"


def launch(ck, grid, args: Sequence, *, stream=None) -> None:
    """Run ``ck`` on ``grid`` (1 to 3 ints) with ``args``; see the module docstring.

    Raises KilnValueError/KilnTypeError for bad grids or arguments, ResourceError when the
    launch configuration exceeds the device, and LaunchError when the driver refuses, no GPU
    is present or the target cannot be launched here.
    """
    _plan_of(ck)(grid, args, stream)


def bind_launch(ck, grid, args: Sequence) -> "BoundLaunch":
    """``ck`` on a fixed ``grid`` with ``args`` fixed except for the tensors' device addresses.

    For library entry points that cache one per shape class, so a repeat call skips argument
    conversion (see :class:`BoundLaunch`). ``args`` are example arguments in
    ``ck.signature.params`` order: device tensors (torch/cupy; numpy arrays would need a
    copy per launch) whose shapes, strides and dtypes every later call shares, and the scalars.
    Tensor-map parameters take a tensor like a launch does; a call passes that tensor's address
    and the descriptor for it comes from the kernel's descriptor cache (encoded on a miss).

    Example::

        bound = bind_launch(ck, (4, 1, 1), [x, y, n, 2.0])
        bound(x2.data_ptr(), y2.data_ptr())   # same shapes as x, y; torch's current stream
    """
    return BoundLaunch(ck, grid, args)


class BoundLaunch:
    """A launch prepared by :func:`bind_launch`; call it with one device address per tensor or
    tensor-map parameter (in parameter order) and an optional ``stream`` (None: the current
    stream of the example tensors' library, as for :func:`launch`).

    The flat C arguments live in an argument block built once; a call writes the addresses
    (and the stream) into their slots and launches: one C call into the native launch shim
    (:mod:`kiln.runtime.driver_launch`), or one ctypes call. The addresses are not checked, so
    the caller must pass tensors laid out exactly like the example ones.

    ``current_stream()`` is the handle a call with ``stream=None`` would launch on (the
    current stream of the example tensors' library); ``launch_on(stream, *pointers)`` launches
    on such a handle: through the shim it is a C callable, so a library entry point that read
    the stream pays no Python frame per launch. ``native`` is ``(record address, fallback)``
    for the shim's ``call_plan`` (None without the shim, or with ``KILN_LAUNCH_BLOCKING``).
    """

    def __init__(self, ck, grid, args: Sequence):
        plan = _plan_of(ck)
        params = ck.signature.params
        if len(args) != len(params):
            raise KilnValueError(f"{ck.name} takes {len(params)} run-time arguments, got "
                                 f"{len(args)}", fix="pass one value per kernel parameter")
        grid = plan.check_grid(grid)
        self._launcher = plan.launcher
        self._tensor_maps = plan.tensor_maps
        flat: list = []
        # Per address, in call order: the slot of a tensor's allocated pointer (the aligned
        # pointer follows it), or ~slot of a tensor map's descriptor pointer.
        slots: list[int] = []
        self._map_views: dict[int, tuple] = {}  # descriptor slot -> (param, shape, strides)
        for param, convert, value in zip(params, plan.converters, args):
            if isinstance(value, np.ndarray):
                raise KilnTypeError(f"bind_launch cannot bind {param.name!r}: numpy arrays are "
                                    "copied to the device per launch",
                                    fix="use ck.launch(...), or pass a torch/cupy device tensor")
            if isinstance(param, TensorMapParam):
                ptr, shape, strides = device_view(param, value, None)
                slots.append(~len(flat))
                self._map_views[len(flat)] = (param, shape, strides)
                flat.append(self._tensor_maps.descriptor(param, ptr, shape, strides))
                continue
            if isinstance(param, TensorParam):
                slots.append(len(flat))
            convert(value, flat, None)
        self._slots = tuple(slots)
        # an instance attribute: no method frame
        self.current_stream = self._current_stream = bound_stream_source(args)
        self._after_launch = plan.after_launch
        self._stream_slot = self._launcher.stream_slot
        self._arguments = self._launcher.new_arguments()
        self._launcher.pack(self._arguments, flat, grid, None)
        self._owner = threading.get_ident()
        self._other_threads: dict[int, Any] = {}  # the ctypes call releases the GIL
        # The native shim writes the addresses and launches in one C call, under the GIL; a
        # tensor map's descriptor comes from the record's memo (launch_mapped), or on a miss
        # from the cache (_launch_missed, which memoises it).
        self._map_positions = tuple((i, slot) for i, slot in enumerate(slots) if slot < 0)
        shim = getattr(self._launcher, "shim", None)
        self._native = self.native = None
        if shim is not None:
            self._arguments.bind_pointer_slots(self._slots)
            self._record, self._native_pointers = self._arguments.address, shim.launch_pointers
            self._native = shim.launch_pointers
            if self._map_views:
                self._arguments.bind_map_memo(shim.MEMO_WAYS,
                                              self._tensor_maps.evictions_address)
                self._native, self._memo_store = shim.launch_mapped, shim.memo_store
        # launch_on(stream, *pointers): through the shim one C call (no Python frame; a memo
        # miss calls this launch back), else the method. No reference back to self: a cycle
        # would leave the launcher's teardown to the cyclic collector.
        if shim is not None and self._after_launch is None:
            fallback = _fallback(weakref.ref(self), self._arguments)
            self.launch_on = functools.partial(shim.launch_direct, self._record, fallback)
            self.launch_outputs = functools.partial(shim.launch_outputs, self._record, fallback)
            self.native = (self._record, fallback)  # for kiln.kernels.one_call

    def __call__(self, *pointers: int, stream=None) -> None:
        if len(pointers) != len(self._slots):
            raise KilnValueError(f"this launch binds {len(self._slots)} tensors, got "
                                 f"{len(pointers)} addresses", fix="pass one per tensor parameter")
        if self._native is not None:
            # An int is a raw handle (what current_stream() returned to an entry point).
            handle = self._current_stream() if stream is None else \
                (stream or None) if type(stream) is int else stream_handle(stream)
            if self._native(self._record, handle, *pointers) is False:  # a descriptor missed
                self._launch_missed(pointers, handle)
            if self._after_launch is not None:
                self._after_launch()
            return
        arguments = self._arguments
        if threading.get_ident() != self._owner:
            arguments = self._thread_arguments()
        words = arguments.words
        handle = self._current_stream() if stream is None else stream_handle(stream)
        for slot, pointer in zip(self._slots, pointers):
            if slot >= 0:
                words[slot] = words[slot + 1] = pointer  # memref allocated and aligned pointers
            else:
                param, shape, strides = self._map_views[~slot]
                words[~slot] = self._tensor_maps.descriptor(param, pointer, shape, strides,
                                                            stream=handle)
        words[self._stream_slot] = handle or 0
        self._launcher.launch_packed(arguments)
        if self._after_launch is not None:
            self._after_launch()

    def launch_on(self, stream, *pointers: int) -> None:
        """``self(*pointers, stream=stream)``; see the class docs."""
        self(*pointers, stream=stream)

    def launch_outputs(self, outputs, stream, *items):
        """Make a call's fresh outputs, launch on ``stream`` with one address per item and
        return the outputs: see :func:`launch_with_outputs` (through the shim, one C call)."""
        return launch_with_outputs(self.launch_on, outputs, stream, items)

    def _launch_missed(self, pointers: tuple, handle) -> None:
        """The launch of ``pointers`` whose descriptors were not all in the record's memo:
        each from the cache (encoded on a miss there) and memoised, unless captured (only a
        graph's replay writes those)."""
        cache = self._tensor_maps
        pointers = list(pointers)
        for i, slot in self._map_positions:
            param, shape, strides = self._map_views[~slot]
            address = cache.descriptor(param, pointers[i], shape, strides, stream=handle)
            if address in cache.addresses:
                self._memo_store(self._record, i, pointers[i], address)
            pointers[i] = address
        self._native_pointers(self._record, handle, *pointers)

    def _thread_arguments(self):
        ident = threading.get_ident()
        arguments = self._other_threads.get(ident)
        if arguments is None:
            arguments = self._other_threads[ident] = self._arguments.copy()
        return arguments


def launch_with_outputs(launch_on: Callable, outputs, stream, items: Sequence):
    """``launch_on(stream, *addresses)`` for a call that returns fresh outputs, and those
    outputs: ``outputs`` is a tuple of makers, each called with no argument (one maker gives
    its tensor alone, several a tuple), or a callable given ``stream`` (it returns a tensor
    or a tuple); each item is an address (an int), a tensor (its ``data_ptr()``) or None (the
    next output's address). What the native shim's ``launch_outputs`` does in one C call.

    Example: ``o = launch_with_outputs(bound.launch_on, (make_o,), stream, (q, None))``.
    """
    if type(outputs) is tuple:
        made = outputs[0]() if len(outputs) == 1 else tuple(make() for make in outputs)
    else:
        made = outputs(stream)
    fresh = iter(made if type(made) is tuple else (made,))
    addresses = []
    for item in items:
        if item is None:
            item = next(fresh, None)
            if item is None:
                raise ValueError("launch_outputs: more None items than outputs")
        addresses.append(item if type(item) is int else item.data_ptr())
    launch_on(stream, *addresses)
    return made


def _fallback(bound_ref, arguments) -> Callable:
    """What a shim's ``launch_on`` calls on a descriptor memo miss: the bound launch (by weak
    reference); it holds the argument block, whose launch record the C call reads, alive."""
    def launch(stream, *pointers: int) -> None:
        bound = bound_ref()
        if bound is None:
            raise LaunchError("this launch_on outlived its bound launch",
                              fix="keep the BoundLaunch as long as its launch_on")
        bound(*pointers, stream=stream)

    launch.arguments = arguments
    return launch


def nvidia_launcher(ck) -> tuple[Callable, object]:
    """``(launch function, CUDA driver)`` for an NVIDIA kernel, or LaunchError/ResourceError."""
    if ck.target.ptx_only:
        raise LaunchError(f"{ck.target.name} kernels cannot be launched by Kiln (PTX only)",
                          fix="inspect kernel.asm['ptx'], or compile for sm_80/sm_90a to run")
    cuda_driver = cuda.driver()  # raises LaunchError without a GPU, before the JIT could abort
    check_launch_config(ck.name, ck.signature, getattr(ck, "metadata", {}),
                        cuda_driver.launch_limits())
    cubin, choice = ck.asm.get("cubin"), env.launcher()
    if cubin is not None and choice != "mlir":
        # The pipeline's cubin, loaded once; per launch only cuLaunchKernel (driver_launch).
        shim = native_module() if choice == "native" else None
        return load_driver_launcher(ck.signature, cubin, cuda_driver, shim), cuda_driver
    return build_nvidia_launcher(ck.signature, ck.target, cubin=cubin,
                                 ptx=ck.asm.get("ptx")), cuda_driver


def amd_launcher(ck) -> tuple[Callable, object]:
    """``(launch function, None)`` for an AMD kernel (HIP loads on the first launch)."""
    if "hsaco" not in ck.asm:
        raise LaunchError(f"{ck.name} has no linked code object (hsaco) to launch",
                          fix="install ld.lld or set KILN_LD_LLD so Kiln can link it")
    return build_amd_launcher(ck.signature, ck.target, ck.asm["hsaco"]), None


# One launcher per backend (Backend.name); tests replace entries to record launches.
LAUNCHERS = {"nvidia": nvidia_launcher, "amd": amd_launcher}


def _plan_of(ck) -> "_LaunchPlan":
    """The launch plan cached on ``ck``, built on first use by its backend's launcher."""
    plan = getattr(ck, _PLAN_ATTRIBUTE, None)
    if plan is None:
        plan = _LaunchPlan(ck.name, ck.signature, *LAUNCHERS[backend_for(ck.target).name](ck))
        setattr(ck, _PLAN_ATTRIBUTE, plan)
    return plan


def check_launch_config(name: str, signature, metadata: dict, limits) -> None:
    """Raise ResourceError when ``signature``'s block, shared memory or registers exceed the
    device's ``limits`` (a :class:`~kiln.runtime.cuda.LaunchLimits`); ``metadata`` supplies
    the static shared bytes and registers per thread when the kernel has a ptxas report.

    ``mgpuLaunchKernel`` only prints the driver's refusal, so these are checked first.
    Example:
    ``check_launch_config(ck.name, ck.signature, ck.metadata, cuda.driver().launch_limits())``.
    """
    block = signature.block
    threads = block[0] * block[1] * block[2]
    if threads > limits.max_threads_per_block or any(
            b > limit for b, limit in zip(block, limits.max_block_dims)):
        raise ResourceError(f"{name} has a block of {block} = {threads} threads; this GPU "
                            f"allows {limits.max_threads_per_block} threads and "
                            f"{limits.max_block_dims} per dimension",
                            fix="lower num_warps")
    static = metadata.get("shared_bytes", 0) or 0
    dynamic = signature.dynamic_shared_bytes
    if static + dynamic > limits.max_shared_bytes_optin:
        raise ResourceError(f"{name} needs {static + dynamic} bytes of shared memory per block "
                            f"({static} static + {dynamic} dynamic); this GPU allows "
                            f"{limits.max_shared_bytes_optin}",
                            fix="use smaller tiles or fewer pipeline stages")
    registers = metadata.get("registers")
    if registers and registers * threads > limits.max_registers_per_block:
        raise ResourceError(f"{name} uses {registers} registers x {threads} threads = "
                            f"{registers * threads} per block; this GPU has "
                            f"{limits.max_registers_per_block}",
                            fix="lower num_warps, or cap registers with maxnreg=")


class _LaunchPlan:
    """A kernel's launcher plus one converter per parameter, built once.

    ``launcher`` is a :class:`~kiln.runtime.host.HostLauncher` (or anything with its
    interface); ``driver`` (None on AMD) stages numpy arrays and encodes tensor maps.
    """

    def __init__(self, name: str, signature, launcher, driver):
        self.name = name
        self.signature = signature
        self.launcher = launcher
        self.driver = driver
        self.tensor_maps = TensorMapCache(driver)
        self.converters = [self._converter(p) for p in signature.params]
        # KILN_LAUNCH_BLOCKING=1: wait for each launch, so a fault raises at the launching line.
        self.after_launch = driver.synchronize if driver is not None and \
            env.launch_blocking() else None
        self._cluster = signature.cluster

    def check_grid(self, grid) -> tuple[int, int, int]:
        """``grid`` as three ints within the limits and, for a cluster kernel, a multiple of
        the cluster shape (else KilnValueError/KilnTypeError)."""
        grid = normalize_grid(grid)
        if self._cluster and any(g % c for g, c in zip(grid, self._cluster)):
            raise KilnValueError(f"grid {grid} of {self.name} is not a multiple of its cluster "
                                 f"shape {self._cluster}",
                                 fix="round every grid dimension up to a multiple of the "
                                     "cluster's (extra CTAs can exit early)")
        return grid

    def __call__(self, grid, args: Sequence, stream) -> None:
        grid = self.check_grid(grid)
        params = self.signature.params
        if len(args) != len(params):  # the tensor maps the trace derived: their sources' values
            args = self.signature.expand(args)
        if len(args) != len(params):
            names = ", ".join(p.name for p in params)
            raise KilnValueError(f"{self.name} takes {len(params)} run-time arguments ({names}), "
                                 f"got {len(args)}", fix="pass one value per kernel parameter")
        handle = stream_source(args)() if stream is None else stream_handle(stream)
        staging = None
        flat: list = []
        try:
            for convert, value in zip(self.converters, args):
                if isinstance(value, np.ndarray) and staging is None:
                    staging = self._new_staging()
                convert(value, flat, staging, handle)
            self.launcher(flat, grid, handle)
            if self.after_launch is not None:
                self.after_launch()
            if staging is not None:
                self.driver.stream_synchronize(handle)
                staging.download()
        finally:
            if staging is not None:
                staging.free()

    def _new_staging(self) -> Staging:
        if self.driver is None:
            raise KilnTypeError("numpy arrays cannot be passed to AMD kernels yet",
                                fix="pass torch (ROCm) device tensors")
        return Staging(self.driver)

    def _converter(self, param) -> Callable[..., None]:
        """``convert(value, flat, staging, stream=None)`` appends ``value``'s flat C arguments
        (``stream``: the launch's, which a tensor map's descriptor may be copied on)."""
        # Converters hold no reference to the plan: a plan must not sit in a reference cycle,
        # so its launcher (and the loaded module) is released as soon as the kernel is.
        if isinstance(param, TensorParam):
            return lambda value, flat, staging, stream=None: convert_tensor(param, value, flat,
                                                                             staging)
        if isinstance(param, TensorMapParam):
            tensor_maps = self.tensor_maps
            return lambda value, flat, staging, stream=None: flat.append(
                tensor_maps.descriptor(param, *device_view(param, value, staging),
                                       staging=staging, stream=stream))
        return scalar_converter(param)
