"""The compile-cache key is sound: every input that changes the generated code is in it.

Helpers and globals in other modules, plain Python functions called at trace time, dict and
numpy globals, constexpr types (2 / 2.0 / True / 0.0 / -0.0) and array contents, Kiln's own
``kernels/`` sources, the target and every compile option, and the external tools.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from source_modules import load_module

import kiln
from kiln import f32
from kiln.fingerprint import constexpr_key, keyword_key_part
from kiln.runtime import cache
from kiln.core.options import CompileOptions
from kiln.driver import source_key


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kiln-cache"))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    yield tmp_path / "kiln-cache"


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """``modules(name, source)`` writes ``tmp_path/<name>.py`` and (re)imports it, as a new
    process would after an edit of the file."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc after a same-size edit
    written = []

    def write(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source).lstrip())
        written.append(name)
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        return importlib.import_module(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


HELPER = """
import kiln

FACTOR = {factor}

def factor():
    return {returned}

@kiln.func
def scale(v):
    return v * FACTOR * factor()
"""

KERNEL = """
import kiln
import helpers
from kiln import f32
from helpers import scale

@kiln.kernel
def by_name(x: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    x[i] = scale(x[i])

@kiln.kernel
def by_attribute(x: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    x[i] = helpers.scale(x[i]) + helpers.FACTOR
"""


def _compile_both(modules, factor: str, returned: str) -> tuple[str, str]:
    modules("helpers", HELPER.format(factor=factor, returned=returned))
    kernels = modules("kernels_under_test", KERNEL)
    x = np.zeros(4, np.float32)
    return tuple(k.compile(x, target="gfx950").asm["kiln"]
                 for k in (kernels.by_name, kernels.by_attribute))


@pytest.mark.lower
def test_editing_a_helper_modules_global_changes_the_binary(modules):
    before = _compile_both(modules, "2.0", "1.5")
    # A warm cache and a new value in the helper's module:
    after = _compile_both(modules, "7.25", "1.5")
    for old, new in zip(before, after):
        assert "7.250000e+00" not in old and "7.250000e+00" in new


@pytest.mark.lower
def test_editing_a_plain_python_helper_changes_the_binary(modules):
    # factor() is plain Python the @kiln.func calls at trace time, in another module.
    before = _compile_both(modules, "2.0", "1.5")
    after = _compile_both(modules, "2.0", "3.75")
    for old, new in zip(before, after):
        assert "3.750000e+00" not in old and "3.750000e+00" in new


TABLE = {"scale": 2.0}
NP_SCALE = np.float32(2.0)


@kiln.kernel
def reads_dict_and_numpy_globals(x: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    x[i] = x[i] * TABLE["scale"] + NP_SCALE


@pytest.mark.parametrize("name,value", [("TABLE", {"scale": 3.0}), ("TABLE", {"scale": 2}),
                                        ("NP_SCALE", np.float32(3.0)),
                                        ("NP_SCALE", np.float64(2.0))])
def test_dict_and_numpy_scalar_globals_enter_the_key(monkeypatch, name, value):
    before = source_key(reads_dict_and_numpy_globals.fn)
    monkeypatch.setitem(reads_dict_and_numpy_globals.fn.__globals__, name, value)
    assert source_key(reads_dict_and_numpy_globals.fn) != before


@pytest.mark.lower
def test_a_changed_dict_global_compiles_a_new_kernel(modules):
    source = """
    import kiln
    from kiln import f32
    TABLE = {table}

    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        x[kiln.thread_id(0)] = TABLE["scale"]
    """
    x = np.zeros(4, np.float32)
    old, new = (modules("dict_global", source.format(table=table)).k.compile(x, target="gfx950")
                for table in ('{"scale": 2.0}', '{"scale": 5.5}'))
    assert "5.500000e+00" in new.asm["kiln"] and "5.500000e+00" not in old.asm["kiln"]


@kiln.kernel
def reads_table(x: kiln.Tensor[f32], W: kiln.constexpr):
    x[0] = float(W[1000])


def test_constexpr_arrays_are_keyed_by_their_bytes(cache_dir):
    # Same dtype, shape and (truncated) repr; element 1000 differs.
    first, second = np.zeros(2000, np.float32), np.zeros(2000, np.float32)
    first[1000], second[1000] = 1.5, 2.5
    assert repr(first) == repr(second)
    x = np.full(4, np.nan, np.float32)
    reads_table.interpret[1](x, W=first)
    assert x[0] == 1.5
    reads_table.interpret[1](x, W=second)
    assert x[0] == 2.5
    for w, text in ((first, "1.500000e+00"), (second, "2.500000e+00")):
        assert text in reads_table.compile(x, W=w, target="gfx950").asm["kiln"]
    third = second.astype(np.float64)  # same values, another dtype: its own key
    assert reads_table.compile(x, W=third, target="gfx950") is not \
        reads_table.compile(x, W=second, target="gfx950")


def test_kiln_kernels_sources_are_in_the_key(monkeypatch, tmp_path):
    import kiln.kernels

    decode = Path(kiln.kernels.__file__).parent / "attention" / "decode.py"
    edited = tmp_path / "decode.py"
    edited.write_bytes(decode.read_bytes() + b"\n# edited\n")
    listed = cache._python_files

    def with_edited_decode(directory, prefix):
        return [(relative, str(edited) if Path(path).resolve() == decode.resolve() else path)
                for relative, path in listed(directory, prefix)]

    cache.toolchain_versions.cache_clear()
    cache._compiler_source_hash.cache_clear()
    before = cache.make_key("kernel")
    assert ("attention/decode.py", str(decode)) in [
        (relative, str(Path(path).resolve())) for relative, path in
        listed(str(Path(kiln.kernels.__file__).resolve().parent), "")]
    monkeypatch.setattr(cache, "_python_files", with_edited_decode)
    cache.toolchain_versions.cache_clear()
    cache._compiler_source_hash.cache_clear()
    try:
        assert cache.make_key("kernel") != before
    finally:
        monkeypatch.undo()
        cache.toolchain_versions.cache_clear()
        cache._compiler_source_hash.cache_clear()
    assert cache.make_key("kernel") == before


def test_distribution_versions_are_the_installed_ones():
    from importlib import metadata

    for name in ("numpy", "llvmlite", "xtc-mlir-python-bindings"):
        assert cache._distribution_version(name) == metadata.version(name)
    assert cache._distribution_version("kiln-no-such-distribution") == "absent"


def test_the_numpy_version_enters_the_key(monkeypatch):
    # Value fingerprints hash numpy's bytes and dtype strings.
    before = cache.make_key("kernel")
    real = cache._distribution_version
    monkeypatch.setattr(cache, "_distribution_version",
                        lambda name: "99.0" if name == "numpy" else real(name))
    cache.toolchain_versions.cache_clear()
    try:
        assert cache.make_key("kernel") != before
    finally:
        monkeypatch.undo()
        cache.toolchain_versions.cache_clear()


def test_external_tools_are_looked_up_for_every_key(monkeypatch, tmp_path):
    tool = tmp_path / "ld.lld"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("KILN_LD_LLD", str(tool))
    before = cache.make_key("kernel")
    other = tmp_path / "ld.lld-other"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("KILN_LD_LLD", str(other))  # same process, another linker
    assert cache.make_key("kernel") != before


@kiln.kernel
def typed(y: kiln.Tensor[f32], D: kiln.constexpr):
    y[0] = -7 // D if D else 0.0
    y[1] = len(repr(D))
    y[2] = math.copysign(1.0, D)


TYPED_VALUES = (2, 2.0, True, 0.0, -0.0)


def test_constexprs_of_equal_value_but_other_type_or_sign_specialise_apart():
    # 2 == 2.0 == True and 0.0 == -0.0 in Python; each must trace its own kernel.
    y = np.full(3, np.nan, np.float32)
    for value in TYPED_VALUES:
        typed.interpret[1](y, D=value)
        expected = [-7 // value if value else 0.0, len(repr(value)), math.copysign(1.0, value)]
        np.testing.assert_array_equal(y, expected)
    assert len(typed._interpret_traces) == len(TYPED_VALUES)


@pytest.mark.lower
def test_typed_constexprs_compile_apart_in_memory_and_on_disk():
    y = np.zeros(3, np.float32)
    compiled = [typed.compile(y, D=v, target="gfx950") for v in (2, 2.0, True)]
    assert len({id(c) for c in compiled}) == 3
    # repr(D) is 1, 3 and 4 characters long: each kernel stores its own length.
    for c, length in zip(compiled, (1, 3, 4)):
        assert f"{float(length):e}" in c.asm["kiln"]
    zero, negative_zero = (typed.compile(y, D=v, target="gfx950") for v in (0.0, -0.0))
    assert zero is not negative_zero and zero.asm["kiln"] != negative_zero.asm["kiln"]


def test_launch_keys_are_typed():
    keys = {constexpr_key(v) for v in TYPED_VALUES}
    assert len(keys) == len(TYPED_VALUES)
    assert len({keyword_key_part(("D", v)) for v in TYPED_VALUES}) == len(TYPED_VALUES)
    assert constexpr_key(float("nan")) == constexpr_key(-float("nan") * 0 + float("nan"))


class Holder:
    """A mutable object a kernel reads: no sound content key."""

    scale = 2.0


STATE = Holder()


@kiln.kernel
def reads_an_object(x: kiln.Tensor[f32]):
    x[0] = STATE.scale  # @reads-state


def test_an_unkeyable_global_is_a_kiln_type_error(marker_line):
    with pytest.raises(kiln.KilnTypeError) as err:
        reads_an_object.compile(np.zeros(4, np.float32), target="gfx950")
    assert "STATE" in str(err.value) and "Holder" in str(err.value)
    assert "kiln.constexpr" in err.value.fix
    assert (err.value.loc.filename, err.value.loc.line) == (__file__, marker_line("@reads-state"))


@functools.lru_cache(maxsize=None)
def cached_width(n):
    return n * 2


@kiln.kernel
def reads_library_objects(x: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    x[i] = x[i] * float(np.float32(math.pi)) + float(np.exp(0.0)) + cached_width(1)


def test_library_objects_and_wrapped_helpers_are_keyed_without_error(monkeypatch):
    before = source_key(reads_library_objects.fn)
    assert before == source_key(reads_library_objects.fn)
    # The lru_cache wrapper is followed to the function it wraps.
    monkeypatch.setitem(reads_library_objects.fn.__globals__, "cached_width",
                        functools.lru_cache(maxsize=None)(lambda n: n * 3))
    assert source_key(reads_library_objects.fn) != before


def test_an_unkeyable_constexpr_is_a_kiln_type_error():
    with pytest.raises(kiln.KilnTypeError) as err:
        typed.interpret[1](np.zeros(3, np.float32), D=Holder())
    assert "'D'" in str(err.value) and "Holder" in str(err.value)


@kiln.kernel
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], a: f32):
    i = kiln.thread_id(0)
    y[i] = a * x[i] + y[i]


@pytest.mark.lower
def test_another_target_gets_its_own_binary_from_a_warm_cache():
    x = np.zeros(64, np.float32)
    fresh = kiln.kernel(saxpy.fn)  # no in-memory entries: only the disk cache can answer
    gfx950 = fresh.compile(x, x, 2.0, target="gfx950")
    gfx942 = kiln.kernel(saxpy.fn).compile(x, x, 2.0, target="gfx942")
    assert gfx950.target.name == "gfx950" and gfx942.target.name == "gfx942"
    assert "gfx942" in gfx942.asm["amdgcn"] and "gfx950" not in gfx942.asm["amdgcn"]
    again = kiln.kernel(saxpy.fn).compile(x, x, 2.0, target="gfx942")  # a hit this time
    assert again.asm["amdgcn"] == gfx942.asm["amdgcn"]


@pytest.mark.parametrize("option", [f.name for f in dataclasses.fields(CompileOptions)])
def test_every_compile_option_is_in_the_key(option):
    base = CompileOptions("sm_90a", num_warps=4, opt_level=3, ptx_version=None, maxnreg=None)
    changed = {"target": "sm_80", "num_warps": 8, "opt_level": 2, "ptx_version": 83,
               "maxnreg": 128, "flush_denormals": True}
    assert option in changed, f"a new CompileOptions field {option}: add it to this test"
    assert dataclasses.replace(base, **{option: changed[option]}).key() != base.key()


def test_a_constexpr_function_is_keyed_by_its_code_not_its_address():
    from kiln.fingerprint import DependencyWalk

    def make():
        return lambda v: v * 2.0

    assert DependencyWalk().value(make()) == DependencyWalk().value(make())
    assert "0x" not in DependencyWalk().value(make())


class _NoDerivedMaps:
    """A signature whose trace derived no tensor maps (what a launch entry asks of it)."""

    @staticmethod
    def sources():
        return ()


class _RecordingLaunch:
    """Stands in for a compiled kernel: records which specialisation each launch used."""
    signature = _NoDerivedMaps()

    def __init__(self, label, log):
        self.label, self.log = label, log

    def launch(self, grid, runtime, stream=None):
        self.log.append(self.label)


@pytest.mark.parametrize("by_keyword", [True, False])
def test_launches_specialise_typed_constexprs_apart(monkeypatch, by_keyword):
    kernel = kiln.kernel(typed.fn)
    prepared, launched = [], []

    def prepare(args, kwargs):
        d = kwargs.get("D", args[-1] if len(args) > 1 else None)
        prepared.append(d)
        return _RecordingLaunch(repr(d), launched), {}, True

    monkeypatch.setattr(kernel, "_prepare_launch", prepare)
    y = np.zeros(3, np.float32)
    for _ in range(2):
        for value in TYPED_VALUES:
            if by_keyword:
                kernel[1](y, D=value)
            else:
                kernel[1](y, value)
    assert [repr(v) for v in prepared] == [repr(v) for v in TYPED_VALUES]
    assert launched == [repr(v) for v in TYPED_VALUES] * 2


def test_a_constexpr_holding_itself_is_a_kiln_type_error():
    looped = [1]
    looped.append(looped)
    with pytest.raises(kiln.KilnTypeError, match="cannot key by content"):
        kiln.kernel(typed.fn).trace(np.zeros(3, np.float32), looped)


def test_nan_keyword_launches_reuse_one_entry(monkeypatch):
    # NaN != NaN: a fresh NaN object can never hit a fast key, so none may be stored for it.
    kernel = kiln.kernel(typed.fn)
    launched = []
    monkeypatch.setattr(kernel, "_prepare_launch",
                        lambda args, kwargs: (_RecordingLaunch("nan", launched), {}, True))
    y = np.zeros(3, np.float32)
    for _ in range(5):
        kernel[1](y, D=float("nan"))
    assert launched == ["nan"] * 5
    assert len(kernel._launches) == 1  # the typed key only


def test_the_same_kernel_in_another_file_of_the_same_module_name_gets_a_new_key(tmp_path):
    # Equal code objects in two files compare equal (co_filename is not compared): the key
    # must still name each file, whose path the compiled kernel's locations carry.
    keys = []
    for folder in ("checkout_a", "checkout_b"):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "same.py"
        path.write_text(textwrap.dedent(KERNEL_TEXT).lstrip())
        keys.append(source_key(load_module(path, "same").k.fn))
    assert keys[0] != keys[1]


def test_the_same_kernel_in_another_file_traces_with_that_files_locations(tmp_path):
    # The rewritten code is shared by equal code objects: it must not be shared across files.
    x = np.zeros(4, np.float32)
    for folder in ("copy_a", "copy_b"):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "same.py"
        path.write_text(textwrap.dedent(KERNEL_TEXT).lstrip())
        asm = load_module(path, "same").k.trace(x).module_asm
        assert f'"{path}"' in asm and ("copy_a" in asm) == (folder == "copy_a")


MAIN_CLASS_TEXT = """
from kiln.fingerprint import DependencyWalk

class Config:
    def rows(self):
        return 1

first = DependencyWalk().value(Config)

class Config:
    def rows(self):
        return 2

print(first != DependencyWalk().value(Config))
"""


def test_classes_of_a_main_without_a_file_are_keyed_by_content():
    # `python -c`, a REPL or a notebook: __main__ has no __file__, its classes are user code.
    done = subprocess.run([sys.executable, "-c", MAIN_CLASS_TEXT], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


KERNEL_TEXT = """
import kiln
from kiln import f32

@kiln.kernel
def k(x: kiln.Tensor[f32]):
    x[kiln.thread_id(0)] = 1.0
"""


def test_a_launch_with_an_extra_argument_is_not_a_cache_hit(monkeypatch):
    kernel = kiln.kernel(typed.fn)

    def prepare(args, kwargs):  # binds the arguments, as compiling does
        kernel._bind(args, kwargs)
        return _RecordingLaunch("ok", []), {}, True

    monkeypatch.setattr(kernel, "_prepare_launch", prepare)
    y = np.zeros(3, np.float32)
    kernel[1](y, 2)
    with pytest.raises(kiln.KilnTypeError, match="bad arguments"):
        kernel[1](y, 2, 3)
