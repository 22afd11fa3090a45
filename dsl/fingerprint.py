"""Typed, content-based fingerprints of the values and code a kernel's trace depends on.

Two uses:

* :func:`typed_key` - the in-memory specialisation key of a constexpr value: hashable, and
  distinct wherever Python equality is not (``2``, ``2.0``, ``True``; ``0.0`` and ``-0.0``;
  numpy arrays by dtype, shape and bytes). Functions and classes are keyed by identity.
* :class:`DependencyWalk` - the on-disk key's view of a kernel: the source and code of every
  user function and class its trace can reach (through globals, closures, defaults and
  ``module.attr`` chains) and the values of the globals they read. Kiln's own code (``kiln``,
  ``kiln.passes``, ``kiln.lowering``, ``kiln.kernels``) is covered by the Kiln-source hash of
  :mod:`kiln.runtime.cache`, so it is not read here (closures and defaults of Kiln's functions
  still are: a library kernel made by a factory differs by what it closes over). Neither is the
  standard library nor installed packages: their code is keyed by name, and only the
  MLIR/LLVM/llvmlite/numpy versions of the toolchain part stand for it.

Example::

    typed_key(2) != typed_key(2.0) != typed_key(True)
    DependencyWalk().function(saxpy.fn)   # 'fn:...#<sha256 of everything saxpy reaches>'
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.util
import inspect
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .core.dtypes import DType
from .core.errors import KilnTypeError, SourceLoc

_FIX = ("pass it to the kernel as a kiln.constexpr parameter (or make it a number, string, "
        "tuple, dict, numpy array or frozen dataclass)")


class Unfingerprintable(Exception):
    """A value with no sound content key (the caller turns it into a KilnTypeError)."""

    def __init__(self, value):
        super().__init__(type(value).__qualname__)
        self.value = value


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _canon(v: Any, callable_key: Callable[[Any], Any]) -> Any:
    """A hashable tuple naming ``v`` by type and content; code objects (functions, classes,
    modules, helpers) are named by ``callable_key``."""
    t = type(v)
    if t is int or t is bool or t is str or t is bytes or v is None:
        return (t.__name__, v)
    if t is float:
        return ("float", v.hex())  # -0.0 != 0.0; every NaN one key
    if v is Ellipsis:
        return ("ellipsis",)
    if t is range or t is slice:
        return (t.__name__, _canon(v.start, callable_key), _canon(v.stop, callable_key),
                _canon(v.step, callable_key))
    if t is complex:
        return ("complex", v.real.hex(), v.imag.hex())
    if t is DType:
        return ("DType", v.name)
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject:
            raise Unfingerprintable(v)
        data = hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
        return ("ndarray", v.dtype.str, v.shape, data)
    if isinstance(v, np.generic):
        return ("np." + t.__name__, v.dtype.str, v.tobytes())
    if isinstance(v, np.dtype):
        return ("np.dtype", v.str)
    if isinstance(v, enum.Enum):
        return (callable_key(t), v.name, _canon(v.value, callable_key))
    if t is list or t is tuple or t is set or t is frozenset or t is dict:
        return (t.__name__, _items(v, callable_key))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        if not t.__dataclass_params__.frozen:
            raise Unfingerprintable(v)
        return (callable_key(t), tuple((f.name, _canon(getattr(v, f.name), callable_key))
                                       for f in dataclasses.fields(v)))
    if isinstance(v, (tuple, list, dict, set, frozenset, int, float, str, bytes)):
        return (callable_key(t), _items(v, callable_key))  # NamedTuple, IntFlag-like subclasses
    return callable_key(v)


def _items(v, callable_key) -> tuple:
    if isinstance(v, dict):
        return tuple((_canon(k, callable_key), _canon(x, callable_key)) for k, x in v.items())
    if isinstance(v, (set, frozenset)):
        return tuple(sorted((_canon(x, callable_key) for x in v), key=repr))
    if isinstance(v, (tuple, list)):
        return tuple(_canon(x, callable_key) for x in v)
    return (repr(v),)  # a str/int/float subclass value


_CODE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
               types.ModuleType)


def _identity(v):
    """In memory, code (functions, classes, modules, Kiln helpers and kernels, library
    callables) is keyed by identity and Kiln's own objects by their state; a user object has
    no sound key (it could change while its kernel is reused)."""
    origin_of_type = _object_origin(type(v))
    if isinstance(v, _CODE_TYPES) or (callable(v) and origin_of_type != "user"):
        return ("id", v)
    if origin_of_type == "kiln" and hasattr(v, "__dict__"):
        return ("kiln", type(v), _canon(dict(vars(v)), _identity))
    raise Unfingerprintable(v)


def typed_key(value: Any, what: str) -> Any:
    """The in-memory specialisation key of the constexpr ``what``: hashable and typed
    (``typed_key(2, "D") != typed_key(2.0, "D")``). Raises KilnTypeError for a value whose
    content Kiln cannot key (a mutable object)."""
    try:
        return _canon(value, _identity)
    except Unfingerprintable as err:
        raise unkeyable(what, err.value) from None
    except RecursionError:  # a container holding itself
        raise unkeyable(what, value) from None


def unkeyable(what: str, value) -> KilnTypeError:
    """The error for a constexpr ``what`` whose value has no sound key."""
    return KilnTypeError(
        f"{what} is a {type(value).__qualname__}, which Kiln cannot key by content (a mutable "
        "object could change while its compiled kernel is reused)",
        fix="pass a number, string, tuple, dict, numpy array, dtype, function or frozen dataclass")


# ---- launch keys (the hot path: cheap cases first) -----------------------------------------
# Keyword value types whose == is exact within one type (floats: all but 0.0 == -0.0).
EXACT_KEY_TYPES = frozenset({int, bool, str, type(None), DType})


def constexpr_key(a: Any) -> Any:
    """A launch-key constexpr: typed, so 2, 2.0 and True, or 0.0 and -0.0, differ."""
    kind = type(a)
    if kind is int or kind is bool or kind is str:
        return (kind, a)
    if kind is float:
        return a.hex()
    return typed_key(a, "a constexpr")


def keyword_key_part(item: tuple) -> Any:
    """``(name, typed value)`` of one launch keyword."""
    return (item[0], constexpr_key(item[1]))


# Kiln's wrappers of user functions (kernels, @kiln.func, autotuners) -> what they wrap, keyed
# by what they wrap and not by their caches; kiln.kernel and kiln.autotune register theirs (they
# import this module).
WRAPPERS: dict[type, Callable[[Any], Any]] = {}


# ---- where code lives ----------------------------------------------------------------------
_origins: dict[str, str] = {}


def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    kiln_dirs = []
    for name in ("kiln", "kiln.passes", "kiln.lowering", "kiln.kernels"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            kiln_dirs.append(str(Path(spec.origin).resolve().parent) + "/")
    paths = sysconfig.get_paths()
    external = {str(Path(paths[k]).resolve()) + "/"
                for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(kiln_dirs), tuple(external)


_ROOTS: tuple | None = None


def origin(filename: str) -> str:
    """``"kiln"`` (Kiln's own sources), ``"external"`` (stdlib, installed packages, C code) or
    ``"user"`` for the code in ``filename``."""
    found = _origins.get(filename)
    if found is None:
        global _ROOTS
        if _ROOTS is None:
            _ROOTS = _roots()
        try:
            path = str(Path(filename).resolve())
        except (OSError, ValueError):
            path = filename
        if path.startswith(_ROOTS[0]):
            found = "kiln"
        elif path.startswith(_ROOTS[1]) or filename.startswith("<frozen"):
            found = "external"
        else:
            found = "user"  # including exec'd code: keyed by its code bytes (see _static)
        _origins[filename] = found
    return found


def _object_origin(obj) -> str:
    name = getattr(obj, "__module__", None) or ""
    filename = getattr(sys.modules.get(name), "__file__", None)
    if filename:
        return origin(filename)
    # No file: a built-in or frozen module, or the __main__ of a REPL, notebook or `python -c`,
    # whose classes are user code (keyed by name only they would hit stale cache entries).
    return "user" if name == "__main__" else "external"


# ---- static facts of one code object, cached ----------------------------------------------
_LOADS = ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME")
_ATTRS = ("LOAD_ATTR", "LOAD_METHOD")
_static_cache: dict[tuple[types.CodeType, str], tuple] = {}


def _code_digest(code: types.CodeType, digest) -> None:
    digest.update(code.co_code)
    for names in (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars):
        digest.update(repr(names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, digest)
        else:
            digest.update(repr(_canon(const, repr)).encode())


def _static(fn) -> tuple[str, dict[tuple[str, ...], int]]:
    """(source with its file and line + code digest, {global name or attribute chain: first
    line reading it}) of ``fn``'s code and the code nested in it."""
    code = fn.__code__
    # Code objects compare equal across files (co_filename is not compared).
    found = _static_cache.get((code, code.co_filename))
    if found is not None:
        return found
    digest = hashlib.sha256()
    _code_digest(code, digest)
    try:
        lines, first = inspect.getsourcelines(fn)
        # A kernel carries source locations, so one that moves must miss even with the same text.
        source = f"{inspect.getsourcefile(fn)}:{first}\n{''.join(lines)}"
    except (OSError, TypeError):
        source = f"{code.co_filename}:{code.co_firstlineno}"
    reads: dict[tuple[str, ...], int] = {}
    stack = [code]
    while stack:
        current = stack.pop()
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
        chain: list[str] = []
        line = current.co_firstlineno
        for ins in dis.get_instructions(current):
            line = ins.positions.lineno or line
            if ins.opname in _ATTRS and chain:
                chain.append(ins.argval)
                reads.setdefault(tuple(chain), line)
                continue
            chain = []
            if ins.opname in _LOADS:
                chain = [ins.argval]
                if ins.opname != "LOAD_DEREF":  # closure cells are all read anyway
                    reads.setdefault((ins.argval,), line)
    found = (f"{source}\n#{digest.hexdigest()}", reads)
    _static_cache[(code, code.co_filename)] = found
    return found


def closure_values(fn) -> dict[str, Any]:
    """``{free variable: value}`` of ``fn``'s closure (cells not yet assigned are left out)."""
    scope = {}
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            scope[var] = cell.cell_contents
        except ValueError:  # not yet assigned
            pass
    return scope


class DependencyWalk:
    """One key computation: walks code reachable from a kernel, reading global values now.

    Each user function and class gets a label ``kind:qualname#hash`` whose hash covers its
    source, code, and the labels/values of what it reads (a Merkle tree, so every function the
    trace can reach is in the root's label). Labels are memoised per walk only: global values
    are read again by every key computation.
    """

    def __init__(self):
        self._labels: dict[int, str] = {}
        self._keep: list = []  # objects whose id() is memoised stay alive for the walk

    # ---- values ---------------------------------------------------------------------------
    def value(self, v: Any) -> str:
        """The key text of a value (a global, closure cell, default or constexpr)."""
        try:
            return repr(_canon(v, self._callable))
        except RecursionError:  # a container holding itself
            raise Unfingerprintable(v) from None

    def _callable(self, v) -> str:
        for kind, unwrap in WRAPPERS.items():
            if isinstance(v, kind):
                return self._callable(unwrap(v))
        if isinstance(v, types.FunctionType):
            return self.function(v)
        if isinstance(v, types.MethodType):
            return f"method:{self._callable(v.__func__)}:{self.value(v.__self__)}"
        if isinstance(v, (staticmethod, classmethod)):
            return self._callable(v.__func__)
        if isinstance(v, type):
            return self.cls(v)
        if isinstance(v, types.ModuleType):
            return f"module:{v.__name__}"
        if isinstance(v, (types.BuiltinFunctionType, types.WrapperDescriptorType,
                          types.MethodDescriptorType)):
            return f"builtin:{getattr(v, '__module__', None)}.{v.__qualname__}"
        t = type(v)
        if t.__module__ == "typing" or t.__module__ == "types":
            return f"typing:{v!r}"
        if isinstance(v, functools.partial):
            return (f"partial:{self._callable(v.func)}:{self.value(v.args)}:"
                    f"{self.value(v.keywords)}")
        wrapped = getattr(v, "__wrapped__", None)
        if wrapped is not None and callable(v):  # functools.lru_cache and other wrappers
            return f"wrapped:{_type_name(t)}:{self._callable(wrapped)}"
        origin_of_type = _object_origin(t)
        if origin_of_type == "external" and callable(v):  # numpy ufuncs and the like
            return f"external:{_type_name(t)}:{getattr(v, '__module__', '')}." \
                   f"{getattr(v, '__qualname__', getattr(v, '__name__', ''))}"
        if origin_of_type == "kiln" and hasattr(v, "__dict__"):
            # Kiln's own helper objects (factories, layouts): their code is Kiln source, their
            # state is what they were built with.
            return f"kiln:{_type_name(t)}:{self.value(dict(vars(v)))}"
        raise Unfingerprintable(v)

    # ---- code -----------------------------------------------------------------------------
    def function(self, fn) -> str:
        """The label of a Python function (user code: source, code and everything it reads)."""
        label = self._labels.get(id(fn))
        if label is not None:
            return label
        where = origin(fn.__code__.co_filename)
        name = f"{fn.__module__}.{fn.__qualname__}"
        if where == "external":
            return f"fn:{name}"
        self._keep.append(fn)
        self._labels[id(fn)] = f"fn:{name}@{fn.__code__.co_firstlineno} (recursive)"
        parts = [name]
        cells = closure_values(fn)
        reads: dict[str, Any] = {f"closure {k}": v for k, v in cells.items()}
        if fn.__defaults__:
            reads["defaults"] = fn.__defaults__
        if fn.__kwdefaults__:
            reads["kwdefaults"] = fn.__kwdefaults__
        lines: dict[str, int] = {}
        if where == "user":
            source, loads = _static(fn)
            parts.append(source)
            scope = fn.__globals__
            for chain, line in loads.items():
                if len(chain) == 1:
                    if chain[0] in scope:
                        reads[f"global {chain[0]}"] = scope[chain[0]]
                        lines[f"global {chain[0]}"] = line
                    continue
                # module.attr chains: the attribute of a module is a global of that module
                base = cells[chain[0]] if chain[0] in cells else scope.get(chain[0])
                for attr in chain[1:-1]:
                    base = getattr(base, attr, None) if isinstance(base, types.ModuleType) else None
                if isinstance(base, types.ModuleType) and hasattr(base, chain[-1]):
                    reads[f"global {'.'.join(chain)}"] = getattr(base, chain[-1])
                    lines[f"global {'.'.join(chain)}"] = line
        for what, v in sorted(reads.items()):
            try:
                parts.append(f"{what}={self.value(v)}")
            except Unfingerprintable as err:
                code = fn.__code__
                kind, _, read = what.partition(" ")
                raise KilnTypeError(
                    f"{fn.__qualname__} reads the {kind} '{read}', a "
                    f"{type(err.value).__qualname__}, which Kiln cannot key by content: a "
                    "compiled kernel could be reused after it changes", fix=_FIX,
                    loc=SourceLoc(code.co_filename, lines.get(what, code.co_firstlineno))
                ) from None
        label = f"fn:{name}#{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:32]}"
        self._labels[id(fn)] = label
        return label

    def cls(self, cls: type) -> str:
        """The label of a class (user code: source, methods, class attributes, base classes)."""
        label = self._labels.get(id(cls))
        if label is not None:
            return label
        name = _type_name(cls)
        if _object_origin(cls) != "user":
            return f"class:{name}"
        self._keep.append(cls)
        self._labels[id(cls)] = f"class:{name} (recursive)"
        try:
            lines, first = inspect.getsourcelines(cls)
            parts = [f"{inspect.getsourcefile(cls)}:{first}\n{''.join(lines)}"]
        except (OSError, TypeError):
            parts = [name]
        parts.extend(self.cls(b) for b in cls.__mro__[1:] if b is not object)
        for attr, v in sorted(vars(cls).items()):
            if attr.startswith("__") and attr.endswith("__") and attr != "__init__":
                continue
            if isinstance(v, property):
                v = (v.fget, v.fset, v.fdel)
            try:
                parts.append(f"{attr}={self.value(v)}")
            except Unfingerprintable as err:
                # defined in the class source above; only a later rebinding would be missed
                parts.append(f"{attr}=<{_type_name(type(err.value))}>")
        label = f"class:{name}#{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:32]}"
        self._labels[id(cls)] = label
        return label
