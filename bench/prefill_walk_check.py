"""Where a persistent prefill walk goes wrong on the GPU: one launch of a Hopper prefill config
against a float32 SDPA reference, with the error summarised per work item (its CTA, its round
on that CTA, and each consumer group's 64 rows), so a wrong walk shows which items, rounds and
groups it breaks and what their rows hold. One JSON line per run; small grids (``--ctas``)
make a run short enough for ``compute-sanitizer``.

Example: ``python bench/prefill_walk_check.py --shape 64/c/512 --batch 2 --heads 4 --ctas 2
--variant persistent:1,overlap_items:1,direct_store:1``
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

BAD = 0.05  # max abs error of a 64-row group that counts as wrong (bf16, unit-variance inputs)


def parse_fields(spec: str) -> dict:
    """``field:value,...`` -> HopperPrefillConfig overrides (0/1 for the bool fields)."""
    from attention_short import BOOL_FIELDS

    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        out[key] = value == "1" if key in BOOL_FIELDS else int(value)
    return out


def item_of(tile: int, head: int, batch: int, tiles: int, heads: int, batches: int,
            causal: bool) -> int:
    """The work item of (query tile, head, batch): ``prefill_hopper_steps._work_item``'s
    inverse for one KV head per query head, no zigzag."""
    if causal:
        return (tiles - 1 - tile) * heads * batches + batch * heads + head
    return (batch * heads + head) * tiles + tile


def tile_of(item: int, tiles: int, heads: int, batches: int, causal: bool) -> tuple:
    """``(query tile, head, batch)`` of a work item: :func:`item_of`'s inverse."""
    if causal:
        rest = item % (heads * batches)
        return tiles - 1 - item // (heads * batches), rest % heads, rest // heads
    rest = item // tiles
    return item % tiles, rest % heads, rest // heads


def last_tile_start(tile: int, cfg, seq: int, causal: bool) -> int:
    """The first key of the last key tile query tile ``tile`` visits."""
    end = min((tile + 1) * cfg.block_m, seq) if causal else seq
    return (end - 1) // cfg.block_n * cfg.block_n


def partial_reference(host, b: int, h: int, rows: slice, causal: bool, keep):
    """The reference rows ``rows`` of (batch ``b``, head ``h``) with only the keys ``n`` where
    ``keep(n)`` in the numerator (the softmax's row sums over every key)."""
    import numpy as np

    q, k, v = (x[b, :, h].astype(np.float64) for x in host)
    s = q[rows] @ k.T / math.sqrt(q.shape[-1])
    keys = np.arange(k.shape[0])
    if causal:
        s = np.where(keys[None, :] <= np.arange(rows.start, rows.stop)[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w * keep(keys)[None, :]) @ v


def reference(host, causal: bool, device):
    """float32 attention of the bf16 inputs ``host`` ([B, S, H, D] numpy), [B, S, H, Dv]:
    on ``device`` through torch, or in numpy where it is None."""
    import numpy as np

    if device is not None:
        import torch

        q, k, v = (torch.from_numpy(x.astype(np.float32)).to(device).transpose(1, 2)
                   for x in host)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.transpose(1, 2).cpu().numpy()
    q, k, v = (x.astype(np.float32).transpose(0, 2, 1, 3) for x in host)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return ((w / w.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="64/c/512", help="D[:Dv]/c|nc/SEQ")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctas", type=int, default=0, help="persistent grid size (0: one per SM)")
    ap.add_argument("--variant", default="", help="field:value,... over for_shape's config")
    ap.add_argument("--show", type=int, default=4, help="wrong items described")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interpret", action="store_true", help="run the kernel in the interpreter")
    args = ap.parse_args(argv)

    import importlib

    import ml_dtypes
    import numpy as np
    from kiln.kernels import runtime
    from kiln.kernels.attention.prefill_config import HopperPrefillConfig

    p = importlib.import_module("kiln.kernels.attention.prefill")
    dims, mask, seq = args.shape.split("/")
    d, _, dv = dims.partition(":")
    d, dv, seq, causal = int(d), int(dv or d), int(seq), mask == "c"
    cfg = replace(HopperPrefillConfig.for_shape(d, dv, seq, causal), **parse_fields(args.variant))
    if args.ctas:
        p.runtime.multiprocessor_count = lambda: args.ctas
        p.INTERPRET_CTAS = args.ctas
    rng = np.random.default_rng(args.seed)
    b, h = args.batch, args.heads
    host = [rng.standard_normal((b, seq, h, n), np.float32).astype(ml_dtypes.bfloat16)
            for n in (d, d, dv)]
    if args.interpret:
        q, k, v = host
    else:
        import torch

        q, k, v = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in host)
    ref = reference(host, causal, None if args.interpret else q.device)
    shapes = dict(d=d, dv=dv, hq=h, hkv=h, batch=b)
    kernel, kargs, grid, constexprs, warps = p._operands(
        q, k, v, None, None, None, shapes, p._mask_spec(causal, None, None),
        1.0 / math.sqrt(d), 0.0, False, interpret=args.interpret, cfg=cfg)
    kargs[3][...] = float("nan")  # poisoned: rows the kernel never writes show up
    started = time.time()
    run = runtime.interpret if args.interpret else runtime.launch
    run(kernel, grid, kargs, target="sm_90a", num_warps=warps, **constexprs)
    out = kargs[3] if args.interpret else kargs[3].cpu().view(torch.int16).numpy().view(np.uint16)
    out = out.view(ml_dtypes.bfloat16).astype(np.float32).reshape(b, seq, h, dv)
    tiles = -(-seq // cfg.block_m)
    ctas = grid[0] if cfg.persistent else 0
    err = np.nan_to_num(np.abs(out - ref), nan=1e9).max(-1)  # [b, seq, h]
    pad = tiles * cfg.block_m - seq
    err = np.pad(err, ((0, 0), (0, pad), (0, 0))).reshape(b, tiles, 2, 64, h)
    group_err = err.max(3)  # [b, tiles, 2 groups, h]: the worst of each group's 64 rows
    result = dict(shape=args.shape, batch=b, heads=h, grid=list(grid), ctas=ctas,
                  variant=args.variant, max_error=round(float(group_err.max()), 4),
                  nan_rows=int(np.isnan(out).any(-1).sum()), s=round(time.time() - started, 2))
    wrong = []
    for bi in range(b):
        for t in range(tiles):
            for hi in range(h):
                e = group_err[bi, t, :, hi]
                if float(e.max()) > BAD:
                    item = item_of(t, hi, bi, tiles, h, b, causal)
                    wrong.append((item, bi, t, hi, [round(float(x), 3) for x in e]))
    wrong.sort()
    result["wrong_items"] = len(wrong)
    result["items"] = tiles * h * b
    if ctas and wrong:
        result["wrong_rounds"] = sorted({w[0] // ctas for w in wrong})[:12]
        result["wrong_ctas"] = sorted({w[0] % ctas for w in wrong})[:12]
        result["wrong_groups"] = [sum(1 for w in wrong if w[4][g] > BAD) for g in (0, 1)]
    described = []
    for item, bi, t, hi, e in wrong[:args.show]:
        rows = slice(t * cfg.block_m, min((t + 1) * cfg.block_m, seq))
        o, r = out[bi, rows, hi], ref[bi, rows, hi]
        entry = dict(item=item, round=item // ctas if ctas else None, b=bi, tile=t, head=hi,
                     group_err=e, zero_rows=int((o == 0).all(-1).sum()),
                     nan_rows=int(np.isnan(o).any(-1).sum()),
                     out_norm=round(float(np.linalg.norm(np.nan_to_num(o))), 3),
                     ref_norm=round(float(np.linalg.norm(r)), 3))
        # What the wrong rows hold instead: O without its first / last key tile's P V (the
        # row sums kept), or the reference rows of the item before on the same CTA.
        for name, keep in (("err_no_first_tile", lambda n: n >= cfg.block_n),
                           ("err_no_last_tile", lambda n: n < last_tile_start(
                               t, cfg, seq, causal))):
            alt = partial_reference(host, bi, hi, rows, causal, keep)
            entry[name] = round(float(np.abs(np.nan_to_num(o, nan=1e9) - alt).max()), 3)
        if ctas and item >= ctas:
            pt, ph, pb = tile_of(item - ctas, tiles, h, b, causal)
            prows = slice(pt * cfg.block_m, min((pt + 1) * cfg.block_m, seq))
            if prows.stop - prows.start == rows.stop - rows.start:
                entry["err_vs_previous_item"] = round(float(np.abs(
                    np.nan_to_num(o, nan=1e9) - ref[pb, prows, ph]).max()), 3)
        described.append(entry)
    result["described"] = described
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
