"""A/B of the matmul tutorial's copies, schedule and epilogue (bench-local variants of
examples/tutorials/matmul.py's kernel) against cuBLAS and Triton's tutorial matmul, one run.

``TMA``: the GlobalTiles' masks are the tensors' own extents (``a.shape``), so ``kiln.copy``
moves them with TMA on sm_90a (else the scalar ``m, n, k``: ``cp.async``). ``STAGED``: C goes
through shared memory (TMA stores where ``TMA``). ``EARLY``: ``kiln.pipeline``'s
``barrier_before_fetch`` (copies N - 1 ahead with a group in flight, a second barrier a step).
``HANDOFF``: ``kiln.pipeline``'s ``handoff`` (no block barrier a step: every thread releases a
stage on its tiles' empty mbarriers after the WGMMA group reading it retired, and the TMA
refill waits for those releases). ``IN_FLIGHT``: ``kiln.pipeline``'s ``mma_in_flight`` (None:
one WGMMA group kept in flight across a step, the fetch 2 stages ahead of 4; 0: none, 3 ahead).
``EPI``: 0 the tutorial's epilogue (bias + GELU with ``rcp.approx``), 3 no bias and no GELU
(the accumulator cast and stored: the floor of the epilogue).

Run: ``python bench/matmul_epilogue_ab.py [--sizes 4096 8192] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import kiln  # noqa: E402
from kiln import bf16, f32, i32  # noqa: E402

SQRT_2_OVER_PI = 0.7978845608028654


@kiln.kernel(num_threads="THREADS")
def ab_kernel(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], bias: kiln.Tensor[f32],
              c: kiln.Tensor[bf16, 2], m: i32, n: i32, k: i32, BM: kiln.constexpr,
              BN: kiln.constexpr, BK: kiln.constexpr, STAGES: kiln.constexpr,
              GROUP_M: kiln.constexpr, THREADS: kiln.constexpr, EPI: kiln.constexpr,
              TMA: kiln.constexpr, STAGED: kiln.constexpr, IN_FLIGHT: kiln.constexpr = None,
              EARLY: kiln.constexpr = False, HANDOFF: kiln.constexpr = False):
    pid, tiles_m, tiles_n = kiln.block_id(0), (m + BM - 1) // BM, (n + BN - 1) // BN
    first = pid // (GROUP_M * tiles_n) * GROUP_M
    rows = kiln.min(tiles_m - first, GROUP_M)
    row0 = (first + pid % (GROUP_M * tiles_n) % rows) * BM
    col0 = pid % (GROUP_M * tiles_n) // rows * BN
    a_s = [kiln.tiles.operand_tile((BM, BK), bf16, "a") for _ in range(STAGES)]
    b_s = [kiln.tiles.operand_tile((BK, BN), bf16, "b") for _ in range(STAGES)]
    ends = (a.shape, b.shape, c.shape) if TMA else ((m, k), (k, n), (m, n))

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=ends[0][0],
                                  col_end=ends[0][1], align=16, col_multiple=8), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=ends[1][0],
                                  col_end=ends[1][1], align=16, col_multiple=8), b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, BK, stages=STAGES, fetch=fetch, mma_in_flight=IN_FLIGHT,
                            barrier_before_fetch=EARLY, handoff=HANDOFF):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    y = acc
    if EPI < 3:
        x = acc + kiln.load(kiln.GlobalTile(bias, (BM, BN), (0, col0), col_end=n), acc.layout)
        z = (x + 0.044715 * x * x * x) * (2.0 * SQRT_2_OVER_PI)
        y = x * kiln.rcp(1.0 + kiln.exp(-z), approx=True)
    out = kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=ends[2][0], col_end=ends[2][1],
                          align=16)
    kiln.copy(kiln.cast(y, bf16), out, staged=STAGED)


BASE = dict(BM=128, BN=256, BK=64, STAGES=4, GROUP_M=8, THREADS=256, EPI=0, TMA=True,
            STAGED=True)
# name: the changes from BASE (the tutorial's sm_90a config) and launch options
VARIANTS = {
    "cp.async s4": dict(TMA=False, STAGED=False),
    "tma s4 direct-C": dict(STAGED=False),
    "tma s4": {},
    "tma s4 early": dict(EARLY=True),
    "tma s4 handoff": dict(HANDOFF=True),
    "tma s4 handoff g16": dict(HANDOFF=True, GROUP_M=16),
    "tma s3 early": dict(STAGES=3, EARLY=True),
    "tma s4 if0": dict(IN_FLIGHT=0),
    "tma s4 g16": dict(GROUP_M=16),
    "tma s4 nobias": dict(EPI=3),
}


def config(name: str) -> tuple[dict, dict]:
    """(constexprs, launch options) of variant ``name``."""
    changes = dict(VARIANTS[name])
    maxnreg = changes.pop("maxnreg", None)
    return dict(BASE, **changes), ({} if maxnreg is None else {"maxnreg": maxnreg})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help="variant names to time, in order (default all)")
    parser.add_argument("--only", default=None,
                        help="comma-separated variant names and/or 'triton': launch each once, "
                             "no timing (for ncu)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    import torch
    import triton
    from timing import queued_ms
    from tutorials_triton import matmul_problem

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for size in args.sizes:
        p = matmul_problem(torch, size, gen)
        a, b, bias, c, flops, t_mm = p.a, p.b, p.bias, p.c, p.flops, p.triton
        m, n, k, want, want_plain = p.m, p.n, p.k, p.want, p.product

        if only and "triton" in only:
            t_mm()
            torch.cuda.synchronize()
        if only is None:
            t_mm()
            cublas = flops / queued_ms(lambda: torch.matmul(a, b), args.repeat) / 1e9
            tri = flops / queued_ms(t_mm, args.repeat) / 1e9
            print(f"{size}^3 cublas {cublas:6.1f} TFLOP/s  triton {tri:6.1f}", flush=True)
        for name in args.variants:
            if only is not None and name not in only:
                continue
            cfg, opts = config(name)
            epi = cfg["EPI"]
            k_grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)

            def run():
                ab_kernel[k_grid](a, b, bias, c, m, n, k, **cfg, **opts)

            c.fill_(float("nan"))
            try:
                run()
            except Exception as err:  # noqa: BLE001 - report and go on to the next variant
                print(f"{size}^3 {name}: FAILED {type(err).__name__}: {str(err)[:300]}",
                      flush=True)
                continue
            if only is not None:
                torch.cuda.synchronize()
                continue
            ref_c = want if epi < 3 else want_plain
            err = float((c.float() - ref_c).abs().max() / ref_c.abs().max())
            tflops = flops / queued_ms(run, args.repeat) / 1e9
            rows.append({"shape": [m, n, k], "variant": name, "kiln_tflops": tflops,
                         "triton_tflops": tri, "cublas_tflops": cublas,
                         "vs_cublas": tflops / cublas, "vs_triton": tflops / tri,
                         "max_rel_err": err})
            print(f"{size}^3 {name:18s} kiln {tflops:6.1f}  x{tflops / cublas:.3f} cublas  "
                  f"x{tflops / tri:.3f} triton  err {err:.1e}", flush=True)
    if rows:
        print(json.dumps({"benchmark": "matmul_epilogue_ab",
                          "device": torch.cuda.get_device_name(0), "rows": rows}))


if __name__ == "__main__":
    main()
