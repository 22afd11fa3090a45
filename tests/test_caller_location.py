"""``kiln.core.errors.caller_location``: the one helper that finds the user's line on the stack."""

import os

import pytest

import kiln
from kiln.core.errors import caller_location

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kiln.core.errors.__file__)))


def _function_in(path: str, source: str, name: str):
    """``name`` from ``source`` compiled as if it lived at ``path`` (frames report that file)."""
    namespace = {"caller_location": caller_location}
    exec(compile(source, path, "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("layout", ["checkout", "wheel"])
def test_callers_of_names_the_library_kernel_line_that_called_the_module(layout, monkeypatch):
    if layout == "wheel":  # kiln/kernels/ sits inside the package directory, a compiler dir
        monkeypatch.setattr(kiln.core.errors, "_COMPILER_DIRS",
                            (os.path.join(SOURCE_ROOT, "kernels") + os.sep,))
    helper_path = os.path.join(SOURCE_ROOT, "kernels", "attention", "helper.py")
    kernel_path = os.path.join(SOURCE_ROOT, "kernels", "attention", "kernel.py")
    helper = _function_in(helper_path, "def where(callers_of):\n"
                                       "    return caller_location(callers_of=callers_of)\n"
                                       "def where_user():\n"
                                       "    return caller_location()\n", "where")
    where_user = helper.__globals__["where_user"]
    kernel = _function_in(kernel_path, "\n\ndef body(f, *a):\n    return f(*a)\n", "body")
    # Called from a library kernel: that kernel's line, not the helper's or this test's.
    assert kernel(helper, helper_path) == kiln.core.errors.SourceLoc(kernel_path, 4)
    # Without callers_of every kernel-library frame is Kiln's own: this test's line.
    loc = kernel(where_user)
    assert loc.filename == __file__ and loc.line > 0
    # Called straight from user code: the user's line.
    loc = helper(helper_path)
    assert loc.filename == __file__
