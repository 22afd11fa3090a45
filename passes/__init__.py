"""Kiln's own MLIR passes (Python-defined), registered by name for pipelines and ``kiln-opt``.

MLIR's textual pipeline parser only knows C++ passes, so a pipeline here is a flat list of
elements: each is either a registered Kiln pass name or upstream pipeline text
(``"canonicalize"``, ``"gpu.module(convert-gpu-to-nvvm)"``). :func:`build_pass_manager` adds
the Kiln ones as Python passes and the rest as text, in order.

Example::

    >>> from mlir import ir
    >>> with ir.Context():
    ...     pm = build_pass_manager(["kiln-fold-block-dim", "canonicalize", "cse"])
    >>> pipeline_text(["kiln-fold-block-dim", "cse"])
    'builtin.module(kiln-fold-block-dim,cse)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

from mlir import ir, passmanager

from kiln.core.errors import KilnValueError


@dataclass(frozen=True)
class KilnPass:
    """A Python pass: ``run(op, pass_)`` rewrites ``op`` (the ``builtin.module``) in place."""

    name: str
    run: Callable
    description: str


_REGISTRY: dict[str, KilnPass] = {}


def register_pass(name: str, fn: Callable, description: str) -> None:
    """Register ``fn(op: ir.Operation, pass_) -> None`` as Kiln pass ``name``.

    Example::

        register_pass("kiln-my-pass", my_pass, "what it rewrites and why")
    """
    if name in _REGISTRY and _REGISTRY[name].run is not fn:
        raise KilnValueError(f"a Kiln pass named {name!r} is already registered",
                             fix="pick a distinct name starting with 'kiln-'")
    _REGISTRY[name] = KilnPass(name, fn, description)


def kiln_passes() -> dict[str, KilnPass]:
    """The registered Kiln passes by name."""
    return dict(_REGISTRY)


def split_pipeline(text: str) -> list[str]:
    """Split ``builtin.module(a,b{x=1 y=2},gpu.module(c,d))`` into its top-level elements.

    A bare comma-separated list (no ``builtin.module(...)`` wrapper) is accepted too.
    """
    body = text.strip()
    if body.startswith("builtin.module(") and body.endswith(")"):
        body = body[len("builtin.module("):-1]
    elements, depth, start = [], 0, 0
    for i, char in enumerate(body):
        if char in "({":
            depth += 1
        elif char in ")}":
            depth -= 1
        elif char == "," and depth == 0:
            elements.append(body[start:i].strip())
            start = i + 1
    elements.append(body[start:].strip())
    return [e for e in elements if e]


def pipeline_text(elements: Sequence[str]) -> str:
    """The textual pipeline for ``elements`` (what ``kiln-opt --pass-pipeline`` takes)."""
    return "builtin.module(" + ",".join(elements) + ")"


def build_pass_manager(elements: Sequence[str], *,
                       timer: Callable[[str], ContextManager] | None = None,
                       verify_each: bool = True) -> passmanager.PassManager:
    """A ``builtin.module`` PassManager running ``elements`` in order (needs an active Context).

    Kiln passes must appear at the top level; inside ``gpu.module(...)`` they are rejected,
    since Python passes cannot be nested in textual pipelines. ``timer(name)``, when given,
    is entered around each Kiln pass's run (the compile profile). ``verify_each=False``
    verifies only after the Kiln passes but the last (upstream passes keep valid IR valid), so
    the caller verifies the result once instead of after every pass.
    """
    pm = passmanager.PassManager("builtin.module")
    pm.enable_verifier(verify_each)
    for i, element in enumerate(elements):
        kiln_pass = _REGISTRY.get(element)
        if kiln_pass is not None:
            # the last pass's result is the caller's to verify (one verify of a large module
            # costs a few ms)
            verify = not verify_each and i < len(elements) - 1
            run = kiln_pass.run if timer is None and not verify else \
                _wrapped(kiln_pass, timer, verify=verify)
            pm.add(run, name=kiln_pass.name, argument=kiln_pass.name,
                   description=kiln_pass.description)
            continue
        nested = [name for name in _REGISTRY if name in element]
        if nested:
            raise KilnValueError(f"Kiln pass {nested[0]!r} cannot be nested in {element!r}",
                                 fix=f"list {nested[0]} at the top level of builtin.module(...); "
                                     "it walks every gpu.func itself")
        try:
            pm.add(element)
        except ValueError as err:
            raise KilnValueError(f"bad pipeline element {element!r}: {err}",
                                 fix="check the pass name and options with mlir-opt --help") from None
    return pm


def _wrapped(kiln_pass: KilnPass, timer: Callable[[str], ContextManager] | None,
             verify: bool) -> Callable:
    def run(op, pass_):
        if timer is None:
            kiln_pass.run(op, pass_)
        else:
            with timer(kiln_pass.name):
                kiln_pass.run(op, pass_)
        if verify:  # a Kiln pass's invalid IR must not reach the next upstream pass
            try:
                op.operation.verify()
            except ir.MLIRError:
                pass_.signal_pass_failure()

    return run


from kiln.passes import fold_block_dim as _fold_block_dim  # noqa: E402  (registers itself)
from kiln.passes import amdgpu_native_math as _amdgpu_native_math  # noqa: E402
from kiln.passes import insert_waits as _insert_waits  # noqa: E402
from kiln.passes import cluster_schedule as _cluster_schedule  # noqa: E402
from kiln.passes import verify_waits as _verify_waits  # noqa: E402
from kiln.passes import extern_dynamic_shared as _extern_dynamic_shared  # noqa: E402
from kiln.passes import flush_denormals as _flush_denormals  # noqa: E402
from kiln.passes import tma_l2_hints as _tma_l2_hints  # noqa: E402
from kiln.passes import scalarize_structs as _scalarize_structs  # noqa: E402
