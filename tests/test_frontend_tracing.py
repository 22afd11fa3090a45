"""Tracing core: binding, specialisation, the gpu.func that comes out, locations."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import f16, f32, i32


@kiln.kernel
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]  # @saxpy-store


X = np.zeros(64, np.float32)


def test_saxpy_module_structure_and_verifies():
    t = saxpy.trace(X, X, 64, 2.0, BLOCK=256, target="sm_90a", num_warps=8)
    asm = t.module_asm
    assert "module attributes {gpu.container_module}" in asm
    assert "gpu.module @kiln_kernels" in asm
    assert "gpu.func @saxpy(" in asm and " kernel " in asm
    assert "known_block_size = array<i32: 256, 1, 1>" in asm
    assert asm.count("memref<?xf32, strided<[1], offset: ?>, 1>") >= 2
    assert "arith.constant 256 : i32" in asm  # BLOCK baked in
    assert "scf.if" in asm and "memref.store" in asm
    with ir.Context():
        ir.Module.parse(asm).operation.verify()


def test_locations_point_at_user_lines(marker_line):
    asm = saxpy.trace(X, X, 64, 2.0, BLOCK=128).module_asm
    assert f'loc("{__file__}":{marker_line("@saxpy-store")}:' in asm


def test_signature_drops_constexprs_and_records_block():
    sig = saxpy.trace(X, X, 64, 2.0, BLOCK=128, num_warps=2, target="gfx950").signature
    assert [p.name for p in sig.params] == ["x", "y", "n", "a"]
    assert [type(p).__name__ for p in sig.params] == ["TensorParam"] * 2 + ["ScalarParam"] * 2
    assert sig.block == (128, 1, 1)  # 2 warps of 64 lanes on AMD
    assert sig.constexprs == (("BLOCK", "128"),)


def test_default_target_is_sm90a_and_settable():
    asm = saxpy.trace(X, X, 1, 1.0, BLOCK=1).module_asm
    assert "known_block_size = array<i32: 128, 1, 1>" in asm
    kiln.set_default_target("gfx942")
    try:
        assert "array<i32: 256, 1, 1>" in saxpy.trace(X, X, 1, 1.0, BLOCK=1).module_asm
    finally:
        kiln.set_default_target("sm_90a")


def test_constexpr_values_specialise():
    a = saxpy.trace(X, X, 1, 1.0, BLOCK=64).module_asm
    b = saxpy.trace(X, X, 1, 1.0, BLOCK=32).module_asm
    assert "arith.constant 64 : i32" in a and "arith.constant 32 : i32" in b


def test_unannotated_arguments_are_inferred():
    @kiln.kernel
    def fill(out, value, count, flag):
        if flag:
            out[kiln.thread_id(0)] = kiln.cast(value + kiln.cast(count, f32), f16)

    sig = fill.trace(np.zeros((4,), np.float16), 1.5, 3, True).signature
    assert [(p.name, p.dtype) for p in sig.params] == [
        ("out", "f16"), ("value", "f32"), ("count", "i32"), ("flag", "i1")]


def test_non_contiguous_tensor_gets_dynamic_inner_stride():
    @kiln.kernel
    def copy(src: kiln.Tensor[f32, 2], dst: kiln.Tensor[f32, 2]):
        dst[0, 0] = src[0, 0]

    base = np.zeros((4, 8), np.float32)
    asm = copy.trace(base[:, ::2], base).module_asm
    assert "memref<?x?xf32, strided<[?, ?], offset: ?>, 1>" in asm
    assert "memref<?x?xf32, strided<[?, 1], offset: ?>, 1>" in asm


def test_argument_dtype_mismatch_names_parameter_and_call_site(marker_line):
    with pytest.raises(kiln.KilnTypeError) as info:
        saxpy.trace(X.astype(np.float16), X, 1, 1.0, BLOCK=1)  # @bad-arg
    err = info.value
    assert "argument 'x'" in err.message and "Tensor[f32]" in err.message and "f16" in err.message
    assert err.fix and "Fix:" in str(err)
    assert err.loc.line == marker_line("@bad-arg")


def test_float_for_int_scalar_is_rejected():
    with pytest.raises(kiln.KilnTypeError, match="argument 'n'.*declared i32"):
        saxpy.trace(X, X, 2.5, 1.0, BLOCK=1)


def test_rank_annotation_is_checked():
    @kiln.kernel
    def k(m: kiln.Tensor[f16, 2]):
        pass

    with pytest.raises(kiln.KilnTypeError, match="rank 2 but got rank 1"):
        k.trace(np.zeros(3, np.float16))


def test_wrong_argument_count_is_a_kiln_error():
    with pytest.raises(kiln.KilnTypeError, match="bad arguments for kernel saxpy"):
        saxpy.trace(X, X, BLOCK=1)


def test_kernel_cannot_return_a_value():
    @kiln.kernel
    def bad(x: kiln.Tensor[f32]):
        return x[0]

    with pytest.raises(kiln.KilnTypeError, match="cannot return values"):
        bad.trace(X)


def test_unknown_target_is_target_error(marker_line):
    with pytest.raises(kiln.TargetError) as info:
        saxpy.trace(X, X, 1, 1.0, BLOCK=1, target="sm_12")  # @bad-target
    assert "unknown target 'sm_12'" in info.value.message and "sm_90a" in info.value.fix
    assert info.value.loc.line == marker_line("@bad-target")


def test_kiln_func_helpers_are_inlined_and_rewritten():
    @kiln.func
    def clamp_positive(v):
        if v < 0.0:
            v = 0.0
        return v

    @kiln.kernel
    def relu(x: kiln.Tensor[f32]):
        i = kiln.thread_id(0)
        x[i] = clamp_positive(x[i])

    asm = relu.trace(X).module_asm
    assert "scf.if" in asm and "-> (f32)" in asm
    assert "func.call" not in asm


def test_kiln_func_outside_a_kernel_is_an_error():
    @kiln.func
    def helper():
        return 1

    with pytest.raises(kiln.KilnValueError, match="inside a @kiln.kernel"):
        helper()


def test_tensormap_parameter_is_a_pointer_viewed_as_descriptor():
    seen = []

    @kiln.kernel
    def tma(a: kiln.TensorMap[f16, (64, 32), 128]):
        seen.append(a)

    t = tma.trace(np.zeros((128, 64), np.float16))
    assert "gpu.func @tma(%arg0: !llvm.ptr" in t.module_asm
    assert ("!nvgpu.tensormap.descriptor<tensor = memref<64x32xf16, 3>, swizzle = swizzle_128b, "
            "l2promo = none, oob = zero, interleave = none>") in t.module_asm
    assert (seen[0].box, seen[0].swizzle, seen[0].dtype) == ((64, 32), 128, f16)
    p = t.signature.params[0]
    assert (type(p).__name__, p.box, p.swizzle, p.rank) == ("TensorMapParam", (64, 32), 128, 2)


def test_tensormap_box_rank_must_match_tensor():
    @kiln.kernel
    def tma(a: kiln.TensorMap[f16, (64,), 0]):
        pass

    with pytest.raises(kiln.KilnTypeError, match="box"):
        tma.trace(np.zeros((128, 64), np.float16))


def test_current_target_inside_kernel():
    seen = []

    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        seen.append(kiln.current_target().name)
        x[0] = kiln.cast(kiln.lane_id() + kiln.warp_id(), f32)

    asm = k.trace(X, target="gfx942").module_asm
    assert seen == ["gfx942"]
    assert "arith.constant 64 : i32" in asm  # wavefront size used by lane_id / warp_id
