"""Environment variables and target names: a bad value is a KilnError naming what it takes."""

import numpy as np
import pytest
from sample_kernels import saxpy

import kiln
from kiln.core import env
from kiln.core.errors import KilnValueError, TargetError
from kiln.runtime import cache
from kiln.lowering import tools
from kiln.core.targets import TARGETS, get_target

X = np.arange(8, dtype=np.float32)
FLAGS = {"KILN_NO_CACHE": env.cache_disabled, "KILN_SHOW_STACKTRACE": env.show_stacktrace,
         "KILN_INTERPRET_CHECK_BOUNDS": env.interpret_check_bounds,
         "KILN_LAUNCH_BLOCKING": env.launch_blocking}


@pytest.mark.parametrize("name", FLAGS)
def test_flags_accept_the_usual_spellings(name, monkeypatch):
    for value, expected in [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                            ("0", False), ("false", False), ("NO", False), ("off", False)]:
        monkeypatch.setenv(name, value)
        assert FLAGS[name]() is expected, value
    monkeypatch.setenv(name, "")
    assert FLAGS[name]() is (name == "KILN_INTERPRET_CHECK_BOUNDS")  # empty: the default


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_other_flag_values_are_errors_naming_the_variable(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(KilnValueError, match=f"{name}='{value}'.*1/true/yes/on or 0/false/no/off"):
        FLAGS[name]()


def test_interpret_timeout_takes_positive_finite_seconds(monkeypatch):
    monkeypatch.delenv("KILN_INTERPRET_TIMEOUT", raising=False)
    assert env.interpret_timeout() == 60.0
    monkeypatch.setenv("KILN_INTERPRET_TIMEOUT", " 2.5 ")
    assert env.interpret_timeout() == 2.5
    for bad in ("abc", "0", "-1", "nan", "inf", "1e999"):
        monkeypatch.setenv("KILN_INTERPRET_TIMEOUT", bad)
        with pytest.raises(KilnValueError, match=r"KILN_INTERPRET_TIMEOUT=.*finite and > 0") as err:
            env.interpret_timeout()
        assert "Fix: set KILN_INTERPRET_TIMEOUT" in str(err.value)


def test_fuzz_examples_takes_a_positive_whole_number(monkeypatch):
    monkeypatch.delenv("KILN_FUZZ_EXAMPLES", raising=False)
    assert env.fuzz_examples(40) == 40
    monkeypatch.setenv("KILN_FUZZ_EXAMPLES", " 2000 ")
    assert env.fuzz_examples(40) == 2000
    for bad in ("0", "-3", "1.5", "many", "\u00b2", "\u0663"):  # superscript 2, Arabic-Indic 3
        monkeypatch.setenv("KILN_FUZZ_EXAMPLES", bad)
        with pytest.raises(KilnValueError, match="KILN_FUZZ_EXAMPLES=.*positive whole number"):
            env.fuzz_examples(40)


def test_a_bad_timeout_fails_an_interpreted_launch_cleanly(monkeypatch):
    monkeypatch.setenv("KILN_INTERPRET_TIMEOUT", "abc")
    y = X.copy()
    with pytest.raises(KilnValueError, match="KILN_INTERPRET_TIMEOUT='abc'"):
        saxpy.interpret[(1,)](X, y, 8, 2.0, BLOCK=8)


# ---- tool paths ----------------------------------------------------------------------------
@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    cache.toolchain_versions.cache_clear()  # the tools found enter the key
    yield
    cache.toolchain_versions.cache_clear()


@pytest.mark.lower
@pytest.mark.parametrize("warm", [False, True], ids=["compiled", "cache-hit"])
@pytest.mark.parametrize("variable, target", [("KILN_PTXAS", "sm_90a"), ("KILN_LD_LLD", "gfx942")])
def test_a_tool_variable_naming_no_file_fails_the_binary_stage(variable, target, warm, tmp_path,
                                                               monkeypatch, private_cache):
    monkeypatch.delenv(variable, raising=False)
    finder = "find_ptxas" if variable == "KILN_PTXAS" else "find_ld_lld"
    if warm:  # an entry compiled without the tool, which a bad variable must not fall back to
        with monkeypatch.context() as patch:
            patch.setattr(tools, finder, lambda: None)
            kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=64, target=target)
        monkeypatch.setattr(kiln.JITKernel, "_trace_specs", lambda *a: pytest.fail("missed"))
    missing = tmp_path / "no-such-tool"
    monkeypatch.setenv(variable, str(missing))
    with pytest.raises(KilnValueError, match=f"{variable}={missing} does not exist") as err:
        kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=64, target=target)
    assert f"point {variable} at" in str(err.value)
    not_executable = tmp_path / "tool.txt"
    not_executable.write_text("")
    monkeypatch.setenv(variable, str(not_executable))
    with pytest.raises(KilnValueError, match="is not an executable file"):
        kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=64, target=target)


def test_stage_tool_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CUOBJDUMP", str(tmp_path / "cuobjdump"))
    with pytest.raises(KilnValueError, match="KILN_CUOBJDUMP=.*does not exist"):
        tools.stage_tool("cuobjdump")
    tool = tmp_path / "cuobjdump"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert tools.stage_tool("cuobjdump") == tool
    monkeypatch.setenv("KILN_CUOBJDUMP", "None")  # skipped on purpose
    assert tools.stage_tool("cuobjdump") is None and tools.find_cuobjdump() is None
    monkeypatch.delenv("KILN_CUOBJDUMP")
    monkeypatch.setattr(tools, "find_cuobjdump", lambda: None)
    assert tools.stage_tool("cuobjdump") is None  # not set, not found: the stage is skipped


@pytest.mark.lower
def test_an_unset_missing_tool_still_skips_its_stage(monkeypatch, private_cache):
    monkeypatch.delenv("KILN_LD_LLD", raising=False)
    monkeypatch.setattr(tools, "find_ld_lld", lambda: None)
    ck = kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=64, target="gfx942")
    assert "obj" in ck.asm and "hsaco" not in ck.asm


@pytest.mark.lower
def test_none_skips_a_tool_stage_on_purpose(monkeypatch, private_cache):
    monkeypatch.setenv("KILN_PTXAS", "none")
    ck = kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=64, target="sm_90a")
    assert "ptx" in ck.asm and "cubin" not in ck.asm


# ---- target names --------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["", "   ", 90, b"sm_90a"])
def test_an_empty_or_non_string_target_is_an_error(target):
    with pytest.raises(TargetError, match="target must be a chip name") as err:
        get_target(target)
    assert all(name in str(err.value) for name in TARGETS)


@pytest.mark.parametrize("how", ["compile", "trace", "interpret"])
def test_kernels_reject_an_empty_target_instead_of_using_the_default(how):
    kernel = kiln.kernel(saxpy.fn)
    with pytest.raises(TargetError, match="target must be a chip name, got ''"):
        if how == "compile":
            kernel.compile(X, X, 8, 2.0, BLOCK=64, target="")
        elif how == "trace":
            kernel.trace(X, X, 8, 2.0, BLOCK=64, target="")
        else:
            kernel.interpret[(1,)](X, X.copy(), 8, 2.0, BLOCK=8, target="")

