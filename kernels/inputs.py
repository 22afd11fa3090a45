"""Argument checks shared by the kernel library's entry points (``prefill``, ``decode``,
``decode_attention``, ``combine``, ``matmul``).

Every check raises a :class:`kiln.KilnError` subclass that names the argument, what it
expected and what it got, at the caller's line (the library's frames count as Kiln's own,
see :func:`kiln.core.errors.caller_location`). Shapes are checked by *named dimensions*: the
first argument that has a dimension binds its size, later ones must agree::

    dims = Dims()
    dims.tensor("q", q, "B Sq Hq D", dtype=kiln.bf16)
    dims.tensor("k_cache", k_cache, "num_pages page_size Hkv D", dtype=kiln.bf16)
    # KilnValueError: k_cache's D is 64, but q's D is 128

Values (page ids, sequence lengths) are checked by :func:`check_paged_lengths`: always for
numpy inputs; for torch CUDA tensors with ``validate=True`` by a device-side reduction and
one synchronisation (see ``docs/kernels.md``, "Inputs and validation").
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

import kiln
from kiln.core.targets import get_target
from kiln.kernel import default_target

BACKENDS = (None, "gpu", "interpret")


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


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


def empty_like(like, shape: tuple, dtype: kiln.DType, fill: float | None = None):
    """A new array of ``like``'s kind (numpy, or torch on its device), filled if asked."""
    if is_torch(like):
        import torch

        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
                       "i32": torch.int32}[dtype.name]
        if fill is None:
            return torch.empty(shape, dtype=torch_dtype, device=like.device)
        return torch.full(shape, fill, dtype=torch_dtype, device=like.device)
    if fill is None:
        return np.empty(shape, dtype.numpy)
    return np.full(shape, fill, dtype.numpy)
