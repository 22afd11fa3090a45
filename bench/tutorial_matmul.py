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
    import triton
    from tutorials_triton import matmul_kernel as t_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for size in args.sizes:
        m = n = k = size
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        b = torch.randn(k, n, device="cuda", generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=gen)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(c)
        x = a.float() @ b.float() + bias
        want = 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
        flops = 2.0 * m * n * k
        grid = (triton.cdiv(m, 128) * triton.cdiv(n, 256),)

        def t_mm():
            t_matmul[grid](a, b, bias, ref, m, n, k, a.stride(0), b.stride(0), ref.stride(0),
                           BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3)

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
