"""Kiln's error classes and the user-source locations they point at.

Every user mistake raises a :class:`KilnError` subclass whose message names the user's
``file:line``, shows that source line with a caret under the offending expression and ends
with a ``Fix:`` hint::

    kiln.core.errors.KilnTypeError: saxpy.py:7: cannot store a bf16 value into a Tensor[f32]
        y[i] = v
        ^^^^^^^^
    Fix: convert first, e.g. kiln.cast(v, kiln.f32)

The classes mirror Python's own contract errors so ``except TypeError`` keeps working:

- :class:`KilnTypeError` (``TypeError``): a value of the wrong kind or dtype.
- :class:`KilnValueError` (``ValueError``): a wrong shape, rank, size or option value.
- :class:`UnsupportedError` (``NotImplementedError``): legal, but not supported (e.g. an MMA
  shape the chip lacks). The message names what is supported.
- :class:`TargetError` (``ValueError``): an unknown chip, a PTX version too old for the chip.
- :class:`ResourceError` (``ValueError``): over a hardware limit (shared memory, registers).
- :class:`CompilationError`: the MLIR verifier or a pass rejected the IR the user built.
- :class:`LaunchError` (``RuntimeError``): the driver refused a launch or a copy.
- :class:`InternalError`: a Kiln bug; the message says so.
- :class:`OutOfBoundsError` (``IndexError``), :class:`RaceError`, :class:`DeadlockError`
  (``RuntimeError``): the CPU interpreter caught the kernel misbehaving (``kernel.interpret``).

Kiln's own stack frames are dropped from tracebacks unless ``KILN_SHOW_STACKTRACE=1``.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable, TypeVar

from . import env

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kiln/, above core/
_SOURCE_ROOT = os.path.dirname(_PACKAGE_DIR)
# Kiln's own code: the ``kiln`` package directory (an installed wheel keeps ``passes``,
# ``lowering`` and ``kernels`` inside it) and, in a source checkout, those sibling directories,
# so a bad argument to ``kiln.kernels.attention.decode`` names the caller's line in both.
_COMPILER_DIRS = (_PACKAGE_DIR + os.sep,) + tuple(
    os.path.join(_SOURCE_ROOT, d) + os.sep for d in ("passes", "lowering"))
# The kernel library: inside the package in a wheel (so under _COMPILER_DIRS too), beside it here.
_KERNEL_DIRS = tuple(os.path.join(root, "kernels") + os.sep
                     for root in (_PACKAGE_DIR, _SOURCE_ROOT))
_FRAMEWORK_DIRS = _COMPILER_DIRS + _KERNEL_DIRS


@dataclass(frozen=True)
class SourceLoc:
    """A position in the user's source: file, 1-based line and column, optional end column."""

    filename: str
    line: int
    col: int = 0
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}"

    def source_line(self) -> str | None:
        text = linecache.getline(self.filename, self.line)
        return text.rstrip("\n") if text else None

    def caret(self) -> str | None:
        """The source line and a caret line under ``col..end_col``, or None if unreadable."""
        text = self.source_line()
        if text is None:
            return None
        stripped = text.lstrip()
        indent = len(text) - len(stripped)
        start = max(self.col - indent, 0)
        width = max((self.end_col or self.col + 1) - self.col, 1)
        return f"    {stripped}\n    {' ' * start}{'^' * width}"


def source_loc_from_mlir(loc) -> SourceLoc | None:
    """The innermost ``FileLineColLoc`` of an MLIR ``ir.Location`` (through name, call-site and
    fused locations) as a SourceLoc; None when there is none. MLIR columns are 1-based."""
    if loc.is_a_file():
        return SourceLoc(loc.filename, loc.start_line, max(loc.start_col - 1, 0))
    if loc.is_a_name():
        return source_loc_from_mlir(loc.child_loc)
    if loc.is_a_callsite():
        return source_loc_from_mlir(loc.callee)
    if loc.is_a_fused():
        for inner in loc.locations:
            found = source_loc_from_mlir(inner)
            if found is not None:
                return found
    return None


def _is_framework_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_FRAMEWORK_DIRS) or "/mlir/" in path and "site-packages" in path


def caller_frame(callers_of: str | None = None, *,
                 start: types.FrameType | None = None) -> types.FrameType | None:
    """The innermost stack frame that belongs to user code (outside Kiln's packages).

    ``callers_of`` (a kernel-library module's ``__file__``) names the frame that called into that
    module instead, skipping only it and Kiln's compiler, so a library kernel's own line counts.
    The search starts at ``start`` (default: the caller's frame).
    """
    skip = _is_framework_file if callers_of is None else functools.partial(
        _is_compiler_or, os.path.abspath(callers_of))
    frame = start or sys._getframe(1)
    while frame is not None and (skip(frame.f_code.co_filename)
                                 or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
    return frame


def caller_location(*, callers_of: str | None = None) -> SourceLoc | None:
    """:func:`caller_frame`'s line: ``loc=caller_location(callers_of=__file__)``."""
    frame = caller_frame(callers_of, start=sys._getframe(1))
    return None if frame is None else SourceLoc(frame.f_code.co_filename, frame.f_lineno)


def _is_compiler_or(module: str, filename: str) -> bool:
    path = os.path.abspath(filename)
    return path == module or (path.startswith(_COMPILER_DIRS)
                              and not path.startswith(_KERNEL_DIRS))


class KilnError(Exception):
    """Base class of every error Kiln raises on purpose.

    ``loc`` is the user's source position (found from the stack or given by the tracer),
    ``fix`` a one-line suggestion. ``str(err)`` is the full formatted message.
    """

    def __init__(self, message: str, *, fix: str | None = None, loc: SourceLoc | None = None):
        self.message = message
        self.fix = fix
        self.loc = loc if loc is not None else _current_trace_loc() or caller_location()
        super().__init__(self._format())

    def _format(self) -> str:
        head = f"{self.loc}: {self.message}" if self.loc else self.message
        parts = [head]
        snippet = self.loc.caret() if self.loc else None
        if snippet:
            parts.append(snippet)
        if self.fix:
            parts.append(f"Fix: {self.fix}")
        return "\n".join(parts)

    def __reduce__(self):  # errors cross process boundaries (cache tests, CLI workers)
        return (_rebuild_error, (type(self), self.message, self.fix, self.loc))


def _rebuild_error(cls, message, fix, loc):
    return cls(message, fix=fix, loc=loc)


class KilnTypeError(KilnError, TypeError):
    """A value of the wrong kind or dtype (e.g. storing bf16 into a ``Tensor[f32]``)."""


class KilnValueError(KilnError, ValueError):
    """A wrong shape, rank, size or option value."""


class UnsupportedError(KilnError, NotImplementedError):
    """Legal, but not supported by Kiln or by the chip; the message names what is."""


class TargetError(KilnError, ValueError):
    """An unknown target chip, or options the chip cannot take (checked before LLVM sees them)."""


class ResourceError(KilnError, ValueError):
    """Over a hardware limit of the target (shared memory, threads per block, registers)."""


class CompilationError(KilnError):
    """MLIR rejected the IR (verifier or pass failure). ``reproducer`` names a file to rerun."""

    def __init__(self, message: str, *, fix: str | None = None, loc: SourceLoc | None = None,
                 reproducer: str | None = None):
        self.reproducer = reproducer
        super().__init__(message, fix=fix, loc=loc)


class LaunchError(KilnError, RuntimeError):
    """The driver refused a launch, an allocation or a copy, or no GPU is available."""


class OutOfBoundsError(KilnError, IndexError):
    """The CPU interpreter saw a load or store outside its tensor or shared buffer."""


class RaceError(KilnError, RuntimeError):
    """The CPU interpreter saw a race: an access colliding with an in-flight async copy or MMA,
    a shared load of another thread's store with no barrier between, a TMA tile touched by a
    thread that did not observe its mbarrier phase, or two blocks of a launch touching one
    global element (at least one storing) without atomics.

    The message names both sides: the threads (and blocks) and source lines of the access and
    of the store, load or async operation it collides with.
    """


class DeadlockError(KilnError, RuntimeError):
    """The CPU interpreter found every execution context of a CTA blocked (barrier or mbarrier),
    or a CTA barrier that only some of its threads reach (divergent control flow)."""


class InternalError(KilnError):
    """A bug in Kiln itself, not in the user's kernel."""

    def _format(self) -> str:
        return super()._format() + "\nThis is a Kiln compiler bug; please report it with the kernel."


# The tracer registers the user's current source position here so errors raised deep inside
# op builders point at the kernel line being traced rather than at the builder.
_trace_loc_stack: list[SourceLoc] = []


def _current_trace_loc() -> SourceLoc | None:
    return _trace_loc_stack[-1] if _trace_loc_stack else None


class trace_location:
    """Context manager: errors raised inside point at ``loc`` (used by the tracer per statement)."""

    def __init__(self, loc: SourceLoc | None):
        self.loc = loc

    def __enter__(self):
        if self.loc is not None:
            _trace_loc_stack.append(self.loc)
        return self

    def __exit__(self, *exc):
        if self.loc is not None:
            _trace_loc_stack.pop()
        return False


F = TypeVar("F", bound=Callable)


def user_facing(fn: F) -> F:
    """Decorate public entry points: a KilnError leaves without Kiln's internal frames.

    With ``KILN_SHOW_STACKTRACE=1`` the full traceback is kept.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KilnError as err:
            if env.show_stacktrace():
                raise
            raise err.with_traceback(None) from None

    return wrapper  # type: ignore[return-value]


def checked_call(fn: F) -> F:
    """Decorate a DSL op: a call with an unknown keyword or a wrong argument count is a
    :class:`KilnTypeError` naming the op's parameters, not Python's bare ``TypeError``.

    Example: ``x.store(i, v, mask=m)`` -> ``x.store() got an unexpected keyword argument 'mask'
    ... Fix: call it as x.store(*args, align=None)``.
    """
    # The wrapper closes over the op and strings only, not the Signature: closures of Kiln ops
    # enter the cache key, which cannot key an inspect.Signature.
    params = [p.replace(annotation=p.empty) for p in inspect.signature(fn).parameters.values()]
    is_method = bool(params) and params[0].name == "self"
    name = f"{'x.' if is_method else 'kiln.'}{fn.__name__}"
    fix = f"call it as {name}{inspect.Signature(params[1:] if is_method else params)}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError as err:
            if isinstance(err, KilnError):
                raise
            try:
                inspect.signature(fn).bind(*args, **kwargs)
            except TypeError as bad_call:  # the call itself is malformed, not the op's body
                raise KilnTypeError(f"{name}(): {bad_call}", fix=fix) from None
            raise

    return wrapper  # type: ignore[return-value]


class WaitError(CompilationError):
    """A read of an asynchronously written value or buffer that no wait covers on some path
    (found by ``kiln-verify-waits`` on Kiln IR or on the final AMDGPU assembly)."""


class ScheduleWarning(UserWarning):
    """A cluster's final instructions differ from its declared recipe (``kiln-verify-schedule``)."""


class CacheWarning(UserWarning):
    """A cache directory or entry Kiln will not use (not yours, open to others, unwritable,
    corrupt); compiling goes on without it."""


class ScheduleError(CompilationError):
    """A cluster's final instructions differ from its recipe under ``strict=True``."""
