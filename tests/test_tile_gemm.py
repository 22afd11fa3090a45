"""kiln.gemm: the atom and warp grid chosen per target, the derived accumulator layout, and
ragged GEMMs in the interpreter on every target (float64 references, NaN-poisoned outputs)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import bf16, f32, i32
from kiln.core.targets import get_target
from kiln.mma import TiledMma, atom
from kiln.tile_gemm import accumulator_layout

ALL_TARGETS = ("sm_80", "sm_90a", "gfx942", "gfx950")


@pytest.mark.parametrize("name,warps", [("mma_sync", (2, 2)), ("mma_sync", (4, 2)),
                                        ("mfma32", (2, 1)), ("mfma16", (1, 2))])
def test_accumulator_layout_places_every_fragment_where_the_warp_computes_it(name, warps):
    """Block layout (t, v) == warp origin + fragment origin + the atom's C layout (lane, r)."""
    a = {"mma_sync": atom(16, 8, 16, bf16, target="sm_80"),
         "mfma32": atom(32, 32, 16, bf16, target="gfx950"),
         "mfma16": atom(16, 16, 32, bf16, target="gfx950")}[name]
    s = a.spec
    tm = TiledMma(a, warps[0], warps[1], 128, 64, s.k)
    tv = accumulator_layout(tm)
    assert tv.tile == (128, 64) and tv.num_threads == warps[0] * warps[1] * s.threads
    per = s.c_layout.num_values
    rows, cols = tv.coords()
    c_rows, c_cols = s.c_layout.coords()
    for t in range(tv.num_threads):
        w, lane = divmod(t, s.threads)
        wr, wc = (w // tm.warps_n) * tm.warp_m, (w % tm.warps_n) * tm.warp_n
        for v in range(tv.num_values):
            f, r = divmod(v, per)
            i, j = divmod(f, tm.rep_n)
            assert (rows[t, v], cols[t, v]) == (wr + i * s.m + c_rows[lane, r],
                                                wc + j * s.n + c_cols[lane, r])


@kiln.kernel(num_threads="THREADS")
def gemm_kernel(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2],
                m: i32, n: i32, k: i32, BM: kiln.constexpr, BN: kiln.constexpr,
                BK: kiln.constexpr, THREADS: kiln.constexpr, SWIZZLE: kiln.constexpr):
    row0 = kiln.block_id(0) * BM
    col0 = kiln.block_id(1) * BN
    a_sw = kiln.tiles.operand_swizzle((BM, BK), bf16) if SWIZZLE else None
    b_sw = kiln.tiles.operand_swizzle((BK, BN), bf16) if SWIZZLE else None
    a_s = kiln.SharedTile((BM, BK), bf16, swizzle=a_sw)
    b_s = kiln.SharedTile((BK, BN), bf16, swizzle=b_sw)
    acc = kiln.accumulator(a_s, b_s)
    for k0 in kiln.range(0, k, BK):
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=m, col_end=k), a_s)
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=k, col_end=n), b_s)
        kiln.barrier()
        acc = kiln.gemm(a_s, b_s, acc)
        kiln.barrier()
    # a row reduction on the derived layout: the row max goes to the last output column
    kiln.copy(acc - kiln.reduce(acc, "max", axis=1) * 0.0,
              kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=m, col_end=n))


@pytest.mark.parametrize("target", ALL_TARGETS)
@pytest.mark.parametrize("swizzle", (False, True))
@pytest.mark.parametrize("shape,tile,threads", [((100, 70, 90), (64, 64, 32), 256),
                                                ((33, 130, 40), (32, 128, 16), 128)])
def test_ragged_gemm_in_the_interpreter(target, shape, tile, threads, swizzle):
    """Unswizzled tiles and operand_swizzle ones (ldmatrix on NVIDIA) give the same product."""
    if threads % get_target(target).warp_size:
        pytest.skip("thread count below the wavefront")
    rng = np.random.default_rng()
    m, n, k = shape
    if tile[2] % 16 and target.startswith("gfx"):
        pytest.skip("BK below the MFMA's k")
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    bm, bn, bk = tile
    gemm_kernel.interpret[(-(-m // bm), -(-n // bn))](a, b, c, m, n, k, BM=bm, BN=bn, BK=bk,
                                                      THREADS=threads, SWIZZLE=swizzle,
                                                      target=target)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("target,atom_name", [("sm_80", "mma_sync_m16n8k16_bf16"),
                                              ("sm_90a", "mma_sync_m16n8k16_bf16"),
                                              ("gfx942", "mfma_f32_32x32x8_bf16"),
                                              ("gfx950", "mfma_f32_32x32x16_bf16")])
def test_gemm_picks_the_biggest_atom_of_the_target(target, atom_name):
    a = np.zeros((64, 64), ml_dtypes.bfloat16)
    text = gemm_kernel.trace(a, a, np.zeros((64, 64), np.float32), 64, 64, 64, BM=64, BN=64,
                             BK=32, THREADS=256, SWIZZLE=True, target=target).module_asm
    marker = {"mma_sync": "nvvm.mma.sync", "mfma_f32_32x32x8": "amdgpu.mfma 32x32x8 ",
              "mfma_f32_32x32x16": "amdgpu.mfma 32x32x16 "}
    assert next(v for key, v in marker.items() if atom_name.startswith(key)) in text
    assert ("nvgpu.ldmatrix" in text) == target.startswith("sm")


@pytest.mark.parametrize("shape", [(128, 32), (32, 128), (64, 64), (16, 16), (32, 256)])
def test_operand_swizzle_is_conflict_free_for_eight_row_chunk_reads(shape):
    sw = kiln.tiles.operand_swizzle(shape, bf16)
    offsets = kiln.SharedTile.__new__(kiln.SharedTile)
    offsets._describe(shape, bf16, None, sw)
    off = offsets.offsets()
    for r0 in range(0, shape[0] - 7, 8):
        for c in range(0, shape[1], 8):
            slots = {int(off[r0 + i, c]) * 2 // 16 % 8 for i in range(8)}
            assert len(slots) == 8, (shape, r0, c)
    assert kiln.tiles.operand_swizzle((64, 8), bf16) is None     # one chunk per row


def test_gemm_errors():
    @kiln.kernel(num_threads=128)
    def mismatched(a: kiln.Tensor[bf16, 2]):
        kiln.gemm(kiln.SharedTile((64, 32), bf16), kiln.SharedTile((16, 64), bf16))

    @kiln.kernel(num_threads=128)
    def untileable(a: kiln.Tensor[bf16, 2]):
        kiln.gemm(kiln.SharedTile((24, 32), bf16), kiln.SharedTile((32, 40), bf16))

    a = np.zeros((64, 64), ml_dtypes.bfloat16)
    with pytest.raises(kiln.KilnValueError, match="M x K"):
        mismatched.trace(a, target="sm_90a")
    with pytest.raises(kiln.UnsupportedError, match="24x40x32"):
        untileable.trace(a, target="gfx950")


@pytest.mark.parametrize("target,renamed", [("sm_80", True), ("gfx950", False)])
def test_register_gather_of_the_accumulator_as_the_next_a_operand(target, renamed):
    """mma.sync: the m16n8 accumulator of a (warps, 1) grid is the m16n8k16 A fragment, two
    C fragments side by side; MFMA: a lane holds a column of C but a row of A."""
    from kiln.tile_gemm import register_gather
    a = atom(16, 8, 16, bf16, target="sm_80") if renamed else atom(32, 32, 16, bf16,
                                                                    target="gfx950")
    s = a.spec
    first = TiledMma(a, 4, 1, 128, 64, 64)            # S = Q K^T: 128 x 64
    second = TiledMma(a, 4, 1, 128, 128, 64)          # O += P V: K = 64
    gather = register_gather(second, accumulator_layout(first))
    if not renamed:
        assert gather is None
        return
    per, rep_n = s.c_layout.num_values, first.rep_n
    assert len(gather) == second.rep_m * second.rep_k
    for i in range(second.rep_m):
        for kk in range(second.rep_k):
            base = (i * rep_n + 2 * kk) * per
            assert gather[i * second.rep_k + kk] == list(range(base, base + 2 * per))
    assert register_gather(TiledMma(a, 2, 2, 128, 128, 64), accumulator_layout(first)) is None


@kiln.kernel(num_threads="THREADS")
def chain_kernel(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], d: kiln.Tensor[bf16, 2],
                 c: kiln.Tensor[f32, 2], BM: kiln.constexpr, BN: kiln.constexpr,
                 BK: kiln.constexpr, THREADS: kiln.constexpr):
    """c = (a @ b^T, rounded to bf16, scaled by its row max) @ d: b is stored N x K and read
    through a .T view; the product feeds the second gemm from registers."""
    a_s, b_s = kiln.SharedTile((BM, BK), bf16), kiln.SharedTile((BN, BK), bf16)
    d_s = kiln.SharedTile((BN, BN), bf16, swizzle=kiln.tiles.operand_swizzle((BN, BN), bf16))
    kiln.copy(kiln.GlobalTile(a, (BM, BK), (0, 0)), a_s)
    kiln.copy(kiln.GlobalTile(b, (BN, BK), (0, 0)), b_s)
    kiln.copy(kiln.GlobalTile(d, (BN, BN), (0, 0)), d_s)
    kiln.barrier()
    s = kiln.gemm(a_s, b_s.T, kiln.accumulator(a_s, b_s.T, warps="rows"))
    rmax = kiln.reduce(kiln.abs(s), "max", axis=1)
    p = kiln.cast(s / rmax, bf16)
    o = kiln.gemm(p, d_s, kiln.accumulator(p, d_s, warps="rows"))
    kiln.copy(o * rmax, kiln.GlobalTile(c, (BM, BN), (0, 0)))      # S's rows onto O's


@pytest.mark.parametrize("target", ("sm_90a", "gfx950"))
def test_gemm_with_a_from_registers_and_a_transposed_b(target):
    rng = np.random.default_rng()
    bm, bn, bk = 64, 64, 32
    a = rng.standard_normal((bm, bk)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((bn, bk)).astype(ml_dtypes.bfloat16)
    d = rng.standard_normal((bn, bn)).astype(ml_dtypes.bfloat16)
    c = np.full((bm, bn), np.nan, np.float32)
    chain_kernel.interpret[(1,)](a, b, d, c, BM=bm, BN=bn, BK=bk, THREADS=128, target=target)
    s = a.astype(np.float64) @ b.astype(np.float64).T
    rmax = np.abs(s).max(axis=1, keepdims=True)
    p = _bf16(s / rmax)
    # The kernel's f32 sums and division may land a value just across a bf16 rounding midpoint:
    # such an element may round either way, and its one-ulp step is added to that output's slack.
    tie_ulp = np.abs(_bf16(s / rmax * (1 + 1e-5)) - _bf16(s / rmax * (1 - 1e-5)))
    d64 = d.astype(np.float64)
    slack = (tie_ulp @ np.abs(d64)) * rmax + 1e-3 * np.abs(s).max()
    error = np.abs(c - (p @ d64) * rmax)
    assert (error <= slack + 1e-4 * np.abs(p @ d64 * rmax)).all(), error.max()


def _bf16(x):
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@kiln.kernel(num_threads=256)
def row_max_kernel(a: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2]):
    a_s = kiln.SharedTile((128, 32), bf16)
    b_s = kiln.SharedTile((32, 64), bf16)
    acc = kiln.accumulator(a_s, b_s, 1.0, warps="rows")
    kiln.copy(acc - kiln.reduce(acc, "max", axis=1), kiln.GlobalTile(c, (128, 64), (0, 0)))


def test_row_reduce_of_a_rows_accumulator_is_quad_shuffles_only():
    """Every warp owns whole rows: the row max is two XOR shuffles within each quad of lanes
    per row group, no shared memory, no barrier."""
    text = row_max_kernel.trace(np.zeros((128, 32), ml_dtypes.bfloat16),
                                np.zeros((128, 64), np.float32), target="sm_90a").module_asm
    assert "gpu.barrier" not in text
    assert text.count("gpu.shuffle") == 2 * 2           # 2 row groups (rows r, r + 8) x 2


def test_gemm_warps_and_row_vector_errors():
    @kiln.kernel(num_threads=128)
    def bad_warps(a: kiln.Tensor[bf16, 2]):
        kiln.accumulator(kiln.SharedTile((64, 32), bf16), kiln.SharedTile((32, 64), bf16),
                         warps=(3, 1))

    @kiln.kernel(num_threads=128)
    def other_rows(a: kiln.Tensor[bf16, 2]):
        a_s, b_s = kiln.SharedTile((64, 32), bf16), kiln.SharedTile((32, 64), bf16)
        rows = kiln.accumulator(a_s, b_s, warps="rows")
        square = kiln.accumulator(a_s, b_s, warps=(2, 2))
        square * kiln.reduce(rows, "max", axis=1)

    a = np.zeros((64, 64), ml_dtypes.bfloat16)
    with pytest.raises(kiln.KilnValueError, match="warps must be"):
        bad_warps.trace(a, target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="other rows"):
        other_rows.trace(a, target="sm_90a")
