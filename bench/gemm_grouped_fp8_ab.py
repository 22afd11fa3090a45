"""A/B of grouped (MoE) FP8 GEMM configs against the dense FP8 GEMM of the same FLOPs, one run.

For each ``G:K:N`` case (``bench/gemm.py --grouped``'s ragged router sizes over ``TOKENS *
TOP_K`` rows) and scale kind (``--kinds``: per tensor, one scale per expert; DeepSeek-V3 block
scales), Kiln's dense FP8 GEMM (its default config for the kind, ``[total_M, K] x [N, K]^T``),
``torch._scaled_mm`` on the same dense problem (per tensor) and every grouped config of
:func:`candidates` (the first is the shipped ``GROUPED_FP8_CONFIG``) are checked first
(NaN-poisoned bf16 output; each group against float32 of the dequantised operands, relative
Frobenius error < 2e-2); each candidate is timed as soon as it is checked, interleaved with the
dense peers (``bench/timing.py``: each of ``--repeat`` rounds times ``--batch`` calls of each in
turn, so a power-limited GPU's clock changes fall on all alike; a run cut short keeps the
candidates before). Prints TFLOP/s and grouped / dense per config: the ratio of the medians and
the min / median over rounds of the ratio within a round (goal >= 0.9).

Usage (H100/H200)::

    python bench/gemm_grouped_fp8_ab.py --cases 64:4096:4096 64:4096:14336 \
        [--kinds per_tensor,block] [--repeat 5] [--batch 2] [--only 0,2] [--watchdog S] \
        [--compile-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import numpy as np
import torch

import kiln
from kiln.autotune import compile_all
from kiln.kernels.gemm.fp8_api import default_config, run_fp8
from kiln.kernels.gemm.fp8_grouped import (GROUPED_FP8_CONFIG, grouped_fp8_constexprs,
                                           make_grouped_fp8_kernel)
from kiln.kernels.gemm.fp8_grouped_api import run_grouped_fp8
from kiln.kernels.gemm.fp8_hopper import Fp8GemmConfig
from kiln.kernels.gemm.grouped import table_size
from gemm_grouped import TOKENS, TOP_K, moe_sizes
from timing import interleaved_samples, round_ratios

MODES = {"per_tensor": ("tensor", "tensor"), "block": ("block", "block")}
BLOCK = 128


def candidates(kind: str) -> tuple:
    """The shipped grouped config first (128 x 128 tiles, a group's last tile of <= 64 rows
    split by columns between the consumers), then the same without that split (the default
    before), row tiles swept 16 at a time, and ``split_n`` 64-row tiles (both consumers on every
    tile's rows, half its columns each: a group pads to 64 rows, not 128)."""
    default = GROUPED_FP8_CONFIG
    split = dict(block_m=64, block_n=256, stages=4, split_n=True)
    return (default, dataclasses.replace(default, split_n=False),
            dataclasses.replace(default, group_m=16), Fp8GemmConfig(**split, group_m=16),
            Fp8GemmConfig(**split, group_m=32))


def short(config) -> str:
    default = dataclasses.asdict(GROUPED_FP8_CONFIG)
    fields = [f"{k}={v}" for k, v in dataclasses.asdict(config).items() if default[k] != v]
    return " ".join(fields) or "default"


def problem(groups: int, k: int, n: int, kind: str):
    """Ragged offsets, e4m3 operands with their scales as ``grouped_matmul`` takes them
    (``scale_a`` ``[1]`` / ``[total_M, K/128]``, ``scale_b`` one per expert ``[G]`` /
    ``[G, N/128, K/128]``), and the float32 products of the dequantised operands: per group,
    and the dense one (expert 0's weight for every row)."""
    sizes = moe_sizes(groups, TOKENS * TOP_K)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    total = int(offsets[-1])
    a = torch.randn(total, k, device="cuda")
    b = torch.randn(groups, n, k, device="cuda")
    if kind == "block":
        sa = a.reshape(total, k // BLOCK, BLOCK).abs().amax(-1) / 448  # [total, Kb]
        sb = b.reshape(groups, n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax((2, 4)) / 448
        a_full = sa.repeat_interleave(BLOCK, 1)
        b_full = sb.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    else:
        sa = (a.abs().max() / 448).reshape(1)
        sb = b.abs().amax((1, 2)) / 448  # one per expert
        a_full, b_full = sa, sb.reshape(groups, 1, 1)
    a8 = (a / a_full).to(torch.float8_e4m3fn)
    b8 = (b / b_full).to(torch.float8_e4m3fn)
    del a, b
    a_deq = a8.float() * a_full
    expected = torch.empty(total, n, device="cuda")
    for g in range(groups):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        expected[lo:hi] = a_deq[lo:hi] @ (b8[g].float() * b_full[g]).t()
    dense = a_deq @ (b8[0].float() * b_full[0]).t()
    return (sizes, offsets, a8, b8, sa.float().contiguous(), sb.float().contiguous(), expected,
            dense)


def kernel_scales(kind: str, sb, groups: int):
    """``scale_b`` in the grouped kernel's form (:mod:`kiln.kernels.gemm.fp8_grouped`) and the
    dense GEMM's for expert 0."""
    if kind == "block":
        return sb.reshape(groups * sb.shape[1], sb.shape[2]), sb[0].contiguous()
    return sb.reshape(groups, 1), sb[:1].contiguous()


def check(c, expected, offsets, what: str) -> float:
    """The largest relative Frobenius error of a group's rows (NaN fails)."""
    worst = 0.0
    for g in range(len(offsets) - 1):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        if lo == hi:
            continue
        want = expected[lo:hi]
        error = ((c[lo:hi].float() - want).norm() / want.norm()).item()
        if not error < 2e-2:  # also catches NaN
            raise SystemExit(f"{what} wrong in group {g}: relative error {error}")
        worst = max(worst, error)
    return worst


def ab_case(groups, k, n, kind, repeat, batch, log, only=None) -> dict:
    mode = MODES[kind]
    sizes, offsets, a8, b8, sa, sb, expected, dense = problem(groups, k, n, kind)
    log(f"G={groups} K={k} N={n} {kind}: operands and float32 references ready")
    total = int(offsets[-1])
    flops = 2.0 * total * n * k
    offs = torch.from_numpy(offsets).cuda()
    b_view = b8.reshape(groups * n, k)
    # The dense problem of the same FLOPs: expert 0's weight for all rows.
    dense_b, dense_c = b8[0].contiguous(), torch.empty(total, n, device="cuda",
                                                       dtype=torch.bfloat16)
    sb, dense_sb = kernel_scales(kind, sb, groups)
    dense_cfg = default_config(mode)
    fns = {"dense": functools.partial(run_fp8, a8, dense_b, dense_c, sa, dense_sb, total, n, k,
                                      dtype="f8e4m3", out="bf16", mode=mode, target="sm_90a",
                                      config=dense_cfg)}
    fns["dense"]()
    log(f"  dense rel error {check(dense_c, dense, [0, total], f'dense {kind}'):.2e}")
    del dense
    if kind == "per_tensor":
        fns["scaled_mm"] = functools.partial(torch._scaled_mm, a8, dense_b.t(),
                                             scale_a=sa.reshape(()), scale_b=dense_sb.reshape(()),
                                             out_dtype=torch.bfloat16)
    peers = dict(fns)
    log(f"G={groups} K={k} N={n} {kind} sizes {sizes.min()}..{sizes.max()}")
    rows = []
    chosen = [c for i, c in enumerate(candidates(kind)) if only is None or i in only]
    for config in chosen:  # each timed with the peers as soon as it is checked
        name = short(config)
        c = torch.full((total, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        run = functools.partial(run_grouped_fp8, a8, b_view, c, offs, sa, sb, mode=mode, k=k,
                                config=config)
        run()
        error = check(c, expected, offsets, f"{kind} {name}")
        samples = interleaved_samples({**peers, name: run}, repeat, batch)
        ms, dense_ms = statistics.median(samples[name]), statistics.median(samples["dense"])
        low, mid = round_ratios(samples, name, "dense")
        row = {"config": name, "kind": kind, "ms": ms, "rel_error": error,
               "tflops": flops / ms / 1e9, "dense_tflops": flops / dense_ms / 1e9,
               "vs_dense": dense_ms / ms, "vs_dense_min": low, "vs_dense_median": mid}
        peer = ""
        if "scaled_mm" in samples:
            row["scaled_mm_tflops"] = flops / statistics.median(samples["scaled_mm"]) / 1e9
            peer = f", scaled_mm {row['scaled_mm_tflops']:.1f}"
        rows.append(row)
        log(f"  {row['tflops']:7.1f} TFLOP/s  vs dense {row['vs_dense']:.3f} (per round min "
            f"{low:.3f} median {mid:.3f}; dense {row['dense_tflops']:.1f}{peer}; rel error "
            f"{error:.1e})  {name}")
    return {"groups": groups, "k": k, "n": n, "kind": kind, "dense_config": repr(dense_cfg),
            "rows": rows}


def precompile(cases, kinds, only=None) -> None:
    """Every grouped candidate's kernel and the dense defaults, at once (ptxas runs overlap)."""
    from kiln.kernels.gemm import compile_matmul

    jobs = [("dense", kind, default_config(MODES[kind]), 0) for kind in kinds]
    jobs += [("grouped", kind, config, groups) for kind in kinds
             for groups in sorted({g for g, _, _ in cases})
             for i, config in enumerate(candidates(kind)) if only is None or i in only]

    def build(job):
        which, kind, config, groups = job
        mode = MODES[kind]
        if which == "dense":
            compile_matmul("f8e4m3", target="sm_90a", trans_b=True, scales=mode,
                           **dataclasses.asdict(config))
            return
        x = np.empty((1, 1), kiln.dtype("f8e4m3").numpy)
        c = np.empty((1, 1), kiln.bf16.numpy)
        sa = np.empty((1,) * (2 if kind == "block" else 1), np.float32)
        make_grouped_fp8_kernel("f8e4m3", "bf16", mode, config).compile(
            x, x, c, c, np.zeros(groups + 1, np.int32), sa, np.empty((1, 1), np.float32),
            groups, 1, 1, 1, 1, target="sm_90a", num_warps=config.num_warps,
            **grouped_fp8_constexprs(config, table_size(groups)))

    compile_all(build, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["64:4096:4096", "64:4096:14336"],
                        help="G:K:N")
    parser.add_argument("--kinds", default="per_tensor,block")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--compile-only", action="store_true",
                        help="fill the compile cache and exit (run beside other compiles)")
    parser.add_argument("--only", metavar="I,J", help="only these candidates (indices into "
                        "candidates(kind)), e.g. 0,2")
    parser.add_argument("--watchdog", type=float, metavar="S",
                        help="dump the stacks and exit after S seconds (a hung kernel)")
    parser.add_argument("--json")
    args = parser.parse_args()
    begin = time.perf_counter()
    if args.watchdog:  # a hung kernel blocks in C: dump every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)

    def log(line):
        print(f"[{time.perf_counter() - begin:5.1f}s] {line}", flush=True)

    cases = [tuple(map(int, case.split(":"))) for case in args.cases]
    kinds = args.kinds.split(",")
    only = {int(i) for i in args.only.split(",")} if args.only else None
    precompile(cases, kinds, only)
    if args.compile_only:
        return
    log(f"{torch.cuda.get_device_name()}: compiled")
    results = []
    for groups, k, n in cases:
        for kind in kinds:
            results.append(ab_case(groups, k, n, kind, args.repeat, args.batch, log, only))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "cases": results}, f)


if __name__ == "__main__":
    main()
