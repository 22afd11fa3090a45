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
  entry point's eager / graph time (issue 42's goal: within 1.15 for batch-1 decode);
- ``slow (misses, guards, gcs)`` beside a library row: tensor-map descriptor memo misses (a
  launch through Python), guards made (a plan's or ``out=``'s guard failing) and full garbage
  collections during its timed calls.

``--host-only`` needs no GPU: Kiln's per-call host work up to the driver call on the CPU
(``bench/launch_overhead_host.py``).

The torch bridge (:mod:`kiln.runtime.native_torch`) is built (or found in the cache) before
anything is timed, and each library row says whether its plan used it (``bridge``: its
outputs from the bridge's C++ makers, its guard the bridge's C++ tensor check). With
``--bridge-ab`` the library rows are also timed with torch's Python paths (``use_bridge(None)``,
the ``nobridge_`` keys), with ``--joint-ab`` with one allocation per fresh output
(``KILN_JOINT_OUTPUTS=0``, the ``separate_`` keys), in the same turns. ``--library-only``
skips the one-block kernel.

Usage::

    python bench/launch_overhead.py --launches 2000 --batches 15 --json overhead.json
    python bench/launch_overhead.py --host-only
    python bench/launch_overhead.py --launches 300 --batches 5 --no-compare   # quick
    python bench/launch_overhead.py --library-only --no-compare --bridge-ab   # bridge A/B

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
from launch_bridge_report import bridge_counts, bridge_state, load_bridge  # noqa: F401 (tests)
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
                   clock=time.perf_counter, samples: list | None = None) -> float:
    """Median µs per ``issue()`` over ``batches`` batches of ``launches`` (after a warm-up);
    ``samples`` (a list) gets each batch's µs."""
    for _ in range(warm_up_calls(launches)):  # warm-up: JIT, caches, clocks
        issue()
    synchronize()
    samples = [] if samples is None else samples
    for _ in range(batches):
        start = clock()
        for _ in range(launches):
            issue()
        samples.append((clock() - start) / launches * 1e6)
        synchronize()
    return statistics.median(samples[-batches:])


def warm_up_calls(launches: int) -> int:
    return max(launches // 10, 50)


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


def run_library(torch, batches: int, variants: tuple = (("", "native", True, True, True),),
                bridge=None, only: tuple = (), turns: int = 1) -> list[dict]:
    """Host, eager and GPU µs per steady-state call of each library entry point with the
    first of ``variants`` (``(key prefix, launcher kind, torch bridge on, joint outputs on,
    one-call objects on)``), and host and
    eager µs with the others (``<prefix>us``, ``<prefix>eager_us``); ``<prefix>bridge``: what
    each variant's plan used (:func:`bridge_state`), ``<prefix>one_call``: how many of its
    timed calls one C call served (:func:`kiln.kernels.one_call.one_call_hits`). The variants
    take turns on each entry point, in order then reversed (``turns`` times), each keeping its
    better median (``<prefix>us``) and its fastest batch (``<prefix>us_min``), after a garbage
    collection: the garbage of the compiles, and whatever ran just before, then weigh on none
    alone. ``only``: the entry points whose row names start with one of these (all when
    empty)."""
    from kiln.kernels.one_call import one_call_hits

    rows = []
    sync = torch.cuda.synchronize
    first = variants[0]
    timed_calls = warm_up_calls(LIBRARY_CALLS) + 2 * LIBRARY_CALLS * batches
    for name, call in library_calls(torch, "cuda").items():
        if only and not name.startswith(only):
            continue
        row: dict = {"path": f"kiln {name}"}
        try:
            use_variant(first, bridge)
            call()  # plans, compiles and (matmul) tunes
            for variant in (variants + variants[::-1]) * turns:
                prefix = variant[0]
                use_variant(variant, bridge)
                call()  # binds with this launcher and bridge
                call()  # and installs its one-call object
                row[f"{prefix}bridge"] = bridge_state()
                gc.collect()
                before, hits = _slow_paths(), one_call_hits()
                samples: list = []
                for key, us in ((f"{prefix}us", _per_launch_us(call, LIBRARY_CALLS, batches,
                                                               sync, samples=samples)),
                                (f"{prefix}eager_us", _eager_us(call, LIBRARY_CALLS, batches,
                                                                sync))):
                    row[key] = min(row.get(key, us), us)
                row[f"{prefix}us_min"] = min(row.get(f"{prefix}us_min", samples[0]), *samples)
                row[f"{prefix}slow"] = tuple(a - b for a, b in zip(_slow_paths(), before))
                row[f"{prefix}one_call"] = f"{one_call_hits() - hits}/{timed_calls}"
            use_variant(first, bridge)
            row["gpu_us"] = _graph_us(torch, call)
            print(f"  measured {row}", file=sys.stderr, flush=True)  # partial results on a timeout
        except Exception as error:  # a path that fails is reported, not fatal to the run
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
    use_variant(first, bridge)
    return rows


_SLOW = [0, 0]  # descriptor memo misses of bound launches, guards made (Python slow paths)


def _slow_paths() -> tuple:
    """(descriptor memo misses, plan or output guards made, full garbage collections) so far:
    what a row's timed calls may have paid beyond the steady state (``<prefix>slow``: the
    counts during its timing)."""
    from kiln.kernels import runtime
    from kiln.runtime.launch import BoundLaunch

    for owner, name, index in ((BoundLaunch, "_launch_missed", 0), (runtime, "guard_of", 1)):
        function = getattr(owner, name)
        if not getattr(function, "counted", False):
            setattr(owner, name, _counting(function, index))
    return _SLOW[0], _SLOW[1], gc.get_stats()[2]["collections"]


def _counting(function, index: int):
    def counted(*args):
        _SLOW[index] += 1
        return function(*args)

    counted.counted = True
    return counted


def use_variant(variant: tuple, bridge) -> None:
    """Calls from now on through ``variant``'s launcher, with ``bridge`` (the loaded torch
    bridge) where the variant turns it on, else torch's Python paths, a call's fresh
    outputs in one allocation where it turns that on (``KILN_JOINT_OUTPUTS``), and one C call
    a repeat call where it turns that on (:mod:`kiln.kernels.one_call`); plans dropped."""
    import os

    from kiln.kernels.one_call import use_one_call
    from kiln.runtime.native_torch import use_bridge

    use_bridge(bridge if variant[2] else None)
    use_one_call(variant[4] if len(variant) > 4 else True)
    os.environ["KILN_JOINT_OUTPUTS"] = "1" if variant[3] else "0"
    use_launcher(variant[1])


_LAUNCHER = [None]  # the kind use_launcher set last


def use_launcher(kind: str) -> None:
    """Launch through ``kind`` (``KILN_LAUNCHER``) from now on: every compiled kernel's plan,
    every library plan and every cached ``kernel[grid]`` launch is dropped, so the next call
    builds its launcher anew."""
    import os

    from kiln.kernel import JITKernel
    from kiln.kernels import runtime
    from kiln.lowering.compiler import CompiledKernel

    runtime.clear_plans()
    if _LAUNCHER[0] == kind:  # the launchers made are of this kind already
        return
    _LAUNCHER[0] = os.environ["KILN_LAUNCHER"] = kind
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


def run(launches: int, batches: int, compare: bool = True, bridge_ab: bool = False,
        library_only: bool = False, joint_ab: bool = False, only: tuple = (),
        one_call_ab: bool = False, turns: int = 1) -> dict:
    """The whole run (see the module docs); ``compare``: the ctypes and mlir launchers too;
    ``bridge_ab``: the library rows with torch's Python paths too; ``joint_ab``: and with
    one allocation a fresh output; ``one_call_ab``: and with each entry point's Python path
    instead of its one C call; ``library_only``: no one-block kernel rows; ``only``: the
    library rows to time (name prefixes); ``turns``: rounds of the variants' turns."""
    from kiln.runtime.cuda import cuda_available

    if not cuda_available():
        return {"skipped": "no CUDA GPU/driver available"}
    results: dict = {"launches_per_batch": launches, "batches": batches, "goal_us": GOAL_US}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        results["kiln_launch_torch_us"] = None
        results["triton_launch_us"] = None
        return results
    bridge, results["torch_bridge"] = load_bridge()  # before any plan or launcher is made
    if not library_only:
        _kernel_rows(torch, launches, batches, compare, results)
    variants = (("", "native", True, True, True),) + \
        ((("pycall_", "native", True, True, False),) if one_call_ab else ()) + \
        ((("mlir_", "mlir", True, True, True),) if compare else ()) + \
        ((("nobridge_", "native", False, True, True),) if bridge_ab and bridge is not None
         else ()) + \
        ((("separate_", "native", True, False, True),) if joint_ab and bridge is not None
         else ())
    results["library"] = run_library(torch, batches, variants, bridge, only, turns)
    use_launcher("native")
    results["ratios"] = _ratios(results)
    return results


def _kernel_rows(torch, launches: int, batches: int, compare: bool, results: dict) -> None:
    """The one-block kernel's rows: Kiln's paths per launcher, raw cuLaunchKernel, Triton."""
    import numpy as np

    y_host = np.zeros(N, np.float32)
    add_one[(1,)](y_host, N, BLOCK=N, num_warps=N // 32, target="sm_90a")
    results["numpy_correct"] = bool((y_host == 1.0).all())
    compiled = add_one.compile(y_host, N, BLOCK=N, num_warps=N // 32, target="sm_90a")
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
        if "nobridge_us" in row:
            ratios[f"{row['path']} host bridge / no bridge"] = ratio(row.get("us"),
                                                                    row["nobridge_us"])
        if "separate_us" in row:
            ratios[f"{row['path']} host joint / separate outputs"] = ratio(
                row.get("us"), row["separate_us"])
        if "pycall_us" in row:
            ratios[f"{row['path']} host one call / Python path"] = ratio(row.get("us"),
                                                                       row["pycall_us"])
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
            {"path": f"{row['path']} [{label}]", "us": row[f"{prefix}us"],
             "us_min": row.get(f"{prefix}us_min"), "eager_us": row.get(f"{prefix}eager_us"),
             "bridge": row.get(f"{prefix}bridge"), "slow": row.get(f"{prefix}slow"),
             "one_call": row.get(f"{prefix}one_call")}
            for prefix, label in (("pycall_", "Python path"), ("mlir_", "mlir launcher"),
                                  ("nobridge_", "no torch bridge"),
                                  ("separate_", "an allocation an output"))
            for row in results.get("library", []) if f"{prefix}us" in row]


def _print_table(results: dict) -> None:
    if "skipped" in results:
        print(f"launch overhead: skipped ({results['skipped']})")
        return
    columns = (("us", "host µs"), ("us_min", "min µs"), ("eager_us", "eager µs"),
               ("gpu_us", "GPU µs (graph)"))
    print(f"{'path':<56}" + "".join(f"{title:>16}" for _, title in columns))
    for row in _rows(results):
        if all(row.get(key) is None for key, _ in columns) and "error" not in row:
            continue  # a path this run did not time (--library-only)
        cells = "".join(f"{row[key]:>16.2f}" if row.get(key) is not None else f"{'':>16}"
                        for key, _ in columns)
        print(f"{row['path']:<56}{cells}" + (f"  {row['error']}" if "error" in row else "") +
              (f"  one call {row['one_call']}" if row.get("one_call") else "") +
              (f"  slow {row['slow']}" if row.get("slow") else "") +
              (f"  bridge {row['bridge']}" if row.get("bridge") else ""))
    if "torch_bridge" in results:
        print(f"torch bridge: {results['torch_bridge']}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000, help="launches per timed batch")
    parser.add_argument("--batches", type=int, default=15, help="timed batches (median taken)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--no-compare", action="store_true",
                        help="only the default launcher (skip the ctypes and mlir rows)")
    parser.add_argument("--bridge-ab", action="store_true",
                        help="library rows also with torch's Python paths (no torch bridge)")
    parser.add_argument("--joint-ab", action="store_true",
                        help="library rows also with an allocation per fresh output")
    parser.add_argument("--one-call-ab", action="store_true",
                        help="library rows also through the Python paths (no one C call)")
    parser.add_argument("--turns", type=int, default=1,
                        help="rounds of the variants' turns on each library row")
    parser.add_argument("--only", default="",
                        help="comma-separated entry points to time (e.g. decode,combine)")
    parser.add_argument("--library-only", action="store_true",
                        help="only the library entry points (no one-block kernel rows)")
    parser.add_argument("--host-only", action="store_true",
                        help="no GPU: time the host work up to the driver call on the CPU")
    args = parser.parse_args(argv)
    if args.host_only:
        from launch_overhead_host import main_host

        return main_host(args.launches, args.batches, args.json)
    results = run(args.launches, args.batches, compare=not args.no_compare,
                  bridge_ab=args.bridge_ab, library_only=args.library_only,
                  joint_ab=args.joint_ab, one_call_ab=args.one_call_ab, turns=args.turns,
                  only=tuple(name + " " for name in args.only.split(",") if name))
    _print_table(results)
    if args.json:
        write_results(args.json, "launch_overhead", [] if "skipped" in results else
                      _rows(results), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
