"""Tensor parameters and shared memory: loads, stores, shapes, strides, masks, limits."""

import numpy as np
import pytest

import kiln
from kiln import bf16, f16, f32, i32

M = np.zeros((4, 8), np.float32)
V = np.zeros(8, np.float32)


def trace(fn, *args, **kw) -> str:
    return kiln.kernel(fn).trace(*args, **kw).module_asm


def test_2d_load_store_with_index_casts():
    def k(x: kiln.Tensor[f32, 2], r: i32):
        x[r, 1] = x[r, 0]

    asm = trace(k, M, 1)
    assert "memref.load %arg0[" in asm and "memref.store" in asm
    assert "arith.index_cast %arg1 : i32 to index" in asm


def test_shape_and_stride_are_i32_values():
    seen = []

    def k(x: kiln.Tensor[f32, 2], out: kiln.Tensor[i32]):
        rows = x.shape[0]
        stride = x.stride(0)
        seen.append((rows.dtype, stride.dtype))
        out[0] = rows * stride

    asm = trace(k, M, np.zeros(1, np.int32))
    assert seen == [(i32, i32)]
    assert "memref.dim" in asm and "memref.extract_strided_metadata" in asm


def test_masked_load_builds_if_with_other():
    def k(x: kiln.Tensor[f32], n: i32):
        i = kiln.thread_id(0)
        x[0] = x.load(i, mask=i < n, other=-1.0)

    asm = trace(k, V, 3)
    assert "scf.if" in asm and "-> (f32)" in asm and "-1.000000e+00" in asm


def test_masked_load_with_traced_other_and_dtype_check():
    def k(x: kiln.Tensor[f32], h: kiln.Tensor[f16], n: i32):
        i = kiln.thread_id(0)
        x[0] = x.load(i, mask=i < n, other=x[1])

    def bad(x: kiln.Tensor[f32], h: kiln.Tensor[f16], n: i32):
        x[0] = x.load(0, mask=n > 0, other=h[0])

    h = np.zeros(2, np.float16)
    assert "scf.yield" in trace(k, V, h, 3)
    with pytest.raises(kiln.KilnTypeError, match="other= has dtype f16"):
        trace(bad, V, h, 3)


def test_vector_load_store_along_last_dim():
    def k(x: kiln.Tensor[f16, 2]):
        v = x.load(1, 0, width=8)
        x.store(0, 0, v)

    asm = trace(k, np.zeros((2, 8), np.float16))
    assert "vector.load" in asm and "vector<8xf16>" in asm and "vector.store" in asm


def test_vector_width_is_an_int_constexpr_numpy_ints_included():
    def k(x: kiln.Tensor[f32], W: kiln.constexpr):
        x.store(0, x.load(0, width=W))

    assert "vector<4xf32>" in trace(k, V, np.int64(4))  # a width computed with numpy

    def traced_width(x: kiln.Tensor[f32], n: i32):
        x.store(0, x.load(0, width=n))

    with pytest.raises(kiln.KilnValueError, match="width must be a positive int"):
        trace(traced_width, V, 4)


def test_store_wrong_dtype_is_type_error_at_user_line(marker_line):
    def k(x: kiln.Tensor[f32], y: kiln.Tensor[bf16]):
        x[0] = y[0]  # @bad-store

    with pytest.raises(kiln.KilnTypeError) as info:
        trace(k, V, np.zeros(2, np.float32).astype("bfloat16"))
    err = info.value
    assert "cannot store a bf16 value" in err.message
    assert err.fix == "convert first, e.g. kiln.cast(value, kiln.f32)"
    assert err.loc.line == marker_line("@bad-store")
    assert "x[0] = y[0]" in str(err) and "^" in str(err)


def test_store_literal_converts_to_tensor_dtype():
    def k(x: kiln.Tensor[f16]):
        x[0] = 3

    assert "arith.constant 3.000000e+00 : f16" in trace(k, np.zeros(2, np.float16))


def test_wrong_index_count_is_value_error(marker_line):
    def k(x: kiln.Tensor[f32, 2]):
        x[0] = 1.0  # @rank

    with pytest.raises(kiln.KilnValueError, match="rank 2 but was indexed with 1") as info:
        trace(k, M)
    assert info.value.loc.line == marker_line("@rank")


def test_float_index_is_type_error():
    def k(x: kiln.Tensor[f32]):
        x[x[0]] = 1.0

    with pytest.raises(kiln.KilnTypeError, match="scalar integer"):
        trace(k, V)


def test_shared_buffers_are_workgroup_globals():
    def k(x: kiln.Tensor[f32]):
        a = kiln.shared((4, 8), f32)
        b = kiln.shared(16, f16, align=128)
        i = kiln.thread_id(0)
        a[0, i] = x[i]
        kiln.barrier()
        b[i] = kiln.cast(a[0, i], f16)
        assert a.shape == (4, 8)

    asm = trace(k, V)
    assert 'memref.global "private" @kiln_shared : memref<4x8xf32, 3> = uninitialized' in asm
    assert "@kiln_shared_1 : memref<16xf16, 3> = uninitialized {alignment = 128 : i64}" in asm
    assert asm.count("memref.get_global") == 2


def test_shared_over_limit_is_resource_error_at_allocation(marker_line):
    def k(x: kiln.Tensor[f32]):
        kiln.shared((128, 128), f32)
        kiln.shared((128, 128), f32)  # @too-big

    with pytest.raises(kiln.ResourceError) as info:
        trace(k, V, target="gfx942")  # 64 KiB of LDS
    err = info.value
    assert "gfx942 allows 65536" in err.message and err.fix
    assert err.loc.line == marker_line("@too-big")


def test_shared_shape_must_be_static():
    def k(x: kiln.Tensor[f32], n: i32):
        kiln.shared((n,), f32)

    with pytest.raises(kiln.KilnValueError, match="positive Python ints") as info:
        trace(k, V, 4)
    assert info.value.fix and info.value.loc.line == k.__code__.co_firstlineno + 1


def test_atomics_and_fence_emit_atomic_rmw_and_llvm_fence():
    def k(x: kiln.Tensor[f32], c: kiln.Tensor[kiln.i32]):
        kiln.fence("cta")
        old = c.atomic_add(0, 1)
        c.atomic_min(1, old)
        x.atomic_max(0, 2.0)
        x.atomic_exchange(1, x.atomic_add(2, 1.5))

    asm = trace(k, V, np.zeros(4, np.int32))
    for op in ("addi", "mins", "maximumf", "assign", "addf"):
        assert f"memref.atomic_rmw {op}" in asm
    assert 'llvm.fence syncscope("block") acq_rel' in asm


def test_atomic_on_bf16_is_type_error_at_user_line(marker_line):
    def k(y: kiln.Tensor[bf16]):
        y.atomic_add(0, kiln.cast(1.0, bf16))  # @bf16-atomic

    with pytest.raises(kiln.KilnTypeError, match="32- or 64-bit int or float") as info:
        trace(k, np.zeros(2, np.float32).astype("bfloat16"))
    assert info.value.loc.line == marker_line("@bf16-atomic")
    assert info.value.loc.filename == __file__


def test_atomic_value_of_another_dtype_is_type_error(marker_line):
    def k(c: kiln.Tensor[kiln.i32]):
        c.atomic_add(0, kiln.cast(1, f32))  # @float-into-int

    with pytest.raises(kiln.KilnTypeError, match="cannot store a f32 value") as info:
        trace(k, np.zeros(2, np.int32))
    assert info.value.loc.line == marker_line("@float-into-int")


def test_unknown_fence_scope_is_value_error(marker_line):
    def k(x: kiln.Tensor[f32]):
        kiln.fence("system")  # @scope

    with pytest.raises(kiln.KilnValueError, match="fence scope 'system'") as info:
        trace(k, V)
    assert info.value.loc.line == marker_line("@scope")
    assert info.value.fix == 'use kiln.fence("gpu") or kiln.fence("cta")'
