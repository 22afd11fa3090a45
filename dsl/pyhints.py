"""Errors for Python and numpy code applied to a traced value, naming the Kiln spelling.

A traced :class:`~kiln.Value` has no Python value at trace time, so ``math.exp(v)``,
``np.exp(v)``, ``float(v)``, ``f"{v}"`` or an ``if`` in a helper that is not a ``@kiln.func``
cannot work. The hooks on ``Value`` call these functions, which read the expression being
evaluated in the caller's frame (its source position, Python >= 3.11) to name what to write
instead::

    x[0] = math.exp(x[1])   # KilnTypeError: math.exp() needs a Python float ... Fix: kiln.exp(...)
"""

from __future__ import annotations

import ast
import operator
import re
import types

from .core.errors import KilnTypeError, SourceLoc, caller_frame

# math.* / numpy.* names -> the Kiln function computing the same thing on traced values.
KILN_EQUIVALENTS = {
    "exp": "kiln.exp", "exp2": "kiln.exp2", "log": "kiln.log", "log2": "kiln.log2",
    "sqrt": "kiln.sqrt", "fabs": "kiln.abs", "abs": "kiln.abs", "absolute": "kiln.abs",
    "fma": "kiln.fma", "maximum": "kiln.maximum", "fmax": "kiln.maximum",
    "minimum": "kiln.minimum", "fmin": "kiln.minimum", "where": "kiln.where",
    "reciprocal": "kiln.rcp", "float32": "kiln.cast(x, kiln.f32)",
    "float16": "kiln.cast(x, kiln.f16)", "int32": "kiln.cast(x, kiln.i32)",
}
# numpy ufuncs that are Python operators: `np.float32(2) * v` keeps working as `2.0 * v`.
UFUNC_OPERATORS = {
    "add": operator.add, "subtract": operator.sub, "multiply": operator.mul,
    "true_divide": operator.truediv, "floor_divide": operator.floordiv, "remainder": operator.mod,
    "bitwise_and": operator.and_, "bitwise_or": operator.or_, "bitwise_xor": operator.xor,
    "left_shift": operator.lshift, "right_shift": operator.rshift, "less": operator.lt,
    "less_equal": operator.le, "greater": operator.gt, "greater_equal": operator.ge,
    "equal": operator.eq, "not_equal": operator.ne,
}
# the name every AST-rewritten function (kernel, @kiln.func) closes over (kiln.ast_rewrite)
REWRITTEN_MARKER = "__kiln_at"
# Code objects of AST-rewritten functions -> how far their source was dedented (their column
# offsets are relative to the dedented text); filled by kiln.ast_rewrite.
COLUMN_SHIFT: dict[types.CodeType, int] = {}


def _position(frame: types.FrameType) -> tuple[SourceLoc, str | None]:
    """The location and source text of the expression ``frame`` is evaluating."""
    whole_line = SourceLoc(frame.f_code.co_filename, frame.f_lineno)
    if not hasattr(frame.f_code, "co_positions"):  # Python 3.10: the first math call of the line
        found = re.search(r"\b(?:math|np|numpy)\.\w+\(.*\)", whole_line.source_line() or "")
        return whole_line, found.group(0) if found else None
    line, end_line, col, end_col = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    if line is None or col is None or end_col is None:
        return whole_line, None
    shift = COLUMN_SHIFT.get(frame.f_code, 0)
    col, end_col = col + shift, end_col + shift
    loc = SourceLoc(frame.f_code.co_filename, line, col,
                    end_col if end_line == line else None)
    text = loc.source_line()
    segment = text[col:end_col] if text is not None and end_line == line else None
    return loc, segment


def _called_name(segment: str | None) -> tuple[str, str] | None:
    """(``"math"``, ``"exp"``) for a segment ``math.exp(...)``; (``""``, ``"float"``) for
    ``float(...)``; None for anything else."""
    try:
        node = ast.parse(segment or "", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id, func.attr
    if isinstance(func, ast.Name):
        return "", func.id
    return None


def _suggestion(name: str) -> str:
    kiln_name = KILN_EQUIVALENTS.get(name)
    if kiln_name is None:
        return ("compute it with Kiln's math (kiln.exp, kiln.exp2, kiln.log, kiln.sqrt, "
                "kiln.abs, kiln.maximum, ...), or on Python values such as a kiln.constexpr")
    return f"use {kiln_name}(...)" if "(" not in kiln_name else f"use {kiln_name}"


def python_number_error(what: str) -> KilnTypeError:
    """The error for ``float(v)``/``int(v)``/``math.f(v)``/``range(v)`` on a traced value."""
    frame = caller_frame()
    loc, segment = _position(frame) if frame is not None else (None, None)
    called = _called_name(segment)
    if called is not None and called[0] and called[1] != "range":
        module, name = called
        return KilnTypeError(f"{module}.{name}() needs a Python number, but its argument is a "
                             "traced value (it has no value until the kernel runs)",
                             fix=_suggestion(name), loc=loc)
    if called is not None and called[1] in ("float", "int", "bool"):
        return KilnTypeError(f"{called[1]}() of a traced value: it has no Python value until "
                             "the kernel runs",
                             fix="use kiln.cast(x, kiln.f32) (or kiln.i32) to convert on the "
                                 "device, or pass a kiln.constexpr for a Python value", loc=loc)
    return KilnTypeError(f"a traced value cannot be used as a Python {what} (e.g. in range())",
                         fix="use kiln.range(...) for traced bounds, or pass a kiln.constexpr",
                         loc=loc)


def truth_value_error() -> KilnTypeError:
    """The error for ``bool(v)``; names ``@kiln.func`` when a plain helper holds the ``if``."""
    frame = caller_frame()
    loc = None
    if frame is not None and REWRITTEN_MARKER not in frame.f_code.co_freevars:
        loc, _ = _position(frame)
        text = (loc.source_line() or "").lstrip()
        # Only an `if` becomes scf.if under @kiln.func; `and`/`or`, `while` still cannot work.
        stmt = next((kw for kw in ("if", "elif") if text.startswith(kw + " ")), None)
        if stmt is not None:
            name = frame.f_code.co_name
            return KilnTypeError(
                f"`{stmt}` on a traced value in {name}(), a plain Python function: only "
                "@kiln.kernel and @kiln.func bodies turn `if` on traced values into scf.if",
                fix=f"decorate {name} with @kiln.func (it is then inlined into the kernel with "
                    "its control flow rewritten)", loc=loc)
    return KilnTypeError(
        "a traced value has no Python truth value (used in `and`/`or`/`not`, a conditional "
        "expression, `assert` or a `while` condition)",
        fix="use an `if` statement (becomes scf.if), `&`/`|` for logic, or kiln.where(c, a, b)",
        loc=loc)


def local_name(value) -> str | None:
    """The name of the user's variable holding ``value`` (e.g. the kernel parameter ``B``)."""
    frame = caller_frame()
    if frame is None:
        return None
    return next((name for name, v in frame.f_locals.items() if v is value), None)


def format_error() -> KilnTypeError:
    """The error for ``str(v)`` / ``f"{v}"``: the text would be the trace-time placeholder."""
    return KilnTypeError(
        "formatting a traced value (print(v), f\"{v}\", str(v)) happens at trace time, when it "
        "has no value yet",
        fix='use kiln.print("v =", v) to print at run time (repr(v) shows its dtype now)')


def numpy_error(name: str) -> KilnTypeError:
    """The error for a numpy function or ufunc called on a traced value."""
    return KilnTypeError(f"numpy.{name}() cannot take a traced value: numpy runs at trace time "
                         "on the host", fix=_suggestion(name))
