"""A/B of MLA decode's kernel options on a few shapes, in one process: split counts, the
fused combine vs the combine kernel, the scores schedules (split keys, seesaw, lead group,
transposed), early launch, L2 prefetch, shared merges; GB/s, ratio to copy bandwidth and
TFLOP/s (GPU time, queued), each variant first checked against a float32 torch reference (max
abs error < 2e-2). Prints one JSON line per measurement as it comes.

Usage (on an H100/H200): ``python bench/mla_decode_ab.py [--shapes 32x4096x1x16,...]
[--variants base,fused,...] [--repeat 10]`` (a shape ``B x ctx x Sq x H``, ``r`` appended for
ragged lengths: uniform in ``[ctx / 4, 7 ctx / 4]``, mean ``ctx``; or ``SHAPE:v1+v2`` with its
own variants); ``--once SHAPE V1,V2``: one call of each variant, in order (for ``ncu -k
regex:mla_decode -c 2``); ``--timeline SHAPE:V,...``: after the shapes, each kernel's GPU
duration and the gap from one call's end to the next one's start over queued calls (torch
profiler, CUPTI).
"""

from __future__ import annotations

import argparse
import json
import sys

from mla_decode import DQK, DV, copy_bandwidth_gbs, make_problem, unpaged
from timing import queued_ms

# name -> mla_decode keywords
VARIANTS = {
    "default": {},
    "base": dict(fused_combine=False),
    "fused": dict(fused_combine=True),
    "repl_fused": dict(fused_combine=True, split_keys=False),
    "fused_early": dict(fused_combine=True, early_launch=True),
    "seesaw": dict(seesaw=True),
    "seesaw_fused": dict(seesaw=True, fused_combine=True),
    "seesaw_early": dict(seesaw=True, early_launch=True),
    "early": dict(early_launch=True),
    "lead": dict(lead_group=True),
    "lead_early": dict(lead_group=True, early_launch=True),
    "lead2": dict(lead_group="pipelined"),
    "lead2_early": dict(lead_group="pipelined", early_launch=True),
    "split": dict(split_keys=True, early_launch=False),  # session 35's default
    "t": dict(transposed=True),  # keys as M, the <= 32 query rows as N
    "t_early": dict(transposed=True, early_launch=True),
    **{f"t_pf{n}": dict(transposed=True, prefetch=n) for n in (1, 2)},
    "tr": dict(transposed="ring"),  # Q trimmed, a ring of 8 KB chunk slots
    "tr_early": dict(transposed="ring", early_launch=True),
    "tp": dict(transposed="pipelined"),  # group 0's V^T P^T in flight behind its next scores
    "trp": dict(transposed="ring-pipelined"),
    **{f"tr_m{n}": dict(transposed="ring", merge_slices=n) for n in (2, 4)},  # shared merge
    **{f"m{n}": dict(merge_slices=n) for n in (2, 4)},  # the lead group, shared merge
    # Early launch with Q and the split's first n pages prefetched into L2 before the wait.
    **{f"early_ep{n}": dict(early_launch=True, early_pages=n) for n in (2, 3)},
    **{f"t_ep{n}": dict(transposed=True, early_launch=True, early_pages=n) for n in (2, 3, 4)},
    **{f"tr_ep{n}": dict(transposed="ring", early_launch=True, early_pages=n) for n in (2, 3)},
    "t_ep2_m4": dict(transposed=True, early_launch=True, early_pages=2, merge_slices=4),
    # The page-balanced grid: every SM's CTA an equal share of all pages (mla_balanced).
    "bal": dict(balanced=True), "bal_noearly": dict(balanced=True, early_launch=False),
    "bal_ep0": dict(balanced=True, early_pages=0),
    **{f"bal_o{n}": dict(balanced=n) for n in (0, 2, 4)},  # overhead units a sequence
    # 128 CTAs with no overhead units: at batch 32 / 64, 4k, each CTA 16 / 32 pages of one
    # sequence, the default's split exactly (the balanced kernel's own cost, isolated).
    "nobal": dict(balanced=False),  # the default split where the default is balanced
    "bal_o0_n128": dict(balanced=0, num_splits=128),
    "bal_n128": dict(balanced=True, num_splits=128),
    **{f"pf{n}": dict(prefetch=n) for n in (1, 2)},  # the lead group, pages ahead in L2
    **{f"s{n}": dict(num_splits=n, fused_combine=False) for n in (1, 2, 3, 4, 8)},
    **{f"s{n}_fused": dict(num_splits=n, fused_combine=True) for n in (2, 3, 4, 6, 8)},
}


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    ragged = text.endswith("r")
    batch, ctx, sq, heads = (int(x) for x in text.rstrip("r").split("x"))
    return batch, ctx, sq, heads, ragged


def ragged_problem(torch, batch, ctx, sq, heads):
    """``make_problem`` at ``7 ctx / 4`` with lengths uniform in ``[ctx / 4, 7 ctx / 4]``
    (seeded), and the reference's per-sequence key mask ``[B, 1, Sq * H, L]``."""
    width = 7 * ctx // 4
    q, kv, table, _ = make_problem(torch, batch, width, sq, heads)
    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    lens = torch.randint(ctx // 4, width + 1, (batch,), generator=gen).to(torch.int32).cuda()
    token = torch.arange(sq * heads, device="cuda") // heads
    keys = torch.arange(width, device="cuda")
    mask = keys[None, None, :] <= (lens[:, None, None] - sq + token[None, :, None])
    return (q, kv, table, lens), width, mask[:, None]


def timeline(torch, problem, kwargs, calls: int = 30) -> dict:
    """Median GPU duration of each kernel name over ``calls`` queued calls, and the median
    gap from one MLA kernel's end to the next one's start (negative: they overlapped)."""
    from kiln.kernels.attention import mla_decode

    for _ in range(3):
        mla_decode(*problem, **kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(20_000_000)
        for _ in range(calls):
            mla_decode(*problem, **kwargs)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                      and "sleep" not in e.name), key=lambda e: e.time_range.start)
    durations: dict = {}
    for e in kernels:
        durations.setdefault(e.name[:40], []).append(e.time_range.elapsed_us())
    mla = [e for e in kernels if "mla" in e.name]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(mla, mla[1:])]
    starts = [b.time_range.start - a.time_range.start for a, b in zip(mla, mla[1:])]
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {"kernels": {k: median(v) for k, v in durations.items()},
            "gap_us": median(gaps), "period_us": median(starts), "min_dur": min(
                (e.time_range.elapsed_us() for e in mla), default=None),
            "max_dur": max((e.time_range.elapsed_us() for e in mla), default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32x4096x1x16")
    parser.add_argument("--variants", default="base,fused")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--once", nargs=2, metavar=("SHAPE", "V1,V2"))
    parser.add_argument("--timeline", help="SHAPE:VARIANT,... kernel durations and gaps "
                        "(after the --shapes runs; --shapes '' for none)")
    args = parser.parse_args()
    import torch

    from kiln.kernels.attention import mla_decode

    if args.once:
        problem = make_problem(torch, *parse_shape(args.once[0])[:4])
        for name in args.once[1].split(","):
            mla_decode(*problem, **VARIANTS[name])
            torch.cuda.synchronize()
        return
    copy_gbs = copy_bandwidth_gbs(torch, 5)
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": round(copy_gbs)}),
          flush=True)
    for item in filter(None, args.shapes.split(",")):
        # "SHAPE" takes --variants; "SHAPE:v1+v2" its own list.
        shape, _, own = item.partition(":")
        batch, ctx, sq, heads, ragged = parse_shape(shape)
        if ragged:
            problem, width, mask = ragged_problem(torch, batch, ctx, sq, heads)
            q, k, v, _ = unpaged(torch, *problem[:3], width)
            keys = int(problem[3].sum())
        else:
            problem = make_problem(torch, batch, ctx, sq, heads)
            q, k, v, mask = unpaged(torch, *problem[:3], ctx)
            keys = batch * ctx
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, scale=DQK ** -0.5)
        del k, v
        nbytes = keys * DQK * 2 + q.numel() * 2 + batch * sq * heads * DV * 2
        flops = 2 * sq * heads * keys * (DQK + DV)
        for name in own.split("+") if own else args.variants.split(","):
            kwargs = VARIANTS[name]
            try:
                out, _ = mla_decode(*problem, **kwargs)
                error = (out.float().reshape(reference.shape) - reference).abs().max().item()
                ms = queued_ms(lambda: mla_decode(*problem, **kwargs), args.repeat, args.calls)
            except Exception as exc:  # report and go on with the next variant
                print(json.dumps({"shape": shape, "variant": name, "error": repr(exc)[:300]}),
                      flush=True)
                continue
            gbs = nbytes / ms / 1e6
            print(json.dumps({"shape": shape, "variant": name, "us": round(1e3 * ms, 1),
                              "copy": round(gbs / copy_gbs, 3),
                              "tflops": round(flops / ms / 1e9), "err": round(error, 4),
                              "ok": error < 2e-2}), flush=True)
        del reference
    for item in args.timeline.split(",") if args.timeline else ():
        shape, _, name = item.partition(":")
        problem = make_problem(torch, *parse_shape(shape)[:4])
        print(json.dumps({"timeline": shape, "variant": name,
                          **timeline(torch, problem, VARIANTS[name or "default"])}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
