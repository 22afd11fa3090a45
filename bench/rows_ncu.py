"""One launch each of the softmax / layer-norm tutorials at long rows, for ncu (``-k
regex:softmax|layernorm``): the tutorials of ``--candidate`` folders first (e.g. an earlier
commit's, for a side-by-side profile), then this tree's, then (``--tma``) rows_variants'
softmax and layer norm whose rows are copied by TMA boxes, then (``--pipe``) its pipelined
softmax and layer norm (the next row read between this row's stores).

Usage: ``ncu --clock-control none --section SpeedOfLight -k regex:'softmax|layernorm' python
bench/rows_ncu.py --cols 32768,16384 --candidate /tmp/base``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tutorials import fused_softmax, layernorm  # noqa: E402
from tutorials_rows import _load  # noqa: E402
import rows_variants  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", default="32768", help="comma-separated column counts")
    parser.add_argument("--candidate", action="append", default=[],
                        help="a folder with a fused_softmax.py and a layernorm.py (repeatable)")
    parser.add_argument("--tma", action="store_true", help="also the TMA-box variants")
    parser.add_argument("--pipe", action="store_true", help="also the pipelined variants")
    args = parser.parse_args()
    import torch
    trees = [(Path(f).name, _load(Path(f) / "fused_softmax.py"), _load(Path(f) / "layernorm.py"))
             for f in args.candidate] + [("this tree", fused_softmax, layernorm)]
    for n in map(int, args.cols.split(",")):
        m = (1 << 24) // n
        x = torch.randn(m, n, device="cuda")
        y = torch.empty_like(x)
        w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        for name, softmax, norm in trees:
            print(f"{m}x{n} {name}: softmax, layernorm", flush=True)
            softmax.softmax(x, y)
            norm.layernorm(x, w, b, y, mean, rstd)
        if args.tma:
            g = min(m, torch.cuda.get_device_properties(0).multi_processor_count)
            print(f"{m}x{n} TMA boxes: softmax_tma, layernorm_ring", flush=True)
            rows_variants.softmax_tma[(g,)](x, x.view(-1, 256), y, m, n, g, BLOCK=n,
                                            CHUNK=4096, THREADS=512)
            rows_variants.layernorm_ring[(g,)](x, x.view(-1, 256), w.view(1, n), b.view(1, n),
                                               y, mean, rstd, m, n, g, 1e-5, BLOCK=n,
                                               CHUNK=4096, THREADS=512, ALIGN=16, ONEPASS=0,
                                               TMA=1)
        if args.pipe:
            g = min(m, torch.cuda.get_device_properties(0).multi_processor_count)
            print(f"{m}x{n} pipelined: softmax_pipe, layernorm_pipe", flush=True)
            rows_variants.softmax_pipe[(g,)](x, y, m, n, g, BLOCK=n, CHUNK=4096, THREADS=512)
            rows_variants.layernorm_pipe[(g,)](x, w, b, y, mean, rstd, m, n, g, 1e-5, BLOCK=n,
                                               CHUNK=4096, THREADS=512)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
