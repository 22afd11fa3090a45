"""The kernel library's runtime: what every entry point (``prefill``, ``decode``,
``decode_attention``, ``combine``, ``matmul``, ``grouped_matmul``) shares between its checks
and its kernel, so that a library kernel is device code, a config and a short entry point.
docs/kernels.md ("The library runtime", "Inputs and validation") describes backends, array
kinds, plans, launches and CUDA graphs.

Every check raises a :class:`kiln.KilnError` subclass naming the argument, at the caller's line
(see :func:`kiln.core.errors.caller_location`). Shapes are checked by *named dimensions*: the
first argument that has a dimension binds its size, later ones must agree::

    dims = Dims()
    dims.tensor("q", q, "B Sq Hq D", dtype=kiln.bf16)
    dims.tensor("k_cache", k_cache, "num_pages page_size Hkv D", dtype=kiln.bf16)
    # KilnValueError: k_cache's D is 64, but q's D is 128

This module is the library's one import of Kiln's runtime layer (launcher, driver, the
native shim's plan guards).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Iterator

import numpy as np

import kiln
from kiln.arrays import is_torch_tensor as is_torch
from kiln.core.targets import get_target
from kiln.kernel import default_target
from kiln.runtime.cuda import driver
from kiln.runtime.launch import bind_launch, launch_with_outputs
from kiln.runtime.native import native_module
from kiln.runtime.native_torch import torch_bridge

from .arrays import (ArrayLib, contiguous, empty_like, is_cupy,  # noqa: F401  (runtime's API)
                     torch_dtype)
from .plan_guard import make_guard, torch_tensor_check  # noqa: F401  (runtime's API)
from .workspaces import TorchOutputs  # noqa: F401  (kiln.kernels.runtime.TorchOutputs)

BACKENDS = (None, "cuda", "gpu", "interpret")


def dtype_of(name: str, x: Any) -> kiln.DType:
    """``x``'s element type as a Kiln dtype (KilnTypeError for an array of another kind)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise kiln.KilnTypeError(f"{name} must be a numpy array or a torch tensor, got "
                                 f"{type(x).__name__}", fix=f"pass {name} as an array")
    try:
        return kiln.dtype(x.dtype)
    except (TypeError, ValueError, KeyError):
        raise kiln.KilnTypeError(f"{name} has dtype {x.dtype}, which Kiln does not know",
                                 fix=f"convert {name} to a supported dtype") from None


class Dims:
    """Named dimension sizes bound by the arguments of one call (see the module docs)."""

    def __init__(self):
        self.sizes: dict[str, int] = {}
        self.bound_by: dict[str, str] = {}

    def tensor(self, name: str, x: Any, dims: str, *, dtype: kiln.DType | None = None
               ) -> tuple[int, ...]:
        """Check ``x``'s kind, its rank against ``dims`` (space-separated dimension names),
        each size against the argument that bound that name first, and its dtype. Returns the
        shape as ints."""
        got = dtype_of(name, x)
        names = dims.split()
        shape = tuple(int(d) for d in x.shape)
        if len(shape) != len(names):
            raise kiln.KilnValueError(f"{name} must be [{', '.join(names)}] (rank {len(names)}),"
                                      f" got shape {shape}", fix=f"reshape {name}")
        for dim, size in zip(names, shape):
            if dim not in self.sizes:
                self.sizes[dim], self.bound_by[dim] = size, name
            elif self.sizes[dim] != size:
                first = self.bound_by[dim]
                raise kiln.KilnValueError(f"{name}'s {dim} is {size}, but {first}'s {dim} is "
                                          f"{self.sizes[dim]}",
                                          fix=f"give {name} and {first} the same {dim}")
        if dtype is not None and got is not dtype:
            raise kiln.KilnTypeError(f"{name} must be {dtype}, got {got}",
                                     fix=f"convert {name} to {dtype}")
        return shape

    def __getitem__(self, dim: str) -> int:
        return self.sizes[dim]


def check_positive(name: str, value: Any, *, integer: bool = False, fix: str) -> None:
    """``value`` must be a positive (int, with ``integer``) number; bools are not numbers."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = " (an int)" if integer else ""
        raise kiln.KilnValueError(f"{name}={value!r} must be positive{what}", fix=fix)


def check_backend(backend: Any, allowed: tuple = BACKENDS) -> None:
    """``backend`` must be one of ``allowed`` (an entry point without a GPU-only kernel may
    allow fewer)."""
    if backend not in allowed:
        raise kiln.KilnValueError(f"backend={backend!r} is not one of "
                                  f"{', '.join(map(repr, allowed))}",
                                  fix="leave backend=None to run on the GPU")


def check_heads(hq: int, hkv: int, *, q_name: str, kv_name: str,
                error: type = kiln.KilnValueError) -> None:
    """At least one KV head, and ``Hq`` a multiple of ``Hkv`` (MHA, GQA, MQA); ``error`` is
    the class an entry point documented for this mistake."""
    if hkv < 1:
        raise kiln.KilnValueError(f"{kv_name} has Hkv={hkv} heads; attention needs at least one",
                                  fix=f"pass {kv_name} with its KV heads")
    if hq % hkv:
        raise error(f"{q_name}'s Hq={hq} heads are not a multiple of Hkv={hkv} ({kv_name}'s)",
                    fix="use Hq = group * Hkv (MHA, GQA or MQA)")


def resolve_target(target):
    """The chip ``target`` names; only None means Kiln's default target ("" is an error)."""
    return get_target(default_target() if target is None else target)


def refuse_inside_capture(what: str) -> None:
    """A ``validate=True`` check of device tensors synchronises, which a CUDA graph capture
    cannot contain: refuse it there rather than skip it silently."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise kiln.KilnValueError(
            f"{what} of device tensors are checked with a synchronisation, which a CUDA graph "
            "capture cannot contain",
            fix="check them with validate=True before capturing, not inside the graph")


def check_paged_lengths(page_table, seq_lens, *, num_pages: int, page_size: int,
                        validate: bool = False) -> None:
    """Every ``seq_lens[b]`` in ``[0, max_pages * page_size]`` and every page id a sequence
    uses (``page_table[b, :ceil(seq_lens[b] / page_size)]``) in ``[0, num_pages)``.

    numpy inputs are always checked, whatever ``validate`` says (the check costs little beside
    a copy to the device or the interpreter). torch tensors only with ``validate=True``: one
    device-side reduction and one synchronisation, then a CPU copy only to name the first bad
    entry. Unchecked (the default, which keeps a call free of synchronisation and capturable
    in a CUDA graph) a bad id poisons its rows with NaN in the kernel (decode's V tensor map
    fills out-of-bounds boxes with NaN).
    """
    if not is_torch(page_table) and not is_torch(seq_lens):
        _check_paged_numpy(np.asarray(page_table), np.asarray(seq_lens), num_pages, page_size)
        return
    if not validate:
        return
    import torch

    refuse_inside_capture("page ids and seq_lens")
    lens = seq_lens.to(torch.int64)
    width = page_table.shape[1]
    used = torch.arange(width, device=page_table.device)[None, :] < \
        ((lens + page_size - 1) // page_size)[:, None]
    bad = (used & ((page_table < 0) | (page_table >= num_pages))).any() | \
        ((lens < 0) | (lens > width * page_size)).any()
    if bool(bad):  # the one synchronisation
        _check_paged_numpy(page_table.cpu().numpy(), seq_lens.cpu().numpy(), num_pages,
                           page_size)


def _check_paged_numpy(page_table: np.ndarray, seq_lens: np.ndarray, num_pages: int,
                       page_size: int) -> None:
    width = page_table.shape[1]
    lens = seq_lens.astype(np.int64)
    for b in np.flatnonzero((lens < 0) | (lens > width * page_size))[:1]:
        raise kiln.KilnValueError(
            f"seq_lens[{b}] = {lens[b]} is outside [0, {width * page_size}] (page_table holds "
            f"{width} pages of {page_size} keys a sequence)",
            fix="pass each sequence's key count, at most page_table.shape[1] * page_size")
    used = np.arange(width)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bad.any():
        b, p = (int(i) for i in np.argwhere(bad)[0])
        raise kiln.KilnValueError(
            f"page_table[{b}, {p}] = {page_table[b, p]} is not a page of the cache (ids "
            f"0..{num_pages - 1}; sequence {b} of {lens[b]} keys uses its first "
            f"{-(-lens[b] // page_size)} entries)",
            fix="map every page a sequence uses to a cache page; entries past it are not read")


def check_counts(name: str, counts, *, slots: int) -> None:
    """Every entry of a numpy ``counts`` array in ``[0, slots]`` (device arrays: not read)."""
    if is_torch(counts):
        return
    counts = np.asarray(counts)
    bad = (counts < 0) | (counts > slots)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise kiln.KilnValueError(f"{name}{list(index)} = {counts[index]} is outside "
                                  f"[0, {slots}] (the partials hold {slots} split slots)",
                                  fix=f"count only the filled slots of each row, at most {slots}")


def spec(x) -> Any:
    """The part of a plan key that one argument contributes: for an array its type, shape,
    dtype, element strides and device (about 0.3 µs for a torch tensor); other values as
    they are (an unhashable one makes the key unhashable: the call is planned afresh)."""
    if x is None:  # an optional input left out
        return None
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _KINDS[type(x)] = _kind_of(x)
    if kind == "torch":
        return x.shape, x.dtype, x.stride(), x.get_device()
    if kind == "numpy":
        return np.ndarray, x.shape, x.dtype, x.strides
    if kind == "cupy":
        return type(x), x.shape, x.dtype, x.strides, x.device.id
    return x


_KINDS: dict[type, str] = {}  # the array library of each argument type seen, for spec


def _kind_of(x) -> str:
    if is_torch(x):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    return "cupy" if is_cupy(x) else "other"


def bindable(*tensors) -> bool:
    """Whether a plan for these arguments may use a bound launch: each (None entries are
    features not used) a contiguous torch tensor on one device of the runtime's device type.
    A plan decides this once: its key holds every tensor's strides and device."""
    present = [t for t in tensors if t is not None]
    if not present or not all(is_torch(t) for t in present):
        return False
    device = present[0].device
    return device.type == _ACTIVE[0].device_type and all(
        t.device == device and t.is_contiguous() for t in present)


# --- plans ----------------------------------------------------------------------------------

_CACHES: list["PlanCache"] = []


class PlanCache(dict):
    """One entry point's plans by key (see the module docs). ``builds`` counts the plans
    made, so a test can tell a repeat call (a hit) from a re-plan.

    :meth:`find` is the steady-state look-up: the guard of the last plan found
    (:mod:`kiln.kernels.plan_guard`), then the keyed one. ``last`` is that ``(guard, plan)``
    pair: an entry point's hot path calls the guard itself (no Python frame for ``find``)
    and calls :meth:`find` when it fails.

    Example::

        guard, plan = PLANS.last
        if not guard(values):                   # values: the arguments the key is made of
            plan = PLANS.find(values)
        if plan is None:
            plan = PLANS.add(key_of(values), make_plan(...), values)
    """

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.builds = 0
        self._guards: dict = {}  # key -> guard of the values that made it (None: unguardable)
        self.last: tuple = (_never, None)  # (guard, plan) of the last plan found or added
        _CACHES.append(self)

    def lookup(self, key):
        """The plan stored under ``key``, or None (also for an unhashable key)."""
        try:
            return self.get(key)
        except TypeError:  # an unhashable option (a list window): planned per call
            return None

    def find(self, values: tuple):
        """The plan of a call made of ``values`` (its key is ``key_of(values)``), or None:
        the last plan when its guard passes (a few torch attribute reads a tensor), else the
        keyed look-up, whose plan (when guardable) becomes the last one."""
        guard, plan = self.last
        if guard(values):
            return plan
        key = key_of(values)
        plan = self.lookup(key)
        if plan is not None:
            self._remember(key, values, plan)
        return plan

    def add(self, key, plan, values: tuple | None = None):
        """Store ``plan`` under ``key`` (unless the key is unhashable) and return it; with
        ``values`` (what ``key_of`` made ``key`` of), :meth:`find` also guards it."""
        self.builds += 1
        with contextlib.suppress(TypeError):
            self[key] = plan
            if values is not None:
                self._remember(key, values, plan)
        return plan

    def clear(self) -> None:
        from .one_call import clear_slots  # the entry points' one-call objects of plans

        super().clear()
        self._guards.clear()
        self.last = (_never, None)
        clear_slots()

    def _remember(self, key, values: tuple, plan) -> None:
        guard = self._guards.get(key, _never)
        if guard is _never:
            guard = self._guards[key] = guard_of(values)
        self.last = (guard, plan) if guard is not None else (_never, None)


def _never(values) -> bool:
    return False


def guard_of(values: tuple):
    """:func:`~kiln.kernels.plan_guard.make_guard` of ``values``, checked in one C call by the
    native launch shim where it was built (its torch tensors by the torch bridge's
    ``tensor_guard`` where that was built, else by :func:`torch_tensor_check`'s checker), else
    by generated Python."""
    shim = native_module()
    if shim is None:
        return make_guard(values)
    return make_guard(values, shim.guard_values, _tensor_check)


def _tensor_check(tensors: tuple):
    """The torch bridge's C check of tensors laid out as ``tensors``, else torch's own."""
    bridge = torch_bridge()
    check = None if bridge is None else bridge.tensor_guard(tensors)
    return check if check is not None else torch_tensor_check(tensors)


def key_of(values: tuple) -> tuple:
    """A plan key of a call's ``values``: each array by :func:`spec`, others as they are."""
    return tuple(map(spec, values))


def clear_plans() -> None:
    """Forget every entry point's plans (they hold bound launches of the runtime that made
    them)."""
    for cache in _CACHES:
        cache.clear()


# --- launches -------------------------------------------------------------------------------

class CudaRuntime:
    """Launches on the CUDA GPU through Kiln's launcher: the runtime of every entry point
    unless :func:`use_runtime` put another in (a test double with the same methods)."""

    device_type = "cuda"  # torch tensors on devices of this type may take a bound launch

    def bind(self, kernel, grid, args, **options):
        """``kernel`` compiled for ``args`` and bound to ``grid``: a callable taking one device
        address per tensor (see :func:`kiln.runtime.launch.bind_launch`)."""
        return bind_launch(kernel.compile(*args, **options), grid, args)

    def launch(self, kernel, grid, args, **options) -> None:
        """``kernel[grid](*args, **options)``: numpy arrays (copied) and strided tensors."""
        kernel[grid](*args, **options)

    def multiprocessor_count(self) -> int:
        return driver().multiprocessor_count()

    def capture_status_address(self) -> int:
        """Address of the driver's ``cuStreamIsCapturing`` (see
        :func:`kiln.kernels.runtime.capture_status_address`)."""
        return driver().stream_capture_address()

    def max_active_clusters(self, ck) -> int:
        """Clusters of the compiled kernel ``ck`` resident on the GPU at once."""
        sig = ck.signature
        return driver().max_active_clusters(ck.asm["cubin"], sig.name, sig.block, sig.cluster,
                                            sig.dynamic_shared_bytes)


class DryRuntime:
    """A runtime that compiles and launches nothing and records what it was asked: for
    tests, and for timing an entry point's host path up to the driver call on a machine
    without a GPU (``bench/launch_overhead.py --host-only``). Its ``device_type`` ("cpu")
    lets torch CPU tensors take the bound-launch path.

    Example::

        with use_runtime(DryRuntime()) as dry:
            combine(o_partial, lse_partial, counts)     # torch CPU tensors
        assert dry.bound_calls == 1 and len(dry.binds) == 1
    """

    device_type = "cpu"

    def __init__(self, sms: int = 132):
        self.sms = sms
        self.binds: list = []  # (kernel, grid, options) per bound launch made
        self.launches: list = []  # (kernel, grid, options) per general launch
        self.bound_calls = 0

    def bind(self, kernel, grid, args, **options):
        self.binds.append((kernel, grid, options))
        return _DryBound(self)

    def launch(self, kernel, grid, args, **options) -> None:
        self.launches.append((kernel, grid, options))

    def multiprocessor_count(self) -> int:
        return self.sms

    def max_active_clusters(self, ck) -> int:
        return self.sms // 2


class _DryBound:
    """A bound launch of :class:`DryRuntime`: counts its calls."""

    def __init__(self, owner: DryRuntime):
        self._owner = owner

    def __call__(self, *pointers: int, stream=None) -> None:
        self._owner.bound_calls += 1

    def launch_on(self, stream, *pointers: int) -> None:
        self._owner.bound_calls += 1

    def launch_outputs(self, outputs, stream, *items):
        return launch_with_outputs(self.launch_on, outputs, stream, items)

    def current_stream(self) -> None:
        return None


_ACTIVE: list = [CudaRuntime()]


@contextlib.contextmanager
def use_runtime(runtime) -> Iterator:
    """Run the library's launches on ``runtime`` (an object with :class:`CudaRuntime`'s
    methods and ``device_type``) inside the ``with`` block. Plans are dropped on entry and on
    exit: they hold bound launches of the runtime that made them.

    Example::

        with use_runtime(DryRuntime()) as dry:
            decode_attention(q, k_cache, v_cache, page_table, seq_lens)
        assert dry.launches or dry.bound_calls
    """
    previous = _ACTIVE[0]
    clear_plans()
    _ACTIVE[0] = runtime
    try:
        yield runtime
    finally:
        clear_plans()
        _ACTIVE[0] = previous


def bind(kernel, grid, args, **options):
    """The active runtime's bound launch of ``kernel`` (see :meth:`CudaRuntime.bind`)."""
    return _ACTIVE[0].bind(kernel, grid, args, **options)


def launch(kernel, grid, args, **options) -> None:
    """Launch ``kernel`` on the active runtime (see :meth:`CudaRuntime.launch`)."""
    _ACTIVE[0].launch(kernel, grid, args, **options)


def multiprocessor_count() -> int:
    """SMs of the GPU the active runtime launches on."""
    return _ACTIVE[0].multiprocessor_count()


def capture_id(stream: int | None):
    """The id of the CUDA-graph capture under way on ``stream``, or None (see
    :class:`kiln.kernels.workspaces.StreamWorkspaces`)."""
    return driver().capture_id(stream)


def capture_status_address() -> int | None:
    """The address of a C function ``int f(CUstream, int *status)`` telling whether a stream
    captures a CUDA graph (the driver's ``cuStreamIsCapturing``) for the active runtime's
    launches, or None (a runtime without one: its workspaces' Python check is asked)."""
    address = getattr(_ACTIVE[0], "capture_status_address", None)
    return None if address is None else address()


def persistent_grid(tiles: int, cluster: int = 1, resident_clusters=None) -> tuple[int, int, int]:
    """A persistent kernel's grid: one CTA per SM (with ``cluster > 1``, per resident cluster,
    ``resident_clusters()`` of them), at most one per tile. Example:
    ``persistent_grid(tiles=4096)`` is ``(132, 1, 1)`` on an H100."""
    resident = multiprocessor_count() if cluster == 1 else resident_clusters()
    return cluster * max(1, min(tiles, resident)), 1, 1


def max_active_clusters(ck) -> int:
    return _ACTIVE[0].max_active_clusters(ck)


def interpret(kernel, grid, args, **options) -> None:
    """Run ``kernel`` in Kiln's CPU interpreter on numpy ``args`` (written in place)."""
    kernel.interpret[grid](*args, **options)
