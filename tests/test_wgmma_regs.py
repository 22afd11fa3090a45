"""WGMMA with A from registers (``kiln.wgmma.mma_async_regs``, the alias of ``mma_async`` with
A in registers): the A-fragment layout, the accumulator -> A conversion, the inline PTX through
ptxas, the interpreter against float64 numpy, and the same kernel on an H100."""

import re

import ml_dtypes
import numpy as np
import pytest
from mlir import ir
from mlir.dialects import vector

import kiln
import kiln.mma
from kiln import layout as L
from kiln import wgmma
from kiln.runtime.cuda import cuda_available
from kiln.interpreter import interpret_kernel
from kiln.shared import dynamic_shared
from kiln.values import Value

DTYPES = {"bf16": (kiln.bf16, ml_dtypes.bfloat16), "f16": (kiln.f16, np.float16)}
K_STEPS = 4  # A is 64 x 64: four m64n64k16 products


def _pack(values, dtype):
    """Scalar Values -> one ``vector<len x dtype>`` Value."""
    vtype = ir.VectorType.get([len(values)], dtype.mlir_type())
    return Value(vector.from_elements(vtype, [v.ir for v in values]), dtype)


def _make_rs_matmul(DTYPE):
    @kiln.kernel
    def rs_matmul(a: kiln.Tensor[DTYPE, 2], b: kiln.Tensor[DTYPE, 2],
                  out: kiln.Tensor[kiln.f32, 2], B_MAJOR: kiln.constexpr,
                  ACCUMULATE: kiln.constexpr):
        """out (64 x 64) = A (64 x 64) @ B with A in registers; B is 64 x 64 in shared memory with
        the 128-byte swizzle, stored N x K (``B_MAJOR="k"``) or K x N (``"mn"``). With
        ``ACCUMULATE`` the product adds to ``out``'s prior contents, else overwrites them."""
        t = kiln.thread_id(0)
        b_s = dynamic_shared((64, 64), DTYPE, align=1024)
        row, half = t // 2, t % 2  # each thread stages 32 elements of one 64-element row
        for i in kiln.static_range(32):
            col = 32 * half + i
            b_s[row, ((col // 8) ^ (row % 8)) * 8 + col % 8] = b[row, col]  # 128B swizzle
        kiln.barrier()
        kiln.nvidia_asm.fence_proxy_async()
        acc_layout = L.wgmma_m64_accumulator(64)
        acc = wgmma.fragment_from_elements([out[acc_layout(t, i)] for i in range(32)])
        a_layout = wgmma.a_fragment_layout()
        wgmma.fence()
        for j in kiln.static_range(K_STEPS):
            a_frag = _pack([a[a_layout(t, v)[0], 16 * j + a_layout(t, v)[1]] for v in range(8)],
                           DTYPE)
            if B_MAJOR == "k":  # K step j: 32 bytes further along each 128-byte row
                desc = wgmma.smem_descriptor(b_s, leading_bytes=16, stride_bytes=1024,
                                             byte_offset=32 * j)
            else:  # K step j: 16 rows of 128 bytes further
                desc = wgmma.smem_descriptor(b_s, leading_bytes=64 * 128, stride_bytes=1024,
                                             byte_offset=2048 * j)
            acc = wgmma.mma_async_regs(acc, a_frag, desc, dtype=DTYPE, b_major=B_MAJOR,
                                       accumulate=ACCUMULATE or j > 0)
        wgmma.commit()
        wgmma.wait_group(0)
        for i in kiln.static_range(32):
            out[acc_layout(t, i)] = acc.element(i)

    return rs_matmul


RS_MATMUL = {name: _make_rs_matmul(dtype) for name, (dtype, _) in DTYPES.items()}


def _inputs(dtype_name, rng):
    np_dtype = DTYPES[dtype_name][1]
    a = rng.standard_normal((64, 64)).astype(np_dtype)
    b = rng.standard_normal((64, 64)).astype(np_dtype)
    return a, b


def _expected(a, b, b_major, prior):
    b64 = b.astype(np.float64)
    return prior + a.astype(np.float64) @ (b64.T if b_major == "k" else b64)


def test_a_fragment_layout_is_the_64x16_accumulator_layout():
    tv = wgmma.a_fragment_layout()
    assert tv.tile == (64, 16) and tv.num_threads == 128 and tv.num_values == 8
    assert tv(37, 5) == (17, 11)  # the docstring's worked example
    rows, cols = tv.coords()
    t, v = np.arange(128)[:, None], np.arange(8)[None, :]
    warp, lane = t // 32, t % 32
    np.testing.assert_array_equal(rows, 16 * warp + lane // 4 + 8 * (v // 2 % 2))
    np.testing.assert_array_equal(cols, 8 * (v // 4) + 2 * (lane % 4) + v % 2)
    # Every element of the 64 x 16 tile exactly once.
    assert len(set(zip(rows.ravel(), cols.ravel()))) == 64 * 16


@pytest.mark.lower
@pytest.mark.parametrize("b_major, trans_b", [("k", 0), ("mn", 1)])
def test_register_a_reaches_ptx_and_ptxas(b_major, trans_b, monkeypatch, rng):
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    a, b = _inputs("bf16", rng)
    out = np.zeros((64, 64), np.float32)
    ck = RS_MATMUL["bf16"].compile(a, b, out, B_MAJOR=b_major, ACCUMULATE=True,
                                   target="sm_90a")
    issues = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16 "
                        r"\{(?:%r\d+, ){31}%r\d+\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, "
                        rf"p, 1, 1, {trans_b};", ck.asm["ptx"])
    assert len(issues) == K_STEPS
    assert ck.metadata["registers"] > 0  # ptxas assembled it
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("b_major", ["k", "mn"])
def test_interpreter_matches_float64(dtype_name, b_major, rng):
    a, b = _inputs(dtype_name, rng)
    prior = rng.standard_normal((64, 64)).astype(np.float32)
    out = prior.copy()
    traced = RS_MATMUL[dtype_name].trace(a, b, out, B_MAJOR=b_major, ACCUMULATE=True,
                                         target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [a, b, out], "sm_90a")
    np.testing.assert_allclose(out, _expected(a, b, b_major, prior), rtol=1e-5, atol=1e-4)


def test_accumulate_false_ignores_the_old_accumulator(rng):
    a, b = _inputs("bf16", rng)
    out = np.full((64, 64), np.nan, np.float32)  # poison: must not leak into the result
    traced = RS_MATMUL["bf16"].trace(a, b, out, B_MAJOR="k", ACCUMULATE=False,
                                     target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [a, b, out], "sm_90a")
    np.testing.assert_allclose(out, _expected(a, b, "k", 0.0), rtol=1e-5, atol=1e-4)


@kiln.kernel
def p_times_v(s_in: kiln.Tensor[kiln.f32, 2], v: kiln.Tensor[kiln.bf16, 2],
              out: kiln.Tensor[kiln.f32, 2]):
    """out = bf16(S) @ V for a 64 x 64 f32 S held as a WGMMA accumulator (FA3's P @ V):
    S -> A operands by a_fragment_from_accumulator, V (keys x depth) MN-major in shared."""
    t = kiln.thread_id(0)
    v_s = dynamic_shared((64, 64), kiln.bf16, align=1024)
    row, half = t // 2, t % 2
    for i in kiln.static_range(32):
        col = 32 * half + i
        v_s[row, ((col // 8) ^ (row % 8)) * 8 + col % 8] = v[row, col]
    kiln.barrier()
    kiln.nvidia_asm.fence_proxy_async()
    acc_layout = L.wgmma_m64_accumulator(64)
    s = wgmma.fragment_from_elements([s_in[acc_layout(t, i)] for i in range(32)])
    p = wgmma.a_fragment_from_accumulator(wgmma.fragment_to_tile(s), kiln.bf16)
    o = wgmma.fragment_zeros(64)
    wgmma.fence()
    for j in kiln.static_range(4):
        desc = wgmma.smem_descriptor(v_s, leading_bytes=64 * 128, stride_bytes=1024,
                                     byte_offset=2048 * j)
        o = wgmma.mma_async_regs(o, p[j], desc, dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    wgmma.wait_group(0)
    for i in kiln.static_range(32):
        out[acc_layout(t, i)] = o.element(i)


def test_accumulator_to_a_operand_feeds_the_next_product(rng):
    s = rng.standard_normal((64, 64)).astype(np.float32)
    v = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    out = np.full((64, 64), np.nan, np.float32)
    traced = p_times_v.trace(s, v, out, target="sm_90a")
    assert traced.module_asm.count("arith.truncf") == 1  # one bulk cast of the 32 registers
    interpret_kernel(traced, (1, 1, 1), [s, v, out], "sm_90a")
    p = s.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(out, p @ v.astype(np.float64), rtol=1e-5, atol=1e-4)


@kiln.kernel
def scaled_rows(s_in: kiln.Tensor[kiln.f32, 2], factors: kiln.Tensor[kiln.f32, 1],
                out: kiln.Tensor[kiln.f32, 2]):
    """out = diag(factors) @ S for a 64 x 64 accumulator, through kiln.wgmma.scale_rows."""
    t = kiln.thread_id(0)
    acc_layout = L.wgmma_m64_accumulator(64)
    s = wgmma.fragment_from_elements([s_in[acc_layout(t, i)] for i in range(32)])
    row = t // 32 * 16 + t % 32 // 4  # the thread's first row; its second is row + 8
    s = wgmma.scale_rows(s, [factors[row], factors[row + 8]])
    for i in kiln.static_range(32):
        out[acc_layout(t, i)] = s.element(i)


def test_scale_rows_multiplies_each_of_a_threads_two_rows(rng):
    s = rng.standard_normal((64, 64)).astype(np.float32)
    factors = rng.standard_normal(64).astype(np.float32)
    out = np.full((64, 64), np.nan, np.float32)
    traced = scaled_rows.trace(s, factors, out, target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [s, factors, out], "sm_90a")
    np.testing.assert_array_equal(out, factors[:, None] * s)


@kiln.kernel
def bad_regs(out: kiln.Tensor[kiln.f32], WHAT: kiln.constexpr):
    b_s = dynamic_shared((64, 64), kiln.bf16, align=1024)
    desc = wgmma.smem_descriptor(b_s, leading_bytes=16, stride_bytes=1024)
    acc = wgmma.fragment_zeros(64)
    a = wgmma.a_fragment_from_accumulator(acc, kiln.bf16)[0]
    if WHAT == "dtype":
        wgmma.mma_async_regs(acc, a, desc, dtype=kiln.f32)
    elif WHAT == "width":
        wgmma.mma_async_regs(acc, wgmma.a_fragment_from_accumulator(acc, kiln.f16)[0], desc,
                             dtype=kiln.bf16)
    elif WHAT == "major":
        wgmma.mma_async_regs(acc, a, desc, dtype=kiln.bf16, b_major="n")
    elif WHAT == "n":
        wgmma.a_fragment_from_accumulator(wgmma.fragment_zeros(40), kiln.bf16)
    elif WHAT == "factors":
        wgmma.scale_rows(acc, [1.0])


@pytest.mark.parametrize("what, error, message", [
    ("dtype", kiln.UnsupportedError, "operand dtype f32"),
    ("width", kiln.KilnTypeError, "vector<8xbf16>"),
    ("major", kiln.KilnValueError, "b_major='n'"),
    ("n", kiln.UnsupportedError, "64 x 40"),
    ("factors", kiln.KilnValueError, "scale_rows needs 2 factors"),
])
def test_bad_operands_raise_at_trace_time(what, error, message):
    with pytest.raises(error, match=re.escape(message)):
        bad_regs.trace(np.zeros(4, np.float32), WHAT=what, target="sm_90a")


def test_register_wgmma_needs_sm90a():
    with pytest.raises(kiln.TargetError, match="WGMMA"):
        bad_regs.trace(np.zeros(4, np.float32), WHAT="dtype", target="sm_80")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
@pytest.mark.parametrize("b_major", ["k", "mn"])
def test_register_a_matmul_on_gpu(b_major, rng):
    a, b = _inputs("bf16", rng)
    out = np.full((64, 64), np.nan, np.float32)  # poison: every element must be written
    RS_MATMUL["bf16"][(1, 1, 1)](a, b, out, B_MAJOR=b_major, ACCUMULATE=False,
                                 target="sm_90a", num_warps=4)
    np.testing.assert_allclose(out, _expected(a, b, b_major, 0.0), rtol=1e-4, atol=1e-3)
