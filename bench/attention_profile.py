"""One launch of the attention tutorial's kernel at bf16 ``[4, 4096, 16, 128]`` (after a
warm-up) for a profiler: ``ncu --section SpeedOfLight --section WarpStateStats -k
regex:attention_kernel -s 1 -c 1 python bench/attention_profile.py [BM,BN,WARPS,STAGES]
[--causal]``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "tutorials"))
import attention  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    block = tuple(int(x) for x in args[0].split(",")) if args else None
    batch, seq, heads, d = 4, 4096, 16, 128
    q, k, v = (torch.randn(batch * seq, heads * d, device="cuda").to(torch.bfloat16)
               for _ in range(3))
    o = torch.empty_like(q)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
    for _ in range(2):   # the first launch compiles; ncu -s 1 skips it
        attention.attention(q, k, v, o, cu, seq, heads, causal="--causal" in sys.argv,
                            block=block)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
