"""The on-disk cache key follows everything a kernel's trace depends on besides its arguments."""

import dataclasses
import importlib.util

import numpy as np
import pytest

import kiln
from kiln import f32
from kiln.driver import source_key

SCALE = 2.0


@dataclasses.dataclass(frozen=True)
class Config:
    unroll: int


def make_kernel(op, config):
    @kiln.kernel
    def apply(x: kiln.Tensor[f32]):
        i = kiln.thread_id(0)
        for _ in kiln.static_range(config.unroll):
            x[i] = op(x[i])

    return apply


@kiln.kernel
def scaled(x: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    x[i] = x[i] * SCALE


def test_factory_kernels_differ_by_captured_function_and_config():
    keys = {source_key(make_kernel(op, Config(u)).fn)
            for op in (lambda v: v + 1.0, lambda v: v * 3.0) for u in (1, 2)}
    assert len(keys) == 4


def test_module_global_constant_enters_the_key(monkeypatch):
    before = source_key(scaled.fn)
    monkeypatch.setitem(scaled.fn.__globals__, "SCALE", 3.0)
    assert source_key(scaled.fn) != before


@pytest.mark.lower
def test_factory_kernels_do_not_share_cache_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    x = np.zeros(4, np.float32)
    add = make_kernel(lambda v: v + 1.0, Config(1)).compile(x, target="gfx950")
    mul = make_kernel(lambda v: v * 3.0, Config(1)).compile(x, target="gfx950")
    assert "arith.addf" in add.asm["kiln"] and "arith.mulf" in mul.asm["kiln"]


MOVED_KERNEL = """
import kiln
from kiln import f32
{blank}
@kiln.kernel
def moved(x: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    x[i] = x[i] * 2.0
"""


def _moved_kernel(path, blank_lines: int):
    """The same kernel text, ``blank_lines`` lower in a module at ``path``."""
    path.write_text(MOVED_KERNEL.format(blank="\n" * blank_lines))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.moved


def test_a_kernel_that_moves_gets_a_new_key(tmp_path):
    first = _moved_kernel(tmp_path / "first.py", 0)
    keys = {source_key(first.fn), source_key(_moved_kernel(tmp_path / "lower.py", 1).fn),
            source_key(_moved_kernel(tmp_path / "other.py", 0).fn)}
    assert len(keys) == 3
    assert source_key(_moved_kernel(tmp_path / "first.py", 0).fn) == source_key(first.fn)


@pytest.mark.lower
def test_a_moved_kernel_reports_its_own_location_after_a_cache_hit(tmp_path, monkeypatch):
    # Compiled kernels carry source locations: a cache entry of the same text elsewhere (another
    # checkout, a line added above) must not hand them out.
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    x = np.zeros(4, np.float32)
    _moved_kernel(tmp_path / "first.py", 0).compile(x, target="gfx950")
    moved = _moved_kernel(tmp_path / "second.py", 3).compile(x, target="gfx950")
    assert str(tmp_path / "second.py") in moved.asm["kiln"]
    assert str(tmp_path / "first.py") not in moved.asm["kiln"]
