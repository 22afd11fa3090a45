"""Tile configs of the matmul tutorial (examples/tutorials/matmul.py) against cuBLAS and
Triton's tutorial matmul at 4096^3 and 8192^3 bf16, in one run; prints a line per config and
the rows as JSON.

Run: ``python bench/tutorial_matmul.py [--sizes 4096 8192] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "tutorials"))
sys.path.insert(0, str(ROOT / "bench"))

import matmul  # noqa: E402
from timing import queued_ms  # noqa: E402

# the tutorial's sm_90a config, then a wider grouped order (the pipeline schedules and other
# tile shapes are A/B'd on bench/matmul_epilogue_ab.py's copy of the kernel)
BASE = dict(BM=128, BN=256, BK=64, STAGES=4, GROUP_M=8, THREADS=256, STAGED=True)
CONFIGS = [BASE, dict(BASE, GROUP_M=16), dict(BASE, STAGED=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    import torch
    from tutorials_triton import matmul_problem

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for size in args.sizes:
        p = matmul_problem(torch, size, gen)
        a, b, bias, c, want, flops = p.a, p.b, p.bias, p.c, p.want, p.flops
        m, n, k, t_mm = p.m, p.n, p.k, p.triton
        t_mm()
        cublas = flops / queued_ms(lambda: torch.matmul(a, b), args.repeat) / 1e9
        tri = flops / queued_ms(t_mm, args.repeat) / 1e9
        for cfg in CONFIGS:
            gl = ((m + cfg["BM"] - 1) // cfg["BM"] * ((n + cfg["BN"] - 1) // cfg["BN"]),)

            def run():
                matmul.matmul_kernel[gl](a, b, bias, c, **cfg, ALIGN=16)

            c.fill_(float("nan"))
            run()
            err = float((c.float() - want).abs().max() / want.abs().max())
            tflops = flops / queued_ms(run, args.repeat) / 1e9
            row = {"shape": [m, n, k], "config": cfg, "kiln_tflops": tflops,
                   "triton_tflops": tri, "cublas_tflops": cublas, "vs_cublas": tflops / cublas,
                   "vs_triton": tflops / tri, "max_rel_err": err}
            rows.append(row)
            print(f"{size}^3 {cfg['BM']}x{cfg['BN']}x{cfg['BK']} s{cfg['STAGES']} "
                  f"g{cfg['GROUP_M']}{' staged' if cfg['STAGED'] else ''}: kiln "
                  f"{tflops:6.1f} TFLOP/s  triton {tri:6.1f}  cublas {cublas:6.1f}  "
                  f"x{tflops / cublas:.3f} cublas  x{tflops / tri:.3f} triton  err {err:.1e}",
                  flush=True)
    print(json.dumps({"benchmark": "tutorial_matmul", "device": torch.cuda.get_device_name(0),
                      "rows": rows}))


if __name__ == "__main__":
    main()
