"""MLIR LLVM-dialect device code -> LLVM IR text, in-process (no ``mlir-translate``)."""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm

from kiln.core.errors import CompilationError, InternalError, source_loc_from_mlir

# Dialects LLVM IR translation understands. The binding crashes the process (null module) on
# anything else, so such ops are reported before translating.
TRANSLATABLE_DIALECTS = ("builtin", "llvm", "nvvm", "rocdl")


def device_module(module: ir.Module) -> ir.Operation:
    """The single ``gpu.module`` of a Kiln module."""
    for op in module.body.operations:
        if op.operation.name == "gpu.module":
            return op.operation
    raise InternalError("no gpu.module in the kernel module")


def device_llvm_ir(module: ir.Module, triple: str) -> str:
    """LLVM IR of the (already LLVM-dialect) ``gpu.module`` body, for ``triple``.

    The body is cloned into a plain module because translation expects a ``builtin.module``;
    the gpu.module's data layout, when it has one, is carried over.
    """
    return translate(device_llvm_module(module, triple))


def translate(inner: ir.Module) -> str:
    """LLVM IR text of a module :func:`device_llvm_module` made."""
    return str(llvm.translate_module_to_llvmir(inner.operation))


def device_llvm_module(module: ir.Module, triple: str) -> ir.Module:
    """The ``gpu.module`` body cloned into a checked, translatable ``builtin.module`` (a copy
    :func:`translate` may turn into text later, while ``module`` is lowered further)."""
    gpu_module = device_module(module)
    with ir.Location.unknown(module.context):
        inner = ir.Module.create()
    inner.operation.attributes["llvm.target_triple"] = ir.StringAttr.get(triple)
    if "llvm.data_layout" in gpu_module.attributes:
        inner.operation.attributes["llvm.data_layout"] = gpu_module.attributes["llvm.data_layout"]
    with ir.InsertionPoint(inner.body):
        for op in gpu_module.regions[0].blocks[0].operations:
            op.operation.clone()
    _check_translatable(inner)
    return inner


def _check_translatable(module: ir.Module) -> None:
    leftovers: list[ir.Operation] = []

    def visit(op: ir.Operation):
        if op.name.split(".")[0] not in TRANSLATABLE_DIALECTS and not leftovers:
            leftovers.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if leftovers:
        op = leftovers[0]
        raise CompilationError(
            f"'{op.name}' was not lowered to the LLVM dialect, so the kernel cannot become LLVM IR",
            fix="this op is not supported on this target; rewrite that line with supported "
                "operations, or report a Kiln bug with KILN_DUMP_DIR's files",
            loc=source_loc_from_mlir(op.location))
