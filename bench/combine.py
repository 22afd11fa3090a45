"""Kiln's split-KV combine vs a torch implementation and vs measured copy bandwidth.

Grids (the field's standard combine shapes, H x D = 32 x 128 unless noted, f32 partials,
bf16 output):

- ``splits`` {2, 16, 64} x batch*q {1, 4, 16, 64, 256} (decode: one query per sequence);
- 2 splits x tokens {256, 1k, 4k, 16k} x H {16, 32, 64} (prefill-sized rows, batch 1);
- decode's shapes at Hq 64 with its default split counts: 16 splits x batch 1 x q 1 (ctx 16k,
  batch 1: the split-parallel schedule; goal <= ~4 us of GPU time) and 4 splits x batch 4 x q 4.

Method: every shape is checked first against a float64 numpy reference (max abs error < 2e-2
on the bf16 output, LSE < 1e-4, NaN fails; random split counts with empty splits). Kiln's
``combine`` and the torch implementation (masked LSE, exp, weighted sum in float32) are then
timed with CUDA events after a warm-up: each sample is ``--batch`` back-to-back calls between
one pair of events (so Python launch work overlaps the previous kernel), median of
``--repeat`` samples. "Kiln out=" times the same call writing into preallocated ``out=`` /
``lse_out=`` tensors (no allocation per call; the decode-loop usage). "GPU us" is the same
call queued behind a busy stream (``timing.queued_ms``: kernel time only), "host us" the host
time per call while the stream is kept busy (``timing.host_us``). GB/s counts the bytes
combine must move: O_partial and LSE_partial of every valid split slot read once, split
counts, O (bf16) and LSE written. The copy bandwidth is a torch device-to-device copy of a 2 GiB buffer (read + write), and the launch latency a
one-element torch add, both measured in the same process with the same method. Goals:
>= 0.85 of copy bandwidth at large sizes, <= 2x launch latency at small ones.

Usage (on an H100): ``python bench/combine.py [--json out.json] [--repeat 20] [--batch 10]
[--small]`` (``--small``: the small-call and decode shapes only).
"""

from __future__ import annotations

import argparse

import numpy as np
from results_io import write_results
from timing import host_us, queued_ms, time_ms

HEADS, HEAD_DIM = 32, 128
SPLIT_GRID = ((2, 16, 64), (1, 4, 16, 64, 256))
TOKEN_GRID = ((256, 1024, 4096, 16384), (16, 32, 64))
DECODE_SHAPES = ((16, 1, 1, 64), (4, 4, 4, 64))  # (splits, batch, q, heads)


def copy_bandwidth_gbs(torch, repeat: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeat, 1)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def launch_latency_us(torch, repeat: int, batch: int) -> float:
    x = torch.zeros(1, device="cuda")
    return time_ms(lambda: x.add_(1.0), repeat, batch) * 1e3


def torch_combine(torch, o_p, lse_p, counts):
    """The reference implementation a model would write (float32, masked slots -inf)."""
    slot = torch.arange(o_p.shape[0], device=o_p.device).view(-1, 1, 1, 1)
    lse = torch.where(slot < counts.unsqueeze(0), lse_p, float("-inf"))
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)
    z = w.sum(dim=0)
    o = torch.einsum("sbqh,sbqhd->bqhd", w, torch.nan_to_num(o_p)) / z.clamp_min(1e-30)[..., None]
    valid = z > 0
    return (torch.where(valid[..., None], o, 0.0).to(torch.bfloat16),
            torch.where(valid, torch.log(z) + m_safe, float("-inf")))


def make_problem(rng, splits, batch, sq, heads):
    """Random split counts with one empty row; decode's shapes use every split (as decode
    does at a full context)."""
    o = rng.standard_normal((splits, batch, sq, heads, HEAD_DIM)).astype(np.float32)
    lse = (rng.standard_normal((splits, batch, sq, heads)) * 3.0).astype(np.float32)
    if (splits, batch, sq, heads) in DECODE_SHAPES:
        counts = np.full((batch, sq, heads), splits, np.int32)
    else:
        counts = rng.integers(1, splits + 1, (batch, sq, heads)).astype(np.int32)
    counts.flat[0] = 0
    empty = rng.random(lse.shape) < 0.1
    lse[empty], o[empty] = -np.inf, 0.0
    return o, lse, counts


def reference(o, lse, counts):
    slot = np.arange(o.shape[0])[:, None, None, None]
    lse = np.where(slot < counts[None], lse.astype(np.float64), -np.inf)
    m = lse.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - m_safe)
    z = w.sum(axis=0)
    out = np.einsum("sbqh,sbqhd->bqhd", w, np.where(np.isfinite(o), o, 0.0))
    valid = z > 0
    return (np.where(valid[..., None], out / np.where(valid, z, 1.0)[..., None], 0.0),
            np.where(valid, np.log(np.where(valid, z, 1.0)) + m_safe, -np.inf))


def useful_bytes(o, counts) -> int:
    rows = counts.size
    valid_slots = int(counts.sum())
    return valid_slots * (HEAD_DIM * 4 + 4) + rows * (4 + HEAD_DIM * 2 + 4)


def run_shape(torch, combine, rng, splits, batch, sq, heads, args, copy_gbs, launch_us):
    o_np, lse_np, counts_np = make_problem(rng, splits, batch, sq, heads)
    o_p, lse_p, counts = (torch.from_numpy(a).cuda() for a in (o_np, lse_np, counts_np))
    max_splits = max(splits, 2)
    out, lse = combine(o_p, lse_p, counts, max_splits=max_splits)
    torch.cuda.synchronize()
    o_ref, lse_ref = reference(o_np, lse_np, counts_np)
    o_err = float(np.abs(out.float().cpu().numpy() - o_ref).max())
    got_lse = lse.cpu().numpy()
    finite = np.isfinite(lse_ref)
    lse_err = float(np.abs(got_lse[finite] - lse_ref[finite]).max()) if finite.any() else 0.0
    ok = (o_err < 2e-2 and lse_err < 1e-4 and not np.isnan(got_lse).any()
          and np.array_equal(np.isneginf(got_lse), ~finite))
    kiln_ms = time_ms(lambda: combine(o_p, lse_p, counts, max_splits=max_splits),
                      args.repeat, args.batch)
    out_ms = time_ms(lambda: combine(o_p, lse_p, counts, max_splits=max_splits, out=out,
                                     lse_out=lse), args.repeat, args.batch)
    torch_ms = time_ms(lambda: torch_combine(torch, o_p, lse_p, counts),
                       args.repeat, args.batch)
    gpu_ms = queued_ms(lambda: combine(o_p, lse_p, counts, max_splits=max_splits), args.repeat)
    call_host_us = host_us(lambda: combine(o_p, lse_p, counts, max_splits=max_splits),
                           args.repeat)
    nbytes = useful_bytes(o_np, counts_np)
    kiln_gbs, torch_gbs = nbytes / kiln_ms / 1e6, nbytes / torch_ms / 1e6
    return {"splits": splits, "batch": batch, "sq": sq, "heads": heads, "ok": ok,
            "o_err": o_err, "lse_err": lse_err, "bytes": nbytes,
            "kiln_us": kiln_ms * 1e3, "kiln_out_us": out_ms * 1e3, "torch_us": torch_ms * 1e3,
            "gpu_us": gpu_ms * 1e3, "host_us": call_host_us,
            "kiln_gbs": kiln_gbs, "torch_gbs": torch_gbs,
            "kiln_vs_copy": kiln_gbs / copy_gbs, "kiln_vs_torch": torch_ms / kiln_ms,
            "kiln_vs_launch": kiln_ms * 1e3 / launch_us,
            "kiln_out_vs_launch": out_ms * 1e3 / launch_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10, help="calls per timed sample")
    parser.add_argument("--small", action="store_true",
                        help="only the small-call shape (2 splits, 1 row, H32, D128)")
    args = parser.parse_args()

    import torch

    from kiln.kernels.attention import combine

    rng = np.random.default_rng()
    copy_gbs = copy_bandwidth_gbs(torch, args.repeat)
    launch_us = launch_latency_us(torch, args.repeat, args.batch)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, launch latency {launch_us:.1f} us")
    shapes = [(s, bq, 1, HEADS) for s in SPLIT_GRID[0] for bq in SPLIT_GRID[1]]
    shapes += [(2, 1, t, h) for t in TOKEN_GRID[0] for h in TOKEN_GRID[1]]
    shapes += list(DECODE_SHAPES)
    if args.small:
        shapes = [(2, 1, 1, HEADS), *DECODE_SHAPES]
    rows = []
    header = (f"{'splits':>6} {'batch':>5} {'sq':>6} {'H':>3} {'ok':>3} {'kiln us':>8} "
              f"{'out= us':>8} "
              f"{'torch us':>8} {'kiln GB/s':>9} {'torch GB/s':>10} {'/copy':>6} {'/torch':>6} "
              f"{'/launch':>7} {'out=/launch':>11} {'GPU us':>7} {'host us':>7}")
    print(header)
    for splits, batch, sq, heads in shapes:
        r = run_shape(torch, combine, rng, splits, batch, sq, heads, args, copy_gbs, launch_us)
        rows.append(r)
        print(f"{splits:>6} {batch:>5} {sq:>6} {heads:>3} {'yes' if r['ok'] else 'NO':>3} "
              f"{r['kiln_us']:>8.1f} {r['kiln_out_us']:>8.1f} {r['torch_us']:>8.1f} "
              f"{r['kiln_gbs']:>9.0f} {r['torch_gbs']:>10.0f} {r['kiln_vs_copy']:>6.2f} "
              f"{r['kiln_vs_torch']:>6.2f} {r['kiln_vs_launch']:>7.2f} "
              f"{r['kiln_out_vs_launch']:>11.2f} {r['gpu_us']:>7.1f} {r['host_us']:>7.1f}")
    if args.json:
        write_results(args.json, "combine-small" if args.small else "combine", rows,
                      torch=torch, copy_gbs=copy_gbs, launch_us=launch_us)
    if not all(r["ok"] for r in rows):
        raise SystemExit("some shapes did not match the reference")


if __name__ == "__main__":
    main()
