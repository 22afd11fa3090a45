"""What the front end hands to lowering: the kernel signature, the cache key, argument specs.

Kept apart from :mod:`kiln.kernel` so the tracing code does not import lowering modules
(``kiln.signature``/``arrays``/``cache`` are imported here, lazily where heavy).

The on-disk cache key (:func:`cache_key`) is ``make_key(dependency fingerprint, argument
specs, typed constexpr values, options.key())``, and ``make_key`` adds the toolchain (Kiln's
own sources including ``kernels/``, MLIR/LLVM/llvmlite/numpy versions, the ``ptxas`` and
``ld.lld`` found). The dependency fingerprint (:func:`source_key`,
:class:`kiln.fingerprint.DependencyWalk`) covers the source and bytecode of every user
function and class the trace can reach - kernel, ``@kiln.func`` helpers, ``@kiln.struct``
classes, plain Python helpers, across modules, through globals, closures, defaults and
``module.attr`` chains - and the values of the globals, closure cells and defaults they read,
by type and content (``2``, ``2.0``, ``True`` and ``-0.0`` differ; numpy arrays by bytes). A
value with no sound key is a KilnTypeError with the fix (make it a constexpr). Code facts are
cached per code object; values are read again for every new specialisation. See "What is in
the key" in ``docs/lowering.md``.
"""

from __future__ import annotations

from typing import Any, Callable

from .core.dtypes import DType
from .core.errors import KilnTypeError
from .fingerprint import DependencyWalk, Unfingerprintable, unkeyable

def tensor_arg_spec(name: str, value: Any) -> tuple[DType, int, bool]:
    """(dtype, rank, innermost-stride-is-1) of an array argument."""
    from kiln.arrays import describe_array, is_array

    if not is_array(value):
        raise KilnTypeError(f"argument '{name}' expects an array, got {type(value).__name__}",
                            fix="pass a numpy array or a torch/cupy CUDA tensor")
    info = describe_array(value)
    if info.rank == 0:
        raise KilnTypeError(f"argument '{name}' is a 0-d array", fix="pass a scalar instead")
    return info.dtype, info.rank, info.contiguous_last


def lowering_signature(name: str, specs, block, constexprs, *, dynamic_shared_bytes: int = 0,
                       cluster=None, programmatic_launch: bool = False):
    """The :class:`~kiln.signature.KernelSignature` of a traced specialisation."""
    from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam

    params = []
    for s in specs:
        if s.kind == "tensor":
            params.append(TensorParam(s.name, s.dtype.name, s.rank, s.contiguous))
        elif s.kind == "tensormap":
            params.append(TensorMapParam(s.name, s.dtype.name, s.rank, s.tensormap.box,
                                         s.tensormap.swizzle, s.tensormap.oob_fill_nan))
        elif s.kind == "scalar":
            params.append(ScalarParam(s.name, s.dtype.name))
    return KernelSignature(name, tuple(params), block=block, constexprs=constexprs,
                           dynamic_shared_bytes=dynamic_shared_bytes, cluster=cluster,
                           programmatic_launch=programmatic_launch)


def source_key(fn: Callable) -> str:
    """The dependency fingerprint of kernel function ``fn``: a hash of the source and code of
    every user function and class its trace can reach and of the global, closure and default
    values they read, read now (see :mod:`kiln.fingerprint`)."""
    return DependencyWalk().function(fn)


def cache_key(fn: Callable, specs, options_key: str) -> str:
    """The on-disk key of ``fn`` specialised to ``specs`` under ``options_key`` (see the
    module docs for what it covers)."""
    from kiln.runtime.cache import make_key

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
    return make_key(*parts, options_key)
