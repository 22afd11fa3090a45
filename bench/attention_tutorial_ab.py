"""A/B of the attention tutorial's copies and schedule (bench-local variants of
examples/tutorials/attention.py's kernel) against Triton's tutorial attention and Kiln's
``prefill``, one run, bf16 ``[B, S, H, 128]``.

``tutorial``: the tutorial's kernel at its default blocks (K/V handed back by ``kiln.release``,
refilled at the end of a step, no block barrier a step); ``tutorial_*`` the same kernel at
other blocks. ``release_kernel`` is that design with (``turns_*``) or without (``free_*``, PTX
byte-identical to the tutorial's) the two warpgroups taking turns issuing their GEMMs
(``kiln.Turns``). ``loops_kernel`` is the
tutorial's earlier design (a block barrier a step, K/V refilled at its start, 2 stages:
``tma_*``; ``cp_*`` moves K/V by ``cp.async``, masked at the sequence's end). All are declared
``flush_denormals=True`` (exp2 one ``MUFU.EX2``).

Measured on an H200 (one run, 4 x 4096 x 16 x 128, non-causal / causal, ``prefill`` 709 /
640 TFLOP/s): ``free_128x3`` 599 / 478 (0.84 / 0.75 of ``prefill``), ``turns_128x3`` 547 / 450,
``tma_128x2`` 567 / 473; the tutorial at 1 x 16384 x 16 x 128 causal (another run, no
Triton) 598 against ``prefill``'s 700 (0.85). Earlier (non-causal; Triton 493, ``prefill`` 733; ``loops_kernel``
without ``flush_denormals``): the tutorial then (TMA, 128 x 64) 462; ``cp_64x2`` 431;
``tma_128x2`` 535; ``tma_64x3`` 447. A run cut short keeps whole variants: give ``--precompile`` runs a minute (Kiln traces one
kernel at a time, the peers' compiles included). A single ``kiln.pipeline`` over every key
tile (each step masked, ``handoff=True`` or not) compiled to serialised WGMMAs (ptxas: "non
wgmma instructions reading accumulator registers", the P V group kept in flight across the
loop's back edge), so it is not here.

Run: ``python bench/attention_tutorial_ab.py [--seqs 4096] [--repeat 5] [--variants ...]
[--causal 1 0] [--precompile N] [--no-triton] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import kiln  # noqa: E402
from kiln import bf16, f32, i32  # noqa: E402

INF = float("inf")


def _tutorial():
    spec = importlib.util.spec_from_file_location("kiln_tutorial_attention",
                                                  ROOT / "examples/tutorials/attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _softmax(s, m, l, qk_scale):
    """Online softmax of one key tile (base 2, the scale folded in): P, alpha, m', l'."""
    m_new = m.maximum(kiln.reduce(s, "max", axis=1))
    p = kiln.exp2(kiln.fma(s, qk_scale, m_new * -qk_scale))
    alpha = kiln.exp2((m - m_new) * qk_scale)
    return kiln.cast(p, bf16), alpha, m_new, l * alpha + kiln.reduce(p, "sum", axis=1)


def _mask(s, kv0, row0, length, causal):
    """Keys past the sequence (causal: after the query) to -inf; the limit is per row."""
    q_row, k_col = kiln.tiles.coords(s.layout)
    lim = kiln.min(q_row + (row0 + 1 if causal else length), length)
    return kiln.where(k_col + kv0 < lim, s, -INF)


@kiln.kernel(num_threads="THREADS", flush_denormals=True)
def loops_kernel(q: kiln.Tensor[bf16, 2], k: kiln.Tensor[bf16, 2], v: kiln.Tensor[bf16, 2],
                 o: kiln.Tensor[bf16, 2], cu_seqlens: kiln.Tensor[i32], qk_scale: f32,
                 D: kiln.constexpr, BM: kiln.constexpr, BN: kiln.constexpr,
                 STAGES: kiln.constexpr, THREADS: kiln.constexpr, CAUSAL: kiln.constexpr,
                 ALIGN: kiln.constexpr, TMA: kiln.constexpr):
    col0 = kiln.block_id(1) * D
    start = cu_seqlens[kiln.block_id(2)]
    length = cu_seqlens[kiln.block_id(2) + 1] - start
    tile, tiles = kiln.block_id(0), (length + BM - 1) // BM
    if CAUSAL:
        tile = kiln.where(tile < tiles, tiles - 1 - tile, tile)
    row0 = tile * BM
    q_s = kiln.tiles.operand_tile((BM, D), bf16, "a")
    k_s = [kiln.tiles.operand_tile((BN, D), bf16, "a") for _ in range(STAGES)]
    v_s = [kiln.tiles.operand_tile((BN, D), bf16, "b") for _ in range(STAGES)]
    def rows(t, n, r0):
        return kiln.GlobalTile(t, (n, D), (start + r0, col0),
                               row_end=t.shape[0] if TMA else start + length, align=ALIGN)

    kiln.copy(kiln.GlobalTile(q, (BM, D), (start + row0, col0), row_end=start + length,
                              align=ALIGN), q_s)
    kiln.copy(rows(v, BN, length), v_s[-1])
    for i in range(STAGES - 1):
        kiln.copy(rows(k, BN, i * BN), k_s[i])
        if i < STAGES - 2:
            kiln.copy(rows(v, BN, i * BN), v_s[i])
    s0 = kiln.accumulator(q_s, k_s[0].T, warps="rows")
    p = kiln.cast(s0, bf16)
    acc = kiln.accumulator(p, v_s[-1], warps="rows")
    m = kiln.tiles.TileVector.full(s0.layout, -INF)
    l = kiln.tiles.TileVector.full(s0.layout, 0.0)
    alpha = kiln.tiles.TileVector.full(s0.layout, 1.0)
    end = length
    full = length // BN * BN
    if CAUSAL:
        end = kiln.min(length, row0 + BM)
        full = kiln.min(full, (row0 + 1) // BN * BN)
    end = kiln.where(row0 < length, end, 0)
    full = kiln.max(kiln.min(full, end) // (STAGES * BN), 0)
    last = kiln.max((end + STAGES * BN - 1) // (STAGES * BN), full)

    def step(kv0, st, p, alpha, acc, m, l, masked):
        kiln.barrier()
        ahead = (st + STAGES - 1) % STAGES
        kiln.copy(rows(k, BN, kv0 + (STAGES - 1) * BN), k_s[ahead])
        kiln.copy(rows(v, BN, kv0 + (STAGES - 2) * BN), v_s[(ahead + STAGES - 1) % STAGES])
        s = kiln.gemm(q_s, k_s[st].T, s0)
        acc = kiln.gemm(p, v_s[st - 1], acc * alpha)
        if masked:
            s = _mask(s, kv0, row0, length, CAUSAL)
        p, alpha, m, l = _softmax(s, m, l, qk_scale)
        return p, alpha, acc, m, l

    def steps(kv0, p, alpha, acc, m, l, masked):
        for st in range(STAGES):
            p, alpha, acc, m, l = step(kv0 + st * BN, st, p, alpha, acc, m, l, masked)
        return p, alpha, acc, m, l

    for g in kiln.range(0, full):
        p, alpha, acc, m, l = steps(g * (STAGES * BN), p, alpha, acc, m, l, False)
    for g in kiln.range(full, last):
        p, alpha, acc, m, l = steps(g * (STAGES * BN), p, alpha, acc, m, l, True)
    kiln.barrier()
    acc = kiln.gemm(p, v_s[-1], acc * alpha)
    kiln.copy(kiln.cast(acc / l, bf16), kiln.GlobalTile(o, (BM, D), (start + row0, col0),
                                                        row_end=start + length, align=ALIGN))


@kiln.kernel(num_threads="THREADS", flush_denormals=True)
def release_kernel(q: kiln.Tensor[bf16, 2], k: kiln.Tensor[bf16, 2], v: kiln.Tensor[bf16, 2],
                   o: kiln.Tensor[bf16, 2], cu_seqlens: kiln.Tensor[i32], qk_scale: f32,
                   D: kiln.constexpr, BM: kiln.constexpr, BN: kiln.constexpr,
                   STAGES: kiln.constexpr, THREADS: kiln.constexpr, CAUSAL: kiln.constexpr,
                   ALIGN: kiln.constexpr, TURNS: kiln.constexpr):
    """The tutorial's design (K/V handed back by ``kiln.release``, refilled at the end of a
    step, no block barrier a step), with ``kiln.Turns`` (``TURNS``) or without."""
    col0 = kiln.block_id(1) * D
    start = cu_seqlens[kiln.block_id(2)]
    length = cu_seqlens[kiln.block_id(2) + 1] - start
    tile, tiles = kiln.block_id(0), (length + BM - 1) // BM
    if CAUSAL:
        tile = kiln.where(tile < tiles, tiles - 1 - tile, tile)
    row0 = tile * BM
    q_s = kiln.tiles.operand_tile((BM, D), bf16, "a")
    k_s = [kiln.tiles.operand_tile((BN, D), bf16, "a") for _ in range(STAGES)]
    v_s = [kiln.tiles.operand_tile((BN, D), bf16, "b") for _ in range(STAGES)]

    def rows(t, n, r0):
        return kiln.GlobalTile(t, (n, D), (start + r0, col0), row_end=t.shape[0], align=ALIGN)

    kiln.copy(kiln.GlobalTile(q, (BM, D), (start + row0, col0), row_end=start + length,
                              align=ALIGN), q_s)
    kiln.copy(rows(v, BN, length), v_s[-1])
    for i in range(STAGES - 1):
        kiln.copy(rows(k, BN, i * BN), k_s[i])
        if i < STAGES - 2:
            kiln.copy(rows(v, BN, i * BN), v_s[i])
    kiln.barrier()
    s0 = kiln.accumulator(q_s, k_s[0].T, warps="rows")
    p = kiln.cast(s0, bf16)
    acc = kiln.accumulator(p, v_s[-1], warps="rows")
    m = kiln.tiles.TileVector.full(s0.layout, -INF)
    l = kiln.tiles.TileVector.full(s0.layout, 0.0)
    alpha = kiln.tiles.TileVector.full(s0.layout, 1.0)
    end = length
    full = length // BN * BN
    if CAUSAL:
        end = kiln.min(length, row0 + BM)
        full = kiln.min(full, (row0 + 1) // BN * BN)
    end = kiln.where(row0 < length, end, 0)
    full = kiln.max(kiln.min(full, end) // (STAGES * BN), 0)
    last = kiln.max((end + STAGES * BN - 1) // (STAGES * BN), full)
    turns = kiln.Turns() if TURNS else contextlib.nullcontext()

    def step(kv0, st, p, alpha, acc, m, l, masked):
        with turns:
            s = kiln.gemm(q_s, k_s[st].T, s0)
            acc = kiln.gemm(p, v_s[st - 1], acc * alpha)
        if masked:
            s = _mask(s, kv0, row0, length, CAUSAL)
        p, alpha, m, l = _softmax(s, m, l, qk_scale)
        kiln.release(k_s[st], v_s[st - 1])
        kiln.copy(rows(k, BN, kv0 + (STAGES - 1) * BN), k_s[st - 1])
        kiln.copy(rows(v, BN, kv0 + (STAGES - 2) * BN), v_s[st - 2])
        return p, alpha, acc, m, l

    def steps(kv0, p, alpha, acc, m, l, masked):
        for st in range(STAGES):
            p, alpha, acc, m, l = step(kv0 + st * BN, st, p, alpha, acc, m, l, masked)
        return p, alpha, acc, m, l

    for g in kiln.range(0, full):
        p, alpha, acc, m, l = steps(g * (STAGES * BN), p, alpha, acc, m, l, False)
    for g in kiln.range(full, last):
        p, alpha, acc, m, l = steps(g * (STAGES * BN), p, alpha, acc, m, l, True)
    if TURNS:
        turns.close()
    acc = kiln.gemm(p, v_s[-1], acc * alpha)
    kiln.copy(kiln.cast(acc / l, bf16), kiln.GlobalTile(o, (BM, D), (start + row0, col0),
                                                        row_end=start + length, align=ALIGN))


# name -> (kernel, (BM, BN, warps, stages), extra constexprs); kernel None is the tutorial's own
# (block None: its default blocks)
VARIANTS = {
    "tutorial": (None, None, {}),
    "tutorial_96x3": (None, (128, 96, 8, 3), {}),
    "tutorial_64x3": (None, (128, 64, 8, 3), {}),
    "tutorial_64x4": (None, (128, 64, 8, 4), {}),
    "tutorial_m64": (None, (64, 64, 4, 3), {}),
    "free_128x3": (release_kernel, (128, 128, 8, 3), {"TURNS": False}),
    "turns_128x3": (release_kernel, (128, 128, 8, 3), {"TURNS": True}),
    "cp_64x2": (loops_kernel, (128, 64, 8, 2), {"TMA": False}),
    "tma_128x2": (loops_kernel, (128, 128, 8, 2), {"TMA": True}),
    "tma_128x3": (loops_kernel, (128, 128, 8, 3), {"TMA": True}),
    "tma_64x3": (loops_kernel, (128, 64, 8, 3), {"TMA": True}),
    "tma_m64": (loops_kernel, (64, 64, 4, 2), {"TMA": True}),
    "tma_m64n96": (loops_kernel, (64, 96, 4, 2), {"TMA": True}),
}


def launch_spec(tut, name, q, k, v, o, cu, seq, heads, causal, scale):
    """``(kernel, grid, args, constexprs)`` of variant ``name``: what its launch passes."""
    kernel, block, extra = VARIANTS[name]
    cfg = tut.config(q.shape[1] // heads, None, block)
    grid = (-(-seq // cfg["BM"]), heads, len(cu) - 1)
    return (kernel or tut.attention_kernel, grid, (q, k, v, o, cu, scale * tut.LOG2E),
            dict(CAUSAL=causal, ALIGN=16, **cfg, **extra))


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

    tut = _tutorial()
    x = np.zeros((256, 256), ml_dtypes.bfloat16)
    with path.open("w") as out:
        for name in names:
            kernel, block, extra = VARIANTS[name]
            ck = (kernel or tut.attention_kernel).compile(
                x, x, x, x, np.array([0, 256], np.int32), 1.0, CAUSAL=causal, ALIGN=16,
                **tut.config(128, "sm_90a", block), **extra, target="sm_90a")
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
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
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

    tut = _tutorial()
    gen = torch.Generator(device="cuda").manual_seed(1)
    d, rows = 128, []
    heads = 2048 // d
    for seq in args.seqs:
        batch = max(16384 // seq, 1)
        q4, k4, v4 = (torch.randn(batch, seq, heads, d, device="cuda", generator=gen)
                      .to(torch.bfloat16) for _ in range(3))
        q, k, v = (t.view(batch * seq, heads * d) for t in (q4, k4, v4))
        cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
        scale = d ** -0.5
        outs = {(n, c): torch.full_like(q, float("nan")) for n in args.variants for c in causals}
        specs = {key: launch_spec(tut, key[0], q, k, v, o, cu, seq, heads, key[1], scale)
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
        for causal in causals:   # per mask: the peers, then every variant (a run cut short
            # keeps whole masks)
            flops = 4.0 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
            want = prefill(q4, k4, v4, causal=causal, scale=scale).view(batch * seq, -1).float()
            ref = torch.empty_like(q)

            def t_run():
                t_attention[(seq // 128, batch * heads)](
                    q, k, v, ref, q.stride(0), scale * tut.LOG2E, seq, heads, D=d, BM=128,
                    BN=128, CAUSAL=causal, num_warps=8, num_stages=3)

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
