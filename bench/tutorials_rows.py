"""Long-row A/B of the softmax and layer-norm tutorials: Kiln's tutorials (a persistent grid, the
next row streamed into shared memory), their earlier one-block-a-row design, persistent
variants of bench/rows_variants.py (other thread counts and blocks per SM), Triton's tutorial
designs (bench/tutorials_triton.py, set up as in bench/tutorials.py) and torch's device copy,
all in one run, at 4k-32k float32 columns (``2^24`` elements a matrix, as ``tutorials.py
--quick``).

Every kernel is first checked against torch in float64 (a wrong result is reported and left
out). GB/s
counts the matrix read once and written once; times are ``timing.queued_ms`` medians.

Usage (on an H100/H200): ``python bench/tutorials_rows.py [--cols 32768,4096] [--json out]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402
from timing import queued_ms, time_ms  # noqa: E402
from tutorials import fused_softmax, layernorm  # noqa: E402
import rows_variants  # noqa: E402

# (threads, blocks per SM) of the persistent variants to try, per column count
ROWS_CONFIGS = {4096: [(256, 2), (256, 4), (256, 8), (512, 2), (512, 4)],
                8192: [(512, 1), (512, 2), (512, 4)],
                16384: [(1024, 1), (1024, 2), (512, 1), (512, 2)], 32768: [(1024, 1), (512, 1)]}
# column counts where layernorm_rows_masked (per-element masks on w, b, y) is tried too
MASKED_COLS = (32768,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", default="32768,4096,16384,8192")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    import torch
    import triton
    from tutorials_triton import layernorm_kernel as t_layernorm, softmax_kernel as t_softmax

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 2 / time_ms(lambda: dst.copy_(src), args.repeat) / 1e6
    del src, dst
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, {sms} SMs", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def record(op, n, variant, fn, nbytes):
        ms = queued_ms(fn, args.repeat)
        gbs = nbytes / ms / 1e6
        rows.append({"op": op, "cols": n, "variant": variant, "us": ms * 1e3, "gbs": gbs,
                     "of_copy": gbs / copy_gbs})
        return gbs

    def check(name, got, want, tol):
        err = float((got.double() - want).abs().max())
        if not err <= tol:
            print(f"WRONG {name}: max error {err:.3g} > {tol}", flush=True)
            return False
        return True

    def report(what, results):
        peer = results.get("triton", float("nan"))
        for k, v in results.items():
            print(f"{what} {k:16s} {v:6.0f} GB/s  {v / copy_gbs:.2f} of copy  "
                  f"{v / peer:.2f} of triton", flush=True)

    for n in [int(c) for c in args.cols.split(",")]:
        m = (1 << 24) // n
        x = torch.randn(m, n, device="cuda", generator=gen)
        nbytes = 8 * m * n
        block = triton.next_power_of_2(n)
        chunk = min(block, 4096)
        want = torch.softmax(x.double(), dim=1)
        y = torch.full_like(x, float("nan"))
        results = {}
        one_row = min(1024, max(128, block // 16))
        variants = {"tutorial": lambda: fused_softmax.softmax(x, y),
                    "one-row": lambda: rows_variants.softmax_one_row[(m,)](
                        x, y, n, BLOCK=block, THREADS=one_row, ALIGN=16)}
        for threads, per_sm in ROWS_CONFIGS[n]:
            grid = min(m, sms * per_sm)
            variants[f"rows t{threads} x{per_sm}"] = (
                lambda g=grid, t=threads: rows_variants.softmax_rows[(g,)](
                    x, y, m, n, g, BLOCK=block, THREADS=t, ALIGN=16))
        t_grid = (min(m, sms * 4),)
        variants["triton"] = lambda: t_softmax[t_grid](y, x, x.stride(0), y.stride(0), m, n,
                                                       BLOCK=block,
                                                       num_warps=8 if block <= 8192 else 16)
        for name, fn in variants.items():
            y.fill_(float("nan"))
            try:
                fn()
            except Exception as err:  # one variant failing to build must not end the A/B
                print(f"FAILED softmax {n} {name}: {type(err).__name__}: {err}"[:400])
                continue
            if check(f"softmax {n} {name}", y, want, 1e-6):
                results[name] = record("softmax", n, name, fn, nbytes)
        report(f"softmax   {m}x{n}", results)

        w = torch.randn(n, device="cuda", generator=gen)
        b = torch.randn(n, device="cuda", generator=gen)
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        want = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        results = {}
        variants = {"tutorial": lambda: layernorm.layernorm(x, w, b, y, mean, rstd),
                    "one-row": lambda: rows_variants.layernorm_one_row[(m,)](
                        x, w, b, y, mean, rstd, n, 1e-5, BLOCK=block, CHUNK=chunk,
                        THREADS=one_row, ALIGN=16)}
        for threads, per_sm in ROWS_CONFIGS[n]:
            grid = min(m, sms * per_sm)
            variants[f"rows t{threads} x{per_sm}"] = (
                lambda g=grid, t=threads: rows_variants.layernorm_rows[(g,)](
                    x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, CHUNK=chunk,
                    THREADS=t, ALIGN=16))
            if n in MASKED_COLS:
                variants[f"masked t{threads} x{per_sm}"] = (
                    lambda g=grid, t=threads: rows_variants.layernorm_rows_masked[(g,)](
                        x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, CHUNK=chunk,
                        THREADS=t, ALIGN=16))
        ln_block = min(65536 // 4, block)
        variants["triton"] = lambda: t_layernorm[(m,)](
            x, y, w, b, mean, rstd, x.stride(0), n, 1e-5, BLOCK=ln_block,
            num_warps=min(max(ln_block // 256, 1), 8))
        for name, fn in variants.items():
            y.fill_(float("nan"))
            try:
                fn()
            except Exception as err:  # one variant failing to build must not end the A/B
                print(f"FAILED layernorm {n} {name}: {type(err).__name__}: {err}"[:400])
                continue
            if check(f"layernorm {n} {name}", y, want, 1e-4):
                results[name] = record("layernorm", n, name, fn, nbytes)
        report(f"layernorm {m}x{n}", results)
    if args.json:
        write_results(args.json, "tutorials_rows", rows, torch, copy_gbs=copy_gbs)
    else:
        print(json.dumps({"copy_gbs": copy_gbs, "rows": rows}))


if __name__ == "__main__":
    main()
