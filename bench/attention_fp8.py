"""Kiln's FP8 (e4m3) Hopper prefill vs Kiln's own bf16 prefill, in one run.

Shapes: D 128, seq ``--seqs`` (default 4k, 8k, 16k) with batch * seq = 16k tokens, 16 heads
(heads * D = 2048, the FlashAttention grid of ``bench/attention.py``), causal and not. Inputs:
bf16 ``randn`` q/k/v, quantised per (batch, head) to e4m3 with FlashAttention-3's descales
(``[B, H]``: amax / 448); the bf16 prefill runs on the bf16 inputs.

Method: each shape is checked first (the FP8 output against the bf16 prefill of the
*dequantised* FP8 inputs: max abs error below FP8's bound ``2**-4 max|v| + 2**-7 max|o|`` (P's
e4m3 rounding, at most ``2**-4 sum_j P_j |v_j|``, plus bf16's), NaN fails; exact checks against
float64 live in ``tests/test_attention_prefill_fp8.py``), then both are timed with CUDA events
(``--repeat`` samples of ``--batch`` calls queued behind a busy stream, median: kernel time,
no host time, for both alike; ``timing.queued_ms``). TFLOP/s = 4 * B * H * S^2 * D / time,
halved for causal; ``ratio`` = FP8 / bf16 (goal: >= 1.6 at seq 4k-16k). Prints one JSON
object per row and a table.

``--variants NAME ...`` also times the FP8 kernel with each named ``VARIANTS`` entry of
:class:`HopperFp8PrefillConfig` overrides (checked like the default; ``ratio`` columns per
variant), for A/B runs of tiles and pipeline depths in one process.

Usage (on an H100/H200): ``python bench/attention_fp8.py [--json out.json] [--seqs 4096 8192]
[--causal 0 1] [--variants bn128 s4r2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from unittest import mock

from results_io import write_results
from timing import queued_ms

TOKENS = 16 * 1024
HIDDEN = 2048
HEAD_DIM = 128
SEQS = (4096, 8192, 16384)
FP8_MAX = 448.0
# Named HopperFp8PrefillConfig overrides for --variants (A/B runs in one process).
VARIANTS = {
    "bn128": dict(block_n=128),  # the default before batch 2 of session 34
    "bn160": dict(block_n=160),
    "s4r2": dict(stages=4, raw_stages=2, block_n=128),
    "s4r4": dict(stages=4, raw_stages=4, block_n=128),
    "p56": dict(producer_registers=56, consumer_registers=224),
    "b4": dict(transpose_batch=4),
    "nomax": dict(exp_before_max=False),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    parser.add_argument("--repeat", type=int, default=10, help="timed samples per shape")
    parser.add_argument("--batch", type=int, default=5, help="queued calls per sample")
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="also time the FP8 kernel with these config overrides")
    return parser.parse_args(argv)


def quantise(x):
    """``(x8, descale)``: e4m3 ``x / descale`` with one descale per (batch, head), ``[B, H]``."""
    import torch

    amax = x.abs().amax(dim=(1, 3)).float().clamp(min=1e-6)  # [B, H]
    descale = amax / FP8_MAX
    x8 = (x.float() / descale[:, None, :, None]).to(torch.float8_e4m3fn)
    return x8, descale


def bench_row(row: dict, args) -> dict:
    import torch

    from kiln.kernels.attention import prefill

    b, s, h, d, causal = (row[k] for k in ("batch", "seq", "heads", "d", "causal"))
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = quantise(q), quantise(k), quantise(v)

    def fp8():
        return prefill(q8, k8, v8, causal=causal, descale_q=dq, descale_k=dk, descale_v=dv)

    def variant(overrides):
        """``fp8`` with ``HopperFp8PrefillConfig.for_head_dim`` patched to add ``overrides``."""
        from kiln.kernels.attention.prefill_hopper_fp8_config import HopperFp8PrefillConfig

        config = dataclasses.replace(HopperFp8PrefillConfig.for_head_dim(d), **overrides)

        def call():
            with mock.patch.object(HopperFp8PrefillConfig, "for_head_dim",
                                   lambda *head_dims: config):
                return fp8()
        return call

    def bf16():
        return prefill(q, k, v, causal=causal)

    dequantised = [(x8.float() * ds[:, None, :, None]).to(torch.bfloat16)
                   for x8, ds in ((q8, dq), (k8, dk), (v8, dv))]
    reference = prefill(*dequantised, causal=causal).float()
    bound = 2 ** -4 * dequantised[2].float().abs().max().item() + \
        2 ** -7 * reference.abs().max().item()

    def checked(call, name):
        out = call()
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        error = (out.float() - reference).abs().max().item()
        if not error < bound:  # also catches NaN
            raise SystemExit(f"FP8 prefill ({name}) wrong at {row}: max abs error {error} > "
                             f"{bound:.4f}")
        return error

    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    result = dict(row, max_abs_error=checked(fp8, "default"))
    result["fp8_tflops"] = flops / queued_ms(fp8, args.repeat, args.batch) / 1e9
    result["bf16_tflops"] = flops / queued_ms(bf16, args.repeat, args.batch) / 1e9
    result["ratio_fp8_vs_bf16"] = result["fp8_tflops"] / result["bf16_tflops"]
    print(f"  {s} causal={causal} default: {result['fp8_tflops']:.1f} TFLOP/s "
          f"({result['ratio_fp8_vs_bf16']:.2f}x bf16 {result['bf16_tflops']:.1f}), max abs "
          f"error {result['max_abs_error']:.4f} (bound {bound:.4f})", flush=True)
    for name in args.variants:
        call = variant(VARIANTS[name])
        error = checked(call, name)
        tflops = flops / queued_ms(call, args.repeat, args.batch) / 1e9
        result[f"{name}_tflops"] = tflops
        result[f"ratio_{name}_vs_bf16"] = tflops / result["bf16_tflops"]
        print(f"  {s} causal={causal} {name}: {tflops:.1f} TFLOP/s "
              f"({tflops / result['bf16_tflops']:.2f}x bf16), error {error:.4f}", flush=True)
    return result


def main(argv=None) -> None:
    import torch

    args = parse_args(argv)
    rows = [dict(batch=TOKENS // s, seq=s, heads=HIDDEN // HEAD_DIM, d=HEAD_DIM, causal=c)
            for c in map(bool, args.causal) for s in args.seqs]
    results = []
    for row in rows:
        result = bench_row(row, args)
        print(json.dumps(result), flush=True)
        results.append(result)
    print(f"{'seq':>6} {'causal':>6} {'fp8 TF/s':>9} {'bf16 TF/s':>9} {'ratio':>6} {'err':>8}")
    for r in results:
        print(f"{r['seq']:>6} {str(r['causal']):>6} {r['fp8_tflops']:>9.1f} "
              f"{r['bf16_tflops']:>9.1f} {r['ratio_fp8_vs_bf16']:>6.2f} "
              f"{r['max_abs_error']:>8.4f}")
    if args.json:
        write_results(args.json, "attention_fp8", results, torch=torch)


if __name__ == "__main__":
    main()
