"""A/B of grouped (MoE) GEMM configs against the dense GEMM of the same FLOPs, in one run.

For each ``G:K:N`` case (``bench/gemm.py --grouped``'s ragged router sizes, ``TOKENS * TOP_K``
rows), Kiln's dense GEMM (default 128 x 256 config) on ``[total_M, K] x [K, N]`` and each
config of :func:`configs` on the grouped problem (checked against float32 first,
NaN-poisoned output; the first is the default, ``grouped_config(G)``), timed interleaved
(``bench/timing.py``: each of ``--repeat`` rounds times ``--batch`` calls of every candidate
in turn, so a power-limited GPU's clock changes fall on all alike). Prints TFLOP/s and
grouped / dense per config: the ratio of the medians and the min / median over rounds of the
ratio within a round. ``--precompile I/N`` compiles shard I of N of the kernels into the disk
cache (run N such processes at once first). Usage::

    python bench/gemm_grouped_ab.py --cases 64:4096:14336 64:4096:4096 [--dynamic] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics

import numpy as np
import torch

import kiln
from kiln.autotune import compile_all
from kiln.kernels.gemm import HopperGemmConfig, run_hopper
from kiln.kernels.gemm.grouped import grouped_config, grouped_constexprs, make_grouped_kernel
from kiln.kernels.gemm.grouped_api import run_grouped
from gemm_ab import short
from gemm_grouped import _check, moe_problem
from timing import interleaved_samples, round_ratios

C = HopperGemmConfig


def configs(groups: int) -> tuple:
    """The default (64 x 256 tiles, one consumer warp group), its row tiles swept 8 at a time,
    and the dense default's 128 x 256 tiles (two consumers; in a group's last tile the lower one
    idles when the tile holds at most 64 rows)."""
    default = grouped_config(groups)
    return (default, dataclasses.replace(default, group_m=8),
            C(stages=default.stages, group_m=default.group_m // 2))


def candidates(groups: int, dynamic: bool) -> list:
    """(name, config, dynamic) of every candidate: :func:`configs`, and with ``dynamic`` the
    default with tiles claimed from a counter (``run_grouped(dynamic=True)``)."""
    found = [(short(config), config, False) for config in configs(groups)]
    if dynamic:
        found.append((f"{short(configs(groups)[0])} dynamic", configs(groups)[0], True))
    return found


def ab_case(groups: int, k: int, n: int, repeat: int, batch: int, dynamic: bool) -> dict:
    sizes, offsets, a, b, offs = moe_problem(torch, groups, k, n)
    total = int(offsets[-1])
    flops = 2.0 * total * n * k
    dense_b = b[0].contiguous()
    dense_c = torch.empty(total, n, device="cuda", dtype=torch.bfloat16)
    # the dense default config (autotuning in this run would cost it seconds it lacks)
    fns = {"dense": lambda: run_hopper(a, dense_b, dense_c, total, n, k, dtype="bf16",
                                       b_major="mn", target="sm_90a",
                                       config=HopperGemmConfig())}
    b_view = b.reshape(groups * k, n)
    deviations = {}
    for name, config, claims in candidates(groups, dynamic):
        c = torch.full((total, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        run = functools.partial(run_grouped, a, b_view, c, offs, k=k, b_rows=k, trans_b=False,
                                config=config, dynamic=claims)
        run()
        deviations[name] = _check(torch, c, a, b, offsets)
        fns[name] = run
    samples = interleaved_samples(fns, repeat, batch)
    dense_ms = statistics.median(samples["dense"])
    print(f"G={groups} K={k} N={n} sizes {sizes.min()}..{sizes.max()}: dense "
          f"{flops / dense_ms / 1e9:.1f} TFLOP/s", flush=True)
    rows = []
    for name in deviations:
        ms = statistics.median(samples[name])
        low, mid = round_ratios(samples, name, "dense")
        rows.append({"config": name, "ms": ms, "deviation": deviations[name],
                     "vs_dense": dense_ms / ms, "vs_dense_min": low, "vs_dense_median": mid})
        print(f"  {flops / ms / 1e9:7.1f} TFLOP/s  vs dense {dense_ms / ms:.3f} (per round min "
              f"{low:.3f} median {mid:.3f})  {name}", flush=True)
    return {"groups": groups, "k": k, "n": n, "dense_ms": dense_ms, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["64:4096:14336", "64:4096:4096"],
                        help="G:K:N")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dynamic", action="store_true",
                        help="also the default config with dynamic tile claims")
    parser.add_argument("--precompile", metavar="I/N")
    parser.add_argument("--json")
    args = parser.parse_args()
    cases = [tuple(map(int, case.split(":"))) for case in args.cases]
    kernels = [(groups, cfg, claims) for groups in sorted({g for g, _, _ in cases})
               for _, cfg, claims in candidates(groups, args.dynamic)]
    if args.precompile:
        shard, shards = map(int, args.precompile.split("/"))
        kernels = kernels[shard::shards]
    compile_all(_compile, kernels)  # every config's kernel at once
    if args.precompile:
        return
    results = []
    for groups, k, n in cases:
        results.append(ab_case(groups, k, n, args.repeat, args.batch, args.dynamic))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cases": results}, f)


def _compile(kernel) -> None:
    groups, cfg, claims = kernel
    placeholder = np.empty((1, 1), kiln.bf16.numpy)
    counters = (np.zeros(2, np.int32),) if claims else ()
    make_grouped_kernel("bf16", "bf16", "mn", cfg, claims).compile(
        placeholder, placeholder, placeholder, placeholder, np.zeros(groups + 1, np.int32),
        groups, 1, 1, 1, 1, *counters, target="sm_90a", num_warps=cfg.num_warps,
        **grouped_constexprs(cfg, groups, claims))


if __name__ == "__main__":
    main()
