"""Kiln's Hopper GEMM vs ``torch.matmul`` (cuBLAS): TFLOP/s for bf16 at 4096^3, 8192^3 and
8192 x 8192 x K for K in 1024..16384, in one run.

Method (``/work/shared/device/METHOD-notes.md``): each shape is checked against a float32
reference first (relative error < 1e-2, NaN fails), then both GEMMs are timed with CUDA events
after a warm-up; the median of the repeats counts. Each timed sample is ``--batch`` back-to-back
calls between one pair of events (the same for both libraries), so the Python launch path of
``kiln.kernels.gemm.matmul`` overlaps the previous kernel instead of idling the GPU, as it does
in a real model. Kiln's configuration is autotuned before timing (``kiln.autotune``), so tuning
stays out of the numbers.

``--sweep`` also times every candidate configuration (``HOPPER_CONFIGS``, single CTAs and
2-CTA clusters) at 8192^3 without the autotuner, each checked first, to show what each lever is
worth.

``--grouped`` times the grouped (MoE) GEMM instead (:func:`grouped_bench`): for G in 8, 16,
64 experts with ragged, seeded router-like group sizes, Kiln's ``grouped_matmul`` against
Kiln's dense ``matmul`` of the same FLOPs (one ``[total_M, K] x [K, N]``) and against a torch
loop of one ``torch.matmul`` per group; ``--sweep`` with it also times each grouped config;
with ``--fp8`` the e4m3 grouped GEMM (per-tensor and block scales) against the dense FP8 GEMM of
the same FLOPs (goal >= 0.9) and ``torch._scaled_mm``.

``--fp8`` times the FP8 GEMM instead (:mod:`gemm_fp8`): per-tensor against
``torch._scaled_mm``, DeepSeek-V3 block scales against Kiln's and cuBLAS's bf16.
``--llm`` runs the LLM sweep instead (:mod:`gemm_llm`: Llama-3-8B/70B layers x M from 1 to
16384, with GB/s against copy bandwidth; ``--quick`` a subset, ``--tune`` tunes the small-M
cells first, ``--configs`` times every small-M candidate config).

Usage (on an H100): ``python bench/gemm.py [--json out.json] [--repeat 20] [--batch 10]
[--shapes 4096x4096x4096] [--sweep] [--grouped [--fp8]] [--fp8 [--quick]]
[--llm [--quick] [--tune] [--configs] [--kernels] [--models ..] [--layers ..] [--m ..]
[--budget S]]``.
"""

from __future__ import annotations

import argparse

try:
    import torch
except ImportError:  # --help works without torch; running needs it
    torch = None

from kiln.kernels.gemm import HOPPER_CONFIGS, hopper_autotuner, matmul, run_hopper
from gemm_fp8 import fp8_main
from gemm_grouped import grouped_fp8_main, grouped_main
from gemm_llm import llm_main
from results_io import write_results
from timing import time_ms

# 8192^3 is also the K = 8192 point of the sweep; it is measured once.
SHAPES = [(4096, 4096, 4096)] + [(8192, 8192, k) for k in (1024, 2048, 4096, 8192, 16384)]


def check(m: int, n: int, k: int, gemm=matmul, what: str = "Kiln GEMM") -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = gemm(a, b)
    reference = a.float() @ b.float()
    error = ((c.float() - reference).norm() / reference.norm()).item()
    if not error < 1e-2:  # also catches NaN
        raise SystemExit(f"{what} wrong at {m}x{n}x{k}: relative error {error}")
    return error


def fixed_config(config):
    """``a @ b`` with ``config``'s kernel, bypassing the autotuner (NaN-poisoned output)."""
    def gemm(a, b, c=None):
        (m, k), n = a.shape, b.shape[1]
        c = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype) if c is None else c
        run_hopper(a, b, c, m, n, k, dtype="bf16", b_major="mn", target="sm_90a", config=config)
        return c
    return gemm


def sweep(m: int, n: int, k: int, repeat: int, batch: int) -> list[dict]:
    """Every candidate configuration at one shape, checked then timed."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for config in HOPPER_CONFIGS:
        gemm = fixed_config(config)
        error = check(m, n, k, gemm, f"Kiln GEMM {config}")
        ms = time_ms(lambda: gemm(a, b, c), repeat, batch)
        rows.append({"config": repr(config), "rel_error": error, "kiln_ms": ms,
                     "kiln_tflops": 2.0 * m * n * k / ms / 1e9})
    return rows


def bench(m: int, n: int, k: int, repeat: int, batch: int) -> dict:
    error = check(m, n, k)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * m * n * k
    kiln_ms = time_ms(lambda: matmul(a, b), repeat, batch)
    torch_ms = time_ms(lambda: torch.matmul(a, b), repeat, batch)
    return {"m": m, "n": n, "k": k, "rel_error": error, "kiln_ms": kiln_ms,
            "cublas_ms": torch_ms, "kiln_tflops": flops / kiln_ms / 1e9,
            "cublas_tflops": flops / torch_ms / 1e9, "ratio": torch_ms / kiln_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10, help="calls per timed sample")
    parser.add_argument("--sweep", action="store_true",
                        help="also time every candidate config at 8192^3")
    parser.add_argument("--grouped", action="store_true",
                        help="time the grouped (MoE) GEMM against dense and a torch loop")
    parser.add_argument("--fp8", action="store_true",
                        help="time the FP8 GEMM against torch._scaled_mm and bf16 (gemm_fp8.py)")
    parser.add_argument("--llm", action="store_true",
                        help="the LLM sweep: Llama-3 8B/70B layers x M in 1..16384")
    parser.add_argument("--quick", action="store_true",
                        help="--fp8: each FP8 config at 8192^3 only, no tuner; --llm: a subset")
    parser.add_argument("--tune", action="store_true", help="--llm: tune the small-M cells")
    parser.add_argument("--configs", action="store_true",
                        help="--llm: time every small-M candidate config too")
    parser.add_argument("--kernels", action="store_true",
                        help="--llm: name the cuBLAS kernels of each cell (profiler)")
    parser.add_argument("--models", nargs="*", help="--llm: only these models")
    parser.add_argument("--layers", nargs="*", help="--llm: only these layers")
    parser.add_argument("--m", type=int, nargs="*", help="--llm: only these M")
    parser.add_argument("--tune-repeat", type=int,
                        help="--llm: timed runs per autotuner config (default: the tuner's)")
    parser.add_argument("--budget", type=float, default=1e9,
                        help="--llm: stop between cells after this many seconds")
    parser.add_argument("--shapes", nargs="*", metavar="MxNxK",
                        help="the default run's shapes (default: 4096^3 and 8192 x 8192 x K)")
    args = parser.parse_args()
    if torch is None or not torch.cuda.is_available():
        raise SystemExit("bench/gemm.py needs torch with a CUDA GPU")
    if args.grouped:
        (grouped_fp8_main if args.fp8 else grouped_main)(args, torch)
        return
    if args.fp8:
        fp8_main(args, torch)
        return
    if args.llm:
        llm_main(args, torch)
        return
    swept = sweep(8192, 8192, 8192, args.repeat, args.batch) if args.sweep else []
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    rows = [bench(m, n, k, args.repeat, args.batch) for m, n, k in shapes]
    device = torch.cuda.get_device_name()
    print(f"{device}, bf16 in / bf16 out, f32 accumulate")
    print(f"{'M x N x K':>20} {'Kiln TFLOP/s':>13} {'cuBLAS TFLOP/s':>15} {'ratio':>6}")
    for r in rows:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        print(f"{shape:>20} {r['kiln_tflops']:13.1f} {r['cublas_tflops']:15.1f} "
              f"{r['ratio']:6.3f}")
    for r in swept:
        print(f"  8192^3 {r['config']}: {r['kiln_tflops']:.1f} TFLOP/s")
    print("autotuned configs:")
    for key, config in hopper_autotuner.best.items():
        print(f"  {key}: {config}")
    if args.json:
        write_results(args.json, "gemm", rows, torch=torch, sweep=swept,
                      configs={str(k): repr(v) for k, v in hopper_autotuner.best.items()})


if __name__ == "__main__":
    main()
