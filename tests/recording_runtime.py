"""An in-process stand-in for the ``mgpu*`` functions the JIT-compiled launcher calls, shared by
the host-launch tests: module loads return fake handles, every launch is recorded with the
kernel arguments decoded by the signature's C types."""

from __future__ import annotations

import ctypes

from kiln.runtime.host import flat_c_argtypes


class RecordingCudaRuntime:
    """``symbols()`` go to ``HostLauncher(runtime_symbols=...)``; ``loaded`` holds
    ``(image, opt_level)``, ``looked_up`` ``(module, name)``, ``launches`` ``(function, grid,
    block, dynamic smem, stream, kernel arguments, argument count)``."""

    _load_jit = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
    _get_function = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
    _launch = ctypes.CFUNCTYPE(None, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_int32,
                               ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                               ctypes.c_size_t)
    _unload = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    MODULE, FUNCTION = 0x1111, 0x2222

    def __init__(self, signature):
        self.kernel_types = flat_c_argtypes(signature)[:-5]  # without grid, smem, stream
        self.loaded, self.looked_up, self.launches = [], [], []
        self._callbacks = {
            "mgpuModuleLoadJIT": self._load_jit(self.load_jit),
            "mgpuModuleGetFunction": self._get_function(self.get_function),
            "mgpuLaunchKernel": self._launch(self.launch),
            "mgpuModuleUnload": self._unload(lambda module: None),
        }

    def symbols(self):
        return {name: ctypes.cast(cb, ctypes.c_void_p).value for name, cb in self._callbacks.items()}

    def load_jit(self, data, opt_level):
        self.loaded.append((ctypes.string_at(data), opt_level))
        return self.MODULE

    def get_function(self, module, name):
        self.looked_up.append((module, name))
        return self.FUNCTION

    def launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra, count):
        args = [ctypes.cast(params[i], ctypes.POINTER(ctype))[0]
                for i, ctype in enumerate(self.kernel_types)]
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), smem, stream, args, count))


class RecordingDriver:
    """Stand-ins for the driver functions a ``DriverLauncher`` calls (``symbols()`` go to
    ``DriverFunctions``): ``launches`` holds what ``RecordingCudaRuntime`` records, the
    same tuple for ``cuLaunchKernel`` and ``cuLaunchKernelEx``; ``configs`` the attributes
    ``(id, value[0..2])`` of each ``cuLaunchKernelEx``; ``refuse`` is a list of CUresults
    the next launches return (before any is recorded), ``context_calls`` names each
    ``cuCtx*`` call."""

    FUNCTION = 0x2222

    def __init__(self, signature):
        from kiln.runtime.driver_launch import (_CONTEXT, _LAUNCH, _LAUNCH_EX, _POP_CONTEXT,
                                                _LaunchConfig)

        self._config_type = _LaunchConfig
        self.kernel_types = flat_c_argtypes(signature)[:-5]
        self.launches, self.configs, self.refuse, self.context_calls = [], [], [], []
        self._callbacks = {
            "cuLaunchKernel": _LAUNCH(self.launch),
            "cuLaunchKernelEx": _LAUNCH_EX(self.launch_ex),
            "cuCtxSetCurrent": _CONTEXT(lambda c: self._context("set", c)),
            "cuCtxPushCurrent_v2": _CONTEXT(lambda c: self._context("push", c)),
            "cuCtxPopCurrent_v2": _POP_CONTEXT(lambda c: self._context("pop", None)),
        }

    def symbols(self):
        return {name: ctypes.cast(cb, ctypes.c_void_p).value
                for name, cb in self._callbacks.items()}

    def _context(self, what, context):
        self.context_calls.append((what, context))
        return 0

    def _args(self, params):
        params = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        return [ctypes.cast(params[i], ctypes.POINTER(ctype))[0]
                for i, ctype in enumerate(self.kernel_types)]

    def launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if self.refuse:
            return self.refuse.pop(0)
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), smem, stream,
                              self._args(params), len(self.kernel_types)))
        return 0

    def launch_ex(self, config, function, params, extra):
        if self.refuse:
            return self.refuse.pop(0)
        c = self._config_type.from_address(config)
        self.configs.append([(c.attrs[i].id, tuple(c.attrs[i].value[:3]))
                             for i in range(c.num_attrs)])
        self.launches.append((function, (c.grid_x, c.grid_y, c.grid_z),
                              (c.block_x, c.block_y, c.block_z), c.shared_bytes, c.stream,
                              self._args(params), len(self.kernel_types)))
        return 0
