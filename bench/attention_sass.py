"""Dump the SASS of the attention tutorial's kernel (sm_90a, D 128) for one block config:
``python bench/attention_sass.py BM,BN,WARPS CAUSAL OUT.sass`` (needs cuobjdump). Prints the
instruction mix of the hottest loop (the longest basic-block run between a label and its
backward branch) so register spills (STL/LDL) and per-step overheads show in one line each."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "tutorials"))
import attention  # noqa: E402


def main() -> None:
    block = tuple(int(x) for x in sys.argv[1].split(","))
    causal = sys.argv[2] == "1"
    x = np.zeros((256, 256), ml_dtypes.bfloat16)
    ck = attention.attention_kernel.compile(x, x, x, x, np.array([0, 256], np.int32), 1.0,
                                            CAUSAL=causal, ALIGN=16,
                                            **attention.config(128, "sm_90a", block),
                                            target="sm_90a")
    print(block, causal, {k: ck.metadata.get(k) for k in ("registers", "spill_bytes",
                                                         "wgmma_serialized")})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    Path(sys.argv[3]).write_text(sass)
    ops = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    counts = collections.Counter(op.split(".")[0] for _, _, op in ops)
    print(f"  {len(ops)} instructions; " + ", ".join(f"{k} {v}" for k, v in
                                                     counts.most_common(24)))


if __name__ == "__main__":
    main()
