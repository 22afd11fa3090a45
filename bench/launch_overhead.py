"""Host-side launch overhead of a cached Kiln kernel, next to Triton's when Triton is installed.

A tiny kernel (``y[i] += 1`` on 128 elements, one block) is launched many times back to back;
the wall-clock time per launch after warm-up is the host overhead (the GPU finishes each launch
faster than the host issues the next). Reported: median over batches, in microseconds, for

- ``kiln launch (torch args)``: ``kiln.lowering.launch.launch`` with torch CUDA tensors;
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
from types import SimpleNamespace

GOAL_US = 20.0
N = 128
MEMREF = "memref<?xf32, strided<[1], offset: ?>, 1>"
ADD_ONE_KILN_IR = f"""
module attributes {{gpu.container_module}} {{
  gpu.module @kiln_kernels {{
    gpu.func @add_one(%y: {MEMREF}, %n: i32) kernel
        attributes {{known_block_size = array<i32: {N}, 1, 1>}} {{
      %i = gpu.thread_id x
      %n_index = arith.index_cast %n : i32 to index
      %in_bounds = arith.cmpi ult, %i, %n_index : index
      scf.if %in_bounds {{
        %one = arith.constant 1.0 : f32
        %v = memref.load %y[%i] : {MEMREF}
        %r = arith.addf %v, %one : f32
        memref.store %r, %y[%i] : {MEMREF}
      }}
      gpu.return
    }}
  }}
}}
"""


def _compile_add_one():
    from mlir import ir, passmanager
    from mlir.dialects import gpu

    from kiln.lowering.signature import KernelSignature, ScalarParam, TensorParam
    from kiln.lowering.targets import get_target

    target = get_target("sm_80")
    with ir.Context():
        module = ir.Module.parse(ADD_ONE_KILN_IR)
        passmanager.PassManager.parse(
            f"builtin.module(gpu-lower-to-nvvm-pipeline{{cubin-chip={target.name} "
            f"cubin-features={target.ptx_features()} cubin-format=isa}})").run(module.operation)
        (binary,) = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
        ptx = gpu.ObjectAttr(binary.attributes["objects"][0]).object.decode().rstrip("\0")
    signature = KernelSignature("add_one", (TensorParam("y", "f32", 1), ScalarParam("n", "i32")),
                                block=(N, 1, 1))
    return SimpleNamespace(name="add_one", target=target, signature=signature, asm={"ptx": ptx})


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

    from kiln.lowering.launch import launch

    kernel = _compile_add_one()
    results: dict = {"launches_per_batch": launches, "batches": batches, "goal_us": GOAL_US}

    y_host = np.zeros(N, np.float32)
    launch(kernel, (1,), [y_host, N])
    results["numpy_correct"] = bool((y_host == 1.0).all())
    plan = kernel._launch_plan

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        y = torch.zeros(N, device="cuda")
        sync = torch.cuda.synchronize
        results["kiln_launch_torch_us"] = _per_launch_us(
            lambda: launch(kernel, (1, 1, 1), [y, N]), launches, batches, sync)
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
    rows = [("kiln launch (torch args)", results.get("kiln_launch_torch_us")),
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
