"""Hopper prefill speed and accuracy under one compile setting, for A/B runs of codegen changes.

Run it once per setting of an environment switch that changes the emitted code (e.g.
``KILN_SCALARIZE_STRUCTS=0`` and ``=1``), alternating, in one batch: each run checks every head
dim against a float32 torch reference (odd shape, causal and not; max abs error < 3e-2, NaN
fails), then times 4k-token prefill (FlashAttention's grid: 16k tokens, heads * D = 2048) with
CUDA events, queued (no host time), median of ``--repeat``; TFLOP/s = 4 B H S^2 D, halved for
causal. One JSON line per row; the A/B ratio is the two runs' TFLOP/s of the same row.

Example::

    KILN_SCALARIZE_STRUCTS=0 python bench/prefill_codegen_ab.py --label off --dims 128,256
    KILN_SCALARIZE_STRUCTS=1 python bench/prefill_codegen_ab.py --label on --dims 128,256
"""

from __future__ import annotations

import argparse
import json
import math

from timing import queued_ms


def reference(q, k, v, causal: bool):
    """float32 attention of [B, S, H, D] tensors (GQA heads repeated)."""
    import torch

    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    group = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="this run's name in the JSON lines")
    parser.add_argument("--dims", default="128,256")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    ns = parser.parse_args()
    import torch

    from kiln.kernels.attention import prefill

    torch.manual_seed(0)
    for d in (int(x) for x in ns.dims.split(",")):
        for causal in (True, False):
            q = torch.randn(1, 1000, 4, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 1000, 2, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            out = prefill(q, k, v, causal=causal)
            error = (out.float() - reference(q, k, v, causal)).abs().max().item()
            ok = error < 3e-2  # NaN compares False
            heads, batch = 2048 // d, 16 * 1024 // ns.seq
            q, k, v = (torch.randn(batch, ns.seq, heads, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            ms = queued_ms(lambda: prefill(q, k, v, causal=causal), ns.repeat)
            flops = 4 * batch * heads * ns.seq * ns.seq * d / (2 if causal else 1)
            print(json.dumps({"label": ns.label, "d": d, "causal": causal, "seq": ns.seq,
                              "max_abs_error": round(error, 5), "ok": ok, "ms": round(ms, 4),
                              "tflops": round(flops / ms / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
