"""AMD ops in the interpreter (no AMD GPU exists here: this is how AMD kernel logic is tested):
buffer views, global -> LDS DMA with s_waitcnt, and MFMA fragments."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import amd_asm, amd_buffer, bf16, f32, mfma, mma

WAVE = 64


@kiln.kernel
def buffer_copy(x: kiln.Tensor[f32, 2], out: kiln.Tensor[f32, 2]):
    """out[r, c] = x[r, c] through a buffer view: reads past x's end give 0, no masks."""
    r = kiln.block_id(0)
    c = kiln.thread_id(0)
    out[r, c] = amd_buffer.buffer(x)[r, c]


def test_buffer_view_reads_zero_past_the_end():
    x = np.random.default_rng().standard_normal((5, 64)).astype(np.float32)
    out = np.full((7, 64), np.nan, np.float32)
    buffer_copy.interpret[(7,)](x, out, num_warps=1, target="gfx950")
    np.testing.assert_array_equal(out[:5], x)
    assert not out[5:].any()


def make_dma_kernel(wait: bool):
    @kiln.kernel
    def dma_rows(x: kiln.Tensor[bf16, 2], out: kiln.Tensor[bf16, 2]):
        """Each lane DMAs 8 elements (16 bytes) of row lane // 8; the wave's pieces land in
        lane order, so the 8 x 64 tile arrives row-major."""
        lane = kiln.thread_id(0)
        tile = kiln.shared((8, 64), bf16)
        src = amd_buffer.buffer(x)
        row, col = lane // 8, (lane % 8) * 8
        token = amd_buffer.copy_to_lds(src, (row, col), tile, (0, 0), width=8)  # @dma
        if wait:
            amd_asm.s_waitcnt(vmcnt=0, waits_for=[token])
        amd_asm.s_barrier()
        out.store(row, col, tile.load(row, col, width=8))  # @lds-read

    return dma_rows


def test_dma_lands_at_the_waitcnt():
    x = np.random.default_rng().standard_normal((6, 64)).astype(ml_dtypes.bfloat16)
    out = np.full((8, 64), np.nan, np.float32).astype(ml_dtypes.bfloat16)
    make_dma_kernel(True).interpret[(1,)](x, out, num_warps=1, target="gfx950")
    np.testing.assert_array_equal(out[:6], x)
    assert not out[6:].astype(np.float32).any()  # rows past x read as zeros


def test_reading_lds_before_the_dma_waitcnt_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((8, 64)).astype(ml_dtypes.bfloat16)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_dma_kernel(False).interpret[(1,)](x, np.zeros_like(x), num_warps=1,
                                               target="gfx950")
    err = info.value
    assert err.loc.line == marker_line("@lds-read")
    assert f":{marker_line('@dma')}" in err.message and "DMA" in err.message


@pytest.mark.parametrize("shape", [(32, 32, 16), (16, 16, 32), (32, 32, 8)])
def test_mfma_atom_through_fragment_layouts(shape):
    m, n, k = shape
    kpl = m * k // WAVE

    @kiln.kernel
    def one_mfma(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2]):
        """Lane l loads its A row l % m (K run (l // m) * kpl ..), its B column l % n (B given
        as N x K), multiplies once, stores C through the accumulator layout."""
        lane = kiln.thread_id(0)
        atom = mma.atom(m, n, k, bf16)
        a_frag = a.load(lane % m, (lane // m) * kpl, width=kpl)
        b_frag = b.load(lane % n, (lane // n) * kpl, width=kpl)
        acc = atom(a_frag, b_frag, kiln.values.constant(0.0, f32, (m * n // WAVE,)))
        mfma.store_accumulator(acc, c, 0, 0)

    rng = np.random.default_rng()
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    bt = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    one_mfma.interpret[(1,)](a, bt, c, num_warps=1, target="gfx950")
    np.testing.assert_allclose(c, a.astype(np.float64) @ bt.astype(np.float64).T, rtol=1e-5,
                               atol=1e-5)
