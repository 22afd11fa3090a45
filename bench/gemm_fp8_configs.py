"""A/B of Hopper FP8 GEMM configs (e4m3, B stored N x K, bf16 out) against their peers, one run.

For each shape, every candidate config (``--configs``: the tuner's, the overlap sweep, the
per-tensor levers, the per-tensor row sweep widths, or the defaults against the runner-up) is
launched directly (no tuner) with per-tensor scales and with DeepSeek-V3
block scales (``--kinds``), and
timed beside ``torch._scaled_mm`` (cuBLASLt, per tensor), Kiln's bf16 GEMM (best of
``BF16_CONFIGS``) and cuBLAS bf16 on the same operands. Timing is interleaved: each of
``--repeat`` rounds times ``--batch`` calls of every candidate and peer in turn (CUDA events)
and the median per candidate counts, so the clock drop of a power-limited GPU warming up falls
on all alike. Before any timing each config is checked on an odd shape (M, N, K not multiples
of the tiles, K steps not a multiple of ``overlap_steps``) against float64 of the dequantised
inputs (NaN-poisoned bf16 output; relative Frobenius error < 5e-3: bf16 rounding is ~1e-3, a
missing or repeated K step or a wrong block scale is > 1e-2), and at each timed shape against
float32.

Prints one line per measurement, then per shape the best config of each scale kind with its
ratio to ``torch._scaled_mm`` (per tensor; goal >= 1.0: the ratio of the medians, and the min /
median over rounds of the ratio within a round) or to Kiln bf16 (block; goal >= 1.4).

Usage (H100/H200): ``python bench/gemm_fp8_configs.py [--shapes 8192x8192x8192,...]
[--configs tuner|overlap|per_tensor|rows|confirm] [--kinds per_tensor,block] [--no-bf16] [--l2 2,3]
[--repeat 5] [--batch 10] [--compile-only] [--json out.json]``; ``--launch
per_tensor:0,block:2,scaled_mm`` only launches those candidates (for ``ncu -k regex:gemm``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from gemm_fp8 import operands
from kiln.kernels.gemm import HopperGemmConfig, run_hopper
from kiln.kernels.gemm.fp8_api import BLOCK_CONFIGS, SCALED_CONFIGS, run_fp8
from kiln.kernels.gemm.fp8_hopper import Fp8GemmConfig
from results_io import write_results
from timing import interleaved_samples, round_ratios

MODES = {"per_tensor": ("tensor", "tensor"), "block": ("block", "block")}
# The overlap sweep: one accumulator (as shipped before) against two accumulators in groups
# (two half-width ones on 192 columns), three consumer warp groups (block_m=192, 160 registers
# each) and block scales on 192 columns.
M192 = dict(block_m=192, block_n=128, stages=4, producer_registers=24, consumer_registers=160)
# Block scales on 192-column tiles (two B scales per step), 240 registers per consumer.
WIDE = dict(block_n=192, stages=4, producer_registers=24, consumer_registers=240)
OVERLAP = {
    "per_tensor": (Fp8GemmConfig(block_n=192, stages=4), Fp8GemmConfig(**WIDE),
                   Fp8GemmConfig(**WIDE, overlap_steps=2),
                   Fp8GemmConfig(block_n=192, stages=4, group_m=16),
                   Fp8GemmConfig(block_n=128, stages=6, overlap_steps=2),
                   Fp8GemmConfig(block_n=128, stages=6, overlap_steps=4), Fp8GemmConfig(**M192)),
    "block": (Fp8GemmConfig(block_n=128, stages=6),
              Fp8GemmConfig(block_n=128, stages=6, overlap_steps=2),
              Fp8GemmConfig(block_n=128, stages=6, overlap_steps=4),
              Fp8GemmConfig(**WIDE), Fp8GemmConfig(**WIDE, overlap_steps=2),
              Fp8GemmConfig(**WIDE, group_m=16), Fp8GemmConfig(**M192)),
}
BF16_CONFIGS = (HopperGemmConfig(), HopperGemmConfig(block_n=192),
                HopperGemmConfig(block_n=192, cluster_m=2))
ODD = (1000, 1032, 1168)  # 9.125 K steps of 128: a partial step and a group remainder


# Per-tensor levers around the default (192-column tiles, 240 consumer registers): row tiles
# swept 8 at a time (the default before), B multicast to CTA pairs (half the L2-to-SM traffic of
# B), a fifth stage, and the 128-column runner-up (also in CTA pairs: cuBLASLt's FP8 kernels run
# 2-CTA clusters).
PER_TENSOR = (Fp8GemmConfig(**WIDE, group_m=4), Fp8GemmConfig(**WIDE),
              Fp8GemmConfig(**WIDE, cluster_m=2), Fp8GemmConfig(**dict(WIDE, stages=5)),
              Fp8GemmConfig(block_n=128, stages=6, overlap_steps=2),
              Fp8GemmConfig(block_n=128, stages=6, overlap_steps=2, cluster_m=2))


# Row tiles per column sweep around the default's 4 (8 measured 0.975 of _scaled_mm, 4 0.996):
# fewer rows per sweep keep fewer A rows and more B columns in L2 at once (H200, two runs at
# 8192^3: 3 0.988 / 0.965 vs 4 0.967 / 0.989; 2 and 1 in between: within the runs' noise).
ROWS = (Fp8GemmConfig(**WIDE, group_m=4), Fp8GemmConfig(**WIDE, group_m=2),
        Fp8GemmConfig(**WIDE, group_m=1), Fp8GemmConfig(**WIDE, group_m=3))
# The defaults against the runner-up (``--configs confirm``): per tensor 4 and 3 row tiles per
# sweep, block scales the tuner's first.
CONFIRM = {"per_tensor": (SCALED_CONFIGS[0], Fp8GemmConfig(**WIDE, group_m=3)),
           "block": BLOCK_CONFIGS[:1]}


# Data pointers whose TMA descriptors ask for an L2 promotion (``--l2``: 2 = 128 B, 3 = 256 B;
# Kiln encodes none): copies of the operands get it, so one process times both, interleaved.
PROMOTE: dict = {}


def promote_l2() -> None:
    """Route every TMA descriptor encoding through :data:`PROMOTE` (descriptors are cached by
    address, so each operand copy keeps the promotion it was first encoded with)."""
    from kiln.runtime import cuda

    encode = cuda.Driver.tensor_map_encode_tiled

    def encode_promoted(self, data_type, address, *args, l2_promotion=0):
        return encode(self, data_type, address, *args,
                      l2_promotion=PROMOTE.get(address, l2_promotion))

    cuda.Driver.tensor_map_encode_tiled = encode_promoted


def candidates(which: str, kinds: tuple = tuple(MODES)) -> dict:
    sets = {"tuner": {"per_tensor": SCALED_CONFIGS, "block": BLOCK_CONFIGS},
            "overlap": OVERLAP, "per_tensor": {"per_tensor": PER_TENSOR},
            "rows": {"per_tensor": ROWS}, "confirm": CONFIRM}
    return {kind: configs for kind, configs in sets[which].items() if kind in kinds}


def precompile(configs: dict) -> None:
    """Compile every (scale kinds, config) kernel at once: ptxas runs overlap."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.kernels.gemm import compile_matmul

    with ThreadPoolExecutor(max_workers=8) as pool:
        jobs = [pool.submit(compile_matmul, "f8e4m3", target="sm_90a", trans_b=True,
                            scales=MODES[kind], **vars(config))
                for kind, configs_of in configs.items() for config in configs_of]
        for job in jobs:
            job.result()


def launch(a8, w8, c, sa, sw, kind, config):
    m, k = a8.shape
    run_fp8(a8, w8, c, sa.reshape(sa.shape or (1,)), sw.reshape(sw.shape or (1,)), m,
            w8.shape[0], k, dtype="f8e4m3", out="bf16", mode=MODES[kind], target="sm_90a",
            config=config)


def check_odd(kind: str, config) -> float:
    """Relative error of ``config`` against float64 of the dequantised inputs on ODD."""
    m, n, k = ODD
    a = torch.randn(m, k, device="cuda", dtype=torch.float64)
    w = torch.randn(n, k, device="cuda", dtype=torch.float64)
    if kind == "block":
        blocks_k = -(-k // 128)
        sa = torch.rand(m, blocks_k, device="cuda", dtype=torch.float64) + 0.5
        sw = torch.rand(-(-n // 128), blocks_k, device="cuda", dtype=torch.float64) + 0.5
        a_full = sa.repeat_interleave(128, 1)[:, :k]
        w_full = sw.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    else:
        sa = torch.tensor(0.75, device="cuda", dtype=torch.float64)
        sw = torch.tensor(1.25, device="cuda", dtype=torch.float64)
        a_full, w_full = sa, sw
    a8 = a.float().to(torch.float8_e4m3fn)
    w8 = w.float().to(torch.float8_e4m3fn)
    reference = (a8.double() * a_full) @ (w8.double() * w_full).t()
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch(a8, w8, c, sa.float().contiguous(), sw.float().contiguous(), kind, config)
    torch.cuda.synchronize()
    error = ((c.double() - reference).norm() / reference.norm()).item()
    if not error < 5e-3:  # bf16 rounding is ~1e-3; a lost K step or scale is > 1e-2
        raise SystemExit(f"{kind} {config} wrong on {ODD}: relative error {error}")
    return error


def bench_shape(m, n, k, configs, repeat, batch, log, bf16=True, l2=()) -> list[dict]:
    """Every candidate and peer at one shape, each checked first, timed interleaved; with
    ``l2`` (promotion codes) also the first per-tensor config on promoted operand copies."""
    flops = 2.0 * m * n * k
    fns, rows = {}, {}
    for kind, configs_of in configs.items():
        a8, w8, sa, sw, reference = operands(torch, m, n, k, block=kind == "block")
        for config in configs_of:
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch(a8, w8, c, sa, sw, kind, config)
            error = ((c.float() - reference).norm() / reference.norm()).item()
            if not error < 2e-2:
                raise SystemExit(f"{kind} {config} wrong at {m}x{n}x{k}: {error}")
            name = f"{kind} {config!r}"
            fns[name] = functools.partial(launch, a8, w8, c, sa, sw, kind, config)
            rows[name] = {"kind": kind, "config": repr(config), "rel_error": error}
        for promotion in l2 if kind == "per_tensor" else ():  # the first config, promoted
            a8p, w8p = a8.clone(), w8.clone()
            PROMOTE.update({a8p.data_ptr(): promotion, w8p.data_ptr(): promotion})
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch(a8p, w8p, c, sa, sw, kind, configs_of[0])
            error = ((c.float() - reference).norm() / reference.norm()).item()
            if not error < 2e-2:
                raise SystemExit(f"{kind} with L2 promotion {promotion} wrong: {error}")
            name = f"{kind} {configs_of[0]!r} l2_promotion={promotion}"
            fns[name] = functools.partial(launch, a8p, w8p, c, sa, sw, kind, configs_of[0])
            rows[name] = {"kind": kind, "config": name.split(" ", 1)[1], "rel_error": error}
        if kind == "per_tensor":
            fns["scaled_mm"] = functools.partial(torch._scaled_mm, a8, w8.t(), scale_a=sa,
                                                 scale_b=sw, out_dtype=torch.bfloat16)
            rows["scaled_mm"] = {"kind": "scaled_mm"}
    a16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    c16 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for config in BF16_CONFIGS if bf16 else ():  # the bf16 tuner's likely winners here
        name = f"kiln_bf16 {config!r}"
        fns[name] = functools.partial(run_hopper, a16, w16, c16, m, n, k, dtype="bf16",
                                      b_major="k", target="sm_90a", config=config)
        rows[name] = {"kind": "kiln_bf16", "config": repr(config)}
    fns["cublas_bf16"] = functools.partial(torch.matmul, a16, w16.t())
    rows["cublas_bf16"] = {"kind": "cublas_bf16"}
    samples = interleaved_samples(fns, repeat, batch)
    for name, times in samples.items():
        row = rows[name]
        ms = statistics.median(times)
        row.update(m=m, n=n, k=k, ms=ms, tflops=flops / ms / 1e9)
        if row["kind"] == "per_tensor":  # against _scaled_mm timed in the same rounds
            row["vs_scaled_mm_min"], row["vs_scaled_mm_median"] = \
                round_ratios(samples, name, "scaled_mm")
        ratio = (f" vs scaled_mm min {row['vs_scaled_mm_min']:.3f} median "
                 f"{row['vs_scaled_mm_median']:.3f}" if "vs_scaled_mm_min" in row else "")
        log(f"{m}x{n}x{k} {row['kind']:>11} {row['tflops']:8.1f} TFLOP/s{ratio} "
            f"{short(row.get('config', ''))}")
    return list(rows.values())


def short(config: str) -> str:
    """A config's repr without its class name and default-valued fields."""
    default = repr(Fp8GemmConfig()).split("(", 1)[1].rstrip(")").split(", ")
    fields = config.split("(", 1)[-1].rstrip(")").split(", ") if config else []
    return " ".join(f for f in fields if f not in default and "=" in f) or \
        ("default" if config else "")


def summary(rows, log) -> None:
    """Best config of each scale kind per shape, with the ratios against the peers (per
    tensor: min / median over rounds of the same-round ratio to ``_scaled_mm``)."""
    for shape in dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows):
        of = [r for r in rows if (r["m"], r["n"], r["k"]) == shape]
        peer = {}
        for r in of:
            if r["kind"] not in MODES:  # a peer: its best config
                peer[r["kind"]] = max(peer.get(r["kind"], 0.0), r["tflops"])
        for kind, against in (("per_tensor", "scaled_mm"), ("block", "kiln_bf16")):
            if not any(r["kind"] == kind for r in of):
                continue
            best = max((r for r in of if r["kind"] == kind), key=lambda r: r["tflops"])
            rounds = (f" (per round: min {best['vs_scaled_mm_min']:.3f}, median "
                      f"{best['vs_scaled_mm_median']:.3f})" if kind == "per_tensor" else "")
            log(f"SUMMARY {'x'.join(map(str, shape))} {kind}: {best['tflops']:.1f} TFLOP/s, "
                f"{best['tflops'] / peer[against]:.3f}x {against} ({peer[against]:.1f}){rounds}, "
                f"{best['tflops'] / peer['cublas_bf16']:.2f}x cublas_bf16 "
                f"({peer['cublas_bf16']:.1f}); {short(best['config'])}")


def launch_only(args) -> None:
    """``--launch``: each named candidate (``KIND:INDEX``, or ``scaled_mm``) once per shape
    (for ``ncu -k``; the only other kernels are torch's operand quantisation)."""
    for which in args.launch.split(","):
        kind, _, index = which.partition(":")
        for shape in args.shapes.split(","):
            m, n, k = map(int, shape.split("x"))
            a8, w8, sa, sw, _ = operands(torch, m, n, k, block=kind == "block",
                                         reference=False)
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            if kind == "scaled_mm":
                torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
            else:
                launch(a8, w8, c, sa, sw, kind, candidates(args.configs)[kind][int(index)])
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8192x8192x8192,4096x8192x8192,8192x14336x4096")
    parser.add_argument("--configs", choices=("tuner", "overlap", "per_tensor", "rows",
                                              "confirm"),
                        default="overlap")
    parser.add_argument("--kinds", default="per_tensor,block",
                        help="scale kinds to time: per_tensor, block or both")
    parser.add_argument("--l2", metavar="CODES",
                        help="also the first per-tensor config with TMA L2 promotion, e.g. 2,3 "
                             "(128 B, 256 B)")
    parser.add_argument("--no-bf16", action="store_true",
                        help="leave Kiln's bf16 GEMMs out (cuBLAS bf16 stays)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--compile-only", action="store_true",
                        help="fill the compile cache and exit (run beside other compiles)")
    parser.add_argument("--launch", metavar="KIND:INDEX[,...]",
                        help="only launch those candidates once per shape (for ncu), e.g. "
                             "per_tensor:0,block:2,scaled_mm")
    args = parser.parse_args()
    if args.launch:
        launch_only(args)
        return
    begin = time.perf_counter()

    def log(line):
        print(f"[{time.perf_counter() - begin:5.1f}s] {line}", flush=True)

    log(torch.cuda.get_device_name())
    configs = candidates(args.configs, tuple(args.kinds.split(",")))
    l2 = tuple(int(x) for x in args.l2.split(",")) if args.l2 else ()
    if l2:
        promote_l2()
    precompile(configs)
    if args.compile_only:
        return
    log("compiled")
    for kind, configs_of in configs.items():
        for config in configs_of:
            log(f"odd {ODD} {kind} rel error {check_odd(kind, config):.2e} {config}")
    rows = []
    for shape in args.shapes.split(","):
        rows += bench_shape(*map(int, shape.split("x")), configs, args.repeat, args.batch, log,
                            not args.no_bf16, l2)
    summary(rows, log)
    if args.json:
        write_results(args.json, "gemm_fp8_configs", rows, torch=torch)


if __name__ == "__main__":
    main()
