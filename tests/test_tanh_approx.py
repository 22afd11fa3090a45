"""kiln.tanh_approx, the op added through the registry (docs/architecture.md "Adding an op"):
its declaration, the PTX it emits, its refusal on AMD, its interpreter semantics against a
float64 tanh, and the soft-cap path that uses it on NVIDIA."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir

import kiln
from kiln.core.errors import KilnTypeError, TargetError
from kiln.core.ops import NO_EFFECTS, all_ops, declared, lookup
from kiln.nvidia.fastmath import TANH_APPROX, TANH_APPROX_REL_ERROR

N = 128


@kiln.kernel
def tanh_scalar(x: kiln.Tensor[kiln.f32, 1], out: kiln.Tensor[kiln.f32, 1]):
    i = kiln.thread_id(0)
    out[i] = kiln.tanh_approx(x[i])


@kiln.kernel
def tanh_vector(x: kiln.Tensor[kiln.f32, 1], out: kiln.Tensor[kiln.f32, 1]):
    i = kiln.thread_id(0)
    y = kiln.tanh_approx(kiln.pack([x[i], x[i + N]]))  # a vector<2xf32>
    a, b = kiln.unpack(y)
    out[i] = a
    out[i + N] = b


@kiln.kernel
def tanh_bf16(x: kiln.Tensor[kiln.bf16, 1], out: kiln.Tensor[kiln.f32, 1]):
    i = kiln.thread_id(0)
    out[i] = kiln.tanh_approx(x[i])  # cast to f32 first


def _inputs(rng, n):
    # Both signs, near zero, past saturation (|x| > 9: tanh is 1 in f32) and odd magnitudes.
    return np.concatenate([rng.standard_normal(n - 4) * 4.0, [0.0, -1e-30, 40.0, -87.0]]) \
        .astype(np.float32)


@pytest.mark.parametrize("kernel,width", [(tanh_scalar, 1), (tanh_vector, 2)],
                         ids=["scalar", "vector"])
def test_interpreter_is_f32_tanh(kernel, width, rng):
    x = _inputs(rng, N * width)
    out = np.full_like(x, np.nan)  # poisoned
    kernel.interpret[1](x, out, target="sm_90a", num_warps=4)
    want = np.tanh(x.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=2 ** -23, atol=1e-37)
    assert out.dtype == np.float32 and out[-2] == 1.0 and out[-1] == -1.0


def test_bf16_input_is_cast_to_f32(rng):
    x = _inputs(rng, N).astype(kiln.bf16.numpy)
    out = np.full(N, np.nan, np.float32)
    tanh_bf16.interpret[1](x, out, target="sm_90a", num_warps=4)
    np.testing.assert_allclose(out, np.tanh(x.astype(np.float64)), rtol=2 ** -23, atol=1e-37)


@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_ptx_is_one_tanh_approx_per_element(target):
    x = np.zeros(2 * N, np.float32)
    asm = tanh_vector.compile(x, x, target=target, num_warps=4).asm
    assert 'kiln.op = "nvidia.fastmath.tanh_approx"' in asm["nvvm"]
    assert asm["ptx"].count("tanh.approx.f32") == 2
    assert "ex2.approx" not in asm["ptx"] and "rcp" not in asm["ptx"]


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_refused_on_amd(target):
    x = np.zeros(N, np.float32)
    with pytest.raises(TargetError, match=r"(?s)test_tanh_approx.py:\d+.*kiln.tanh_approx.*sm_90a"):
        tanh_scalar.compile(x, x, target=target, num_warps=4)


def test_integer_input_is_refused():
    @kiln.kernel
    def k(x: kiln.Tensor[kiln.i32, 1], out: kiln.Tensor[kiln.f32, 1]):
        out[0] = kiln.tanh_approx(x[0])

    with pytest.raises(KilnTypeError, match="floats"):
        k.trace(np.zeros(1, np.int32), np.zeros(1, np.float32), target="sm_90a")


def test_declaration():
    assert declared("nvidia.fastmath.tanh_approx") is TANH_APPROX in all_ops()
    assert TANH_APPROX.feature == "ptx" and TANH_APPROX.effects == NO_EFFECTS
    assert TANH_APPROX.interpret is not None
    assert TANH_APPROX_REL_ERROR == 2.0 ** -11
    x = np.zeros(N, np.float32)
    text = tanh_scalar.trace(x, x, target="sm_90a").module_asm
    found = []

    def walk(op):
        if lookup(op) is TANH_APPROX:
            found.append(op)
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner.operation)

    with ir.Context(), ir.Location.unknown():
        walk(ir.Module.parse(text).operation)
        # No side effects: LLVM may CSE or sink it like any arithmetic.
        assert len(found) == 1 and "has_side_effects" not in found[0].attributes


def test_softcap_error_budget():
    """tanh.approx errs relative to the capped score c (log2 units scale both sides by log2 e):
    at most |c| 2**-11, 8x under the |c| 2**-8 a bf16 rounding of c costs."""
    bf16_unit_roundoff = 2.0 ** -8
    assert TANH_APPROX_REL_ERROR * 8 <= bf16_unit_roundoff
