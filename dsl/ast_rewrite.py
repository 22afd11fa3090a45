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
import functools
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

_counter = itertools.count()
_PREFIX = "__kiln_"

# The runtime functions the rewritten code calls, each a parameter ``__kiln_<name>`` of the
# factory (a name load in the rewritten code, not an attribute of a runtime object).
_RUNTIME = {
    "capture": trace_runtime.capture,
    "reachable_structs": trace_runtime.reachable_structs,
    "is_traced": trace_runtime.is_traced,
    "if_stmt": trace_runtime.if_stmt,
    "static_if": trace_runtime.static_if,
    "missing": trace_runtime.MISSING,
    "for_stmt": trace_runtime.for_stmt,
    "TracedRange": trace_runtime.TracedRange,
    "static_while_cond": trace_runtime.static_while_cond,
    "unrolled": trace_runtime.unrolled,
    "static_for": trace_runtime.static_for,
    "traced_return": trace_runtime.traced_return,
    "traced_break": trace_runtime.traced_break,
    "traced_raise": trace_runtime.traced_raise,
}
# ``__kiln_at(k)`` enters the k-th source position of the function's table (kiln.pyhints
# knows a rewritten function by this free name).
AT = pyhints.REWRITTEN_MARKER


def _rt(attr: str) -> ast.expr:
    return ast.Name(_PREFIX + attr, ast.Load())


def _call(attr: str, *args: ast.expr) -> ast.Call:
    return ast.Call(_rt(attr), list(args), [])


def _names_tuple(names, ctx) -> ast.Tuple:
    return ast.Tuple([ast.Name(n, ctx()) for n in names], ctx())


def _str_tuple(names) -> ast.Constant:
    return ast.Constant(tuple(names))  # one node: the compiler folds a tuple of constants so


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
        return _located(ast.Expr(_call("traced_return")), node)

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
        return _located(ast.Expr(_call("traced_raise")), node) if self.in_if else node

    def visit_Break(self, node):
        if self.loop_depth:
            return node
        return _located(ast.Expr(_call("traced_break")), node)

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


def _located(new: ast.AST, old: ast.AST) -> ast.AST:
    """``ast.copy_location(new, old)``, then :func:`_fill` below ``new``."""
    new.__dict__.update(lineno=old.lineno, col_offset=old.col_offset, end_lineno=old.end_lineno,
                        end_col_offset=old.end_col_offset)
    _fill(new)
    return new


def _fill(node: ast.AST) -> None:
    """Give the nodes below ``node`` (which has a position) that have none ``node``'s position,
    what :func:`ast.fix_missing_locations` gives them (the nearest located ancestor's). The
    walk stops at nodes that have one: the rewrite fills every node it places when it places
    it, so their subtrees are complete (one walk of the whole tree at the end was a third of
    the rewrite's time, most of it over the source's own nodes)."""
    fields = node.__dict__
    position = {"lineno": fields["lineno"], "col_offset": fields["col_offset"],
                "end_lineno": fields["end_lineno"], "end_col_offset": fields["end_col_offset"]}
    # a node's children are read before its own position goes in (fewer fields to step over)
    stack = [(node, False)]
    while stack:
        here, unplaced = stack.pop()
        fields = here.__dict__
        for value in fields.values():
            if type(value) is list:
                stack += [(child, True) for child in value if isinstance(child, ast.AST)
                          and "lineno" not in child.__dict__]
            elif isinstance(value, ast.AST) and "lineno" not in value.__dict__:
                stack.append((value, True))
        if unplaced and "lineno" in here._attributes:
            fields.update(position)


_SIMPLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Assert,
           ast.Delete, ast.Raise)

class _Rewriter(ast.NodeTransformer):
    def __init__(self, filename: str, share: bool = True, body=()):
        self.filename = filename
        self.places: list[SourceLoc] = []  # the positions ``__kiln_at(k)`` enters, by k
        # what each statement stores and loads, and holds (ast_regions): nested regions ask again
        self._names: dict = {}
        self._holds: dict = {}
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
        self.places.append(SourceLoc(self.filename, node.lineno, node.col_offset, end))
        ctx = ast.Call(ast.Name(AT, ast.Load()), [ast.Constant(len(self.places) - 1)], [])
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
        super().generic_visit(node)
        if isinstance(node, (ast.stmt, ast.excepthandler)):  # a with/try/match: its new bodies
            _fill(node)
        return node

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
        _fill(node)
        return node

    def _branch_fn(self, name, params, body, node):
        ret = ast.Return(_names_tuple(params, ast.Load))
        self.depth += 1
        try:
            stmts = self._stmts(body)
        finally:
            self.depth -= 1
        return _located(_function(name, params, stmts + [ret]), node)

    def _assign_results(self, names, call, node):
        if names:
            stmt = ast.Assign([_names_tuple(names, ast.Store)], call)
        else:
            stmt = ast.Expr(call)
        return self._at(node, [_located(stmt, node)])

    def _capture(self, names):
        locals_call = ast.Call(ast.Name("locals", ast.Load()), [], [])
        return _call("capture", locals_call, _str_tuple(names))

    def _structs(self, names):
        locals_call = ast.Call(ast.Name("locals", ast.Load()), [], [])
        return _call("reachable_structs", locals_call, _str_tuple(names))

    def visit_If(self, node):
        n = next(_counter)
        cond = f"__kiln_cond_{n}"
        names, loaded = region_names(node.body + node.orelse, self._names)
        if self.share and shareable(
                node.body + node.orelse, lambda: self._late_risk(node.body + node.orelse, names),
                memo=self._holds):
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
        return [_located(evaluate, node), _located(dispatch, node)]

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
        return [_located(stmt, node) for stmt in (evaluate, *fns, dispatch)]

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
            stored, loaded = region_names(node.body, self._names)
            # a body that rebinds the loop variable leaves its own value after the loop
            if node.target.id not in stored and shareable(
                    node.body, lambda: {node.target.id, *stored}, memo=self._holds):
                return self._shared_for(node, n, it, stored, loaded)
        # The traced body gets a copy; the static loop takes the original nodes.
        traced_body = _clone(node.body) if may_trace else None
        counted = _call("unrolled", ast.Name(it, ast.Load()), ast.Constant(self.filename),
                        ast.Constant(node.lineno))
        static_for = ast.For(node.target, counted, self._stmts(node.body),
                             self._stmts(node.orelse), None)
        evaluate = self._at(node.iter, [ast.Assign([ast.Name(it, ast.Store())], node.iter)])
        if not may_trace:
            return [_located(evaluate, node), _located(static_for, node)]
        stored, loaded = region_names(traced_body, self._names)
        names = [m for m in stored if m != node.target.id]
        body_fn = self._branch_fn(f"__kiln_body_{n}", [node.target.id] + names,
                                  _forbid_escapes(traced_body), node)
        body_fn.body[-1] = _located(ast.Return(_names_tuple(names, ast.Load)), node)
        call = _call("for_stmt", ast.Name(it, ast.Load()), ast.Name(body_fn.name, ast.Load()),
                     _str_tuple(names), self._capture(names), self._structs(loaded))
        traced = [body_fn, self._assign_results(names, call, node)]
        is_range = ast.Call(ast.Name("isinstance", ast.Load()),
                            [ast.Name(it, ast.Load()), _rt("TracedRange")], [])
        dispatch = ast.If(is_range, traced, [static_for])
        return [_located(evaluate, node), _located(dispatch, node)]

    def _shared_for(self, node, n, it, stored, loaded):
        """One rewrite of the body serves both paths (as :meth:`_shared_if`): the body
        function ``for_stmt`` builds the loop from also runs each item of a Python-unrolled
        loop (``static_for``), so a loop's body is not rewritten twice per nesting level."""
        target = node.target.id
        names = [m for m in stored if m != target]
        body_fn = self._branch_fn(f"__kiln_body_{n}", [target] + names, node.body, node)
        body_fn.body[-1] = _located(ast.Return(_names_tuple(names, ast.Load)), node)
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
        return [_located(stmt, node) for stmt in (evaluate, body_fn, dispatch)]


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
    factory = _factories.get(code_key)
    if factory is None:
        factory = _factories[code_key] = _compile_factory(fn)
    make = types.FunctionType(factory.code, fn.__globals__)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet (e.g. a later-defined helper)
            cells.append(None)
    rewritten = make(*_RUNTIME.values(), factory.at, *cells)
    rewritten.__defaults__ = fn.__defaults__
    rewritten.__kwdefaults__ = fn.__kwdefaults__
    return rewritten


class Factory:
    """A function's rewrite: ``code``, that of ``__kiln_factory(*runtime, __kiln_at,
    *freevars)``, which returns the rewritten function, and ``at``, what it binds to
    ``__kiln_at``: ``at(k)`` enters ``places[k]``, the k-th statement's source position
    (made once here, not per statement run)."""

    __slots__ = ("code", "places", "at")

    def __init__(self, code: types.CodeType, places: list[SourceLoc]):
        self.code, self.places = code, places
        self.at = functools.partial(_enter_place, places)


def _enter_place(places: list[SourceLoc], k: int) -> at_source:
    return at_source.of(places[k])


# The rewritten code depends only on the source, so kernels a factory makes (one function
# object per config or head dim, one code object) share it; each binds its own closure.
_factories: dict[tuple[types.CodeType, str], Factory] = {}


def _compile_factory(fn: Callable) -> Factory:
    """The rewrite of ``fn``'s source (:class:`Factory`)."""
    try:
        raw = function_source(fn)
        source = textwrap.dedent(raw)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError) as err:
        raise KilnValueError(f"cannot read the source of {fn.__qualname__}: {err}",
                             fix="define kernels in a .py file (not at an interactive prompt)",
                             loc=SourceLoc(fn.__code__.co_filename,
                                           fn.__code__.co_firstlineno)) from None
    factory = _rewrite_source(fn, source, filename)
    dedent = raw.index(raw.lstrip()[0]) - source.index(source.lstrip()[0])
    _record_column_shift(factory.code, dedent)
    return factory


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


def _rewrite_source(fn: Callable, source: str, filename: str) -> Factory:
    """Parse, rewrite and compile ``fn``'s (dedented) source into its :class:`Factory`."""
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
    rewriter = _Rewriter(filename, share=not declares, body=fdef.body)
    fdef.body = rewriter._stmts(fdef.body)
    _fill(fdef)
    freevars = fn.__code__.co_freevars
    fdef.returns = None
    for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs:
        a.annotation = None  # annotations were read off the original function already
    body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    params = [_PREFIX + name for name in _RUNTIME] + [AT, *freevars]
    factory = _located(_function("__kiln_factory", params, body), fdef)
    code = compile(ast.Module([factory], type_ignores=[]), filename, "exec")
    return Factory(next(c for c in code.co_consts if isinstance(c, types.CodeType)),
                   rewriter.places)
