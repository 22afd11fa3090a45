"""Launching the MLIR pipeline's cubin straight through the driver: :class:`DriverLauncher`.

:class:`~kiln.runtime.host.HostLauncher` calls the ExecutionEngine's ``kiln_launch``, whose
``mgpuLaunchKernel`` looks the function up (``cuModuleGetFunction``), pushes and pops the
context and sets the shared-memory attribute on every launch, behind a ctypes call. A
:class:`DriverLauncher` loads the same cubin once (``cuModuleLoadData``,
``cuModuleGetFunction``, ``cuFuncSetAttribute``) and per launch only packs the flat arguments
(the same 8-byte slots and :attr:`layout` as ``HostLauncher``, so the generated launchers of
:mod:`kiln.runtime.launch_fast` and :class:`~kiln.runtime.launch.BoundLaunch` serve both)
and calls ``cuLaunchKernel`` on the stream in the stream slot (``cuLaunchKernelEx`` for a
cluster shape or a programmatic launch, with the attributes MLIR's wrappers set). The call
goes through the native shim (:mod:`kiln.runtime.native`, one C call per launch) or, where no
C compiler built it, through ctypes.

Each argument block (:class:`DriverArguments`) carries a *launch record*: the C structure
the shim reads (function, driver entry points, primary context, words, parameter pointers,
launch config). A failed launch raises :class:`~kiln.core.errors.LaunchError` with the
driver's message; a thread without a current context gets the primary one (the module's),
and one with another context current launches inside a push/pop of it.

Example::

    launcher = load_driver_launcher(ck.signature, ck.asm["cubin"], cuda.driver(),
                                    native_module())
    launcher(flat_args, (gx, gy, gz), stream)
"""

from __future__ import annotations

import ctypes
import math
import struct
import weakref
from typing import Mapping, Sequence

from kiln.core.errors import LaunchError
from kiln.runtime import cuda
from kiln.runtime.cuda import _LaunchAttribute, _LaunchConfig
from kiln.runtime.host import SLOT_BYTES, _SLOT_CODES, PackedLaunches, flat_c_argtypes
from kiln.signature import KernelSignature

# CUlaunchAttributeID, CUclusterSchedulingPolicy and CUfunction_attribute enumerators (cuda.h).
CLUSTER_DIMENSION = 4
CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
CLUSTER_SCHEDULING_SPREAD = 1  # what mgpuLaunchClusterKernel asks for
PROGRAMMATIC_STREAM_SERIALIZATION = 6
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
PORTABLE_CLUSTER_SIZE = 8
CUDA_ERROR_INVALID_CONTEXT = 201
SYMBOLS = ("cuLaunchKernel", "cuLaunchKernelEx", "cuCtxSetCurrent", "cuCtxPushCurrent_v2",
           "cuCtxPopCurrent_v2")

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p)
_LAUNCH_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p)
_CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_POP_CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


class _Record(ctypes.Structure):
    """``launch_record`` of native_launch.h, field for field."""
    _fields_ = [("function", ctypes.c_void_p), ("launch", ctypes.c_void_p),
                ("launch_ex", ctypes.c_void_p), ("set_current", ctypes.c_void_p),
                ("push_current", ctypes.c_void_p), ("pop_current", ctypes.c_void_p),
                ("context", ctypes.c_void_p), ("config", ctypes.c_void_p),
                ("words", ctypes.c_void_p), ("params", ctypes.c_void_p),
                ("pointer_slots", ctypes.c_void_p), ("pointer_count", ctypes.c_uint32),
                ("grid_slot", ctypes.c_uint32), ("block", ctypes.c_uint32 * 3),
                ("plain_fallback", ctypes.c_uint32), ("map_memo", ctypes.c_void_p),
                ("evictions", ctypes.c_void_p), ("memo_evictions", ctypes.c_uint64)]


class DriverFunctions:
    """The driver entry points a launch calls (``symbols``: name -> address, :data:`SYMBOLS`)
    and the context to launch in, as the shim and the ctypes path need them. A test or
    benchmark passes addresses of stand-ins (a no-op launch)."""

    def __init__(self, symbols: Mapping[str, int], context: int | None):
        self.addresses = {name: symbols[name] for name in SYMBOLS}
        self.context = context
        self.launch = _LAUNCH(self.addresses["cuLaunchKernel"])
        self.launch_ex = _LAUNCH_EX(self.addresses["cuLaunchKernelEx"])
        self.set_current = _CONTEXT(self.addresses["cuCtxSetCurrent"])
        self.push_current = _CONTEXT(self.addresses["cuCtxPushCurrent_v2"])
        self.pop_current = _POP_CONTEXT(self.addresses["cuCtxPopCurrent_v2"])


class DriverArguments:
    """One argument block of a :class:`DriverLauncher`: ``words`` (one 8-byte slot per flat
    argument, then grid x/y/z, dynamic shared bytes, stream), a pointer to each parameter's
    slot, the launch config (cluster or programmatic launches) and the launch record over
    them. ``address`` is what the launcher's ``entry`` takes."""

    def __init__(self, launcher: "DriverLauncher"):
        # What a launch reads, held directly: the launcher keeps its blocks, and a cycle back
        # to it would delay unloading its module to the cyclic collector.
        self._owner = weakref.ref(launcher)
        self._function, self._functions = launcher.function, launcher.functions
        self._grid_slot, self._block = launcher.grid_slot, launcher.signature.block
        self._plain_fallback = launcher.plain_fallback
        count = launcher.layout.size // SLOT_BYTES
        self.words = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self.words)
        params = launcher.grid_slot
        self._params = (ctypes.c_void_p * max(params, 1))(
            *range(base, base + SLOT_BYTES * params, SLOT_BYTES))
        self._config = launcher.new_config()
        functions = launcher.functions
        self.record = _Record(
            function=launcher.function, context=functions.context,
            config=ctypes.addressof(self._config) if self._config is not None else None,
            words=base, params=ctypes.addressof(self._params), grid_slot=params,
            block=(ctypes.c_uint32 * 3)(*launcher.signature.block),
            plain_fallback=int(launcher.plain_fallback),
            **{field: functions.addresses[name] for field, name in (
                ("launch", "cuLaunchKernel"), ("launch_ex", "cuLaunchKernelEx"),
                ("set_current", "cuCtxSetCurrent"), ("push_current", "cuCtxPushCurrent_v2"),
                ("pop_current", "cuCtxPopCurrent_v2"))})
        self._slots = None
        self.address = ctypes.addressof(self.record) if launcher.shim is not None else self

    def bind_pointer_slots(self, slots: Sequence[int]) -> None:
        """Where each address of the shim's ``launch_pointers`` goes: a slot ``s >= 0`` takes
        it twice (a tensor's allocated and aligned pointers), ``~s`` once (a tensor map)."""
        self._slots = (ctypes.c_int32 * max(len(slots), 1))(*slots)
        self.record.pointer_slots = ctypes.addressof(self._slots)
        self.record.pointer_count = len(slots)

    def bind_map_memo(self, ways: int, evictions_address: int) -> None:
        """Room for the shim's ``launch_mapped`` memo: ``ways`` (tensor address, descriptor
        address) pairs per address position (after :meth:`bind_pointer_slots`), valid while
        the uint64 at ``evictions_address`` (the descriptor cache's eviction count) keeps the
        value it had when they were stored."""
        self._memo = (ctypes.c_uint64 * max(2 * ways * self.record.pointer_count, 1))()
        self.record.map_memo = ctypes.addressof(self._memo)
        self.record.evictions = evictions_address
        self.record.memo_evictions = ctypes.c_uint64.from_address(evictions_address).value

    def copy(self) -> "DriverArguments":
        twin = DriverArguments(self._owner())
        ctypes.memmove(twin.words, self.words, ctypes.sizeof(self.words))
        if self._slots is not None:
            twin.bind_pointer_slots(list(self._slots)[:self.record.pointer_count])
        return twin

    def ctypes_launch(self) -> None:
        """The shim's ``launch`` in Python (where no shim could be built)."""
        code = self._launch_in_context()
        if code:
            raise_launch_error(code)

    def _launch_in_context(self) -> int:
        functions = self._functions
        code = self._launch_once()
        if code == 0 or not functions.context:
            return code
        if code == CUDA_ERROR_INVALID_CONTEXT and functions.set_current(functions.context) == 0:
            return self._launch_once()
        if functions.push_current(functions.context) != 0:
            return code
        code = self._launch_once()
        functions.pop_current(ctypes.byref(ctypes.c_void_p()))
        return code

    def _launch_once(self) -> int:
        words, slot = self.words, self._grid_slot
        grid, smem, stream = words[slot:slot + 3], words[slot + 3] & 0xFFFFFFFF, words[slot + 4]
        functions = self._functions
        if self._config is not None:
            config = self._config
            config.grid_x, config.grid_y, config.grid_z = grid
            config.shared_bytes, config.stream = smem, stream or None
            code = functions.launch_ex(ctypes.addressof(config), self._function,
                                       ctypes.addressof(self._params), None)
            if code == 0 or not self._plain_fallback:
                return code
        return functions.launch(self._function, *grid, *self._block, smem, stream or None,
                                ctypes.addressof(self._params), None)


def raise_launch_error(code: int) -> None:
    """Raise the LaunchError of a launch the driver refused with CUresult ``code``."""
    message = cuda.driver().error_message(code) if cuda.cuda_available() else \
        f"CUDA error {code}"
    raise LaunchError(f"cuLaunchKernel failed: {message}",
                      fix="check the kernel's indices and the launch grid; rerun with "
                          "KILN_LAUNCH_BLOCKING=1 or compute-sanitizer to locate a fault")


class DriverLauncher(PackedLaunches):
    """A kernel loaded once and launched through the driver (see the module docs); the same
    interface as :class:`~kiln.runtime.host.HostLauncher`: ``launcher(flat, grid, stream)``,
    or :meth:`new_arguments` / :meth:`pack` once and :meth:`launch_packed` per launch, or
    ``entry(arguments.address)`` after packing :attr:`layout` (what a generated launcher
    does). ``shim``: the native module, or None for the ctypes path."""

    def __init__(self, signature: KernelSignature, function: int, functions: DriverFunctions,
                 shim=None):
        self.signature = signature
        self.function = function
        self.functions = functions
        # A shim built from another layout of the record (never, unless edited) is not used.
        self.shim = shim if shim is not None and \
            shim.RECORD_BYTES == ctypes.sizeof(_Record) else None
        shim = self.shim
        argtypes = flat_c_argtypes(signature)
        self.layout = struct.Struct("<" + "".join(_SLOT_CODES[t] for t in argtypes))
        self.grid_slot = len(argtypes) - 5
        self.stream_slot = len(argtypes) - 1
        self._smem = signature.dynamic_shared_bytes
        # The shim's functions when it is there; otherwise DriverArguments' own, which take
        # the block itself as its "address".
        self.entry = shim.launch if shim is not None else DriverArguments.ctypes_launch
        if shim is not None:
            shim.set_error_handler(raise_launch_error)
        self.plain_fallback = signature.programmatic_launch and not signature.cluster
        self.thread_blocks: dict[int, DriverArguments] = {}

    def new_config(self) -> _LaunchConfig | None:
        """A launch config with this kernel's attributes (None: a plain launch)."""
        sig = self.signature
        attributes = []
        if sig.cluster:
            cluster = _LaunchAttribute(id=CLUSTER_DIMENSION)
            cluster.value[:3] = sig.cluster
            policy = _LaunchAttribute(id=CLUSTER_SCHEDULING_POLICY_PREFERENCE)
            policy.value[0] = CLUSTER_SCHEDULING_SPREAD
            attributes = [cluster, policy]
        elif sig.programmatic_launch:
            programmatic = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
            programmatic.value[0] = 1
            attributes = [programmatic]
        if not attributes:
            return None
        array = (_LaunchAttribute * len(attributes))(*attributes)
        config = _LaunchConfig(0, 0, 0, *sig.block, self._smem, None,
                               ctypes.cast(array, ctypes.POINTER(_LaunchAttribute)),
                               len(attributes))
        config._attributes = array  # alive as long as the config
        return config

    def new_arguments(self) -> DriverArguments:
        """A fresh, zeroed argument block for :meth:`pack` / :meth:`launch_packed`."""
        return DriverArguments(self)


def load_driver_launcher(signature: KernelSignature, cubin: bytes, driver,
                         shim) -> DriverLauncher:
    """A :class:`DriverLauncher` of ``signature.name`` in ``cubin`` on ``driver`` (a
    :class:`~kiln.runtime.cuda.Driver`); the module is unloaded when the launcher is
    collected. ``shim``: the native module (:func:`~kiln.runtime.native.native_module`), or
    None to launch through ctypes."""
    module, function = driver.load_function(bytes(cubin), signature.name)
    try:
        if signature.dynamic_shared_bytes > 0:  # mgpuLaunchKernel sets it on every launch
            driver.set_function_attribute(function, MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          signature.dynamic_shared_bytes)
        if signature.cluster and math.prod(signature.cluster) > PORTABLE_CLUSTER_SIZE:
            driver.set_function_attribute(function, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    except LaunchError:
        driver.unload_module(module)
        raise
    launcher = DriverLauncher(signature, function,
                              DriverFunctions(driver.launch_symbols(), driver.context), shim)
    weakref.finalize(launcher, _unload, driver, module)
    return launcher


def _unload(driver, module: int) -> None:
    """Unload at collection or interpreter exit (a driver shutting down may refuse)."""
    try:
        driver.unload_module(module)
    except LaunchError:
        pass
