"""The attention tutorial at 3 and 4 K/V stages on the GPU: compile time (cold, with the
kiln-insert-waits share), correctness against float64 on ragged causal and plain batches, and
TFLOP/s at one 4k shape beside torch SDPA (cuDNN / flash) in the same run. Prints JSON lines.

Run: ``python bench/tutorial_stages_check.py`` (a CUDA GPU with torch)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from source_modules import EXAMPLES, load_module  # noqa: E402

attention = load_module(EXAMPLES / "tutorials" / "attention.py", "kiln_tutorial_attention")


def compile_times(d: int, block, causal: bool) -> dict:
    """Cold compile for sm_90a: wall seconds in all and in kiln-insert-waits."""
    x = np.zeros((256, 2 * d), ml_dtypes.bfloat16)
    start = time.perf_counter()
    ck = attention.attention_kernel.compile(x, x, x, x, np.array([0, 256], np.int32), 1.0,
                                            CAUSAL=causal, ALIGN=16,
                                            **attention.config(d, "sm_90a", block),
                                            target="sm_90a")
    wall = time.perf_counter() - start
    steps = {row[0]: row[1] / 1e3 for row in ck.metadata["compile_profile"]}
    return dict(compile_s=round(wall, 2),
                insert_waits_s=round(steps.get("gpu.passes.kiln-insert-waits", -1), 3))


def check(d: int, block, causal: bool) -> dict:
    heads, lengths = 2, [1000, 0, 37, 700]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (torch.randn(int(cu[-1]), heads * d, device="cuda").to(torch.bfloat16)
               for _ in range(3))
    o = torch.full_like(q, float("nan"))
    times = compile_times(d, block, causal)
    attention.attention(q, k, v, o, torch.from_numpy(cu).cuda(), max(lengths), heads,
                        causal=causal, block=block)
    torch.cuda.synchronize()
    want = attention.reference(*(t.float().cpu().numpy() for t in (q, k, v)), cu, heads, causal)
    got = o.float().cpu().numpy()
    err = float(np.linalg.norm(np.nan_to_num(got, nan=1e9) - want) / np.linalg.norm(want))
    return dict(d=d, block=block, causal=causal, **times, rel_err=err,
                ok=bool(np.isfinite(got).all() and err < 1e-2))


def speed(d: int, block, causal: bool, seq: int = 4096, heads: int = 16) -> dict:
    from triton.testing import do_bench
    q, k, v = (torch.randn(seq, heads * d, device="cuda").to(torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    run = lambda: attention.attention(q, k, v, o, cu, seq, heads, causal=causal, block=block)
    ms = do_bench(run, warmup=50, rep=200, return_mode="median")
    sq, sk, sv = (t.view(1, seq, heads, d).transpose(1, 2) for t in (q, k, v))
    sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        sq, sk, sv, is_causal=causal), warmup=50, rep=200, return_mode="median")
    flops = 4 * heads * seq * seq * d / (2 if causal else 1)
    return dict(d=d, block=block, causal=causal, seq=seq, tflops=round(flops / ms / 1e9, 1),
                sdpa_tflops=round(flops / sdpa / 1e9, 1), vs_sdpa=round(sdpa / ms, 3))


if __name__ == "__main__":
    for args in ((64, (128, 64, 8, 4), True), (64, (128, 64, 8, 4), False),
                 (128, (128, 64, 8, 4), True), (128, None, True)):
        print(json.dumps(check(*args)), flush=True)
    for args in ((128, None, True), (128, (128, 64, 8, 4), True), (64, (128, 64, 8, 4), True),
                 (64, None, True)):
        print(json.dumps(speed(*args)), flush=True)
