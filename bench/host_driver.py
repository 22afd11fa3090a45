"""The driver's share of a launch, on the GPU machine (issue 42): how ``cuLaunchKernel`` /
``cuLaunchKernelEx`` time grows with a kernel's parameter count and with the programmatic
launch attribute, to say what passing ``decode_attention``'s 105 flat parameters as fewer
would save.

One-block kernels that do nothing (their one store is never taken) with 1, 4, 9 and 16 rank-4
f32 tensors (11 flat parameters each, plus an i32: 12, 45, 100 and 177 parameters; 9 tensors
is about decode_attention's count), each plain and with ``grid_dependency_wait`` (a
programmatic launch: ``cuLaunchKernelEx`` with its attribute), launched back to back through
the shim's ``launch_on`` with ready addresses on torch's current stream. µs per launch,
median and fastest of ``--batches`` batches of ``--launches``, the variants in turns A..Z
Z..A, each keeping its better median; a raw ctypes ``cuLaunchKernel`` of the 12-parameter
kernel is the peer (the floor of any launcher called from Python).

Usage: ``python bench/host_driver.py --launches 1000 --batches 7 --json driver.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import kiln
from kiln import f32, i32

TENSORS = (1, 4, 9, 16)


@kiln.kernel
def t1(a0: kiln.Tensor[f32], n: i32):
    if (kiln.thread_id(0) == 0) & (n < 0):
        a0[0, 0, 0, 0] = 0.0


@kiln.kernel
def t4(a0: kiln.Tensor[f32], a1: kiln.Tensor[f32], a2: kiln.Tensor[f32], a3: kiln.Tensor[f32],
       n: i32):
    if (kiln.thread_id(0) == 0) & (n < 0):
        a0[0, 0, 0, 0] = 0.0


@kiln.kernel
def t9(a0: kiln.Tensor[f32], a1: kiln.Tensor[f32], a2: kiln.Tensor[f32], a3: kiln.Tensor[f32],
       a4: kiln.Tensor[f32], a5: kiln.Tensor[f32], a6: kiln.Tensor[f32], a7: kiln.Tensor[f32],
       a8: kiln.Tensor[f32], n: i32):
    if (kiln.thread_id(0) == 0) & (n < 0):
        a0[0, 0, 0, 0] = 0.0


@kiln.kernel
def t16(a0: kiln.Tensor[f32], a1: kiln.Tensor[f32], a2: kiln.Tensor[f32], a3: kiln.Tensor[f32],
        a4: kiln.Tensor[f32], a5: kiln.Tensor[f32], a6: kiln.Tensor[f32], a7: kiln.Tensor[f32],
        a8: kiln.Tensor[f32], a9: kiln.Tensor[f32], a10: kiln.Tensor[f32],
        a11: kiln.Tensor[f32], a12: kiln.Tensor[f32], a13: kiln.Tensor[f32],
        a14: kiln.Tensor[f32], a15: kiln.Tensor[f32], n: i32):
    if (kiln.thread_id(0) == 0) & (n < 0):
        a0[0, 0, 0, 0] = 0.0


@kiln.kernel
def p1(a0: kiln.Tensor[f32], n: i32):
    kiln.nvidia_asm.grid_dependency_wait()
    if (kiln.thread_id(0) == 0) & (n < 0):
        a0[0, 0, 0, 0] = 0.0


@kiln.kernel
def p9(a0: kiln.Tensor[f32], a1: kiln.Tensor[f32], a2: kiln.Tensor[f32], a3: kiln.Tensor[f32],
       a4: kiln.Tensor[f32], a5: kiln.Tensor[f32], a6: kiln.Tensor[f32], a7: kiln.Tensor[f32],
       a8: kiln.Tensor[f32], n: i32):
    kiln.nvidia_asm.grid_dependency_wait()
    if (kiln.thread_id(0) == 0) & (n < 0):
        a0[0, 0, 0, 0] = 0.0


KERNELS = {"1 tensor (12 params)": (t1, 1), "4 tensors (45 params)": (t4, 4),
           "9 tensors (100 params)": (t9, 9), "16 tensors (177 params)": (t16, 16),
           "1 tensor, programmatic (Ex)": (p1, 1), "9 tensors, programmatic (Ex)": (p9, 9)}


def _timed(issue, launches: int, batches: int, sync) -> list[float]:
    for _ in range(max(launches // 10, 50)):
        issue()
    sync()
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(launches):
            issue()
        samples.append((time.perf_counter() - start) / launches * 1e6)
        sync()
    return samples


def run(launches: int, batches: int) -> dict:
    import torch

    from kiln.runtime.host import flat_c_argtypes
    from kiln.runtime.launch import bind_launch

    sync, raw = torch.cuda.synchronize, torch._C._cuda_getCurrentRawStream
    x = torch.zeros(2, 2, 2, 2, device="cuda")
    issues = {}
    for name, (kernel, count) in KERNELS.items():
        args = [x] * count + [1]
        compiled = kernel.compile(*args, num_warps=1, target="sm_90a")
        bound = bind_launch(compiled, (1, 1, 1), args)
        pointers = [x.data_ptr()] * count
        stream = raw(torch.cuda.current_device())
        issues[name] = (lambda b=bound, p=pointers, s=stream: b.launch_on(s, *p))
        issues[name]()
        issues[name + " params"] = len(flat_c_argtypes(compiled.signature)) - 5  # no grid
    sync()
    rows: dict = {}
    names = list(KERNELS)
    for name in names + names[::-1]:
        samples = _timed(issues[name], launches, batches, sync)
        row = rows.setdefault(name, {"params": issues[name + " params"]})
        row["us"] = min(row.get("us", 1e9), statistics.median(samples))
        row["us_min"] = min(row.get("us_min", 1e9), min(samples))
        print(f"  measured {name}: {row}", file=sys.stderr, flush=True)
    base = rows[names[0]]["us"]
    for row in rows.values():
        row["over 12 params"] = round(row["us"] - base, 3)
    return rows


def print_rows(rows: dict) -> None:
    print(f"{'kernel':<34}{'params':>8}{'µs':>8}{'min µs':>8}{'over 12':>9}", flush=True)
    for name, row in rows.items():
        print(f"{name:<34}{row['params']:>8}{row['us']:>8.2f}{row['us_min']:>8.2f}"
              f"{row['over 12 params']:>9.2f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = run(args.launches, args.batches)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
