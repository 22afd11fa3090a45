"""Kiln's Hopper attention prefill vs torch SDPA (cuDNN and FlashAttention backends).

Shapes, in one run: the FlashAttention benchmark grid (sequence 512 .. 16k with batch * seq =
16k tokens, heads * D = 2048, D in {64, 128}, causal and not) and GQA (B16, Hq 64, Hkv 8,
D 128, seq ``--gqa-seq``), and the head-dim rows (``DIM_ROWS``: D 96, D_qk 192 with D_v 128
(DeepSeek's MLA prefill), D 192, and D 128 with a Gemma-2 ``softcap``; ``--dims-only`` runs just
those). SDPA has no softcap: its softcap rows time SDPA uncapped (the ratio is then Kiln capped
vs SDPA uncapped, and Kiln's output is not compared there). bf16 inputs laid out ``[B, S, H, D]`` (SDPA reads the same memory
through ``transpose(1, 2)``, no copies).

Method: every shape is checked first (Kiln vs the SDPA FlashAttention output: max abs error
< 3e-2, NaN fails; exact float32 checks live in ``tests/test_attention_prefill_hopper.py``),
then each implementation is timed with CUDA events after a warm-up: ``--repeat`` samples of
``--batch`` back-to-back calls, the median counts. TFLOP/s = 4 * B * H * Sq * Sk * D / time,
halved for causal. Ratios are Kiln / the faster SDPA backend (goal: >= 1.05 at D = 128,
seq >= 4k). Backends that reject a shape are reported as n/a.

Tuning sweep (unless ``--no-sweep``): the Hopper kernel's ``(block_n, stages)`` alternatives of
``SWEEP`` on seq 4096, each checked then timed like the main rows, so one run shows whether
``HopperPrefillConfig.for_head_dim``'s defaults are the fastest.

Usage (on an H100): ``python bench/attention.py [--json out.json] [--plot out.png]``;
``python bench/attention.py --sanitize`` runs one causal, one ragged and one long unmasked call
(no timing) for ``compute-sanitizer --tool memcheck|racecheck|synccheck``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os

from results_io import write_results
from timing import queued_ms, time_ms

TOKENS = 16 * 1024
HIDDEN = 2048  # heads * D
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
MAX_ERROR = 3e-2
SWEEP_SEQ = 4096
# Head dims the FlashAttention grid lacks: (D, D_v, softcap) at seq 1k and 4k, 16k tokens.
DIM_ROWS = ((96, 96, None), (192, 128, None), (192, 192, None), (128, 128, 30.0))
# (D, causal) -> (block_n, stages) candidates; all fit shared memory and compile without spills
# with the default softmax schedule.
SWEEP = {(128, False): ((128, 2), (128, 3), (144, 2), (160, 2)),
         (128, True): ((128, 2), (128, 3), (144, 2)),
         (64, False): ((128, 2), (192, 2), (192, 3)),
         (64, True): ((128, 2), (192, 2), (192, 3))}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", default="attention.png", help="PNG of TFLOP/s vs seq length")
    parser.add_argument("--repeat", type=int, default=15, help="timed samples per shape")
    parser.add_argument("--batch", type=int, default=5, help="back-to-back calls per sample")
    parser.add_argument("--gqa-seq", type=int, default=2048, help="sequence length of the GQA row")
    parser.add_argument("--quick", action="store_true", help="only seq 512 and 4096")
    parser.add_argument("--queued", action="store_true",
                        help="time kernels on a pre-filled stream (timing.queued_ms): no host "
                             "time counted, for every implementation alike")
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip the block_n / stages sweep of the Hopper kernel")
    parser.add_argument("--dims-only", action="store_true",
                        help="only the head-dim rows (DIM_ROWS), no sweep")
    parser.add_argument("--sanitize", action="store_true",
                        help="run one causal, one ragged and one long unmasked call for "
                             "compute-sanitizer, no timing")
    return parser.parse_args(argv)


def shapes(args) -> list[dict]:
    seqs = (512, 4096) if args.quick else SEQS
    rows = [dict(batch=TOKENS // s, seq=s, hq=HIDDEN // d, hkv=HIDDEN // d, d=d, causal=c)
            for d in HEAD_DIMS for c in (False, True) for s in seqs]
    rows += [dict(batch=16, seq=args.gqa_seq, hq=64, hkv=8, d=128, causal=c) for c in (False, True)]
    dims = [dict(batch=TOKENS // s, seq=s, hq=16, hkv=16, d=d, dv=dv, softcap=cap, causal=c)
            for d, dv, cap in DIM_ROWS for c in (False, True)
            for s in ((4096,) if args.quick else (1024, 4096))]
    return dims if args.dims_only else rows + dims


def sdpa_call(backend_name: str, q, k, v, causal: bool):
    """A no-argument callable running SDPA with one backend, or None if it rejects the shape."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[
        backend_name]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                    enable_gqa=gqa)
    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return run


def random_inputs(row: dict):
    import torch

    b, s, hq, hkv, d = (row[k] for k in ("batch", "seq", "hq", "hkv", "d"))
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, row.get("dv", d), device="cuda", dtype=torch.bfloat16)
    return q, k, v


def row_flops(row: dict) -> float:
    b, s, hq, d = (row[k] for k in ("batch", "seq", "hq", "d"))
    return 2.0 * b * hq * s * s * (d + row.get("dv", d)) / (2 if row["causal"] else 1)


def bench_shape(row: dict, args) -> dict:
    from kiln.kernels.attention import prefill

    causal, softcap = row["causal"], row.get("softcap")
    q, k, v = random_inputs(row)
    flops = row_flops(row)
    result = dict(row)
    reference = None
    for name in ("flash", "cudnn"):
        call = sdpa_call(name, q, k, v, causal)
        if call is None:
            result[f"{name}_tflops"] = None
            continue
        if reference is None and not softcap:
            reference = call().transpose(1, 2).float()
        result[f"{name}_tflops"] = flops / _timer(args)(call) / 1e9
    out = prefill(q, k, v, causal=causal, softcap=softcap)
    if reference is not None:
        error = (out.float() - reference).abs().max().item()
        if not error < MAX_ERROR:  # also catches NaN
            raise SystemExit(f"Kiln prefill wrong at {row}: max abs error {error} vs SDPA")
        result["max_abs_error"] = error
    result["kiln_tflops"] = flops / _timer(args)(
        lambda: prefill(q, k, v, causal=causal, softcap=softcap)) / 1e9
    peers = [result[f"{n}_tflops"] for n in ("flash", "cudnn") if result[f"{n}_tflops"]]
    result["ratio_vs_best_sdpa"] = result["kiln_tflops"] / max(peers) if peers else None
    return result


def _timer(args):
    """Milliseconds per call: back-to-back calls between events, or queued (``--queued``)."""
    if args.queued:
        return lambda fn: queued_ms(fn, args.repeat)
    return lambda fn: time_ms(fn, args.repeat, args.batch)


def sweep(args) -> list[dict]:
    """Kiln alone with each ``SWEEP`` config (checked against SDPA flash first)."""
    from unittest import mock

    import torch

    from kiln.kernels.attention import prefill
    from kiln.kernels.attention.prefill_hopper import HopperPrefillConfig

    prefill_module = importlib.import_module("kiln.kernels.attention.prefill")
    results = []
    for (d, causal), configs in SWEEP.items():
        row = dict(batch=TOKENS // SWEEP_SEQ, seq=SWEEP_SEQ, hq=HIDDEN // d, hkv=HIDDEN // d,
                   d=d, causal=causal)
        q, k, v = random_inputs(row)
        reference = sdpa_call("flash", q, k, v, causal)().transpose(1, 2).float()
        for block_n, stages in configs:
            config = dataclasses.replace(HopperPrefillConfig.for_head_dim(d), block_n=block_n,
                                         stages=stages)
            # prefill() takes its configuration from for_head_dim: swap this one in, with an
            # empty plan cache (a cached plan would keep the default tiles).
            with mock.patch.object(HopperPrefillConfig, "for_head_dim",
                                   lambda *head_dim, config=config: config), \
                    mock.patch.dict(prefill_module._PLANS, clear=True):
                error = (prefill(q, k, v, causal=causal).float() - reference).abs().max().item()
                if not error < MAX_ERROR:
                    raise SystemExit(f"Kiln prefill wrong with {config}: max abs error {error}")
                ms = _timer(args)(lambda: prefill(q, k, v, causal=causal))
            torch.cuda.synchronize()
            results.append(dict(row, block_n=block_n, stages=stages, max_abs_error=error,
                                kiln_tflops=row_flops(row) / ms / 1e9))
            print(sweep_table(results[-1:]).splitlines()[-1], flush=True)
    return results


def sweep_table(results: list[dict]) -> str:
    lines = ["| B | seq | D | causal | block_n | stages | Kiln TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['batch']} | {r['seq']} | {r['d']} | {'yes' if r['causal'] else 'no'} "
                     f"| {r['block_n']} | {r['stages']} | {r['kiln_tflops']:.0f} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    def cell(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    lines = ["| B | seq | Hq/Hkv | D | causal | Kiln TFLOP/s | cuDNN | flash | Kiln / best |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        dims = f"{r['d']}" if r.get("dv", r["d"]) == r["d"] else f"{r['d']}/{r['dv']}"
        if r.get("softcap"):
            dims += f" cap {r['softcap']:g}"
        lines.append(f"| {r['batch']} | {r['seq']} | {r['hq']}/{r['hkv']} | {dims} | "
                     f"{'yes' if r['causal'] else 'no'} | {cell(r['kiln_tflops'], '.0f')} | "
                     f"{cell(r['cudnn_tflops'], '.0f')} | {cell(r['flash_tflops'], '.0f')} | "
                     f"{cell(r['ratio_vs_best_sdpa'], '.2f')} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in results if r["hq"] == r["hkv"] and "dv" not in r]
    panels = sorted({(r["d"], r["causal"]) for r in grid})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        rows = sorted((r for r in grid if (r["d"], r["causal"]) == (d, causal)),
                      key=lambda r: r["seq"])
        for key, label in (("kiln_tflops", "Kiln"), ("cudnn_tflops", "SDPA cuDNN"),
                           ("flash_tflops", "SDPA flash")):
            points = [(r["seq"], r[key]) for r in rows if r[key] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sanitize() -> None:
    """One causal GQA call, one ragged call with a window (rows whose first visible key comes
    after the first tile: the softmax's redo path), one unmasked call over 8300 keys (the last
    key tile partial) and one at D = 256, all but the ragged one checked against a float32
    reference, for compute-sanitizer."""
    import torch

    from kiln.kernels.attention import prefill

    q = torch.randn(2, 700, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 700, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = prefill(q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        is_causal=True, enable_gqa=True).transpose(1, 2)
    error = (out.float() - want).abs().max().item()
    lengths = torch.tensor([0, 300, 301, 813], dtype=torch.int32, device="cuda")
    qr = torch.randn(813, 4, 64, device="cuda", dtype=torch.bfloat16)
    kr = torch.randn(813, 4, 64, device="cuda", dtype=torch.bfloat16)
    o, lse = prefill(qr, kr, kr, cu_seqlens_q=lengths, cu_seqlens_k=lengths, causal=True,
                     window=(128, 0), return_lse=True)
    ql = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    kl = torch.randn(1, 8300, 2, 128, device="cuda", dtype=torch.bfloat16)
    vl = torch.randn_like(kl)
    # Plain float32 matmuls: SDPA would pick its memory-efficient kernel here, whose shared
    # memory use racecheck reports as races.
    qf, kf, vf = (x.transpose(1, 2).float() for x in (ql, kl, vl))
    want = (torch.softmax(qf @ kf.transpose(-1, -2) / 128 ** 0.5, dim=-1) @ vf).transpose(1, 2)
    long_error = (prefill(ql, kl, vl).float() - want).abs().max().item()
    qw, kw, vw = (torch.randn(1, 300, 2, 256, device="cuda", dtype=torch.bfloat16)
                  for _ in range(3))
    qf, kf, vf = (x.transpose(1, 2).float() for x in (qw, kw, vw))
    want = (torch.softmax(qf @ kf.transpose(-1, -2) / 256 ** 0.5, dim=-1) @ vf).transpose(1, 2)
    long_error = max(long_error, (prefill(qw, kw, vw).float() - want).abs().max().item())
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(o).all())
    print(f"sanitize: causal GQA max abs error {error:.3g}; ragged output finite: {finite}; "
          f"unmasked 8300 keys and D 256 max abs error {long_error:.3g}")
    if not (error < MAX_ERROR and finite and long_error < MAX_ERROR):
        raise SystemExit("prefill results are wrong under the sanitizer run")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.sanitize:
        sanitize()
        return
    results = []
    for row in shapes(args):
        results.append(bench_shape(row, args))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if not args.dims_only:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    tuning = [] if args.no_sweep or args.dims_only else sweep(args)
    if tuning:
        print(sweep_table(tuning))
    if args.json:
        import torch

        benchmark = "attention_head_dims" if args.dims_only else "attention"
        write_results(args.json, benchmark, results, torch=torch, sweep=tuning,
                      plot=os.path.basename(args.plot))


if __name__ == "__main__":
    main()
