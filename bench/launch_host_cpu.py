"""Host cost of a launch up to the driver, measured on any machine (no GPU needed).

saxpy is traced and compiled for sm_90a as usual and launched through each of Kiln's CUDA
launchers, with the driver replaced by native no-ops compiled here, so the time is Kiln's own:

- ``mlir``: the JIT-compiled host module (``KILN_LAUNCHER=mlir``), its ``mgpu*`` runtime
  functions no-ops: key, argument packing, the ctypes call into ``kiln_launch``;
- ``native``: :class:`~kiln.runtime.driver_launch.DriverLauncher` through the C shim (the
  default), ``cuLaunchKernel`` a no-op;
- ``ctypes``: the same launcher without the shim (no C compiler).

Rows: ``kernel[grid](...)``, ``ck.launch``, a bound launch, and the launcher's bare call
(what a launch costs before any Python work). Arguments are stand-ins for CUDA torch tensors
(Python attributes where torch has C ones). Prints µs per call, best of five (CPU time of the
process), and JSON with ``--json FILE``::

    .venv/bin/python bench/launch_host_cpu.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
import gc
import time
import timeit
from types import SimpleNamespace

import numpy as np
from mlir import execution_engine, ir

import kiln
from kiln import f32, i32
from kiln.runtime.host import HostLauncher, nvidia_kernel_object
from kiln.runtime.launch import _PLAN_ATTRIBUTE, _LaunchPlan, bind_launch
from results_io import write_results

# Native stand-ins for the MLIR CUDA runtime wrappers: a module load, a function lookup and a
# launch that do nothing, and their addresses.
_NO_OP_RUNTIME = """
llvm.func @load(%image: !llvm.ptr, %level: i32) -> !llvm.ptr {
  %m = llvm.mlir.zero : !llvm.ptr
  llvm.return %m : !llvm.ptr }
llvm.func @function(%module: !llvm.ptr, %name: !llvm.ptr) -> !llvm.ptr {
  %f = llvm.mlir.zero : !llvm.ptr
  llvm.return %f : !llvm.ptr }
llvm.func @launch(%f: !llvm.ptr, %gx: i64, %gy: i64, %gz: i64, %bx: i64, %by: i64, %bz: i64,
    %smem: i32, %stream: !llvm.ptr, %params: !llvm.ptr, %extra: !llvm.ptr, %count: i64) {
  llvm.return }
llvm.func @unload(%module: !llvm.ptr) { llvm.return }
llvm.func @addresses(%out: !llvm.ptr) {
  %a0 = llvm.mlir.addressof @load : !llvm.ptr
  %a1 = llvm.mlir.addressof @function : !llvm.ptr
  %a2 = llvm.mlir.addressof @launch : !llvm.ptr
  %a3 = llvm.mlir.addressof @unload : !llvm.ptr
  %p1 = llvm.getelementptr %out[1] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr
  %p2 = llvm.getelementptr %out[2] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr
  %p3 = llvm.getelementptr %out[3] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr
  llvm.store %a0, %out : !llvm.ptr, !llvm.ptr
  llvm.store %a1, %p1 : !llvm.ptr, !llvm.ptr
  llvm.store %a2, %p2 : !llvm.ptr, !llvm.ptr
  llvm.store %a3, %p3 : !llvm.ptr, !llvm.ptr
  llvm.return }
"""
_NAMES = ("mgpuModuleLoadJIT", "mgpuModuleGetFunction", "mgpuLaunchKernel", "mgpuModuleUnload")


_NO_OP_DRIVER = """
llvm.func @ok() -> i32 {
  %0 = llvm.mlir.constant(0 : i32) : i32
  llvm.return %0 : i32 }
llvm.func @address(%out: !llvm.ptr) {
  %a = llvm.mlir.addressof @ok : !llvm.ptr
  llvm.store %a, %out : !llvm.ptr, !llvm.ptr
  llvm.return }
"""


def no_op_driver() -> tuple[object, dict[str, int]]:
    """(engine to keep alive, driver function name -> address of a native function that
    returns CUDA_SUCCESS at once, whatever its arguments), for a DriverLauncher."""
    from kiln.runtime.driver_launch import SYMBOLS

    context = ir.Context()
    with context, ir.Location.unknown():
        engine = execution_engine.ExecutionEngine(ir.Module.parse(_NO_OP_DRIVER), opt_level=2)
        engine.initialize()
    slot = ctypes.c_void_p()
    pointer = ctypes.c_void_p(ctypes.addressof(slot))
    args = (ctypes.c_void_p * 1)(ctypes.addressof(pointer))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(engine.raw_lookup("address"))(ctypes.addressof(args))
    return (context, engine), {name: slot.value for name in SYMBOLS}


def no_op_runtime() -> tuple[object, dict[str, int]]:
    """(engine to keep alive, ``mgpu*`` name -> address of its native no-op)."""
    context = ir.Context()
    with context, ir.Location.unknown():
        engine = execution_engine.ExecutionEngine(ir.Module.parse(_NO_OP_RUNTIME), opt_level=2)
        engine.initialize()
    table = (ctypes.c_void_p * 4)()
    pointer = ctypes.c_void_p(ctypes.addressof(table))
    args = (ctypes.c_void_p * 1)(ctypes.addressof(pointer))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(engine.raw_lookup("addresses"))(
        ctypes.addressof(args))
    return (context, engine), dict(zip(_NAMES, table))


class Tensor:
    """A CUDA torch tensor as the launch path reads one (where torch is not installed)."""

    __module__ = "torch"
    device = SimpleNamespace(type="cuda")
    is_cuda = True
    dtype = np.dtype(np.float32)

    def __init__(self, ptr: int, n: int):
        self._ptr, self.shape = ptr, (n,)

    def data_ptr(self):
        return self._ptr

    def dim(self):
        return 1

    def stride(self, dim=None):
        return (1,) if dim is None else 1


@contextlib.contextmanager
def cpu_torch_as_device():
    """Let the checked launch take torch CPU tensors as device ones (their attributes cost
    what a CUDA tensor's do; only ``is_cuda`` differs, and the launch key keeps it)."""
    from kiln.runtime import arguments, launch

    checked = arguments.device_view

    def device_view(param, value, staging):
        if type(value).__module__.startswith("torch") and not value.is_cuda:
            return value.data_ptr(), tuple(value.shape), tuple(value.stride())
        return checked(param, value, staging)

    # the converters read it from kiln.runtime.arguments, bound launches from kiln.runtime.launch
    for module in (arguments, launch):
        module.device_view = device_view
    try:
        yield
    finally:
        for module in (arguments, launch):
            module.device_view = checked


def raw_ctypes_call(symbols: dict[str, int]):
    """A ``cuLaunchKernel``-shaped ctypes call (11 arguments, prebuilt) into the no-op: what
    a launcher that calls the driver through ctypes pays at least, as Triton's did."""
    from kiln.runtime.driver_launch import _LAUNCH

    launch = _LAUNCH(symbols["cuLaunchKernel"])
    params = (ctypes.c_void_p * 4)()
    return lambda: launch(0x1000, 16, 1, 1, 256, 1, 1, 0, None, params, None)


@kiln.kernel(num_threads="BLOCK")
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]


def launchers(ck):
    """(label, launcher, keep-alive) of each CUDA launcher of ``ck`` over no-op drivers."""
    from kiln.runtime.driver_launch import DriverFunctions, DriverLauncher
    from kiln.runtime.native import native_module

    keep, symbols = no_op_runtime()
    # No local keeps the launcher: its engine unloads through the no-ops when the caller drops
    # it, before the no-ops' engine goes (the other way round jumps into freed code).
    yield "mlir", HostLauncher(ck.signature,
                               lambda: nvidia_kernel_object(ck.target, ptx=ck.asm["ptx"]), [],
                               runtime_symbols=symbols), keep
    del keep
    keep, symbols = no_op_driver()
    functions = DriverFunctions(symbols, None)
    shim = native_module()
    if shim is not None:
        yield "native", DriverLauncher(ck.signature, 0x1000, functions, shim), keep
    yield "ctypes", DriverLauncher(ck.signature, 0x1000, functions, None), keep


def _timed(case, number: int) -> float:
    # CPU time of this process: steadier than wall time on a shared machine.
    timer = timeit.Timer(case, timer=time.process_time)
    return min(timer.repeat(number=number, repeat=5)) / number * 1e6


def launch_rows(x, y, n: int, number: int) -> dict:
    """µs per call of each launch path of saxpy on ``x``, ``y`` over each launcher."""
    ck = saxpy.compile(x, y, n, 2.0, BLOCK=256)
    results: dict = {}
    for kind, launcher, keep in launchers(ck):
        setattr(ck, _PLAN_ATTRIBUTE, _LaunchPlan(ck.name, ck.signature, launcher, None))
        saxpy._launches.clear()
        saxpy._last_launch = None
        bound = bind_launch(ck, (16, 1, 1), [x, y, n, 2.0])
        arguments = launcher.new_arguments()
        launcher.pack(arguments, [0x10000, 0x10000, 0, n, 1, 0x20000, 0x20000, 0, n, 1, n, 2.0],
                      (16, 1, 1), None)
        cases = {
            "kernel[grid](...)": lambda: saxpy[(16,)](x, y, n, 2.0, BLOCK=256),
            "ck.launch(grid, args)": lambda: ck.launch((16, 1, 1), [x, y, n, 2.0]),
            "bind_launch(...)(pointers)": lambda: bound(0x10000, 0x20000),
            "launcher's bare call": lambda: launcher.launch_packed(arguments),
        }
        try:
            for case in cases.values():
                case()  # plan, generated launcher
            for label, case in cases.items():
                results[f"{label} [{kind}]"] = best = _timed(case, number)
                print(f"{label:28s} {kind:7s} {best:6.2f} us", flush=True)
        finally:
            # An MLIR launcher's engine unloads its module through the no-ops: release it first.
            saxpy._launches.clear()
            saxpy._last_launch = None
            del cases, bound, launcher, arguments
            delattr(ck, _PLAN_ATTRIBUTE)
            gc.collect()
            del keep
    return results


def library_rows(number: int) -> dict:
    """µs per steady-state call of each library entry point on torch CPU tensors up to its
    bound launch (a DryRuntime), by name; empty without torch."""
    try:
        import torch
    except ImportError:
        return {}
    from launch_overhead_host import run_library_host_only

    return {row["path"]: row["us"] for row in run_library_host_only(number, 5)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--number", type=int, default=20000, help="calls per timing")
    parser.add_argument("--tensors", choices=("torch", "stand-in"), default=None,
                        help="torch CPU tensors (the default where torch is installed) or "
                             "stand-ins")
    parser.add_argument("--no-library", action="store_true", help="skip the entry points")
    options = parser.parse_args(argv)
    n = 4096
    tensors = options.tensors or ("torch" if _torch_installed() else "stand-in")
    print(f"arguments: {tensors} tensors", flush=True)
    if tensors == "torch":
        import torch

        x, y = torch.zeros(n), torch.zeros(n)
        with cpu_torch_as_device():
            results = launch_rows(x, y, n, options.number)
    else:
        results = launch_rows(Tensor(0x10000, n), Tensor(0x20000, n), n, options.number)
    keep, symbols = no_op_driver()
    results["raw ctypes cuLaunchKernel-shaped call"] = raw = _timed(raw_ctypes_call(symbols),
                                                                    options.number)
    print(f"{'raw ctypes call (floor of a ctypes launcher)':44s} {raw:6.2f} us")
    del keep
    if not options.no_library:
        library = library_rows(max(options.number // 20, 200))
        for label, us in library.items():
            results[f"library {label} (up to the bound launch)"] = us
            print(f"{label:56s} {us:6.2f} us", flush=True)
        if not library:
            print("library entry points: skipped (torch is not installed)")
    base = results.get("kernel[grid](...) [mlir]")
    ratios = {}
    for kind in ("native", "ctypes"):
        ours = results.get(f"kernel[grid](...) [{kind}]")
        if ours and base:
            ratios[f"kernel[grid] {kind} / mlir"] = ours / base
        if ours:
            ratios[f"kernel[grid] {kind} / raw ctypes call"] = ours / raw
    for label, ratio in ratios.items():
        print(f"{label}: {ratio:.2f}")
    if options.json:
        write_results(options.json, "launch_host_cpu",
                      [{"path": label, "us": us} for label, us in results.items()],
                      results=results, ratios=ratios, tensors=tensors,
                      device="host CPU (driver call a no-op)", driver=None)
    return results


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


if __name__ == "__main__":
    main()
