"""Cluster annotations: ``with kiln.cluster(k, recipe):`` names one phase of a software pipeline.

A *cluster* is a contiguous run of ops in one block (a loop body, prologue or epilogue) that the
scheduling passes treat as a unit: nothing moves across its boundaries, it may end in a barrier,
and its *recipe* declares which work classes it holds and how LLVM should interleave them.
Recipes are data, meant to be read next to a kernel's schedule table::

    C1 = ClusterRecipe(work=(("dma", 2), ("ds_read", 4), ("valu", 8)),
                       interleave=(("ds_read", 1), ("valu", 2)), priority=1)
    print(C1)   # dma=2 ds_read=4 valu=8; interleave ds_read=1 valu=2; barrier; setprio=1

    @kiln.kernel
    def k(...):
        for j in kiln.range(n):
            with kiln.cluster(0, QK_RECIPE):
                ...                      # QK MFMAs
            with kiln.cluster(1, C1):
                ...                      # DMA K[j], LDS->register V[j-1]

How it builds IR: ``__exit__`` tags every op created inside the ``with`` (nested regions
included) with the discardable attribute ``kiln.cluster = k : i64``; the enclosing ``gpu.func``
gets ``kiln.cluster_recipes = {c<k> = "<recipe summary>"}`` and ``kiln.target``. The passes
``kiln-cluster-schedule``, ``kiln-insert-waits`` and ``kiln-verify-schedule`` (docs/passes.md)
read them; the annotations themselves change no semantics (the interpreter ignores them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlir import ir

from . import builder
from .core.errors import InternalError, KilnValueError

# Work classes a recipe may name, with the LLVM AMDGPU sched_group_barrier mask of each
# (llvm/lib/Target/AMDGPU/AMDGPUIGroupLP.cpp SchedGroupMask).
SCHED_GROUP_MASKS = {
    "alu": 0x1,        # any non-memory instruction
    "valu": 0x2,
    "salu": 0x4,
    "mfma": 0x8,       # MFMA / WMMA
    "vmem": 0x10,      # every VMEM instruction
    "vmem_read": 0x20,
    "dma": 0x20,       # global/buffer -> LDS DMA issues as a VMEM read
    "vmem_write": 0x40,
    "ds": 0x80,
    "ds_read": 0x100,
    "ds_write": 0x200,
    "trans": 0x400,
}
# NVIDIA work classes: only counted/declared; LLVM's NVPTX backend has no sched-group intrinsics.
NVIDIA_WORK = ("wgmma", "tma", "cp_async")
WORK_CLASSES = tuple(SCHED_GROUP_MASKS) + NVIDIA_WORK

RECIPES_ATTR = "kiln.cluster_recipes"
CLUSTER_ATTR = "kiln.cluster"
TARGET_ATTR = "kiln.target"
MANUAL_WAITS_ATTR = "kiln.manual_waits"
CONSUMER_DRAIN_ATTR = "kiln.consumer_drain"


def _check_work(name: str, pairs: tuple) -> tuple[tuple[str, int], ...]:
    checked = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise KilnValueError(f"ClusterRecipe.{name} entry {pair!r} is not a (class, count) pair",
                                 fix='write e.g. (("mfma", 4), ("ds_read", 2))')
        work, count = pair
        if work not in WORK_CLASSES:
            raise KilnValueError(f"unknown work class {work!r} in ClusterRecipe.{name}",
                                 fix=f"use one of {', '.join(WORK_CLASSES)}")
        if not isinstance(count, int) or count < 1:
            raise KilnValueError(f"ClusterRecipe.{name} count for {work!r} must be a positive int, "
                                 f"got {count!r}", fix="drop the entry or give a count >= 1")
        checked.append((work, count))
    return tuple(checked)


def _format_work(pairs) -> str:
    return " ".join(f"{work}={count}" for work, count in pairs)


def _parse_work(text: str) -> tuple[tuple[str, int], ...]:
    return tuple((w, int(c)) for w, c in (item.split("=") for item in text.split()))


@dataclass(frozen=True)
class ClusterRecipe:
    """What one cluster holds and how it is scheduled.

    - ``work``: ``(class, count)`` pairs in issue order, e.g. ``(("mfma", 4), ("ds_read", 2))``;
      counts are per cluster instance, checked against the final assembly by
      ``kiln-verify-schedule``. Classes: ``alu valu salu mfma vmem vmem_read dma vmem_write ds
      ds_read ds_write trans`` (AMD) and ``wgmma tma cp_async`` (NVIDIA, declared only).
    - ``interleave``: a pattern of ``(class, n)`` groups repeated until ``work`` is used up;
      lowered to ``rocdl.sched.group.barrier`` so LLVM issues e.g. 1 MFMA, 2 DS reads, 1 MFMA...
    - ``barrier_at_end``: end the cluster with ``s_barrier`` (AMD) / ``bar.sync`` (NVIDIA).
    - ``priority``: ``s_setprio`` at the start of the cluster (reset to 0 at its end).
    - ``iglp``: an ``llvm.amdgcn.iglp.opt`` variant for the cluster instead of an interleave.
    - ``drain_lgkm``: open the cluster with ``s_waitcnt lgkmcnt(0)`` (consumer-side drain).
    - ``pingpong``: NVIDIA, two named-barrier ids ``(a, b)``: two consumer warp groups take
      turns issuing this cluster. The group with even ``tid.x // 128`` waits on ``a`` before
      the cluster and arrives on ``b`` after it; the odd one waits on ``b``, arrives on ``a``;
      the odd group arrives on ``a`` once before the loop so the even one goes first.

    Example::

        >>> r = ClusterRecipe(work=(("mfma", 4), ("ds_read", 2)),
        ...                   interleave=(("mfma", 2), ("ds_read", 1)), priority=1)
        >>> str(r)
        'mfma=4 ds_read=2; interleave mfma=2 ds_read=1; barrier; setprio=1'
        >>> ClusterRecipe.parse(str(r)) == r
        True
    """

    work: tuple = ()
    interleave: tuple | None = None
    barrier_at_end: bool = True
    priority: int | None = None
    iglp: int | None = None
    drain_lgkm: bool = False
    pingpong: tuple | None = None
    counts: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "work", _check_work("work", tuple(self.work)))
        totals: dict[str, int] = {}
        for work, count in self.work:
            totals[work] = totals.get(work, 0) + count
        object.__setattr__(self, "counts", totals)
        if self.interleave is not None:
            pattern = _check_work("interleave", tuple(self.interleave))
            object.__setattr__(self, "interleave", pattern)
            missing = [w for w, _ in pattern if w not in totals]
            if missing or not pattern:
                raise KilnValueError(f"interleave names {missing or 'nothing'} not declared in work",
                                     fix="interleave only the classes listed in work")
        if self.interleave is not None and self.iglp is not None:
            raise KilnValueError("a recipe takes interleave or iglp, not both",
                                 fix="keep the explicit interleave, or let iglp.opt pick one")
        if self.priority is not None and not 0 <= self.priority <= 3:
            raise KilnValueError(f"priority {self.priority} is outside s_setprio's 0..3",
                                 fix="use 0 (lowest) to 3 (highest)")
        if self.pingpong is not None:
            ids = tuple(self.pingpong)
            if (len(ids) != 2 or ids[0] == ids[1]
                    or not all(isinstance(i, int) and 1 <= i <= 15 for i in ids)):
                raise KilnValueError(f"pingpong takes two distinct named-barrier ids in 1..15, "
                                     f"got {self.pingpong!r}", fix="write e.g. pingpong=(3, 4)")
            object.__setattr__(self, "pingpong", ids)
        if self.iglp is not None and self.iglp not in (0, 1, 2):
            raise KilnValueError(f"iglp variant {self.iglp} is unknown", fix="use 0, 1 or 2")

    def sched_groups(self) -> list[tuple[str, int]]:
        """The ``(class, size)`` sched groups the interleave expands to, in order."""
        if self.interleave is None:
            return []
        left, groups = dict(self.counts), []
        while any(left[w] > 0 for w, _ in self.interleave):
            for work, size in self.interleave:
                take = min(size, left[work])
                if take:
                    groups.append((work, take))
                    left[work] -= take
        return groups

    def __str__(self) -> str:
        parts = [_format_work(self.work) or "empty"]
        if self.interleave is not None:
            parts.append("interleave " + _format_work(self.interleave))
        if self.iglp is not None:
            parts.append(f"iglp={self.iglp}")
        if self.barrier_at_end:
            parts.append("barrier")
        if self.priority is not None:
            parts.append(f"setprio={self.priority}")
        if self.drain_lgkm:
            parts.append("drain")
        if self.pingpong is not None:
            parts.append(f"pingpong={self.pingpong[0]},{self.pingpong[1]}")
        return "; ".join(parts)

    @classmethod
    def parse(cls, text: str) -> ClusterRecipe:
        """The recipe whose ``str()`` is ``text`` (how passes read it back from the IR)."""
        head, *rest = [part.strip() for part in text.split(";")]
        kwargs: dict = {"work": () if head == "empty" else _parse_work(head),
                        "barrier_at_end": False}
        for part in rest:
            if part.startswith("interleave "):
                kwargs["interleave"] = _parse_work(part[len("interleave "):])
            elif part.startswith("iglp="):
                kwargs["iglp"] = int(part[5:])
            elif part.startswith("setprio="):
                kwargs["priority"] = int(part[8:])
            elif part == "barrier":
                kwargs["barrier_at_end"] = True
            elif part == "drain":
                kwargs["drain_lgkm"] = True
            elif part.startswith("pingpong="):
                kwargs["pingpong"] = tuple(int(i) for i in part[9:].split(","))
            else:
                raise KilnValueError(f"bad cluster recipe text {text!r} (at {part!r})",
                                     fix="write it as str(ClusterRecipe(...)) prints it")
        return cls(**kwargs)


DEFAULT_RECIPE = ClusterRecipe()
_active: list[int] = []
_INDEXED = 256  # clusters of at most this many ops are found by index (cluster._built)


def _insertion_block_and_anchor() -> tuple[ir.Block, ir.Operation | None]:
    ip = ir.InsertionPoint.current
    return ip.block, ip.ref_operation


def enclosing_gpu_func(block: ir.Block) -> ir.Operation:
    op = block.owner.operation if block.owner is not None else None
    while op is not None and op.name != "gpu.func":  # .operation: OpView.name may be an attribute
        op = op.parent.operation if op.parent is not None else None
    if op is None:
        raise KilnValueError("kiln.cluster must be used inside a kernel body",
                             fix="put the with-block inside a @kiln.kernel function")
    return op


def _index(block: ir.Block, anchor: ir.Operation | None) -> int:
    """The index of ``anchor`` in ``block`` (its length when None), by bisection: a dozen
    indexings instead of iterating an unrolled kernel's thousands of ops in Python."""
    ops = block.operations
    low, high = 0, len(ops)
    if anchor is None:
        return high
    while low < high:
        middle = (low + high) // 2
        if ops[middle].operation.is_before_in_block(anchor):
            low = middle + 1
        else:
            high = middle
    return low


def _mark_function(func: ir.Operation, cluster_id: int, recipe: ClusterRecipe) -> None:
    recipes = {}
    if RECIPES_ATTR in func.attributes:
        recipes = {n.name: n.attr for n in ir.DictAttr(func.attributes[RECIPES_ATTR])}
    key = f"c{cluster_id}"
    text = str(recipe)
    if key in recipes and ir.StringAttr(recipes[key]).value != text:
        raise KilnValueError(f"cluster {cluster_id} is declared twice with different recipes",
                             fix="give each distinct recipe its own cluster number")
    recipes[key] = ir.StringAttr.get(text)
    func.attributes[RECIPES_ATTR] = ir.DictAttr.get(recipes)
    func.attributes[TARGET_ATTR] = ir.StringAttr.get(builder.current_target().name)


class cluster:
    """``with kiln.cluster(k, recipe=None):`` marks the ops built inside as cluster ``k``.

    ``k`` is a non-negative int, unique per recipe within the kernel (the same ``k`` may be
    entered again, e.g. in the prologue and the loop body, with the same recipe). Clusters
    do not nest. See the module docstring for the attributes it writes.
    """

    def __init__(self, k: int, recipe: ClusterRecipe | None = None):
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise KilnValueError(f"cluster number must be a non-negative int, got {k!r}",
                                 fix="number clusters 0, 1, 2, ... as in the schedule table")
        if recipe is not None and not isinstance(recipe, ClusterRecipe):
            raise KilnValueError(f"recipe must be a kiln.ClusterRecipe, got {type(recipe).__name__}",
                                 fix="build one with kiln.ClusterRecipe(work=(...))")
        self.k = k
        self.recipe = recipe or DEFAULT_RECIPE
        self._block = None
        self._last = None  # the op before the insertion point at entry (None: none)
        self._start = 0  # the index after it at entry

    def __enter__(self):
        builder.current()
        if _active:
            raise KilnValueError(f"kiln.cluster({self.k}) is nested in kiln.cluster({_active[-1]})",
                                 fix="close the outer cluster first; clusters do not nest")
        self._block, anchor = _insertion_block_and_anchor()
        self._start = _index(self._block, anchor)
        self._last = self._block.operations[self._start - 1].operation if self._start else None
        _mark_function(enclosing_gpu_func(self._block), self.k, self.recipe)
        _active.append(self.k)
        return self

    def _built(self, block: ir.Block, anchor: ir.Operation | None) -> list[ir.Operation]:
        """The ops after the one that preceded the insertion point at entry, up to the
        insertion point now (ops put in above that one are not ours). Indexing the block walks
        its list in C++ (a few ns an op) and iterating it makes a Python object an op (about a
        microsecond): a short cluster is indexed, a long one found in one iteration."""
        ops = block.operations
        start, end = self._start, _index(block, anchor)
        if end - start <= _INDEXED and (not start or ops[start - 1].operation == self._last):
            return [ops[i].operation for i in range(start, end)]
        built, found = [], self._last is None
        for view in ops:
            op = view.operation
            if not found:
                found = op == self._last
            elif anchor is not None and op == anchor:
                break
            else:
                built.append(op)
        if not found:
            raise InternalError(f"the op before kiln.cluster({self.k}) was erased inside it",
                                fix="report this Kiln bug with the kernel")
        return built

    def __exit__(self, *exc):
        _active.pop()
        if exc[0] is not None:
            return False
        block, anchor = _insertion_block_and_anchor()
        if block != self._block:
            raise InternalError(f"kiln.cluster({self.k}) ends in another block than it began",
                                fix="report this Kiln bug with the kernel")
        tag = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), self.k)
        for op in self._built(block, anchor):
            if len(op.regions):  # nested ops too; a walk costs a Python call an op
                op.walk(lambda inner: _tag(inner, tag), ir.WalkOrder.PRE_ORDER)
            else:
                op.attributes[CLUSTER_ATTR] = tag
        return False


def _tag(op: ir.Operation, tag: ir.Attribute):
    op.attributes[CLUSTER_ATTR] = tag
    return ir.WalkResult.ADVANCE


def _mark_current_function(attr: str) -> None:
    builder.current()
    block, _ = _insertion_block_and_anchor()
    enclosing_gpu_func(block).attributes[attr] = ir.UnitAttr.get()
    enclosing_gpu_func(block).attributes[TARGET_ATTR] = ir.StringAttr.get(
        builder.current_target().name)


def manual_waits() -> None:
    """Turn off automatic wait insertion for this kernel: the kernel places its own
    ``s_waitcnt``; ``kiln-verify-waits`` still proves them sufficient (or raises WaitError).

    Example: call ``kiln.manual_waits()`` as the first statement of the kernel body.
    """
    _mark_current_function(MANUAL_WAITS_ATTR)


def consumer_drain() -> None:
    """Consumer-side drain mode: every cluster holding MFMA/WGMMA work opens with
    ``s_waitcnt lgkmcnt(0)``, so LLVM's waitcnt insertion sees a bracket reset per cluster
    instead of a staircase of partial LDS waits.

    Example: call ``kiln.consumer_drain()`` once in the kernel body.
    """
    _mark_current_function(CONSUMER_DRAIN_ATTR)
