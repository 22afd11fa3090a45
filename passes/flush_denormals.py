"""``kiln-flush-f32-denormals``: f32 arithmetic that flushes denormals to zero (NVIDIA).

What ``nvcc -ftz=true`` does, for kernels declared ``@kiln.kernel(flush_denormals=True)``:

- every ``llvm.func`` gets ``denormal_fp_math_f32 = "preserve-sign"``, so the NVPTX backend
  emits the ``.ftz`` forms of f32 ``add``/``mul``/``fma``/``max``;
- every ``gpu.module`` gets the module flag ``nvvm-reflect-ftz = 1``, so the libdevice
  functions that ``math`` ops lower to take their flushing paths: ``__nv_exp2f`` becomes the
  single instruction ``ex2.approx.ftz.f32`` instead of ``ex2.approx.f32``, which ptxas wraps
  in a range check and two multiplies to keep denormal results. An attention softmax is
  ``exp2``-bound: +4-5% for the Hopper prefill on an H200.

Results differ only where an input or result is below 2**-126 (it becomes 0).

Example (``kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-flush-f32-denormals)'``)::

    gpu.module @kiln_kernels {
      llvm.func @k() ...
    // becomes
    gpu.module @kiln_kernels {
      llvm.module_flags [#llvm.mlir.module_flag<override, "nvvm-reflect-ftz", 1 : i32>]
      llvm.func @k() attributes {denormal_fp_math_f32 = "preserve-sign", ...} ...
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm

from kiln.passes import register_pass

NAME = "kiln-flush-f32-denormals"
REFLECT_FTZ = '#llvm.mlir.module_flag<override, "nvvm-reflect-ftz", 1 : i32>'


def flush_f32_denormals(op: ir.Operation, pass_=None) -> None:
    """Mark every LLVM function preserve-sign for f32 and every GPU module reflect-ftz."""
    functions, modules = [], []

    def collect(candidate: ir.Operation):
        if candidate.name == "llvm.func":
            functions.append(candidate)
            return ir.WalkResult.SKIP  # a function body holds no functions or modules
        if candidate.name == "gpu.module":
            modules.append(candidate)
        return ir.WalkResult.ADVANCE

    op.walk(collect, ir.WalkOrder.PRE_ORDER)
    for function in functions:
        function.attributes["denormal_fp_math_f32"] = ir.StringAttr.get("preserve-sign")
    flag = ir.Attribute.parse(REFLECT_FTZ)
    for module in modules:
        body = module.regions[0].blocks[0]
        existing = [inner.operation for inner in body.operations
                    if inner.operation.name == "llvm.module_flags"]
        if existing:  # one llvm.module_flags op per module: extend it
            flags = list(ir.ArrayAttr(existing[0].attributes["flags"]))
            if flag not in flags:
                existing[0].attributes["flags"] = ir.ArrayAttr.get(flags + [flag])
            continue
        with ir.InsertionPoint.at_block_begin(body), module.location:
            llvm.module_flags(ir.ArrayAttr.get([flag]))


register_pass(NAME, flush_f32_denormals,
              "f32 denormals flush to zero: preserve-sign functions, libdevice reflect-ftz")
