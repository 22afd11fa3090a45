"""What the front end needs from the layers above it, and what it hands them.

``@kiln.kernel`` compiles, launches and interprets, but those jobs live in the backends, the
runtime and the interpreter, which sit above the dsl (docs/architecture.md). The dsl declares
the interface, :class:`Driver`; the facade (``kiln/__init__``) installs the implementation at
import, so a dsl module never imports an upper layer. What the front end hands over: the kernel
signature (:func:`lowering_signature`), argument specs (:func:`tensor_arg_spec`) and the
front-end half of the cache key (:func:`key_parts`).

The on-disk cache key is ``make_key(*key_parts(fn, specs), options.key())``; ``make_key``
(``kiln.runtime.cache``) adds the toolchain (Kiln's own sources including ``kernels/``,
MLIR/LLVM/llvmlite/numpy versions, the ``ptxas`` and ``ld.lld`` found). The dependency
fingerprint (:func:`source_key`, :class:`kiln.fingerprint.DependencyWalk`) covers the source and
bytecode of every user function and class the trace can reach - kernel, ``@kiln.func`` helpers,
``@kiln.struct`` classes, plain Python helpers, across modules, through globals, closures,
defaults and ``module.attr`` chains - and the values of the globals, closure cells and defaults
they read, by type and content (``2``, ``2.0``, ``True`` and ``-0.0`` differ; numpy arrays by
bytes). A value with no sound key is a KilnTypeError with the fix (make it a constexpr). Code
facts are cached per code object; values are read again for every new specialisation. See "What
is in the key" in ``docs/lowering.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .arrays import describe_array, is_array
from .core.dtypes import DType
from .core.errors import InternalError, KilnTypeError
from .fingerprint import DependencyWalk, Unfingerprintable, unkeyable
from .signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam


@dataclass(frozen=True)
class Driver:
    """The upper layers' entry points that ``@kiln.kernel`` calls.

    ``compile(fn, specs, options, trace)`` returns a compiled kernel (cache lookup, then
    ``trace()`` and the backend's stages); ``launch(ck, grid, args, stream=)`` runs one on the
    GPU; ``specialized_launcher(ck, args, positions)`` returns, after a launch, a faster
    launcher for arguments of the kinds of ``args`` (or None);
    ``guarded_launcher(ck, args, kwargs, positions, constexpr_flags, meta)`` one that also
    checks that a call has the launch key of ``(args, kwargs)`` (returning False, having
    launched nothing, when not); ``interpret(traced, grid, args, target)`` runs a traced kernel
    on the CPU.
    """

    compile: Callable
    launch: Callable
    specialized_launcher: Callable
    interpret: Callable
    guarded_launcher: Callable


_installed: list[Driver] = []


def install(driver: Driver) -> None:
    """Make ``driver`` the one ``@kiln.kernel`` uses (the facade does this at import)."""
    _installed[:] = [driver]


def installed() -> Driver:
    """The installed :class:`Driver`."""
    if not _installed:
        raise InternalError("no Kiln driver is installed (kiln/__init__ installs it at import)")
    return _installed[0]

def tensor_arg_spec(name: str, value: Any) -> tuple[DType, int, bool]:
    """(dtype, rank, innermost-stride-is-1) of an array argument."""
    if not is_array(value):
        raise KilnTypeError(f"argument '{name}' expects an array, got {type(value).__name__}",
                            fix="pass a numpy array or a torch/cupy CUDA tensor")
    info = describe_array(value)
    if info.rank == 0:
        raise KilnTypeError(f"argument '{name}' is a 0-d array", fix="pass a scalar instead")
    return info.dtype, info.rank, info.contiguous_last


def lowering_signature(name: str, specs, block, constexprs, *, dynamic_shared_bytes: int = 0,
                       cluster=None, programmatic_launch: bool = False, derived=()):
    """The :class:`~kiln.signature.KernelSignature` of a traced specialisation (``derived``:
    the tensor maps the trace added, after the declared parameters)."""
    params = []
    for s in specs:
        if s.kind == "tensor":
            params.append(TensorParam(s.name, s.dtype.name, s.rank, s.contiguous))
        elif s.kind == "tensormap":
            params.append(TensorMapParam(s.name, s.dtype.name, s.rank, s.tensormap.box,
                                         s.tensormap.swizzle, s.tensormap.oob_fill_nan))
        elif s.kind == "scalar":
            params.append(ScalarParam(s.name, s.dtype.name))
    return KernelSignature(name, tuple(params) + tuple(derived), block=block,
                           constexprs=constexprs,
                           dynamic_shared_bytes=dynamic_shared_bytes, cluster=cluster,
                           programmatic_launch=programmatic_launch)


def source_key(fn: Callable) -> str:
    """The dependency fingerprint of kernel function ``fn``: a hash of the source and code of
    every user function and class its trace can reach and of the global, closure and default
    values they read, read now (see :mod:`kiln.fingerprint`)."""
    return DependencyWalk().function(fn)


def key_parts(fn: Callable, specs) -> list[str]:
    """The front end's part of the on-disk key of ``fn`` specialised to ``specs``: the
    dependency fingerprint, each argument spec and each constexpr's typed value."""
    walk = DependencyWalk()
    parts = [walk.function(fn)]
    for s in specs:
        if s.kind != "constexpr":
            parts.append(s.key())
            continue
        try:
            parts.append(f"{s.name}=constexpr:{walk.value(s.value)}")
        except Unfingerprintable as err:
            raise unkeyable(f"constexpr '{s.name}'", err.value) from None
    return parts
