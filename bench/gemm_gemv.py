"""The decode GEMVs (``kiln.kernels.gemm.gemv``; ``.gemv_mma`` at M of 5..16) against cuBLAS
and ``matmul``'s pick.

For each Llama-3 layer (weights N x K, as ``bench/gemm.py --llm``; ``--models``/``--layers``
filter) at each ``--m``: checks the GEMV against float32 (relative error < 1e-2), then times
cuBLAS (``torch.matmul(x, w.T)``), ``matmul`` (its small-M pick) and the GEMV's variants with
interleaved samples (``gemm_llm.measure_pair``; kernel-only GPU times), and prints the ratios
cuBLAS time / Kiln time and the default variant's GB/s. At M = 1 the CUDA-core variants
(``rRuUwW``: weight rows per warp, loads in flight, warps per CTA), above 4 the tensor-core
ones (``mmaWwUuTt``: warps per CTA, 32-column blocks in flight per warp, 16-row tiles per CTA;
``--mma``: at every M).
Usage: ``python bench/gemm_gemv.py [--m 1 16] [--layers qkv] [--mma] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln.kernels.gemm import matmul
from kiln.kernels.gemm import gemv_mma
from kiln.kernels.gemm.gemv import MAX_ROWS, ROWS, UNROLL, WARPS, gemv_kernel, grid
from kiln.kernels import runtime
from gemm_llm import MODELS, measure_pair


# (weight rows per warp, loads in flight per lane and row, warps per CTA): the default first
VARIANTS = ((ROWS, UNROLL, WARPS), (1, 8, WARPS), (1, 8, 4), (2, 4, 4), (1, 4, 4))
# the tensor-core GEMV's (warps per CTA, blocks in flight per warp, 16-row tiles per CTA):
# the default first
MMA_VARIANTS = ((gemv_mma.WARPS, gemv_mma.UNROLL, gemv_mma.TILES), (8, 2, 2), (8, 1, 4),
                (16, 1, 2), (16, 2, 2), (16, 2, 1))


def _bound_call(kernel, grid, x, w, scalars, warps):
    """A call of ``kernel`` on ``x`` and ``w`` (bound once on ``grid`` with ``scalars`` after the
    output) writing a fresh ``M x N`` bf16 output, as the library's entry point does."""
    m, n = x.shape[0], w.shape[0]
    bound = runtime.bind(kernel, grid,
                         [x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), *scalars],
                         target="sm_90a", num_warps=warps)

    def call():
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        bound(x.data_ptr(), w.data_ptr(), c.data_ptr())
        return c
    return call


def mma_call(x, w, warps=gemv_mma.WARPS, unroll=gemv_mma.UNROLL, tiles=gemv_mma.TILES):
    m, k = x.shape
    n = w.shape[0]
    kernel = gemv_mma.mma_gemv_kernel("bf16", "bf16", gemv_mma.halves(m), warps, unroll, tiles)
    return _bound_call(kernel, gemv_mma.grid(n, tiles), x, w, (m, n, k), warps)


def gemv_call(x, w, rows=ROWS, unroll=UNROLL, warps=WARPS):
    m, k = x.shape
    n = w.shape[0]
    return _bound_call(gemv_kernel("bf16", "bf16", m, rows, unroll), grid(n, rows, warps), x, w,
                       (n, k), warps)


def variant_calls(x, w, mma: bool = False) -> dict:
    """name -> call of each GEMV variant for ``x``'s M (the default first; at M of 2..4 only
    it), the tensor-core ones above M = 4 or with ``mma``."""
    m = x.shape[0]
    if m > MAX_ROWS or mma:
        return {f"mma{wp}w{u}u{t}t": mma_call(x, w, wp, u, t) for wp, u, t in MMA_VARIANTS}
    return {f"r{r}u{u}w{wp}": gemv_call(x, w, r, u, wp)
            for r, u, wp in (VARIANTS if m == 1 else VARIANTS[:1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--layers", nargs="+")
    parser.add_argument("--mma", action="store_true",
                        help="the tensor-core GEMV's variants at M <= 4 too")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for layer, (n, k) in MODELS[model].items():
            if args.layers and layer not in args.layers:
                continue
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                reference = x.float() @ w.float().T
                named = variant_calls(x, w, args.mma)
                calls = list(named.values())
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
                variants = {name: cublas / g for name, (_, g) in zip(named, gemvs)}
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
