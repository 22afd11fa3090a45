"""NVIDIA-only building blocks: elected threads, proxy fences, register reallocation.

Everything here is an upstream ``nvvm`` op except the inline-PTX wrappers:
:func:`named_barrier` (see its comment), :func:`wgmma_mma_async_regs` (WGMMA with A in
registers, which ``nvvm.wgmma.mma_async`` cannot express), :func:`l2_cache_policy` (NVVM
has no ``createpolicy``), :func:`wait_for_count` (no upstream op spins on global memory) and
:func:`sched_barrier` (no upstream op holds ptxas's instruction order).
The module also holds the operand coercion shared by :mod:`kiln.tma`, :mod:`kiln.mbarrier` and
:mod:`kiln.wgmma`: those wrappers accept Python ints, traced ``kiln.Value``/``Handle`` objects
(anything with ``.ir``) or raw ``ir.Value``.

Example (inside a ``@kiln.kernel`` for sm_90a)::

    leader = kiln.nvidia_asm.elect_sync()          # one lane per warp
    kiln.nvidia_asm.fence_mbarrier_init()          # make mbarrier.init visible to TMA
    kiln.nvidia_asm.setmaxnreg(240, increase=True) # consumer warp group takes more registers
"""

from __future__ import annotations

import contextlib
import numbers

from mlir import ir
from mlir.dialects import arith, nvvm

from .. import builder
from ..builder import GLOBAL_MEMORY_SPACE, SHARED_MEMORY_SPACE
from ..core import dtypes as dt
from ..core.dtypes import i32 as kiln_i32
from ..core.errors import KilnTypeError, KilnValueError
from ..core.ops import Effects, declare
from ..core.targets import get_target
from ..values import Value, cast, to_value


# ---------------------------------------------------------------------------------------------
# Operand coercion shared by the NVGPU wrappers
# ---------------------------------------------------------------------------------------------

def ir_value(obj, what: str) -> ir.Value:
    """The ``ir.Value`` behind a traced object (``.ir``) or a raw value; KilnTypeError otherwise."""
    value = getattr(obj, "ir", obj)
    if not isinstance(value, ir.Value):
        raise KilnTypeError(f"{what} must be a traced kernel value, got {type(obj).__name__}",
                            fix=f"pass the {what} object created inside the kernel")
    return value


def as_index(obj, what: str) -> ir.Value:
    """An ``index`` value from a Python/numpy int or a traced integer (cast when needed)."""
    if isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
        return arith.constant(ir.IndexType.get(), int(obj))
    value = getattr(obj, "ir", obj)
    if isinstance(value, ir.Value) and isinstance(value.type, ir.IndexType):
        return value
    if isinstance(value, ir.Value) and isinstance(value.type, ir.IntegerType) \
            and value.type.width > 1:
        return arith.index_cast(ir.IndexType.get(), value)
    described = f"a value of type {value.type}" if isinstance(value, ir.Value) else repr(obj)
    raise KilnTypeError(f"{what} must be an int or a traced integer, got {described}",
                        fix=f"pass {what} as a Python int or an integer kernel value")


def as_predicate(obj) -> ir.Value | None:
    """None, or an ``i1`` from a Python bool or a traced boolean (e.g. ``tid == 0``)."""
    if obj is None:
        return None
    i1 = ir.IntegerType.get_signless(1)
    if isinstance(obj, bool):
        return arith.constant(i1, int(obj))
    value = ir_value(obj, "predicate")
    if value.type != i1:
        raise KilnTypeError(f"predicate must be a boolean, got a value of type {value.type}",
                            fix="compare first, e.g. predicate=(tid == 0)")
    return value


_target_stack: list = []


@contextlib.contextmanager
def compiling_for(target):
    """Build NVGPU IR for ``target`` outside ``@kiln.kernel`` (hand-built ``gpu.func``s, tests).

    Inside a traced kernel the wrappers ask ``kiln.current_target()`` instead::

        with ir.Context(), ir.Location.unknown(), kiln.nvidia_asm.compiling_for("sm_90a"):
            ...  # build a gpu.func and call kiln.tma / kiln.wgmma wrappers in it
    """
    _target_stack.append(get_target(target))
    try:
        yield _target_stack[-1]
    finally:
        _target_stack.pop()


def current_target():
    """The target the wrappers validate against: :func:`compiling_for`'s, else the kernel's."""
    if _target_stack:
        return _target_stack[-1]
    return builder.current_target()


def require_feature(feature: str, what: str):
    """The current :class:`~kiln.core.targets.Target` if it has ``feature`` (a name from
    ``kiln.core.targets.FEATURES``: ``"wgmma"``, ``"tma"``, ``"sm90"``, ``"ptx"``, ...),
    else TargetError naming ``what`` and the chips that have it."""
    return current_target().require(feature, what)


# ---------------------------------------------------------------------------------------------
# Declarations (kiln.core.ops): identity, chips, effects, interpreter semantics
# ---------------------------------------------------------------------------------------------

def _barrier_semantics(method: str):
    """Interpreter semantics of ``bar.sync`` / ``bar.arrive``: the CTA's named barrier ``method``."""
    def build(op, plan):
        barrier_id, count = plan.operands(op)
        loc = plan.location(op)

        def run(env, ctx):
            getattr(ctx.cta, method)(ctx, int(env[barrier_id][0]), int(env[count][0]), loc)

        return run
    return build


BARRIER = declare("nvidia.sync.barrier", feature="ptx", effects=Effects(barrier=True),
                  mlir_names=("nvvm.barrier", "nvvm.barrier0"))
NAMED_BARRIER = declare("nvidia.sync.named_barrier", feature="ptx",
                        interpret=_barrier_semantics("named_barrier"))
NAMED_BARRIER_ARRIVE = declare("nvidia.sync.named_barrier_arrive", feature="ptx",
                               interpret=_barrier_semantics("named_barrier_arrive"))
NAMED_BARRIER_ANY = declare("nvidia.sync.named_barrier_any", feature="ptx")
# Orders SASS only; its scratch word is never read, so the interpreter has nothing to run.
SCHED_BARRIER = declare("nvidia.sync.sched_barrier", feature="ptx",
                        interpret=lambda op, plan: None)
L2_CACHE_POLICY = declare("nvidia.sync.l2_cache_policy", feature="ptx")
WAIT_FOR_COUNT = declare("nvidia.sync.wait_for_count", feature="ptx")
ELECT_SYNC = declare("nvidia.sync.elect_sync", feature="sm90", mlir_names=("nvvm.elect.sync",))
FENCE_PROXY_ASYNC = declare("nvidia.sync.fence_proxy_async", feature="sm90",
                            mlir_names=("nvvm.fence.proxy",))
FENCE_MBARRIER_INIT = declare("nvidia.sync.fence_mbarrier_init", feature="sm90",
                              mlir_names=("nvvm.fence.mbarrier.init",))
SETMAXNREG = declare("nvidia.sync.setmaxnreg", feature="wgmma",
                     mlir_names=("nvvm.setmaxregister",))
CLUSTER_CTARANK = declare("nvidia.cluster.ctarank", feature="sm90",
                          mlir_names=("nvvm.read.ptx.sreg.cluster.ctarank",))
CLUSTER_SYNC = declare("nvidia.cluster.sync", feature="sm90",
                       mlir_names=("nvvm.cluster.arrive", "nvvm.cluster.wait"))
GRIDDEPCONTROL = declare("nvidia.sync.griddepcontrol", feature="sm90",
                         mlir_names=("nvvm.griddepcontrol",))


# ---------------------------------------------------------------------------------------------
# Instructions
# ---------------------------------------------------------------------------------------------

def elect_sync():
    """``elect.sync``: True in exactly one lane of each warp (sm_90+).

    Cheaper than ``lane_id == 0`` and lets ptxas see a uniform leader. Returns a ``kiln.Value``
    of dtype i1 when the front end is loaded, usable as ``predicate=`` or in ``if``.
    """
    ELECT_SYNC.require(current_target(), "elect_sync")
    return Value(nvvm.elect_sync(ir.IntegerType.get_signless(1)))


def fence_proxy_async() -> None:
    """``fence.proxy.async.shared::cta``: order generic-proxy shared-memory writes before
    async-proxy reads (a TMA store or WGMMA reading what threads just wrote)."""
    FENCE_PROXY_ASYNC.require(current_target(), "fence_proxy_async")
    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def fence_mbarrier_init() -> None:
    """``fence.mbarrier_init.release.cluster``: publish ``mbarrier.init`` to the async proxy
    (and to other CTAs of a cluster) before TMA transactions complete on the barrier."""
    FENCE_MBARRIER_INIT.require(current_target(), "fence_mbarrier_init")
    nvvm.fence_mbarrier_init()


def setmaxnreg(count: int, *, increase: bool) -> None:
    """``setmaxnreg.{inc,dec}.sync.aligned.u32 count``: reassign registers between warp groups.

    ``count`` must be a multiple of 8 in 24..256; every thread of the warp group executes it.
    """
    SETMAXNREG.require(current_target(), "setmaxnreg")
    if not isinstance(count, int) or count % 8 or not 24 <= count <= 256:
        raise KilnValueError(f"setmaxnreg count must be a multiple of 8 in 24..256, got {count!r}",
                             fix="round the register count to a multiple of 8, e.g. 232 or 40")
    action = nvvm.SetMaxRegisterAction.increase if increase else nvvm.SetMaxRegisterAction.decrease
    nvvm.setmaxregister(count, action)


def named_barrier(barrier_id, num_threads: int) -> None:
    """``bar.sync barrier_id, num_threads``: wait for ``num_threads`` threads (a multiple of 32)
    at hardware barrier ``barrier_id`` (1..15; 0 is ``kiln.barrier()``'s), e.g. one warp group
    synchronising without stopping the others: ``named_barrier(1 + group, 128)``.

    ``bar.sync`` is PTX's aligned barrier: keep lane-divergent branches (``if tid % 128 == 0:``)
    off both sides of it. LLVM may copy the barrier into both arms of such a branch, and a warp
    whose lanes reach two copies hangs (``bench/RESULTS.md``, session 20)."""
    NAMED_BARRIER.require(current_target(), "named_barrier")
    # Inline PTX: nvvm.barrier's printed form does not parse back with its location attached
    # (MLIR 22), and Kiln round-trips every stage through text.
    NAMED_BARRIER.inline_asm(None, _named_barrier_operands(barrier_id, num_threads),
                             "bar.sync $0, $1;", "r,r")


def named_barrier_arrive(barrier_id, num_threads: int) -> None:
    """``bar.arrive barrier_id, num_threads``: count this warp group toward ``num_threads``
    without waiting. Pairs with :func:`named_barrier` in another warp group to hand over a
    turn (ping-pong scheduling): ``named_barrier_arrive(other_turn, 256)``."""
    NAMED_BARRIER_ARRIVE.require(current_target(), "named_barrier_arrive")
    NAMED_BARRIER_ARRIVE.inline_asm(None, _named_barrier_operands(barrier_id, num_threads),
                                    "bar.arrive $0, $1;", "r,r")


# ``named_barrier_any``: bar.red.or.pred on the flag's truth, the result back as 0/1.
NAMED_BARRIER_ANY_ASM = ("{\n.reg .pred p, q;\nsetp.ne.b32 q, $1, 0;\n"
                         "bar.red.or.pred p, $2, $3, q;\nselp.u32 $0, 1, 0, p;\n}")


def named_barrier_any(barrier_id, num_threads: int, flag):
    """``bar.red.or.pred``: :func:`named_barrier`, and whether ``flag`` (an i1 or integer;
    nonzero is true) is true in any of the ``num_threads`` threads. Every participating thread
    gets the same answer, so a branch on it is uniform over, say, a whole warp group -- as
    warp-group-wide instructions (``wgmma``) under it need; :func:`kiln.shuffle.any_lane` is
    one warp's. Example::

        if kiln.nvidia_asm.named_barrier_any(7 + group, 128, x > limit):
            ...   # every warp of the group takes this branch, or none does
    """
    NAMED_BARRIER_ANY.require(current_target(), "named_barrier_any")
    flag = to_value(flag)
    if flag.shape or flag.dtype.name not in ("i1", "i8", "i16", "i32"):
        raise KilnTypeError(f"named_barrier_any votes on a scalar bool or integer, got {flag!r}",
                            fix="compare first, e.g. x > limit")
    operands = [cast(flag, kiln_i32).ir, *_named_barrier_operands(barrier_id, num_threads)]
    vote = NAMED_BARRIER_ANY.inline_asm(ir.IntegerType.get_signless(32), operands,
                                        NAMED_BARRIER_ANY_ASM, "=r,r,r,r")
    return Value(vote, kiln_i32) != 0


# ``sched_barrier``: read %clock and store it to the caller's scratch word. ptxas keeps the
# instructions around a clock read on their side of it; the store keeps the read alive.
SCHED_BARRIER_ASM = "{\n.reg .u32 t;\nmov.u32 t, %clock;\nst.shared.u32 [$0], t;\n}"


def sched_barrier(scratch, *index) -> None:
    """A point ptxas's scheduler does not move instructions across (NVIDIA only): a ``%clock``
    read whose value is stored to ``scratch[index]``, a shared i32 word of the calling thread
    that nothing reads. PTX order is not SASS order: ptxas hoists a ``wgmma.wait_group`` above
    independent work, and a wait hoisted above a softmax stops that softmax from overlapping
    the tensor cores. Give every thread its own word (a shared word two threads store to is a
    race to ``compute-sanitizer``). Costs a clock read and a store. Example::

        scratch = kiln.shared((384,), kiln.i32)       # one word per thread
        probs = softmax(scores)                        # overlaps the WGMMA in flight
        kiln.nvidia_asm.sched_barrier(scratch, tid)    # ... in SASS too
        kiln.wgmma.wait_group(0)
    """
    _check_nvidia_buffer(scratch, dt.i32, SHARED_MEMORY_SPACE, "sched_barrier",
                         "stores to a shared tensor of i32 words",
                         "pass kiln.shared((threads,), kiln.i32)")
    SCHED_BARRIER.inline_asm(ir.Type.parse("!llvm.void"), [scratch.element_address(*index)],
                             SCHED_BARRIER_ASM, "l")


# L2 eviction priorities a cache policy can give (PTX createpolicy.fractional.L2::<name>).
EVICTION_POLICIES = ("evict_first", "evict_last", "evict_normal")


def l2_cache_policy(priority: str) -> ir.Value:
    """``createpolicy.fractional.L2::<priority>.b64``: the 64-bit L2 cache policy that
    gives every line an access touches ``priority`` (one of :data:`EVICTION_POLICIES`); the
    ``l2CacheHint`` operand of a TMA copy (see :func:`kiln.tma.load`)."""
    if priority not in EVICTION_POLICIES:
        raise KilnValueError(f"L2 eviction priority {priority!r} is not evict_first, evict_last "
                             "or evict_normal", fix="use one of those three")
    return L2_CACHE_POLICY.inline_asm(ir.IntegerType.get_signless(64), [],
                                      f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;",
                                      "=l", has_side_effects=False)


# ``wait_for_count``: poll with an acquire load until the signed difference ``counter - target``
# is >= 0 (so a target past a wrapped counter still compares right). The labels live in their
# own ``{ }`` scope, so the asm may be inlined any number of times.
WAIT_FOR_COUNT_ASM = ("{\n.reg .pred p;\n.reg .b64 v;\nKILN_WAIT_FOR_COUNT:\n"
                      "ld.acquire.gpu.global.b64 v, [$0];\nsub.s64 v, v, $1;\n"
                      "setp.lt.s64 p, v, 0;\n@p bra KILN_WAIT_FOR_COUNT;\n}")


def wait_for_count(counters, *index, target) -> None:
    """Spin in the calling thread until the i64 counter ``counters[index]`` reaches ``target``
    (``ld.acquire.gpu`` in a loop; NVIDIA only, no upstream op spins on global memory).

    What other CTAs stored before they released their increments (``kiln.fence("gpu")`` then
    ``atomic_add``) is then visible to this thread, and after a ``kiln.barrier()`` to its CTA.
    Waiting on CTAs of the same grid is only safe when they are sure to run: ones already
    running, or at most a few launched later (the hardware starts CTAs in block order, so a
    handful of waiters cannot hold every SM). Example (the last of ``n`` CTAs' tickets)::

        if kiln.thread_id(0) == 0:
            kiln.fence("gpu")
            ticket = counters.atomic_add(0, 1)
            kiln.nvidia_asm.wait_for_count(counters, 0, target=ticket - ticket % n + n)
        kiln.barrier()
    The interpreter runs CTAs one at a time, so a wait passes there only where the CTAs before
    this one already brought the counter to ``target``; otherwise it raises UnsupportedError.
    """
    _check_nvidia_buffer(counters, dt.i64, GLOBAL_MEMORY_SPACE, "wait_for_count",
                         "polls a global tensor of i64 counters",
                         "keep the counters in a kiln.Tensor[kiln.i64, ...]")
    goal = to_value(target)
    if goal.dtype.kind != "int":
        raise KilnTypeError(f"wait_for_count's target must be an integer, got {goal.dtype}",
                            fix="compute the target from the ticket (an integer)")
    WAIT_FOR_COUNT.inline_asm(ir.Type.parse("!llvm.void"),
                              [counters.element_address(*index), cast(goal, dt.i64).ir],
                              WAIT_FOR_COUNT_ASM, "l,l,~{memory}")


def _check_nvidia_buffer(buffer, dtype, memory_space: int, what: str, needs: str,
                         fix: str) -> None:
    """TargetError off NVIDIA; KilnTypeError unless ``buffer`` is a ``dtype`` tensor in
    ``memory_space`` (the operand checks of the inline-PTX wrappers that take a buffer)."""
    require_feature("ptx", what)
    memref_type = getattr(getattr(buffer, "ir", None), "type", None)
    space = memref_type.memory_space if isinstance(memref_type, ir.MemRefType) else None
    if getattr(buffer, "dtype", None) is not dtype or not isinstance(space, ir.IntegerAttr) \
            or space.value != memory_space:
        raise KilnTypeError(f"{what} {needs}, got {getattr(buffer, 'ir', buffer)}", fix=fix)


def _named_barrier_operands(barrier_id, num_threads: int) -> list:
    if isinstance(barrier_id, int) and not 0 <= barrier_id < 16:
        raise KilnValueError(f"named barrier id {barrier_id} must be in 0..15",
                             fix="use ids 1..15 (0 is the block-wide barrier)")
    if not isinstance(num_threads, int) or num_threads <= 0 or num_threads % 32:
        raise KilnValueError(f"named barrier thread count {num_threads!r} must be a positive "
                             "multiple of 32", fix="count whole warps, e.g. 128 for a warp group")
    i32 = ir.IntegerType.get_signless(32)
    identifier = arith.constant(i32, barrier_id) if isinstance(barrier_id, int) else \
        arith.index_cast(i32, as_index(barrier_id, "barrier id"))
    return [identifier, arith.constant(i32, num_threads)]


# ---------------------------------------------------------------------------------------------
# Thread-block clusters (sm_90+)
# ---------------------------------------------------------------------------------------------

MAX_PORTABLE_CLUSTER = 8  # CTAs per cluster every sm_90 part supports


def cluster_dims(x: int, y: int = 1, z: int = 1) -> None:
    """Declare that the kernel runs in clusters of ``x * y * z`` CTAs (at most 8).

    Sets ``known_cluster_size`` on the ``gpu.func`` (PTX ``.reqnctapercluster``) and the
    signature's ``cluster`` so every launch is a cluster launch; the grid must be a multiple of
    the cluster shape. Call it once, at the top of the kernel::

        kiln.nvidia_asm.cluster_dims(2)           # pairs of CTAs along x
        rank = kiln.nvidia_asm.cluster_ctarank()  # 0 or 1
    """
    CLUSTER_SYNC.require(current_target(), "cluster_dims")
    shape = (x, y, z)
    if not all(isinstance(d, int) and d >= 1 for d in shape) \
            or x * y * z > MAX_PORTABLE_CLUSTER:
        raise KilnValueError(f"cluster shape {shape} must be positive ints with at most "
                             f"{MAX_PORTABLE_CLUSTER} CTAs in all",
                             fix="use e.g. cluster_dims(2) for pairs of CTAs")
    state = builder.current()
    if state.cluster is not None and state.cluster != shape:
        raise KilnValueError(f"cluster shape declared twice: {state.cluster} and {shape}",
                             fix="call kiln.nvidia_asm.cluster_dims once per kernel")
    state.cluster = shape
    kernel = state.entry_block.owner  # the gpu.func
    kernel.attributes["known_cluster_size"] = ir.DenseI32ArrayAttr.get(list(shape))


def cluster_ctarank():
    """This CTA's rank in its cluster (``%cluster_ctarank``, 0 .. CTAs per cluster - 1), an i32."""
    CLUSTER_CTARANK.require(current_target(), "cluster_ctarank")
    return Value(nvvm.read_ptx_sreg_cluster_ctarank(ir.IntegerType.get_signless(32)))


def cluster_sync() -> None:
    """``barrier.cluster.arrive`` + ``barrier.cluster.wait``: every thread of every CTA of the
    cluster must reach it. Use it after initialising mbarriers that peer CTAs will signal, and
    before exiting while peers may still write this CTA's shared memory. After
    ``kiln.cluster_rank``, which keeps an arrive pending, it completes that one first and
    leaves a new one pending."""
    CLUSTER_SYNC.require(current_target(), "cluster_sync")
    standing = builder.current().cluster_arrive_standing
    if standing:
        nvvm.cluster_wait()
    nvvm.cluster_arrive()
    nvvm.cluster_wait()
    if standing:
        nvvm.cluster_arrive()


# ---------------------------------------------------------------------------------------------
# Programmatic dependent launch (sm_90+)
# ---------------------------------------------------------------------------------------------

def grid_dependency_wait() -> None:
    """``griddepcontrol.wait``: block until the grids this launch depends on (the work queued
    before it on its stream) have completed and their memory is visible.

    Calling it opts the kernel into programmatic dependent launch: the launcher lets its CTAs
    start while the previous kernel on the stream is still running (after that kernel calls
    :func:`launch_dependents`, or as it finishes), so only the work before this call overlaps.
    Call it once, at the top level of the kernel, before the first read of global memory
    another kernel may write and before any global write; shared-memory set-up may come first::

        full.init(0, count=1, predicate=tid == 0)     # no global memory touched yet
        kiln.nvidia_asm.grid_dependency_wait()
        n = lengths[kiln.block_id(0)]
    """
    GRIDDEPCONTROL.require(current_target(), "grid_dependency_wait")
    state = builder.current()
    if ir.InsertionPoint.current.block != state.entry_block:
        raise KilnValueError("grid_dependency_wait() must run on every path: call it at the "
                             "kernel's top level, not inside an if or a loop",
                             fix="move kiln.nvidia_asm.grid_dependency_wait() to the kernel "
                                 "body, before its first global memory access")
    state.programmatic_launch = True
    nvvm.griddepcontrol(nvvm.GridDepActionKind.wait)


def launch_dependents() -> None:
    """``griddepcontrol.launch_dependents``: once every CTA of this grid has run it (or exited),
    the next kernel on the stream, if it waits with :func:`grid_dependency_wait`, may start
    launching. It orders no memory: that kernel's wait still lasts until this grid completes.
    Call it where the grid's remaining work no longer needs whole SMs, e.g. after the main
    loop. Example: ``kiln.nvidia_asm.launch_dependents()``."""
    GRIDDEPCONTROL.require(current_target(), "launch_dependents")
    nvvm.griddepcontrol(nvvm.GridDepActionKind.launch_dependents)


# kiln.nvidia_asm's former names for the WGMMA inline-PTX helpers, now in kiln.nvidia.wgmma.
from .wgmma import (KEEP_REGISTERS_LIVE_ASM, keep_registers_live,  # noqa: E402,F401
                    wgmma_mma_async_regs, wgmma_rs_asm)
