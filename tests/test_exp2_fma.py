"""``exp2`` on the FMA pipe (kernels/attention/exp2_fma.py): its error against float64, its
clamps, exact powers of two, the PTX it emits, and the FP8 prefill with part of its softmax
exponentials emulated."""

import dataclasses
from unittest import mock

import numpy as np
import pytest

import kiln
from kiln.kernels.attention.exp2_fma import EXP2_FMA_REL_ERROR, HIGH, LOW, exp2_fma

N = 4096


@kiln.kernel(num_threads=128)
def _exp2_kernel(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.f32, 1]):
    for i in kiln.range(kiln.thread_id(0), N, 128):
        y[i] = exp2_fma(x[i])


def _run(x):
    y = np.full(N, np.nan, np.float32)  # poisoned
    _exp2_kernel.interpret[1](x.astype(np.float32), y, target="sm_90a")
    return y.astype(np.float64)


def test_relative_error_within_the_bound(rng):
    x = rng.uniform(LOW, HIGH, N).astype(np.float32)
    x[:64] = rng.uniform(-0.5, 0.5, 64)  # the polynomial's own interval
    x[64:128] = np.arange(64) * 0.5 + 0.25  # halfway cases of the rounding
    err = np.abs(_run(x) / np.exp2(x.astype(np.float64)) - 1)
    assert err.max() <= EXP2_FMA_REL_ERROR
    assert err.max() > EXP2_FMA_REL_ERROR / 4  # the bound is tight, not vacuous


def test_clamps_and_exact_powers_of_two():
    x = np.zeros(N, np.float32)
    x[:4] = [-np.inf, -1000.0, 200.0, np.inf]
    x[4:8] = [-125.0, 0.0, 7.0, 64.0]
    y = _run(x)
    assert (y[:2] == 2.0 ** LOW).all() and (y[2:4] == 2.0 ** HIGH).all()
    np.testing.assert_array_equal(y[4:8], np.exp2(x[4:8].astype(np.float64)))


@pytest.mark.lower
def test_ptx_has_no_mufu_exp2():
    x = np.zeros(N, np.float32)
    ptx = _exp2_kernel.compile(x, x, target="sm_90a").asm["ptx"]
    assert "ex2.approx" not in ptx and "fma.rn.f32" in ptx and "shl.b32" in ptx


def test_fp8_prefill_with_emulated_exponentials(rng):
    """8 and 32 of every 64 exponentials on the FMA pipe: the exact-P inputs stay exact (the
    emulation is exact on whole powers of two) with a causal mask and GQA."""
    from test_attention_prefill_fp8 import LN2, _check_exact, exact_problem

    from kiln.kernels.attention.prefill import prefill
    from kiln.kernels.attention.prefill_hopper_fp8_config import HopperFp8PrefillConfig

    default = HopperFp8PrefillConfig.for_head_dim
    for emulated in (8, 32):
        def config(*dims, emulated=emulated):
            return dataclasses.replace(default(*dims), emulated_exp2=emulated)

        (q8, k8, v8), descales, _, _ = exact_problem(rng, batch=2, sq=130, sk=200, hq=2, hkv=1,
                                                     d=128)
        with mock.patch.object(HopperFp8PrefillConfig, "for_head_dim", config):
            o, lse = prefill(q8, k8, v8, scale=LN2, return_lse=True, causal=True,
                             backend="interpret", target="sm_90a", **descales)
        _check_exact(o, lse, q8, k8, v8, descales, causal=True)


def test_bad_emulated_count_is_refused():
    from kiln.kernels.attention.prefill_hopper_fp8_config import HopperFp8PrefillConfig

    with pytest.raises(kiln.KilnValueError, match="emulated_exp2"):
        HopperFp8PrefillConfig(emulated_exp2=3)
