"""Long-row A/B of the softmax and layer-norm tutorials at 4k-32k float32 columns, one run:
the tutorials as shipped (``config``); the tutorials' kernels at other launches (``stream tT
[cC] xK rR``: rows streamed through shared memory over a persistent grid of K blocks of T
threads an SM (layer norm: tiles of C columns), registers capped at R; ``direct tT rR``: a
block a row); the variants of bench/rows_variants.py (softmax ``ab iI [tstore]``: the
streamed softmax in 4096-column tiles with the next row's copies issued at I, ``probe ab ...
pP``: its probes, timed unchecked; ``pipe tT cC xK [a0]``: the three-stage pipeline); the
tutorials of other folders
(``--candidate``, e.g. the tutorials of an earlier commit); Triton's tutorial designs
(bench/tutorials_triton.py, set up as in bench/tutorials.py) and torch's device copy, both of
a 1 GiB buffer and of the benchmark's own matrix (same bytes: the launch and ramp costs a
kernel of this size pays too). The variant lists at the top are the last A/B's.

Matrices have ``2^24`` elements (as ``tutorials.py --quick``). Every kernel is first checked
against torch in float64 (a wrong result is reported and left out; that first call compiles
it, outside the timing). GB/s counts the matrix read once and written once; times are
``timing.queued_ms`` medians.

Usage (on an H100/H200): ``python bench/tutorials_rows.py [--cols 16384,32768] [--only
config,...] [--no-triton] [--label base-] [--candidate folder ...] [--json out]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402
from timing import queued_ms, time_ms  # noqa: E402
from tutorials import fused_softmax, layernorm  # noqa: E402
import rows_variants  # noqa: E402

# (threads, blocks per SM, register cap or 0) of the softmax tutorial's streamed kernel
SOFTMAX_STREAM: dict[int, list] = {}
# (threads, register cap) of the softmax tutorial's one-shot kernel, a block a row
SOFTMAX_DIRECT: dict[int, list] = {}
# (threads, register cap) of the layer-norm tutorial's one-shot kernel, a block a row
LAYERNORM_DIRECT = {16384: [(512, 64)], 8192: [(512, 40), (256, 80)]}
# (ISSUE, PROBE, TSTORE) of rows_variants.softmax_ab (512 threads, 4096-column tiles, one block
# an SM); a PROBE's output is not the softmax: it is timed unchecked, named "probe ..."
SOFTMAX_AB = {32768: [(0, 0, 0), (2, 0, 0), (0, 0, 1), (0, 1, 0), (0, 2, 0), (0, 3, 0),
                      (0, 4, 0)],
              16384: [(0, 0, 0), (0, 4, 0)]}
# (threads, chunk columns, blocks per SM) of rows_variants.softmax_pipe, (... w/b tiles
# ahead) of layernorm_pipe
SOFTMAX_PIPE = {32768: [(512, 4096, 1), (512, 2048, 1)], 16384: [(512, 4096, 1)],
                8192: [(512, 4096, 2)]}
LAYERNORM_PIPE = {32768: [(512, 4096, 1, 1), (512, 4096, 1, 0)],
                  16384: [(512, 4096, 1, 1), (512, 4096, 1, 0)], 8192: [(512, 4096, 1, 1)]}
# (threads, chunk columns, blocks per SM, register cap or 0) of the layer-norm tutorial's
# streamed kernel
LAYERNORM_STREAM: dict[int, list] = {}


def _load(path: Path):
    """The module at ``path``, loaded by path."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", default="16384,32768,8192,4096")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", help="comma-separated variant names to run (and triton)")
    parser.add_argument("--no-triton", action="store_true", help="leave Triton out")
    parser.add_argument("--label", default="", help="prefix of every variant's name")
    parser.add_argument("--candidate", action="append", default=[],
                        help="a folder with a fused_softmax.py and a layernorm.py of the "
                             "tutorials' interface, measured as the folder's name (repeatable)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    candidates = {Path(folder).name: {name: _load(Path(folder) / f"{name}.py")
                                      for name in ("fused_softmax", "layernorm")}
                  for folder in args.candidate}
    keep = set(args.only.split(",")) if args.only else None
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
        if args.no_triton:
            variants.pop("triton")
        for name, fn in variants.items():
            if keep is not None and name not in keep | {"triton"}:
                continue
            name = args.label + name
            y.fill_(float("nan"))
            try:
                fn()
            except Exception as err:  # one variant failing to build must not end the A/B
                print(f"FAILED {op} {n} {name}: {type(err).__name__}: {err}"[:400], flush=True)
                continue
            err = 0.0 if name.startswith(args.label + "probe") else \
                float((y.double() - want).abs().max())
            if not err <= tol:
                print(f"WRONG {op} {m}x{n} {name}: max error {err:.3g} > {tol}", flush=True)
                continue
            ms = queued_ms(fn, args.repeat)
            results[name] = gbs = nbytes / ms / 1e6
            rows.append({"op": op, "shape": [m, n], "variant": name, "us": ms * 1e3,
                         "gbs": gbs, "of_copy": gbs / copy_gbs, "of_copy_same": gbs / same_gbs})
        peer = results.get(args.label + "triton", float("nan"))
        for name, gbs in results.items():
            print(f"{op:9s} {m}x{n} {name:22s} {gbs:6.0f} GB/s  {gbs / copy_gbs:.2f} of copy  "
                  f"{gbs / same_gbs:.2f} of same-size copy  {gbs / peer:.2f} of triton",
                  flush=True)

    for n in map(int, args.cols.split(",")):
        m = (1 << 24) // n
        x = torch.randn(m, n, device="cuda", generator=gen)
        y = torch.full_like(x, float("nan"))
        same_gbs = 8 * m * n / queued_ms(lambda: y.copy_(x), args.repeat) / 1e6
        print(f"copy {m}x{n} float32: {same_gbs:.0f} GB/s ({same_gbs / copy_gbs:.2f} of 1 GiB)",
              flush=True)
        rows.append({"op": "copy", "shape": [m, n], "variant": "torch", "gbs": same_gbs,
                     "of_copy": same_gbs / copy_gbs})
        block = max(512, 1 << (n - 1).bit_length())
        chunk = min(block, 4096)

        def grid_of(per_sm):
            return min(m, sms * per_sm)

        variants = {"config": lambda: fused_softmax.softmax(x, y)}
        for label, c in candidates.items():
            variants[label] = lambda c=c: c["fused_softmax"].softmax(x, y)
        for t, per_sm, cap in SOFTMAX_STREAM.get(n, []):
            variants[f"stream t{t} x{per_sm}" + (f" r{cap}" if cap else "")] = (
                lambda g=grid_of(per_sm), t=t, cap=cap:
                fused_softmax.softmax_kernel[(g,)](x, y, m, n, g, BLOCK=block, THREADS=t,
                                                   ALIGN=16, STREAM=True,
                                                   **({"maxnreg": cap} if cap else {})))
        for t, cap in SOFTMAX_DIRECT.get(n, []):
            variants[f"direct t{t} r{cap}"] = lambda t=t, cap=cap: \
                fused_softmax.softmax_kernel[(m,)](x, y, m, n, m, BLOCK=block, THREADS=t,
                                                   ALIGN=16, STREAM=False, maxnreg=cap)
        for issue, probe, tstore in SOFTMAX_AB.get(n, []):
            variants[("probe " if probe else "") + f"ab i{issue}" + (f" p{probe}" if probe else "")
                     + (" tstore" if tstore else "")] = (
                lambda g=grid_of(1), i=issue, p=probe, ts=tstore:
                rows_variants.softmax_ab[(g,)](x, x.view(-1, 256), y, y.view(-1, 256), m, n, g,
                                               BLOCK=block, CHUNK=4096, THREADS=512, ISSUE=i,
                                               PROBE=p, TSTORE=ts))
        for t, chunk_, per_sm in SOFTMAX_PIPE.get(n, []):
            variants[f"pipe t{t} c{chunk_} x{per_sm}"] = (
                lambda g=grid_of(per_sm), t=t, c=chunk_: rows_variants.softmax_pipe[(g,)](
                    x, y, m, n, g, BLOCK=block, CHUNK=c, THREADS=t))
        t_grid = (min(m, sms * 4),)
        variants["triton"] = lambda: t_softmax[t_grid](y, x, x.stride(0), y.stride(0), m, n,
                                                       BLOCK=block,
                                                       num_warps=8 if block <= 8192 else 16)
        measure("softmax", m, n, variants, torch.softmax(x.double(), dim=1), 1e-6, same_gbs)

        # w and b repeat every 4096 columns: the ``wbs 2`` probe reads their first tile only
        w, b = (torch.randn(4096, device="cuda", generator=gen).repeat(-(-n // 4096))[:n]
                for _ in range(2))
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        variants = {"config": lambda: layernorm.layernorm(x, w, b, y, mean, rstd)}
        for label, c in candidates.items():
            variants[label] = lambda c=c: c["layernorm"].layernorm(x, w, b, y, mean, rstd)
        for t, cap in LAYERNORM_DIRECT.get(n, []):
            variants[f"direct t{t} r{cap}"] = lambda t=t, cap=cap: \
                layernorm.layernorm_kernel[(m,)](x, w, b, y, mean, rstd, m, n, m, 1e-5,
                                                 BLOCK=block, CHUNK=chunk, THREADS=t,
                                                 ALIGN=16, STREAM=False, maxnreg=cap)
        for t, chunk_, per_sm, cap in LAYERNORM_STREAM.get(n, []):
            variants[f"stream t{t} c{chunk_} x{per_sm}" + (f" r{cap}" if cap else "")] = (
                lambda g=grid_of(per_sm), t=t, c=chunk_, cap=cap:
                layernorm.layernorm_kernel[(g,)](x, w, b, y, mean, rstd, m, n, g, 1e-5,
                                                 BLOCK=block, CHUNK=c, THREADS=t,
                                                 ALIGN=16, STREAM=True,
                                                 **({"maxnreg": cap} if cap else {})))
        for t, chunk_, per_sm, ahead in LAYERNORM_PIPE.get(n, []):
            variants[f"pipe t{t} c{chunk_} x{per_sm}" + ("" if ahead else " a0")] = (
                lambda g=grid_of(per_sm), t=t, c=chunk_, a=ahead:
                rows_variants.layernorm_pipe[(g,)](x, w, b, y, mean, rstd, m, n, g, 1e-5,
                                                   BLOCK=block, CHUNK=c, THREADS=t, AHEAD=a))
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
