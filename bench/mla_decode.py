"""Kiln's MLA decode vs copy bandwidth, vs torch SDPA on the same (unpaged) data, in GB/s and
TFLOP/s.

Grid: DeepSeek-V3's latent head (576 = 512 V + 64 rotary columns, bf16, pages of 64 rows),
128 heads (and 16), context 4k, batch 32 / 64 / 128, Sq 1 (memory-bound: goal >= 0.85 of
copy bandwidth at batch >= 32) and Sq 2 (Sq x heads = 256: goal >= 500 TFLOP/s).

Method: every shape is first checked against a float32 torch reference (max abs error <
2e-2; NaN fails). Kiln (``mla_decode`` with its defaults: at 16 packed rows the transposed
schedule with early launch and 2 pages prefetched before its wait, else the lead group;
"lead": ``lead_group=True``, the lead group at every shape; "early": ``early_launch=True``;
"split": session 35's default, ``split_keys=True``; "seesaw": ``seesaw=True``, pages in
pairs, one scored by each warp group; "replicated": ``split_keys=False``, both groups
scoring every key; "2-kernel": the default kernel with ``fused_combine=False``, its partials
merged by ``combine``; "1-split": ``num_splits=1``, no merge; "balanced": ``balanced=True``,
every SM's CTA an equal share of all the batch's pages, at most 32 packed rows) and torch SDPA (each
sequence's rows contiguous, ``[B, 1, L, 576]`` keys and ``[B, 1, L, 512]`` values, the
``Sq x H`` query rows of a sequence as one head's queries, the causal mask of the new tokens
as a boolean mask) are timed with CUDA events queued behind a busy stream (GPU time only),
median of ``--repeat`` samples of ``--batch`` calls. GB/s counts the bytes decode must move:
every sequence's cache rows, q and o; TFLOP/s counts ``2 * Sq * H * L * (576 + 512)`` a
sequence.
The copy bandwidth is a 2 GiB device-to-device ``torch`` copy (read + write bytes).
FlashMLA is not installed on the bench machines; its published H800 figures (about 3000 GB/s
memory-bound, 580 TFLOP/s compute-bound) are the anchor.

Usage (on an H100): ``python bench/mla_decode.py [--json out.json] [--repeat 20] [--quick]``.
"""

from __future__ import annotations

import argparse

from results_io import write_results
from timing import queued_ms

PAGE, DQK, DV = 64, 576, 512
# (batch, ctx, Sq, heads)
SHAPES = ((32, 4096, 1, 128), (64, 4096, 1, 128), (128, 4096, 1, 128), (32, 4096, 1, 16),
          (128, 4096, 1, 16), (32, 4096, 2, 128), (64, 4096, 2, 128), (128, 4096, 2, 128))
QUICK_SHAPES = ((32, 4096, 1, 16), (32, 4096, 1, 128), (64, 4096, 2, 128))
# Kiln's timed calls beside the default (its keywords; the first, the default, is also
# checked): the other scores schedules, the combine kernel instead of the fused merge, one split.
VARIANTS = {"default": {}, "lead": dict(lead_group=True), "early": dict(early_launch=True),
            "split": dict(split_keys=True, early_launch=False),
            "seesaw": dict(seesaw=True), "replicated": dict(split_keys=False),
            "2-kernel": dict(fused_combine=False), "1-split": dict(num_splits=1),
            "balanced": dict(balanced=True)}
NARROW = ("balanced",)  # variants of at most 32 packed rows (Sq x H): NaN at other shapes


def copy_bandwidth_gbs(torch, repeat: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = queued_ms(lambda: dst.copy_(src), repeat, 5)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def make_problem(torch, batch, ctx, sq, heads):
    pages = ctx // PAGE
    kv = torch.randn(batch * pages, PAGE, DQK, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    q = torch.randn(batch, sq, heads, DQK, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, kv, table, seq_lens


def unpaged(torch, q, kv, table, ctx):
    """SDPA's inputs: q ``[B, 1, Sq * H, 576]`` (token-major rows), k ``[B, 1, L, 576]``,
    v ``[B, 1, L, 512]`` (contiguous copies of each sequence's rows), the bottom-right
    causal mask ``[Sq * H, L]`` (None for Sq 1)."""
    batch, sq, heads, _ = q.shape
    rows = kv[table.long()].reshape(batch, 1, ctx, DQK)
    mask = None
    if sq > 1:
        token = torch.arange(sq * heads, device=q.device) // heads
        mask = torch.arange(ctx, device=q.device)[None, :] <= (ctx - sq + token)[:, None]
    return (q.reshape(batch, 1, sq * heads, DQK), rows.contiguous(),
            rows[..., :DV].contiguous(), mask)


def bench(torch, batch, ctx, sq, heads, repeat, calls, copy_gbs) -> dict:
    from kiln.kernels.attention import mla_decode

    problem = make_problem(torch, batch, ctx, sq, heads)
    q, k, v, mask = unpaged(torch, *problem[:3], ctx)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    scale = DQK ** -0.5
    reference = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
    variants = {name: options for name, options in VARIANTS.items()
                if name not in NARROW or sq * heads <= 32}
    for options in variants.values():
        out, _ = mla_decode(*problem, **options)
        error = (out.float().reshape(reference.shape) - reference).abs().max().item()
        if not error < 2e-2:  # also catches NaN
            raise SystemExit(f"Kiln MLA decode ({options}) wrong at batch "
                             f"{batch} ctx {ctx} Sq {sq} H {heads}: max abs error {error}")
    del reference
    nbytes = batch * ctx * DQK * 2 + q.numel() * 2 + batch * sq * heads * DV * 2
    flops = 2 * batch * sq * heads * ctx * (DQK + DV)
    kiln_ms = queued_ms(lambda: mla_decode(*problem), repeat, calls)
    variant_ms = {name: queued_ms(lambda: mla_decode(*problem, **options), repeat, calls)
                  if name in variants else float("nan")
                  for name, options in VARIANTS.items() if options}
    try:
        torch_ms = queued_ms(lambda: sdpa(q, k, v, attn_mask=mask, scale=scale), repeat, calls)
    except RuntimeError as error_:  # e.g. out of memory on the math path
        print(f"torch SDPA failed at batch {batch}: {error_}")
        torch_ms = float("nan")
    kiln_gbs = nbytes / kiln_ms / 1e6
    return {"batch": batch, "ctx": ctx, "sq": sq, "heads": heads, "max_abs_error": error,
            "kiln_ms": kiln_ms, **{f"kiln_{name}_ms": ms for name, ms in variant_ms.items()},
            "torch_sdpa_ms": torch_ms, "kiln_gbs": kiln_gbs,
            "kiln_tflops": flops / kiln_ms / 1e9, "torch_tflops": flops / torch_ms / 1e9,
            "copy_gbs": copy_gbs, "ratio_to_copy": kiln_gbs / copy_gbs,
            "speedup_vs_torch": torch_ms / kiln_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10, help="calls per sample")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_SHAPES}")
    args = parser.parse_args()
    import torch  # imported after argparse so --help works without a GPU stack

    copy_gbs = copy_bandwidth_gbs(torch, args.repeat)
    rows = [bench(torch, *shape, args.repeat, args.batch, copy_gbs)
            for shape in (QUICK_SHAPES if args.quick else SHAPES)]
    print(f"{torch.cuda.get_device_name()}: MLA 576/512, bf16, page {PAGE}; copy bandwidth "
          f"{copy_gbs:.0f} GB/s; GPU time only (queued)")
    print(f"{'batch':>5} {'ctx':>6} {'Sq':>3} {'H':>4} {'Kiln us':>8} "
          + "".join(f"{name:>9}" for name, options in VARIANTS.items() if options) +
          f" {'SDPA us':>8} "
          f"{'Kiln GB/s':>9} {'/copy':>6} {'Kiln TF/s':>9} {'SDPA TF/s':>9} {'vs SDPA':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ctx']:>6} {r['sq']:>3} {r['heads']:>4} "
              f"{1e3 * r['kiln_ms']:8.1f} "
              + "".join(f"{1e3 * r[f'kiln_{name}_ms']:9.1f}" for name, options
                        in VARIANTS.items() if options) +
              f" {1e3 * r['torch_sdpa_ms']:8.1f} {r['kiln_gbs']:9.0f} "
              f"{r['ratio_to_copy']:6.2f} {r['kiln_tflops']:9.0f} {r['torch_tflops']:9.0f} "
              f"{r['speedup_vs_torch']:7.2f}")
    if args.json:
        write_results(args.json, "mla_decode", rows, torch=torch, copy_gbs=copy_gbs)


if __name__ == "__main__":
    main()
