"""Where a compile spends its time: wall and CPU milliseconds per pipeline step.

A :class:`CompileProfile` is filled while a kernel is traced and lowered; the compiled
kernel carries it as ``metadata["compile_profile"]``, a list of ``(step, wall_ms, cpu_ms)``
in the order the steps ran. CPU time counts this process and its finished child processes
(``ptxas``, ``ld.lld``), so it stays meaningful on a loaded machine where wall time is not;
it is the whole process's, so during concurrent compiles (autotune) it includes other threads'.
``kiln compile FILE.py:KERNEL --report`` prints it as a table, after :func:`summarise`'s
split of the compile's wall time into the parts of the pipeline.

Example::

    profile = CompileProfile()
    with profile.step("trace"):
        traced = kernel.trace(...)
    profile.entries       # [("trace", 12.3, 11.9)]
"""

from __future__ import annotations

import gc
import resource
import time
from contextlib import contextmanager
from typing import Iterator


def cpu_seconds() -> float:
    """CPU seconds of this process plus its waited-for children (e.g. ptxas)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class CompileProfile:
    """An ordered list of ``(step, wall_ms, cpu_ms)``; steps may nest (``"gpu"`` holds
    ``"gpu.kiln-insert-waits"``, named with a dot), so only top-level steps add up."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, float, float]] = []

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the body as step ``name``, listed where it started (before its nested steps)."""
        slot = len(self.entries)
        self.entries.append((name, 0.0, 0.0))
        wall, cpu = self.clock()
        try:
            yield
        finally:
            self.entries[slot] = _entry(name, time.perf_counter() - wall, cpu_seconds() - cpu)

    @staticmethod
    def clock() -> tuple[float, float]:
        """(wall, cpu) seconds now, for :meth:`add_since`."""
        return time.perf_counter(), cpu_seconds()

    def add_since(self, name: str, started: tuple[float, float]) -> None:
        """Record step ``name`` as running from ``started`` (a :meth:`clock`) until now."""
        self.entries.append(_entry(name, time.perf_counter() - started[0],
                                   cpu_seconds() - started[1]))

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        """Record step ``name`` measured elsewhere (e.g. on another thread:
        ``profile.add("obj.emit", 0.25, 0.24)``)."""
        self.entries.append(_entry(name, wall_s, cpu_s))

    def total(self) -> tuple[float, float]:
        """(wall_ms, cpu_ms) of the top-level steps."""
        return total_of(self.entries)


def _entry(name: str, wall_s: float, cpu_s: float) -> tuple[str, float, float]:
    return name, round(wall_s * 1e3, 3), round(cpu_s * 1e3, 3)


def total_of(entries) -> tuple[float, float]:
    """(wall_ms, cpu_ms) summed over the top-level steps of a profile's entries."""
    top = [(wall, cpu) for name, wall, cpu in entries if "." not in name]
    return sum(w for w, _ in top), sum(c for _, c in top)


def format_profile(entries) -> list[str]:
    """The profile as aligned table lines; nested steps (``a.b``) are indented per level."""
    lines = [f"  {'step':<44} {'wall ms':>9} {'cpu ms':>9}"]
    for name, wall_ms, cpu_ms in entries:
        label = "  " * name.count(".") + name
        lines.append(f"  {label:<44} {wall_ms:>9.1f} {cpu_ms:>9.1f}")
    wall_ms, cpu_ms = total_of(entries)
    lines.append(f"  {'total':<44} {wall_ms:>9.1f} {cpu_ms:>9.1f}")
    return lines


# Steps that ran beside the critical path: the Python work done while ptxas runs (NVIDIA) or
# while LLVM emits AMD's assembly on a thread and its object in a second process.
BESIDE = ("cubin.ptxas.", "amdgcn.beside.", "amdgcn.check.")
_MLIR_STAGES = ("gpu", "nvvm", "rocdl", "llvm")
# part -> the top-level steps it sums (Kiln's own passes are taken out of the MLIR stages)
_PARTS = (("cache key", ("cache-lookup", "cache-store")), ("trace", ("trace", "parse")),
          ("Kiln passes", ()), ("MLIR", _MLIR_STAGES), ("LLVM", ("ptx", "amdgcn", "obj")),
          ("ptxas", ("cubin",)))


def summarise(entries) -> dict[str, float]:
    """Wall ms of a profile's entries by part: ``cache key``, ``trace``, ``Kiln passes`` (the
    Python passes of the MLIR stages), ``MLIR`` (the rest of those stages), ``LLVM`` (the
    optimisation and code generation: NVIDIA's ``ptx``, AMD's ``amdgcn`` and ``obj``),
    ``ptxas``, ``other`` (the rest); they add up to the total. ``beside`` is the Python work
    that overlapped LLVM or ptxas (inside their parts).

    Example: ``summarise(ck.metadata["compile_profile"])["ptxas"]``."""
    walls = {name: wall for name, wall, _ in entries}
    kiln = sum(wall for name, wall, _ in entries if name.count(".") == 2
               and name.split(".")[0] in _MLIR_STAGES and name.split(".")[2].startswith("kiln-")
               and name.split(".")[1] == "passes")
    parts = {part: sum(walls.get(step, 0.0) for step in steps) for part, steps in _PARTS}
    parts["Kiln passes"], parts["MLIR"] = kiln, parts["MLIR"] - kiln
    counted = {step for _, steps in _PARTS for step in steps}
    parts["other"] = sum(wall for name, wall, _ in entries if "." not in name
                         and name not in counted)
    parts["beside"] = sum(wall for name, wall, _ in entries if name.startswith(BESIDE)
                          and name.count(".") == 2)
    return {part: round(ms, 1) for part, ms in parts.items()}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector within (as it was, after): a compile pass that
    allocates tens of thousands of short-lived acyclic objects (a wait analysis's steps and
    sets) otherwise pays for collections that scan the whole heap and free nothing; reference
    counting still frees them. Example::

        with gc_paused():
            WaitAnalysis(func)
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
