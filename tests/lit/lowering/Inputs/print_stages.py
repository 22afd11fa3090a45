"""Compile Inputs/saxpy.mlir for the chips given on the command line and print every stage.

Each stage is printed under a ``// STAGE <chip> <stage>`` header (binary stages as their size),
then ``// METADATA <chip> key=value ...``, so FileCheck can check each one.
"""

import sys
from pathlib import Path

from kiln.lowering.compiler import compile_kernel
from kiln.core.options import CompileOptions
from kiln.signature import KernelSignature, ScalarParam, TensorParam

SIGNATURE = KernelSignature(
    "saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
              ScalarParam("n", "i32"), ScalarParam("a", "f32")), block=(128, 1, 1))
KILN_IR = (Path(__file__).parent / "saxpy.mlir").read_text()

for chip in sys.argv[1:]:
    warps = 128 // (64 if chip.startswith("gfx") else 32)
    kernel = compile_kernel(KILN_IR, SIGNATURE, CompileOptions(chip, num_warps=warps))
    for stage, artifact in kernel.asm.items():
        print(f"// STAGE {chip} {stage}")
        print(f"<{len(artifact)} bytes>" if isinstance(artifact, bytes) else artifact)
    timings = ("compile_ms", "compile_profile")
    fields = " ".join(f"{k}={v}" for k, v in sorted(kernel.metadata.items()) if k not in timings)
    print(f"// METADATA {chip} {fields} stages={','.join(kernel.metadata['compile_ms'])}")
