"""Long-row A/B of the softmax and layer-norm tutorials at 4k-32k float32 columns, one run:
the tutorials as shipped (``config``), their kernels with rows taken a block each (``direct``,
grid = rows) or streamed through shared memory over a persistent grid (``stream tT xK``: T
threads, K blocks per SM), layer norm with two rows in flight (``stream2``) or with ``w``/``b``
loaded before the reductions (``wb-early``; both in bench/rows_variants.py), Triton's
tutorial designs (bench/tutorials_triton.py, set up as in bench/tutorials.py) and torch's
device copy.

Matrices have ``2^24`` elements (as ``tutorials.py --quick``); ``--big`` adds the shipped
tutorials and Triton on ``2^26``-element matrices, where launch and ramp costs weigh a quarter
as much. Every kernel is first checked against torch in float64 (a wrong result is reported and
left out). GB/s counts the matrix read once and written once; times are ``timing.queued_ms``
medians.

Usage (on an H100/H200): ``python bench/tutorials_rows.py [--cols 32768,4096] [--big]
[--json out]``.
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

# (threads, blocks per SM) of the streamed kernels to try, per column count
STREAM_CONFIGS = {4096: [(256, 2), (256, 4)], 8192: [(512, 2)],
                  16384: [(512, 1), (512, 2), (1024, 1)], 32768: [(512, 1), (1024, 1)]}
# column counts where layer norm with two rows in flight is tried
STREAM2_COLS = (4096, 8192, 16384)
# column counts where layer norm loading w and b before the reductions is tried (the tutorial
# does it for rows of one 4096-column tile)
WB_EARLY_COLS = (8192,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", default="32768,16384,4096,8192")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--big", action="store_true", help="also 2^26-element matrices")
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

    def measure(op, m, n, variants, want, tol):
        nbytes = 8 * m * n
        results = {}
        for name, fn in variants.items():
            y.fill_(float("nan"))
            try:
                fn()
            except Exception as err:  # one variant failing to build must not end the A/B
                print(f"FAILED {op} {n} {name}: {type(err).__name__}: {err}"[:400], flush=True)
                continue
            err = float((y.double() - want).abs().max())
            if not err <= tol:
                print(f"WRONG {op} {m}x{n} {name}: max error {err:.3g} > {tol}", flush=True)
                continue
            ms = queued_ms(fn, args.repeat)
            results[name] = gbs = nbytes / ms / 1e6
            rows.append({"op": op, "shape": [m, n], "variant": name, "us": ms * 1e3,
                         "gbs": gbs, "of_copy": gbs / copy_gbs})
        peer = results.get("triton", float("nan"))
        for name, gbs in results.items():
            print(f"{op:9s} {m}x{n} {name:16s} {gbs:6.0f} GB/s  {gbs / copy_gbs:.2f} of copy  "
                  f"{gbs / peer:.2f} of triton", flush=True)

    sizes = [(n, 24) for n in map(int, args.cols.split(","))]
    sizes += [(n, 26) for n in map(int, args.cols.split(","))] if args.big else []
    for n, log2 in sizes:
        m = (1 << log2) // n
        x = torch.randn(m, n, device="cuda", generator=gen)
        y = torch.full_like(x, float("nan"))
        block, threads, _, _ = fused_softmax.config(n)
        chunk = min(block, 4096)
        configs = STREAM_CONFIGS[n] if log2 == 24 else []
        variants = {"config": lambda: fused_softmax.softmax(x, y)}
        if log2 == 24:
            variants["direct"] = lambda: fused_softmax.softmax_kernel[(m,)](
                x, y, m, n, m, BLOCK=block, THREADS=threads, ALIGN=16, STREAM=False)
        for t, per_sm in configs:
            grid = min(m, sms * per_sm)
            variants[f"stream t{t} x{per_sm}"] = (
                lambda g=grid, t=t: fused_softmax.softmax_kernel[(g,)](
                    x, y, m, n, g, BLOCK=block, THREADS=t, ALIGN=16, STREAM=True))
        t_grid = (min(m, sms * 4),)
        variants["triton"] = lambda: t_softmax[t_grid](y, x, x.stride(0), y.stride(0), m, n,
                                                       BLOCK=block,
                                                       num_warps=8 if block <= 8192 else 16)
        measure("softmax", m, n, variants, torch.softmax(x.double(), dim=1), 1e-6)

        w = torch.randn(n, device="cuda", generator=gen)
        b = torch.randn(n, device="cuda", generator=gen)
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        variants = {"config": lambda: layernorm.layernorm(x, w, b, y, mean, rstd)}
        if log2 == 24:
            variants["direct"] = lambda: layernorm.layernorm_kernel[(m,)](
                x, w, b, y, mean, rstd, m, n, m, 1e-5, BLOCK=block, CHUNK=chunk,
                THREADS=threads, ALIGN=16, STREAM=False)
        if log2 == 24 and n in WB_EARLY_COLS:
            variants["wb-early"] = lambda: rows_variants.layernorm_wb_early[(m,)](
                x, w, b, y, mean, rstd, m, n, m, 1e-5, BLOCK=block, CHUNK=chunk,
                THREADS=threads, ALIGN=16)
        for t, per_sm in configs:
            grid = min(m, sms * per_sm)
            variants[f"stream t{t} x{per_sm}"] = (
                lambda g=grid, t=t: layernorm.layernorm_kernel[(g,)](
                    x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, CHUNK=chunk,
                    THREADS=t, ALIGN=16, STREAM=True))
            if n in STREAM2_COLS:
                variants[f"stream2 t{t} x{per_sm}"] = (
                    lambda g=grid, t=t: rows_variants.layernorm_rows2[(g,)](
                        x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, CHUNK=chunk,
                        THREADS=t, ALIGN=16))
        ln_block = min(65536 // 4, block)
        variants["triton"] = lambda: t_layernorm[(m,)](
            x, y, w, b, mean, rstd, x.stride(0), n, 1e-5, BLOCK=ln_block,
            num_warps=min(max(ln_block // 256, 1), 8))
        want = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        measure("layernorm", m, n, variants, want, 1e-4)
        del x, y, want
    if args.json:
        write_results(args.json, "tutorials_rows", rows, torch, copy_gbs=copy_gbs)
    else:
        print(json.dumps({"copy_gbs": copy_gbs, "rows": rows}))


if __name__ == "__main__":
    main()
