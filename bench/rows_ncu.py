"""One launch each of the long-row softmax / layer-norm kernels for ncu (``-k
regex:softmax|layernorm``): the tutorials at ``--cols`` and rows_variants' ring kernels.

Usage: ``ncu --clock-control none --section SpeedOfLight -k regex:'softmax|layernorm' python
bench/rows_ncu.py --cols 32768``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tutorials import fused_softmax, layernorm  # noqa: E402
import rows_variants  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", default="32768", help="comma-separated column counts")
    parser.add_argument("--chunk", type=int, default=4096)
    args = parser.parse_args()
    import torch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in map(int, args.cols.split(",")):
        m = (1 << 24) // n
        x = torch.randn(m, n, device="cuda")
        y = torch.empty_like(x)
        w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        g = min(m, sms)
        print(f"{m}x{n}: softmax, softmax_ring, layernorm, layernorm_ring", flush=True)
        fused_softmax.softmax(x, y)
        rows_variants.softmax_ring[(g,)](x, y, m, n, g, BLOCK=n, CHUNK=args.chunk,
                                         THREADS=512, ALIGN=16)
        layernorm.layernorm(x, w, b, y, mean, rstd)
        rows_variants.layernorm_ring[(g,)](x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=n,
                                           CHUNK=args.chunk, THREADS=512, ALIGN=16, ONEPASS=0)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
