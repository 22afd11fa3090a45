"""Opcode counts of the matmul A/B variants' SASS (cuobjdump on the device machine): MUFU,
CALL (rcp.rn's slow path), HGMMA, LDGSTS, global/shared loads and stores, BAR.

Run: ``python bench/sass_summary.py [--dump DIR]`` (with ``--dump`` each variant's SASS is
written there).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matmul_epilogue_ab as ab  # noqa: E402

KEYS = ("MUFU", "CALL", "BSSY", "HGMMA", "LDGSTS", "LDG", "STG", "STS", "LDS", "BAR", "WARPSYNC")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args()
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    for name in ab.VARIANTS:
        cfg, opts = ab.config(name)
        ck = ab.ab_kernel.compile(a, a, np.zeros(256, np.float32), a, 256, 256, 256, **cfg,
                                  **opts, target="sm_90a")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True,
                                  text=True, check=True).stdout
        ops = collections.Counter(m.group(1).split(".")[0] for m in
                                  re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                                              sass))
        total = sum(ops.values())
        print(f"sass {name:18s} regs {ck.metadata['registers']} spill "
              f"{ck.metadata['spill_bytes']} total {total:5d} " +
              " ".join(f"{k} {ops.get(k, 0)}" for k in KEYS), flush=True)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name.replace(' ', '_')}.sass").write_text(sass)


if __name__ == "__main__":
    main()
