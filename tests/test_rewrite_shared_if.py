"""A static ``if`` runs the same branch functions the traced path passes to ``if_stmt``, and a
Python-unrolled ``for`` the body function ``for_stmt`` takes, so the rewrite grows linearly with
``if``/``for`` nesting instead of doubling per level; Python semantics of static ``if``s and
loops stay those of the source (checked against the plain function), lambdas included."""

from __future__ import annotations

import marshal

import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import ast_rewrite, f32


def _run_both(fn, *args):
    """``fn(*args)`` and its rewrite's result (or the exception type each raised)."""
    def outcome(call):
        try:
            return call(*args)
        except Exception as err:  # the plain function's own error must come back unchanged
            return type(err)

    with ir.Context(), ir.Location.unknown():
        return outcome(fn), outcome(ast_rewrite.rewrite(fn))


def nested(a, b, c):
    total = 0
    if a:
        total += 1
        if b:
            only_b = 10
            total += only_b
            if c:
                total *= 3
        else:
            total -= 2
    elif c:
        total = -1
    return total


def assigned_in_one_branch(flag):
    if flag:
        late = 5
    return late  # UnboundLocalError when flag is false, as in plain Python


def with_escapes(values):
    found = []
    for v in values:
        if v < 0:
            continue
        if v > 5:
            break
        if v == 3:
            return ["three", *found]
        found.append(v)
    return found


def late_closure(flag):
    scale = 1
    if flag:
        scale = 2
        fn = lambda x: x * scale  # noqa: E731  (captures the later rebinding)
    scale = 7
    return fn(3) if flag else scale


def loops_inside(n):
    acc = []
    if n > 1:
        for i in range(n):
            if i % 2:
                continue
            acc.append(i)
            if i > 4:
                break
    return acc


def loop_names(n):
    total = 0
    for i in range(n):
        total += i
        first_in_loop = i * 2
    return total, i, first_in_loop  # UnboundLocalError when n == 0, as in plain Python


def loop_target_kept(n):
    i = -1
    for i in range(n):
        pass
    return i


def loop_target_rebound(n):
    for i in range(n):
        i = i * 2  # the rebinding is what the variable holds after the loop
    return i


def loops_nested(n):
    rows = []
    for i in range(n):
        row = []
        for j in range(i):
            if j % 2:
                row.append(j * i)
            else:
                row.append(-j)
        rows.append(row)
    return rows


def lambda_reads_loop_target(n):
    fns = []
    for i in range(n):
        fns.append(lambda: i)  # late binding: every lambda sees the last i
    return [f() for f in fns]


def lambda_reads_branch_name(flag):
    if flag:
        k = 3
        fn = lambda x: x + k  # noqa: E731  (k is bound only here: the branch may be shared)
    else:
        fn = lambda x: -x  # noqa: E731
    return fn(4)


def lambda_in_branch_in_loop(n):
    fns = []
    for i in range(n):
        if i % 2:
            v = i
            fns.append(lambda: v)  # each sees the last v
    return [f() for f in fns]


def lambda_called_in_loop(n):
    out = []
    for i in range(n):
        scale = i + 1
        out.append((lambda x: x * scale)(2))
    return out


@pytest.mark.parametrize("case, inputs", [
    (nested, [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]),
    (loop_names, [(0,), (1,), (4,)]),
    (loop_target_kept, [(0,), (3,)]),
    (loop_target_rebound, [(0,), (3,)]),
    (loops_nested, [(0,), (5,)]),
    (lambda_reads_loop_target, [(0,), (3,)]),
    (lambda_reads_branch_name, [(True,), (False,)]),
    (lambda_in_branch_in_loop, [(0,), (6,)]),
    (lambda_called_in_loop, [(0,), (3,)]),
    (assigned_in_one_branch, [(True,), (False,)]),
    (with_escapes, [([1, -1, 2, 3, 4],), ([1, 2, 9, 3],), ([],)]),
    (late_closure, [(True,), (False,)]),
    (loops_inside, [(0,), (2,), (9,)]),
])
def test_static_ifs_keep_python_semantics(case, inputs):
    for args in inputs:
        plain, rewritten = _run_both(case, *args)
        assert plain == rewritten, (case.__name__, args)


def _function_and_factory_size(path, source: str):
    """``deep`` defined by ``source`` written at ``path`` (the rewrite reads its source back),
    and the marshalled size of the code its rewrite compiles."""
    path.write_text(source)
    namespace: dict = {}
    exec(compile(source, str(path), "exec"), namespace)
    fn = namespace["deep"]
    return fn, len(marshal.dumps(ast_rewrite._compile_factory(fn).code))


def test_the_rewrite_grows_linearly_with_if_nesting(tmp_path):
    sizes = {}
    for depth in (4, 8):
        fn, sizes[depth] = _function_and_factory_size(tmp_path / f"deep{depth}.py",
                                                      _deep_source(depth))
        with ir.Context(), ir.Location.unknown():
            assert ast_rewrite.rewrite(fn)(depth) == fn(depth)
    assert sizes[8] < 2.5 * sizes[4], sizes  # doubling per level would be 16x


def test_the_rewrite_grows_linearly_with_loop_nesting(tmp_path):
    sizes = {}
    for depth in (3, 6):
        lines = ["def deep(n):", "    v = 0"]
        for level in range(depth):
            lines.append(f"{'    ' * (level + 1)}for i{level} in range(n):")
        lines += [f"{'    ' * (depth + 1)}v = v + 1", "    return v"]
        fn, sizes[depth] = _function_and_factory_size(tmp_path / f"loops{depth}.py",
                                                      "\n".join(lines) + "\n")
        with ir.Context(), ir.Location.unknown():
            assert ast_rewrite.rewrite(fn)(2) == fn(2) == 2 ** depth
    assert sizes[6] < 2.5 * sizes[3], sizes  # doubling per level would be 8x


def _deep_source(depth: int) -> str:
    """``depth`` ifs, each nested in the previous one's then-branch, each with an else."""
    lines = ["def deep(x):", "    v = x"]
    for level in range(depth):
        lines += [f"{'    ' * (level + 1)}if x > {level}:", f"{'    ' * (level + 2)}v = v + {level}"]
    for level in reversed(range(depth)):
        lines += [f"{'    ' * (level + 1)}else:", f"{'    ' * (level + 2)}v = v - 1"]
    lines.append("    return v")
    return "\n".join(lines) + "\n"


def test_a_function_declaring_outer_names_keeps_its_own_static_ifs():
    counter = {"n": 0}

    def bump(flag):
        global _BUMPED
        if flag:
            _BUMPED = counter["n"] + 1
        return _BUMPED

    plain, rewritten = _run_both(bump, True)
    assert plain == rewritten == 1


_BUMPED = 0


@kiln.kernel
def mixed(x: kiln.Tensor[f32], n: kiln.i32, MODE: kiln.constexpr):
    i = kiln.thread_id(0)
    v = x[i]
    if MODE == 1:          # static: one branch traced, through the shared branch function
        if i < n:          # traced inside the static branch
            v = v * 2.0
        else:
            v = v - 1.0
    elif MODE == 2:
        v = v + 3.0
    x[i] = v


@pytest.mark.parametrize("mode, expect", [
    (1, lambda x, n: np.where(np.arange(x.size) < n, x * 2, x - 1)),
    (2, lambda x, n: x + 3),
    (0, lambda x, n: x),
])
def test_static_and_traced_ifs_nest_in_a_kernel(mode, expect):
    x = np.random.default_rng().standard_normal(64).astype(np.float32)
    n = int(np.random.default_rng().integers(1, 63))
    out = x.copy()
    mixed.interpret[1](out, n, MODE=mode, target="sm_90a", num_warps=2)
    np.testing.assert_allclose(out, expect(x.astype(np.float64), n), rtol=1e-6)


def test_the_mla_kernel_rewrites_without_doubling_per_level():
    # Its schedule chain (if seesaw / elif ring / elif lead_group == 2 / else: a kiln.range loop
    # whose body passes lambdas) doubled per level while lambdas made a branch unshareable and
    # every loop body was rewritten twice: 27x its own code, now 9x.
    from kiln.kernels.attention.mla_kernel import make_mla_kernel

    fn = make_mla_kernel(64, False, lead_group=True).fn
    rewritten = len(marshal.dumps(ast_rewrite._compile_factory(fn).code))
    assert rewritten < 12 * len(marshal.dumps(fn.__code__)), rewritten
