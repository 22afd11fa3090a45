"""The AST rewrite: traced if/for become scf.if/scf.for; Python conditions stay Python."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import f16, f32, i32

X = np.zeros(8, np.float32)


def trace(kern, *args, **kw):
    return kern.trace(*args, **kw).module_asm


def test_if_else_variables_become_results():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        i = kiln.thread_id(0)
        if i < n:
            v = x[i]
            w = 1.0
        else:
            v = 2.0
            w = 3.0
        x[i] = v + w

    asm = trace(k, X, 4)
    assert "scf.if" in asm and "-> (f32, f32)" in asm
    assert asm.count("scf.yield") == 2


def test_elif_chain_nests():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        i = kiln.thread_id(0)
        v = 0.0
        if i < n:
            v = 1.0
        elif i < n * 2:
            v = 2.0
        else:
            v = 3.0
        x[i] = v

    assert trace(k, X, 4).count("scf.if") == 2


def test_variable_from_one_branch_used_after_is_an_error(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        if n > 0:
            only_here = 1.0
        x[0] = only_here  # @one-branch

    with pytest.raises(kiln.KilnTypeError) as info:
        k.trace(X, 1)
    err = info.value
    assert "'only_here'" in err.message and "only one branch" in err.message
    assert "Fix:" in str(err)
    assert err.loc.line == marker_line("@one-branch")


def test_variable_local_to_a_branch_is_fine_when_unused_after():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        if n > 0:
            tmp = x[0] * 2.0
            x[1] = tmp

    assert "scf.if" in trace(k, X, 1)


def test_branch_dtype_mismatch_is_an_error(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], h: kiln.Tensor[f16], n: i32):
        v = x[0]
        if n > 0:  # @mismatch
            v = h[0]
        x[0] = v

    with pytest.raises(kiln.KilnTypeError, match="'v' changes type") as info:
        k.trace(X, np.zeros(2, np.float16), 1)
    assert info.value.loc.line == marker_line("@mismatch")


def test_python_condition_is_resolved_at_trace_time():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], USE_ONE: kiln.constexpr):
        if USE_ONE:
            x[0] = 1.0
        else:
            x[0] = 2.0

    one = trace(k, X, USE_ONE=True)
    assert "scf.if" not in one and "1.000000e+00" in one and "2.000000e+00" not in one


def test_return_in_static_if_is_plain_python():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], EARLY: kiln.constexpr):
        if EARLY:
            return
        x[0] = 1.0

    assert "memref.store" not in trace(k, X, EARLY=True)
    assert "memref.store" in trace(k, X, EARLY=False)


def test_return_inside_traced_if_is_unsupported(marker_line):
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        if n > 0:
            return  # @bad-return
        x[0] = 1.0

    with pytest.raises(kiln.UnsupportedError) as info:
        k.trace(X, 1)
    assert info.value.loc.line == marker_line("@bad-return")
    assert "Fix:" in str(info.value)


def test_range_loop_carries_assigned_variables():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        acc = 0.0
        count = 0
        for j in kiln.range(0, n, 2):
            acc += x[j]
            count = count + 1
        x[0] = acc + kiln.cast(count, f32)

    asm = trace(k, X, 8)
    assert "scf.for" in asm and "iter_args(" in asm and "-> (f32, i32)" in asm
    assert ": i32 {" in asm  # i32 induction variable


def test_loop_body_temporaries_are_not_carried():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        for j in kiln.range(n):
            t = x[j] * 2.0
            x[j] = t

    asm = trace(k, X, 8)
    assert "scf.for" in asm and "iter_args" not in asm


def test_loop_carried_dtype_change_is_an_error():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], h: kiln.Tensor[f16], n: i32):
        acc = h[0]
        for j in kiln.range(n):
            acc = acc + x[j]  # f16 + f32 -> f32
        x[0] = kiln.cast(acc, f32)

    with pytest.raises(kiln.KilnTypeError, match="'acc' changes type inside a kiln.range loop"):
        k.trace(X, np.zeros(2, np.float16), 4)


def test_tuples_are_loop_carried():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        pair = (0.0, 1.0)
        for j in kiln.range(n):
            pair = (pair[1], pair[0] + x[j])
        x[0] = pair[0]

    assert "-> (f32, f32)" in trace(k, X, 4)


def test_static_range_unrolls():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], STEPS: kiln.constexpr):
        acc = 0.0
        for s in kiln.static_range(STEPS):
            acc = acc + x[s]
        x[0] = acc

    asm = trace(k, X, STEPS=3)
    assert "scf.for" not in asm and asm.count("memref.load") == 3
    # A constexpr computed with numpy is an int to range(), so to static_range too.
    assert trace(k, X, STEPS=np.int64(3)).count("memref.load") == 3
    with pytest.raises(kiln.KilnTypeError, match="needs Python int bounds, got bool"):
        trace(k, X, STEPS=True)


def test_while_on_traced_value_is_unsupported():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        while n > 0:
            n = n - 1

    with pytest.raises(kiln.UnsupportedError, match="while"):
        k.trace(X, 1)


def test_break_in_traced_loop_is_unsupported():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        for j in kiln.range(n):
            break

    with pytest.raises(kiln.UnsupportedError, match="break"):
        k.trace(X, 1)


def test_bool_of_traced_value_explains_the_fix():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        x[0] = 1.0 if n > 0 else 2.0

    with pytest.raises(kiln.KilnTypeError, match="no Python truth value") as info:
        k.trace(X, 1)
    assert "kiln.where" in info.value.fix


def test_nested_if_in_loop_with_mask():
    @kiln.kernel
    def k(x: kiln.Tensor[f32], n: i32):
        best = -1.0
        for j in kiln.range(n):
            v = x[j]
            if v > best:
                best = v
        x[0] = best

    asm = trace(k, X, 8)
    assert asm.index("scf.for") < asm.index("scf.if")


def _odd_statements(x, n, items):
    """Statements the rewrite takes its less common paths for: ``while``, ``with``, ``try``
    (its handlers have positions of their own), a branch that returns (no shared branch
    function), a non-name loop target."""
    total = 0
    while n > 0:
        n -= 1
    with open(__file__) as source:
        total += len(source.readline())
    try:
        total += items[0]
    except IndexError as err:
        total -= len(str(err))
    finally:
        total += 1
    if total > 3:
        return total
    for a, b in items:
        total += a * b
    for i in range(3):
        if i == x:
            break
    return total


def _rewritten_module(monkeypatch, fn, *, own_fill: bool):
    """The factory module the rewrite compiles for ``fn``: with its own location fill, or
    with none and ``ast.fix_missing_locations`` run before the compile."""
    import ast
    import builtins
    import itertools

    from kiln import ast_rewrite

    trees = []

    def compile_(tree, *args):
        trees.append(tree if own_fill else ast.fix_missing_locations(tree))
        return builtins.compile(tree, *args)

    with monkeypatch.context() as patch:
        patch.setattr(ast_rewrite, "compile", compile_, raising=False)
        patch.setattr(ast_rewrite, "_counter", itertools.count())  # the same generated names
        if not own_fill:
            patch.setattr(ast_rewrite, "_fill", lambda node: None)
            patch.setattr(ast_rewrite, "_located", ast.copy_location)
        ast_rewrite._compile_factory(fn)
    return ast.dump(trees[0], include_attributes=True)


def test_rewrite_fills_locations_as_the_ast_module(monkeypatch):
    """The rewrite gives each node it makes a position as it places it; every position is
    what ``ast.fix_missing_locations`` of the whole tree gives (the compiled code, its line
    table and so kiln.pyhints' columns must not change)."""
    import inspect

    from kiln.kernels.attention import mla_decode, prefill_hopper, prefill_hopper_steps

    functions = [_odd_statements]
    for module in (prefill_hopper, prefill_hopper_steps, mla_decode):
        functions += [inspect.unwrap(f) for _, f in inspect.getmembers(module, inspect.isfunction)
                      if f.__module__ == module.__name__]
    functions = [getattr(f, "fn", f) for f in functions]
    assert len(functions) > 10
    for fn in functions:
        assert _rewritten_module(monkeypatch, fn, own_fill=True) == \
            _rewritten_module(monkeypatch, fn, own_fill=False), fn.__qualname__


def test_factory_kernels_share_one_rewrite_and_keep_their_closures(monkeypatch):
    """Kernels a factory makes share one code object: its source is rewritten and compiled
    once, and each kernel still sees its own closure values."""
    from kiln import ast_rewrite

    def make(scale):
        @kiln.kernel
        def scaled(x: kiln.Tensor[f32]):
            i = kiln.thread_id(0)
            if i < 4:
                x[i] = x[i] * scale
        return scaled

    compiled = []
    real = ast_rewrite._compile_factory
    monkeypatch.setattr(ast_rewrite, "_compile_factory",
                        lambda fn: compiled.append(fn) or real(fn))
    two, three = trace(make(2.0), X), trace(make(3.0), X)
    assert len(compiled) == 1
    assert "2.000000e+00" in two and "3.000000e+00" in three
