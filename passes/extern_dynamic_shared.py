"""``kiln-extern-dynamic-shared``: make the dynamic shared-memory symbol an external declaration.

``convert-gpu-to-nvvm`` / ``convert-gpu-to-rocdl`` lower ``gpu.dynamic_shared_memory`` to an
*internal* zero-sized global. The backends then emit it as an ordinary static variable
(NVPTX: ``.shared .align 16 .b8 __dynamic_shmem__0;``, one byte), and ptxas is free to place
the kernel's other static shared buffers (``kiln.shared`` tiles, mbarriers) after it — inside
the bytes the kernel addresses as its dynamic region. On an H200 a 4 KB ``kiln.shared`` tile
was overwritten completely by writes to a ``kiln.dynamic_shared`` buffer declared after it.
An external zero-sized array is what CUDA's ``extern __shared__`` and HIP's dynamic LDS
compile to (``.extern .shared .align 16 .b8 __dynamic_shmem__0[];``): the driver places it
after all static shared memory.

Example (``kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-extern-dynamic-shared)'``)::

    llvm.mlir.global internal @__dynamic_shmem__0() {addr_space = 3 : i32, alignment = 16 : i64}
        : !llvm.array<0 x i8>
    // becomes
    llvm.mlir.global external @__dynamic_shmem__0() {addr_space = 3 : i32, alignment = 16 : i64}
        : !llvm.array<0 x i8>
"""

from __future__ import annotations

from mlir import ir

from kiln.passes import register_pass

NAME = "kiln-extern-dynamic-shared"
SYMBOL_PREFIX = "__dynamic_shmem__"  # upstream's name for the lowered gpu.dynamic_shared_memory


def extern_dynamic_shared(op: ir.Operation, pass_=None) -> None:
    """Give every lowered dynamic shared-memory global external linkage."""

    def visit(candidate: ir.Operation):
        if candidate.name == "llvm.func":
            return ir.WalkResult.SKIP  # globals sit in modules, never in a function body
        if candidate.name == "llvm.mlir.global" and ir.StringAttr(
                candidate.attributes["sym_name"]).value.startswith(SYMBOL_PREFIX):
            candidate.attributes["linkage"] = ir.Attribute.parse("#llvm.linkage<external>")
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)


register_pass(NAME, extern_dynamic_shared,
              "Give the lowered gpu.dynamic_shared_memory global external linkage, so static "
              "shared buffers are not placed inside the dynamic region")
