"""Where the grouped (MoE) GEMM loses against the dense GEMM of the same FLOPs: one run that
separates the causes (``bench/gemm.py --grouped`` reports only the end result).

At ``TOKENS * TOP_K`` rows, expert ``K x N`` = 4096 x 14336 and 4096 x 4096, G in 8 and 64,
all with the grouped kernel's own tile config (no autotuning, so configs do not differ):

| row | what it isolates |
| --- | --- |
| ``dense`` | the plain Hopper kernel on one ``[total_M, K] x [K, N]`` (the goal's denominator) |
| ``grouped G=1`` | the grouped kernel's own costs (tile table, tile look-up, masked epilogue) |
| ``uniform`` | G equal groups of a multiple of 128 rows: G weights to stream, no ragged tails |
| ``uniform -32`` | 32 rows fewer per group: each group's last tile has 96 rows (both consumers busy, all tiles cost the same) |
| ``uniform -64`` | 64 fewer: each last tile has 64 rows (one consumer idles: tiles of unequal cost, which desynchronise the CTAs that share B in L2) |
| ``ragged`` | the router-like sizes of ``bench/gemm.py --grouped`` (tails padded to 64 rows) |
| ``... dynamic`` | the same with CTAs claiming tiles from a counter (``run_grouped(dynamic=True)``), which keeps the running tiles a window of consecutive ones |

TFLOP/s count the rows multiplied (the ``-32`` / ``-64`` cases leave the last rows of ``A``
unused).

plus, per case, the time to read every expert's weights once at the device's copy bandwidth
(the floor a grouped GEMM cannot beat however it schedules) and each other config of
``GROUPED_CONFIGS`` on the ragged case. Usage: ``python bench/gemm_grouped_probe.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.kernels.gemm import run_hopper
from kiln.kernels.gemm.grouped import grouped_config
from kiln.kernels.gemm.grouped_api import run_grouped
from gemm_grouped import GROUPED_CONFIGS, TOKENS, TOP_K, moe_sizes
from gemm_llm import copy_gbps
from timing import time_ms

CASES = ((64, 4096, 14336), (64, 4096, 4096), (8, 4096, 14336))  # (G, K, N)


def grouped_ms(a, sizes, k, n, config=None, dynamic=False) -> float:
    groups = len(sizes)
    offs = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)).cuda()
    b = torch.randn(groups * k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    c = torch.empty(a.shape[0], n, device="cuda", dtype=torch.bfloat16)
    def run(out, claims):
        run_grouped(a, b, out, offs, k=k, b_rows=k, trans_b=False, config=config,
                    dynamic=claims)

    if dynamic:  # claimed tiles are computed as strided ones are: the same bits
        run(c, True)
        expected = torch.empty_like(c)
        run(expected, False)
        rows = int(np.sum(sizes))
        if not torch.equal(c[:rows], expected[:rows]):
            print("  MISMATCH: dynamic tile claims differ from the strided walk")
    return time_ms(lambda: run(c, dynamic), 5, 3)


def main() -> None:
    bandwidth = copy_gbps(torch) / 2  # read bytes per second: half of read + write
    total = TOKENS * TOP_K
    print(f"{torch.cuda.get_device_name()}: grouped GEMM probe, {total} rows, TFLOP/s")
    for groups, k, n in CASES:
        a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * total * n * k
        dense_b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        c = torch.empty(total, n, device="cuda", dtype=torch.bfloat16)
        config = grouped_config(groups)
        dense = time_ms(lambda: run_hopper(a, dense_b, c, total, n, k, dtype="bf16",
                                           b_major="mn", target="sm_90a", config=config), 5, 3)
        each = total // groups
        sizes = moe_sizes(groups, total)
        print(f"G={groups} K={k} N={n}: sizes {sizes.min()}..{sizes.max()}, weights-read floor "
              f"{groups * k * n * 2 / bandwidth / 1e6:.2f} ms, dense {dense:.2f} ms "
              f"({flops / dense / 1e9:.1f} TFLOP/s)", flush=True)
        cases = [("ragged", sizes, None, False), ("ragged dynamic", sizes, None, True),
                 ("uniform", [each] * groups, None, False),
                 ("uniform -64", [each - 64] * groups, None, False),
                 ("uniform -64 dynamic", [each - 64] * groups, None, True),
                 ("uniform -32", [each - 32] * groups, None, False),
                 ("grouped G=1", [total], None, False)]
        cases += [(f"ragged {cfg.block_m}x{cfg.block_n}{' dynamic' * dynamic}", sizes, cfg,
                   dynamic) for cfg in GROUPED_CONFIGS if cfg != config
                  for dynamic in (False, True)]
        for name, group_sizes, cfg, dynamic in cases:  # printed as measured
            ms = grouped_ms(a, group_sizes, k, n, cfg, dynamic)
            tflops = 2.0 * int(np.sum(group_sizes)) * n * k / ms / 1e9
            print(f"  {name:>22} {tflops:7.1f} TFLOP/s  {ms:7.3f} ms  "
                  f"vs dense {tflops / (flops / dense / 1e9):.3f}", flush=True)


if __name__ == "__main__":
    main()
