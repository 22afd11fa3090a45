"""The tutorials (examples/tutorials/) against their Triton peers and copy bandwidth.

Peers follow the designs of Triton's own tutorials (01 vector add, 02 fused softmax, 03 matrix
multiplication, 05 layer norm), written here from their public description: vector add in
1024-element blocks with a tail mask; softmax with the whole row in one program (``BLOCK =
next_power_of_2(N)``, masked loads with ``-inf``), a persistent loop over rows; layer norm
forward with one program per row looping over ``BLOCK``-column chunks three times (mean,
variance, normalise), ``BLOCK = min(65536 / 4, next_power_of_2(N))``, ``num_warps =
min(max(BLOCK // 256, 1), 8)``; matmul with grouped tile ordering (``GROUP_M = 8``), masked
``tl.dot`` K loop, 128 x 256 x 64 tiles, 8 warps, 3 stages (a config the tutorial's autotuner
lists for Hopper), and the same bias + GELU epilogue as Kiln's tutorial. cuBLAS is
``torch.matmul`` (bf16, no epilogue). Fused attention (06): Q in registers, a loop over K/V
tiles with ``tl.dot``, base-2 online softmax, causal as an unmasked stage then a masked diagonal
stage; 128 x 64 tiles, 4 warps (D 64) / 128 x 128, 8 warps (D 128), 3 stages; Kiln's own
``kiln.kernels.attention.prefill`` is the third column. Grouped GEMM (08): persistent programs
(one per SM) walking the groups' tiles, 128 x 128 x 64 tiles, 8 warps, 3 stages, here over
MoE-style ``group_offsets``; cuBLAS is one ``torch.matmul`` per group.

Method: every shape is first checked on the GPU against a float64 reference (Kiln and Triton;
a wrong result fails the run). Times are ``timing.queued_ms`` (kernel time only: calls queued
behind a busy stream), median of ``--repeat`` samples. GB/s counts the bytes each op must move
(softmax and layer norm: the matrix read and written once; vector add: two inputs, one output).
The copy bandwidth is a torch device-to-device copy of a 1 GiB buffer in the same run; softmax
and layer norm also give the copy of their own matrix (same bytes, the same launch and ramp).
"lines" counts the kernel's body (the ``@kiln.kernel`` / ``@triton.jit`` function body and its
helpers, no blank lines, comments or docstrings); the JSON has them under ``lines``.

Usage (on an H100/H200): ``python bench/tutorials.py [--quick] [--only attention,grouped]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import json
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402
from timing import queued_ms, time_ms  # noqa: E402


def _tutorial(name: str):
    """examples/tutorials/<name>.py, loaded by path (bench/ has an ``attention`` module too)."""
    spec = importlib.util.spec_from_file_location(f"kiln_tutorial_{name}",
                                                  ROOT / "examples" / "tutorials" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


attention, fused_softmax, grouped_matmul, layernorm, matmul, vector_add = (
    _tutorial(n) for n in ("attention", "fused_softmax", "grouped_matmul", "layernorm", "matmul",
                           "vector_add"))


def code_lines(*fns) -> int:
    """Lines of code of the bodies of ``fns`` (a kernel and its helpers): no decorators or
    signature, blank lines, comments or docstring."""
    total = 0
    for fn in fns:
        source = textwrap.dedent(inspect.getsource(fn))
        body = ast.parse(source).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        lines = source.splitlines()[body[0].lineno - 1:body[-1].end_lineno]
        total += sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))
    return total


def kernel_lines() -> dict[str, tuple[int, int]]:
    """``{tutorial: (kiln lines, triton lines)}`` (imports Triton)."""
    import tutorials_triton as t
    return {
        "vector_add": (code_lines(vector_add.add_kernel.fn), code_lines(t.add_kernel.fn)),
        "softmax": (code_lines(fused_softmax.softmax_kernel.fn), code_lines(t.softmax_kernel.fn)),
        "layernorm": (code_lines(layernorm.layernorm_kernel.fn),
                      code_lines(t.layernorm_kernel.fn)),
        "matmul": (code_lines(matmul.matmul_kernel.fn), code_lines(t.matmul_kernel.fn)),
        "attention": (code_lines(attention.attention_kernel.fn),
                      code_lines(t.attention_kernel.fn, t._attention_inner.fn)),
        "grouped": (code_lines(grouped_matmul.grouped_matmul_kernel.fn),
                    code_lines(t.grouped_matmul_kernel.fn)),
    }


def check(name, got, want, tol):
    err = float(np.abs(got.double().cpu().numpy() - want).max())
    if not err <= tol:
        raise SystemExit(f"{name}: max error {err:.3g} > {tol}")
    return err


# (BM, BN, num_warps) of the Triton peer per head dim, 3 stages
T_ATTENTION_CONFIGS = {64: [(128, 64, 4)], 128: [(128, 128, 8), (128, 64, 8)]}
# (BM, BN, warps, stages) the tutorial tries on each head dim's first shape; the fastest runs all
K_ATTENTION_CONFIGS = {64: [(128, 64, 8, 3), (128, 128, 8, 3)],
                       128: [(128, 128, 8, 3), (128, 64, 8, 3)]}


def attention_inputs(torch, seq: int, d: int, gen):
    """The attention benches' problem at sequence length ``seq`` and head dim ``d``: ``16k``
    tokens as ``batch`` sequences of ``2048 / d`` heads, random bf16. Returns ``(batch, heads,
    (q4, k4, v4) [B, S, H, D], (q, k, v) the same memory as [B * S, H * D], cu_seqlens,
    scale)``."""
    heads, batch = 2048 // d, max(16384 // seq, 1)
    q4, k4, v4 = (torch.randn(batch, seq, heads, d, device="cuda", generator=gen)
                  .to(torch.bfloat16) for _ in range(3))
    q, k, v = (t.view(batch * seq, heads * d) for t in (q4, k4, v4))
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
    return batch, heads, (q4, k4, v4), (q, k, v), cu, d ** -0.5


def bench_attention(args, lines) -> list[dict]:
    """Fused attention, bf16 ``[B, S, H, D]`` with ``B * S = 16k`` tokens: Kiln's tutorial
    (the same memory as ``[B * S, H * D]``), Triton's tutorial design and Kiln's prefill."""
    import torch
    from triton.runtime.errors import OutOfResources
    from tutorials_triton import attention_kernel as t_attention
    from kiln.kernels.attention import prefill

    gen = torch.Generator(device="cuda").manual_seed(1)
    # the tutorial first checks itself against float64 on a ragged batch
    cu_small = torch.tensor([0, 1000, 1037, 1700], dtype=torch.int32)
    for d in (128,) if args.quick else (64, 128):
        q, k, v = (torch.randn(1700, 2 * d, device="cuda", generator=gen).to(torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            o = torch.full_like(q, float("nan"))
            attention.attention(q, k, v, o, cu_small.cuda(), 1000, 2, causal=causal)
            want = attention.reference(*(t.float().cpu().numpy() for t in (q, k, v)),
                                       cu_small.numpy(), 2, causal)
            check(f"kiln attention d{d} causal={causal}", o, want, 2e-2)
    rows = []
    dims = args.dims or ((128,) if args.quick else (64, 128))
    seqs = (4096, 16384) if args.quick else (4096, 8192, 16384)
    for d in dims:
        k_config = None
        for seq in seqs:
            batch, heads, (q4, k4, v4), (q, k, v), cu, scale = attention_inputs(torch, seq, d,
                                                                                gen)
            for causal in (False, True):
                o, ref = torch.empty_like(q), torch.empty_like(q)
                flops = 4.0 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)

                def k_run(config=None):
                    attention.attention(q, k, v, o, cu, seq, heads, causal=causal,
                                        block=config or k_config)

                def t_run(config=None):
                    bm, bn, warps = config or t_config
                    t_attention[(seq // bm, batch * heads)](
                        q, k, v, ref, q.stride(0), scale * attention.LOG2E, seq, heads, D=d,
                        BM=bm, BN=bn, CAUSAL=causal, num_warps=warps, num_stages=3)

                def p_run():
                    return prefill(q4, k4, v4, causal=causal, scale=scale)

                if k_config is None or args.blocks:   # --blocks: an A/B at every shape
                    tried = {c: queued_ms(lambda: k_run(c), args.repeat)
                             for c in args.blocks or K_ATTENTION_CONFIGS[d]}
                    k_config = min(tried, key=tried.get)
                    print(f"kiln attention d{d} seq {seq} causal={causal:d} blocks (BM, BN, "
                          "warps): " + ", ".join(f"{c} {flops / ms / 1e9:.0f} TFLOP/s"
                                                 for c, ms in tried.items()), flush=True)
                k_run()
                # the tutorial autotuner's Hopper picks; the first that fits shared memory
                for t_config in T_ATTENTION_CONFIGS[d]:
                    try:
                        t_run(t_config)
                        break
                    except OutOfResources:
                        continue
                want = p_run().view(batch * seq, heads * d).float()
                err = 0.0
                for name, got in (("kiln", o), ("triton", ref)):
                    e = float((got.float() - want).abs().max())
                    if not e < 2e-2:
                        raise SystemExit(f"{name} attention vs prefill: max error {e:.3g}")
                    err = max(err, e)
                k_ms, t_ms, p_ms = (queued_ms(f, args.repeat) for f in (k_run, t_run, p_run))
                row = {"op": "attention", "shape": [batch, seq, heads, d], "causal": causal,
                       "kiln_us": k_ms * 1e3, "triton_us": t_ms * 1e3, "prefill_us": p_ms * 1e3,
                       "kiln_tflops": flops / k_ms / 1e9, "triton_tflops": flops / t_ms / 1e9,
                       "prefill_tflops": flops / p_ms / 1e9, "vs_triton": t_ms / k_ms,
                       "vs_prefill": p_ms / k_ms, "max_err": err, "kiln_lines": lines[0],
                       "triton_lines": lines[1], "triton_config": list(t_config),
                       "kiln_config": list(k_config)}
                rows.append(row)
                print(f"attention  {str((batch, seq, heads, d)):16s} causal={causal:d} kiln "
                      f"{row['kiln_tflops']:6.1f} TFLOP/s  triton {row['triton_tflops']:6.1f}  "
                      f"prefill {row['prefill_tflops']:6.1f}  x{row['vs_triton']:.2f} of triton,"
                      f" x{row['vs_prefill']:.2f} of prefill  lines {lines[0]} vs {lines[1]}",
                      flush=True)
    return rows


def bench_grouped(args, lines, sms) -> list[dict]:
    """Grouped GEMM over MoE-style ``group_offsets`` (8 groups of uneven sizes, 8k rows in all,
    ``K = N = 4096``): Kiln's tutorial, Triton's grouped-GEMM design, one cuBLAS call a group."""
    import torch
    from tutorials_triton import grouped_matmul_kernel as t_grouped

    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for k, n in ([(4096, 4096)] if args.quick else [(4096, 4096), (2048, 7168)]):
        sizes = [1536, 512, 0, 2048, 777, 1271, 1024, 1024]
        offsets = torch.tensor([0] + list(np.cumsum(sizes)), dtype=torch.int32, device="cuda")
        total, groups = sum(sizes), len(sizes)
        a = torch.randn(total, k, device="cuda", generator=gen).to(torch.bfloat16)
        b = (torch.randn(groups, k, n, device="cuda", generator=gen) / 64).to(torch.bfloat16)
        c, ref, cub = (torch.empty(total, n, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
        bounds = [int(x) for x in offsets.cpu()]

        def k_run():
            grouped_matmul.grouped_matmul(a, b, c, offsets)

        def t_run():
            t_grouped[(sms,)](a, b, ref, offsets, groups, n, k, NUM_SM=sms, BM=128, BN=128,
                              BK=64, num_warps=8, num_stages=3)

        def c_run():
            for g in range(groups):
                torch.matmul(a[bounds[g]:bounds[g + 1]], b[g], out=cub[bounds[g]:bounds[g + 1]])

        k_run()
        t_run()
        c_run()
        want = cub.float()
        scale = float(want.abs().max())
        err = 0.0
        for name, got in (("kiln", c), ("triton", ref)):
            e = float((got.float() - want).abs().max()) / scale
            if not e < 2e-2:
                raise SystemExit(f"{name} grouped matmul: max relative error {e:.3g}")
            err = max(err, e)
        flops = 2.0 * total * k * n
        k_ms, t_ms, c_ms = (queued_ms(f, args.repeat) for f in (k_run, t_run, c_run))
        row = {"op": "grouped", "shape": [total, n, k, groups], "kiln_us": k_ms * 1e3,
               "triton_us": t_ms * 1e3, "cublas_us": c_ms * 1e3,
               "kiln_tflops": flops / k_ms / 1e9, "triton_tflops": flops / t_ms / 1e9,
               "cublas_tflops": flops / c_ms / 1e9, "vs_triton": t_ms / k_ms,
               "vs_cublas": c_ms / k_ms, "max_err": err, "kiln_lines": lines[0],
               "triton_lines": lines[1]}
        rows.append(row)
        print(f"grouped    {str((total, n, k, groups)):16s} kiln {row['kiln_tflops']:6.1f} TFLOP/s"
              f"  triton {row['triton_tflops']:6.1f}  cublas {row['cublas_tflops']:6.1f}  "
              f"x{row['vs_triton']:.2f} of triton, x{row['vs_cublas']:.2f} of cublas  "
              f"lines {lines[0]} vs {lines[1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (about a minute)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", help="comma-separated tutorials (vector_add, softmax, "
                        "layernorm, matmul, attention, grouped); default all")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--blocks", nargs="+", type=lambda b: tuple(map(int, b.split(","))),
                        help="attention: BM,BN,WARPS[,STAGES] blocks to time at every shape (the "
                             "fastest is the row's); default: tune on the first shape")
    parser.add_argument("--dims", type=lambda x: tuple(map(int, x.split(","))),
                        help="attention head dims (default 64,128; --quick: 128)")
    args = parser.parse_args()
    import torch

    import triton
    from tutorials_triton import add_kernel as t_add, layernorm_kernel as t_layernorm, \
        matmul_problem, softmax_kernel as t_softmax

    only = set(args.only.split(",")) if args.only else None

    def wanted(name):
        return only is None or name in only

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 2 / time_ms(lambda: dst.copy_(src), args.repeat) / 1e6
    del src, dst
    lines = kernel_lines()
    for name, (k_lines, t_lines) in lines.items():
        print(f"lines of kernel code  {name:10s} kiln {k_lines:4d}  triton {t_lines:4d}")
    rows = []

    def record(op, shape, nbytes, kiln_fn, triton_fn, err, same_gbs=None):
        k_ms = queued_ms(kiln_fn, args.repeat)
        t_ms = queued_ms(triton_fn, args.repeat)
        k_gbs, t_gbs = nbytes / k_ms / 1e6, nbytes / t_ms / 1e6
        row = {"op": op, "shape": list(shape), "kiln_us": k_ms * 1e3, "triton_us": t_ms * 1e3,
               "kiln_gbs": k_gbs, "triton_gbs": t_gbs, "vs_triton": k_gbs / t_gbs,
               "of_copy": k_gbs / copy_gbs, "triton_of_copy": t_gbs / copy_gbs,
               "max_err": err, "kiln_lines": lines[op][0], "triton_lines": lines[op][1]}
        same = ""
        if same_gbs:   # a copy of the same matrix pays the launch and ramp this size pays
            row.update(copy_same_gbs=same_gbs, of_copy_same=k_gbs / same_gbs,
                       triton_of_copy_same=t_gbs / same_gbs)
            same = f"  {row['of_copy_same']:.0%} of same-size copy"
        rows.append(row)
        print(f"{op:10s} {str(shape):16s} kiln {k_gbs:7.0f} GB/s  triton {t_gbs:7.0f} GB/s  "
              f"x{row['vs_triton']:.2f}  {row['of_copy']:.0%} of copy{same}  "
              f"lines {lines[op][0]} vs {lines[op][1]}", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in ([1 << 26] if args.quick else [1 << 20, 1 << 24, 1 << 26]) if wanted("vector_add") \
            else []:
        n = n + 3
        x, y = (torch.randn(n, device="cuda", generator=gen) for _ in range(2))
        out, ref = torch.empty_like(x), torch.empty_like(x)
        vector_add.add(x, y, out)
        t_add[(triton.cdiv(n, 1024),)](x, y, ref, n, BLOCK=1024)
        want = (x.double() + y.double()).cpu().numpy()
        err = max(check("kiln add", out, want, 1e-6), check("triton add", ref, want, 1e-6))
        record("vector_add", (n,), 12 * n, lambda: vector_add.add(x, y, out),
               lambda: t_add[(triton.cdiv(n, 1024),)](x, y, ref, n, BLOCK=1024), err)

    cols = [4096, 8192, 16384, 32768] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    cols = cols if wanted("softmax") or wanted("layernorm") else []
    for n in cols:
        m = (1 << (24 if args.quick else 26)) // n
        x = torch.randn(m, n, device="cuda", generator=gen)
        y, ref = torch.empty_like(x), torch.empty_like(x)
        same_gbs = 8 * m * n / queued_ms(lambda: ref.copy_(x), args.repeat) / 1e6
        block = triton.next_power_of_2(n)
        warps = 8 if block <= 8192 else 16
        grid = (min(m, sms * 4),)

        def t_run():
            t_softmax[grid](ref, x, x.stride(0), ref.stride(0), m, n, BLOCK=block,
                            num_warps=warps)

        fused_softmax.softmax(x, y)
        t_run()
        want = fused_softmax.reference(x.cpu().numpy())
        err = max(check("kiln softmax", y, want, 1e-6), check("triton softmax", ref, want, 1e-6))
        record("softmax", (m, n), 8 * m * n, lambda: fused_softmax.softmax(x, y), t_run, err,
               same_gbs)

        w = torch.randn(n, device="cuda", generator=gen)
        b = torch.randn(n, device="cuda", generator=gen)
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        t_mean, t_rstd = torch.empty_like(mean), torch.empty_like(rstd)
        ln_block = min(65536 // 4, block)
        ln_warps = min(max(ln_block // 256, 1), 8)

        def t_ln():
            t_layernorm[(m,)](x, ref, w, b, t_mean, t_rstd, x.stride(0), n, 1e-5,
                              BLOCK=ln_block, num_warps=ln_warps)

        layernorm.layernorm(x, w, b, y, mean, rstd)
        t_ln()
        want, _, _ = layernorm.reference(x.cpu().numpy(), w.cpu().numpy(), b.cpu().numpy())
        err = max(check("kiln layernorm", y, want, 1e-4),
                  check("triton layernorm", ref, want, 1e-4))
        record("layernorm", (m, n), 8 * m * n, lambda: layernorm.layernorm(x, w, b, y, mean, rstd),
               t_ln, err, same_gbs)

    for size in ([4096] if args.quick else [4096, 8192]) if wanted("matmul") else []:
        p = matmul_problem(torch, size, gen)
        a, b, bias, c, ref, want, t_mm = p.a, p.b, p.bias, p.c, p.ref, p.want, p.triton
        m, n, k = p.m, p.n, p.k
        matmul.matmul(a, b, bias, c)
        t_mm()
        scale = float(want.abs().max())
        err = 0.0
        for name, got in (("kiln matmul", c), ("triton matmul", ref)):
            e = float((got.float() - want).abs().max()) / scale
            if not e < 2e-2:
                raise SystemExit(f"{name}: max relative error {e:.3g}")
            err = max(err, e)
        flops = 2.0 * m * n * k
        k_ms, t_ms = queued_ms(lambda: matmul.matmul(a, b, bias, c), args.repeat), \
            queued_ms(t_mm, args.repeat)
        cublas_ms = queued_ms(lambda: torch.matmul(a, b), args.repeat)
        row = {"op": "matmul", "shape": [m, n, k], "kiln_us": k_ms * 1e3,
               "triton_us": t_ms * 1e3, "cublas_us": cublas_ms * 1e3,
               "kiln_tflops": flops / k_ms / 1e9, "triton_tflops": flops / t_ms / 1e9,
               "cublas_tflops": flops / cublas_ms / 1e9, "vs_triton": t_ms / k_ms,
               "vs_cublas": cublas_ms / k_ms, "max_err": err,
               "kiln_lines": lines["matmul"][0], "triton_lines": lines["matmul"][1]}
        rows.append(row)
        print(f"matmul     {str((m, n, k)):16s} kiln {row['kiln_tflops']:6.1f} TFLOP/s  triton "
              f"{row['triton_tflops']:6.1f}  cublas {row['cublas_tflops']:6.1f}  "
              f"x{row['vs_triton']:.2f} of triton, x{row['vs_cublas']:.2f} of cublas  "
              f"lines {lines['matmul'][0]} vs {lines['matmul'][1]}", flush=True)

    if wanted("grouped"):
        rows += bench_grouped(args, lines["grouped"], sms)
    if wanted("attention"):
        rows += bench_attention(args, lines["attention"])
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    line_counts = {k: {"kiln": v[0], "triton": v[1]} for k, v in lines.items()}
    if args.json:
        write_results(args.json, "tutorials", rows, torch, copy_gbs=copy_gbs, lines=line_counts)
    print(json.dumps({"copy_gbs": copy_gbs, "lines": line_counts, "rows": rows}))


if __name__ == "__main__":
    main()
