"""Host-side launch overhead: Kiln's launch paths and library entry points, Triton, and a raw
``cuLaunchKernel``, in one run.

A tiny kernel (``y[i] += 1`` on 128 elements, one block) is launched many times back to back;
the wall-clock time per launch after warm-up is the host overhead (the GPU finishes each launch
faster than the host issues the next). Reported: median over batches, in microseconds, for

- ``kiln kernel[grid](...)``: the user-facing launch of a ``@kiln.kernel`` with torch CUDA
  tensors (specialisation lookup + argument conversion + launch);
- ``kiln CompiledKernel.launch``: the same, starting from the compiled kernel;
- ``kiln bound launch``: ``bind_launch(...)`` called with the tensor's address (library path);
- ``kiln packed launch``: the launcher called on a ready argument block (the floor of a
  Kiln launch: the native shim's one C call + ``cuLaunchKernel``);
- each of these per launcher (``KILN_LAUNCHER``): ``native`` (the default: the pipeline's
  cubin by ``cuLaunchKernel`` from the C shim), ``ctypes`` (the same without the shim) and
  ``mlir`` (the ExecutionEngine's host module, what Kiln used before);
- ``triton launch``: an equivalent ``@triton.jit`` kernel;
- ``raw cuLaunchKernel``: the same cubin through ``libcuda`` by ctypes with prebuilt
  parameters (skipped, with the reason, where libcuda cannot be loaded);
- each library entry point (``prefill``, ``decode``, ``decode_attention``, ``combine``,
  ``matmul``; decode on issue 42's shape: batch 1, 16k keys, Hq 32 / Hkv 8, D 128, pages of
  64) at steady state: host µs per call (``LIBRARY_CALLS`` calls back to back, no sync, few
  enough that the launch queue never fills), eager µs (the same calls with the final sync),
  and GPU µs (the calls captured in a CUDA graph and replayed, timed by CUDA events); host
  and eager µs again with the ``mlir`` launcher (the launchers take turns on each entry point,
  after a garbage collection, each keeping its better time);
- ratios: kernel[grid] / raw cuLaunchKernel and / Triton, native / mlir per path, and each
  entry point's eager / graph time (issue 42's goal: within 1.15 for batch-1 decode).

``--host-only`` needs no GPU: it measures Kiln's per-call host work up to the driver call on
the CPU (CPU time of the process, steadier than wall time on a shared machine). The real
JIT-compiled host launchers are built with an in-process CUDA runtime whose
``mgpuLaunchKernel`` is a native no-op (a JIT-compiled empty function), for the tiny kernel
and for the split-KV combine's signature (five rank-3..5 tensors, 60 flat C arguments):

- ``bound launch``: :class:`~kiln.runtime.launch.BoundLaunch` (what ``combine()`` calls),
  also ``[native]`` and ``[ctypes]``: the same over the driver launcher with a no-op
  ``cuLaunchKernel``;
- ``launch plan``: ``CompiledKernel.launch`` on ``__cuda_array_interface__`` arrays;
- ``packed launcher``: ``HostLauncher(flat, grid, stream)`` with ready flat arguments;
- ``flat ctypes call``: the previous ABI, one ctypes call converting every flat C argument
  (to the same no-op), for comparison.

``--host-only`` also times each library entry point on torch CPU tensors (when torch is
installed) with :class:`kiln.kernels.runtime.DryRuntime`, which binds and launches nothing:
the entry point's own work up to its bound launch (add the bound launch's row above for the
call up to the driver). matmul's tuning is seeded with its first config there.

Usage::

    python bench/launch_overhead.py --launches 2000 --batches 15 --json overhead.json
    python bench/launch_overhead.py --host-only
    python bench/launch_overhead.py --launches 300 --batches 5 --no-compare   # quick

Goals (issue 42): <= 5 µs host per ``kernel[grid]`` launch, <= 8 µs per library call.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import kiln
from kiln import f32, i32
from results_io import write_results

GOAL_US = 5.0
LIBRARY_GOAL_US = 8.0
LIBRARY_CALLS = 100
N = 128


@kiln.kernel
def add_one(y: kiln.Tensor[f32], n: i32, BLOCK: kiln.constexpr):
    i = kiln.thread_id(0)
    if i < n:
        y[i] = y[i] + 1.0


def _per_launch_us(issue, launches: int, batches: int, synchronize,
                   clock=time.perf_counter) -> float:
    for _ in range(max(launches // 10, 50)):  # warm-up: JIT, caches, clocks
        issue()
    synchronize()
    samples = []
    for _ in range(batches):
        start = clock()
        for _ in range(launches):
            issue()
        samples.append((clock() - start) / launches * 1e6)
        synchronize()
    return statistics.median(samples)


def _triton_issue(torch, y):
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, tl.load(y_ptr + offsets, mask=mask) + 1.0, mask=mask)

    return lambda: add_one[(1,)](y, N, BLOCK=N)


def _raw_cu_launch(compiled, y):
    """``cuLaunchKernel`` of ``compiled`` (add_one) through ctypes with prebuilt parameters on
    torch's current stream: the floor of any launcher called from Python."""
    import ctypes

    import torch

    from kiln.runtime.host import flat_c_argtypes

    cuda = ctypes.CDLL("libcuda.so.1")
    sig = compiled.signature
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    for status in (cuda.cuModuleLoadData(ctypes.byref(module), compiled.asm["cubin"]),
                   cuda.cuModuleGetFunction(ctypes.byref(function), module, sig.name.encode())):
        if status:
            raise OSError(f"CUDA driver error {status}")
    values = [ctype(v) for ctype, v in zip(flat_c_argtypes(sig)[:-5],
                                           [y.data_ptr(), y.data_ptr(), 0, N, 1, N])]
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    launch = cuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    stream = torch.cuda.current_stream().cuda_stream
    block = sig.block
    keep = (values, params, module)  # alive as long as the closure

    def issue():
        launch(function, 1, 1, 1, *block, sig.dynamic_shared_bytes, stream, params, None)
        return keep

    return issue


def library_calls(torch, device: str, target: str = "sm_90a") -> dict:
    """The library entry points on fixed torch inputs on ``device``, by name."""
    from kiln.kernels.attention import combine, decode, decode_attention, prefill
    from kiln.kernels.gemm import matmul

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    q, k_cache, v_cache = randn(1, 1, 32, 128), randn(256, 64, 8, 128), randn(256, 64, 8, 128)
    table = torch.randperm(256, generator=gen).to(device=device, dtype=torch.int32)[None]
    lens = torch.tensor([256 * 64], dtype=torch.int32, device=device)
    paged = (q, k_cache, v_cache, table, lens)
    o_part, lse_part, counts = decode(*paged, target=target)
    o_out, lse_out = decode_attention(*paged, target=target)  # reused by the out= row
    dense, a, b = randn(1, 1024, 16, 128), randn(1024, 1024), randn(1024, 1024)
    return {
        "prefill (1x1024, 16 heads, D 128, causal)": lambda: prefill(
            dense, dense, dense, causal=True, target=target),
        "decode (1x16k, Hq 32 / Hkv 8, D 128)": lambda: decode(*paged, target=target),
        "decode_attention (same)": lambda: decode_attention(*paged, target=target),
        "decode_attention (same, out=, lse_out=)": lambda: decode_attention(
            *paged, target=target, out=o_out, lse_out=lse_out),
        "combine (decode's partials)": lambda: combine(
            o_part, lse_part, counts, max_splits=o_part.shape[0], target=target),
        "matmul (1024^3 bf16)": lambda: matmul(a, b, target=target),
    }


def _graph_us(torch, call, per_graph: int = 10, replays: int = 20) -> float:
    """GPU µs of one ``call``: ``per_graph`` calls captured in a CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch's docs say
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (per_graph * replays)


def _eager_us(call, calls: int, batches: int, synchronize) -> float:
    """µs per call of ``calls`` back-to-back calls, the final synchronisation included."""
    samples = []
    for _ in range(batches):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def run_library(torch, batches: int, kinds: tuple = ("native",)) -> list[dict]:
    """Host, eager and GPU µs per steady-state call of each library entry point with the
    first launcher of ``kinds``, and host and eager µs with the others (``<kind>_us``,
    ``<kind>_eager_us``). The launchers take turns on each entry point, in the order
    ``kinds`` then reversed, each keeping its better time, after a garbage collection: the
    garbage of the compiles, and whatever ran just before, then weigh on no launcher alone."""
    rows = []
    sync = torch.cuda.synchronize
    first = kinds[0]
    for name, call in library_calls(torch, "cuda").items():
        row: dict = {"path": f"kiln {name}"}
        try:
            use_launcher(first)
            call()  # plans, compiles and (matmul) tunes
            for kind in kinds + kinds[::-1]:
                use_launcher(kind)
                call()  # binds with this launcher
                gc.collect()
                prefix = "" if kind == first else f"{kind}_"
                for key, us in ((f"{prefix}us", _per_launch_us(call, LIBRARY_CALLS, batches,
                                                               sync)),
                                (f"{prefix}eager_us", _eager_us(call, LIBRARY_CALLS, batches,
                                                                sync))):
                    row[key] = min(row.get(key, us), us)
            use_launcher(first)
            row["gpu_us"] = _graph_us(torch, call)
            print(f"  measured {row}", file=sys.stderr, flush=True)  # partial results on a timeout
        except Exception as error:  # a path that fails is reported, not fatal to the run
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
    return rows


def use_launcher(kind: str) -> None:
    """Launch through ``kind`` (``KILN_LAUNCHER``) from now on: every compiled kernel's plan,
    every library plan and every cached ``kernel[grid]`` launch is dropped, so the next call
    builds its launcher anew."""
    import os

    from kiln.kernel import JITKernel
    from kiln.kernels import runtime
    from kiln.lowering.compiler import CompiledKernel

    os.environ["KILN_LAUNCHER"] = kind
    runtime.clear_plans()
    for obj in gc.get_objects():
        kind_of = type(obj)  # not isinstance: it would read lazy attributes of torch's modules
        if kind_of is CompiledKernel and "_launch_plan" in vars(obj):
            del obj._launch_plan
        elif kind_of is JITKernel:
            obj._launches.clear()
            obj._last_launch = None


def _launch_paths(torch, y, launches: int, batches: int, kind: str) -> dict:
    """µs per launch of add_one's Kiln paths with launcher ``kind``."""
    from kiln.runtime.launch import bind_launch

    use_launcher(kind)
    sync = torch.cuda.synchronize
    compiled = add_one.compile(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a")
    launcher = add_one[(1,)]
    times = {"kernel_grid": _per_launch_us(
        lambda: launcher(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a"), launches,
        batches, sync)}
    times["compiled_launch"] = _per_launch_us(lambda: compiled.launch((1, 1, 1), [y, N]),
                                              launches, batches, sync)
    bound = bind_launch(compiled, (1, 1, 1), [y, N])
    pointer = y.data_ptr()
    times["bound"] = _per_launch_us(lambda: bound(pointer), launches, batches, sync)
    plan = compiled._launch_plan
    arguments = plan.launcher.new_arguments()
    plan.launcher.pack(arguments, [pointer, pointer, 0, N, 1, N], (1, 1, 1),
                       torch.cuda.current_stream().cuda_stream)
    times["packed"] = _per_launch_us(lambda: plan.launcher.launch_packed(arguments), launches,
                                     batches, sync)
    times["launcher"] = type(plan.launcher).__name__ + (
        "" if getattr(plan.launcher, "shim", 1) is not None else " (ctypes)")
    print(f"  measured {kind}: {times}", file=sys.stderr, flush=True)
    return times


def run(launches: int, batches: int, compare: bool = True) -> dict:
    from kiln.runtime.cuda import cuda_available

    if not cuda_available():
        return {"skipped": "no CUDA GPU/driver available"}
    import numpy as np

    results: dict = {"launches_per_batch": launches, "batches": batches, "goal_us": GOAL_US}

    y_host = np.zeros(N, np.float32)
    add_one[(1,)](y_host, N, BLOCK=N, num_warps=N // 32, target="sm_90a")
    results["numpy_correct"] = bool((y_host == 1.0).all())
    compiled = add_one.compile(y_host, N, BLOCK=N, num_warps=N // 32, target="sm_90a")

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        y = torch.zeros(N, device="cuda")
        sync = torch.cuda.synchronize
        kinds = ("mlir", "ctypes", "native") if compare else ("native",)
        launchers: dict = {}
        for kind in kinds + kinds[::-1]:  # each twice, in turns: the better time of the two
            times = _launch_paths(torch, y, launches, batches, kind)
            launchers[kind] = {key: min(value, launchers.get(kind, times)[key])
                               if isinstance(value, float) else value
                               for key, value in times.items()}
        results["launchers"] = launchers
        native = results["launchers"]["native"]
        results["kiln_launch_torch_us"] = native["kernel_grid"]
        results["kiln_compiled_launch_us"] = native["compiled_launch"]
        results["kiln_bound_launch_us"] = native["bound"]
        results["kiln_raw_launcher_us"] = native["packed"]
        try:
            raw = _raw_cu_launch(compiled, y)
        except (OSError, AttributeError) as error:
            results["raw_cu_launch_us"] = None
            results["raw_cu_launch_skipped"] = f"libcuda not usable: {error}"
        else:
            results["raw_cu_launch_us"] = _per_launch_us(raw, launches, batches, sync)
        sync()
        results["torch_result_ok"] = bool((y > 0).all().item())
        try:
            issue = _triton_issue(torch, y)
        except ImportError:
            results["triton_launch_us"] = None
        else:
            results["triton_launch_us"] = _per_launch_us(issue, launches, batches, sync)
        results["library"] = run_library(torch, batches, ("native", "mlir") if compare
                                         else ("native",))
        use_launcher("native")
        results["ratios"] = _ratios(results)
    else:
        results["kiln_launch_torch_us"] = None
        results["triton_launch_us"] = None
    return results


def _ratios(results: dict) -> dict:
    """kernel[grid] against the floors and peers, the native launcher against the MLIR one,
    and each library entry point's eager back-to-back time against its CUDA-graph time."""
    def ratio(a, b):
        return None if a is None or not b else round(a / b, 3)

    launchers = results.get("launchers", {})
    kiln_us = results.get("kiln_launch_torch_us")
    ratios = {"kernel_grid / raw cuLaunchKernel": ratio(kiln_us, results.get("raw_cu_launch_us")),
              "kernel_grid / triton": ratio(kiln_us, results.get("triton_launch_us"))}
    if "mlir" in launchers:
        for path in ("kernel_grid", "bound", "packed"):
            ratios[f"{path} native / mlir"] = ratio(launchers["native"][path],
                                                    launchers["mlir"][path])
    for row in results.get("library", []):
        ratios[f"{row['path']} eager / graph"] = ratio(row.get("eager_us"), row.get("gpu_us"))
        if "mlir_us" in row:
            ratios[f"{row['path']} host native / mlir"] = ratio(row.get("us"), row["mlir_us"])
    return ratios


def _rows(results: dict) -> list[dict]:
    """One row per launch path: its name and µs per launch (None where it did not run)."""
    paths = (("kiln kernel[grid](torch)", "kiln_launch_torch_us"),
             ("kiln CompiledKernel.launch", "kiln_compiled_launch_us"),
             ("kiln bound launch", "kiln_bound_launch_us"),
             ("kiln packed launch (native shim)", "kiln_raw_launcher_us"),
             ("raw cuLaunchKernel (ctypes)", "raw_cu_launch_us"),
             ("triton launch", "triton_launch_us"))
    launchers = [{"path": f"kiln {path} [{kind}: {times['launcher']}]", "us": times[path]}
                 for kind, times in results.get("launchers", {}).items()
                 for path in ("kernel_grid", "bound", "packed")]
    return [{"path": name, "us": results.get(key)} for name, key in paths] + launchers + \
        results.get("library", []) + [
            {"path": f"{row['path']} [mlir launcher]", "us": row["mlir_us"],
             "eager_us": row.get("mlir_eager_us")}
            for row in results.get("library", []) if "mlir_us" in row]


def _print_table(results: dict) -> None:
    if "skipped" in results:
        print(f"launch overhead: skipped ({results['skipped']})")
        return
    columns = (("us", "host µs"), ("eager_us", "eager µs"), ("gpu_us", "GPU µs (graph)"))
    print(f"{'path':<56}" + "".join(f"{title:>16}" for _, title in columns))
    for row in _rows(results):
        cells = "".join(f"{row[key]:>16.2f}" if row.get(key) is not None else f"{'':>16}"
                        for key, _ in columns)
        print(f"{row['path']:<56}{cells}" + (f"  {row['error']}" if "error" in row else ""))
    for name, value in results.get("ratios", {}).items():
        if value is not None:
            print(f"ratio {name:<64}{value:>8.2f}")
    if results.get("raw_cu_launch_skipped"):
        print(f"raw cuLaunchKernel skipped: {results['raw_cu_launch_skipped']}")
    kiln_us = results.get("kiln_launch_torch_us")
    if kiln_us is not None:
        verdict = "meets" if kiln_us <= GOAL_US else "misses"
        print(f"kernel[grid] goal <= {GOAL_US:.0f} µs: {verdict}")
    library = [row for row in results.get("library", []) if row.get("us") is not None]
    if library:
        verdict = "meets" if max(row["us"] for row in library) <= LIBRARY_GOAL_US else "misses"
        print(f"library goal <= {LIBRARY_GOAL_US:.0f} µs a call: {verdict} (" + ", ".join(
            f"{row['path'][5:].split(' (')[0]} {row['us']:.1f}"
            f"{'' if row['us'] <= LIBRARY_GOAL_US else ' over'}" for row in library) + ")")


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
    (up to the bound launch), or why it could not run."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    from kiln.kernels import runtime
    from kiln.kernels.gemm import HOPPER_CONFIGS, hopper_autotuner

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
        print("library entry points, torch CPU tensors, DryRuntime (up to the bound launch):")
        for row in library:
            print(f"{row['path']:<56}{row['us']:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000, help="launches per timed batch")
    parser.add_argument("--batches", type=int, default=15, help="timed batches (median taken)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--no-compare", action="store_true",
                        help="only the default launcher (skip the ctypes and mlir rows)")
    parser.add_argument("--host-only", action="store_true",
                        help="no GPU: time the host work up to the driver call on the CPU")
    args = parser.parse_args(argv)
    if args.host_only:
        results = run_host_only(args.launches, args.batches)
        results["library"] = run_library_host_only(args.launches, args.batches)
        _print_host_table(results)
    else:
        results = run(args.launches, args.batches, compare=not args.no_compare)
        _print_table(results)
    if args.json:
        if args.host_only:
            rows = [{"kernel": label, **row} for label, row in results.items()
                    if isinstance(row, dict)]
            if isinstance(results["library"], list):
                rows += [{"kernel": row["path"], "entry_point_us": row["us"]}
                         for row in results["library"]]
            write_results(args.json, "launch_overhead-host", rows, results=results,
                          device="host CPU (driver call a no-op)", driver=None)
        else:
            write_results(args.json, "launch_overhead", [] if "skipped" in results else
                          _rows(results), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
