"""A/B of Hopper GEMM configs on chosen LLM cells against cuBLAS, as ``matmul`` runs them.

For each cell (``model:layer:M``, weights stored N x K as in ``bench/gemm.py --llm``) and each
candidate config of :data:`CANDIDATES` for that M (plus ``matmul``'s own pick): the result is
checked against float32 (relative error < 1e-2), then timed two ways in this process, beside
``torch.matmul(x, w.T)`` (cuBLAS):

* ``gpu``: kernels only (calls queued behind a busy stream, ``timing.queued_ms``);
* ``call``: ``--batch`` back-to-back calls of the config's bound plan (what a repeat
  ``matmul`` call runs: one allocation, one or two bound launches), host time included,
  as the LLM sweep's ``ratio`` column times ``matmul``.

Prints one line per config: cuBLAS time / Kiln time for both, microseconds, the config; then
the ``--top`` best of the cell by call ratio (with their GPU ratio); ``--matmul-only`` times
``matmul``'s own pick alone (a quick check of the defaults). ``--budget`` seconds
stops between cells. Usage::

    python bench/gemm_ab.py --cells llama3-8b:o:64 llama3-8b:down:1 [--json ab.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields

import torch

import kiln
from kiln.autotune import compile_all
from kiln.kernels import gemm
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul
from kiln.kernels.gemm.small_m import SMALL_M, chosen_config
from gemm_llm import MODELS
from timing import queued_ms, time_ms

C = HopperGemmConfig
# Candidates by the largest M they are tried at (decode, then prefill-chunk sizes).
CANDIDATES = {
    64: (C(block_n=32, stages=8, swap_ab=True, split_k=4),
         C(block_n=32, stages=8, swap_ab=True, split_k=4, pdl=True),
         C(block_n=32, stages=10, swap_ab=True, split_k=4, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, split_k=2, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, split_k=8, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, stream_k=True),
         C(block_n=32, stages=8, swap_ab=True, stream_k=True, pdl=True),
         C(block_n=64, stages=8, swap_ab=True, split_k=4, pdl=True),
         C(block_n=64, stages=8, swap_ab=True, stream_k=True, pdl=True),
         C(block_m=64, block_n=128, stages=8, split_k=4),
         C(block_m=64, block_n=128, stages=8, split_k=4, pdl=True),
         C(block_m=64, block_n=128, stages=9, stream_k=True, pdl=True),
         C(block_m=64, block_n=256, stages=4),
         C(block_m=64, block_n=256, stages=4, pdl=True),
         C(block_m=64, block_n=256, stages=4, stream_k=True, pdl=True),
         C(block_m=64, block_n=32, stages=12, swap_ab=True, pingpong=True, pdl=True)),
    SMALL_M: (C(block_m=64, block_n=128, stages=8),
              C(block_m=64, block_n=128, stages=8, pdl=True),
              C(block_m=64, block_n=128, stages=8, split_k=2, pdl=True),
              C(block_m=64, block_n=256, stages=4, pdl=True),
              C(block_m=64, block_n=128, stages=8, pingpong=True, pdl=True),
              C(block_m=64, block_n=192, stages=5, pingpong=True, pdl=True),
              C(block_m=64, block_n=256, stages=4, pingpong=True, pdl=True),
              C(block_n=128, stages=6, pdl=True),
              C(block_n=128, stages=6, stream_k=True, pdl=True),
              C(pdl=True), C(split_k=2, pdl=True), C(split_k=4, pdl=True),
              C(block_n=128, stages=6, split_k=2, pdl=True),
              C(stream_k=True), C(stream_k=True, pdl=True),
              C(block_n=192, pdl=True), C(block_n=128, stages=6, cluster_m=2)),
}


def candidates(m: int) -> tuple:
    return next(configs for top, configs in sorted(CANDIDATES.items()) if m <= top)


def short(config) -> str:
    """The fields of ``config`` that differ from the default config."""
    default = C()
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in fields(config)
                    if getattr(config, f.name) != getattr(default, f.name)) or "default"


def error(c, reference) -> float:
    return ((c.float() - reference).norm() / reference.norm()).item()


def bound_call(x, w, config):
    """A repeat ``matmul(x, w, trans_b=True)`` call of ``config``: its bound plan's work."""
    c = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)
    plan = gemm._bind(x, w, c, True, "sm_90a", config)
    xp, wp = x.data_ptr(), w.data_ptr()

    def call():
        out = plan.fresh_c.one()
        plan.bound(xp, wp, out.data_ptr())
        return out
    return call


def ab_cell(model: str, layer: str, m: int, repeat: int, batch: int, top: int = 5,
            matmul_only: bool = False) -> dict:
    n, k = MODELS[model][layer]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    reference = x.float() @ w.float().T
    cublas = lambda: torch.matmul(x, w.T)  # noqa: E731
    cublas_gpu, cublas_call = queued_ms(cublas, repeat), time_ms(cublas, repeat, batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pick = chosen_config(m, n, k, "bf16", "k", "bf16", sms=sms) if m <= SMALL_M else None
    configs = [] if matmul_only else \
        list(candidates(m)) + ([pick] if pick and pick not in candidates(m) else [])
    matmul(x, w, trans_b=True)  # tunes M > SMALL_M (the autotuner's pick) before timing
    print(f"{model} {layer} M={m} N={n} K={k}: cuBLAS {cublas_gpu * 1e3:.1f} us gpu, "
          f"{cublas_call * 1e3:.1f} us call; matmul picks {short(pick) if pick else 'tuned'}",
          flush=True)
    rows = [{"config": "matmul", **_time(lambda: matmul(x, w, trans_b=True), None, reference,
                                          repeat, batch, cublas_gpu, cublas_call)}]
    for config in configs:
        try:
            call = bound_call(x, w, config)
        except kiln.KilnError as err:
            print(f"    FAILED {type(err).__name__}: {str(err)[:100]}  {short(config)}")
            continue
        rows.append({"config": short(config), **_time(call, config, reference, repeat, batch,
                                                      cublas_gpu, cublas_call)})
    timed = [r for r in rows if "gpu_ms" in r]
    best_gpu = max(timed, key=lambda r: r["gpu_ratio"])
    print(f"  best gpu: {best_gpu['gpu_ratio']:.3f}  {best_gpu['config']}")
    for r in sorted(timed, key=lambda r: -r["call_ratio"])[:top]:  # the best as matmul runs
        print(f"  call {r['call_ratio']:.3f} ({r['call_ms'] * 1e3:6.1f} us) gpu "
              f"{r['gpu_ratio']:.3f} ({r['gpu_ms'] * 1e3:6.1f} us)  {r['config']}", flush=True)
    return {"model": model, "layer": layer, "m": m, "n": n, "k": k,
            "cublas_gpu_ms": cublas_gpu, "cublas_call_ms": cublas_call,
            "pick": short(pick) if pick else None, "rows": rows}


def _time(call, config, reference, repeat, batch, cublas_gpu, cublas_call) -> dict:
    err = error(call(), reference)
    name = short(config) if config else "matmul"
    if not err < 1e-2:
        print(f"    WRONG (relative error {err})  {name}")
        return {"rel_error": err}
    gpu, host = queued_ms(call, repeat), time_ms(call, repeat, batch)
    row = {"gpu_ms": gpu, "call_ms": host, "gpu_ratio": cublas_gpu / gpu,
           "call_ratio": cublas_call / host, "rel_error": err}
    print(f"    gpu {row['gpu_ratio']:.3f} {gpu * 1e3:7.1f} us  call {row['call_ratio']:.3f} "
          f"{host * 1e3:7.1f} us  {name}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", required=True, help="model:layer:M")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--budget", type=float, default=1e9, help="seconds")
    parser.add_argument("--top", type=int, default=5, help="configs summarised per cell")
    parser.add_argument("--matmul-only", action="store_true",
                        help="time matmul's own pick alone (no candidates)")
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    cells = [(model, layer, int(m)) for model, layer, m in
             (spec.split(":") for spec in args.cells)]
    results, compiled = [], set()
    for model, layer, m in cells:
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent")
            break
        space = candidates(m)
        if space not in compiled and not args.matmul_only:  # each candidate list's kernels at once, when first needed
            compile_all(lambda config: compile_matmul("bf16", target="sm_90a", trans_b=True,
                                                      **vars(config)), space)
            compiled.add(space)
            print(f"{torch.cuda.get_device_name()}: {len(space)} configs compiled by "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        results.append(ab_cell(model, layer, m, args.repeat, args.batch, args.top,
                               args.matmul_only))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cells": results}, f)


if __name__ == "__main__":
    main()
