"""Short-prompt prefill A/B: Kiln's one-tile-per-CTA kernel vs its persistent variant (and other
configs) vs torch SDPA (cuDNN, flash) in one run, at 16k tokens total (batch * seq), heads * D
= 2048; GPU time only (queued). Prints one JSON line per row with ratios to cuDNN.

Example: ``python bench/attention_short.py --seqs 512 1024 2048 8192 --dims 64 128 192:128``;
``--once`` runs each peer and variant once, untimed, e.g. under ``ncu``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import row_flops, sdpa_call  # noqa: E402
from timing import queued_ms  # noqa: E402

MAX_ERROR = 0.05  # max abs error vs SDPA of bf16 outputs of unit-variance inputs
BOOL_FIELDS = ("persistent", "overlap_items", "zigzag", "direct_store", "lazy_rescale",
               "exp_before_max", "pin_pv_wait")


def variants(d: int, extra: list[str], dv: int | None = None) -> dict:
    """Named Hopper configs to A/B: ``auto`` (None: what ``prefill`` picks for the shape), the
    one-tile kernel, the persistent one, and ``extra`` (``name=[dims@]field:value,...``
    overrides of the one-tile config, ``dims`` a ``/``-separated list of the head dims they
    apply to)."""
    from kiln.kernels.attention.prefill_config import HopperPrefillConfig

    base = HopperPrefillConfig.for_head_dim(d, dv)
    out = {"auto": None, "one_tile": base, "persistent": replace(base, persistent=True)}
    for spec in extra:
        name, _, fields = spec.partition("=")
        dims, _, fields = fields.rpartition("@") if "@" in fields else ("", "", fields)
        if dims and str(d) not in dims.split("/"):
            continue
        kw = {}
        for item in fields.split(","):
            key, _, value = item.partition(":")
            kw[key] = value == "1" if key in BOOL_FIELDS else int(value)
        out[name] = replace(base, **kw)
    return out


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

    def run():  # cfg None: the configuration prefill picks for the shape
        kernel, args, grid, constexprs, warps = p._operands(q, k, v, None, None, None, shapes,
                                                            mask, scale, 0.0, False, cfg=cfg)
        runtime.launch(kernel, grid, args, target="sm_90a", num_warps=warps, **constexprs)
        return args[3].reshape(*q.shape[:-1], v.shape[-1])
    return run


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    ap.add_argument("--dims", nargs="+", default=["64", "128"],
                    help="head dims, D or D:Dv (e.g. 192:128)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--variant", action="append", default=[],
                    help="name=[64/128@]field:value,... e.g. n128=64@persistent:1,block_n:128")
    ap.add_argument("--only", nargs="*", default=None,
                    help="variants to time (default all), each NAME or NAME@D1/D2")
    ap.add_argument("--peers", nargs="+", default=["cudnn", "flash"])
    ap.add_argument("--once", action="store_true",
                    help="run each peer and variant once, untimed (for ncu)")
    args = ap.parse_args(argv)
    masks = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    started = time.time()
    for dims in args.dims:
        d, _, dv = dims.partition(":")
        d, dv = int(d), int(dv or d)
        hq = 2048 // d
        configs = variants(d, args.variant, dv)
        if args.only is not None:
            wanted = {o.partition("@")[0] for o in args.only
                      if "@" not in o or dims in o.partition("@")[2].split("/")}
            configs = {n: c for n, c in configs.items() if n in wanted}
        for causal in masks:
            for seq in args.seqs:
                batch = max(1, args.tokens // seq)
                row = dict(batch=batch, seq=seq, hq=hq, hkv=hq, d=d, dv=dv, causal=causal)
                q, k, v = (torch.randn(batch, seq, hq, n, device="cuda", dtype=torch.bfloat16)
                           for n in (d, d, dv))
                flops = row_flops(row)
                result = dict(row)
                reference = None
                for name in args.peers:
                    call = sdpa_call(name, q, k, v, causal)  # runs it once
                    if call is None or args.once:
                        continue
                    if reference is None:
                        reference = call().transpose(1, 2).float()
                    result[name] = round(flops / queued_ms(call, args.repeat) / 1e9, 1)
                if reference is None and not args.once:  # no backend takes it (192 / 128)
                    reference = torch.nn.functional.scaled_dot_product_attention(
                        *(x.transpose(1, 2).float() for x in (q, k, v)),
                        is_causal=causal).transpose(1, 2)
                best = max(result.get("cudnn", 0), result.get("flash", 0))
                for name, cfg in configs.items():
                    call = kiln_call(q, k, v, causal, cfg)
                    if args.once:
                        call()
                        continue
                    error = (call().float() - reference).abs().max().item()
                    if not error < MAX_ERROR:
                        result[name] = f"WRONG {error:.3g}"
                        continue
                    tflops = flops / queued_ms(call, args.repeat) / 1e9
                    result[name] = round(tflops, 1)
                    result[f"{name}/cudnn"] = round(tflops / result["cudnn"], 3) \
                        if "cudnn" in result else None
                    result[f"{name}/best"] = round(tflops / best, 3) if best else None
                result["t"] = round(time.time() - started, 1)
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
