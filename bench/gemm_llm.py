"""``bench/gemm.py --llm``: the LLM sweep, Kiln's ``matmul`` against ``torch.matmul`` (cuBLAS).

Cells: the N x K of Llama-3-8B and -70B linear layers at tensor parallelism 1 (QKV fused,
O, gate+up fused, down), weights stored N x K as ``nn.Linear`` keeps them (Kiln
``matmul(x, w, trans_b=True)``, cuBLAS ``torch.matmul(x, w.T)``), times M in
:data:`M_VALUES` (decode batches to prefill chunks). Each cell is checked against float32
first (relative error < 1e-2, NaN fails), then both are timed with CUDA events in this process
(median of ``--repeat`` samples of ``--batch`` calls: ``ratio``, host path included, as a model
calls it) and with the calls queued behind a busy stream (``ratio_gpu``: kernels only, since at
M = 1 a kernel is shorter than a Python call). Besides TFLOP/s each row reports GB/s
(A + B + C bytes once) and its fraction of the device's copy bandwidth (a 1 GiB
device-to-device copy, read + write), which is the ceiling for small M.

Kiln's config: for M <= 512 the small-M heuristic or a stored small-M tuning (``--tune``
tunes those cells first, ``kiln.kernels.gemm.small_m``); above, the autotuner. ``--configs``
also times every small-M candidate config on the M <= 512 cells (to pick heuristics).
``--quick`` runs a subset in well under a minute.
"""

from __future__ import annotations

from dataclasses import fields

import kiln
from kiln.autotune import compile_all
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul, matmul_config
from kiln.kernels.gemm.small_m import SMALL_M, SMALL_M_CONFIGS, tune_small_m
from results_io import write_results
from timing import queued_ms, time_ms

# (N, K) per layer, TP = 1: QKV = heads + 2 KV heads' worth, gate and up fused.
MODELS = {
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                  "down": (4096, 14336)},
    "llama3-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192),
                   "down": (8192, 28672)},
}
M_VALUES = (1, 16, 64, 256, 1024, 4096, 16384)
QUICK_CELLS = [("llama3-8b", layer, m) for layer in ("o", "gate_up", "down")
               for m in (1, 16, 64, 256, 512, 4096)]
GOAL = 0.95


def copy_gbps(torch) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10, 1)
    return 2 * src.numel() * 2 / ms / 1e6


def cell(torch, model: str, layer: str, m: int, repeat: int, batch: int, *, tune: bool,
         configs: bool, copy_bw: float) -> dict:
    n, k = MODELS[model][layer]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    if tune and m <= SMALL_M:
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        tune_small_m(x, w, c, m, n, k, "bf16", "k", "bf16", "sm_90a")
    reference = x.float() @ w.float().T
    per_config = {}
    if configs and m <= SMALL_M:
        print(f"  {model} {layer} M={m}: each candidate's cuBLAS ratio, kernel us, config")
        per_config["configs"] = _per_config(
            x, w, reference, repeat, queued_ms(lambda: torch.matmul(x, w.T), repeat))
    error = _error(matmul(x, w, trans_b=True), reference)
    if not error < 1e-2:  # also catches NaN: reported in the table, fails the run at the end
        return {"model": model, "layer": layer, "m": m, "n": n, "k": k, "rel_error": error}
    flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + n * k + m * n)
    kiln_ms = time_ms(lambda: matmul(x, w, trans_b=True), repeat, batch)
    torch_ms = time_ms(lambda: torch.matmul(x, w.T), repeat, batch)
    kiln_gpu = queued_ms(lambda: matmul(x, w, trans_b=True), repeat)
    torch_gpu = queued_ms(lambda: torch.matmul(x, w.T), repeat)
    row = {"ratio_gpu": torch_gpu / kiln_gpu, "kiln_gpu_ms": kiln_gpu, "cublas_gpu_ms": torch_gpu,
           "model": model, "layer": layer, "m": m, "n": n, "k": k, "rel_error": error,
           "kiln_ms": kiln_ms, "cublas_ms": torch_ms, "kiln_tflops": flops / kiln_ms / 1e9,
           "cublas_tflops": flops / torch_ms / 1e9, "kiln_gbps": nbytes / kiln_ms / 1e6,
           "cublas_gbps": nbytes / torch_ms / 1e6, "ratio": torch_ms / kiln_ms}
    row["kiln_copy_fraction"] = row["kiln_gbps"] / copy_bw
    return {**row, **per_config}


def _per_config(x, w, reference, repeat: int, cublas_ms: float) -> dict:
    """Kernel milliseconds (queued) of every small-M candidate on this cell, each checked
    first and printed as it is measured (ratio to cuBLAS, microseconds, config)."""
    compile_all(lambda config: compile_matmul(  # all at once, on a thread pool
        "bf16", target="sm_90a", trans_b=True, **vars(config)), SMALL_M_CONFIGS)
    times = {}
    for config in SMALL_M_CONFIGS:
        try:
            error = _error(matmul_config(x, w, config, trans_b=True), reference)
        except kiln.KilnError as err:  # a candidate that cannot run is reported, not fatal
            print(f"    FAILED ({type(err).__name__}: {str(err)[:120]})  {_short(config)}")
            continue
        if not error < 1e-2:  # nor is a wrong one
            print(f"    WRONG (relative error {error})  {_short(config)}")
            continue
        ms = queued_ms(lambda: matmul_config(x, w, config, trans_b=True), repeat)
        times[repr(config)] = ms
        print(f"    {cublas_ms / ms:6.3f} {ms * 1e3:8.1f} us  {_short(config)}", flush=True)
    return times


def _short(config) -> str:
    """The fields of ``config`` that differ from the default config."""
    default = HopperGemmConfig()
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in fields(config)
                    if getattr(config, f.name) != getattr(default, f.name)) or "default"


def _error(c, reference) -> float:
    return ((c.float() - reference).norm() / reference.norm()).item()


def llm_main(args, torch) -> None:
    cells = QUICK_CELLS if args.quick else [(model, layer, m) for model in MODELS
                                            for layer in MODELS[model] for m in M_VALUES]
    bw = copy_gbps(torch)
    print(f"{torch.cuda.get_device_name()}, bf16, weights N x K; copy bandwidth "
          f"{bw:.0f} GB/s")
    header = (f"{'model':>10} {'layer':>7} {'M':>6} {'N':>6} {'K':>6} {'Kiln TF/s':>10} "
              f"{'cuBLAS TF/s':>12} {'Kiln GB/s':>10} {'copy %':>7} {'ratio':>6} {'gpu':>6}")
    print(header, flush=True)
    rows = []
    for model, layer, m in cells:  # printed as measured: a cut-off run still reports
        r = cell(torch, model, layer, m, args.repeat, args.batch, tune=args.tune,
                 configs=args.configs, copy_bw=bw)
        rows.append(r)
        if "ratio" not in r:
            print(f"{model:>10} {layer:>7} {m:>6} WRONG: relative error {r['rel_error']}")
            continue
        flag = "" if r["ratio"] >= GOAL else "  <"
        print(f"{r['model']:>10} {r['layer']:>7} {r['m']:>6} {r['n']:>6} {r['k']:>6} "
              f"{r['kiln_tflops']:10.1f} {r['cublas_tflops']:12.1f} {r['kiln_gbps']:10.0f} "
              f"{100 * r['kiln_copy_fraction']:6.1f}% {r['ratio']:6.3f} {r['ratio_gpu']:6.3f}"
              f"{flag}", flush=True)
    wrong = [r for r in rows if "ratio" not in r]
    rows = [r for r in rows if "ratio" in r]
    if rows:
        worst = min(rows, key=lambda r: r["ratio"])
        print(f"worst cell: {worst['model']} {worst['layer']} M={worst['m']}: "
              f"{worst['ratio']:.3f}; cells >= {GOAL}: "
              f"{sum(r['ratio'] >= GOAL for r in rows)}/{len(rows)}")
    if args.json:
        write_results(args.json, "gemm_llm", rows, torch=torch, copy_gbps=bw, wrong=wrong)
    if wrong:
        raise SystemExit(f"Kiln GEMM wrong in {len(wrong)} cells (see WRONG above)")
