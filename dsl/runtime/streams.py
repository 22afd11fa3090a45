"""Which CUDA stream a launch goes on: a ``stream=`` argument's raw handle, or (``stream=None``)
the current stream of the array library the arguments come from, as in Triton.

``stream_handle`` reads the raw ``CUstream`` of a torch/cupy stream or an int; the getters
read the current stream of torch (its raw C getter: no ``torch.cuda.Stream`` object per
launch), cupy, or none (the legacy default stream: numpy, JAX and other DLPack arrays). A
getter is worked out once per array type. docs/lowering.md ("Launching (NVIDIA)") has the
rules.

Example: ``stream_source([x, y, n])()`` is the handle ``launch`` would use for ``stream=None``;
inside ``with torch.cuda.stream(s):``, ``current_stream(x) == s.cuda_stream``.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence

import numpy as np

from kiln.arrays import is_torch_tensor
from kiln.core.errors import KilnTypeError


def stream_handle(stream) -> int | None:
    """The raw ``CUstream`` of a torch/cupy stream or an int handle; None (and 0) mean the
    legacy default stream. (``launch`` resolves ``stream=None`` with :func:`current_stream`
    first.)"""
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)):
        return int(stream) or None
    for attribute in ("cuda_stream", "ptr", "handle"):  # torch, cupy, cuda-python
        value = getattr(stream, attribute, None)
        if isinstance(value, (int, np.integer)):
            return int(value) or None
    raise KilnTypeError(f"cannot use a {type(stream).__name__} as a CUDA stream",
                        fix="pass a torch.cuda.Stream, a cupy stream, a raw int handle or None")


def current_stream(value) -> int | None:
    """The raw current stream of the array library that ``value`` comes from: torch's
    ``torch.cuda.current_stream()`` for a torch tensor, cupy's ``get_current_stream()`` for a
    cupy array; None (the legacy default stream) for anything else.

    Example: inside ``with torch.cuda.stream(s):``, ``current_stream(x) == s.cuda_stream``.
    """
    return _stream_getter(type(value))()


def no_stream() -> None:
    """The getter of arrays with no current stream to follow: the legacy default stream."""
    return None


_stream_getters: dict[type, Callable[[], int | None]] = {}


def _stream_getter(kind: type) -> Callable[[], int | None]:
    """How to read the current stream for arrays of type ``kind`` (worked out once per type)."""
    getter = _stream_getters.get(kind)
    if getter is None:
        getter = _stream_getters[kind] = _make_stream_getter(kind.__module__.split(".")[0])
    return getter


def _make_stream_getter(library: str) -> Callable[[], int | None]:
    module = sys.modules.get(library)  # loaded: one of its arrays exists
    if library == "torch" and module is not None:
        # A CPU-only build or no driver: no stream to follow (asking for one would raise).
        if not module.cuda.is_available():
            return no_stream
        # Triton's route: the raw handle without building a torch.cuda.Stream object (~0.2 µs
        # instead of ~2 µs); the public API where the private one is missing.
        raw, device = (getattr(module._C, "_cuda_getCurrentRawStream", None),
                       getattr(module._C, "_cuda_getDevice", None))
        if raw is not None and device is not None:
            return lambda: raw(device()) or None
        return lambda: module.cuda.current_stream().cuda_stream or None
    if library == "cupy" and module is not None:
        return lambda: module.cuda.get_current_stream().ptr or None
    return no_stream


def stream_source(args: Sequence) -> Callable[[], int | None]:
    """The current-stream getter of the first device array among ``args`` (numpy arrays and
    scalars have none)."""
    for value in args:
        kind = type(value)
        if kind is np.ndarray or kind in (int, float, bool):
            continue
        getter = _stream_getter(kind)
        if getter is not no_stream:
            return getter
    return no_stream


def bound_stream_source(args: Sequence) -> Callable[[], int | None]:
    """A bound launch's current-stream getter: for a torch CUDA tensor among ``args``, torch's
    raw-stream getter bound to that tensor's device (one C call a launch, no Python frame; it
    gives 0, not None, for the legacy default stream), else :func:`stream_source`'s."""
    for value in args:
        if is_torch_tensor(value) and getattr(value, "is_cuda", False) and \
                _stream_getter(type(value)) is not no_stream:
            torch_c = getattr(sys.modules.get("torch"), "_C", None)
            raw = getattr(torch_c, "_cuda_getCurrentRawStream", None)
            if raw is not None and hasattr(value, "get_device"):
                return functools.partial(raw, value.get_device())
            break
    return stream_source(args)
