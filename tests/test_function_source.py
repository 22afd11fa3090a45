"""``kiln.ast_rewrite.function_source``: the source the AST rewrite parses, found from the code's
positions instead of ``inspect``'s tokenizer, must parse to the same tree as ``inspect.getsource``
for every function (the library's, tricky endings, an edited file)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import sys
import textwrap
import types

import pytest

import kiln
import kiln.kernels
from kiln.ast_rewrite import function_source

TRICKY = '''
import functools


def trailing_else(x):
    if x:
        y = 1
    else:
        pass


class Holder:
    @staticmethod
    @functools.lru_cache(maxsize=None)
    def decorated(a,
                  b=(1,
                     2)):
        def inner():
            return [a,
                    b]
    # a comment at the def's column inside the method
        return inner
    # a trailing comment


def with_text():
    text = """a string
with lines at column 0
"""
    return text


def lambdas(xs):
    return sorted(xs, key=lambda v: (v,
                                     -v))


def only_doc():
    """Nothing else."""
'''


def _tree(source: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(source)))


def _functions(module) -> set:
    found = set()
    for value in vars(module).values():
        candidates = [value, getattr(value, "fn", None)]
        if isinstance(value, type):
            for member in vars(value).values():
                candidates += [member, getattr(member, "__func__", None)]
        found |= {c for c in candidates if isinstance(c, types.FunctionType)
                  and c.__module__ == module.__name__}
    return found


def _library_modules():
    for info in pkgutil.walk_packages(kiln.kernels.__path__, "kiln.kernels."):
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # torch-only modules on a machine without torch
            continue


def test_every_library_function_parses_as_inspect_reads_it():
    functions = set()
    for module in _library_modules():
        functions |= _functions(module)
    assert len(functions) > 500
    checked = 0
    for fn in functions:
        try:
            reference = inspect.getsource(fn)
        except OSError:  # made from a string (no file): the rewrite raises for both
            continue
        assert _tree(function_source(fn)) == _tree(reference), fn.__qualname__
        checked += 1
    assert checked > 500


def test_tricky_endings(tmp_path, monkeypatch):
    (tmp_path / "tricky_source_mod.py").write_text(TRICKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("tricky_source_mod")
    functions = _functions(module) | {module.Holder.decorated.__wrapped__}
    assert len(functions) == 5
    for fn in functions:
        assert _tree(function_source(fn)) == _tree(inspect.getsource(fn)), fn.__qualname__
    assert "else:" in function_source(module.trailing_else)


def test_an_edited_file_is_read_again(tmp_path, monkeypatch):
    path = tmp_path / "edited_source_mod.py"
    path.write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_source_mod")
    assert "return 1" in function_source(module.f)
    path.write_text("def f():\n    x = 2\n    return x\n")
    importlib.invalidate_caches()
    sys.modules.pop("edited_source_mod")
    module = importlib.import_module("edited_source_mod")
    assert function_source(module.f) == "def f():\n    x = 2\n    return x\n"
