"""A/B of the attention tutorial's blocks (examples/tutorials/attention.py's kernel at other
``(BM, BN, warps, stages)``) against Triton's tutorial attention and Kiln's ``prefill``, one run,
bf16 ``[B, S, H, 128]``.

``tutorial``: the tutorial's kernel at its default blocks (K/V handed back by ``kiln.release``,
refilled at the end of a step, no block barrier a step); ``tutorial_*`` the same kernel at
other blocks. Every variant compiles (``--precompile N``: in N threads, Kiln traces one kernel
at a time), and the peers compile, before anything is timed: a compile thread holding the GIL
starves the queued launches (batch 1 of session 37: Triton timed at 52 TFLOP/s).

Measured on an H200 (one run, 4 x 4096 x 16 x 128, non-causal / causal, ``prefill`` 709 /
640 TFLOP/s): the tutorial's design at 128 x 128 x 3 599 / 478 (0.84 / 0.75 of ``prefill``);
the same with its two warpgroups taking turns issuing their GEMMs (``kiln.Turns``) 547 / 450;
the design before (a block barrier a step, K/V refilled at its start, 2 stages, by TMA) 567 /
473 at 128 x 128, by ``cp.async`` masked at the sequence's end 431 at 128 x 64 (non-causal);
the tutorial at 1 x 16384 x 16 x 128 causal (another run, no Triton) 598 against ``prefill``'s
700 (0.85). Those two designs' kernels are in ``git show 430c4ad:bench/attention_tutorial_ab.py``
(``release_kernel`` with ``TURNS``, ``loops_kernel``); docs/tiles.md has the history. A single
``kiln.pipeline`` over every key tile (each step masked, ``handoff=True`` or not) compiled to
serialised WGMMAs (ptxas: "non wgmma instructions reading accumulator registers", the P V group
kept in flight across the loop's back edge), so it is not here. A run cut short keeps whole
masks. ``bench/tutorials.py --blocks`` times blocks beside the peers too, without the SASS and
profile modes.

Run: ``python bench/attention_tutorial_ab.py [--seqs 4096] [--repeat 5] [--variants ...]
[--causal 1 0] [--precompile N] [--no-triton] [--profile] [--sass out.txt] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from tutorials import attention as tut, attention_inputs  # noqa: E402

# name -> the tutorial's block (BM, BN, warps, stages); None: its default blocks
VARIANTS = {
    "tutorial": None,
    "tutorial_96x3": (128, 96, 8, 3),
    "tutorial_64x3": (128, 64, 8, 3),
    "tutorial_64x4": (128, 64, 8, 4),
    "tutorial_m64": (64, 64, 4, 3),
}


def launch_spec(name, q, k, v, o, cu, seq, heads, causal, scale):
    """``(kernel, grid, args, constexprs)`` of variant ``name``: what its launch passes."""
    cfg = tut.config(q.shape[1] // heads, None, VARIANTS[name])
    grid = (-(-seq // cfg["BM"]), heads, len(cu) - 1)
    return (tut.attention_kernel, grid, (q, k, v, o, cu, scale * tut.LOG2E),
            dict(CAUSAL=causal, ALIGN=16, **cfg))


def launcher(spec):
    """A no-argument launch of a :func:`launch_spec`."""
    kernel, grid, args, constexprs = spec
    return lambda: kernel[grid](*args, **constexprs)


def start_compiles(specs: dict, workers: int) -> dict:
    """Compile every launch spec in ``workers`` threads, started now (Kiln traces one at a
    time and lowers, ptxas included, concurrently; the peers compile meanwhile): ``{key:
    future}``."""
    from concurrent.futures import ThreadPoolExecutor

    def build(spec):
        kernel, _, args, constexprs = spec
        kernel.compile(*args, **constexprs)

    pool = ThreadPoolExecutor(workers)
    futures = {key: pool.submit(build, spec) for key, spec in specs.items()}
    pool.shutdown(wait=False)
    return futures


def write_sass(path: Path, names, causal: bool) -> None:
    """cuobjdump's SASS of each variant (sm_90a, D 128) into ``path``."""
    import subprocess
    import tempfile

    import ml_dtypes
    import numpy as np

    x = np.zeros((256, 256), ml_dtypes.bfloat16)
    with path.open("w") as out:
        for name in names:
            ck = tut.attention_kernel.compile(
                x, x, x, x, np.array([0, 256], np.int32), 1.0, CAUSAL=causal, ALIGN=16,
                **tut.config(128, "sm_90a", VARIANTS[name]), target="sm_90a")
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(ck.asm["cubin"])
                f.flush()
                sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True,
                                      text=True, check=True).stdout
            out.write(f"== {name} causal={causal:d}\n{sass}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1],
                        help="the masks to time, in this order")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-triton", action="store_true",
                        help="time Kiln's prefill only as the peer (a short run)")
    parser.add_argument("--profile", action="store_true",
                        help="one launch of each variant, then of prefill; no checks (ncu)")
    parser.add_argument("--sass", type=Path, help="write each variant's SASS here and stop")
    parser.add_argument("--precompile", type=int, default=0, metavar="N",
                        help="compile every variant of each shape in N threads first")
    args = parser.parse_args()
    causals = [bool(c) for c in args.causal]
    if args.sass:
        write_sass(args.sass, args.variants, causals[0])
        return

    import torch
    from timing import queued_ms
    from tutorials_triton import attention_kernel as t_attention
    from kiln.kernels.attention import prefill

    gen = torch.Generator(device="cuda").manual_seed(1)
    d, rows = 128, []
    for seq in args.seqs:
        batch, heads, (q4, k4, v4), (q, k, v), cu, scale = attention_inputs(torch, seq, d, gen)
        outs = {(n, c): torch.full_like(q, float("nan")) for n in args.variants for c in causals}
        specs = {key: launch_spec(key[0], q, k, v, o, cu, seq, heads, key[1], scale)
                 for key, o in outs.items()}
        built = start_compiles(specs, args.precompile) if args.precompile else {}
        if args.profile:
            for key, spec in specs.items():
                if key in built:
                    built[key].result()
                launcher(spec)()
            for causal in causals:   # Kiln's prefill last (ncu -c counts the variants first)
                prefill(q4, k4, v4, causal=causal, scale=scale)
            torch.cuda.synchronize()
            continue
        ref = torch.empty_like(q)

        def triton(causal):
            return lambda: t_attention[(seq // 128, batch * heads)](
                q, k, v, ref, q.stride(0), scale * tut.LOG2E, seq, heads, D=d, BM=128,
                BN=128, CAUSAL=causal, num_warps=8, num_stages=3)

        # every compile, the peers' too, ends before anything is timed (see the module docs)
        wants = {causal: prefill(q4, k4, v4, causal=causal, scale=scale).view(batch * seq, -1)
                 .float() for causal in causals}
        for causal in causals if not args.no_triton else ():
            triton(causal)()
        for future in built.values():
            with contextlib.suppress(Exception):   # reported where the variant is timed
                future.result()
        for causal in causals:   # per mask: the peers, then every variant (a run cut short
            # keeps whole masks)
            flops = 4.0 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
            want, t_run = wants[causal], triton(causal)
            p_ms = queued_ms(lambda: prefill(q4, k4, v4, causal=causal, scale=scale),
                             args.repeat)
            row = {"shape": [batch, seq, heads, d], "causal": causal,
                   "prefill_tflops": flops / p_ms / 1e9}
            t_ms = None
            if not args.no_triton:
                t_run()
                t_ms = queued_ms(t_run, args.repeat)
                row["triton_tflops"] = flops / t_ms / 1e9
            rows.append(row)
            print(f"[{batch},{seq},{heads},{d}] causal={causal:d}  prefill "
                  f"{flops / p_ms / 1e9:6.1f} TFLOP/s" +
                  ("" if t_ms is None else f"  triton {flops / t_ms / 1e9:6.1f}"), flush=True)
            for name in args.variants:
                o = outs[name, causal]
                try:
                    if (name, causal) in built:
                        built[name, causal].result()
                    run = launcher(specs[name, causal])
                    run()
                    err = float((o.float() - want).abs().max())
                    ms = queued_ms(run, args.repeat)
                except Exception as exc:  # a variant that fails to build is a row, not a stop
                    print(f"  {name:14s} causal={causal:d} failed: {type(exc).__name__}: "
                          f"{str(exc)[:200]}", flush=True)
                    continue
                ok = err < 2e-2
                row[name] = {"tflops": flops / ms / 1e9, "max_err": err, "ok": ok}
                print(f"  {name:14s} causal={causal:d} {flops / ms / 1e9:6.1f} TFLOP/s  " +
                      ("" if t_ms is None else f"x{t_ms / ms:.3f} of triton  ") +
                      f"x{p_ms / ms:.3f} of prefill  err {err:.2e}{'' if ok else '  WRONG'}",
                      flush=True)
                if args.json:   # after every row: a run cut short keeps what it measured
                    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
