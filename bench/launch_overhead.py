"""Host-side launch overhead of a cached Kiln kernel, next to Triton's when Triton is installed.

A tiny kernel (``y[i] += 1`` on 128 elements, one block) is launched many times back to back;
the wall-clock time per launch after warm-up is the host overhead (the GPU finishes each launch
faster than the host issues the next). Reported: median over batches, in microseconds, for

- ``kiln kernel[grid](...)``: the user-facing launch of a ``@kiln.kernel`` with torch CUDA
  tensors (specialisation lookup + argument conversion + launch);
- ``kiln CompiledKernel.launch``: the same, starting from the compiled kernel;
- ``kiln raw launcher``: the JIT-compiled ``kiln_launch`` called with ready-made C arguments
  (the floor: ctypes call + ``mgpuLaunchKernel``);
- ``triton launch``: an equivalent ``@triton.jit`` kernel.

Usage::

    python bench/launch_overhead.py --launches 2000 --batches 15 --json overhead.json

Goal: <= 20 µs per Kiln launch with torch tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import kiln
from kiln import f32, i32

GOAL_US = 20.0
N = 128


@kiln.kernel
def add_one(y: kiln.Tensor[f32], n: i32, BLOCK: kiln.constexpr):
    i = kiln.thread_id(0)
    if i < n:
        y[i] = y[i] + 1.0


def _per_launch_us(issue, launches: int, batches: int, synchronize) -> float:
    for _ in range(max(launches // 10, 50)):  # warm-up: JIT, caches, clocks
        issue()
    synchronize()
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(launches):
            issue()
        samples.append((time.perf_counter() - start) / launches * 1e6)
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


def run(launches: int, batches: int) -> dict:
    from kiln.lowering.cuda import cuda_available

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
        launcher = add_one[(1,)]
        results["kiln_launch_torch_us"] = _per_launch_us(
            lambda: launcher(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a"),
            launches, batches, sync)
        results["kiln_compiled_launch_us"] = _per_launch_us(
            lambda: compiled.launch((1, 1, 1), [y, N]), launches, batches, sync)
        plan = compiled._launch_plan
        flat = [y.data_ptr(), y.data_ptr(), 0, N, 1, N]
        results["kiln_raw_launcher_us"] = _per_launch_us(
            lambda: plan.launcher(flat, (1, 1, 1), None), launches, batches, sync)
        sync()
        results["torch_result_ok"] = bool((y > 0).all().item())
        try:
            issue = _triton_issue(torch, y)
        except ImportError:
            results["triton_launch_us"] = None
        else:
            results["triton_launch_us"] = _per_launch_us(issue, launches, batches, sync)
    else:
        results["kiln_launch_torch_us"] = None
        results["triton_launch_us"] = None
    return results


def _print_table(results: dict) -> None:
    if "skipped" in results:
        print(f"launch overhead: skipped ({results['skipped']})")
        return
    rows = [("kiln kernel[grid](torch)", results.get("kiln_launch_torch_us")),
            ("kiln CompiledKernel.launch", results.get("kiln_compiled_launch_us")),
            ("kiln raw launcher", results.get("kiln_raw_launcher_us")),
            ("triton launch", results.get("triton_launch_us"))]
    print(f"{'path':<28}{'µs / launch (median)':>22}")
    for name, value in rows:
        shown = f"{value:.2f}" if value is not None else "n/a"
        print(f"{name:<28}{shown:>22}")
    kiln_us = results.get("kiln_launch_torch_us")
    if kiln_us is not None:
        verdict = "meets" if kiln_us <= GOAL_US else "misses"
        print(f"goal <= {GOAL_US:.0f} µs: {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000, help="launches per timed batch")
    parser.add_argument("--batches", type=int, default=15, help="timed batches (median taken)")
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    results = run(args.launches, args.batches)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
