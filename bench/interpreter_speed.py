"""Seconds the CPU interpreter takes on the tutorials and a library kernel (no GPU needed).

Each case runs once to build its plan (tracing and parsing are not what is measured), then
``--repeat`` times; the JSON line gives the median wall and CPU seconds (CPU time is steadier
on a shared machine) and the interpreter's op dispatches (closures run by blocks) per call.
Cases: the 512^3 tile GEMM tutorial (bias + GELU; sm_90a's mma.sync and gfx950's MFMA), fused
softmax and layer norm over 64 x 4096 f32, the library ``matmul`` (bf16, 256 x 256 x 256,
sm_90a's WGMMA kernel, warp-group contexts) and ``prefill`` (causal, 2 heads of 256 x 64).

Usage: ``python bench/interpreter_speed.py [--repeat 3] [--only matmul]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "tutorials"))

import fused_softmax  # noqa: E402
import layernorm  # noqa: E402
import matmul  # noqa: E402

from kiln.interpreter import plan as _plan  # noqa: E402
from kiln.kernels.attention import prefill  # noqa: E402
from kiln.kernels.gemm import matmul as library_matmul  # noqa: E402


def _bf16(rng, shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def cases(rng):
    """name -> a function running the case once in the interpreter."""
    a, b = _bf16(rng, (512, 512)), _bf16(rng, (512, 512))
    bias, c = rng.standard_normal(512).astype(np.float32), np.zeros((512, 512), ml_dtypes.bfloat16)
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    w, bb = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    y, mean, rstd = np.zeros_like(x), np.zeros(64, np.float32), np.zeros(64, np.float32)
    la, lb = _bf16(rng, (256, 256)), _bf16(rng, (256, 256))
    q, k, v = _bf16(rng, (1, 256, 2, 64)), _bf16(rng, (1, 256, 2, 64)), _bf16(rng, (1, 256, 2, 64))
    return {
        "matmul_tutorial_512": lambda: matmul.matmul(a, b, bias, c, backend="interpret",
                                                     target="sm_90a"),
        "matmul_tutorial_512_gfx950": lambda: matmul.matmul(a, b, bias, c, backend="interpret",
                                                            target="gfx950"),
        "softmax_64x4096": lambda: fused_softmax.softmax(x, y, backend="interpret",
                                                         target="sm_90a"),
        "layernorm_64x4096": lambda: layernorm.layernorm(x, w, bb, y, mean, rstd,
                                                         backend="interpret", target="sm_90a"),
        "library_matmul_256": lambda: library_matmul(la, lb, target="sm_90a",
                                                     backend="interpret"),
        "library_prefill_256_causal": lambda: prefill(q, k, v, causal=True, target="sm_90a",
                                                      backend="interpret"),
    }


class _Dispatches:
    """Counts the closures the interpreter runs (each block adds its length once per run)."""

    def __init__(self):
        self.count = 0
        self._run = _plan.Block.run

    def __enter__(self):
        def run(block, env, ctx, counter=self, inner=self._run):
            counter.count += len(block.runs)
            inner(block, env, ctx)

        _plan.Block.run = run
        return self

    def __exit__(self, *exc):
        _plan.Block.run = self._run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = parser.parse_args()
    for name, fn in cases(np.random.default_rng(0)).items():
        if args.only and args.only not in name:
            continue
        fn()  # trace, compile the plan
        with _Dispatches() as counted:
            fn()
        seconds, cpu = [], []
        for _ in range(args.repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(json.dumps({"case": name, "seconds": round(statistics.median(seconds), 3),
                          "cpu_seconds": round(statistics.median(cpu), 3),
                          "dispatches": counted.count}), flush=True)


if __name__ == "__main__":
    main()
