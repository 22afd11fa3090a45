"""kiln.mma: the atom registry, the mma.sync and WGMMA atoms, TiledMma, and the sm_80 GEMM
example (compile-only here; the gpu test runs it against numpy)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from gemm_reference import assert_matmul_close
from source_modules import load_example as load_example_module

import kiln
import kiln.mma as mma
import kiln.tiles as tiles
from kiln import layout as L
from kiln.runtime.cuda import cuda_available



def load_example():
    return load_example_module("mma_sync_gemm")


def test_mma_sync_fragment_layouts_follow_the_ptx_tables():
    lanes = np.arange(32)[:, None]
    group, pair = lanes // 4, lanes % 4
    values = np.arange(8)[None, :]
    rows, cols = L.mma_m16n8k16_a().coords()
    np.testing.assert_array_equal(rows, group + 8 * (values // 2 % 2))
    np.testing.assert_array_equal(cols, 2 * pair + values % 2 + 8 * (values // 4))
    rows, cols = L.mma_m16n8k16_b().coords()
    v = np.arange(4)[None, :]
    np.testing.assert_array_equal(rows, 2 * pair + v % 2 + 8 * (v // 2))
    np.testing.assert_array_equal(cols, np.broadcast_to(group, (32, 4)))


def test_fragment_product_model_equals_matmul(rng):
    """Multiply through the fragment layouts: scatter lanes' A/B values, check C = A @ B."""
    spec = mma.atom(16, 8, 16, kiln.bf16, target="sm_80").spec
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    ar, ac = spec.a_layout.coords()
    br, bc = spec.b_layout.coords()
    a_seen, b_seen = np.full_like(a, np.nan), np.full_like(b, np.nan)
    a_seen[ar, ac] = a[ar, ac]
    b_seen[br, bc] = b[br, bc]
    cr, cc = spec.c_layout.coords()
    np.testing.assert_allclose((a_seen @ b_seen)[cr, cc], (a @ b)[cr, cc])


def test_atom_lookup_and_errors():
    assert mma.atom(16, 8, 16, "f16", target="sm_90a").spec.name == "mma_sync_m16n8k16_f16"
    assert mma.atom(64, 128, 16, kiln.bf16, target="sm_90a").spec.threads == 128
    names = {a.spec.name for a in mma.atoms_for("sm_80")}
    assert names == {"mma_sync_m16n8k16_bf16", "mma_sync_m16n8k16_f16"}
    with pytest.raises(kiln.UnsupportedError, match=r"available on sm_90a") as err:
        mma.atom(64, 64, 16, kiln.bf16, target="sm_80")
    assert "16x8x16 bf16->f32" in str(err.value)
    with pytest.raises(kiln.UnsupportedError, match=r"64x\{8\.\.256 step 8\}x16 bf16->f32"):
        mma.atom(16, 8, 8, kiln.bf16, target="sm_90a")


def test_registered_builders_run_once_on_the_first_lookup(monkeypatch):
    """register_atoms defers a family's atoms to the first lookup, keeping registration order
    (a later register_atom of the same name still replaces the built one)."""
    monkeypatch.setattr(mma, "_REGISTRY", dict(mma._registry()))
    monkeypatch.setattr(mma, "_PENDING", [])
    calls = []
    spec = mma.atom_named("mma_sync_m16n8k16_bf16").spec

    def build():
        calls.append(1)
        return [mma.MmaSyncAtom(dataclasses.replace(spec, name="lazy_m16n8k16"))]

    mma.register_atoms(build)
    assert calls == [] and "lazy_m16n8k16" not in mma._REGISTRY
    assert mma.atom_named("lazy_m16n8k16").spec.m == 16 and calls == [1]
    mma.atoms_for("sm_80")
    assert calls == [1]
    replacement = mma.MmaSyncAtom(mma.atom_named("lazy_m16n8k16").spec)
    mma.register_atom(replacement)
    assert mma.atom_named("lazy_m16n8k16") is replacement
    with pytest.raises(kiln.KilnTypeError, match="register_atoms needs a function"):
        mma.register_atoms([replacement])
    mma.register_atoms(lambda: ["not an atom"])
    with pytest.raises(kiln.KilnTypeError, match="register_atom needs an MmaAtom"):
        mma.atoms_for("sm_80")


def test_spec_checks_layout_shapes():
    with pytest.raises(kiln.KilnValueError, match="expected"):
        mma.MmaAtomSpec("bad", "nvidia", 16, 8, 16, kiln.bf16, kiln.bf16, kiln.f32, 32,
                        L.mma_m16n8k16_b(), L.mma_m16n8k16_b(), L.mma_m16n8_accumulator(),
                        "sm80")


def test_atom_chips_come_from_the_target_model():
    """An atom names a feature of the target model; its chips are the targets that have it."""
    assert mma.atom(16, 8, 16, kiln.bf16, target="sm_80").spec.chips == \
        ("sm_80", "sm_90", "sm_90a", "sm_100a")
    assert mma.atom(64, 64, 16, kiln.bf16, target="sm_90a").spec.feature == "wgmma"
    with pytest.raises(kiln.KilnValueError, match="unknown target feature"):
        mma.MmaAtomSpec("bad", "nvidia", 16, 8, 16, kiln.bf16, kiln.bf16, kiln.f32, 32,
                        L.mma_m16n8k16_a(), L.mma_m16n8k16_b(), L.mma_m16n8_accumulator(),
                        "sm_80")


def test_tiled_mma_partitions_and_validates():
    tm = mma.TiledMma(mma.atom(16, 8, 16, kiln.bf16, target="sm_80"), 2, 2, 64, 64, 32)
    assert (tm.rep_m, tm.rep_n, tm.rep_k, tm.threads) == (2, 4, 2, 128)
    with pytest.raises(kiln.KilnValueError, match="multiple of 32"):
        mma.TiledMma(tm.atom, 2, 2, 48, 64, 32)
    with pytest.raises(kiln.UnsupportedError, match="shared memory"):
        mma.TiledMma(mma.atom(64, 64, 16, kiln.bf16, target="sm_90a"), 1, 1, 64, 64, 16)


@pytest.mark.parametrize("dtype", [kiln.bf16, kiln.f16])
def test_tiled_mma_issues_the_atom_grid(dtype):
    @kiln.kernel
    def k(out: kiln.Tensor[kiln.f32]):
        tm = mma.TiledMma(mma.atom(16, 8, 16, dtype), 1, 2, 32, 32, 32)
        s = tm.atom.spec
        a = tiles.RegTile.full(s.a_layout, (2, 2), 0.5, dtype)
        b = tiles.RegTile.full(s.b_layout, (2, 2), 0.25, dtype)
        acc = tm.mma(tm.accumulator(), a, b)
        out.store(kiln.lane_id() * 4, acc.fragment(1, 1))

    text = k.trace(np.zeros(128, np.float32), target="sm_80", num_warps=2).module_asm
    assert text.count("nvvm.mma.sync") == 2 * 2 * 2
    # bf16 pairs travel packed in i32 (the type says bf16); f16 pairs as vector<2xf16>
    operands = ("(i32, i32, f32)" if dtype is kiln.bf16 else "(vector<2xf16>, vector<2xf16>, f32)")
    assert operands in text


def test_wrong_fragment_is_a_type_error():
    @kiln.kernel
    def k(out: kiln.Tensor[kiln.f32]):
        atom = mma.atom(16, 8, 16, kiln.bf16)
        c = kiln.values.constant(0.0, kiln.f32, (4,))
        a = kiln.values.constant(1.0, kiln.f16, (8,))
        out.store(0, atom(a, kiln.values.constant(1.0, kiln.bf16, (4,)), c))

    with pytest.raises(kiln.KilnTypeError, match=r"A fragment must be a vector<8xbf16>"):
        k.trace(np.zeros(4, np.float32), target="sm_80")


def test_mma_on_amd_without_atoms_is_target_or_unsupported_error():
    with pytest.raises((kiln.TargetError, kiln.UnsupportedError)):
        mma.atom(16, 8, 16, kiln.bf16, target="gfx942")


@pytest.mark.lower
def test_gemm_example_ptx():
    gemm = load_example()
    a, b, c = gemm.reference_inputs(100, 64, 64)
    ck = gemm.mma_sync_gemm.compile(a, b, c, 100, 64, BM=64, BN=64, BK=32, num_warps=4,
                                    target="sm_80")
    lines = [re.sub(r"\s+", " ", l.strip()) for l in ck.asm["ptx"].splitlines()]
    count = lambda prefix: sum(1 for l in lines if l.startswith(prefix))  # noqa: E731
    assert count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * 4 * 2
    assert count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * 2
    assert count("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16") == 2 * 4
    assert count("cp.async.cg.shared.global") == 2 * 4     # prologue + loop, 4 chunks a thread
    assert count("cp.async.wait_group 1;") == 1
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (sm_80+)")
@pytest.mark.parametrize("m,n,k", [(64, 64, 32), (200, 128, 96), (37, 192, 256)])
def test_gemm_example_matches_numpy(m, n, k):
    gemm = load_example()
    a, b, c = gemm.reference_inputs(m, n, k, seed=m + n + k)
    gemm.run(a, b, c)
    assert not np.isnan(c).any()
    assert_matmul_close(c, a, b)
