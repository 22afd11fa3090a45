"""``kiln-fold-block-dim``: replace ``gpu.block_dim`` with constants from ``known_block_size``.

Kiln's block size is a compile-time constant, and on AMD ``gpu.block_dim`` lowers to a call
into the device library (``__ockl_get_local_size``) that Kiln does not link. Folding it also
lets canonicalization simplify index arithmetic on NVIDIA.

Example (``kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-fold-block-dim)'``)::

    gpu.func @k() kernel attributes {known_block_size = array<i32: 128, 1, 1>} {
      %0 = gpu.block_dim x          // becomes: %0 = arith.constant 128 : index
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith

from kiln.passes import register_pass
from kiln.passes.enclosing import enclosing_gpu_func

NAME = "kiln-fold-block-dim"
_DIMENSIONS = {"x": 0, "y": 1, "z": 2}


def _dimension_index(block_dim: ir.Operation) -> int:
    # Printed form is "#gpu<dim x>"; the enum has no typed Python accessor.
    return _DIMENSIONS[str(block_dim.attributes["dimension"]).rstrip(">").split()[-1]]


def fold_block_dim(op: ir.Operation, pass_=None) -> None:
    """Rewrite every ``gpu.block_dim`` inside a ``gpu.func`` that has ``known_block_size``."""
    block_dims: list[ir.Operation] = []

    def collect(candidate: ir.Operation):
        if candidate.name == "gpu.block_dim":
            block_dims.append(candidate)
        return ir.WalkResult.ADVANCE

    op.walk(collect, ir.WalkOrder.PRE_ORDER)
    for block_dim in block_dims:  # rewritten after the walk: erasing while walking is unsafe
        func = enclosing_gpu_func(block_dim)
        if func is None or "known_block_size" not in func.attributes:
            continue
        sizes = ir.DenseI32ArrayAttr(func.attributes["known_block_size"])
        size = sizes[_dimension_index(block_dim)]
        with ir.InsertionPoint(block_dim), block_dim.location:
            constant = arith.ConstantOp(ir.IndexType.get(), size)
        block_dim.result.replace_all_uses_with(constant.result)
        block_dim.erase()


register_pass(NAME, fold_block_dim,
              "Replace gpu.block_dim with arith.constant from the gpu.func's known_block_size")
