"""Traced values: operators, promotion, casts, math and ids."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.core import dtypes as dt
from kiln import bf16, f16, f32, i8, i32, i64


def body_ir(fn, *arrays, **kw) -> str:
    """Trace ``fn`` as a kernel taking ``arrays`` and return the module text."""
    return kiln.kernel(fn).trace(*arrays, **kw).module_asm


F32 = np.zeros(4, np.float32)


@pytest.mark.parametrize("expr, op", [
    (lambda a, b: a + b, "arith.addf"), (lambda a, b: a - b, "arith.subf"),
    (lambda a, b: a * b, "arith.mulf"), (lambda a, b: a / b, "arith.divf"),
    (lambda a, b: a % b, "arith.remf"), (lambda a, b: a // b, "math.floor"),
    (lambda a, b: kiln.maximum(a, b), "arith.maximumf"),
    (lambda a, b: kiln.minimum(a, b), "arith.minimumf"),
    (lambda a, b: kiln.fma(a, b, a), "math.fma"),
])
def test_float_binary_ops(expr, op):
    def k(x: kiln.Tensor[f32]):
        x[0] = expr(x[1], x[2])

    assert op in body_ir(k, F32)


@pytest.mark.parametrize("expr, op", [
    (lambda a, b: a + b, "arith.addi"), (lambda a, b: a // b, "arith.divsi"),
    (lambda a, b: a % b, "arith.remsi"), (lambda a, b: a & b, "arith.andi"),
    (lambda a, b: a | b, "arith.ori"), (lambda a, b: a ^ b, "arith.xori"),
    (lambda a, b: a << b, "arith.shli"), (lambda a, b: a >> b, "arith.shrsi"),
    (lambda a, b: ~a, "arith.xori"), (lambda a, b: -a, "arith.subi"),
    (lambda a, b: abs(a), "math.absi"), (lambda a, b: a ** 3, "arith.muli"),
])
def test_integer_ops(expr, op):
    def k(x: kiln.Tensor[i32]):
        x[0] = expr(x[1], x[2])

    assert op in body_ir(k, np.zeros(4, np.int32))


def test_int_true_division_gives_f32():
    def k(x: kiln.Tensor[i32], y: kiln.Tensor[f32]):
        y[0] = x[0] / x[1]

    asm = body_ir(k, np.zeros(2, np.int32), F32)
    assert "arith.sitofp" in asm and "arith.divf" in asm


@pytest.mark.parametrize("op, pred", [("lt", "olt"), ("ge", "oge"), ("eq", "oeq"), ("ne", "une")])
def test_float_comparisons(op, pred):
    def k(x: kiln.Tensor[f32]):
        c = getattr(x[0], f"__{op}__")(x[1])
        x[2] = kiln.where(c, 1.0, 0.0)

    asm = body_ir(k, F32)
    assert f"arith.cmpf {pred}" in asm and "arith.select" in asm


def test_int_compare_is_signed():
    def k(x: kiln.Tensor[i32]):
        x[0] = kiln.where(x[1] < x[2], 1, 0)

    assert "arith.cmpi slt" in body_ir(k, np.zeros(3, np.int32))


def test_literal_is_weak_and_takes_value_dtype():
    def k(x: kiln.Tensor[f16]):
        x[0] = x[1] * 2.0 + 1

    asm = body_ir(k, np.zeros(2, np.float16))
    assert "arith.mulf" in asm and ": f16" in asm and "arith.extf" not in asm


def test_pow_needs_constant_int_exponent():
    def k(x: kiln.Tensor[f32]):
        x[0] = x[1] ** 0.5

    with pytest.raises(kiln.UnsupportedError, match="exponent"):
        body_ir(k, F32)


@pytest.mark.parametrize("fn, op", [(kiln.exp2, "math.exp2"), (kiln.log2, "math.log2"),
                                    (kiln.exp, "math.exp"), (kiln.log, "math.log"),
                                    (kiln.sqrt, "math.sqrt"), (kiln.rsqrt, "math.rsqrt"),
                                    (kiln.rcp, "arith.divf"), (kiln.abs, "math.absf")])
def test_math_functions(fn, op):
    def k(x: kiln.Tensor[f32]):
        x[0] = fn(x[1])

    assert op in body_ir(k, F32)


def test_approximate_reciprocal_is_an_afn_divide():
    def k(x: kiln.Tensor[f32]):
        x[0] = kiln.rcp(x[1], approx=True) + kiln.rcp(x[2])

    text = body_ir(k, F32)
    assert text.count("arith.divf") == 2 and text.count("fastmath<afn>") == 1

    def bad(x: kiln.Tensor[f32]):
        x[0] = kiln.rcp(x[1], approx="yes")

    with pytest.raises(kiln.KilnTypeError, match="approx= must be a bool"):
        body_ir(bad, F32)


@pytest.mark.parametrize("src, dst, op", [
    (i32, i64, "arith.extsi"), (i64, i32, "arith.trunci"), (i32, f32, "arith.sitofp"),
    (f32, i32, "arith.fptosi"), (f16, f32, "arith.extf"), (f32, bf16, "arith.truncf"),
    (i32, dt.index, "arith.index_cast"), (f16, bf16, "arith.truncf"),
])
def test_cast_ops(src, dst, op):
    def k(x: kiln.Tensor[src], y: kiln.Tensor[i8]):
        v = kiln.cast(x[0], dst)
        y[0] = kiln.cast(v, i8)

    assert op in body_ir(k, np.zeros(2, src.numpy), np.zeros(2, np.int8))


def test_ids_and_block_dim_constant():
    def k(x: kiln.Tensor[i32]):
        x[0] = kiln.block_id(1) + kiln.thread_id(0) + kiln.num_blocks(2) + kiln.block_dim(0)
        kiln.barrier()

    asm = body_ir(k, np.zeros(2, np.int32), num_warps=2)
    assert "gpu.block_id  y" in asm and "gpu.thread_id  x" in asm and "gpu.grid_dim  z" in asm
    assert "gpu.block_dim" not in asm and "arith.constant 64 : i32" in asm
    assert "gpu.barrier" in asm


def test_bad_dimension_is_value_error():
    def k(x: kiln.Tensor[i32]):
        x[0] = kiln.thread_id(3)

    with pytest.raises(kiln.KilnValueError, match="dimension 3"):
        body_ir(k, np.zeros(2, np.int32))


_NUMERIC = [dt.i8, dt.i16, dt.i32, dt.i64, dt.f16, dt.f32, dt.f64]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_NUMERIC), st.sampled_from(_NUMERIC))
def test_promotion_matches_numpy_where_numpy_is_sensible(a, b):
    """Kiln's table equals numpy's result_type except where numpy widens past both inputs
    (int + float16 -> float64-ish) and Kiln keeps the float operand's dtype."""
    got = dt.promote(a, b)
    expected = np.result_type(a.numpy, b.numpy)
    if a.is_float != b.is_float:
        assert got is (a if a.is_float else b)
    else:
        assert got.numpy == expected


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(_NUMERIC), st.sampled_from(_NUMERIC))
def test_traced_add_has_promoted_dtype(a, b):
    seen = []

    def k(x: kiln.Tensor[a], y: kiln.Tensor[b]):
        seen.append((x[0] + y[0]).dtype)

    body_ir(k, np.zeros(1, a.numpy), np.zeros(1, b.numpy))
    assert seen == [dt.promote(a, b)]


def test_vector_ops_broadcast_scalars():
    seen = []

    def k(x: kiln.Tensor[f32]):
        v = x.load(0, width=4) * 2.0 + x[0]
        seen.append(v.shape)
        x.store(0, v)

    asm = body_ir(k, F32)
    assert seen == [(4,)]
    assert "vector.load" in asm and "vector.broadcast" in asm and "vector.store" in asm


def test_value_rejects_non_numeric_mlir_types():
    from mlir.dialects import llvm

    def k(x: kiln.Tensor[f32]):
        null = llvm.mlir_zero(llvm.PointerType.get())
        assert isinstance(kiln.Value(x[0].ir), kiln.Value)
        kiln.Value(null)

    with pytest.raises(kiln.KilnTypeError, match="not !llvm.ptr") as info:
        body_ir(k, F32)
    assert "Handle" in info.value.fix


def test_constants_are_found_by_their_python_number():
    """A constant is looked up by its Python number before its attribute is made: 0.0 and -0.0
    stay two constants, 1 and 1.0 as f32 (one attribute) one, True next to an i1 one."""
    def k(x: kiln.Tensor[f32], m: kiln.Tensor[i32]):
        v = x[0]
        x[1] = v * 0.0 + v * -0.0 + v * 0.0
        x[2] = kiln.cast(1, f32) + kiln.cast(1.0, f32) + v * 1
        m[0] = kiln.cast((m[1] > 0) & True, i32) + 1
    asm = body_ir(k, F32, np.zeros(4, np.int32))
    constants = [line.split("=", 1)[1].split(" loc(")[0].strip() for line in asm.splitlines()
                 if "arith.constant" in line]
    assert constants.count("arith.constant 0.000000e+00 : f32") == 1
    assert constants.count("arith.constant -0.000000e+00 : f32") == 1
    assert constants.count("arith.constant 1.000000e+00 : f32") == 1
    assert len(constants) == len(set(constants))  # each distinct constant made once


def test_generic_op_and_known_match_the_generated_builders():
    """``values.generic_op`` builds the op the generated builder builds (generic form with its
    properties); ``values.known`` gives the Value ``Value(...)`` gives."""
    from mlir import ir
    from mlir.dialects import arith

    from kiln.values import Value, generic_op, known

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            f32_type = ir.VectorType.get([4], ir.F32Type.get())
            a = arith.constant(f32_type, ir.DenseElementsAttr.get_splat(
                f32_type, ir.FloatAttr.get(ir.F32Type.get(), 2.5)))
            generated, generic = arith.addf(a, a), generic_op("arith.addf", a.type, a, a)
            cmp = arith.cmpf(arith.CmpFPredicate.OLT, a, a)
            i64 = ir.IntegerType.get_signless(64)
            cmp_generic = generic_op("arith.cmpf", cmp.type, a, a, attributes={
                "predicate": ir.IntegerAttr.get(i64, int(arith.CmpFPredicate.OLT))})
        ops = [line.split("=", 1)[1] for line in
               module.operation.get_asm(print_generic_op_form=True).splitlines() if "=" in line]
        assert ops[1] == ops[2] and ops[3] == ops[4] and "predicate = 4" in ops[3]
        made, wrapped = known(generic, kiln.f32, (4,)), Value(generated)
        assert (made.dtype, made.shape) == (wrapped.dtype, wrapped.shape) == (kiln.f32, (4,))
