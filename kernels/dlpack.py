"""Device arrays of other libraries (cupy, JAX, any DLPack exporter) in the library entry points.

The entry points plan, bind and launch torch tensors. A CUDA array of another library is
viewed as a torch tensor through DLPack (``torch.from_dlpack``: zero-copy; the exporter is
handed torch's current stream, so the entry point's launches are ordered after the work that
produced the array), the entry point runs on the views, and its array results are viewed back
in the caller's library (``cupy.from_dlpack``, ``jax.numpy.from_dlpack``; an exporter of
another library gets the torch tensors). Without torch installed nothing is converted: the
entry points read such arrays as they always did.

Example (inside an entry point, after its torch fast path)::

    if dlpack.foreign(q):
        return dlpack.through_torch(prefill, q, k, v, causal=causal)
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import numpy as np

from .runtime import is_torch

# DLDeviceType values of CUDA memory torch views: kDLCUDA, kDLCUDAManaged.
DEVICE_TYPES = frozenset({2, 13})
_FOREIGN_TYPES: dict[type, bool] = {}  # per argument type: an exporter that is not torch/numpy
_IMPORTERS = {"cupy": ("cupy", "from_dlpack"), "jax": ("jax.numpy", "from_dlpack"),
              "jaxlib": ("jax.numpy", "from_dlpack")}


def foreign(x: Any) -> bool:
    """Whether ``x`` is a CUDA array of a library other than torch and numpy (exporting
    ``__dlpack__`` and ``__dlpack_device__``) while torch is installed."""
    kind = _FOREIGN_TYPES.get(type(x))
    if kind is None:
        kind = _FOREIGN_TYPES[type(x)] = (
            not isinstance(x, np.ndarray) and not is_torch(x) and hasattr(x, "__dlpack__")
            and hasattr(x, "__dlpack_device__")
            and importlib.util.find_spec("torch") is not None)
    return kind and int(x.__dlpack_device__()[0]) in DEVICE_TYPES


def through_torch(entry: Callable, *args, **kwargs):
    """``entry(*args, **kwargs)`` with every :func:`foreign` argument viewed as a torch
    tensor, and its results (an array or a tuple of them) viewed back in the library of the
    first foreign argument."""
    import torch  # only for foreign arrays: torch is optional

    first = next(x for x in (*args, *kwargs.values()) if foreign(x))

    def inward(x):
        return torch.from_dlpack(x) if foreign(x) else x

    out = entry(*(inward(x) for x in args), **{k: inward(v) for k, v in kwargs.items()})
    back = _importer(first)
    return tuple(back(o) for o in out) if isinstance(out, tuple) else back(out)


def _importer(x) -> Callable:
    """The ``from_dlpack`` of ``x``'s library, or the identity (torch tensors returned)."""
    found = _IMPORTERS.get(type(x).__module__.split(".")[0])
    if found is None:
        return lambda tensor: tensor
    module, name = found
    return getattr(importlib.import_module(module), name)
