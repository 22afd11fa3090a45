"""The one WGMMA op (``kiln.wgmma.mma_async``) with A in shared memory or registers and every
operand major, its atom (``kiln.mma.atom(64, n, 16)`` on sm_90a), and the one register-fragment
type (``kiln.RegTile``) as WGMMA accumulator, WGMMA A operand, MFMA fragment and raw registers.

Every kernel runs in the interpreter on fresh random inputs against a float64 numpy reference,
with NaN-poisoned outputs so an element never written fails."""

import contextlib
import re

import ml_dtypes
import numpy as np
import pytest
from mlir import ir

import kiln
import kiln.mfma  # registers the MFMA atoms
import kiln.mma
from kiln import layout as L
from kiln import wgmma
from kiln.interpreter import interpret_kernel
from kiln.shared import dynamic_shared

DTYPES = {"bf16": (kiln.bf16, ml_dtypes.bfloat16), "f16": (kiln.f16, np.float16)}
K_STEPS = 4  # a 64 x 64 A: four m64n64k16 products
# (where A lives, A major, B major): every combination the instruction has.
FORMS = [("shared", "k", "k"), ("shared", "k", "mn"), ("shared", "mn", "k"),
         ("shared", "mn", "mn"), ("registers", "k", "k"), ("registers", "k", "mn")]


def _stage(tile, stored, t):
    """Copy the 64 x 64 ``stored`` matrix into ``tile`` with the 128-byte swizzle (16-byte
    units of a row XORed with the row's index mod 8), 32 elements per thread."""
    row, half = t // 2, t % 2
    for i in range(32):
        col = 32 * half + i
        tile[row, ((col // 8) ^ (row % 8)) * 8 + col % 8] = stored[row, col]


def _descriptor(tile, major, step):
    """The descriptor of k16 step ``step`` of a 64 x 64 tile: K-major rows of 64 K (32 bytes a
    step), or MN-major rows of 64 M/N (16 rows of 128 bytes a step)."""
    if major == "k":
        return wgmma.smem_descriptor(tile, leading_bytes=16, stride_bytes=1024,
                                     byte_offset=32 * step)
    return wgmma.smem_descriptor(tile, leading_bytes=64 * 128, stride_bytes=1024,
                                 byte_offset=2048 * step)


def _make_matmul(DTYPE):
    @kiln.kernel
    def matmul(a: kiln.Tensor[DTYPE, 2], a_stored: kiln.Tensor[DTYPE, 2],
               b_stored: kiln.Tensor[DTYPE, 2], out: kiln.Tensor[kiln.f32, 2],
               A_LOC: kiln.constexpr, A_MAJOR: kiln.constexpr, B_MAJOR: kiln.constexpr):
        """out += A @ B (64 x 64 x 64): A from shared memory (stored ``a_stored``, K-major
        M x K or MN-major K x M) or from registers (read from ``a``), B from shared memory
        (stored N x K for ``B_MAJOR="k"``, K x N for ``"mn"``)."""
        t = kiln.thread_id(0)
        a_s = dynamic_shared((64, 64), DTYPE, align=1024)
        b_s = dynamic_shared((64, 64), DTYPE, align=1024)
        _stage(a_s, a_stored, t)
        _stage(b_s, b_stored, t)
        kiln.barrier()
        kiln.nvidia_asm.fence_proxy_async()
        acc_layout = L.wgmma_m64_accumulator(64)
        acc = wgmma.fragment_from_elements([out[acc_layout(t, i)] for i in range(32)])
        a_layout = wgmma.a_fragment_layout()
        wgmma.fence()
        for j in kiln.static_range(K_STEPS):
            if A_LOC == "shared":
                a_op = _descriptor(a_s, A_MAJOR, j)
            else:  # this thread's 8 elements of A's columns 16j .. 16j+15, as a 1 x 1 RegTile
                a_op = kiln.RegTile.from_registers(
                    [a[a_layout(t, v)[0], 16 * j + a_layout(t, v)[1]] for v in range(8)],
                    a_layout)
            acc = wgmma.mma_async(acc, a_op, _descriptor(b_s, B_MAJOR, j), dtype=DTYPE,
                                  a_major=A_MAJOR, b_major=B_MAJOR)
        wgmma.commit()
        wgmma.wait_group(0)
        for i in kiln.static_range(32):
            out[acc_layout(t, i)] = acc.element(i)

    return matmul


MATMUL = {name: _make_matmul(dtype) for name, (dtype, _) in DTYPES.items()}


def _run_matmul(dtype_name, a_loc, a_major, b_major, rng):
    np_dtype = DTYPES[dtype_name][1]
    a = rng.standard_normal((64, 64)).astype(np_dtype)
    b = rng.standard_normal((64, 64)).astype(np_dtype)
    prior = rng.standard_normal((64, 64)).astype(np.float32)
    a_stored = a if a_major == "k" else np.ascontiguousarray(a.T)
    b_stored = np.ascontiguousarray(b.T) if b_major == "k" else b
    out = prior.copy()
    traced = MATMUL[dtype_name].trace(a, a_stored, b_stored, out, A_LOC=a_loc, A_MAJOR=a_major,
                                      B_MAJOR=b_major, target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [a, a_stored, b_stored, out], "sm_90a")
    expected = prior + a.astype(np.float64) @ b.astype(np.float64)
    return traced, out, expected


@pytest.mark.parametrize("a_loc, a_major, b_major", FORMS)
def test_one_op_matches_float64_for_every_a_location_and_major(a_loc, a_major, b_major, rng):
    traced, out, expected = _run_matmul("bf16", a_loc, a_major, b_major, rng)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    text = traced.module_asm
    if a_loc == "shared":  # NVVM spells K-major A as "row" and K-major B as "col"
        layout_a = "row" if a_major == "k" else "col"
        layout_b = "col" if b_major == "k" else "row"
        assert text.count(f"A[<bf16>, <one>, <{layout_a}>], B[<bf16>, <one>, <{layout_b}>]") \
            == K_STEPS
        assert "llvm.inline_asm" not in text
    else:
        trans_b = int(b_major == "mn")
        assert text.count(f"p, 1, 1, {trans_b};") == K_STEPS
        assert "nvvm.wgmma.mma_async" not in text


@pytest.mark.parametrize("a_loc", ["shared", "registers"])
def test_one_op_with_f16_operands(a_loc, rng):
    _, out, expected = _run_matmul("f16", a_loc, "k", "mn", rng)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def _make_fp8_matmul(DTYPE):
    @kiln.kernel
    def fp8_matmul(a: kiln.Tensor[DTYPE, 2], b: kiln.Tensor[DTYPE, 2],
                   out: kiln.Tensor[kiln.f32, 2]):
        """out += A @ B^T, A 64 x 128 and B 64 x 128 (both K-major, one 128-byte swizzled row
        of FP8 each): four m64n64k32 steps, 32 bytes apart."""
        t = kiln.thread_id(0)
        a_s = dynamic_shared((64, 128), DTYPE, align=1024)
        b_s = dynamic_shared((64, 128), DTYPE, align=1024)
        row, half = t // 2, t % 2
        for i in range(64):  # 16-byte units of a row XORed with the row's index mod 8
            col = 64 * half + i
            a_s[row, ((col // 16) ^ (row % 8)) * 16 + col % 16] = a[row, col]
            b_s[row, ((col // 16) ^ (row % 8)) * 16 + col % 16] = b[row, col]
        kiln.barrier()
        kiln.nvidia_asm.fence_proxy_async()
        acc_layout = L.wgmma_m64_accumulator(64)
        acc = wgmma.fragment_from_elements([out[acc_layout(t, i)] for i in range(32)])
        wgmma.fence()
        for j in kiln.static_range(4):
            acc = wgmma.mma_async(
                acc, wgmma.smem_descriptor(a_s, leading_bytes=16, stride_bytes=1024,
                                           byte_offset=32 * j),
                wgmma.smem_descriptor(b_s, leading_bytes=16, stride_bytes=1024,
                                      byte_offset=32 * j), dtype=DTYPE)
        wgmma.commit()
        wgmma.wait_group(0)
        for i in kiln.static_range(32):
            out[acc_layout(t, i)] = acc.element(i)

    return fp8_matmul


@pytest.mark.parametrize("dtype", [kiln.f8e4m3, kiln.f8e5m2], ids=str)
def test_fp8_k32_op_matches_float64(dtype, rng):
    """FP8 operands select ``m64nNk32`` (e4m3/e5m2), K-major from shared memory."""
    a = rng.standard_normal((64, 128)).astype(dtype.numpy)
    b = rng.standard_normal((64, 128)).astype(dtype.numpy)
    prior = rng.standard_normal((64, 64)).astype(np.float32)
    out = prior.copy()
    traced = _make_fp8_matmul(dtype).trace(a, b, out, target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [a, b, out], "sm_90a")
    expected = prior + a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    kind = dtype.name[2:]
    assert traced.module_asm.count(f"A[<{kind}>, <one>, <row>], B[<{kind}>, <one>, <col>]") == 4
    assert traced.module_asm.count("k = 32") == 4


@kiln.kernel
def bad_fp8_form(out: kiln.Tensor[kiln.f32], WHAT: kiln.constexpr):
    s = dynamic_shared((64, 128), kiln.f8e4m3, align=1024)
    desc = wgmma.smem_descriptor(s, leading_bytes=16, stride_bytes=1024)
    acc = wgmma.fragment_zeros(64)
    if WHAT == "mn-major B":
        wgmma.mma_async(acc, desc, desc, dtype=kiln.f8e4m3, b_major="mn")
    elif WHAT == "register A":
        p = wgmma.a_fragment_from_accumulator(acc, kiln.bf16)
        wgmma.mma_async(acc, p.fragment(0, 0), desc, dtype=kiln.f8e4m3)


@pytest.mark.parametrize("what,error,words", [
    ("mn-major B", kiln.UnsupportedError, "FP8 wgmma.mma_async needs A and B K-major"),
    # FP8 A from registers exists (tests/test_wgmma_fp8_regs.py), but only as FP8 registers.
    ("register A", kiln.KilnTypeError, "A operand must be a vector<16xf8e4m3>"),
])
def test_fp8_forms_the_instruction_lacks_are_rejected(what, error, words):
    with pytest.raises(error, match=re.escape(words)):
        bad_fp8_form.trace(np.zeros(4, np.float32), WHAT=what, target="sm_90a")


@kiln.kernel
def bad_form(out: kiln.Tensor[kiln.f32], WHAT: kiln.constexpr):
    b_s = dynamic_shared((64, 64), kiln.bf16, align=1024)
    desc = wgmma.smem_descriptor(b_s, leading_bytes=16, stride_bytes=1024)
    acc = wgmma.fragment_zeros(64)
    p = wgmma.a_fragment_from_accumulator(acc, kiln.bf16)
    if WHAT == "register A, MN-major":
        wgmma.mma_async(acc, p[0], desc, dtype=kiln.bf16, a_major="mn")
    elif WHAT == "traced accumulate, shared A":
        wgmma.mma_async(acc, desc, desc, dtype=kiln.bf16, accumulate=kiln.thread_id(0) > 0)
    elif WHAT == "grid of A operands":
        wgmma.mma_async(acc, p, desc, dtype=kiln.bf16)


@pytest.mark.parametrize("what, error, message", [
    ("register A, MN-major", kiln.UnsupportedError, "K-major by definition"),
    ("traced accumulate, shared A", kiln.UnsupportedError, "needs A in registers"),
    ("grid of A operands", kiln.KilnTypeError, "i64 shared-memory descriptor or a vector<8"),
])
def test_forms_the_instruction_lacks_are_rejected(what, error, message):
    with pytest.raises(error, match=message):
        bad_form.trace(np.zeros(4, np.float32), WHAT=what, target="sm_90a")


# --- the atom ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [8, 64, 256])
def test_mma_atom_64_n_16_is_the_one_wgmma_op(n):
    atom = kiln.mma.atom(64, n, 16, kiln.bf16, target="sm_90a")
    assert isinstance(atom, kiln.mma.WgmmaAtom)
    assert (atom.spec.m, atom.spec.n, atom.spec.k, atom.spec.threads) == (64, n, 16, 128)
    assert atom.spec.a_layout == wgmma.a_fragment_layout() and atom.spec.b_layout is None
    assert atom.spec.c_layout == L.wgmma_m64_accumulator(n) and atom.spec.chips == ("sm_90a",)
    # One atom per shape and dtype: no second (register-A) atom.
    assert [a.spec.name for a in kiln.mma.atoms_for("sm_90a")
            if (a.spec.m, a.spec.n, a.spec.a_dtype) == (64, n, kiln.bf16)] \
        == [f"wgmma_m64n{n}k16_bf16"]


@kiln.kernel
def atom_products(a: kiln.Tensor[kiln.bf16, 2], b_stored: kiln.Tensor[kiln.bf16, 2],
                  out: kiln.Tensor[kiln.f32, 3]):
    """out[0] = A @ B with A from shared memory, out[1] with A from registers, both through
    ``kiln.mma.atom(64, 64, 16, bf16)`` (B stored K x N)."""
    t = kiln.thread_id(0)
    atom = kiln.mma.atom(64, 64, 16, kiln.bf16)
    a_s = dynamic_shared((64, 64), kiln.bf16, align=1024)
    b_s = dynamic_shared((64, 64), kiln.bf16, align=1024)
    _stage(a_s, a, t)
    _stage(b_s, b_stored, t)
    kiln.barrier()
    kiln.nvidia_asm.fence_proxy_async()
    a_layout = atom.spec.a_layout
    results = []
    for a_loc in ("shared", "registers"):
        acc = wgmma.fragment_zeros(64)
        wgmma.fence()
        for j in kiln.static_range(K_STEPS):
            a_op = _descriptor(a_s, "k", j) if a_loc == "shared" else kiln.RegTile.from_registers(
                [a[a_layout(t, v)[0], 16 * j + a_layout(t, v)[1]] for v in range(8)], a_layout)
            acc = atom(a_op, _descriptor(b_s, "mn", j), acc, b_major="mn")
        wgmma.commit()
        wgmma.wait_group(0)
        results.append(acc)
    for which, acc in enumerate(results):
        for i in kiln.static_range(32):
            row, col = atom.spec.c_layout(t, i)
            out[which, row, col] = acc.element(i)


def test_mma_atom_64_n_16_runs_both_a_locations(rng):
    a = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    out = np.full((2, 64, 64), np.nan, np.float32)
    traced = atom_products.trace(a, b, out, target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [a, b, out], "sm_90a")
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[1], expected, rtol=1e-5, atol=1e-4)


# --- one register-fragment type ---------------------------------------------------------------

def _coords_out(out, layout, t, tile):
    """Write each register of ``tile`` (1 x g grid) to ``out`` at the element it holds."""
    width = layout.num_values
    for i in range(width * tile.grid[1]):
        row, col = layout(t, i % width)
        out[row, col + (i // width) * layout.tile[1]] = tile.element(i)


@kiln.kernel
def wgmma_conversions(s_in: kiln.Tensor[kiln.f32, 2], acc_out: kiln.Tensor[kiln.f32, 2],
                      tile_out: kiln.Tensor[kiln.f32, 2], back_out: kiln.Tensor[kiln.f32, 2],
                      a_out: kiln.Tensor[kiln.f32, 2]):
    """A 64 x 64 accumulator read from ``s_in`` as raw registers, then: the accumulator
    itself, its vector-tile form (fragment_to_tile), the accumulator rebuilt from that tile
    (fragment_from_tile), and its bf16 A operands (a_fragment_from_accumulator), each written
    back element by element through its own layout."""
    t = kiln.thread_id(0)
    layout = L.wgmma_m64_accumulator(64)
    acc = wgmma.fragment_from_elements([s_in[layout(t, i)] for i in range(32)])
    _coords_out(acc_out, layout, t, acc)
    tile = wgmma.fragment_to_tile(acc)
    _coords_out(tile_out, tile.layout, t, tile)
    back = wgmma.fragment_from_tile(tile * 2.0)
    _coords_out(back_out, back.layout, t, back)
    p = wgmma.a_fragment_from_accumulator(acc, kiln.bf16)
    _coords_out(a_out, p.layout, t, p.map(lambda f: kiln.cast(f, kiln.f32)))


def test_wgmma_accumulator_tile_and_a_operand_forms_agree_element_by_element(rng):
    s = rng.standard_normal((64, 64)).astype(np.float32)
    outs = [np.full((64, 64), np.nan, np.float32) for _ in range(4)]
    traced = wgmma_conversions.trace(s, *outs, target="sm_90a")
    interpret_kernel(traced, (1, 1, 1), [s, *outs], "sm_90a")
    acc_out, tile_out, back_out, a_out = outs
    np.testing.assert_array_equal(acc_out, s)
    np.testing.assert_array_equal(tile_out, s)
    np.testing.assert_array_equal(back_out, 2.0 * s)
    np.testing.assert_array_equal(a_out, s.astype(ml_dtypes.bfloat16).astype(np.float32))


@kiln.kernel
def mfma_conversions(c_in: kiln.Tensor[kiln.f32, 2], c_out: kiln.Tensor[kiln.f32, 2],
                     t_out: kiln.Tensor[kiln.f32, 2], r_out: kiln.Tensor[kiln.f32, 2]):
    """A 32 x 32 MFMA accumulator as a RegTile built from raw registers; written back through
    its layout, through its transpose (same registers), and rebuilt from its registers."""
    lane = kiln.thread_id(0)
    layout = kiln.mma.atom(32, 32, 16, kiln.bf16).spec.c_layout
    c = kiln.RegTile.from_registers([c_in[layout(lane, v)] for v in range(16)], layout)
    _coords_out(c_out, layout, lane, c)
    _coords_out(t_out, c.T.layout, lane, c.T)
    again = kiln.RegTile.from_registers([x + 1.0 for x in c.registers()], layout)
    _coords_out(r_out, layout, lane, again)


def test_mfma_fragment_as_regtile_element_by_element(rng):
    c = rng.standard_normal((32, 32)).astype(np.float32)
    outs = [np.full((32, 32), np.nan, np.float32) for _ in range(3)]
    traced = mfma_conversions.trace(c, *outs, target="gfx950", num_warps=1)
    interpret_kernel(traced, (1, 1, 1), [c, *outs], "gfx950")
    c_out, t_out, r_out = outs
    np.testing.assert_array_equal(c_out, c)
    np.testing.assert_array_equal(t_out, c.T)
    np.testing.assert_array_equal(r_out, c + 1.0)


@contextlib.contextmanager
def bare_module():
    """An MLIR context and insertion point to build values in, with no kernel around them."""
    with ir.Context(), ir.Location.unknown():
        with ir.InsertionPoint(ir.Module.create().body):
            yield


def test_register_lists_and_struct_form_round_trip():
    with bare_module():
        layout = L.wgmma_m64_accumulator(16)
        regs = [kiln.cast(float(i), kiln.f32) for i in range(8)]
        tile = kiln.RegTile.from_registers(regs, layout)
        packed = kiln.RegTile.from_struct(tile.struct(), layout)
        assert (packed.shape, packed.dtype, packed.grid, len(packed)) == ((64, 16), kiln.f32,
                                                                          (1, 1), 1)
        assert packed.struct() is not None and packed.unpacked().fragments[0].shape == (8,)
        with pytest.raises(kiln.KilnValueError, match="needs 8 registers"):
            kiln.RegTile.from_registers(regs[:7], layout)
        with pytest.raises(kiln.KilnTypeError, match="one dtype"):
            kiln.RegTile.from_registers(regs[:7] + [kiln.cast(1, kiln.i32)], layout)
        with pytest.raises(kiln.KilnValueError, match="register 8 is outside"):
            tile.element(8)
        grid = kiln.RegTile.full(layout, (1, 2), 0.0)
        with pytest.raises(kiln.KilnValueError, match="only a 1 x 1 RegTile"):
            grid.struct()
