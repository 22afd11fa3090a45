"""Where a library call's host time goes, and what the torch bridge saves, in one run (H200).

The torch bridge (:mod:`kiln.runtime.native_torch`) makes fresh outputs with ATen from C++,
checks plan guards' tensors in C++ and lets the launch shim read tensors' C++ metadata. This
bench times, in one process:

- the bridge's first build (the cache is fresh on the GPU machine) and whether it loads;
- one fresh CUDA tensor, made and released, each way: ``torch.empty(shape, dtype=, device=)``,
  ``torch.empty_strided``, ``like.new_empty(shape)``, ``torch.empty_like`` of an expanded
  template (the library's maker without the bridge), the bridge's maker; and inside C++ alone
  (``alloc_cost``: the allocator alone, a bare ATen tensor, then with torch's Python wrapper,
  each with its release);
- decode's plan guard (13 values, 5 tensors) through torch's ``TensorGuards`` and the bridge;
- ``kernel[grid](...)`` of a one-block kernel in each configuration (below), beside the
  bound launch, the launch of a ready argument block, a raw ctypes ``cuLaunchKernel`` and
  Triton;
- each library entry point of ``bench/launch_overhead.py`` in each configuration of
  :data:`CONFIGS` (torch's Python paths, the bridge; turns A B B A, each keeping its better
  time):
  host µs per call, eager back-to-back µs, CUDA-graph replay µs; the outputs of every
  configuration equal those of the first.

Usage: ``python bench/host_alloc.py [--json out.json] [--only entry,launch,guard,alloc]``.
Prints one JSON line per measurement as it goes (a run cut short keeps what it printed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time

from launch_overhead import (LIBRARY_CALLS, N, _eager_us, _graph_us, _per_launch_us,
                             _raw_cu_launch, _triton_issue, add_one, library_calls,
                             use_launcher)

TARGET = "sm_90a"
DEVICE = "cuda"


def emit(results: dict, key: str, value) -> None:
    results[key] = value
    print(json.dumps({key: value}), flush=True)


def timed(call, calls: int = 2000, batches: int = 9, sync=None) -> float:
    """Median µs per call of ``calls`` back-to-back calls (each result dropped at once)."""
    for _ in range(calls // 4):
        call()
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        if sync is not None:
            sync()
    return round(sorted(samples)[len(samples) // 2], 3)


def build_bridge(results: dict):
    from kiln.runtime.native_torch import torch_bridge

    start = time.perf_counter()
    bridge = torch_bridge()
    emit(results, "bridge_build_s", round(time.perf_counter() - start, 3))
    emit(results, "bridge", None if bridge is None else "loaded")
    return bridge


def _loaded_bridge():
    from kiln.runtime.native_torch import torch_bridge

    return torch_bridge()


def allocations(torch, bridge, results: dict) -> None:
    like = torch.empty(8, device=DEVICE)
    shapes = {"o_partial f32 [8,1,1,32,128]": ((8, 1, 1, 32, 128), torch.float32),
              "o bf16 [1,1,32,128]": ((1, 1, 32, 128), torch.bfloat16)}
    for label, (shape, dtype) in shapes.items():
        template = like.new_empty((), dtype=dtype)
        strides = torch.empty(shape, dtype=dtype, device=DEVICE).stride()
        rows = {
            "torch.empty": lambda: torch.empty(shape, dtype=dtype, device=DEVICE),
            "torch.empty_strided": lambda: torch.empty_strided(shape, strides, dtype=dtype,
                                                               device=DEVICE),
            "new_empty": lambda: template.new_empty(shape),
            "empty_like(expanded)": functools.partial(torch.empty_like,
                                                      template.expand(shape)),
        }
        if bridge is not None:
            rows["bridge maker"] = bridge.empty_maker(template, shape, rows["new_empty"])
        emit(results, f"alloc {label}", {name: timed(call) for name, call in rows.items()})
        if bridge is not None:
            costs = bridge.alloc_cost(rows["bridge maker"], 20000)
            emit(results, f"alloc {label} in C++ us (allocator alone, tensor, wrapped)",
                 tuple(round(ns / 1e3, 3) for ns in costs))


def guards(torch, bridge, results: dict) -> None:
    from kiln.kernels import runtime
    from kiln.kernels.plan_guard import make_guard, torch_tensor_check
    from kiln.runtime.native import native_module

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    kv = torch.randn(256, 64, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    table = torch.zeros(1, 256, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    # decode's guard values: 5 tensors, 8 options
    values = (q, kv, kv.clone(), table, lens, None, None, None, None, TARGET, None, None, False)
    shim = native_module()
    rows = {"TensorGuards": make_guard(values, shim.guard_values, torch_tensor_check)}
    if bridge is not None:
        rows["bridge"] = make_guard(values, shim.guard_values, bridge.tensor_guard)
    rows["runtime.guard_of (default)"] = runtime.guard_of(values)
    emit(results, "decode guard us", {name: timed(lambda g=g: g(values))
                                      for name, g in rows.items()})
    emit(results, "decode guard passes", {name: g(values) for name, g in rows.items()})


def kernel_grid(torch, bridge, results: dict) -> None:
    from kiln.runtime.launch import bind_launch
    from kiln.runtime.native import native_module

    sync = torch.cuda.synchronize
    y = torch.zeros(N, device=DEVICE)
    compiled = add_one.compile(y, N, BLOCK=N, num_warps=N // 32, target=TARGET)
    launcher = add_one[(1,)]
    row: dict = {}
    names = list(CONFIGS) if bridge is not None else ["python"]
    for turn in names + names[::-1]:
        use_config(bridge, turn)
        launcher(y, N, BLOCK=N, num_warps=N // 32, target=TARGET)
        launcher(y, N, BLOCK=N, num_warps=N // 32, target=TARGET)
        us = _per_launch_us(lambda: launcher(y, N, BLOCK=N, num_warps=N // 32, target=TARGET),
                            2000, 15, sync)
        key = f"kernel[grid] ({turn} reads)"
        row[key] = round(min(row.get(key, us), us), 3)
        fresh = _per_launch_us(lambda: add_one[(1,)](y, N, BLOCK=N, num_warps=N // 32,
                                                     target=TARGET), 2000, 15, sync)
        key = f"add_one[(1,)](...) ({turn} reads)"
        row[key] = round(min(row.get(key, fresh), fresh), 3)
    use_config(bridge, "bridge")
    bound = bind_launch(compiled, (1, 1, 1), [y, N])
    pointer = y.data_ptr()
    row["bound"] = round(_per_launch_us(lambda: bound(pointer), 2000, 15, sync), 3)
    plan = compiled._launch_plan
    arguments = plan.launcher.new_arguments()
    plan.launcher.pack(arguments, [pointer, pointer, 0, N, 1, N], (1, 1, 1),
                       torch.cuda.current_stream().cuda_stream)
    row["launch_packed (ready block)"] = round(_per_launch_us(
        lambda: plan.launcher.launch_packed(arguments), 2000, 15, sync), 3)
    row["shim launch record"] = round(_per_launch_us(
        functools.partial(native_module().launch, arguments.address), 2000, 15, sync), 3)
    for name, make in (("raw ctypes cuLaunchKernel", lambda: _raw_cu_launch(compiled, y)),
                       ("triton", lambda: _triton_issue(torch, y))):
        try:
            row[name] = round(_per_launch_us(make(), 2000, 15, sync), 3)
        except Exception as error:  # a peer that cannot run is reported
            row[name] = f"{type(error).__name__}: {error}"
    emit(results, "launch us", row)


# Whether the torch bridge is used, in each configuration the entry points are timed with.
CONFIGS = {"python": False, "bridge": True}


def use_config(bridge, name: str) -> None:
    """Calls from now on with configuration ``name`` of :data:`CONFIGS` (plans and launchers
    dropped, so the next call makes them anew)."""
    from kiln.runtime.native_torch import use_bridge

    use_bridge(bridge if CONFIGS[name] else None)
    use_launcher("native")


def entry_points(torch, bridge, results: dict) -> None:
    sync = torch.cuda.synchronize
    names = list(CONFIGS) if bridge is not None else ["python"]
    for name, call in library_calls(torch, DEVICE, TARGET).items():
        row: dict = {}
        try:
            outputs = {}
            for config in names + names[::-1]:  # turns: A B B A
                use_config(bridge, config)
                outputs[config] = call()
                gc.collect()
                for key, us in ((f"host {config}", _per_launch_us(call, LIBRARY_CALLS, 11, sync)),
                                (f"eager {config}", _eager_us(call, LIBRARY_CALLS, 11, sync))):
                    row[key] = round(min(row.get(key, us), us), 3)
            best = names[1] if len(names) > 1 else names[0]  # the default: the bridge
            use_config(bridge, best)
            row["gpu_us (graph)"] = round(_graph_us(torch, call), 3)
            for config in names:
                row[f"eager/graph {config}"] = round(row[f"eager {config}"] /
                                                     row["gpu_us (graph)"], 3)
            row["same outputs"] = all(_same(torch, outputs["python"], out)
                                      for out in outputs.values())
        except Exception as error:  # a path that fails is reported, not fatal to the run
            row["error"] = f"{type(error).__name__}: {error}"
        emit(results, f"entry {name}", row)
    use_config(bridge, "bridge")


def _same(torch, a, b) -> bool:
    """Whether two calls' outputs are equal (decode's partials through combine: the slots
    past a row's count are never written)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    if len(a) == 3:
        from kiln.kernels.attention import combine

        a, b = (combine(*x, max_splits=x[0].shape[0], target=TARGET) for x in (a, b))
    torch.cuda.synchronize()
    return all(x.shape == y.shape and x.dtype == y.dtype and
               bool(torch.equal(x.nan_to_num(), y.nan_to_num())) for x, y in zip(a, b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", default="build,alloc,guard,launch,entry",
                        help="comma-separated parts")
    parser.add_argument("--precompile", metavar="ENTRY",
                        help="only call this entry point once (fills the compile cache)")
    parser.add_argument("--cpu", action="store_true",
                        help="torch CPU tensors, alloc and guard parts only (a check of the "
                             "script without a GPU)")
    args = parser.parse_args(argv)
    import torch

    global DEVICE
    if args.cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA GPU"}))
        return 0
    if args.precompile:
        start = time.perf_counter()
        for name, call in library_calls(torch, DEVICE, TARGET).items():
            if name.startswith(args.precompile + " "):
                call()
        torch.cuda.synchronize()
        print(json.dumps({f"precompiled {args.precompile} s": time.perf_counter() - start}))
        return 0
    results: dict = {"torch": torch.__version__}
    parts = args.only.split(",")
    bridge = build_bridge(results) if "build" in parts else _loaded_bridge()
    for part, run in (("entry", entry_points), ("launch", kernel_grid), ("guard", guards),
                      ("alloc", allocations)):
        if part in parts:
            try:
                run(torch, bridge, results)
            except Exception as error:  # the other parts still run
                emit(results, f"{part} error", f"{type(error).__name__}: {error}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
