"""Where a library entry point's host time goes, on the GPU machine (issue 42).

Two tables, one run, wall-clock µs per call (median of batches, after warm-up):

- ``primitives``: the torch and Kiln operations an entry point's steady state is made of
  (allocating a fresh output, taking views, reading a tensor's attributes, the current
  stream, a packed launch of a one-block kernel), each less the cost of an empty call;
- ``stages``: each entry point of ``bench/launch_overhead.py`` (same shapes) whole (host µs,
  eager back-to-back µs, CUDA-graph replay µs), then the
  stages of its steady state timed alone: the plan look-up, the fresh outputs, the bound
  launch with ready addresses; plus the top functions of a cProfile of 2000 calls (own time).

Prints JSON with ``--json FILE``. Usage::

    python bench/host_breakdown.py --json /tmp/breakdown.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import json
import pstats
import statistics
import sys
import time

CALLS = 2000


def per_call_us(call, calls: int = CALLS, batches: int = 7, synchronize=None) -> float:
    """Median µs per ``call()`` over ``batches`` batches of ``calls`` (warmed up)."""
    for _ in range(200):
        call()
    samples = []
    for _ in range(batches):
        if synchronize is not None:
            synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    if synchronize is not None:
        synchronize()
    return round(statistics.median(samples), 3)


def primitives(torch) -> dict:
    """µs of each primitive less an empty lambda's."""
    x = torch.empty(1 << 20, device="cuda")
    o = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    template = x.new_empty((), dtype=torch.bfloat16).expand(1, 1, 32, 128)
    contiguous_format = torch.contiguous_format
    raw, device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    shape = o.shape
    words = x.new_empty(8192)
    ops = {
        "empty lambda": lambda: None,
        "torch.empty(shape, dtype, device)": lambda: torch.empty(
            (1, 1, 32, 128), dtype=torch.bfloat16, device="cuda"),
        "x.new_empty(shape, dtype)": lambda: x.new_empty((1, 1, 32, 128), dtype=torch.bfloat16),
        "x.new_empty(n)": lambda: x.new_empty(8192),
        "empty_like(expanded, memory_format)": lambda: torch.empty_like(
            template, memory_format=contiguous_format),
        "empty_like(contiguous)": lambda: torch.empty_like(o),
        "words.as_strided(shape, strides, off)": lambda: words.as_strided(
            (4, 32, 32), (1024, 32, 1), 16),
        "words[a:b]": lambda: words[16:4112],
        "words.view(shape)": lambda: words.view(8, 1024),
        "words.split_with_sizes(3)": lambda: words.split_with_sizes([4096, 2048, 2048]),
        "words.view(int32)": lambda: words.view(torch.int32),
        "o.data_ptr()": o.data_ptr,
        "o.shape": lambda: o.shape,
        "o.shape == S": lambda: o.shape == shape,
        "o.dtype": lambda: o.dtype,
        "o.stride()": o.stride,
        "o.is_contiguous()": o.is_contiguous,
        "o.get_device()": o.get_device,
        "o.device": lambda: o.device,
        "raw current stream": lambda: raw(device()),
        "raw current stream of device -1": lambda: raw(-1),
        "partial(raw, -1)": functools.partial(raw, -1),
        "torch.empty(n, dtype, device object)": lambda: torch.empty(
            8192, dtype=torch.float32, device=x.device),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch._C._cuda_isCurrentStreamCapturing()": getattr(
            torch._C, "_cuda_isCurrentStreamCapturing", None),
    }
    base = per_call_us(ops.pop("empty lambda"), 5000, 5)
    results = {}
    for name, op in ops.items():
        try:
            results[name] = round(per_call_us(op, 5000, 5) - base, 3)
        except Exception as error:  # an op this torch lacks
            results[name] = f"{type(error).__name__}: {error}"
    try:
        side = torch.cuda.Stream()
        same = [raw(-1) == raw(device())]
        with torch.cuda.stream(side):
            same.append(raw(-1) == raw(device()) == side.cuda_stream)
        results["raw(-1) is the current stream (default, side)"] = same
    except Exception as error:
        results["raw(-1) is the current stream (default, side)"] = repr(error)
    return results


def stages(torch, target: str = "sm_90a") -> dict:
    """Each entry point whole and its steady-state stages alone (µs), and its cProfile."""
    sys.path.insert(0, "bench")
    from launch_overhead import _eager_us, _graph_us, library_calls

    from kiln.kernels import gemm

    combine_module, decode_plan, prefill_module = (
        importlib.import_module(f"kiln.kernels.attention.{name}")
        for name in ("combine", "decode_plan", "prefill"))

    key = gemm.hopper_autotuner.key_of((None, None, None, 1024, 1024, 1024, "bf16", "mn",
                                        "bf16", target), {})
    gemm.hopper_autotuner.best[key] = gemm.HOPPER_CONFIGS[0]  # no tuning in a 50 s batch
    calls = library_calls(torch, "cuda", target)
    sync = torch.cuda.synchronize
    out: dict = {}
    for name, call in calls.items():
        try:
            call()
            sync()
            row = {"whole": per_call_us(call, 300, 9, sync),
                   "eager": round(_eager_us(call, 100, 9, sync), 3),
                   "graph": round(_graph_us(torch, call), 3)}
            row.update(_stage_rows(torch, name, call, decode_plan, combine_module,
                                   prefill_module, gemm, sync))
            row["profile"] = _profile(call, sync)
        except Exception as error:  # one entry point failing does not end the run
            row = {"error": f"{type(error).__name__}: {error}"}
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'profile'})}",
              flush=True)
        out[name] = row
    return out


def _stage_rows(torch, name, call, decode_plan, combine_module, prefill_module,
                gemm, sync) -> dict:
    """The stages of one entry point's steady state, each timed alone (µs)."""
    from kiln.kernels.runtime import TorchOutputs

    rows: dict = {}
    timed = lambda f: per_call_us(f, 300, 9, sync)  # noqa: E731
    if name.startswith("decode"):
        q, k_cache, v_cache, table, lens = _closure(call)["paged"]
        plans = decode_plan.PLANS
        plan = plans.last[1]
        values = (q, k_cache, v_cache, table, lens, None, None, None, None, "sm_90a", None,
                  None, None if plan.fused else False)
        rows["plan find (guard)"] = timed(lambda: plans.find(values))
        rows["key_of + dict get"] = timed(lambda: plans.lookup(decode_plan.key_of(values)))
        bound = plan.bound
        stream = bound.current_stream()
        rows["current_stream"] = timed(bound.current_stream)
        inputs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                  lens.data_ptr(), *plan.placeholder_pointers)
        rows["input pointers"] = timed(lambda: (
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
            lens.data_ptr(), *plan.placeholder_pointers))
        if plan.fused:
            rows["outputs (2 fresh)"] = timed(lambda: plan.outputs(like=plan.no_sinks))
            o, lse = plan.outputs(like=plan.no_sinks)
            owners, (p0, p1, p2, tickets) = plan.spaces.get(stream)
            rows["workspace get"] = timed(lambda: plan.spaces.get(stream))
            args = (*inputs, p0, p1, p2, o.data_ptr(), lse.data_ptr(), tickets)
        else:
            rows["partial words (1 alloc)"] = timed(plan.torch_partial_words)
            rows["partials (3 fresh tensors)"] = timed(plan.torch_partials)
            kept = plan.torch_partials()  # alive while the launches below write them
            partials = tuple(t.data_ptr() for t in kept)
            shape = tuple(plan.partial_shape)
            two = TorchOutputs(plan.no_sinks, (shape[1:], torch.bfloat16),
                               (shape[1:4], torch.float32))
            rows["2 fresh tensors (decode_attention's o, lse)"] = timed(two)
            args = (*inputs, *partials, *plan.no_output_pointers)
        _launch_rows(rows, timed, bound, args)
    elif name.startswith("combine"):
        plan = combine_module._PLANS.last[1]
        fresh = plan.fresh_outputs(None)
        rows["outputs (2 fresh)"] = timed(fresh)
        o, lse = fresh()
        given = _closure(call)
        o_p, lse_p, counts = given["o_part"], given["lse_part"], given["counts"]
        _launch_rows(rows, timed, plan.bound, (o_p.data_ptr(), lse_p.data_ptr(),
                                               counts.data_ptr(), o.data_ptr(), lse.data_ptr()))
        rows["plan_combine (guard)"] = timed(lambda: combine_module.plan_combine(
            o_p, lse_p, counts, max_splits=o_p.shape[0], target="sm_90a"))
    elif name.startswith("matmul"):
        plan = gemm._PLANS.last[1]
        rows["output (1 fresh)"] = timed(plan.fresh_c.one)
        c = plan.fresh_c.one()
        _launch_rows(rows, timed, plan.bound, (c.data_ptr(),) * 3)
    elif name.startswith("prefill"):
        plan = prefill_module._PLANS.last[1]
        rows["output (1 fresh)"] = timed(plan.fresh.one)
        dense = _closure(call)["dense"]
        o = plan.fresh.one()
        ptrs = (dense.data_ptr(),) * 3 + (o.data_ptr(), plan.no_lse.data_ptr(),
                                          plan.fixed_sinks.data_ptr(), *plan.cu_pointers)
        _launch_rows(rows, timed, plan.bound, ptrs)
    return rows


def _launch_rows(rows: dict, timed, bound, args: tuple) -> None:
    """The bound launch with ready addresses, and (native shim) its one C call alone."""
    rows["bound launch"] = timed(lambda: bound(*args))
    stream = bound.current_stream()
    rows["launch_on"] = timed(lambda: bound.launch_on(stream, *args))
    native = getattr(bound, "_native", None)
    if native is not None:
        rows["shim call"] = timed(lambda: native(bound._record, stream, *args))


def _closure(call) -> dict:
    """The variables a lambda of ``library_calls`` closes over, by name."""
    return dict(zip(call.__code__.co_freevars, (c.cell_contents for c in call.__closure__)))


def _profile(call, sync, calls: int = CALLS, top: int = 10) -> list:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    sync()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats("tottime")
    rows = []
    for (file, line, function), (cc, nc, tt, ct, _) in list(stats.stats.items()):
        rows.append((round(tt / calls * 1e6, 3), round(ct / calls * 1e6, 3), nc // calls,
                     f"{file.rsplit('/', 2)[-1]}:{line}:{function}"))
    rows.sort(reverse=True)
    return rows[:top]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--only", choices=("primitives", "stages"), help="one table only")
    args = parser.parse_args(argv)
    import torch

    results = {"device": torch.cuda.get_device_name()}
    if args.only != "stages":
        results["primitives"] = primitives(torch)
        for name, us in results["primitives"].items():
            print(f"  {name:<48}{us} µs", flush=True)
    if args.only != "primitives":
        results["stages"] = stages(torch)
        for name, row in results["stages"].items():
            for tt, ct, n, where in row.get("profile", []):
                print(f"  {name[:24]:<24} own {tt:>6.2f} cum {ct:>6.2f} x{n} {where}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
