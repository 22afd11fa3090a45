"""``bench/gemm.py --fp8``: Kiln's FP8 GEMM (e4m3, B stored N x K) against its peers, one run.

Rows, per shape (8192^3-class LLM shapes):

- ``per_tensor``: Kiln ``matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True)`` with device
  scalar scales against ``torch._scaled_mm`` (cuBLASLt) on the same operands;
  ``ratio_vs_scaled_mm`` = cuBLASLt time / Kiln time (goal >= 1.0).
- ``block``: DeepSeek-V3 block scales (1 x 128 for A, 128 x 128 for B) against Kiln's bf16
  GEMM (``matmul(a, w, trans_b=True)`` on bf16 copies; goal ``ratio_vs_kiln_bf16`` >= 1.4) and
  ``torch.matmul`` bf16 (cuBLAS).

Every Kiln result is checked first against a float32 torch reference on the dequantised
operands (relative Frobenius error < 2e-2, NaN fails). Timing: CUDA events, ``--batch`` calls
per sample, ``--repeat`` rounds in which Kiln and its peers take turns (FP8 GEMMs run
power-limited: interleaving puts the clock changes on all alike); the medians count, and the
per-tensor ratio is also given as min / median over rounds of the ratio within a round. Kiln
configs are autotuned before timing. ``--quick`` times each FP8 config directly (no tuner) at
8192^3 only, interleaved the same way: which config wins, in well under a minute.
"""

from __future__ import annotations

import functools
import statistics

from kiln.kernels.gemm import HopperGemmConfig, matmul, run_hopper
from kiln.kernels.gemm.fp8_api import BLOCK_CONFIGS, SCALED_CONFIGS, run_fp8
from results_io import write_results
from timing import interleaved_samples, round_ratios

SHAPES = ((8192, 8192, 8192), (8192, 14336, 4096), (4096, 4096, 4096))
QUICK_SHAPES = ((8192, 8192, 8192),)
BLOCK = 128


def operands(torch, m: int, n: int, k: int, block: bool, reference: bool = True):
    """e4m3 A (M x K) and W (N x K) with their scales: per tensor (0-d device scalars) or
    block scales, plus the float32 dequantised reference product (None unless
    ``reference``: it is a GEMM kernel of its own, which a profiler would count)."""
    a = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    if block:
        sa = a.reshape(m, k // BLOCK, BLOCK).abs().amax(-1) / 448
        sw = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax((1, 3)) / 448
        a_full = sa.repeat_interleave(BLOCK, 1)
        w_full = sw.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    else:
        sa, sw = a.abs().max() / 448, w.abs().max() / 448
        a_full, w_full = sa, sw
    a8 = (a / a_full).to(torch.float8_e4m3fn)
    w8 = (w / w_full).to(torch.float8_e4m3fn)
    product = (a8.float() * a_full) @ (w8.float() * w_full).t() if reference else None
    return a8, w8, sa.float().contiguous(), sw.float().contiguous(), product


def check(c, reference, what: str) -> float:
    error = ((c.float() - reference).norm() / reference.norm()).item()
    if not error < 2e-2:  # also catches NaN
        raise SystemExit(f"{what} wrong: relative error {error}")
    return error


def bench_shape(torch, m, n, k, repeat, batch) -> list[dict]:
    """Per tensor (Kiln vs ``_scaled_mm``) and block scales (Kiln vs Kiln / cuBLAS bf16) at one
    shape, each group timed interleaved (``timing.interleaved_samples``: a power-limited
    GPU's clock changes fall on all alike); ratios also as min / median over rounds."""
    flops = 2.0 * m * n * k
    rows = []
    a8, w8, sa, sw, reference = operands(torch, m, n, k, block=False)
    error = check(matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True), reference,
                  f"Kiln FP8 per-tensor {m}x{n}x{k}")
    peer = torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
    check(peer[0] if isinstance(peer, tuple) else peer, reference, "torch._scaled_mm")
    samples = interleaved_samples({
        "kiln": lambda: matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True),
        "scaled_mm": lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw,
                                              out_dtype=torch.bfloat16)}, repeat, batch)
    kiln_ms, peer_ms = (statistics.median(samples[x]) for x in ("kiln", "scaled_mm"))
    low, mid = round_ratios(samples, "kiln", "scaled_mm")
    rows.append({"kind": "per_tensor", "m": m, "n": n, "k": k, "rel_error": error,
                 "kiln_ms": kiln_ms, "scaled_mm_ms": peer_ms,
                 "kiln_tflops": flops / kiln_ms / 1e9, "scaled_mm_tflops": flops / peer_ms / 1e9,
                 "ratio_vs_scaled_mm": peer_ms / kiln_ms, "ratio_round_min": low,
                 "ratio_round_median": mid})
    a8, w8, sa, sw, reference = operands(torch, m, n, k, block=True)
    error = check(matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True), reference,
                  f"Kiln FP8 block {m}x{n}x{k}")
    a16, w16 = a8.to(torch.bfloat16), w8.to(torch.bfloat16)
    matmul(a16, w16, trans_b=True)  # tunes Kiln bf16 before the timed rounds
    samples = interleaved_samples({
        "kiln": lambda: matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True),
        "kiln_bf16": lambda: matmul(a16, w16, trans_b=True),
        "cublas_bf16": lambda: torch.matmul(a16, w16.t())}, repeat, batch)
    kiln_ms, bf16_ms, torch_ms = (statistics.median(samples[x])
                                  for x in ("kiln", "kiln_bf16", "cublas_bf16"))
    rows.append({"kind": "block", "m": m, "n": n, "k": k, "rel_error": error,
                 "kiln_ms": kiln_ms, "kiln_bf16_ms": bf16_ms, "cublas_bf16_ms": torch_ms,
                 "kiln_tflops": flops / kiln_ms / 1e9, "kiln_bf16_tflops": flops / bf16_ms / 1e9,
                 "cublas_bf16_tflops": flops / torch_ms / 1e9,
                 "ratio_vs_kiln_bf16": bf16_ms / kiln_ms,
                 "ratio_vs_cublas_bf16": torch_ms / kiln_ms})
    return rows


def precompile(configs) -> None:
    """Compile every (scale kinds, config) kernel at once: ptxas runs overlap."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.kernels.gemm import compile_matmul

    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(compile_matmul, "f8e4m3", target="sm_90a", trans_b=True,
                                   scales=mode, **vars(config)) for mode, config in configs]:
            future.result()


def quick_shape(torch, m, n, k, repeat, batch) -> list[dict]:
    """Each FP8 config at one shape without the tuner, against the same peers, all timed in
    interleaved rounds; per-tensor rows carry min / median over rounds of the same-round
    ratio to ``_scaled_mm``."""
    flops = 2.0 * m * n * k
    precompile([(("tensor", "tensor"), c) for c in SCALED_CONFIGS] +
               [(("block", "block"), c) for c in BLOCK_CONFIGS])
    fns, rows = {}, {}
    for kind, configs in (("per_tensor", SCALED_CONFIGS), ("block", BLOCK_CONFIGS)):
        a8, w8, sa, sw, reference = operands(torch, m, n, k, block=kind == "block")
        mode = ("block", "block") if kind == "block" else ("tensor", "tensor")
        for config in configs:
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            run = functools.partial(run_fp8, a8, w8, c, sa.reshape(sa.shape or (1,)),
                                    sw.reshape(sw.shape or (1,)), m, n, k, dtype="f8e4m3",
                                    out="bf16", mode=mode, target="sm_90a", config=config)
            run()
            name = f"{kind} {config!r}"
            fns[name] = run
            rows[name] = {"kind": kind, "config": repr(config),
                          "rel_error": check(c, reference, f"Kiln FP8 {kind} {config}")}
        if kind == "per_tensor":
            fns["scaled_mm"] = functools.partial(torch._scaled_mm, a8, w8.t(), scale_a=sa,
                                                 scale_b=sw, out_dtype=torch.bfloat16)
            rows["scaled_mm"] = {"kind": "scaled_mm"}
    a16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    c16 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fns["kiln_bf16"] = functools.partial(run_hopper, a16, w16, c16, m, n, k, dtype="bf16",
                                         b_major="k", target="sm_90a",
                                         config=HopperGemmConfig(block_n=192))
    fns["cublas_bf16"] = functools.partial(torch.matmul, a16, w16.t())
    rows.update(kiln_bf16={"kind": "kiln_bf16"}, cublas_bf16={"kind": "cublas_bf16"})
    samples = interleaved_samples(fns, repeat, batch)
    for name, row in rows.items():
        ms = statistics.median(samples[name])
        row.update(m=m, n=n, k=k, kiln_ms=ms, kiln_tflops=flops / ms / 1e9)
        ratio = ""
        if row["kind"] == "per_tensor":
            row["ratio_round_min"], row["ratio_round_median"] = \
                round_ratios(samples, name, "scaled_mm")
            ratio = (f" vs _scaled_mm per round min {row['ratio_round_min']:.3f} median "
                     f"{row['ratio_round_median']:.3f}")
        print(f"{m}x{n}x{k} {row['kind']:>11} {row['kiln_tflops']:8.1f} TFLOP/s{ratio} "
              f"{row.get('config', '')}", flush=True)
    return list(rows.values())


def fp8_main(args, torch) -> None:
    """Entry point of ``bench/gemm.py --fp8 [--quick]``: prints a table, writes ``--json``."""
    device = torch.cuda.get_device_name()
    print(f"{device}, FP8 e4m3 in (B N x K) / bf16 out, f32 accumulate")
    if args.quick:
        rows = [r for shape in QUICK_SHAPES for r in quick_shape(torch, *shape, args.repeat,
                                                                  args.batch)]
    else:
        rows = [r for shape in SHAPES for r in bench_shape(torch, *shape, args.repeat,
                                                            args.batch)]
        for r in rows:
            shape = f"{r['m']}x{r['n']}x{r['k']}"
            if r["kind"] == "per_tensor":
                print(f"{shape:>16} per-tensor  Kiln {r['kiln_tflops']:7.1f}  _scaled_mm "
                      f"{r['scaled_mm_tflops']:7.1f}  ratio {r['ratio_vs_scaled_mm']:.3f} "
                      f"(per round min {r['ratio_round_min']:.3f} median "
                      f"{r['ratio_round_median']:.3f})")
            else:
                print(f"{shape:>16} block       Kiln {r['kiln_tflops']:7.1f}  Kiln bf16 "
                      f"{r['kiln_bf16_tflops']:7.1f} ({r['ratio_vs_kiln_bf16']:.2f}x)  cuBLAS "
                      f"bf16 {r['cublas_bf16_tflops']:7.1f} ({r['ratio_vs_cublas_bf16']:.2f}x)")
    if args.json:
        write_results(args.json, "gemm_fp8", rows, torch=torch)
