"""CompileOptions validation: every bad option is rejected in Python, naming this file and a Fix."""

import pytest

from kiln.core.errors import KilnValueError, TargetError
from kiln.core.options import CompileOptions


@pytest.mark.parametrize("kwargs, error, message, fix", [
    (dict(target="sm_42"), TargetError, "unknown target 'sm_42'", "use one of sm_80"),
    (dict(target="sm_90a", num_warps=0), KilnValueError, "num_warps=0 is out of range 1..32", "1..32 warps"),
    (dict(target="sm_90a", num_warps=33), KilnValueError, "num_warps=33 is out of range", "1..32 warps"),
    (dict(target="sm_90a", num_warps=4.0), KilnValueError, "num_warps must be an int", "num_warps=4"),
    (dict(target="gfx950", num_warps=32), KilnValueError, "gives 2048 threads per block",
     "num_warps <= 16"),
    (dict(target="sm_80", opt_level=4), KilnValueError, "opt_level=4 is out of range 0..3", "opt_level 0"),
    (dict(target="sm_90a", ptx_version=78), TargetError, "too old for sm_90a", "ptx_version >= 80"),
    (dict(target="sm_90a", ptx_version=89), TargetError, "not supported by this LLVM", "use one of 70"),
    (dict(target="sm_90a", maxnreg=16), KilnValueError, "maxnreg=16 is out of range 24..255",
     "maxnreg in 24..255"),
    (dict(target="gfx942", maxnreg=64), TargetError, "maxnreg is an NVIDIA option", "drop maxnreg"),
    (dict(target="gfx942", ptx_version=80), TargetError, "ptx_version is an NVIDIA option",
     "drop ptx_version"),
    (dict(target="gfx950", flush_denormals=True), TargetError,
     "flush_denormals is an NVIDIA option", "drop flush_denormals"),
    (dict(target="sm_90a", flush_denormals=1), KilnValueError, "flush_denormals must be a bool",
     "flush_denormals=True or False"),
])
def test_bad_option_is_rejected_with_location_and_fix(kwargs, error, message, fix):
    with pytest.raises(error) as caught:
        CompileOptions(**kwargs)
    text = str(caught.value)
    assert message in text
    assert "\nFix: " in text and fix in text.split("\nFix: ")[1]
    assert caught.value.loc is not None and caught.value.loc.filename == __file__


def test_valid_options_are_canonical_and_keyed():
    options = CompileOptions("SM90A", num_warps=8, maxnreg=128)
    assert options.target == "sm_90a"
    assert options.block_size == 256
    assert options.ptx_features() == "+ptx80"
    assert options.key() == "sm_90a/w8/O3/ptx80/r128"
    assert CompileOptions("gfx950", num_warps=16).block_size == 1024


def test_keys_differ_for_every_field():
    base = CompileOptions("sm_90a")
    variants = [CompileOptions("sm_80"), CompileOptions("sm_90a", num_warps=8),
                CompileOptions("sm_90a", opt_level=2), CompileOptions("sm_90a", ptx_version=83),
                CompileOptions("sm_90a", maxnreg=64),
                CompileOptions("sm_90a", flush_denormals=True)]
    keys = {base.key(), *(v.key() for v in variants)}
    assert len(keys) == 1 + len(variants)


@pytest.mark.lower
def test_flush_denormals_kernel_uses_the_flushing_exp2():
    import numpy as np

    import kiln

    def exp2_rows(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.f32, 1]):
        i = kiln.thread_id(0)
        y[i] = kiln.exp2(x[i]) * x[i]

    x = np.zeros(32, np.float32)
    flushing = kiln.kernel(flush_denormals=True)(exp2_rows).compile(x, x, target="sm_90a")
    plain = kiln.kernel(exp2_rows).compile(x, x, target="sm_90a")
    assert "ex2.approx.ftz.f32" in flushing.asm["ptx"] and "mul.rn.ftz.f32" in flushing.asm["ptx"]
    assert "ex2.approx.f32" in plain.asm["ptx"] and ".ftz" not in plain.asm["ptx"]


@pytest.mark.lower
def test_a_flush_denormals_kernel_compiles_for_amd_as_any_other():
    """The decorator's flush_denormals says what the kernel's numerics allow, so a portable
    kernel keeps it on every target; AMD (where the option is not offered) ignores it."""
    import numpy as np

    import kiln

    def exp2_rows(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.f32, 1]):
        i = kiln.thread_id(0)
        y[i] = kiln.exp2(x[i]) * x[i]

    x = np.zeros(64, np.float32)
    flushing = kiln.kernel(flush_denormals=True)(exp2_rows).compile(x, x, target="gfx950")
    plain = kiln.kernel(exp2_rows).compile(x, x, target="gfx950")
    assert flushing.asm["amdgcn"] == plain.asm["amdgcn"]
