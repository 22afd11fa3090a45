"""Per-config timings of the LLM sweep's cells, to fit ``kiln.kernels.gemm.small_m``'s heuristic.

For each cell of ``bench/gemm.py --llm`` (Llama-3-8B / -70B N x K times M in 1..16384, weights
stored N x K), times ``torch.matmul`` (cuBLAS) and every candidate config with
``matmul_config`` (each checked against float32 first; a wrong or failing one is reported and
skipped): for M <= 512 the small-M candidates (split-K, swap-AB, small tiles, stream-K) and the
heuristic's own pick, above that the large-GEMM autotuner's configs and their stream-K forms.
Times are kernel-only (calls queued behind a busy stream), few repeats: this is a survey, not
a benchmark. Cells run small M first, 70B before 8B (:func:`priority`); ``--budget`` seconds
stops the survey between cells, and the JSON (written after every cell) keeps what was
measured.

Usage: ``python bench/gemm_config_sweep.py --json sweep.json [--budget 100] [--models llama3-70b]``
Prints one line per cell: cuBLAS microseconds, the heuristic / autotuner-space best ratio and
the best config.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields

try:
    import torch
except ImportError:  # the candidate lists (and --help) work without torch
    torch = None

import kiln
from kiln.autotune import compile_all
from kiln.kernels.gemm import HOPPER_CONFIGS, HopperGemmConfig, compile_matmul, matmul_config
from kiln.kernels.gemm.small_m import SMALL_M, SMALL_M_CONFIGS, heuristic_config
from gemm_llm import M_VALUES, MODELS
from timing import queued_ms

C = HopperGemmConfig
EXTRA_LARGE = (C(stream_k=True), C(block_n=192, stream_k=True),
               C(block_n=128, stages=5, stream_k=True),
               C(block_m=64, block_n=256, stages=4, stream_k=True))
EXTRA_SMALL = (C(block_n=32, stages=8, swap_ab=True, stream_k=True),
               C(block_n=64, stages=8, swap_ab=True, stream_k=True),
               C(block_m=64, block_n=128, stages=8, stream_k=True),
               C(block_m=64, block_n=256, stages=4, stream_k=True),
               C(block_n=128, stages=6, stream_k=True),
               C(block_n=32, stages=8, swap_ab=True, split_k=16),
               C(block_m=64, block_n=128, stages=8, split_k=8),
               C(block_m=64, block_n=32, stages=8, swap_ab=True, split_k=2),
               C(block_m=64, block_n=32, stages=8, swap_ab=True, stream_k=True),
               C(block_m=64, block_n=64, stages=8, swap_ab=True, split_k=2))
LARGE_CONFIGS = HOPPER_CONFIGS + tuple(c for c in EXTRA_LARGE if c not in HOPPER_CONFIGS)
SMALL_CONFIGS = SMALL_M_CONFIGS + tuple(c for c in EXTRA_SMALL if c not in SMALL_M_CONFIGS)
TARGET_MS = 3.0  # GPU time per timed sample: enough calls to swamp the event overhead


def short(config) -> dict:
    """The fields of ``config`` that differ from the default config."""
    default = C()
    return {f.name: getattr(config, f.name) for f in fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}


def time_config(fn, reference) -> float | str:
    """Kernel ms of ``fn`` (checked first), or why it was not timed."""
    try:
        c = fn()
    except kiln.KilnError as err:
        return f"failed: {type(err).__name__}: {str(err)[:100]}"
    error = ((c.float() - reference).norm() / reference.norm()).item()
    if not error < 1e-2:
        return f"wrong: relative error {error}"
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - start) * 1e3
    calls = max(1, min(20, int(TARGET_MS / max(once, 1e-3))))
    return queued_ms(fn, repeat=3, calls=calls, warmup=1)


def survey_cell(model, layer, m) -> dict:
    n, k = MODELS[model][layer]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    reference = x.float() @ w.float().T
    cublas = time_config(lambda: torch.matmul(x, w.T), reference)
    candidates = list(SMALL_CONFIGS if m <= SMALL_M else LARGE_CONFIGS)
    heuristic = heuristic_config(m, n, k, "k", sms=torch.cuda.get_device_properties(0)
                                 .multi_processor_count) if m <= SMALL_M else None
    if heuristic is not None and heuristic not in candidates:
        candidates.append(heuristic)
    configs = []
    for config in candidates:
        ms = time_config(lambda: matmul_config(x, w, config, trans_b=True), reference)
        configs.append({"config": short(config), "ms": ms})
    return {"model": model, "layer": layer, "m": m, "n": n, "k": k, "cublas_ms": cublas,
            "heuristic": None if heuristic is None else short(heuristic), "configs": configs}


def summary(row) -> str:
    timed = [c for c in row["configs"] if isinstance(c["ms"], float)]
    head = f"{row['model']:>10} {row['layer']:>7} {row['m']:>6}"
    if not timed or not isinstance(row["cublas_ms"], float):
        return f"{head} nothing timed"
    best = min(timed, key=lambda c: c["ms"])
    picked = [c for c in timed if c["config"] == row["heuristic"]]
    pick = f" heur {row['cublas_ms'] / picked[0]['ms']:.3f}" if picked else ""
    bad = len(row["configs"]) - len(timed)
    return (f"{head} cublas {row['cublas_ms'] * 1e3:8.1f}us best "
            f"{row['cublas_ms'] / best['ms']:.3f}{pick} {best['config']}"
            + (f" ({bad} not timed)" if bad else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--budget", type=float, default=100.0, help="seconds")
    parser.add_argument("--models", nargs="*", default=["llama3-70b", "llama3-8b"])
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    args = parser.parse_args()
    start = time.perf_counter()
    rows, compiled = [], set()
    for model, layer, m in sorted(((model, layer, m) for model in args.models
                                   for layer in MODELS[model] for m in args.m), key=priority):
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(rows)} cells surveyed")
            return
        space = SMALL_CONFIGS if m <= SMALL_M else LARGE_CONFIGS
        if space not in compiled:  # each space's kernels at once, when first needed
            compile_all(lambda config: compile_matmul("bf16", target="sm_90a", trans_b=True,
                                                      **vars(config)), space)
            compiled.add(space)
            print(f"{torch.cuda.get_device_name()}: {len(space)} configs compiled by "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
        rows.append(survey_cell(model, layer, m))
        print(summary(rows[-1]), flush=True)
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cells": rows}, f)


def priority(cell) -> tuple:
    """Survey order: the heuristic's cells (M <= 512) first, then growing M; 70B before 8B
    (never measured before), layers in model order."""
    model, layer, m = cell
    return (0 if m <= SMALL_M else m, list(MODELS).index(model) * -1,
            list(MODELS[model]).index(layer), m)


if __name__ == "__main__":
    main()
