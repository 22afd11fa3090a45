"""The trace state: the MLIR context, module and insertion point active while a kernel is traced.

Wrappers anywhere in Kiln (NVGPU, TMA, WGMMA helpers) build ops directly with the upstream
builders; they only need the context, insertion point and location that :func:`current` keeps
entered while a kernel body runs::

    from mlir.dialects import nvvm
    def elect_one():
        state = kiln.builder.current()          # raises outside a kernel trace
        return kiln.Value(nvvm.elect_sync(...))  # builds at the kernel's insertion point

``kiln.current_target()`` returns the :class:`~kiln.core.targets.Target` being traced for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlir import ir

from .core.errors import KilnValueError, SourceLoc, trace_location

KERNEL_MODULE_NAME = "kiln_kernels"
# Values (about one MLIR op each) one kernel trace may build. Unrolled Python loops and
# helpers that build many ops per step would otherwise trace for minutes; the shipped kernels
# build at most about 15000.
MAX_TRACED_VALUES = 1 << 18
SHARED_MEMORY_SPACE = 3
GLOBAL_MEMORY_SPACE = 1


# The dialects a trace and Kiln's own passes build ops of (upstream passes load the dialects
# they build themselves); a context loading every registered dialect took ~18 ms to make.
TRACE_DIALECTS = ("builtin", "func", "gpu", "arith", "math", "memref", "scf", "vector", "llvm",
                  "nvvm", "nvgpu", "rocdl", "amdgpu", "index", "cf", "affine", "ub")


def trace_context() -> ir.Context:
    """A new MLIR context with :data:`TRACE_DIALECTS` loaded, for one kernel's trace and
    compile (``with trace_context(): ...``). Loaded through their descriptors: asking
    ``ctx.dialects[name]`` imports the dialect's Python module too (an NVIDIA compile importing
    the ROCDL one cost a small kernel's trace 40 ms on the H200 host)."""
    ctx = ir.Context(load_on_create_dialects=())
    for name in TRACE_DIALECTS:
        ctx.get_dialect_descriptor(name)
    return ctx


@dataclass
class TraceState:
    """Everything one kernel trace owns. Created and entered by :mod:`kiln.kernel`."""

    context: ir.Context
    module: ir.Module
    gpu_module_block: ir.Block  # body of ``gpu.module @kiln_kernels`` (shared globals go here)
    target: object  # kiln.core.targets.Target
    block: tuple[int, int, int]
    shared_bytes: int = 0
    shared_names: set[str] = field(default_factory=set)
    entry_block: ir.Block | None = None  # the kernel's entry block (kernel-wide values go here)
    dynamic_shared_bytes: int = 0  # requested at launch (kiln.dynamic_shared)
    dynamic_shared_base: object = None  # (memref<?xi8>, aligned byte offset) once created
    cluster: tuple[int, int, int] | None = None  # CTA cluster shape (kiln.nvidia_asm.cluster_dims)
    cluster_arrive_standing: bool = False  # kiln.cluster_rank keeps a cluster arrive pending
    programmatic_launch: bool = False  # waits on prior grids (kiln.nvidia_asm.grid_dependency_wait)
    unrolled_iterations: int = 0  # Python loop iterations so far (trace_runtime's budget)
    values_built: int = 0  # kiln.Values so far (MAX_TRACED_VALUES)
    thread_ids: list = field(default_factory=list)  # gpu.thread_id x results (threads.py)
    param_names: tuple = ()  # the run-time parameters' names, by entry block argument
    derived_maps: dict = field(default_factory=dict)  # kiln.tile_tma: key -> (param, descriptor)
    tma_setup: object = None  # kiln.tile_tma: the op new mbarrier inits go before
    tma_fetching: list | None = None  # kiln.pipeline(handoff=True): the tiles a fetch loads
    tma_pairs: int = 0  # kiln.tile_tma: full/empty mbarrier pairs made so far
    finishers: list = field(default_factory=list)  # run once the body is traced (kiln.release)
    # values.constant: (dtype, shape, attribute) -> its one arith.constant, in the entry block
    constants: dict = field(default_factory=dict)
    struct_fields: dict = field(default_factory=dict)  # reg_tile: struct type -> its fields

    def unique_symbol(self, base: str) -> str:
        name, n = base, 0
        while name in self.shared_names:
            n += 1
            name = f"{base}_{n}"
        self.shared_names.add(name)
        return name


_stack: list[TraceState] = []


def push(state: TraceState) -> None:
    _stack.append(state)


def pop() -> None:
    _stack.pop()


def current() -> TraceState:
    """The active trace; calling a device-only Kiln function outside a kernel is an error."""
    if not _stack:
        raise KilnValueError("this Kiln operation can only be used inside a @kiln.kernel body",
                             fix="call it from a @kiln.kernel or @kiln.func function")
    return _stack[-1]


def is_tracing() -> bool:
    return bool(_stack)


def current_or_none() -> TraceState | None:
    """The active trace, or None outside one."""
    return _stack[-1] if _stack else None


def entry_point(state: TraceState) -> ir.InsertionPoint:
    """Where kernel-wide values go: at the top of the kernel's entry block, after the constants
    :func:`kiln.values.constant` keeps there (they must dominate every op, these ones too)."""
    hoisted = {value.owner for value in state.constants.values()}
    for op in state.entry_block.operations:
        if op.operation not in hoisted:
            return ir.InsertionPoint(op)
    return ir.InsertionPoint(state.entry_block)


def count_value() -> None:
    """Count one traced Value against :data:`MAX_TRACED_VALUES` (KilnValueError past it)."""
    if not _stack:
        return
    state = _stack[-1]
    state.values_built += 1
    if state.values_built > MAX_TRACED_VALUES:
        raise KilnValueError(
            f"the kernel's trace built more than {MAX_TRACED_VALUES} values "
            "(kiln.builder.MAX_TRACED_VALUES) by this line: a Python loop or helper unrolls too "
            "much", fix="use `for i in kiln.range(...)` for a loop that runs on the GPU, or "
                        "unroll less")


def current_target():
    """The target chip of the kernel being traced (a ``kiln.core.targets.Target``).

    Example: ``if kiln.current_target().is_nvidia: ...`` selects a code path at trace time.
    """
    return current().target


class at_source(trace_location):
    """Enter a user source position: new ops get its ``loc("file":line:col)`` and Kiln errors
    raised inside point at it (:class:`~kiln.core.errors.trace_location`). Used by the
    AST-rewritten kernel around every statement.

    Example: ``with at_source("k.py", 12, 4): ...`` builds ops at ``loc("k.py":12:5)``."""

    __slots__ = ("_mlir_loc",)

    def __init__(self, filename: str, line: int, col: int, end_col: int | None = None):
        super().__init__(SourceLoc(filename, line, col, end_col))
        self._mlir_loc = None

    @classmethod
    def of(cls, loc: SourceLoc) -> "at_source":
        """Enter ``loc``, a SourceLoc made once (the rewritten code's table of positions)."""
        entered = cls.__new__(cls)
        entered.loc = loc
        entered._mlir_loc = None
        return entered

    def __enter__(self):
        loc = self.loc
        self._mlir_loc = ir.Location.file(loc.filename, loc.line, loc.col + 1)
        self._mlir_loc.__enter__()
        trace_location.__enter__(self)
        return self

    def __exit__(self, *exc):
        trace_location.__exit__(self, *exc)
        self._mlir_loc.__exit__(*exc)
        return False
