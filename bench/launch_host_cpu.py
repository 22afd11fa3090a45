"""Host cost of a launch up to the driver, measured on any machine (no GPU needed).

saxpy is traced and compiled for sm_90a as usual; its launcher is the real JIT-compiled host
module, but the ``mgpu*`` runtime functions it calls are native no-ops compiled here, so the
time is Kiln's own: key, argument packing, the ctypes call into ``kiln_launch`` (also timed
alone: what a launch costs here before any Python work). Arguments
are stand-ins for CUDA torch tensors (Python attributes where torch has C ones). Prints µs per
call, best of five (CPU time of the process)::

    .venv/bin/python bench/launch_host_cpu.py
"""

from __future__ import annotations

import ctypes
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
    """A CUDA torch tensor as the launch path reads one."""

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


@kiln.kernel(num_threads="BLOCK")
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]


def main() -> None:
    n = 4096
    x, y = Tensor(0x10000, n), Tensor(0x20000, n)
    ck = saxpy.compile(x, y, n, 2.0, BLOCK=256)
    keep, symbols = no_op_runtime()
    launcher = HostLauncher(ck.signature, lambda: nvidia_kernel_object(ck.target,
                                                                       ptx=ck.asm["ptx"]),
                            [], runtime_symbols=symbols)
    setattr(ck, _PLAN_ATTRIBUTE, _LaunchPlan(ck.name, ck.signature, launcher, None))
    bound = bind_launch(ck, (16, 1, 1), [x, y, n, 2.0])
    cases = {
        "kernel[grid](...)": lambda: saxpy[(16,)](x, y, n, 2.0, BLOCK=256),
        "ck.launch(grid, args)": lambda: ck.launch((16, 1, 1), [x, y, n, 2.0]),
        "bind_launch(...)(pointers)": lambda: bound(0x10000, 0x20000),
        "ctypes call into kiln_launch": lambda: launcher.launch_packed(arguments),
    }
    arguments = launcher.new_arguments()
    launcher.pack(arguments, [0x10000, 0x10000, 0, n, 1, 0x20000, 0x20000, 0, n, 1, n, 2.0],
                  (16, 1, 1), None)
    try:
        for case in cases.values():
            case()  # compile, plan, generated launcher
        for label, case in cases.items():
            # CPU time of this process: steadier than wall time on a shared machine.
            timer = timeit.Timer(case, timer=time.process_time)
            best = min(timer.repeat(number=20000, repeat=5)) / 20000 * 1e6
            print(f"{label:28s} {best:6.2f} us", flush=True)
    finally:
        # The launcher's engine unloads its module through the no-ops: release it first.
        saxpy._launches.clear()
        saxpy._last_launch = None
        del cases, bound, launcher, arguments
        delattr(ck, _PLAN_ATTRIBUTE)
        gc.collect()
        del keep


if __name__ == "__main__":
    main()
