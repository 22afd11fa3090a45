"""A/B of Hopper GEMM configs on chosen LLM cells against cuBLAS, as ``matmul`` runs them.

For each cell (``model:layer:M``, weights stored N x K as in ``bench/gemm.py --llm``; or
``MxNxK`` with B stored K x N, as ``bench/gemm.py`` times 4096^3): ``torch.matmul``
(cuBLAS), ``matmul`` itself (its small-M pick, or the autotuner's, tuned before timing) and
each candidate config of :data:`CANDIDATES` for that M, each checked against float32 first
(relative error < 1e-2), then all timed together with their samples interleaved
(``gemm_llm.measure_pair``: samples of about 2 ms of GPU time, one clock and power state for
all), two ways:

* ``gpu``: kernels only (calls queued behind a busy stream);
* ``call``: ``--batch`` back-to-back calls of the config's bound plan (what a repeat
  ``matmul`` call runs: one allocation, one or two bound launches), host time included,
  as the LLM sweep's ``ratio`` column times ``matmul``.

Prints per cell ``matmul``'s line and the ``--top`` best configs by GPU ratio: cuBLAS time /
Kiln time for both, microseconds, the config (every row is in ``--json``).
``--matmul-only`` (or cells outside ``--ab-min-m``/``--ab-max-m``/``--ab-cells``) times
``matmul``'s own pick alone (a quick check of the defaults); ``--configs`` /
``--large-configs`` (``field=value,...`` text; or ``cell@config+config`` per cell) time those
configs at the A/B cells of M up to
512 / above instead of the candidate lists (``--configs-min-m``: cells of smaller M keep the
lists); ``--precompile I/N`` fills the disk cache first
from N processes. ``--budget`` seconds stops between cells. Usage::

    python bench/gemm_ab.py --cells llama3-8b:o:64 llama3-8b:down:1 4096x4096x4096 \
        [--ab-cells llama3-8b:o:64] [--json ab.json]
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
from kiln.kernels.gemm import (HOPPER_CONFIGS, HopperGemmConfig, compile_matmul,
                               hopper_autotuner, matmul)
from kiln.kernels.gemm.small_m import SMALL_M, chosen_config
from gemm_llm import MODELS, measure_pair

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
         C(block_m=64, block_n=128, stages=8, split_k=4, pdl=True),
         # whole-K swap-AB through the reduction kernel; 64-row swap tiles cut 8 ways; a
         # deeper 64 x 256 ring (its C staged in two halves); 64 x 256 stream-K
         C(block_n=32, stages=8, swap_ab=True, pdl=True),
         C(block_m=64, block_n=32, stages=12, swap_ab=True, split_k=8, pdl=True),
         C(block_m=64, block_n=256, stages=5),
         C(block_m=64, block_n=256, stages=4, stream_k=True, pdl=True),
         C(block_m=64, block_n=128, stages=8, stream_k=True, pdl=True),
         # deeper rings of the direct / 2-slice swap-AB tiles (more weight bytes in flight)
         C(block_n=32, stages=10, swap_ab=True, fused_reduce=True, pdl=True),
         C(block_n=32, stages=10, swap_ab=True, split_k=2, pdl=True),
         C(gemv=True)),  # the decode GEMV (M <= 4)
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
         C(block_m=64, block_n=192, stages=5, stream_k=True, pdl=True),
         C(block_m=64, block_n=256, stages=4, stream_k=True, pdl=True)),
    SMALL_M: (C(), C(stream_k=True), C(block_n=192), C(block_n=192, pdl=True),
              C(block_n=128, stages=6), C(block_n=128, stages=6, pdl=True),
              C(block_n=128, stages=6, cluster_m=2), C(cluster_m=2), C(block_n=192, cluster_m=2),
              C(block_n=128, stages=6, split_k=2, pdl=True), C(split_k=2, pdl=True),
              C(block_n=192, split_k=2, pdl=True), C(block_n=128, stages=6, split_k=3, pdl=True),
              C(block_m=64, block_n=128, stages=8, pdl=True), C(block_m=64, block_n=128, stages=8),
              C(block_m=64, block_n=256, stages=4), C(block_m=64, block_n=192, stages=5),
              C(block_n=128, stages=6, stream_k=True, pdl=True),
              C(block_n=192, stream_k=True, pdl=True), C(stream_k=True, pdl=True),
              C(block_m=64, block_n=256, stages=4, stream_k=True, pdl=True),
              C(stream_k=True, group_m=16), C(block_n=192, stream_k=True),
              # odd multiples of 32 columns (B stored N x K): 70B QKV M = 256 makes 128
              # tiles of 128 x 160, 8B QKV M = 256 128 of 128 x 96
              C(block_n=160), C(block_n=160, stages=5), C(block_n=160, pdl=True),
              C(block_n=160, cluster_m=2), C(block_n=96, stages=6), C(block_n=96, stages=7),
              C(block_n=96, stages=6, cluster_m=2), C(block_n=128, stages=5, cluster_m=2)),
    # the large-GEMM autotuner's space and its neighbours
    1 << 30: HOPPER_CONFIGS + (C(group_m=16), C(block_n=192, group_m=16),
                               C(cluster_m=2, group_m=16), C(block_n=192, stream_k=True),
                               C(stages=3, cluster_m=2), C(block_n=128, stages=6, cluster_m=2),
                               C(block_m=64, block_n=256, stages=4, pingpong=True),
                               C(group_m=4), C(pdl=True),
                               C(block_n=128, stages=6, stream_k=True),
                               C(block_n=128, stages=5, stream_k=True, group_m=16),
                               C(block_n=160), C(block_n=160, stages=5),
                               C(block_n=160, cluster_m=2), C(block_n=224, stages=3),
                               C(block_n=224), C(block_n=224, stages=3, cluster_m=2)),
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


def parse_cell(spec: str) -> tuple:
    """``(label, m, n, k, trans_b)`` of ``model:layer:M`` (weights N x K, ``trans_b``) or of
    ``MxNxK`` (B stored K x N, as ``bench/gemm.py`` times 4096^3), either followed by
    ``@config+config...`` (the configs timed there, see :func:`_fixed`)."""
    spec = spec.partition("@")[0]
    if ":" in spec:
        model, layer, m = spec.split(":")
        n, k = MODELS[model][layer]
        return f"{model} {layer} M={m}", int(m), n, k, True
    m, n, k = map(int, spec.lower().split("x"))
    return f"{m}x{n}x{k} (B: K x N)", m, n, k, False


def bound_call(x, w, config, trans_b: bool = True):
    """A repeat ``matmul(x, w, trans_b=...)`` call of ``config``: its bound plan's work."""
    n = w.shape[0] if trans_b else w.shape[1]
    c = torch.empty(x.shape[0], n, device="cuda", dtype=x.dtype)
    plan = gemm._bind(x, w, c, trans_b, "sm_90a", config)
    xp, wp = x.data_ptr(), w.data_ptr()

    def call():
        out = plan.fresh_c.one()
        plan.bound(xp, wp, out.data_ptr())
        return out
    return call


def parse_config(spec: str) -> HopperGemmConfig:
    """A config from ``--configs`` text: ``default`` or ``field=value`` pairs joined by
    commas, e.g. ``block_n=128,stages=6,stream_k=1``."""
    if spec == "default":
        return C()
    types = {f.name: f.type for f in fields(C)}
    values = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--configs: no HopperGemmConfig field {name!r} in {spec!r}")
        values[name] = value.lower() in ("1", "true") if types[name] in (bool, "bool") \
            else int(value)
    return C(**values)


def cell_configs(m: int, trans_b: bool, matmul_only: bool, fixed=None) -> list:
    """The candidates timed at a cell: ``fixed`` (``--configs``) or those of its M (none with
    ``matmul_only``), without swap-AB or odd multiples of 32 columns where B is stored K x N."""
    space = candidates(m) if fixed is None else fixed
    return [] if matmul_only else [c for c in space
                                   if trans_b or not (c.swap_ab or c.block_n % 64)]


def ab_cell(spec: str, repeat: int, batch: int, top: int = 5,
            matmul_only: bool = False, fixed=None) -> dict:
    """cuBLAS, ``matmul`` and every candidate of one cell, each checked, then timed with their
    samples interleaved (``gemm_llm.measure_pair``: one clock and power state for all)."""
    label, m, n, k, trans_b = parse_cell(spec)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = w if trans_b else w.T.contiguous()
    reference = x.float() @ w.float().T
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b_major = "k" if trans_b else "mn"
    pick = chosen_config(m, n, k, "bf16", b_major, "bf16", sms=sms) if m <= SMALL_M else None
    configs = cell_configs(m, trans_b, matmul_only, fixed)
    if pick is not None and pick not in configs and not matmul_only:
        configs.append(pick)
    matmul(x, b, trans_b=trans_b)  # tunes M > SMALL_M (the autotuner's pick) before timing
    tuned = pick or hopper_autotuner.cached((None, None, None, m, n, k, "bf16", b_major, "bf16",
                                             None), {})
    fns = {"cublas": (lambda: torch.matmul(x, w.T)) if trans_b else (lambda: torch.matmul(x, b)),
           "matmul": lambda: matmul(x, b, trans_b=trans_b)}
    rows = {}
    for config in configs:
        name = short(config)
        try:
            call = bound_call(x, b, config, trans_b)
            err = error(call(), reference)
        except kiln.KilnError as exc:  # a candidate that cannot run is reported, not fatal
            rows[name] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            continue
        if not err < 1e-2:  # nor is a wrong one (NaN included)
            rows[name] = {"rel_error": err}
            continue
        fns[name] = call
        rows[name] = {"rel_error": err}
    err = error(matmul(x, b, trans_b=trans_b), reference)
    if not err < 1e-2:
        raise SystemExit(f"matmul wrong at {label}: relative error {err}")
    times = dict(zip(fns, measure_pair(torch, list(fns.values()), repeat, batch)))
    cublas_call, cublas_gpu = times.pop("cublas")
    print(f"{label} N={n} K={k}: cuBLAS {cublas_gpu * 1e3:.1f} us gpu, {cublas_call * 1e3:.1f} us"
          f" call; matmul runs {short(tuned) if tuned else 'tuned'}", flush=True)
    for name, (call_ms, gpu_ms) in times.items():
        rows.setdefault(name, {}).update(
            gpu_ms=gpu_ms, call_ms=call_ms, gpu_ratio=cublas_gpu / gpu_ms,
            call_ratio=cublas_call / call_ms)
    for name, row in rows.items():
        if "gpu_ms" not in row:
            print(f"    NOT TIMED {name}: {row.get('failed') or row}")
    timed = sorted((name for name in rows if "gpu_ms" in rows[name]),
                   key=lambda name: -rows[name]["gpu_ratio"])
    shown = ["matmul"] + [name for name in timed if name != "matmul"][:top]
    for name in shown:
        r = rows[name]
        print(f"  gpu {r['gpu_ratio']:.3f} ({r['gpu_ms'] * 1e3:7.1f} us) call "
              f"{r['call_ratio']:.3f} ({r['call_ms'] * 1e3:7.1f} us)  {name}", flush=True)
    return {"cell": spec, "label": label, "m": m, "n": n, "k": k, "trans_b": trans_b,
            "cublas_gpu_ms": cublas_gpu, "cublas_call_ms": cublas_call,
            "matmul_config": short(tuned) if tuned else None, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", required=True, help="model:layer:M or MxNxK")
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
    parser.add_argument("--ab-cells", nargs="*",
                        help="only these cells A/B candidates (the rest time matmul alone)")
    parser.add_argument("--configs", nargs="+", type=parse_config,
                        help="time these configs at the A/B cells of M <= 512 instead of "
                             "CANDIDATES: 'default' or e.g. block_n=128,stages=6,stream_k=1")
    parser.add_argument("--configs-min-m", type=int, default=0,
                        help="A/B cells of smaller M time the candidate lists, not --configs")
    parser.add_argument("--large-configs", nargs="+", type=parse_config,
                        help="the same for the A/B cells of M > 512")
    parser.add_argument("--precompile", metavar="I/N",
                        help="compile shard I of N of the run's kernels into the disk cache and "
                             "exit (run N such processes at once before the timed run)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the host path of the first cell's matmul calls")
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    ab = [spec for spec in args.cells if not args.matmul_only
          and args.ab_min_m <= parse_cell(spec)[1] <= args.ab_max_m
          and (args.ab_cells is None or spec in args.ab_cells)]
    if args.precompile:
        shard, shards = map(int, args.precompile.split("/"))
        compile_all(_compile, _kernels(args.cells, ab, args.configs, args.large_configs,
                                       args.configs_min_m)[shard::shards])
        return
    results = []
    for spec in args.cells:
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent")
            break
        if args.profile and not results:
            _profile(spec)
        fixed = _fixed(spec, args.configs, args.large_configs, args.configs_min_m)
        results.append(ab_cell(spec, args.repeat, args.batch, args.top, spec not in ab, fixed))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "cells": results}, f)


def _compile(job) -> None:
    config, trans_b = job
    compile_matmul("bf16", target="sm_90a", trans_b=trans_b, **vars(config))


def _fixed(spec: str, fixed, fixed_large, fixed_min_m: int = 0):
    """The configs given for cell ``spec`` (None: its candidate list): those after its ``@``
    (``field=value,...`` texts joined by ``+``), else ``fixed`` / ``fixed_large`` by M."""
    if "@" in spec:
        return [parse_config(text) for text in spec.partition("@")[2].split("+")]
    m = parse_cell(spec)[1]
    if m > SMALL_M:
        return fixed_large
    return fixed if m >= fixed_min_m else None


def _kernels(cells, ab, fixed=None, fixed_large=None, fixed_min_m=0) -> list:
    """Every (config, trans_b) the run compiles: the A/B cells' candidates (``fixed`` and
    ``fixed_large`` replacing those of ``fixed_min_m`` <= M <= 512 and above), each cell's
    pick (small M), the large-GEMM autotuner's space (large M), in a fixed order."""
    jobs = set()
    for spec in cells:
        _, m, n, k, trans_b = parse_cell(spec)
        space = _fixed(spec, fixed, fixed_large, fixed_min_m)
        jobs.update((c, trans_b) for c in cell_configs(m, trans_b, spec not in ab, space))
        if m > SMALL_M:
            jobs.update((c, trans_b) for c in HOPPER_CONFIGS)
        else:
            jobs.add((chosen_config(m, n, k, "bf16", "k" if trans_b else "mn", "bf16"), trans_b))
    return sorted(jobs, key=repr)


def _profile(spec: str, calls: int = 300) -> None:
    """The top host functions of ``calls`` repeat ``matmul`` calls (the GPU kept busy)."""
    import cProfile
    import pstats

    label, m, n, k, trans_b = parse_cell(spec)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*((n, k) if trans_b else (k, n)), device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        matmul(x, w, trans_b=trans_b)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        matmul(x, w, trans_b=trans_b)
    profile.disable()
    torch.cuda.synchronize()
    print(f"host profile of {calls} matmul calls, {label}:")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    for line in text.getvalue().splitlines():
        if line.strip():
            print(f"P {line.strip()}")


if __name__ == "__main__":
    main()
