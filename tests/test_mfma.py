"""AMD MFMA atoms: fragment layouts, the registry per chip, errors, and the gfx942/gfx950 ISA."""

import numpy as np
import pytest

import kiln
import kiln.amd_buffer as amd_buffer
import kiln.loader
import kiln.mfma as mfma
from kiln import mma
from kiln.core.errors import KilnTypeError, KilnValueError, UnsupportedError


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """These kernels differ only in the Python callables they close over, which the compile
    cache key cannot see: compile each one afresh."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")


def _brute_a(m, k, kpl):
    lane, value = np.meshgrid(np.arange(64), np.arange(kpl), indexing="ij")
    return lane % m, (lane // m) * kpl + value


@pytest.mark.parametrize("m,k", [(32, 8), (16, 16), (32, 16), (16, 32), (16, 128), (32, 64)])
def test_operand_layouts_match_the_isa_formula(m, k):
    kpl = m * k // 64
    rows, cols = mfma.operand_a_layout(m, k).coords()
    want_rows, want_cols = _brute_a(m, k, kpl)
    assert np.array_equal(rows, want_rows) and np.array_equal(cols, want_cols)
    # B (k x n) is A's pattern with rows and columns swapped: column l % n, rows (l // n) * kpl + v.
    b_rows, b_cols = mfma.operand_b_layout(k, m).coords()
    assert np.array_equal(b_rows, want_cols) and np.array_equal(b_cols, want_rows)



def test_registry_per_chip():
    gfx942 = {a.spec.name for a in mma.atoms_for("gfx942")}
    gfx950 = {a.spec.name for a in mma.atoms_for("gfx950")}
    assert gfx942 == {f"mfma_f32_{s}_{d}" for s in ("32x32x8", "16x16x16") for d in ("bf16", "f16")}
    assert gfx942 < gfx950
    assert {"mfma_f32_32x32x16_bf16", "mfma_f32_16x16x32_f16", "mfma_f32_16x16x128_f8e4m3",
            "mfma_f32_32x32x64_f8e4m3_f8e5m2"} <= gfx950
    atom = mma.atom(16, 16, 128, kiln.f8e5m2, b_dtype=kiln.f8e4m3, target="gfx950")
    assert (atom.spec.a_dtype, atom.spec.b_dtype, atom.spec.a_layout.num_values) == \
        (kiln.f8e5m2, kiln.f8e4m3, 32)
    assert atom.spec.c_layout == kiln.layout.mfma_16x16_accumulator()


def test_missing_combination_lists_the_chips_atoms():
    with pytest.raises(UnsupportedError) as err:
        mma.atom(32, 32, 16, kiln.bf16, target="gfx942")
    text = str(err.value)
    assert "available on gfx950" in text and "32x32x8 bf16->f32" in text
    with pytest.raises(UnsupportedError, match="16x16x16 f16->f32"):
        mma.atom(16, 16, 128, kiln.f8e4m3, target="gfx942")


def _mfma_kernel(atom_spec, chip):
    a_dt, b_dt, kpl = atom_spec.a_dtype, atom_spec.b_dtype, atom_spec.a_layout.num_values
    acc_n = atom_spec.c_layout.num_values

    @kiln.kernel
    def one_mfma(a: kiln.Tensor[a_dt], b: kiln.Tensor[b_dt], c: kiln.Tensor[kiln.f32]):
        lane = kiln.lane_id()
        atom = mma.atom(atom_spec.m, atom_spec.n, atom_spec.k, a_dt, b_dtype=b_dt)
        acc = atom(a.load(lane * kpl, width=kpl), b.load(lane * kpl, width=kpl),
                   c.load(lane * acc_n, width=acc_n))
        c.store(lane * acc_n, acc)

    args = (np.empty(4, a_dt.numpy), np.empty(4, b_dt.numpy), np.empty(4, np.float32))
    return one_mfma.compile(*args, target=chip, num_warps=1)


@pytest.mark.lower
@pytest.mark.parametrize("atom", mfma.ATOMS, ids=lambda a: a.spec.name)
def test_each_atom_becomes_its_instruction(atom):
    s = atom.spec
    chip = s.chips[0]
    compiled = _mfma_kernel(s, chip)
    assert "amdgpu.mfma" in compiled.asm["kiln"]
    asm = compiled.asm["amdgcn"]
    assert asm.count(mfma.instruction_name(s.m, s.n, s.k, s.a_dtype, s.b_dtype) + " ") == 1
    assert compiled.metadata["scratch_bytes"] == 0


@pytest.mark.lower
def test_atom_rejects_wrong_fragments_and_chips(marker_line):
    atom32 = mma.atom(32, 32, 16, kiln.bf16, target="gfx950")

    @kiln.kernel
    def narrow_a(a: kiln.Tensor[kiln.bf16], c: kiln.Tensor[kiln.f32]):
        acc = c.load(0, width=16)
        c.store(0, atom32(a.load(0, width=4), a.load(0, width=8), acc))  # @narrow

    with pytest.raises(KilnTypeError, match=r"A fragment must be a vector<8xbf16>") as err:
        narrow_a.trace(np.empty(4, kiln.bf16.numpy), np.empty(4, np.float32), target="gfx950",
                       num_warps=1)
    assert err.value.loc.line == marker_line("@narrow")

    @kiln.kernel
    def on_gfx942(a: kiln.Tensor[kiln.bf16], c: kiln.Tensor[kiln.f32]):
        acc = c.load(0, width=16)
        c.store(0, atom32(a.load(0, width=8), a.load(0, width=8), acc))

    with pytest.raises(UnsupportedError, match="v_mfma_f32_32x32x16_bf16 .* does not exist on "
                                               "gfx942"):
        on_gfx942.trace(np.empty(4, kiln.bf16.numpy), np.empty(4, np.float32), target="gfx942",
                        num_warps=1)


@pytest.mark.lower
@pytest.mark.parametrize("transposed", [False, True])
def test_store_accumulator_writes_the_c_layout(transposed):
    @kiln.kernel
    def store_c(c_in: kiln.Tensor[kiln.f32], c: kiln.Tensor[kiln.bf16, 2], m: kiln.i32,
                n: kiln.i32):
        acc = c_in.load(kiln.lane_id() * 16, width=16)
        mfma.store_accumulator(acc, amd_buffer.buffer(c), 32, 64, transposed=transposed,
                               limits=(m, n))

    compiled = store_c.compile(np.empty(4, np.float32), np.empty((2, 2), kiln.bf16.numpy), 1, 1,
                               target="gfx950", num_warps=1)
    asm = compiled.asm["amdgcn"]
    if transposed:  # 4 groups of 4 consecutive columns: one 8-byte store each
        assert asm.count("buffer_store_dwordx2") == 4
    else:  # 16 single bf16 stores
        assert asm.count("buffer_store_short") == 16


@pytest.mark.lower
def test_store_accumulator_checks_its_arguments():
    with pytest.raises(KilnTypeError, match="vector<16xf32>"):
        mfma.store_accumulator(3.0, None, 0, 0)

    def store(transposed, b_layout, use_buffer):
        @kiln.kernel
        def store_c(c_in: kiln.Tensor[kiln.f32], c: kiln.Tensor[kiln.f32, 2]):
            dst = amd_buffer.buffer(c) if use_buffer else c
            mfma.store_accumulator(c_in.load(0, width=16), dst, 0, 0, transposed=transposed,
                                   limits=(4, 4), b_layout=b_layout)

        store_c.trace(np.empty(4, np.float32), np.empty((2, 2), np.float32), target="gfx950",
                      num_warps=1)

    permuted = kiln.loader.TiledMmaLoader(kiln.bf16, (32, 32, 16)).b_tr_layout()
    with pytest.raises(KilnValueError, match="a transposed fragment does not have"):
        store(True, permuted, True)
    with pytest.raises(KilnValueError, match="needs a buffer view"):
        store(False, None, False)
