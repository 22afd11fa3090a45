"""Long-row A/B of the softmax and layer-norm tutorials at 4k-32k float32 columns, one run:
the tutorials as shipped (``config``; rows of 16k+ columns streamed through shared memory over
a persistent grid), that stream at 8k columns (``stream``), register-row
variants over a persistent grid (bench/rows_variants.py: ``rows tT rR xK``: T threads, R rows
a step, K blocks per SM; layer norm ``wbS``: S 4096-column tiles of ``w``/``b`` held in shared
memory), rows split over a thread-block cluster (``split tT sS xK``: S CTAs a row reduced
through distributed shared memory, K blocks per SM or 0: a cluster a row; layer norm ``eE``:
w/b loaded early; ``wbs``: w/b slices kept in shared memory; ``1pass``: shifted one-pass
statistics, one reduction), Triton's tutorial designs
(bench/tutorials_triton.py, set up as in bench/tutorials.py) and torch's device copy, both of
a 1 GiB buffer and of the benchmark's own matrix (same bytes: the launch and ramp costs a
kernel of this size pays too).

Matrices have ``2^24`` elements (as ``tutorials.py --quick``); ``--big`` adds the shipped
tutorials and Triton on ``2^26``-element matrices. Every kernel is first checked against torch
in float64 (a wrong result is reported and left out). GB/s counts the matrix read once and
written once; times are ``timing.queued_ms`` medians.

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

# (threads, rows a step, blocks per SM) of the register-row softmax, per column count
SOFTMAX_ROWS = {4096: [(256, 1, 8)], 8192: [(512, 1, 3)]}
# (threads, w/b tiles in shared memory, blocks per SM) of the register-row layer norm
LAYERNORM_ROWS = {4096: [(256, 1, 4)]}
# (threads, CTAs a row (cluster size), blocks per SM; 0: a cluster a row, no loop) of the
# cluster-split softmax
SOFTMAX_SPLIT = {8192: [(256, 2, 0)], 16384: [(512, 2, 0), (256, 4, 0), (256, 4, 6)],
                 32768: [(512, 4, 0), (256, 8, 0), (256, 4, 0)]}
# (threads, CTAs a row, w/b before the reductions, blocks per SM, w/b slices in shared memory,
# one-pass statistics) of the cluster-split layer norm
LAYERNORM_SPLIT = {4096: [(256, 1, 1, 0, 0, 0), (256, 1, 1, 0, 0, 1)],
                   8192: [(256, 2, 1, 0, 0, 0), (256, 2, 1, 0, 0, 1)],
                   16384: [(256, 4, 1, 0, 0, 0), (512, 2, 0, 0, 0, 0), (512, 2, 0, 2, 1, 0),
                           (256, 4, 1, 0, 0, 1)],
                   32768: [(256, 8, 1, 0, 0, 0), (512, 4, 0, 0, 0, 0), (512, 4, 0, 2, 1, 0),
                           (256, 8, 1, 0, 0, 1), (256, 8, 0, 0, 0, 0)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", default="32768,16384,8192,4096")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--big", action="store_true", help="also 2^26-element matrices")
    parser.add_argument("--no-split", action="store_true", help="leave the cluster-split out")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    import torch
    from tutorials_triton import layernorm_kernel as t_layernorm, softmax_kernel as t_softmax

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 2 / time_ms(lambda: dst.copy_(src), args.repeat) / 1e6
    del src, dst
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (1 GiB), {sms} SMs", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def measure(op, m, n, variants, want, tol, same_gbs):
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
                         "gbs": gbs, "of_copy": gbs / copy_gbs, "of_copy_same": gbs / same_gbs})
        peer = results.get("triton", float("nan"))
        for name, gbs in results.items():
            print(f"{op:9s} {m}x{n} {name:18s} {gbs:6.0f} GB/s  {gbs / copy_gbs:.2f} of copy  "
                  f"{gbs / same_gbs:.2f} of same-size copy  {gbs / peer:.2f} of triton",
                  flush=True)

    sizes = [(n, 24) for n in map(int, args.cols.split(","))]
    sizes += [(n, 26) for n in map(int, args.cols.split(","))] if args.big else []
    for n, log2 in sizes:
        m = (1 << log2) // n
        x = torch.randn(m, n, device="cuda", generator=gen)
        y = torch.full_like(x, float("nan"))
        same_gbs = 8 * m * n / queued_ms(lambda: y.copy_(x), args.repeat) / 1e6
        print(f"copy {m}x{n} float32: {same_gbs:.0f} GB/s ({same_gbs / copy_gbs:.2f} of 1 GiB)",
              flush=True)
        rows.append({"op": "copy", "shape": [m, n], "variant": "torch", "gbs": same_gbs,
                     "of_copy": same_gbs / copy_gbs})
        block = max(512, 1 << (n - 1).bit_length())
        splits = log2 == 24 and not args.no_split
        chunk = min(block, 4096)
        variants = {"config": lambda: fused_softmax.softmax(x, y)}
        # the tutorial's streamed design one step below the rows where it streams (``config``)
        stream = log2 == 24 and block == fused_softmax.STREAM_FROM // 2
        if stream:
            variants["stream t512 x1"] = lambda g=min(m, sms): fused_softmax.softmax_kernel[(g,)](
                x, y, m, n, g, BLOCK=block, THREADS=512, ALIGN=16, STREAM=True)
        for t, r, per_sm in SOFTMAX_ROWS.get(n, []) if log2 == 24 else []:
            grid = min(-(-m // r), sms * per_sm)
            variants[f"rows t{t} r{r} x{per_sm}"] = (
                lambda g=grid, t=t, r=r: rows_variants.softmax_rows[(g,)](
                    x, y, m, n, g, BLOCK=block, THREADS=t, ROWS=r, ALIGN=16))
        for t, split, per_sm in SOFTMAX_SPLIT.get(n, []) if splits else []:
            grid = min(m, sms * per_sm // split) * split if per_sm else m * split
            variants[f"split t{t} s{split} x{per_sm}"] = (
                lambda g=grid, t=t, s=split: rows_variants.softmax_split[(g,)](
                    x, y, m, n, g, BLOCK=block, THREADS=t, SPLIT=s, ALIGN=16))
        t_grid = (min(m, sms * 4),)
        variants["triton"] = lambda: t_softmax[t_grid](y, x, x.stride(0), y.stride(0), m, n,
                                                       BLOCK=block,
                                                       num_warps=8 if block <= 8192 else 16)
        measure("softmax", m, n, variants, torch.softmax(x.double(), dim=1), 1e-6, same_gbs)

        w = torch.randn(n, device="cuda", generator=gen)
        b = torch.randn(n, device="cuda", generator=gen)
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        variants = {"config": lambda: layernorm.layernorm(x, w, b, y, mean, rstd)}
        if stream:
            variants["stream t512 x1"] = lambda g=min(m, sms): layernorm.layernorm_kernel[(g,)](
                x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, CHUNK=chunk, THREADS=512,
                ALIGN=16, STREAM=True)
        for t, wbs, per_sm in LAYERNORM_ROWS.get(n, []) if log2 == 24 else []:
            grid = min(m, sms * per_sm)
            variants[f"rows t{t} wb{wbs} x{per_sm}"] = (
                lambda g=grid, t=t, wbs=wbs: rows_variants.layernorm_rows[(g,)](
                    x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, CHUNK=chunk,
                    THREADS=t, WBS=wbs, ALIGN=16))
        for t, split, early, per_sm, wbs, one in LAYERNORM_SPLIT.get(n, []) if splits else []:
            grid = min(m, sms * per_sm // split) * split if per_sm else m * split
            name = f"split t{t} s{split} e{early} x{per_sm}{' wbs' * wbs}{' 1pass' * one}"
            variants[name] = (
                lambda g=grid, t=t, s=split, e=early, wbs=wbs, one=one:
                rows_variants.layernorm_split[(g,)](
                    x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=block, THREADS=t, SPLIT=s,
                    WB_EARLY=e, ALIGN=16, WBS=wbs, ONEPASS=one))
        ln_block = min(65536 // 4, block)
        variants["triton"] = lambda: t_layernorm[(m,)](
            x, y, w, b, mean, rstd, x.stride(0), n, 1e-5, BLOCK=ln_block,
            num_warps=min(max(ln_block // 256, 1), 8))
        want = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        measure("layernorm", m, n, variants, want, 1e-4, same_gbs)
        del x, y, want
    if args.json:
        write_results(args.json, "tutorials_rows", rows, torch, copy_gbs=copy_gbs)
    else:
        print(json.dumps({"copy_gbs": copy_gbs, "rows": rows}))


if __name__ == "__main__":
    main()
