"""Short-prompt prefill A/B: the configuration ``prefill`` picks (``auto``), the one-tile kernel,
the persistent one and named variants vs torch SDPA (cuDNN, flash) in one run, at 16k tokens
total (batch * seq), heads * D = 2048; GPU time only (queued), every candidate of a shape
sampled in interleaved rounds. Prints one compact line per shape with ratios to cuDNN, and
(``--json``) one JSON line per shape.

Example: ``python bench/attention_short.py --seqs 512 1024 2048 --dims 64 128 192:128
--variant pz=c@base:auto,persistent:1,zigzag:1 --precompile 16``;
``--once`` runs each peer and variant once, untimed, e.g. under ``ncu``.

A variant is ``name=[scope@]field:value,...``: ``scope`` a ``/``-separated list of head dims
(``64``, ``192:128``) and masks (``c``, ``nc``) it applies to (none: all); the fields override
the one-tile config (``HopperPrefillConfig.for_head_dim``), or with ``base:auto`` the one
``prefill`` picks for the shape (``for_shape``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MAX_ERROR = 0.05  # max abs error vs SDPA of bf16 outputs of unit-variance inputs
BOOL_FIELDS = ("persistent", "overlap_items", "zigzag", "direct_store", "lazy_rescale",
               "exp_before_max", "pin_pv_wait", "skip_masked_tiles")
SLEEP_CYCLES = 8_000_000  # ~4 ms of spinning: longer than the host takes to queue the calls


@dataclass(frozen=True)
class Variant:
    """A named configuration rule: where it applies and what it overrides."""

    name: str
    dims: tuple = ()
    masks: tuple = ()
    base: str = "one_tile"
    fields: dict = field(default_factory=dict, hash=False)

    def applies(self, dims: str, causal: bool) -> bool:
        d = dims.partition(":")[0]
        return (not self.dims or dims in self.dims or d in self.dims) and \
            (not self.masks or causal in self.masks)

    def config(self, d: int, dv: int, seq: int, causal: bool):
        from kiln.kernels.attention.prefill_config import HopperPrefillConfig

        base = HopperPrefillConfig.for_shape(d, dv, seq, causal) if self.base == "auto" \
            else HopperPrefillConfig.for_head_dim(d, dv)
        return replace(base, **self.fields)


def parse_variant(spec: str) -> Variant:
    """``name=[scope@]field:value,...`` (the module docstring)."""
    name, _, rest = spec.partition("=")
    scope, _, fields = rest.rpartition("@")
    dims = tuple(t for t in scope.split("/") if t and t not in ("c", "nc"))
    masks = tuple(t == "c" for t in scope.split("/") if t in ("c", "nc"))
    base, kw = "one_tile", {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition(":")
        if key == "base":
            base = value
        else:
            kw[key] = value == "1" if key in BOOL_FIELDS else int(value)
    return Variant(name, dims, masks, base, kw)


BUILTIN = (Variant("auto", base="auto"), Variant("one_tile"),
           Variant("persistent", fields={"persistent": True}))


def shape_configs(variants, dims: str, seq: int, causal: bool, only) -> dict:
    """name -> config of every variant that applies to the shape (and is in ``only``)."""
    from kiln import KilnError

    d, _, dv = dims.partition(":")
    d, dv = int(d), int(dv or d)
    out = {}
    for v in variants:
        if not v.applies(dims, causal):
            continue
        if only is not None and not any(o.partition("@")[0] == v.name and (
                "@" not in o or dims in o.partition("@")[2].split("/")) for o in only):
            continue
        try:
            out[v.name] = v.config(d, dv, seq, causal)
        except KilnError as err:  # e.g. tiles that do not fit: the row says so, the rest runs
            print(f"{v.name} at {dims} {seq}: {type(err).__name__}: {str(err)[:120]}")
    return out


def _compile_job(job) -> tuple:
    """Compile one kernel into the disk cache (a worker process: no torch, no GPU)."""
    import importlib

    from kiln.kernels.attention.prefill_config import MaskSpec

    cfg, causal, hkv = job
    p = importlib.import_module("kiln.kernels.attention.prefill")
    started = time.time()
    try:
        kernel = p.make_kernel("bf16", cfg, MaskSpec(causal=causal), 1, False, False, 0.0)
        compiled = kernel.compile(*p._placeholder_args("bf16", cfg, 1), target="sm_90a",
                                  num_warps=cfg.num_warps, **p._constexprs(cfg, hkv))
        spills = compiled.metadata.get("spill_bytes")
        return (f"spills {spills} bytes" if spills else None), time.time() - started
    except Exception as err:  # reported; the timing loop meets it again and marks the row
        return f"{type(err).__name__}: {str(err)[:200]}", time.time() - started


def precompile(jobs: list, workers: int):
    """Start compiling every kernel of the run at once on ``workers`` processes (the launches
    then read them from the disk cache); returns a function that waits for them and reports.
    The caller imports torch and sets up the GPU meanwhile."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    started = time.time()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(_compile_job, job) for job in jobs]

    def join():
        for (cfg, causal, _), future in zip(jobs, futures):
            note, seconds = future.result()
            if note:
                print(f"{describe(cfg)} {'c' if causal else 'nc'} ({seconds:.1f} s): {note}")
        pool.shutdown()
        print(f"precompiled {len(jobs)} kernels on {workers} processes in "
              f"{time.time() - started:.1f} s", flush=True)
    return join


def describe(cfg) -> str:
    """A config in a few characters: ``d64 n128s3 P ov ds z`` (persistent, overlapped items,
    direct stores, zigzag; ``m``: max first, not max on demand; ``skip``: skip_masked_tiles)."""
    flags = [("P", cfg.persistent), ("ov", cfg.overlaps_items), ("ds", cfg.direct_store),
             ("z", cfg.zigzag), ("m", cfg.lazy_rescale and not cfg.exp_before_max),
             ("skip", cfg.skip_masked_tiles)]
    dims = f"d{cfg.head_dim}" + (f"v{cfg.head_dim_v}" if cfg.head_dim_v else "")
    return " ".join([dims, f"n{cfg.block_n}s{cfg.stages}"] + [f for f, on in flags if on])


def kiln_call(q, k, v, causal, cfg):
    """A no-argument launch of the Hopper prefill kernel of ``cfg`` (fresh outputs each call)."""
    import importlib

    from kiln.kernels import runtime

    # The module, not the function the package exports under the same name.
    p = importlib.import_module("kiln.kernels.attention.prefill")
    shapes = dict(d=q.shape[-1], dv=v.shape[-1], hq=q.shape[2], hkv=k.shape[2],
                  batch=q.shape[0])
    mask = p._mask_spec(causal, None, None)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        kernel, args, grid, constexprs, warps = p._operands(q, k, v, None, None, None, shapes,
                                                            mask, scale, 0.0, False, cfg=cfg)
        runtime.launch(kernel, grid, args, target="sm_90a", num_warps=warps, **constexprs)
        return args[3].reshape(*q.shape[:-1], v.shape[-1])
    return run


def interleaved_queued_ms(fns: dict, rounds: int, calls: int = 20) -> dict:
    """Median GPU ms per call of each of ``fns``, sampled in interleaved rounds (clock drift
    falls on all alike), each sample ``calls`` calls queued behind a busy stream."""
    import statistics

    import torch

    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            for _ in range(calls):
                fn()
            stop.record()
            stop.synchronize()
            samples[name].append(start.elapsed_time(stop) / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def checked(name, call, reference, hang_s: float, current: str | None):
    """Run ``call`` once under a hang guard (``faulthandler`` exits the process after
    ``hang_s``, ``current`` names the variant for the caller); its max error or None."""
    import torch

    if current:
        with open(current, "w") as f:
            f.write(name)
    faulthandler.dump_traceback_later(hang_s, exit=True)
    out = call()
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    if current:  # empty: no call in flight
        open(current, "w").close()
    return None if reference is None else (out.float() - reference).abs().max().item()


def compact(result: dict) -> str:
    """One line of a shape's row: peers' TFLOP/s, then each variant's and its cuDNN ratio."""
    shape = f"{result['dims']} {result['seq']} {'c' if result['causal'] else 'nc'}"
    peers = " ".join(f"{p}={result[p]}" for p in ("cudnn", "flash") if p in result)
    rest = " ".join(f"{n}={result[n]}({result.get(n + '/cudnn', result.get(n + '/flash'))})"
                    for n in result["names"] if n in result)
    return f"{shape} {peers} | {rest}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    ap.add_argument("--dims", nargs="+", default=["64", "128"],
                    help="head dims, D or D:Dv (e.g. 192:128)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--variant", action="append", default=[],
                    help="name=[scope@]field:value,... e.g. pz=64/c@base:auto,zigzag:1")
    ap.add_argument("--only", nargs="*", default=None,
                    help="variants to time (default all), each NAME or NAME@D1/D2")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="variants not to run: names, or prefixes ending in '_' (sk_: sk_*)")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="the shapes to run, each D[:Dv]/c|nc/SEQ[/NAME,...] (in place of dims "
                         "x masks x seqs; NAMEs: the variants there, in place of --only), e.g. "
                         "64/c/512 192:128/nc/1024/auto")
    ap.add_argument("--peers", nargs="+", default=["cudnn", "flash"])
    ap.add_argument("--once", action="store_true",
                    help="run each peer and variant once, untimed (for ncu)")
    ap.add_argument("--precompile", type=int, default=0, metavar="WORKERS",
                    help="compile every kernel of the run first on WORKERS processes")
    ap.add_argument("--compile-only", action="store_true",
                    help="with --precompile: compile, list the kernels per shape and stop")
    ap.add_argument("--json", help="append one JSON line per shape to this file")
    ap.add_argument("--done", help="skip the shapes already in this JSON-lines file")
    ap.add_argument("--hang-s", type=float, default=20.0,
                    help="exit if one first call takes longer (a hung kernel)")
    ap.add_argument("--current", help="file naming the variant of the call in flight")
    args = ap.parse_args(argv)
    masks = {"both": [True, False], "yes": [True], "no": [False]}[args.causal]
    variants = [v for v in (*BUILTIN, *map(parse_variant, args.variant))
                if not any(v.name == s or s.endswith("_") and v.name.startswith(s)
                           for s in args.skip)]
    shapes = [(dims, causal, seq) for causal in masks for dims in args.dims for seq in args.seqs]
    only = {}  # shape -> the variants run there
    if args.shapes is not None:
        shapes = []
        for spec in args.shapes:
            dims, mask, seq, *names = spec.split("/")
            shapes.append((dims, mask == "c", int(seq)))
            only[shapes[-1]] = names[0].split(",") if names else args.only
    only = {shape: only.get(shape, args.only) for shape in shapes}
    done = set()
    if args.done and os.path.exists(args.done):
        with open(args.done) as f:
            done = {(r["dims"], r["causal"], r["seq"]) for r in map(json.loads, f)}
    shapes = [s for s in shapes if s not in done]
    if args.precompile:
        jobs = {(cfg, causal, 2048 // int(dims.partition(":")[0]))
                for dims, causal, seq in shapes
                for cfg in shape_configs(variants, dims, seq, causal,
                                         only[dims, causal, seq]).values()}
        joined = precompile(sorted(jobs, key=repr), args.precompile)
    if args.compile_only:
        if args.precompile:
            joined()
        for dims, causal, seq in shapes:
            configs = shape_configs(variants, dims, seq, causal, only[dims, causal, seq])
            print(dims, seq, "c" if causal else "nc",
                  "; ".join(f"{n}: {describe(c)}" for n, c in configs.items()))
        return
    from attention import row_flops, sdpa_call
    import torch

    torch.cuda.init()
    if args.precompile:  # compiled while torch loaded
        joined()

    started = time.time()
    for dims, causal, seq in shapes:
        d, _, dv = dims.partition(":")
        d, dv = int(d), int(dv or d)
        hq = 2048 // d
        batch = max(1, args.tokens // seq)
        row = dict(batch=batch, seq=seq, hq=hq, hkv=hq, d=d, dv=dv, causal=causal)
        q, k, v = (torch.randn(batch, seq, hq, n, device="cuda", dtype=torch.bfloat16)
                   for n in (d, d, dv))
        flops = row_flops(row)
        result = dict(row, dims=dims)
        fns, reference = {}, None
        for name in args.peers:
            call = sdpa_call(name, q, k, v, causal)  # runs it once
            if call is not None:
                fns[name] = call
                if reference is None and not args.once:
                    reference = call().transpose(1, 2).float()
        if reference is None and not args.once:  # no backend takes it
            reference = torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(1, 2).float() for x in (q, k, v)),
                is_causal=causal).transpose(1, 2)
        configs = shape_configs(variants, dims, seq, causal, only[dims, causal, seq])
        result["names"] = list(configs)
        for name, cfg in configs.items():
            call = kiln_call(q, k, v, causal, cfg)
            error = checked(name, call, reference, args.hang_s, args.current)
            if error is not None and not error < MAX_ERROR:
                result[name] = f"WRONG {error:.3g}"
                continue
            fns[name] = call
        if not args.once:
            times = interleaved_queued_ms(fns, args.repeat)
            for name, ms in times.items():
                result[name] = round(flops / ms / 1e9, 1)
            peer = next((p for p in ("cudnn", "flash") if p in times), None)
            for name in configs:
                if name in times and peer:
                    result[f"{name}/{peer}"] = round(times[peer] / times[name], 3)
        result["t"] = round(time.time() - started, 1)
        print(compact(result), f"t={result['t']}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
