"""``bench/gemm.py --llm``: the LLM sweep, Kiln's ``matmul`` against ``torch.matmul`` (cuBLAS).

Cells: the N x K of Llama-3-8B and -70B linear layers at tensor parallelism 1 (QKV fused,
O, gate+up fused, down), weights stored N x K as ``nn.Linear`` keeps them (Kiln
``matmul(x, w, trans_b=True)``, cuBLAS ``torch.matmul(x, w.T)``), times M in
:data:`M_VALUES` (decode batches to prefill chunks). Each cell is checked against float32
first (relative error < 1e-2, NaN fails; above M = 1024 on 256 random rows), then both are
timed with CUDA events in this process: back-to-back calls (``ratio``, host path included, as
a model calls it) and calls queued behind a busy stream (``ratio_gpu``: kernels only, since at
M = 1 a kernel is shorter than a Python call). Each sample holds enough calls for about 2 ms
of GPU time (``--batch`` at most), Kiln's and cuBLAS's samples alternate, and a cell takes the
median of up to ``--repeat`` samples (fewer for long kernels), so the whole table (56 cells)
runs in well under a minute. Besides
TFLOP/s each row reports GB/s (A + B + C bytes once) and its fraction of the device's copy
bandwidth (a 1 GiB device-to-device copy, read + write), which is the ceiling for small M,
and the config Kiln ran. ``--kernels`` also names the cuBLAS kernels of each cell short of
the goal (one profiled call: tile shape, split-K).

Kiln's config: for M <= 512 the small-M heuristic or a stored small-M tuning (``--tune``
tunes those cells first, ``kiln.kernels.gemm.small_m``); above, the autotuner. ``--configs``
also times every small-M candidate config on the M <= 512 cells (to pick heuristics).
``--quick`` runs a subset; ``--models`` (in that order) / ``--layers`` / ``--m`` filter the
cells, ``--budget`` seconds stops between cells, ``--tune-repeat`` sets the autotuner's timed
runs per config (the large-M cells' tuning dominates a full run).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import fields

import kiln
from kiln.autotune import compile_all
from kiln.kernels.gemm import (HopperGemmConfig, compile_matmul, hopper_autotuner, matmul,
                               matmul_config)
from kiln.kernels.gemm.small_m import SMALL_M, SMALL_M_CONFIGS, chosen_config, tune_small_m
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
SAMPLE_MS = 2.0  # GPU time of one timed sample
CELL_MS = 300.0  # at most this much GPU time per timing of a cell (fewer samples)
CHECK_ROWS = 256  # rows checked against float32 above M = 1024
SLEEP_CYCLES = 4_000_000  # ~2 ms of spinning: longer than queuing a sample's calls


def copy_gbps(torch) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10, 1)
    return 2 * src.numel() * 2 / ms / 1e6


def measure(torch, fn, repeat: int, batch: int) -> tuple[float, float]:
    """(call ms, GPU ms) of ``fn``: see :func:`measure_pair`."""
    return measure_pair(torch, (fn,), repeat, batch)[0]


def measure_pair(torch, fns, repeat: int, batch: int) -> list[tuple[float, float]]:
    """(call ms, GPU ms) of each of ``fns``: samples of about :data:`SAMPLE_MS` of GPU time
    (``batch`` calls at most), up to ``repeat`` of them within :data:`CELL_MS`, the functions'
    samples interleaved (clock and power drift hit all alike), the rounds starting at
    functions spread over the list (no function always runs first or after the same one);
    medians."""
    plans = []
    for fn in fns:
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        once = max(start.elapsed_time(stop), 1e-3)
        calls = max(1, min(batch, round(SAMPLE_MS / once)))
        plans.append((calls, max(2, min(repeat, int(CELL_MS / (calls * once))))))
    samples = min(s for _, s in plans)
    times = [([], []) for _ in fns]
    order = list(zip(fns, plans, times))
    for sample in range(samples):
        shift = sample * len(order) // samples
        turn = order[shift:] + order[:shift]
        for queued in (False, True):
            for fn, (calls, _), (call_ms, gpu_ms) in turn:
                (gpu_ms if queued else call_ms).append(time_ms(
                    fn, 1, calls, warmup=0, queued=queued, sleep_cycles=SLEEP_CYCLES))
    return [(statistics.median(c), statistics.median(g)) for c, g in times]


def cell(torch, model: str, layer: str, m: int, repeat: int, batch: int, *, tune: bool,
         configs: bool, copy_bw: float) -> dict:
    n, k = MODELS[model][layer]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    if tune and m <= SMALL_M:
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        tune_small_m(x, w, c, m, n, k, "bf16", "k", "bf16", "sm_90a")
    rows = torch.randperm(m, device="cuda")[:CHECK_ROWS].sort().values if m > 1024 else None
    reference = (x if rows is None else x[rows]).float() @ w.float().T
    per_config = {}
    if configs and m <= SMALL_M:
        print(f"  {model} {layer} M={m}: each candidate's cuBLAS ratio, kernel us, config")
        per_config["configs"] = _per_config(
            x, w, reference, repeat, queued_ms(lambda: torch.matmul(x, w.T), repeat))
    c = matmul(x, w, trans_b=True)  # tunes M > SMALL_M first
    error = _error(c if rows is None else c[rows], reference)
    del c, reference
    if not error < 1e-2:  # also catches NaN: reported in the table, fails the run at the end
        return {"model": model, "layer": layer, "m": m, "n": n, "k": k, "rel_error": error}
    flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + n * k + m * n)
    (kiln_ms, kiln_gpu), (torch_ms, torch_gpu) = measure_pair(
        torch, (lambda: matmul(x, w, trans_b=True), lambda: torch.matmul(x, w.T)), repeat, batch)
    row = {"ratio_gpu": torch_gpu / kiln_gpu, "kiln_gpu_ms": kiln_gpu, "cublas_gpu_ms": torch_gpu,
           "model": model, "layer": layer, "m": m, "n": n, "k": k, "rel_error": error,
           "kiln_ms": kiln_ms, "cublas_ms": torch_ms, "kiln_tflops": flops / kiln_ms / 1e9,
           "cublas_tflops": flops / torch_ms / 1e9, "kiln_gbps": nbytes / kiln_ms / 1e6,
           "cublas_gbps": nbytes / torch_ms / 1e6, "ratio": torch_ms / kiln_ms,
           "config": _short(kiln_config(m, n, k) or HopperGemmConfig())}
    row["kiln_copy_fraction"] = row["kiln_gbps"] / copy_bw
    return {**row, **per_config}


def kiln_config(m: int, n: int, k: int):
    """The config ``matmul`` runs at this cell (after its first call tuned it; None if the
    tuning was not stored)."""
    return chosen_config(m, n, k, "bf16", "k", "bf16") or hopper_autotuner.cached(
        (None, None, None, m, n, k, "bf16", "k", "bf16", None), {})


def cublas_kernels(torch, cells) -> dict:
    """The CUDA kernels of one ``torch.matmul(x, w.T)`` per cell, by a profiler."""
    from torch.profiler import ProfilerActivity, profile

    names = {}
    for model, layer, m in cells:
        n, k = MODELS[model][layer]
        x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        torch.matmul(x, w.T)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.matmul(x, w.T)
            torch.cuda.synchronize()
        names[(model, layer, m)] = [e.name for e in prof.events()
                                    if str(e.device_type).endswith("CUDA")]
    return names


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
    models = args.models or list(MODELS)  # in the order given
    cells = QUICK_CELLS if args.quick else [(model, layer, m) for model in models
                                            for layer in MODELS[model] for m in M_VALUES]
    cells = [(model, layer, m) for model, layer, m in cells
             if model in models and (not args.layers or layer in args.layers)
             and (not args.m or m in args.m)]
    if args.tune_repeat:  # long kernels need few timings to rank the autotuner's configs
        hopper_autotuner.warmup, hopper_autotuner.repeat = 1, args.tune_repeat
    began = time.perf_counter()
    bw = copy_gbps(torch)
    print(f"{torch.cuda.get_device_name()}, bf16, weights N x K; copy bandwidth "
          f"{bw:.0f} GB/s")
    header = (f"{'model':>10} {'layer':>7} {'M':>6} {'N':>6} {'K':>6} {'Kiln TF/s':>10} "
              f"{'cuBLAS TF/s':>12} {'Kiln GB/s':>10} {'copy %':>7} {'ratio':>6} {'gpu':>6} "
              "Kiln config")
    print(header, flush=True)
    rows = []
    for model, layer, m in cells:  # printed as measured: a cut-off run still reports
        if time.perf_counter() - began > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(rows)} of {len(cells)} cells")
            break
        r = cell(torch, model, layer, m, args.repeat, args.batch, tune=args.tune,
                 configs=args.configs, copy_bw=bw)
        rows.append(r)
        if "ratio" not in r:
            print(f"{model:>10} {layer:>7} {m:>6} WRONG: relative error {r['rel_error']}")
            continue
        flag = "<" if min(r["ratio"], r["ratio_gpu"]) < GOAL else " "
        print(f"{r['model']:>10} {r['layer']:>7} {r['m']:>6} {r['n']:>6} {r['k']:>6} "
              f"{r['kiln_tflops']:10.1f} {r['cublas_tflops']:12.1f} {r['kiln_gbps']:10.0f} "
              f"{100 * r['kiln_copy_fraction']:6.1f}% {r['ratio']:6.3f} {r['ratio_gpu']:6.3f}"
              f"{flag} {r['config']}", flush=True)
    wrong = [r for r in rows if "ratio" not in r]
    rows = [r for r in rows if "ratio" in r]
    for ratio in ("ratio", "ratio_gpu") if rows else ():
        worst = min(rows, key=lambda r: r[ratio])
        print(f"{ratio}: worst cell {worst['model']} {worst['layer']} M={worst['m']}: "
              f"{worst[ratio]:.3f}; cells >= {GOAL}: "
              f"{sum(r[ratio] >= GOAL for r in rows)}/{len(rows)}")
    kernels = {}
    if args.kernels:  # the cells short of the goal
        names = cublas_kernels(torch, [(r["model"], r["layer"], r["m"]) for r in rows
                                       if min(r["ratio"], r["ratio_gpu"]) < GOAL])
        for (model, layer, m), found in names.items():
            kernels[f"{model}:{layer}:{m}"] = found
            print(f"cuBLAS {model} {layer} M={m}: {' + '.join(found)}")
    if args.json:
        write_results(args.json, "gemm_llm", rows, torch=torch, copy_gbps=bw, wrong=wrong,
                      cublas_kernels=kernels)
    if wrong:
        raise SystemExit(f"Kiln GEMM wrong in {len(wrong)} cells (see WRONG above)")
