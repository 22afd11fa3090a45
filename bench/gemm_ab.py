"""A/B of Hopper GEMM configs on chosen LLM cells against cuBLAS, as ``matmul`` runs them.

For each cell (``model:layer:M``, weights stored N x K as in ``bench/gemm.py --llm``) and each
candidate config of :data:`CANDIDATES` for that M (plus ``matmul``'s own pick): the result is
checked against float32 (relative error < 1e-2), then timed two ways in this process (``gemm_llm.measure``: samples of about 2 ms of GPU
time), beside ``torch.matmul(x, w.T)`` (cuBLAS):

* ``gpu``: kernels only (calls queued behind a busy stream);
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
import io
import json
import time
from dataclasses import fields

try:
    import torch
except ImportError:  # the candidate lists (and --help) work without torch
    torch = None

import kiln
from kiln.autotune import compile_all
from kiln.kernels import gemm
from kiln.kernels.gemm import HOPPER_CONFIGS, HopperGemmConfig, compile_matmul, matmul
from kiln.kernels.gemm.small_m import SMALL_M, chosen_config
from gemm_llm import MODELS, measure

C = HopperGemmConfig
# Candidates by the largest M they are tried at (decode, prefill-chunk, then prefill sizes).
CANDIDATES = {
    16: (C(block_n=32, stages=8, swap_ab=True, split_k=4, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, split_k=2, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, split_k=8, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, split_k=16, pdl=True),
         C(block_n=32, stages=8, swap_ab=True, stream_k=True, pdl=True),
         C(block_n=32, stages=10, swap_ab=True, split_k=4, pdl=True),
         C(block_m=64, block_n=32, stages=12, swap_ab=True, split_k=2, pdl=True),
         C(block_m=64, block_n=32, stages=12, swap_ab=True, split_k=4, pdl=True),
         C(block_m=64, block_n=32, stages=12, swap_ab=True, stream_k=True, pdl=True),
         C(block_m=192, block_n=32, stages=6, swap_ab=True, split_k=4, pdl=True,
           consumer_registers=152),
         C(block_m=256, block_n=32, stages=5, swap_ab=True, split_k=4, pdl=True,
           consumer_registers=112),
         C(block_m=256, block_n=32, stages=5, swap_ab=True, stream_k=True, pdl=True,
           consumer_registers=112),
         C(block_n=32, stages=8, swap_ab=True, split_k=4, fused_reduce=True, pdl=True),
         # swap-AB over all of K, C stored directly (one launch)
         C(block_n=32, stages=8, swap_ab=True, fused_reduce=True, pdl=True),
         C(block_m=64, block_n=32, stages=12, swap_ab=True, fused_reduce=True, pdl=True),
         C(block_m=256, block_n=32, stages=5, swap_ab=True, fused_reduce=True, pdl=True,
           consumer_registers=112),
         C(block_m=64, block_n=256, stages=4),
         C(block_m=64, block_n=192, stages=5, stream_k=True, pdl=True),
         C(block_m=64, block_n=128, stages=8, split_k=4, pdl=True)),
    64: (C(block_n=32, stages=8, swap_ab=True, split_k=4, pdl=True),
         C(block_n=64, stages=8, swap_ab=True, split_k=4, pdl=True),
         C(block_m=64, block_n=64, stages=12, swap_ab=True, split_k=2, pdl=True),
         C(block_m=64, block_n=64, stages=12, swap_ab=True, split_k=4, pdl=True),
         C(block_m=64, block_n=64, stages=12, swap_ab=True, fused_reduce=True, pdl=True),
         C(block_m=64, block_n=64, stages=12, split_k=2, pdl=True),
         C(block_m=64, block_n=64, stages=12, split_k=4, pdl=True),
         C(block_m=64, block_n=128, stages=8, split_k=2, pdl=True),
         C(block_m=64, block_n=128, stages=8, split_k=4, pdl=True),
         C(block_m=64, block_n=128, stages=9, split_k=4, pdl=True),
         C(block_m=64, block_n=128, stages=8, split_k=4, fused_reduce=True, pdl=True),
         C(block_m=64, block_n=128, stages=9, stream_k=True, pdl=True),
         C(block_m=64, block_n=256, stages=4),
         C(block_m=64, block_n=256, stages=4, split_k=2, pdl=True),
         C(block_m=64, block_n=192, stages=5, stream_k=True, pdl=True)),
    SMALL_M: (C(), C(stream_k=True), C(block_n=192), C(block_n=192, pdl=True),
              C(block_n=128, stages=6), C(block_n=128, stages=6, pdl=True),
              C(block_n=128, stages=6, cluster_m=2), C(cluster_m=2), C(block_n=192, cluster_m=2),
              C(block_n=128, stages=6, split_k=2, pdl=True), C(split_k=2, pdl=True),
              C(block_n=192, split_k=2, pdl=True), C(block_n=128, stages=6, split_k=3, pdl=True),
              C(block_m=64, block_n=128, stages=8, pdl=True), C(block_m=64, block_n=128, stages=8),
              C(block_m=64, block_n=256, stages=4), C(block_m=64, block_n=192, stages=5),
              C(block_n=128, stages=6, stream_k=True, pdl=True),
              C(block_n=192, stream_k=True, pdl=True), C(stream_k=True, pdl=True),
              C(block_m=64, block_n=256, stages=4, stream_k=True, pdl=True)),
    # the large-GEMM autotuner's space and its neighbours
    1 << 30: HOPPER_CONFIGS + (C(group_m=16), C(block_n=192, group_m=16),
                               C(cluster_m=2, group_m=16), C(block_n=192, stream_k=True),
                               C(stages=3, cluster_m=2), C(block_n=128, stages=6, cluster_m=2),
                               C(block_m=64, block_n=256, stages=4, pingpong=True),
                               C(group_m=4), C(pdl=True)),
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
    cublas_call, cublas_gpu = measure(torch, cublas, repeat, batch)
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
    host, gpu = measure(torch, call, repeat, batch)
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
    parser.add_argument("--ab-min-m", type=int, default=0,
                        help="cells of smaller M time matmul's pick alone")
    parser.add_argument("--ab-max-m", type=int, default=1 << 30,
                        help="cells of larger M time matmul's pick alone")
    parser.add_argument("--precompile", metavar="I/N",
                        help="compile shard I of N of the run's kernels into the disk cache and "
                             "exit (run N such processes at once before the timed run)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the host path of the first cell's matmul calls")
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    cells = [(model, layer, int(m)) for model, layer, m in
             (spec.split(":") for spec in args.cells)]
    ab = [(model, layer, m) for model, layer, m in cells
          if not args.matmul_only and args.ab_min_m <= m <= args.ab_max_m]
    if args.precompile:
        shard, shards = map(int, args.precompile.split("/"))
        compile_all(_compile, _kernels(cells, ab)[shard::shards])
        return
    results, compiled = [], set()
    for model, layer, m in cells:
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent")
            break
        space = candidates(m) if (model, layer, m) in ab else ()
        if space and space not in compiled:  # each candidate list's kernels when first needed
            compile_all(_compile, space)
            compiled.add(space)
            print(f"{torch.cuda.get_device_name()}: {len(space)} configs compiled by "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        if args.profile and not results:
            _profile(model, layer, m)
        results.append(ab_cell(model, layer, m, args.repeat, args.batch, args.top,
                               (model, layer, m) not in ab))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cells": results}, f)


def _compile(config) -> None:
    compile_matmul("bf16", target="sm_90a", trans_b=True, **vars(config))


def _kernels(cells, ab) -> list:
    """Every config the run compiles: the A/B cells' candidates, each cell's pick (small M),
    the large-GEMM autotuner's space (large M), in a fixed order."""
    configs = {c for _, _, m in ab for c in candidates(m)}
    for _, layer_name, m in cells:
        if m > SMALL_M:
            configs.update(HOPPER_CONFIGS)
    for model, layer_name, m in cells:
        n, k = MODELS[model][layer_name]
        pick = chosen_config(m, n, k, "bf16", "k", "bf16") if m <= SMALL_M else None
        if pick:
            configs.add(pick)
    return sorted(configs, key=repr)


def _profile(model: str, layer: str, m: int, calls: int = 300) -> None:
    """The top host functions of ``calls`` repeat ``matmul`` calls (the GPU kept busy)."""
    import cProfile
    import pstats

    n, k = MODELS[model][layer]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        matmul(x, w, trans_b=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        matmul(x, w, trans_b=True)
    profile.disable()
    torch.cuda.synchronize()
    print(f"host profile of {calls} matmul calls, {model} {layer} M={m}:")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    for line in text.getvalue().splitlines():
        if line.strip():
            print(f"P {line.strip()}")


if __name__ == "__main__":
    main()
