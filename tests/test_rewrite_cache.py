"""The AST rewrite kept on disk (dsl/rewrite_cache.py): a fresh process reuses it, an edited
function or a damaged entry is rewritten again, ``KILN_NO_CACHE`` turns it off, and errors
still point at the user's column from a reused rewrite."""

import subprocess
import sys

import pytest
from source_modules import write_kernel_module

from kiln import rewrite_cache

_KERNEL = """
    import kiln
    from kiln import f32, i32

    @kiln.kernel(num_threads="BLOCK")
    def axpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
        if i < n:
            y[i] = {expr}
"""

# In a fresh process: trace axpy, report how many rewrites ran and the traced IR's size.
_CHILD = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import kiln.ast_rewrite as rewrite
calls = []
real = rewrite._rewrite_source
rewrite._rewrite_source = lambda *a: calls.append(1) or real(*a)
import {module} as m
x = np.zeros(8, np.float32)
traced = m.axpy.trace(x, x, 8, BLOCK=32)
print(len(calls), traced.module_asm.count("arith.mulf"))
"""


def _trace_in_a_fresh_process(module, cache, no_cache=False):
    env = {"KILN_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    if no_cache:
        env["KILN_NO_CACHE"] = "1"
    done = subprocess.run([sys.executable, "-c", _CHILD.format(module=module.__name__),
                           str(module.__file__).rsplit("/", 1)[0]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rewrites, products = map(int, done.stdout.split())
    return rewrites, products


def test_a_fresh_process_reuses_the_rewrite(tmp_path):
    module = write_kernel_module(tmp_path, "rewrite_reuse", _KERNEL.format(expr="2.0 * x[i]"))
    cache = tmp_path / "cache"
    assert _trace_in_a_fresh_process(module, cache) == (1, 1)
    assert len(list((cache / "rewrite").iterdir())) == 1
    assert _trace_in_a_fresh_process(module, cache) == (0, 1)  # reused: no rewrite ran
    assert _trace_in_a_fresh_process(module, cache, no_cache=True) == (1, 1)


def test_an_edited_function_or_a_damaged_entry_is_rewritten(tmp_path):
    cache = tmp_path / "cache"
    module = write_kernel_module(tmp_path, "rewrite_edit", _KERNEL.format(expr="2.0 * x[i]"))
    assert _trace_in_a_fresh_process(module, cache) == (1, 1)
    (entry,) = (cache / "rewrite").iterdir()
    entry.write_bytes(b"\x00not marshal data")
    assert _trace_in_a_fresh_process(module, cache) == (1, 1)  # a miss, and stored again
    edited = write_kernel_module(tmp_path, "rewrite_edit",
                                 _KERNEL.format(expr="2.0 * x[i] * x[i]"))
    assert _trace_in_a_fresh_process(edited, cache) == (1, 2)  # its new source: a new entry
    assert len(list((cache / "rewrite").iterdir())) == 2


def test_keys_cover_source_place_and_python():
    base = rewrite_cache.key_of("def f(): pass\n", "/a.py", 3)
    assert base == rewrite_cache.key_of("def f(): pass\n", "/a.py", 3)
    assert len({base, rewrite_cache.key_of("def f(): return\n", "/a.py", 3),
                rewrite_cache.key_of("def f(): pass\n", "/b.py", 3),
                rewrite_cache.key_of("def f(): pass\n", "/a.py", 4)}) == 4


def test_untrusted_or_missing_entries_are_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    key = rewrite_cache.key_of("x", "/x.py", 1)
    assert rewrite_cache.load(key) is None
    code = compile("y = 1", "/x.py", "exec")
    rewrite_cache.store(key, code)
    assert rewrite_cache.load(key) == code
    (tmp_path / "cache").chmod(0o777)  # writable by others: not trusted, nothing read
    with pytest.warns(Warning):
        assert rewrite_cache.load(key) is None
