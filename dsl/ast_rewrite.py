"""Rewrite a kernel's Python source so ``if``/``for`` on traced values build ``scf.if``/``scf.for``.

Every ``if`` becomes "evaluate the condition once; if it is a plain Python value run the
original statement, else call :func:`kiln.trace_runtime.if_stmt` with one nested function per
branch". The nested functions take the variables the branches assign as parameters and return
their new values, so ``x = 1.0`` inside a traced branch becomes an ``scf.if`` result. Loops
``for i in kiln.range(...)`` become a body function passed to ``for_stmt``; any other ``for``
runs in Python (unrolled). ``while`` conditions must be Python values, and a ``raise`` cannot
sit in a traced ``if`` (it would run at trace time whatever the condition).

A plain-Python condition runs the taken branch's function too (``trace_runtime.static_if``),
so each branch is rewritten once and nested ``if``s do not double the code per level; branches
whose meaning a function would change (``return``/``break``/``continue`` leaving them,
``raise``, nested ``def``/``lambda``/generators, ``del``, ``global``/``nonlocal``, ``locals()``,
zero-argument ``super()``) keep the original statement for the static path instead.

Line numbers are kept (the rewritten code is compiled under the user's file name at the
original lines), and every simple statement runs inside ``kiln.builder.at_source(...)`` so the
ops it builds carry ``loc("file":line:col)`` and Kiln errors point at it.

Example (what the user writes; the rewrite is invisible)::

    @kiln.kernel
    def relu(x: kiln.Tensor[f32], n: i32):
        i = kiln.thread_id(0)
        v = 0.0
        if i < n:            # traced -> scf.if yielding v
            v = x[i]
        x[i] = kiln.max(v, 0.0)
"""

from __future__ import annotations

import ast
import collections
import gc
import inspect
import itertools
import linecache
import re
import textwrap
import types
from typing import Callable

from . import pyhints, trace_runtime
from .ast_regions import declares_outer_names, region_names, shareable, store_counts
from .builder import at_source
from .core.errors import KilnValueError, SourceLoc

RT = "__kiln_rt"
_counter = itertools.count()


class _Runtime:
    """The names the rewritten code calls (bound to the ``__kiln_rt`` factory parameter)."""

    at = staticmethod(at_source)
    capture = staticmethod(trace_runtime.capture)
    reachable_structs = staticmethod(trace_runtime.reachable_structs)
    is_traced = staticmethod(trace_runtime.is_traced)
    if_stmt = staticmethod(trace_runtime.if_stmt)
    static_if = staticmethod(trace_runtime.static_if)
    missing = trace_runtime.MISSING
    for_stmt = staticmethod(trace_runtime.for_stmt)
    TracedRange = trace_runtime.TracedRange
    static_while_cond = staticmethod(trace_runtime.static_while_cond)
    unrolled = staticmethod(trace_runtime.unrolled)
    static_for = staticmethod(trace_runtime.static_for)
    traced_return = staticmethod(trace_runtime.traced_return)
    traced_break = staticmethod(trace_runtime.traced_break)
    traced_raise = staticmethod(trace_runtime.traced_raise)


def _rt(attr: str) -> ast.expr:
    return ast.Attribute(ast.Name(RT, ast.Load()), attr, ast.Load())


def _call(attr: str, *args: ast.expr) -> ast.Call:
    return ast.Call(_rt(attr), list(args), [])


def _names_tuple(names, ctx) -> ast.Tuple:
    return ast.Tuple([ast.Name(n, ctx()) for n in names], ctx())


def _str_tuple(names) -> ast.Tuple:
    return ast.Tuple([ast.Constant(n) for n in names], ast.Load())


def _function(name: str, params, body) -> ast.FunctionDef:
    args = ast.arguments(posonlyargs=[], args=[ast.arg(p) for p in params], vararg=None,
                         kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    return ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None)


class _ForbidEscapes(ast.NodeTransformer):
    """Inside a traced region, ``return``/``break``/``continue`` cannot leave it: raise instead."""

    def __init__(self, in_if: bool):
        self.loop_depth = 0
        self.in_if = in_if

    def visit_FunctionDef(self, node):
        return node

    visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

    def visit_Return(self, node):
        return ast.copy_location(ast.Expr(_call("traced_return")), node)

    def _loop(self, node):
        self.loop_depth += 1
        node.body = [self.visit(s) for s in node.body]
        self.loop_depth -= 1
        node.orelse = [self.visit(s) for s in node.orelse]
        return node

    visit_For = visit_While = _loop

    def visit_Raise(self, node):
        # Both branches of a traced `if` are traced, so a raise there would fire whatever the
        # condition is at run time.
        return ast.copy_location(ast.Expr(_call("traced_raise")), node) if self.in_if else node

    def visit_Break(self, node):
        if self.loop_depth:
            return node
        return ast.copy_location(ast.Expr(_call("traced_break")), node)

    visit_Continue = visit_Break


def _forbid_escapes(stmts, in_if: bool = False):
    t = _ForbidEscapes(in_if)
    return [t.visit(s) for s in stmts]


def _clone(node):
    """A deep copy of an AST node or list of them (``copy.deepcopy`` is generic and took most
    of the rewrite's time on the attention kernels)."""
    if isinstance(node, list):
        return [_clone(item) for item in node]
    if not isinstance(node, ast.AST):
        return node  # field values are immutable: str, int, None, constants
    cls = type(node)
    new = cls.__new__(cls)
    fields = new.__dict__
    for name, value in node.__dict__.items():
        fields[name] = _clone(value) if isinstance(value, (list, ast.AST)) else value
    return new


def fix_missing_locations(root: ast.AST) -> ast.AST:
    """:func:`ast.fix_missing_locations` with the same result, walking fields directly
    (the generic ``iter_child_nodes`` walk was a third of the rewrite's time). An expression
    that has its position came from the parsed source (or a clone of it): the rewrite builds
    new nodes around source expressions, never inside them, so its subtree is complete."""
    stack = [(root, 1, 0, 1, 0)]
    while stack:
        node, lineno, col, end_lineno, end_col = stack.pop()
        fields = node.__dict__
        if "lineno" in node._attributes:
            if "lineno" in fields:
                if isinstance(node, ast.expr):
                    continue
                lineno = fields["lineno"]
            else:
                node.lineno = lineno
            if fields.get("end_lineno") is None:
                node.end_lineno = end_lineno
            else:
                end_lineno = fields["end_lineno"]
            if "col_offset" in fields:
                col = fields["col_offset"]
            else:
                node.col_offset = col
            if fields.get("end_col_offset") is None:
                node.end_col_offset = end_col
            else:
                end_col = fields["end_col_offset"]
        # A child's fill depends only on its ancestors, so the visiting order is free.
        for value in fields.values():
            if isinstance(value, list):
                stack.extend([(v, lineno, col, end_lineno, end_col) for v in value
                              if isinstance(v, ast.AST) and not isinstance(v, _UNLOCATED)])
            elif isinstance(value, ast.AST) and not isinstance(value, _UNLOCATED):
                stack.append((value, lineno, col, end_lineno, end_col))
    return root


# Leaf nodes without positions (Load/Store, operators): nothing to fill, nothing below.
_UNLOCATED = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)


_SIMPLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Assert,
           ast.Delete, ast.Raise)

class _Rewriter(ast.NodeTransformer):
    def __init__(self, filename: str, share: bool = True, body=()):
        self.filename = filename
        self.share = share  # False when the function declares global/nonlocal names
        self.depth = 0  # branch/body functions being built around the current statement
        self.loops = 0  # loops around the current statement
        self._body = body
        self._stores: collections.Counter | None = None  # the function's bindings of each name

    def _late_risk(self, stmts, names) -> set:
        """The names of ``names`` (what an ``if``'s branches store) whose binding a lambda in
        the branches could see differ in a branch function: all of them inside a loop (each
        run of the branches would bind its own), else those bound outside the branches too
        (a lambda made inside would not see the later rebinding)."""
        if self.loops:
            return set(names)
        if self._stores is None:
            self._stores = store_counts(self._body)
        inside = store_counts(stmts)
        return {name for name in names if inside[name] < self._stores[name]}

    def _at(self, node: ast.AST, body: list[ast.stmt]) -> ast.With:
        end = node.end_col_offset if node.end_lineno == node.lineno else None
        ctx = _call("at", ast.Constant(self.filename), ast.Constant(node.lineno),
                    ast.Constant(node.col_offset), ast.Constant(end))
        return ast.With([ast.withitem(ctx)], body)

    def _stmts(self, stmts):
        out = []
        for s in stmts:
            r = self.visit(s)
            out.extend(r if isinstance(r, list) else [r])
        return out

    def generic_visit(self, node):
        if isinstance(node, _SIMPLE):
            return self._at(node, [node])
        return super().generic_visit(node)

    def visit_FunctionDef(self, node):
        # A nested def inside the kernel is plain Python; it is rewritten when it is a kiln.func.
        return node

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_While(self, node):
        test = node.test  # the error names the condition's own line, not the enclosing def
        end = test.end_col_offset if test.end_lineno == test.lineno else None
        node.test = _call("static_while_cond", test, ast.Constant(self.filename),
                          ast.Constant(test.lineno), ast.Constant(test.col_offset),
                          ast.Constant(end))
        self.loops += 1
        try:
            node.body = self._stmts(node.body)
        finally:
            self.loops -= 1
        node.orelse = self._stmts(node.orelse)
        return node

    def _branch_fn(self, name, params, body, node):
        ret = ast.Return(_names_tuple(params, ast.Load))
        self.depth += 1
        try:
            stmts = self._stmts(body)
        finally:
            self.depth -= 1
        return ast.copy_location(_function(name, params, stmts + [ret]), node)

    def _assign_results(self, names, call, node):
        if names:
            stmt = ast.Assign([_names_tuple(names, ast.Store)], call)
        else:
            stmt = ast.Expr(call)
        return self._at(node, [ast.copy_location(stmt, node)])

    def _capture(self, names):
        locals_call = ast.Call(ast.Name("locals", ast.Load()), [], [])
        return _call("capture", locals_call, _str_tuple(names))

    def _structs(self, names):
        locals_call = ast.Call(ast.Name("locals", ast.Load()), [], [])
        return _call("reachable_structs", locals_call, _str_tuple(names))

    def visit_If(self, node):
        n = next(_counter)
        cond = f"__kiln_cond_{n}"
        names, loaded = region_names(node.body + node.orelse)
        if self.share and shareable(
                node.body + node.orelse, lambda: self._late_risk(node.body + node.orelse, names)):
            return self._shared_if(node, n, cond, names, loaded)
        # The traced branches get copies; the static statement takes the original nodes.
        traced_body, traced_orelse = _clone(node.body), _clone(node.orelse)
        static_if = ast.If(ast.Name(cond, ast.Load()), self._stmts(node.body),
                           self._stmts(node.orelse))
        then_fn = self._branch_fn(f"__kiln_then_{n}", names, _forbid_escapes(traced_body, True),
                                  node)
        traced = [then_fn]
        else_ref: ast.expr = ast.Constant(None)
        if node.orelse:
            traced.append(self._branch_fn(f"__kiln_else_{n}", names,
                                          _forbid_escapes(traced_orelse, True), node))
            else_ref = ast.Name(f"__kiln_else_{n}", ast.Load())
        call = _call("if_stmt", ast.Name(cond, ast.Load()),
                     ast.Name(f"__kiln_then_{n}", ast.Load()),
                     else_ref, _str_tuple(names), self._capture(names), self._structs(loaded))
        traced.append(self._assign_results(names, call, node))
        evaluate = self._at(node.test, [ast.Assign([ast.Name(cond, ast.Store())], node.test)])
        dispatch = ast.If(_call("is_traced", ast.Name(cond, ast.Load())), traced, [static_if])
        return [ast.copy_location(evaluate, node), ast.copy_location(dispatch, node)]

    def _shared_if(self, node, n, cond, names, loaded):
        """One rewrite of the branches serves both paths: the branch functions the traced
        path passes to ``if_stmt`` also run a static condition (``static_if``), so nested
        ``if``s are not rewritten twice per level (the copies grew the code 25-fold)."""
        fns = [self._branch_fn(f"__kiln_then_{n}", names, node.body, node)]
        else_ref: ast.expr = ast.Constant(None)
        if node.orelse:
            fns.append(self._branch_fn(f"__kiln_else_{n}", names, node.orelse, node))
            else_ref = ast.Name(f"__kiln_else_{n}", ast.Load())
        refs = (ast.Name(cond, ast.Load()), ast.Name(f"__kiln_then_{n}", ast.Load()), else_ref)
        traced = _call("if_stmt", *refs, _str_tuple(names), self._capture(names),
                       self._structs(loaded))
        static = [self._assign_results(names, _call("static_if", *_clone(list(refs)),
                                                    self._capture(names)), node)]
        # A name the taken branch left unbound stays unbound in the kernel's own body; inside a
        # branch or loop-body function it is a parameter, left MISSING as the traced path does.
        for name in names if self.depth == 0 else ():
            missing = ast.Compare(ast.Name(name, ast.Load()), [ast.Is()], [_rt("missing")])
            static.append(ast.If(missing, [ast.Delete([ast.Name(name, ast.Del())])], []))
        evaluate = self._at(node.test, [ast.Assign([ast.Name(cond, ast.Store())], node.test)])
        dispatch = ast.If(_call("is_traced", ast.Name(cond, ast.Load())),
                          [self._assign_results(names, traced, node)], static)
        return [ast.copy_location(stmt, node) for stmt in (evaluate, *fns, dispatch)]

    def visit_For(self, node):
        self.loops += 1
        try:
            return self._for(node)
        finally:
            self.loops -= 1

    def _for(self, node):
        n = next(_counter)
        it = f"__kiln_iter_{n}"
        may_trace = isinstance(node.target, ast.Name) and not node.orelse
        if may_trace and self.share:
            stored, loaded = region_names(node.body)
            # a body that rebinds the loop variable leaves its own value after the loop
            if node.target.id not in stored and shareable(node.body,
                                                          lambda: {node.target.id, *stored}):
                return self._shared_for(node, n, it, stored, loaded)
        # The traced body gets a copy; the static loop takes the original nodes.
        traced_body = _clone(node.body) if may_trace else None
        counted = _call("unrolled", ast.Name(it, ast.Load()), ast.Constant(self.filename),
                        ast.Constant(node.lineno))
        static_for = ast.For(node.target, counted, self._stmts(node.body),
                             self._stmts(node.orelse), None)
        evaluate = self._at(node.iter, [ast.Assign([ast.Name(it, ast.Store())], node.iter)])
        if not may_trace:
            return [ast.copy_location(evaluate, node), ast.copy_location(static_for, node)]
        stored, loaded = region_names(traced_body)
        names = [m for m in stored if m != node.target.id]
        body_fn = self._branch_fn(f"__kiln_body_{n}", [node.target.id] + names,
                                  _forbid_escapes(traced_body), node)
        body_fn.body[-1] = ast.Return(_names_tuple(names, ast.Load))
        call = _call("for_stmt", ast.Name(it, ast.Load()), ast.Name(body_fn.name, ast.Load()),
                     _str_tuple(names), self._capture(names), self._structs(loaded))
        traced = [body_fn, self._assign_results(names, call, node)]
        is_range = ast.Call(ast.Name("isinstance", ast.Load()),
                            [ast.Name(it, ast.Load()), _rt("TracedRange")], [])
        dispatch = ast.If(is_range, traced, [static_for])
        return [ast.copy_location(evaluate, node), ast.copy_location(dispatch, node)]

    def _shared_for(self, node, n, it, stored, loaded):
        """One rewrite of the body serves both paths (as :meth:`_shared_if`): the body
        function ``for_stmt`` builds the loop from also runs each item of a Python-unrolled
        loop (``static_for``), so a loop's body is not rewritten twice per nesting level."""
        target = node.target.id
        names = [m for m in stored if m != target]
        body_fn = self._branch_fn(f"__kiln_body_{n}", [target] + names, node.body, node)
        body_fn.body[-1] = ast.Return(_names_tuple(names, ast.Load))
        body_ref = ast.Name(body_fn.name, ast.Load())
        traced = _call("for_stmt", ast.Name(it, ast.Load()), body_ref, _str_tuple(names),
                       self._capture(names), self._structs(loaded))
        initial = ast.Subscript(self._capture([target]), ast.Constant(0), ast.Load())
        static = [self._assign_results(
            [target] + names, _call("static_for", ast.Name(it, ast.Load()), _clone(body_ref),
                                    initial, self._capture(names), ast.Constant(self.filename),
                                    ast.Constant(node.lineno)), node)]
        for name in [target] + names if self.depth == 0 else ():  # as _shared_if's static path
            missing = ast.Compare(ast.Name(name, ast.Load()), [ast.Is()], [_rt("missing")])
            static.append(ast.If(missing, [ast.Delete([ast.Name(name, ast.Del())])], []))
        evaluate = self._at(node.iter, [ast.Assign([ast.Name(it, ast.Store())], node.iter)])
        is_range = ast.Call(ast.Name("isinstance", ast.Load()),
                            [ast.Name(it, ast.Load()), _rt("TracedRange")], [])
        dispatch = ast.If(is_range, [self._assign_results(names, traced, node)], static)
        return [ast.copy_location(stmt, node) for stmt in (evaluate, body_fn, dispatch)]


_cache: dict[Callable, Callable] = {}


def _record_column_shift(code: types.CodeType, shift: int) -> None:
    """Tell kiln.pyhints how far ``code`` and its nested functions were dedented."""
    pyhints.COLUMN_SHIFT[code] = shift
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _record_column_shift(const, shift)


def rewrite(fn: Callable) -> Callable:
    """The AST-rewritten version of ``fn`` (cached), bound to the same globals and closure."""
    cached = _cache.get(fn)
    if cached is not None:
        return cached
    # The rewrite allocates tens of thousands of acyclic AST nodes; the cyclic collector's
    # passes over them (and the whole heap) were an eighth of a large kernel's trace.
    paused = gc.isenabled()
    gc.disable()
    try:
        rewritten = _rewrite(fn)
    finally:
        if paused:
            gc.enable()
    _cache[fn] = rewritten
    return rewritten


def _rewrite(fn: Callable) -> Callable:
    # Equal code objects in two files compare equal (co_filename is not compared), and the
    # rewritten code carries its file in every location.
    code_key = (fn.__code__, fn.__code__.co_filename)
    factory_code = _factory_code.get(code_key)
    if factory_code is None:
        factory_code = _factory_code[code_key] = _compile_factory(fn)
    make = types.FunctionType(factory_code, fn.__globals__)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet (e.g. a later-defined helper)
            cells.append(None)
    rewritten = make(_Runtime, *cells)
    rewritten.__defaults__ = fn.__defaults__
    rewritten.__kwdefaults__ = fn.__kwdefaults__
    return rewritten


# The rewritten code depends only on the source, so kernels a factory makes (one function
# object per config or head dim, one code object) share it; each binds its own closure.
_factory_code: dict[tuple[types.CodeType, str], types.CodeType] = {}


def _compile_factory(fn: Callable) -> types.CodeType:
    """The code of ``__kiln_factory(__kiln_rt, *freevars)``, which returns the rewritten fn."""
    try:
        raw = function_source(fn)
        source = textwrap.dedent(raw)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError) as err:
        raise KilnValueError(f"cannot read the source of {fn.__qualname__}: {err}",
                             fix="define kernels in a .py file (not at an interactive prompt)",
                             loc=SourceLoc(fn.__code__.co_filename,
                                           fn.__code__.co_firstlineno)) from None
    factory_code = _rewrite_source(fn, source, filename)
    dedent = raw.index(raw.lstrip()[0]) - source.index(source.lstrip()[0])
    _record_column_shift(factory_code, dedent)
    return factory_code


# inspect.findsource's test for the line a function's source starts on
_DEF_LINE = re.compile(r"^(\s*def\s)|(\s*async\s+def\s)|(.*(?<!\w)lambda(:|\s))|^(\s*@)")


def function_source(fn: Callable) -> str:
    """``inspect.getsource(fn)`` for its parse (the same code lines; trailing comments may
    differ): the lines from the code's first line to the last its positions name, and any
    more-indented lines after (an ``else: pass`` compiles to nothing), read from ``linecache``.
    ``inspect`` tokenizes the whole body to find its end: an eighth of a large kernel's trace."""
    fn = inspect.unwrap(fn)  # as inspect does: a functools.wraps wrapper shows what it wraps
    code = fn.__code__
    linecache.checkcache(code.co_filename)  # a file edited since it was read is read again
    lines = linecache.getlines(code.co_filename, fn.__globals__)
    start = code.co_firstlineno - 1
    if not hasattr(code, "co_positions") or not 0 <= start < len(lines) \
            or not _DEF_LINE.match(lines[start]):
        return inspect.getsource(fn)  # Python 3.10, or no file: inspect's lines and errors
    indent = _indent(lines[start])
    end = max(start + 1, _last_line(code))
    while end < len(lines) and (_blank(lines[end]) or _indent(lines[end]) > indent):
        end += 1
    while end > start + 1 and _blank(lines[end - 1]):
        end -= 1
    return "".join(lines[start:end])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _blank(line: str) -> bool:
    """An empty or comment-only line."""
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _last_line(code: types.CodeType) -> int:
    """The last source line any instruction of ``code`` or its nested code spans."""
    last = max((end for _, end, _, _ in code.co_positions() if end is not None), default=0)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            last = max(last, _last_line(const))
    return last


def _rewrite_source(fn: Callable, source: str, filename: str) -> types.CodeType:
    """Parse, rewrite and compile ``fn``'s (dedented) source into the factory's code."""
    # parsed at its own first line (blank lines before it), not moved there by
    # ast.increment_lineno's walk of the whole tree
    tree = ast.parse("\n" * (fn.__code__.co_firstlineno - 1) + source)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise KilnValueError(f"{fn.__qualname__} is not a plain `def` function",
                             fix="decorate a `def` (lambdas and async functions are not supported)")
    fdef.decorator_list = []
    # a source without the keywords declares nothing: no walk of the tree
    declares = ("global" in source or "nonlocal" in source) and declares_outer_names(fdef)
    fdef.body = _Rewriter(filename, share=not declares, body=fdef.body)._stmts(fdef.body)
    freevars = fn.__code__.co_freevars
    fdef.returns = None
    for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs:
        a.annotation = None  # annotations were read off the original function already
    body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    factory = ast.copy_location(_function("__kiln_factory", [RT, *freevars], body), fdef)
    module = fix_missing_locations(ast.Module([factory], type_ignores=[]))
    code = compile(module, filename, "exec")
    return next(c for c in code.co_consts if isinstance(c, types.CodeType))
