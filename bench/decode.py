"""Kiln's split-KV paged decode vs torch (page gather + SDPA) and vs measured copy bandwidth.

Grid (the field's standard decode shapes): Hq 64 / Hkv 8, D 128, bf16 cache of ``--page-size``
rows per page, context 4k / 16k / 64k, batch 1 / 4 / 16, Sq 1 / 4 (draft tokens, bottom-right
causal).

Method: every shape is first checked against a float32 torch reference (gather + SDPA; max
abs error < 3e-2, NaN fails), each of Kiln's paths. Then Kiln (``decode_attention`` as it
chooses; forced to one kernel whose last split CTA combines, "fused"; forced to two kernels,
``decode`` + ``combine``; and ``decode`` alone) and the torch implementation are timed with
CUDA events after a warm-up, median of ``--repeat`` samples of ``--batch`` back-to-back calls (so the host's launch work overlaps the GPU, as in a
serving loop that runs ahead or replays a CUDA graph); with ``--queued`` each sample is
queued behind a busy stream instead (``timing.queued_ms``: GPU time only, no host time). The
host columns are the host time per ``decode_attention`` / ``decode`` call while the stream is
kept busy (``timing.host_us``), so one run shows kernel time and host time side by side
(goal: <= 20 us per ``decode_attention`` call). GB/s counts the bytes decode must move: the
K and V pages of every sequence plus q and the output. The copy bandwidth is a ``torch`` device-to-device copy of a 2 GiB buffer
(read + write bytes), measured in the same process; the ratio column is Kiln's GB/s over it
(goal: >= 0.80 at ctx >= 16k).

Tuning sweep (``--sweep``, GPU time only): ``decode_attention`` with each ``DecodeConfig`` of
``SWEEP_CONFIGS`` and ``num_splits`` at 0.5, 1, 1.5 and 2 times its default, on
``SWEEP_SHAPES`` (where the goal is hardest: batch 1, and Sq 4), each config checked against
the reference first; one table shows which tile, ring, warps and split count wins per shape.

Usage (on an H100): ``python bench/decode.py [--json out.json] [--repeat 20] [--page-size 64]
[--queued] [--contexts 16384] [--batches 1] [--draft-tokens 8 16] [--sweep]``.
"""

from __future__ import annotations

import argparse
import functools
import math

from results_io import write_results
from timing import host_us, queued_ms, time_ms

HQ, HKV, HEAD_DIM = 64, 8, 128
CONTEXTS = (4096, 16384, 65536)
BATCHES = (1, 4, 16)
DRAFT_TOKENS = (1, 4)
# (batch, ctx, Sq) of the sweep: the rows under the goal, and batch 16 to catch regressions.
SWEEP_SHAPES = ((1, 16384, 1), (1, 16384, 4), (4, 16384, 4), (1, 65536, 4), (16, 16384, 4))
# DecodeConfig keyword sets: 64 keys, 3 stages, 4 warps (the default at Sq 1), a shallower and
# a deeper ring, 8 warps of 16 keys (the default at Sq 4: two groups), 128-key tiles with 4 and
# 8 warps, and one WGMMA warp group (the default from Sq 8 x GQA 8).
SWEEP_CONFIGS = ({}, {"stages": 2}, {"stages": 4}, {"num_warps": 8},
                 {"block_n": 128, "stages": 2}, {"block_n": 128, "stages": 2, "num_warps": 8},
                 {"consumer": "wgmma", "stages": 4})
SWEEP_SPLIT_FACTORS = (0.5, 1, 1.5, 2)


def copy_bandwidth_gbs(torch, repeat: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeat)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def make_problem(torch, batch, ctx, sq, page_size):
    pages = ctx // page_size
    num_pages = batch * pages
    kc = torch.randn(num_pages, page_size, HKV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(num_pages, device="cuda").view(batch, pages).int()
    q = torch.randn(batch, sq, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, kc, vc, table, seq_lens


def torch_decode(torch, q, kc, vc, table, seq_lens, dtype=None):
    """Gather each sequence's pages, then SDPA with the draft tokens' causal mask, one sequence
    at a time (SDPA's math path expands the KV heads for GQA: the whole batch at ctx 64k in
    float32 did not fit in 80 GB)."""
    batch, sq = q.shape[:2]
    ctx = int(seq_lens[0])
    dtype = dtype or q.dtype
    positions = torch.arange(ctx, device=q.device)
    mask = positions[None, :] <= (ctx - sq + torch.arange(sq, device=q.device))[:, None]
    outs = []
    for b in range(batch):
        pages = table[b].long()
        k = kc[pages].reshape(-1, HKV, HEAD_DIM)[:ctx].to(dtype).transpose(0, 1)
        v = vc[pages].reshape(-1, HKV, HEAD_DIM)[:ctx].to(dtype).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[b].to(dtype).transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
        outs.append(out.transpose(0, 1))
    return torch.stack(outs)


def bench(torch, batch, ctx, sq, page_size, repeat, calls, copy_gbs, queued) -> dict:
    from kiln.kernels.attention.decode import decode, decode_attention

    problem = make_problem(torch, batch, ctx, sq, page_size)
    reference = torch_decode(torch, *problem, dtype=torch.float32)
    for fused in (None, True, False):
        out, _ = decode_attention(*problem, fused_combine=fused)
        error = (out.float() - reference).abs().max().item()
        if not error < 3e-2:  # also catches NaN
            raise SystemExit(f"Kiln decode (fused_combine={fused}) wrong at batch {batch} ctx "
                             f"{ctx} Sq {sq}: max abs error {error}")
    q = problem[0]
    # The ids were checked by the calls above: the timed loop skips the per-call device check
    # (one reduction and a synchronisation), as a serving loop that vouches for them does.
    decode_attention = functools.partial(decode_attention, validate=False)
    decode = functools.partial(decode, validate=False)
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * 2 + 2 * q.numel() * 2
    timer = (lambda fn: queued_ms(fn, repeat, calls)) if queued else \
        (lambda fn: time_ms(fn, repeat, calls))
    kiln_ms = timer(lambda: decode_attention(*problem))
    fused_ms = timer(lambda: decode_attention(*problem, fused_combine=True))
    two_kernel_ms = timer(lambda: decode_attention(*problem, fused_combine=False))
    split_ms = timer(lambda: decode(*problem))
    torch_ms = timer(lambda: torch_decode(torch, *problem))
    kiln_gbs = nbytes / kiln_ms / 1e6
    return {"batch": batch, "ctx": ctx, "sq": sq, "page_size": page_size, "max_abs_error": error,
            "queued": queued, "kiln_ms": kiln_ms, "kiln_fused_ms": fused_ms,
            "kiln_two_kernel_ms": two_kernel_ms,
            "kiln_split_only_ms": split_ms,
            "torch_ms": torch_ms,
            "host_us": host_us(lambda: decode_attention(*problem), repeat, calls),
            "split_host_us": host_us(lambda: decode(*problem), repeat, calls),
            "kiln_gbs": kiln_gbs, "torch_gbs": nbytes / torch_ms / 1e6, "copy_gbs": copy_gbs,
            "ratio_to_copy": kiln_gbs / copy_gbs, "speedup_vs_torch": torch_ms / kiln_ms}


def sweep(torch, page_size, repeat, calls, copy_gbs) -> list[dict]:
    """``decode_attention`` per ``SWEEP_CONFIGS`` x split factor on ``SWEEP_SHAPES`` (queued)."""
    from kiln import UnsupportedError
    from kiln.kernels.attention.decode import (DecodeConfig, decode_attention,
                                               default_num_splits)

    results = []
    for batch, ctx, sq in SWEEP_SHAPES:
        problem = make_problem(torch, batch, ctx, sq, page_size)
        reference = torch_decode(torch, *problem, dtype=torch.float32)
        nbytes = 2 * batch * ctx * HKV * HEAD_DIM * 2 + 2 * problem[0].numel() * 2
        for options in SWEEP_CONFIGS:
            config = DecodeConfig(**options)
            try:
                config.check_rows(sq * HQ // HKV, HEAD_DIM)
            except UnsupportedError:
                continue
            rows = config.row_blocks(sq * HQ // HKV, HEAD_DIM)
            default = default_num_splits(batch, HKV, ctx, config.block_n, row_blocks=rows)
            for factor in SWEEP_SPLIT_FACTORS:
                splits = max(1, round(default * factor))
                error = (decode_attention(*problem, num_splits=splits, config=config)[0].float()
                         - reference).abs().max().item()
                ms = math.nan
                if error < 3e-2:  # also catches NaN; a wrong config is listed, not timed
                    ms = queued_ms(lambda: decode_attention(*problem, num_splits=splits,
                                                            config=config), repeat, calls)
                results.append(dict(batch=batch, ctx=ctx, sq=sq, block_n=config.block_n,
                                    stages=config.stages, num_warps=config.num_warps,
                                    num_splits=splits, default_splits=default,
                                    max_abs_error=error, kiln_ms=ms,
                                    ratio_to_copy=nbytes / ms / 1e6 / copy_gbs))
                print(sweep_table(results[-1:]).splitlines()[-1], flush=True)
    return results


def sweep_table(results: list[dict]) -> str:
    lines = ["| batch | ctx | Sq | block_n | stages | warps | splits | Kiln us | /copy |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        default = "*" if r["num_splits"] == r["default_splits"] else ""
        timing = (f"{1e3 * r['kiln_ms']:.1f} | {r['ratio_to_copy']:.2f}"
                  if not math.isnan(r["kiln_ms"]) else f"wrong (error {r['max_abs_error']:.3g}) |")
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['sq']} | {r['block_n']} | {r['stages']} "
                     f"| {r['num_warps']} | {r['num_splits']}{default} | {timing} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=10, help="back-to-back calls per sample")
    parser.add_argument("--queued", action="store_true",
                        help="GPU time only: queue each sample behind a busy stream")
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=DRAFT_TOKENS,
                        help="Sq values (speculative decoding: 8 and 16 run the WGMMA consumer)")
    parser.add_argument("--sweep", action="store_true",
                        help="only the DecodeConfig x num_splits sweep (GPU time, queued)")
    args = parser.parse_args()
    import torch  # imported after argparse so --help works without a GPU stack

    copy_gbs = copy_bandwidth_gbs(torch, args.repeat)
    if args.sweep:
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; page "
              f"{args.page_size}; * = default splits")
        results = sweep(torch, args.page_size, args.repeat, args.batch, copy_gbs)
        print(sweep_table(results))
        if args.json:
            write_results(args.json, "decode-sweep", results, torch=torch, copy_gbs=copy_gbs)
        if any(math.isnan(r["kiln_ms"]) for r in results):
            raise SystemExit("a sweep config gave a wrong result (see the table)")
        return
    rows = [bench(torch, batch, ctx, sq, args.page_size, args.repeat, args.batch, copy_gbs,
                  args.queued)
            for ctx in args.contexts for batch in args.batches for sq in args.draft_tokens]
    print(f"{torch.cuda.get_device_name()}: Hq {HQ} / Hkv {HKV}, D {HEAD_DIM}, bf16, page "
          f"{args.page_size}; copy bandwidth {copy_gbs:.0f} GB/s; "
          f"{'GPU time only (queued)' if args.queued else 'back-to-back calls'}")
    print(f"{'ctx':>6} {'batch':>5} {'Sq':>3} {'Kiln ms':>8} {'fused ms':>8} {'2-kern ms':>9} "
          f"{'split ms':>8} "
          f"{'torch ms':>8} "
          f"{'Kiln GB/s':>9} {'torch GB/s':>10} {'/copy':>6} {'vs torch':>8} {'host us':>7} "
          f"{'split host us':>13}")
    for r in rows:
        print(f"{r['ctx']:>6} {r['batch']:>5} {r['sq']:>3} {r['kiln_ms']:8.3f} "
              f"{r['kiln_fused_ms']:8.3f} {r['kiln_two_kernel_ms']:9.3f} "
              f"{r['kiln_split_only_ms']:8.3f} {r['torch_ms']:8.3f} {r['kiln_gbs']:9.0f} "
              f"{r['torch_gbs']:10.0f} {r['ratio_to_copy']:6.2f} {r['speedup_vs_torch']:8.2f} "
              f"{r['host_us']:7.1f} {r['split_host_us']:13.1f}")
    if args.json:
        write_results(args.json, "decode", rows, torch=torch, copy_gbs=copy_gbs)


if __name__ == "__main__":
    main()
