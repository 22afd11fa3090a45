"""``kiln-scalarize-structs``: wide struct loop values and branch results become scalars, with
the same results (run on the CPU by MLIR's ExecutionEngine before and after the pass), and
narrow or never-rebuilt structs stay whole."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from mlir import ir
from mlir.execution_engine import ExecutionEngine

from kiln.passes import build_pass_manager
from kiln.passes.scalarize_structs import MIN_FIELDS

LOWER = ["convert-scf-to-cf", "convert-arith-to-llvm", "convert-cf-to-llvm",
         "convert-func-to-llvm", "canonicalize", "reconcile-unrealized-casts"]


def _source(fields: int, rebuild: bool = True) -> str:
    """``f(x, n)``: a struct of ``fields`` f32 (field i starts at i), ``n`` times field ``i``
    becomes ``field * x + i``, then under ``x > 0`` each field doubles (both rebuilt by
    insertvalue; without ``rebuild`` the struct passes through both); returns the sum of field i times i + 1."""
    st = f"!llvm.struct<({', '.join(['f32'] * fields)})>"
    lines = [f"func.func @f(%x: f32, %n: index) -> f32 attributes {{llvm.emit_c_interface}} {{",
             "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
             "  %zero = arith.constant 0.0 : f32", f"  %u = llvm.mlir.undef : {st}"]
    prev = "%u"
    for i in range(fields):
        lines += [f"  %i{i} = arith.constant {float(i)} : f32",
                  f"  %s{i} = llvm.insertvalue %i{i}, {prev}[{i}] : {st}"]
        prev = f"%s{i}"
    lines.append(f"  %r = scf.for %k = %c0 to %n step %c1 iter_args(%a = {prev}) -> ({st}) {{")
    prev = "%a"
    if rebuild:
        for i in range(fields):
            lines += [f"    %e{i} = llvm.extractvalue %a[{i}] : {st}",
                      f"    %m{i} = arith.mulf %e{i}, %x : f32",
                      f"    %p{i} = arith.addf %m{i}, %i{i} : f32",
                      f"    %b{i} = llvm.insertvalue %p{i}, {prev}[{i}] : {st}"]
            prev = f"%b{i}"
    lines += [f"    scf.yield {prev} : {st}", "  }",
              "  %pos = arith.cmpf ogt, %x, %zero : f32",
              f"  %t = scf.if %pos -> ({st}) {{"]
    prev = "%r"
    for i in range(fields if rebuild else 0):
        lines += [f"    %g{i} = llvm.extractvalue %r[{i}] : {st}",
                  f"    %d{i} = arith.addf %g{i}, %g{i} : f32",
                  f"    %h{i} = llvm.insertvalue %d{i}, {prev}[{i}] : {st}"]
        prev = f"%h{i}"
    lines += [f"    scf.yield {prev} : {st}", "  } else {", f"    scf.yield %r : {st}", "  }"]
    total = "%zero"
    for i in range(fields):
        lines += [f"  %o{i} = llvm.extractvalue %t[{i}] : {st}",
                  f"  %w{i} = arith.constant {float(i + 1)} : f32",  # a field out of place shows
                  f"  %v{i} = arith.mulf %o{i}, %w{i} : f32",
                  f"  %q{i} = arith.addf {total}, %v{i} : f32"]
        total = f"%q{i}"
    lines += [f"  return {total} : f32", "}"]
    return "module {\n" + "\n".join(lines) + "\n}"


def _scalarize(module: ir.Module) -> None:
    build_pass_manager(["kiln-scalarize-structs"]).run(module.operation)
    module.operation.verify()


def _carried_structs(module: ir.Module) -> int:
    found = []

    def visit(op):
        if op.name in ("scf.for", "scf.if"):
            found.extend(r for r in op.results if "llvm.struct" in str(r.type))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return len(found)


def _run(module: ir.Module, x: float, n: int) -> float:
    build_pass_manager(LOWER).run(module.operation)
    engine = ExecutionEngine(module, opt_level=0)
    result = ctypes.c_float()
    engine.invoke("f", ctypes.pointer(ctypes.c_float(x)), ctypes.pointer(ctypes.c_int64(n)),
                  ctypes.pointer(result))
    return result.value


def _expected(fields: int, x: float, n: int) -> float:
    start = np.arange(fields, dtype=np.float64)
    acc = start.copy()
    for _ in range(n):
        acc = acc * x + start
    return float(((acc * 2 if x > 0 else acc) * (start + 1)).sum())


@pytest.mark.parametrize("x", [0.75, -0.5])
def test_wide_rebuilt_structs_become_scalars_with_the_same_results(x, rng):
    n = int(rng.integers(1, 6))
    with ir.Context():
        before, after = (ir.Module.parse(_source(MIN_FIELDS)) for _ in range(2))
        assert _carried_structs(after) == 2
        _scalarize(after)
        assert _carried_structs(after) == 0
        build_pass_manager(["canonicalize"]).run(after.operation)
        assert "llvm.insertvalue" not in str(after)  # every rebuilt struct folded away
        got, reference = _run(after, x, n), _run(before, x, n)
    assert got == reference
    assert got == pytest.approx(_expected(MIN_FIELDS, x, n), rel=1e-5)


@pytest.mark.parametrize("fields,rebuild", [(MIN_FIELDS - 1, True), (MIN_FIELDS, False)])
def test_narrow_or_untouched_structs_stay_whole(fields, rebuild):
    with ir.Context():
        module = ir.Module.parse(_source(fields, rebuild))
        text = str(module)
        _scalarize(module)
        assert str(module) == text
