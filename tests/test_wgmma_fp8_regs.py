"""FP8 WGMMA with A from registers (``m64nNk32``, e4m3): the 8-bit A-fragment layout, the
accumulator -> FP8 A conversion (``cvt.rn.satfinite`` pairs, columns in ``FP8_A_K_ORDER``), the
inline PTX through ptxas, and the interpreter against float64 numpy (FlashAttention-3's FP8
``O += P V``: P from registers, V transposed K-major in shared memory)."""

import re

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import layout as L
from kiln import wgmma
from kiln.interpreter import interpret_kernel
from kiln.nvidia.cvt import FP8_MAX, pack_f8x4
from kiln.runtime.cuda import cuda_available
from kiln.shared import dynamic_shared

E4M3 = ml_dtypes.float8_e4m3fn
KEYS, DEPTH = 128, 64  # P is 64 x 128 (four k32 steps), V 128 x 64


@kiln.kernel
def p_times_v_fp8(s_in: kiln.Tensor[kiln.f32, 2], vt: kiln.Tensor[kiln.f8e4m3, 2],
                  out: kiln.Tensor[kiln.f32, 2]):
    """out = e4m3(S) @ V: S (64 x 128 f32) as a WGMMA accumulator -> FP8 A operands; ``vt``
    is V^T (64 x 128, keys along the row, already in FP8_A_K_ORDER) staged K-major with the
    128-byte swizzle."""
    t = kiln.thread_id(0)
    v_s = dynamic_shared((DEPTH, KEYS), kiln.f8e4m3, align=1024)
    row = t // 2
    for i in kiln.static_range(64):
        col = 64 * (t % 2) + i
        v_s[row, ((col // 16) ^ (row % 8)) * 16 + col % 16] = vt[row, col]  # 128B swizzle
    kiln.barrier()
    kiln.nvidia_asm.fence_proxy_async()
    acc_layout = L.wgmma_m64_accumulator(KEYS)
    s = wgmma.fragment_from_elements([s_in[acc_layout(t, i)] for i in range(KEYS // 2)])
    p = wgmma.a_fragment_from_accumulator(s, kiln.f8e4m3, k_permuted=True)
    o = wgmma.fragment_zeros(DEPTH)
    wgmma.fence()
    for j in kiln.static_range(KEYS // 32):  # k32 step j: 32 bytes along each 128-byte row
        desc = wgmma.smem_descriptor(v_s, leading_bytes=16, stride_bytes=1024,
                                     byte_offset=32 * j)
        o = wgmma.mma_async(o, p.fragment(0, j), desc, dtype=kiln.f8e4m3)
    wgmma.commit()
    wgmma.wait_group(0)
    for i in kiln.static_range(DEPTH // 2):
        out[L.wgmma_m64_accumulator(DEPTH)(t, i)] = o.element(i)


def _permuted_vt(v):
    """V^T with each 32-key block's columns in FP8_A_K_ORDER (what the A fragment holds)."""
    order = np.concatenate([32 * b + np.array(wgmma.FP8_A_K_ORDER) for b in range(KEYS // 32)])
    return np.ascontiguousarray(v[order].T)


def test_fp8_a_fragment_layout_matches_the_ptx_figure():
    tv = wgmma.a_fragment_layout_8bit()
    assert tv.tile == (64, 32) and tv.num_threads == 128 and tv.num_values == 16
    assert tv(37, 9) == (17, 21)  # the docstring's worked example
    rows, cols = tv.coords()
    t, v = np.arange(128)[:, None], np.arange(16)[None, :]
    warp, lane = t // 32, t % 32
    np.testing.assert_array_equal(rows, 16 * warp + lane // 4 + 8 * (v // 4 % 2))
    np.testing.assert_array_equal(cols, 4 * (lane % 4) + v % 4 + 16 * (v // 8))


def test_fp8_k_order_is_where_the_accumulator_keeps_each_a_column():
    """FP8 A value v of thread t sits at column FP8_A_K_ORDER[k] of the accumulator rows."""
    acc = L.wgmma_m64_accumulator(32)
    a_rows, a_cols = wgmma.a_fragment_layout_8bit().coords()
    rows, cols = acc.coords()
    assert sorted(wgmma.FP8_A_K_ORDER) == list(range(32))
    for t in range(128):
        held = set(zip(rows[t], cols[t]))
        wanted = {(r, wgmma.FP8_A_K_ORDER[c]) for r, c in zip(a_rows[t], a_cols[t])}
        assert held == wanted


def _problem(rng):
    s = (rng.random((64, KEYS)) * 2.0).astype(np.float32)
    s[0, :5] = [500.0, -1000.0, 1e-4, 3e-3, np.float32(0.0)]  # saturation and subnormals
    v = rng.standard_normal((KEYS, DEPTH)).astype(E4M3)
    p = np.clip(s, -FP8_MAX["f8e4m3"], FP8_MAX["f8e4m3"]).astype(E4M3).astype(np.float64)
    out = np.full((64, DEPTH), np.nan, np.float32)  # poison: every element must be written
    v64 = np.abs(v.astype(np.float64))
    largest_product = (np.abs(p)[:, :, None] * v64[None]).max(axis=1)
    return [s, _permuted_vt(v), out], p @ v.astype(np.float64), np.abs(p) @ v64, largest_product


def test_interpreter_matches_float64(rng):
    args, expected, *_ = _problem(rng)
    traced = p_times_v_fp8.trace(*args, target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), args, "sm_90a")
    np.testing.assert_allclose(args[2], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
def test_fp8_register_a_on_gpu(rng):
    """The hardware's 8-bit A fragment is the layout the interpreter assumes. FP8 WGMMA adds
    each k32 instruction's products with ~14 mantissa bits (tests/fp8_reference.py): 2**-12
    of ``|P| @ |V|`` per instruction, four here. It aligns the 32 products to the largest one
    before adding, so beside a saturated P (448) each small product may also lose 2**-13 of
    that largest product (row 0 erred by 0.76 against a 0.54 bound without that term). A key
    out of order still errs by ~|P V| itself, far past both terms on every other row."""
    args, expected, magnitude, largest_product = _problem(rng)
    p_times_v_fp8[(1, 1, 1)](*args, target="sm_90a", num_warps=4)
    error = np.abs(args[2] - expected)
    bound = 2.0 ** -10 * magnitude + 32 * 2.0 ** -13 * largest_product + 1e-6
    assert not np.isnan(args[2]).any()
    assert (error <= bound).all(), \
        f"{(error > bound).sum()} elements off, worst {error.max():.3g}"


def test_without_k_permuted_fp8_fragments_are_refused():
    @kiln.kernel
    def plain(out: kiln.Tensor[kiln.f32, 1]):
        s = wgmma.fragment_zeros(64)
        wgmma.a_fragment_from_accumulator(s, kiln.f8e4m3)
        out[0] = 0.0

    with pytest.raises(kiln.UnsupportedError, match="k_permuted=True"):
        plain.trace(np.zeros(1, np.float32), target="sm_90a")


@pytest.mark.lower
def test_fp8_register_a_reaches_ptx_and_ptxas(monkeypatch, rng):
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    args = [np.zeros((64, KEYS), np.float32), np.zeros((DEPTH, KEYS), E4M3),
            np.zeros((64, DEPTH), np.float32)]
    ck = p_times_v_fp8.compile(*args, target="sm_90a")
    ptx = ck.asm["ptx"]
    issues = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3 "
                        r"\{(?:%r\d+, ){31}%r\d+\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, "
                        r"p, 1, 1;", ptx)
    assert len(issues) == KEYS // 32
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == KEYS // 4  # 2 each
    assert ck.metadata["registers"] > 0 and ck.metadata["spill_bytes"] == 0


@kiln.kernel
def packs(x: kiln.Tensor[kiln.f32, 2], out: kiln.Tensor[kiln.i32, 1]):
    t = kiln.thread_id(0)
    out[t] = pack_f8x4([x[t, i] for i in range(4)], kiln.f8e4m3)


def test_pack_f8x4_rounds_saturates_and_packs_low_byte_first(rng):
    x = (rng.standard_normal((128, 4)) * 100).astype(np.float32)
    x[0] = [1000.0, -1000.0, np.nan, 2.0 ** -10]
    out = np.zeros(128, np.int32)
    interpret_kernel(packs.trace(x, out, target="sm_90a"), (1, 1, 1), [x, out], "sm_90a")
    expected = np.clip(x, -448.0, 448.0).astype(E4M3)
    got = out.view(np.uint8).reshape(128, 4).view(E4M3)
    np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))
