"""kiln.pack / unpack / vector_slice / vector_concat / vector_constant: IR, interpreter semantics,
errors."""

import ml_dtypes
import numpy as np
import pytest

import kiln


@kiln.kernel
def reverse_in_pairs(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.f32, 1]):
    """y[8t .. 8t+8] = x's 8 elements with each half reversed, through one packed vector."""
    base = kiln.thread_id(0) * 8
    values = [x[base + i] for i in range(8)]
    vec = kiln.pack(values)
    lo = kiln.unpack(kiln.vector_slice(vec, 0, 4))
    hi = kiln.unpack(kiln.vector_slice(vec, 4, 4))
    offsets = kiln.unpack(kiln.vector_constant([3, 2, 1, 0], kiln.i32))
    for i in range(4):
        y[base + offsets[i]] = lo[i]
    y.store(base + 4, kiln.pack(hi[::-1]), align=16)


def test_pack_slice_and_constant_run_in_the_interpreter():
    rng = np.random.default_rng()
    x = rng.standard_normal(256).astype(np.float32)  # 32 threads x 8
    y = np.full(256, np.nan, np.float32)
    reverse_in_pairs.interpret[(1,)](x, y, num_warps=1)
    np.testing.assert_array_equal(y, x.reshape(32, 2, 4)[:, :, ::-1].reshape(256))


@kiln.kernel
def rotate_quads(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.f8e4m3, 1]):
    """y[12t .. 12t+12] = fp8 of x's 12 elements with the three quads rotated by one."""
    base = kiln.thread_id(0) * 12
    quads = [kiln.cast(x.load(base + 4 * i, width=4), kiln.f8e4m3) for i in range(3)]
    y.store(base, kiln.vector_concat(quads[1:] + quads[:1]))


def test_vector_concat_joins_in_order_in_the_interpreter():
    rng = np.random.default_rng()
    x = rng.standard_normal(32 * 12).astype(np.float32)
    y = np.full(32 * 12, np.nan, ml_dtypes.float8_e4m3fn)
    rotate_quads.interpret[(1,)](x, y, num_warps=1)
    want = x.reshape(32, 3, 4)[:, [1, 2, 0]].reshape(-1).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(y.astype(np.float32), want.astype(np.float32))


@pytest.mark.lower
def test_fp8_casts_of_quads_become_packed_conversions_on_gfx950():
    """arith-to-amdgpu turns a 4-wide f32 -> fp8 cast into v_cvt_pk_fp8_f32 (two per quad)."""
    x = np.zeros(4, np.float32)
    asm = rotate_quads.compile(x, np.zeros(4, ml_dtypes.float8_e4m3fn), target="gfx950",
                               num_warps=1).asm["amdgcn"]
    assert asm.count("v_cvt_pk_fp8_f32") == 6


def test_pack_builds_from_elements_and_slices_are_shuffles():
    x = np.zeros(32, np.float32)
    asm = reverse_in_pairs.trace(x, x, target="sm_90a", num_warps=1).module_asm
    assert "vector.from_elements" in asm
    assert "vector.shuffle" in asm
    assert "dense<[3, 2, 1, 0]> : vector<4xi32>" in asm


@pytest.mark.lower
def test_packed_bf16_store_is_one_wide_store_in_ptx():
    @kiln.kernel
    def cast_eight(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.bf16, 1]):
        base = kiln.thread_id(0) * 8
        y.store(base, kiln.pack([kiln.cast(x[base + i], kiln.bf16) for i in range(8)]),
                align=16)

    ck = cast_eight.compile(np.zeros(256, np.float32), np.zeros(256, ml_dtypes.bfloat16),
                            target="sm_90a", num_warps=1)
    assert "st.global.v4.b32" in ck.asm["ptx"] or "st.global.v4.u32" in ck.asm["ptx"]


@pytest.mark.parametrize("build, message", [
    (lambda x: kiln.pack([]), "at least one value"),
    (lambda x: kiln.pack([1.0, 2.0]), "traced value"),
    (lambda x: kiln.pack([x[0], kiln.cast(x[1], kiln.bf16)]), "cast every value"),
    (lambda x: kiln.vector_slice(kiln.pack([x[0], x[1]]), 1, 2), "outside a vector"),
    (lambda x: kiln.unpack(x[0]), "1-D vector"),
    (lambda x: kiln.vector_concat([]), "at least one vector"),
    (lambda x: kiln.vector_concat([kiln.pack([x[0]]), kiln.pack([kiln.cast(x[1], kiln.bf16)])]),
     "cast every part"),
])
def test_bad_vectors_are_reported_at_the_call(build, message):
    @kiln.kernel
    def bad(x: kiln.Tensor[kiln.f32, 1]):
        build(x)

    with pytest.raises(kiln.KilnError, match=message):
        bad.trace(np.zeros(4, np.float32), target="sm_90a", num_warps=1)
