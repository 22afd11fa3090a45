"""The decode GEMV kernel (``kiln.kernels.gemm.gemv``) against cuBLAS and ``matmul``'s pick.

For each Llama-3 layer (weights N x K, as ``bench/gemm.py --llm``) at each ``--m``: checks the
GEMV against float32 (relative error < 1e-2), then times cuBLAS (``torch.matmul(x, w.T)``),
``matmul`` (its small-M pick) and the GEMV with interleaved samples (``gemm_llm.measure_pair``;
kernel-only GPU times), and prints the ratios cuBLAS time / Kiln time and the GEMV's GB/s.
Usage: ``python bench/gemm_gemv.py [--m 1 4] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln.kernels.gemm import matmul
from kiln.kernels.gemm.gemv import ROWS, UNROLL, WARPS, gemv_kernel, grid
from kiln.kernels import runtime
from gemm_llm import MODELS, measure_pair


# (weight rows per warp, loads in flight per lane and row, warps per CTA): the default first
VARIANTS = ((ROWS, UNROLL, WARPS), (1, 8, WARPS), (1, 8, 4), (2, 4, 4), (1, 4, 4))


def gemv_call(x, w, rows=ROWS, unroll=UNROLL, warps=WARPS):
    m, k = x.shape
    n = w.shape[0]
    kernel = gemv_kernel("bf16", "bf16", m, rows, unroll)
    bound = runtime.bind(kernel, grid(n, rows, warps),
                         [x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), n, k],
                         target="sm_90a", num_warps=warps)

    def call():
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        bound(x.data_ptr(), w.data_ptr(), c.data_ptr())
        return c
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for model, layers in MODELS.items():
        for layer, (n, k) in layers.items():
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                reference = x.float() @ w.float().T
                calls = [gemv_call(x, w, *v) for v in (VARIANTS if m == 1 else VARIANTS[:1])]
                errs = [((call().float() - reference).norm() / reference.norm()).item()
                        for call in calls]
                if not max(errs) < 1e-2:
                    print(f"{model} {layer} M={m}: GEMV WRONG, relative errors {errs}")
                    continue
                fns = (lambda: torch.matmul(x, w.T), lambda: matmul(x, w, trans_b=True), *calls)
                (_, cublas), (_, pick), *gemvs = measure_pair(torch, fns, args.repeat,
                                                              args.batch)
                gemv = gemvs[0][1]
                gbps = 2 * (n * k + m * k + m * n) / gemv / 1e6
                variants = {f"r{r}u{u}w{w}": cublas / g
                            for (r, u, w), (_, g) in zip(VARIANTS, gemvs)}
                row = dict(model=model, layer=layer, m=m, n=n, k=k, cublas_us=cublas * 1e3,
                           matmul_us=pick * 1e3, gemv_us=gemv * 1e3, gemv_ratio=cublas / gemv,
                           matmul_ratio=cublas / pick, gemv_gbps=gbps, variants=variants)
                rows.append(row)
                print(f"{model:10} {layer:7} M={m:<3} cuBLAS {cublas * 1e3:6.1f} us  matmul "
                      f"{pick * 1e3:6.1f} ({cublas / pick:.3f})  GEMV {gemv * 1e3:6.1f} "
                      f"({cublas / gemv:.3f}, {gbps:.0f} GB/s) "
                      + " ".join(f"{v} {r:.3f}" for v, r in variants.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main()
