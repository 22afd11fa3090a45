"""What runs at a GEMM cell: cuBLAS's kernel names, and one call of each side for a profiler.

``--names``: for each cell (``model:layer:M``, weights N x K; or ``MxNxK``, B stored K x N, as
in ``bench/gemm_ab.py``) the CUDA kernels of one ``torch.matmul`` call (a torch profiler:
nvjet names carry cuBLAS's tile, stages and cluster) and the config ``matmul`` picks (up
to M = 512; "tuned" above).
``--run``: at the first cell one Kiln call of ``matmul``'s pick (its first call: tuning above
M = 512, compiling if not cached), one cuBLAS call, then one call of each ``--configs`` entry,
for ``ncu`` to count (Kiln's kernels are ``hopper_gemm_*``), e.g.::

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:'gemm|nvjet' \\
        python bench/gemm_profile_cell.py --run llama3-8b:qkv:256 --configs block_n=192
    python bench/gemm_profile_cell.py --names llama3-8b:qkv:16 4096x4096x4096
"""

from __future__ import annotations

import argparse

import torch

from kiln.kernels.gemm import hopper_autotuner, matmul
from kiln.kernels.gemm.small_m import SMALL_M, chosen_config
from gemm_ab import bound_call, parse_cell, parse_config, short


def operands(spec: str):
    """``(label, x, b, trans_b, cublas)`` of a cell: bf16 operands and the cuBLAS call."""
    label, m, n, k, trans_b = parse_cell(spec)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = w if trans_b else w.T.contiguous()
    return label, x, b, trans_b, (lambda: torch.matmul(x, w.T)) if trans_b else \
        (lambda: torch.matmul(x, b))


def pick(x, b, trans_b: bool, tune: bool = True) -> str:
    """The config ``matmul`` runs for these operands (``tune``: calling it first, which tunes
    above SMALL_M; else "tuned" there)."""
    (m, k), n = x.shape, b.shape[0] if trans_b else b.shape[1]
    b_major = "k" if trans_b else "mn"
    if tune:
        matmul(x, b, trans_b=trans_b)
    config = chosen_config(m, n, k, "bf16", b_major, "bf16") if m <= SMALL_M else \
        hopper_autotuner.cached((None, None, None, m, n, k, "bf16", b_major, "bf16", None), {})
    return short(config) if config else "tuned"


def names(cells) -> None:
    from torch.profiler import ProfilerActivity, profile

    for spec in cells:
        label, x, b, trans_b, cublas = operands(spec)
        cublas()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cublas()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if str(e.device_type).endswith("CUDA")]
        print(f"{label}: cuBLAS {' + '.join(kernels)}; Kiln {pick(x, b, trans_b, False)}",
              flush=True)


def run(spec: str, configs) -> None:
    label, x, b, trans_b, cublas = operands(spec)
    print(f"{label}: matmul ({pick(x, b, trans_b)}), cuBLAS, "
          + ", ".join(short(c) for c in configs), flush=True)
    for call in [cublas] + [bound_call(x, b, config, trans_b) for config in configs]:
        call()
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="+", help="model:layer:M or MxNxK")
    parser.add_argument("--names", action="store_true", help="name cuBLAS's kernels per cell")
    parser.add_argument("--run", action="store_true", help="one call of each side (for ncu)")
    parser.add_argument("--configs", nargs="*", type=parse_config, default=[],
                        help="with --run: also these configs ('default' or field=value,...)")
    args = parser.parse_args()
    if args.names:
        names(args.cells)
    if args.run:
        run(args.cells[0], args.configs)


if __name__ == "__main__":
    main()
