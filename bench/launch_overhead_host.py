"""``bench/launch_overhead.py --host-only``: Kiln's per-call host work up to the driver call,
on the CPU (no GPU; CPU time of the process, steadier than wall time on a shared machine).

The real JIT-compiled host launchers are built with an in-process CUDA runtime whose
``mgpuLaunchKernel`` is a native no-op (a JIT-compiled empty function), for the tiny kernel
and for the split-KV combine's signature (five rank-3..5 tensors, 60 flat C arguments):

- ``bound launch``: :class:`~kiln.runtime.launch.BoundLaunch` (what ``combine()`` calls),
  also ``[native]`` and ``[ctypes]``: the same over the driver launcher with a no-op
  ``cuLaunchKernel``;
- ``launch plan``: ``CompiledKernel.launch`` on ``__cuda_array_interface__`` arrays;
- ``packed launcher``: ``HostLauncher(flat, grid, stream)`` with ready flat arguments;
- ``flat ctypes call``: the previous ABI, one ctypes call converting every flat C argument
  (to the same no-op), for comparison.

:func:`run_library_host_only` times each library entry point on torch CPU tensors (when torch
is installed) with :class:`kiln.kernels.runtime.DryRuntime`, which binds and launches nothing:
the entry point's own work up to its bound launch (add the bound launch's row above for the
call up to the driver). matmul's tuning is seeded with its first config there.

Usage: ``python bench/launch_overhead.py --host-only`` (or call :func:`run_host_only`).
"""

from __future__ import annotations

import functools
import time

from launch_overhead import N, _per_launch_us, library_calls
from results_io import write_results


class _NoopRuntime:
    """The ``mgpu*`` functions a host launcher needs, in-process: module loading returns fake
    handles (Python, called once) and ``mgpuLaunchKernel`` is a native no-op."""

    def __init__(self):
        import ctypes

        from mlir import execution_engine, ir, passmanager
        from mlir.dialects import func

        self._context = ir.Context()
        with self._context, ir.Location.unknown():
            module = ir.Module.create()
            with ir.InsertionPoint(module.body):
                noop = func.FuncOp("noop", ir.FunctionType.get([], []))
            with ir.InsertionPoint(noop.add_entry_block()):
                func.ReturnOp([])
            passmanager.PassManager.parse("builtin.module(convert-func-to-llvm)").run(
                module.operation)
            self._engine = execution_engine.ExecutionEngine(module, opt_level=2)
        # The packed wrapper of a function without arguments reads none of its own: any call
        # signature (System V ABI) returns at once.
        self.noop_address = self._engine.raw_lookup("noop")
        handle = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
        lookup = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
        self._callbacks = [handle(lambda data, level: 0x1111), handle(lambda data, size: 0x1111),
                           lookup(lambda module, name: 0x2222)]
        self.symbols = {"mgpuModuleLoadJIT": self._address(0), "mgpuModuleLoad": self._address(1),
                        "mgpuModuleGetFunction": self._address(2),
                        "mgpuModuleUnload": self.noop_address,
                        "mgpuLaunchKernel": self.noop_address}

    def _address(self, index: int) -> int:
        import ctypes

        return ctypes.cast(self._callbacks[index], ctypes.c_void_p).value


class _DeviceArray:
    """A device array by ``__cuda_array_interface__`` (what cupy exposes); never dereferenced."""

    def __init__(self, ptr: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": None, "version": 3}


def run_host_only(launches: int, batches: int) -> dict:
    """Per-call host overhead (µs) of Kiln's launch paths up to the driver call (no GPU)."""
    import ctypes
    from types import SimpleNamespace

    from kiln.runtime.host import HostLauncher, flat_c_argtypes, nvidia_kernel_object
    from kiln.runtime.launch import _LaunchPlan, bind_launch
    from kiln.signature import KernelSignature, ScalarParam, TensorParam
    from kiln.core.targets import get_target
    from kiln.runtime.driver_launch import DriverFunctions
    from launch_host_cpu import no_op_driver

    def timed(issue) -> float:  # CPU time: steadier than wall time on a shared machine
        return _per_launch_us(issue, launches, batches, _pass, time.process_time)

    runtime = _NoopRuntime()
    keep_driver, driver_symbols = no_op_driver()
    driver_functions = DriverFunctions(driver_symbols, None)
    combine_shape = {"o_part": (2, 1, 1, 32, 128), "lse_part": (2, 1, 1, 32),
                     "counts": (1, 1, 32), "o_out": (1, 1, 32, 128), "lse_out": (1, 1, 32)}
    kernels = {
        "add_one (1 tensor, 6 flat args)": (
            KernelSignature("add_one", (TensorParam("y", "f32", 1), ScalarParam("n", "i32")),
                            block=(128, 1, 1)),
            [_DeviceArray(0x10000, (N,), "<f4"), N]),
        "combine (5 tensors, 60 flat args)": (
            KernelSignature("lse_merge", tuple(
                TensorParam(name, "i32" if name == "counts" else "f32", len(shape))
                for name, shape in combine_shape.items()) + (
                ScalarParam("heads", "i32"), ScalarParam("rows", "i32")), block=(512, 1, 1)),
            [_DeviceArray(0x10000 * (i + 1), shape, "<i4" if name == "counts" else "<f4")
             for i, (name, shape) in enumerate(combine_shape.items())] + [32, 32]),
    }
    results: dict = {"mode": "host-only (CPU, driver call replaced by a native no-op)",
                     "launches_per_batch": launches, "batches": batches}
    for label, (signature, args) in kernels.items():
        launcher = HostLauncher(signature, lambda: nvidia_kernel_object(
            get_target("sm_80"), ptx="// no device code"), [], runtime_symbols=runtime.symbols)
        plan = _LaunchPlan(signature.name, signature, launcher, None)
        ck = SimpleNamespace(name=signature.name, signature=signature, _launch_plan=plan)
        bound = bind_launch(ck, (1, 1, 1), args)
        pointers = [a.__cuda_array_interface__["data"][0] for a in args
                    if isinstance(a, _DeviceArray)]
        flat: list = []
        for convert, value in zip(plan.converters, args):
            convert(value, flat, None)
        flat_call = ctypes.CFUNCTYPE(None, *flat_c_argtypes(signature))(runtime.noop_address)
        tail = (1, 1, 1, 0, None)
        for kind, driver_launcher in _driver_launchers(signature, driver_functions):
            driver_plan = _LaunchPlan(signature.name, signature, driver_launcher, None)
            driver_bound = bind_launch(SimpleNamespace(name=signature.name, signature=signature,
                                                       _launch_plan=driver_plan), (1, 1, 1), args)
            results[f"{label} [{kind}]"] = {
                "bound_launch_us": timed(lambda: driver_bound(*pointers)),
                "launch_plan_us": timed(lambda: driver_plan((1, 1, 1), args, None)),
                "packed_launcher_us": timed(lambda: driver_launcher(flat, (1, 1, 1), None)),
                "flat_ctypes_call_us": None,
            }
        results[label] = {
            "bound_launch_us": timed(lambda: bound(*pointers)),
            "launch_plan_us": timed(lambda: plan((1, 1, 1), args, None)),
            "packed_launcher_us": timed(lambda: launcher(flat, (1, 1, 1), None)),
            "flat_ctypes_call_us": timed(lambda: flat_call(*flat, *tail)),
        }
        del bound, plan, ck, launcher  # the engines unload through the runtime: before it
    return results


def _driver_launchers(signature, functions):
    """(label, DriverLauncher) through the native shim (where it builds) and ctypes."""
    from kiln.runtime.driver_launch import DriverLauncher
    from kiln.runtime.native import native_module

    shim = native_module()
    if shim is not None:
        yield "native", DriverLauncher(signature, 0x1000, functions, shim)
    yield "ctypes", DriverLauncher(signature, 0x1000, functions, None)


def run_library_host_only(launches: int, batches: int) -> list[dict] | str:
    """Per-call host µs of each library entry point on torch CPU tensors with a DryRuntime
    (up to the bound launch: ``us``), and with :class:`NoopDriverRuntime` (the whole steady
    state but the driver's and the CUDA allocator's work) through its one C call
    (``one_call_us``) and through its Python path (``python_us``, :mod:`kiln.kernels.one_call`
    off), the two in turns A B B A, each keeping its better median; or why it could not run."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    from kiln.kernels import runtime
    from kiln.kernels.gemm import HOPPER_CONFIGS, hopper_autotuner
    from kiln.kernels.one_call import use_one_call

    # No GPU to time configs on: matmul's 1024^3 shape takes the first one.
    key = hopper_autotuner.key_of((None, None, None, 1024, 1024, 1024, "bf16", "mn", "bf16",
                                   "sm_90a"), {})
    hopper_autotuner.best[key] = HOPPER_CONFIGS[0]
    rows = []
    with runtime.use_runtime(runtime.DryRuntime()):
        for name, call in library_calls(torch, "cpu").items():
            call()  # plans
            rows.append({"path": name, "us": _per_launch_us(call, launches, batches, _pass,
                                                            time.process_time)})
    for key in ("one_call_us", "python_us", "python_us", "one_call_us"):
        use_one_call(key == "one_call_us")
        with runtime.use_runtime(NoopDriverRuntime()):
            for row, call in zip(rows, library_calls(torch, "cpu").values()):
                call()
                call()  # plans, binds, installs its one call
                us = _per_launch_us(call, launches, batches, _pass, time.process_time)
                row[key] = min(row.get(key, us), us)
    use_one_call(True)
    return rows


def _pass() -> None:
    pass


def _print_host_table(results: dict) -> None:
    print(results["mode"])
    columns = ("bound_launch_us", "launch_plan_us", "packed_launcher_us", "flat_ctypes_call_us")
    print(f"{'kernel':<44}" + "".join(f"{c[:-3]:>20}" for c in columns))
    for label, row in results.items():
        if isinstance(row, dict):
            print(f"{label:<44}" + "".join(f"{row[c]:>20.2f}" if row[c] is not None
                                           else f"{'':>20}" for c in columns))
    print("(µs per call, median of batches)")
    library = results.get("library")
    if isinstance(library, str):
        print(f"library entry points: skipped ({library})")
    elif library:
        print("library entry points, torch CPU tensors: DryRuntime (up to the bound launch); "
              "no-op driver: one C call, Python path")
        for row in library:
            print(f"{row['path']:<56}{row['us']:>10.2f}{row['one_call_us']:>10.2f}"
                  f"{row['python_us']:>10.2f}")


class _FakeDriver:
    """The CUDA driver calls a tensor-map cache makes (encode, allocate, copy), answered at
    once with made-up addresses: descriptors that nothing reads."""

    def __init__(self):
        self._next = 0x7000_0000

    def mem_alloc(self, nbytes: int) -> int:
        self._next += -(-nbytes // 256) * 256
        return self._next

    mem_alloc_host = mem_alloc

    def tensor_map_encode_tiled(self, *args) -> bytes:
        return bytes(128)

    def stream_capturing(self, stream) -> bool:
        return False

    def make_current(self) -> None:
        pass

    def memcpy_htod(self, *args) -> None:
        pass

    def mem_free(self, *args) -> None:
        pass

    mem_free_host = mem_free


class NoopDriverRuntime:
    """A library runtime for torch CPU tensors whose bound launches are real: each kernel is
    compiled (PTX and cubin, as on the GPU machine) and bound through the native shim's
    :class:`~kiln.runtime.driver_launch.DriverLauncher`, with driver functions that return at
    once (``no_op_driver``) and a made-up tensor-map driver. So an entry point's steady state
    runs as on the GPU (plan guard, the torch bridge's makers, the shim's ``launch_outputs``
    reading tensors and packing the record) except the driver's own work and the CUDA
    allocator's (CPU tensors). For profiling the hot path without a GPU.

    Example::

        with runtime.use_runtime(NoopDriverRuntime()):
            decode_attention(q, k_cache, v_cache, page_table, seq_lens)   # CPU tensors
    """

    device_type = "cpu"

    def __init__(self, sms: int = 132):
        from kiln.kernels.runtime import DryRuntime
        from kiln.runtime.driver_launch import DriverFunctions
        from kiln.runtime.native import native_module
        from launch_host_cpu import no_op_driver

        self._keep, symbols = no_op_driver()
        self._functions = DriverFunctions(symbols, None)
        self._shim = native_module()
        self._dry = DryRuntime(sms)
        self.launch = self._dry.launch
        self.multiprocessor_count = self._dry.multiprocessor_count
        self.max_active_clusters = self._dry.max_active_clusters

    def bind(self, kernel, grid, args, **options):
        from launch_host_cpu import cpu_torch_as_device

        from kiln.runtime.driver_launch import DriverLauncher
        from kiln.runtime.launch import _LaunchPlan, bind_launch

        ck = kernel.compile(*args, **options)
        plan = _LaunchPlan(ck.name, ck.signature,
                           DriverLauncher(ck.signature, 0x1000, self._functions, self._shim),
                           _FakeDriver())
        ck._launch_plan = plan
        with cpu_torch_as_device():
            bound = bind_launch(ck, grid, args)
        # The legacy stream, by a C call as cheap as torch's raw getter (no CUDA to ask).
        bound.current_stream = bound._current_stream = functools.partial(int, 0)
        return bound


def main_host(launches: int, batches: int, json_path: str | None) -> int:
    """``launch_overhead.py --host-only``: the table, and the JSON at ``json_path``."""
    results = run_host_only(launches, batches)
    results["library"] = run_library_host_only(launches, batches)
    _print_host_table(results)
    if json_path:
        rows = [{"kernel": label, **row} for label, row in results.items()
                if isinstance(row, dict)]
        if isinstance(results["library"], list):
            rows += [{"kernel": row["path"], "entry_point_us": row["us"],
                      "one_call_us": row["one_call_us"], "python_path_us": row["python_us"]}
                     for row in results["library"]]
        write_results(json_path, "launch_overhead-host", rows, results=results,
                      device="host CPU (driver call a no-op)", driver=None)
    return 0
