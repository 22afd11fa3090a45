"""``interpret_kernel``: run a traced kernel on numpy arrays, one CTA (or cluster) at a time.

The CTAs of a thread-block cluster run together. Each CTA gets fresh (poisoned) shared memory
and runs either as one execution context covering all its threads or, when the kernel blocks
inside divergent code (an mbarrier wait under an ``scf.if``) or issues warp-group MMAs with more
than one warp group, as one context per warp group, each on its own Python thread. Only one
context of a cluster runs at a time (they hand over at blocking points), so runs are
deterministic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from mlir import ir

from kiln.core import env as kiln_env
from kiln.cluster import RECIPES_ATTR as _RECIPES
from kiln.core.errors import CompilationError, KilnTypeError, KilnValueError, UnsupportedError
from kiln.launch_args import check_float_argument, check_int_argument, normalize_grid
from kiln.passes import build_pass_manager
from kiln.passes.cluster_schedule import NAME as CLUSTER_SCHEDULE
from kiln.passes.insert_waits import NAME as INSERT_WAITS
from kiln.tile_copy import AUTO_WAIT_ATTR

from . import (ops_amd, ops_ampere, ops_arith, ops_cluster, ops_control,  # noqa: F401 - register
               ops_gpu, ops_hopper, ops_mbarrier, ops_memory, ops_vector, ops_wgmma)
from .global_races import GlobalAccesses
from .phase_clock import PhaseClock
from .plan import Plan, np_dtype
from .state import CTA, Cluster, Context, ContextAborted, MemRef
from kiln.core.dtypes import dtype as kiln_dtype
from kiln.core.targets import get_target
from kiln.signature import ScalarParam, TensorMapParam

WARP_GROUP_THREADS = 128
_SHARED_ALIGN = 16


@dataclass(frozen=True)
class TensorMapArg:
    """A TMA descriptor argument: the global array it describes and its box."""

    array: np.ndarray
    box: tuple[int, ...]
    swizzle: int
    oob_fill_nan: bool


@dataclass
class _CompiledPlan:
    context: ir.Context  # keeps the parsed module's types alive for the plan's lifetime
    plan: Plan
    static_shared_bytes: int
    warp_group_contexts: bool


_plans: dict[str, _CompiledPlan] = {}
_contexts: list[ir.Context] = []  # the one the cached plans' modules are parsed in


def _context() -> ir.Context:
    """The Context modules are parsed in, shared by the cached plans (a Context costs as much
    as parsing a small kernel); a fresh one with each fresh cache, so its interned types and
    attributes do not pile up."""
    if not _contexts:
        ctx = ir.Context()
        ctx.allow_unregistered_dialects = True
        _contexts.append(ctx)
    return _contexts[0]


def _compile_plan(module_asm: str, kernel_name: str) -> _CompiledPlan:
    cached = _plans.get(module_asm)
    if cached is not None:
        return cached
    ctx = _context()
    with ctx:
        module = ir.Module.parse(module_asm)
        # The cluster-ending barriers, and the waits of kiln.copy's async copies, are part of
        # the program: run the passes that place them, as the compile does.
        passes = [CLUSTER_SCHEDULE] if _RECIPES in module_asm else []
        if AUTO_WAIT_ATTR in module_asm:
            passes.append(INSERT_WAITS)
        if passes:
            try:
                build_pass_manager(passes).run(module.operation)
            except ir.MLIRError as err:
                raise CompilationError(
                    f"{', '.join(passes)} failed on kernel {kernel_name}: {err}",
                    fix="the diagnostic names the construct the pass rejected; compiling the "
                        "kernel writes a reproducer") from None
        gpu_module = next(op.operation for op in module.body.operations
                          if op.operation.name == "gpu.module")
        shared: dict[str, tuple] = {}
        offset = 0
        func = None
        for op in gpu_module.regions[0].blocks[0].operations:
            op = op.operation
            if op.name == "memref.global":
                mtype = ir.MemRefType(ir.TypeAttr(op.attributes["type"]).value)
                align = ir.IntegerAttr(op.attributes["alignment"]).value \
                    if "alignment" in op.attributes else _SHARED_ALIGN
                offset = (offset + align - 1) // align * align
                dtype = np_dtype(mtype)
                shared[ir.StringAttr(op.attributes["sym_name"]).value] = (
                    offset, tuple(mtype.shape), dtype)
                offset += int(np.prod(mtype.shape)) * dtype.itemsize
            elif op.name == "gpu.func" and \
                    ir.StringAttr(op.attributes["sym_name"]).value == kernel_name:
                func = op
        plan = Plan(func, shared)
        warp_group = plan.blocks_in_divergent_code or plan.has_warp_group_ops
        plan.slots = {}  # drop the MLIR values; the closures only hold slot numbers
    compiled = _CompiledPlan(ctx, plan, offset, warp_group)
    if len(_plans) > 64:
        _plans.clear()
        _contexts.clear()
    _plans[module_asm] = compiled
    return compiled


def global_memref(array: np.ndarray, name: str) -> MemRef:
    """A memref over the memory of ``array`` (a view: stores write into the caller's array)."""
    if not isinstance(array, np.ndarray):
        raise KilnTypeError(f"the interpreter takes numpy arrays; argument '{name}' is a "
                            f"{type(array).__name__}", fix="pass a numpy array (e.g. t.cpu().numpy())")
    item = array.itemsize
    if any(s < 0 or s % item for s in array.strides):
        raise UnsupportedError(f"argument '{name}' has strides {array.strides}; the interpreter "
                               "takes non-negative strides that are multiples of the item size",
                               fix="pass np.ascontiguousarray(x)")
    strides = tuple(s // item for s in array.strides)
    span = 1 + sum((n - 1) * s for n, s in zip(array.shape, strides)) if array.size else 0
    # as_strided rebuilds the dtype from its array-interface string, which ml_dtypes'
    # float8_e5m2 has no spelling for: stride over same-sized unsigned ints and view back.
    carrier = array.view(np.dtype(f"u{item}"))
    storage = np.lib.stride_tricks.as_strided(carrier, shape=(span,), strides=(item,))
    storage = storage.view(array.dtype)
    return MemRef(storage, 0, tuple(array.shape), strides, f"tensor '{name}'")


def _convert_args(signature, args) -> tuple[list, dict]:
    """The interpreter's values of ``args``, and the writeable copies it made of read-only
    numpy arrays (by parameter name: ``(original, copy)``, see :func:`_check_read_only`)."""
    values, copies = [], {}
    for param, arg in zip(signature.params, args):
        if isinstance(param, ScalarParam):
            dtype = kiln_dtype(param.dtype)
            if dtype.kind in ("int", "bool", "index"):
                arg = check_int_argument(param.name, arg, dtype.name)
            else:
                arg = check_float_argument(param.name, arg, dtype.name)
            values.append(np.array([arg], dtype.numpy))
        elif isinstance(param, TensorMapParam):
            values.append(TensorMapArg(np.asarray(arg), tuple(param.box), param.swizzle,
                                       param.oob_fill_nan))
        else:
            if isinstance(arg, np.ndarray) and not arg.flags.writeable:
                copies[param.name] = (arg, arg.copy())
                arg = copies[param.name][1]
            values.append(global_memref(arg, param.name))
    return values, copies


def _check_read_only(copies: dict) -> None:
    """A read-only numpy argument runs on a copy; the kernel must not have written it."""
    for name, (original, copy) in copies.items():
        if np.ascontiguousarray(original).tobytes() != np.ascontiguousarray(copy).tobytes():
            raise KilnValueError(f"the kernel writes argument '{name}', a read-only numpy array; "
                                 "its results were dropped",
                                 fix=f"pass a writeable array, e.g. np.copy({name})")


def interpret_kernel(traced, grid, args, target) -> None:
    """Run ``traced`` (a :class:`kiln.kernel.TracedKernel`) over ``grid`` on the CPU.

    ``args`` are the run-time arguments in signature order (numpy arrays are written in place);
    ``target`` is a :class:`kiln.core.targets.Target` or its name.
    Example (what ``saxpy.interpret[grid](...)`` does)::

        traced = saxpy.trace(x, y, n, 2.0, BLOCK=256)
        interpret_kernel(traced, (n + 255) // 256, [x, y, n, 2.0], get_target("sm_90a"))
    """
    target = get_target(target)
    compiled = _compile_plan(traced.module_asm, traced.name)
    plan = compiled.plan
    signature = traced.signature
    block = tuple(signature.block)
    threads = int(np.prod(block))
    grid = normalize_grid(grid)
    values, copies = _convert_args(signature, signature.expand(list(args)))
    static = (compiled.static_shared_bytes + _SHARED_ALIGN - 1) // _SHARED_ALIGN * _SHARED_ALIGN
    shared_bytes = static + signature.dynamic_shared_bytes
    split = compiled.warp_group_contexts and threads > WARP_GROUP_THREADS
    group = WARP_GROUP_THREADS if split else threads
    timeout = kiln_env.interpret_timeout()
    shape = _cluster_shape(signature, grid)
    accesses = GlobalAccesses(grid, concurrent=int(np.prod(shape)) > 1)
    accesses.register(values)
    check_bounds = kiln_env.interpret_check_bounds()  # read once: ops consult it per access
    invariants: dict = {}  # launch-invariant values, by thread range (Plan.start)
    for cluster_origin in np.ndindex(*(g // c for g, c in zip(grid[::-1], shape[::-1]))):
        cz, cy, cx = cluster_origin
        cluster = Cluster(shape, timeout)
        for rank, (dz, dy, dx) in enumerate(np.ndindex(*shape[::-1])):
            block_id = (cx * shape[0] + dx, cy * shape[1] + dy, cz * shape[2] + dz)
            cta = CTA(block_id, block, grid, shared_bytes, cluster, rank)
            cta.warp_size, cta.check_bounds = target.warp_size, check_bounds
            cta.dynamic_shared_offset = static
            cta.globals, cta.linear_id = accesses, accesses.linear_block(block_id)
            cluster.ctas.append(cta)
        cluster.clock = PhaseClock(threads, len(cluster.ctas))
        _run_cluster(plan, cluster, values, threads, group, invariants)
    _check_read_only(copies)


def _cluster_shape(signature, grid: tuple) -> tuple[int, int, int]:
    shape = tuple(signature.cluster or (1, 1, 1))
    shape = shape + (1,) * (3 - len(shape))
    if any(g % c for g, c in zip(grid, shape)):
        raise KilnValueError(f"grid {grid} is not a multiple of the kernel's cluster shape "
                             f"{shape}", fix="round the grid up to whole clusters")
    return shape


def _run_cluster(plan: Plan, cluster: Cluster, values: list, threads: int, group: int,
                 invariants: dict) -> None:
    """Run every context of every CTA of ``cluster`` (CTAs of one cluster run together)."""
    contexts = []
    for cta in cluster.ctas:
        mine = [Context(cta, np.arange(start, start + group)) for start in range(0, threads, group)]
        cta.live = len(mine)
        contexts += mine
    cluster.live = len(contexts)

    def body(ctx: Context):
        env: list[Any] = [None] * plan.num_slots
        for slot, value in zip(plan.entry.args, values):
            env[slot] = value
        with cluster.cond, np.errstate(all="ignore"):
            try:
                plan.start(env, ctx, invariants)
                plan.entry.run(env, ctx)
            except ContextAborted:
                pass
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                if cluster.failed is None:
                    cluster.failed = err
            finally:
                ctx.cta.context_finished()

    if len(contexts) == 1:
        body(contexts[0])
    else:
        workers = [threading.Thread(target=body, args=(c,), daemon=True) for c in contexts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if cluster.failed is not None:
        raise cluster.failed
