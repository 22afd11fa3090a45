"""What a region of a kernel's statements (an ``if``'s branches, a loop's body) stores and
loads, and whether a function taking and returning the names it stores would run it the same
(the AST rewrite's static path then shares the traced path's branch or body function).

Example::

    stored, loaded = region_names(if_node.body + if_node.orelse)
    shared = shareable(if_node.body + if_node.orelse, lambda: set(stored))
"""

from __future__ import annotations

import ast
import collections
from typing import Callable


# Nodes that open a scope of their own: the names they store are not the region's.
_NAMED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_ANONYMOUS_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def region_names(stmts, memo: dict | None = None) -> tuple[list[str], list[str]]:
    """(stored names, loaded-only names) of a list of statements, each in first-seen order.

    Loaded names matter for ``@kiln.struct`` objects mutated in place (``s.m = v`` or a method
    call such as ``s.update(v)``): the runtime carries every struct the region can reach. A
    nested def/lambda/comprehension's stores are its own, but it can still read and mutate a
    struct. The walk is ``ast.NodeVisitor``'s order, without its per-node dispatch. ``memo``
    (one dict per function, its statements unchanged meanwhile) keeps each statement's names,
    so the regions of nested ``if``s do not walk their statements again at every level.
    """
    stored: dict[str, None] = {}  # ordered sets
    loaded: dict[str, None] = {}
    for stmt in stmts:
        own_stored, own_loaded = _statement_names(stmt, {} if memo is None else memo)
        stored.update(own_stored)
        loaded.update(own_loaded)
    return list(stored), [name for name in loaded if name not in stored]


def _statement_names(stmt: ast.stmt, memo: dict) -> tuple[dict, dict]:
    """The names ``stmt`` stores and loads (ordered sets), from ``memo`` when it has them."""
    found = memo.get(stmt)
    if found is not None:
        return found
    stored: dict[str, None] = {}
    loaded: dict[str, None] = {}

    def visit(node: ast.AST, inner: bool) -> None:
        kind = type(node)
        if kind is ast.Name:
            names = loaded if not isinstance(node.ctx, ast.Store) else None if inner else stored
            if names is not None and node.id not in names and not node.id.startswith("__kiln_"):
                names[node.id] = None
            return
        if not inner and node is not stmt and isinstance(node, ast.stmt):
            below_stored, below_loaded = _statement_names(node, memo)
            stored.update(below_stored)
            loaded.update(below_loaded)
            return
        if kind in _NAMED_SCOPES:
            if not inner and node.name not in stored and not node.name.startswith("__kiln_"):
                stored[node.name] = None
            inner = True
        elif kind in _ANONYMOUS_SCOPES:
            inner = True
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        visit(item, inner)
            elif isinstance(value, ast.AST):
                visit(value, inner)

    visit(stmt, False)
    memo[stmt] = stored, loaded
    return stored, loaded


# What a branch body may not hold for its static run to go through the branch function: the
# function would change what they mean (leaving the enclosing function or loop, a raise the
# traced path defers, unbinding, names bound in the enclosing scope or captured late by a
# nested scope, frame introspection). A lambda is shareable unless it reads a name the region
# stores (see _late_bound).
_UNSHAREABLE = (ast.Return, ast.Raise, ast.Yield, ast.YieldFrom, ast.Await, ast.Global,
                ast.Nonlocal, ast.Delete, ast.NamedExpr, ast.FunctionDef,
                ast.AsyncFunctionDef, ast.ClassDef, ast.GeneratorExp, ast.AsyncFor,
                ast.AsyncWith)
_INTROSPECTION = frozenset({"locals", "vars", "eval", "exec", "dir", "super", "__class__"})


def shareable(stmts, stored: Callable[[], set] = set, in_loop: bool = False,
              memo: dict | None = None) -> bool:
    """Whether ``stmts`` (an ``if``'s branches or a loop's body) mean the same run inside a
    function that takes and returns the names they assign; ``stored()``: the names they store
    that a lambda among them must not read (asked only when there is one). ``memo`` (one dict
    per function, as :func:`region_names`') keeps what each statement holds."""
    memo = {} if memo is None else memo
    late: list = []
    for stmt in stmts:
        unshareable, escapes, lambdas = _holds(stmt, memo)
        if unshareable or escapes and not in_loop:
            return False
        for node in lambdas:
            if not late:
                late.append(stored())
            if _late_bound(node, late[0]):
                return False
    return True


def _holds(node: ast.AST, memo: dict) -> tuple[bool, bool, tuple]:
    """What ``node``'s subtree holds: a node of ``_UNSHAREABLE`` or an introspecting name; a
    ``break``/``continue`` outside any loop within it; its lambdas. Statements' from ``memo``."""
    found = memo.get(node) if isinstance(node, ast.stmt) else None
    if found is not None:
        return found
    unshareable = isinstance(node, _UNSHAREABLE) or (
        isinstance(node, ast.Name) and node.id in _INTROSPECTION)
    escapes = isinstance(node, (ast.Break, ast.Continue))
    lambdas: tuple = (node,) if isinstance(node, ast.Lambda) else ()
    loop = isinstance(node, (ast.For, ast.While))  # its breaks stay inside (its else too)
    for value in () if unshareable else node.__dict__.values():
        for child in value if isinstance(value, list) else (value,):
            if not isinstance(child, ast.AST):
                continue
            below, below_escapes, below_lambdas = _holds(child, memo)
            if below:
                unshareable = True
                break
            escapes = escapes or below_escapes and not loop
            lambdas += below_lambdas
        if unshareable:
            break
    found = (unshareable, escapes, lambdas)
    if isinstance(node, ast.stmt):
        memo[node] = found
    return found


def _late_bound(node: ast.Lambda, stored) -> bool:
    """Whether lambda ``node`` reads a name of ``stored``: in the branch function it would
    close over the function's own binding, not see the enclosing scope's later rebinding (the
    names it only reads are the enclosing scope's cells either way)."""
    params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                              node.args.vararg, node.args.kwarg) if a is not None}
    return any(isinstance(n, ast.Name) and n.id in stored and n.id not in params
               for n in ast.walk(node.body))


def declares_outer_names(fdef: ast.FunctionDef) -> bool:
    """Whether ``fdef`` rebinds globals or enclosing names (``locals()`` cannot pass them)."""
    return any(isinstance(node, (ast.Global, ast.Nonlocal)) for node in ast.walk(fdef))


def store_counts(stmts) -> collections.Counter:
    """How many times ``stmts`` bind each name in their own scope (not in nested scopes)."""
    counts: collections.Counter = collections.Counter()
    stack = list(stmts)
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is ast.Name:
            if isinstance(node.ctx, ast.Store):
                counts[node.id] += 1
            continue
        if kind in _NAMED_SCOPES or kind in _ANONYMOUS_SCOPES:
            continue  # its name binds here, but a def/class is never shareable anyway
        for value in node.__dict__.values():
            if isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)
    return counts
