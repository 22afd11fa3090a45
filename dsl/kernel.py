"""``@kiln.kernel`` and ``@kiln.func``: trace Python functions into MLIR and compile them.

::

    import kiln
    from kiln import f32, i32

    @kiln.kernel(num_threads="BLOCK")   # BLOCK threads per block on every vendor
    def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
        if i < n:
            y[i] = a * x[i] + y[i]

    ck = saxpy.compile(x, y, n, 2.0, BLOCK=256, target="sm_90a")
    print(ck.asm["kiln"])
    saxpy[(n + 255) // 256](x, y, n, 2.0, BLOCK=256)

Parameters are annotated ``kiln.Tensor[dtype]``, a scalar dtype (``f32``, ``"i64"``),
``kiln.constexpr`` (a Python value baked into the kernel; every distinct value compiles a new
kernel) or ``kiln.TensorMap[dtype, box, swizzle]``. Unannotated parameters are inferred from the
first call: arrays become tensors, ``int`` i32, ``float`` f32, ``bool`` i1.

Launch options (keywords of ``compile``/launch): ``target`` (default ``"sm_90a"``, see
:func:`set_default_target`), ``num_warps`` (4; a warp is 32 threads on NVIDIA, 64 on AMD) or
``num_threads`` (the same count on every vendor; see :mod:`kiln.threads` and
``@kiln.kernel(num_threads=...)``), ``opt_level``, ``ptx_version``, ``maxnreg`` and, for
launches, ``stream``. The grid of ``kernel[grid]`` is an int, a tuple of up to 3 ints, or a
callable receiving the constexprs (plus ``num_warps`` and ``num_threads``) and returning one.

Compiled kernels are cached in memory per specialisation (dtype/rank/contiguity of tensors,
dtype of scalars, constexpr values, options) and on disk (``kiln.runtime.cache``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np

from . import ast_rewrite, builder, threads
from .annotations import Param, classify, resolve_annotation
from .core import dtypes as dt
from .core import env
from .core.errors import KilnError, KilnTypeError, user_facing
from .core.options import CompileOptions
from .core.targets import get_target
from .driver import installed, tensor_arg_spec
from .fingerprint import WRAPPERS, keyword_key_part, typed_key
# kiln_asm and TracedKernel stay importable from here (the compiler and tests import them)
from .kernel_trace import ArgSpec, TracedKernel, kiln_asm, trace_kernel  # noqa: F401
from .launch_args import normalize_grid
from .launch_key import exact_keywords, launch_key_part

OPTION_NAMES = ("target", "num_warps", "num_threads", "opt_level", "ptx_version", "maxnreg")
_default_target = "sm_90a"


def set_default_target(target: str) -> None:
    """Target used when ``target=`` is not given. Example: ``kiln.set_default_target("gfx950")``."""
    global _default_target
    _default_target = get_target(target).name


def default_target() -> str:
    return _default_target


def _target_or_default(target) -> str:
    # Only None means the default: "" or a non-string is an error in get_target, not the default.
    return _default_target if target is None else target


def _scalar_dtype_of(value: Any) -> dt.DType | None:
    if isinstance(value, (bool, np.bool_)):
        return dt.i1
    if isinstance(value, int):
        return dt.i32
    if isinstance(value, float):
        return dt.f32
    if isinstance(value, np.generic):
        return dt.dtype(value.dtype)
    return None


class JITKernel:
    """What ``@kiln.kernel`` returns: call ``.compile(...)``, ``.trace(...)`` or ``[grid](...)``."""
    def __init__(self, fn: Callable, *, flush_denormals: bool = False,
                 num_threads: int | str | None = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = fn.__name__
        self.flush_denormals = flush_denormals
        self._sig = inspect.signature(fn)
        self.params = tuple(classify(p.name, resolve_annotation(fn, p.annotation))
                            for p in self._sig.parameters.values())
        threads.check_declaration(self.name, num_threads,
                                  tuple(p.name for p in self.params if p.kind == "constexpr"))
        self.num_threads = num_threads  # declared threads per block (int or a constexpr's name)
        self._runtime_idx = tuple(i for i, p in enumerate(self.params) if p.kind != "constexpr")
        self._constexpr_flags = tuple(p.kind == "constexpr" for p in self.params)
        self._compiled: dict[tuple, Any] = {}  # (arg specs, options) -> CompiledKernel
        self._launches: dict[tuple, _LaunchEntry] = {}  # cheap launch key -> its entry
        self._last_launch: _LaunchEntry | None = None  # tried first, by its guard
        self._interpret_traces: dict[tuple, TracedKernel] = {}

    def __repr__(self):
        return f"<kiln.kernel {self.name}>"

    # ---- binding and specialisation -----------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> list:
        if not kwargs and len(args) == len(self.params):
            return list(args)
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as err:
            raise KilnTypeError(f"bad arguments for kernel {self.name}: {err}",
                                fix=f"call it as {self.name}{self._sig}") from None
        bound.apply_defaults()
        return list(bound.arguments.values())

    def _arg_spec(self, param: Param, value: Any) -> ArgSpec:
        kind, spec = param.kind, param.spec
        if kind == "constexpr":
            return ArgSpec(param.name, "constexpr", value=value,
                           typed=typed_key(value, f"constexpr '{param.name}' of {self.name}"))
        if kind in ("tensor", "tensormap") or (kind == "infer" and _scalar_dtype_of(value) is None):
            ts = tensor_arg_spec(param.name, value)  # (dtype, rank, contiguous)
            want = spec.dtype if spec is not None else None
            if want is not None and ts[0] is not want:
                raise KilnTypeError(
                    f"argument '{param.name}' of {self.name} is declared "
                    f"{'Tensor' if kind == 'tensor' else 'TensorMap'}[{want}] but got an array "
                    f"of {ts[0]}", fix=f"pass a {want} array (e.g. x.astype('{want.numpy}'))")
            if kind == "tensor" and spec.rank is not None and spec.rank != ts[1]:
                raise KilnTypeError(f"argument '{param.name}' of {self.name} is declared with "
                                    f"rank {spec.rank} but got rank {ts[1]}",
                                    fix=f"pass a {spec.rank}-d array")
            if kind == "tensormap":
                if len(spec.box) != ts[1]:
                    raise KilnTypeError(f"TensorMap '{param.name}' box {spec.box} has "
                                        f"{len(spec.box)} dims but the tensor has rank {ts[1]}",
                                        fix="give one box size per tensor dimension")
                return ArgSpec(param.name, "tensormap", ts[0], ts[1], True, tensormap=spec)
            return ArgSpec(param.name, "tensor", ts[0], ts[1], ts[2])
        got = _scalar_dtype_of(value)
        if got is None:
            raise KilnTypeError(f"argument '{param.name}' of {self.name} expects a "
                                f"{spec if spec else 'scalar'} scalar, got {type(value).__name__}",
                                fix="pass a Python/numpy number")
        if kind == "infer":
            return ArgSpec(param.name, "scalar", got)
        if spec.is_int and got.is_float:
            raise KilnTypeError(f"argument '{param.name}' of {self.name} is declared {spec} but "
                                f"got the float {value!r}", fix=f"pass an int, e.g. int({value!r})")
        return ArgSpec(param.name, "scalar", spec)

    def specialize(self, args: tuple, kwargs: dict) -> tuple[ArgSpec, ...]:
        values = self._bind(args, kwargs)
        return tuple(self._arg_spec(p, v) for p, v in zip(self.params, values))

    def _num_warps(self, specs: tuple[ArgSpec, ...], target: str | None,
                   num_warps: int | None, num_threads: int | None) -> int:
        """Warps per block from the declaration and the options (see kiln.threads)."""
        constexprs = {s.name: s.value for s in specs if s.kind == "constexpr"}
        return threads.resolve_num_warps(self.name, self.num_threads, constexprs,
                                         get_target(_target_or_default(target)), num_warps,
                                         num_threads)

    # ---- tracing ---------------------------------------------------------------------------
    def _trace_specs(self, specs: tuple[ArgSpec, ...], target_name: str,
                     num_warps: int) -> TracedKernel:
        return trace_kernel(self.fn, self.name, specs, target_name, num_warps)

    @user_facing
    def trace(self, *args, target: str | None = None, num_warps: int | None = None,
              num_threads: int | None = None, **kwargs) -> TracedKernel:
        """Build the kiln IR only (no lowering).

        Example: ``saxpy.trace(x, y, n, 2.0, BLOCK=256).module_asm``.
        """
        specs = self.specialize(args, kwargs)
        warps = self._num_warps(specs, target, num_warps, num_threads)
        return self._trace_specs(specs, _target_or_default(target), warps)

    # ---- compile and launch ---------------------------------------------------------------
    def _options(self, target, num_warps, opt_level, ptx_version, maxnreg):
        target = _target_or_default(target)
        # the kernel's numerics allow flushing; only NVIDIA has the option (a portable kernel)
        flush = self.flush_denormals and not get_target(target).is_amd
        return CompileOptions(target, num_warps=num_warps, opt_level=opt_level,
                              ptx_version=ptx_version, maxnreg=maxnreg, flush_denormals=flush)

    def _compile_specs(self, specs, options):
        # The installed driver looks the cache up (global values are read again for every new
        # specialisation, see kiln.driver) and traces only on a miss.
        return installed().compile(self.fn, specs, options, lambda: self._trace_specs(
            specs, options.target, options.num_warps))

    @user_facing
    def compile(self, *args, target: str | None = None, num_warps: int | None = None,
                num_threads: int | None = None, opt_level: int = 3,
                ptx_version: int | None = None, maxnreg: int | None = None, **kwargs):
        """Specialise on ``args`` and compile; returns a ``CompiledKernel`` (``.asm``,
        ``.metadata``, ``.launch``).

        Example: ``saxpy.compile(x, y, n, 2.0, BLOCK=256, target="gfx950")``.
        """
        specs = self.specialize(args, kwargs)
        warps = self._num_warps(specs, target, num_warps, num_threads)
        options = self._options(target, warps, opt_level, ptx_version, maxnreg)
        key = (specs, options)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile_specs(specs, options)
        compiled.dump_stages()  # KILN_DUMP_DIR set since this kernel was compiled
        return compiled

    def __getitem__(self, grid) -> Callable:
        """``kernel[grid](*args, **constexprs_and_options)`` launches (see module docs)."""
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, stream=None, **kwargs):
        # The hot path of a repeat launch: the last launch's guarded launcher (its launch key's
        # check fused with the packing, kiln.runtime.launch_fast), else one dict lookup on a
        # cheap key (kind/dtype/rank/contiguity of arrays, Python scalar types, typed positional
        # constexprs, keyword values and their types; kiln.launch_key), then the launcher
        # generated for that specialisation; the full specialisation runs once per key.
        # @user_facing, inlined: its wrapper would cost every launch one more call.
        try:
            last = self._last_launch
            if last is not None and last.target == _default_target and \
                    last.guarded(grid, args, kwargs, stream):
                return
            positional = self._positional_key(args, kwargs)
            try:
                key = (positional, len(args), tuple(kwargs.items()),
                       tuple(map(type, kwargs.values())), _default_target)
                entry = self._launches.get(key)
            except TypeError:  # an unhashable keyword value (an array): the typed key only
                key, entry = None, None
            if entry is None:
                entry = self._launch_entry(key, positional, args, kwargs)
            if entry.fast:
                entry.fast(grid(entry.meta) if callable(grid) else grid, args, stream)
                if entry.guarded is None:
                    entry.guarded = installed().guarded_launcher(
                        entry.ck, args, kwargs, entry.positions, self._constexpr_flags,
                        entry.meta) or False
                if entry.guarded:
                    self._last_launch = entry
            else:
                self._launch_checked(entry, grid, args, kwargs, stream)
        except KilnError as err:
            if env.show_stacktrace():
                raise
            raise err.with_traceback(None) from None

    def _positional_key(self, args: tuple, kwargs: dict) -> tuple:
        try:
            return tuple(map(launch_key_part, args, self._constexpr_flags))
        except KilnTypeError:  # a constexpr with no sound key: say which one
            self.specialize(args, {k: v for k, v in kwargs.items() if k not in OPTION_NAMES})
            raise

    def _launch_checked(self, entry: "_LaunchEntry", grid, args: tuple, kwargs: dict,
                        stream) -> None:
        """A launch through ``CompiledKernel.launch``, which checks every argument; the first
        one of an entry then asks the runtime for a launcher generated for these kinds of
        arguments (``entry.fast``)."""
        if entry.by_position:
            runtime = [args[i] for i in self._runtime_idx]
        else:
            values = self._bind(args, {k: v for k, v in kwargs.items() if k not in OPTION_NAMES})
            runtime = [values[i] for i in self._runtime_idx]
        if callable(grid):
            grid = grid(entry.meta)
        entry.ck.launch(normalize_grid(grid), runtime, stream=stream)
        if entry.fast is None:
            entry.fast = entry.by_position and installed().specialized_launcher(
                entry.ck, args, entry.positions) or False

    def _launch_entry(self, fast_key, positional, args: tuple, kwargs: dict) -> "_LaunchEntry":
        """A launch's entry by the typed key of its keyword values. It is also kept under the
        fast key where == on those values is exact (equal and same type means the same kernel):
        not for -0.0 == 0.0, containers (2 == 2.0 inside) or objects compared by identity."""
        try:
            typed = (positional, len(args), tuple(map(keyword_key_part, kwargs.items())),
                     _default_target)
        except KilnTypeError:
            self.specialize(args, {k: v for k, v in kwargs.items() if k not in OPTION_NAMES})
            raise
        entry = self._launches.get(typed)
        if entry is None:
            entry = self._launches[typed] = _LaunchEntry(
                *self._prepare_launch(args, dict(kwargs)), target=_default_target)
            # derived tensor maps (kiln.copy through TMA) take their source tensor's argument
            entry.positions = self._runtime_idx + tuple(
                self._runtime_idx[i] for i in entry.ck.signature.sources())
        # A NaN is never == another NaN object: each launch would add one more fast key.
        if fast_key is not None and exact_keywords(kwargs):
            self._launches[fast_key] = entry
        return entry

    @property
    def interpret(self) -> "_Interpreted":
        """Run on the CPU instead of a GPU: ``kernel.interpret[grid](*args, **constexprs)``.

        Same arguments and specialisation as a launch (``target`` picks which vendor's kernel
        is traced, default ``"sm_90a"``; ``num_warps``); numpy arrays are written in place.
        See ``docs/interpreter.md``. Example::

            saxpy.interpret[(n + 255) // 256](x, y, n, 2.0, BLOCK=256, num_warps=8)
        """
        return _Interpreted(self)

    def _prepare_launch(self, args: tuple, kwargs: dict) -> tuple:
        options = {k: kwargs.pop(k) for k in OPTION_NAMES if k in kwargs}
        ck = self.compile(*args, **options, **kwargs)
        meta = self._grid_meta(self._bind(args, kwargs), ck.options.num_warps, ck.target)
        by_position = all(i < len(args) for i in self._runtime_idx)
        return ck, meta, by_position

    def _grid_meta(self, values: list, num_warps: int, target) -> dict:
        """What a callable grid receives: the constexprs, ``num_warps`` and ``num_threads``."""
        meta = {p.name: v for p, v in zip(self.params, values) if p.kind == "constexpr"}
        return dict(meta, num_warps=num_warps, num_threads=num_warps * target.warp_size)


class _LaunchEntry:
    """One launch specialisation of a JITKernel: the compiled kernel, the grid callable's
    ``meta``, whether every run-time argument is positional, ``fast``, the launcher generated
    after its first launch, and ``guarded`` (kiln.runtime.launch_fast.guarded_launcher) of its
    first fast launch (each None before it is made, False when there is none); ``target`` is
    the default target it was keyed under."""
    __slots__ = ("ck", "meta", "by_position", "fast", "guarded", "target", "positions")

    def __init__(self, ck, meta: dict, by_position: bool, *, target: str):
        self.ck, self.meta, self.by_position, self.target = ck, meta, by_position, target
        self.fast = self.guarded = None
        self.positions = ()


class _Interpreted:
    """``kernel.interpret``: indexing with a grid gives the CPU-interpreter launcher."""
    def __init__(self, kernel: JITKernel):
        self.kernel = kernel

    def __getitem__(self, grid) -> Callable:
        return functools.partial(self._run, grid)

    def __call__(self, *args, **kwargs):
        raise KilnTypeError(f"kernel.interpret needs a grid: {self.kernel.name}.interpret is "
                            "indexed with the grid before the call, like a launch",
                            fix=f"use {self.kernel.name}.interpret[grid](...), e.g. "
                                f"{self.kernel.name}.interpret[(n + 255) // 256](...)")

    @user_facing
    def _run(self, grid, *args, target: str | None = None, num_warps: int | None = None,
             num_threads: int | None = None, **kwargs):
        k = self.kernel
        target = _target_or_default(target)
        specs = k.specialize(args, kwargs)
        num_warps = k._num_warps(specs, target, num_warps, num_threads)
        key = (specs, target, num_warps)
        traced = k._interpret_traces.get(key)
        if traced is None:
            traced = k._interpret_traces[key] = k._trace_specs(specs, target, num_warps)
        values = k._bind(args, kwargs)
        chip = get_target(target)
        if callable(grid):
            grid = grid(k._grid_meta(values, num_warps, chip))
        installed().interpret(traced, grid, [values[i] for i in k._runtime_idx], chip)


def kernel(fn: Callable | None = None, *, flush_denormals: bool = False,
           num_threads: int | str | None = None):
    """Decorator making ``fn`` a GPU kernel (see module docs for the full example).

    ``num_threads``: the kernel's threads per block, an int or the name of one of its
    ``kiln.constexpr`` parameters (``num_threads="BLOCK"``); every launch and compile then
    uses that many threads on every vendor (warps of 32 on NVIDIA, 64 on AMD), and one asking
    for another count is an error. See :mod:`kiln.threads`.

    ``flush_denormals=True``: f32 arithmetic and ``kiln.exp2`` flush denormals to zero on
    NVIDIA (``nvcc -ftz=true``; a one-instruction ``exp2``), for kernels whose numerics do not
    need values below 2**-126, such as a softmax; AMD targets compile such a kernel as they
    would any other. Example::

        @kiln.kernel(flush_denormals=True)
        def softmax_rows(x: kiln.Tensor[kiln.f32, 2], y: kiln.Tensor[kiln.f32, 2]): ...
    """
    if fn is None:
        return functools.partial(JITKernel, flush_denormals=flush_denormals,
                                 num_threads=num_threads)
    return JITKernel(fn, flush_denormals=flush_denormals, num_threads=num_threads)


class KilnFunc:
    """What ``@kiln.func`` returns: a device helper inlined into the kernel that calls it.

    Example::

        @kiln.func
        def relu(v):
            return kiln.maximum(v, 0.0)
    """
    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        builder.current()  # only callable while tracing
        return ast_rewrite.rewrite(self.fn)(*args, **kwargs)


def func(fn: Callable) -> KilnFunc:
    """Decorator for device helpers called from kernels (inlined at trace time)."""
    return KilnFunc(fn)


WRAPPERS[JITKernel] = WRAPPERS[KilnFunc] = lambda wrapper: wrapper.fn
