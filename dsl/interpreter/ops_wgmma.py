"""Raw ``nvvm.wgmma.*`` (what ``kiln.wgmma.mma_async`` emits) and LLVM struct accumulators.

``nvvm.wgmma.mma_async`` (f16/bf16 ``m64nNk16``, e4m3/e5m2 ``m64nNk32``; products and sums
in float64, rounded to the f32 accumulator) reads A and B through 64-bit shared-memory matrix
descriptors, decoded as PTX defines them (start address, leading/stride byte offsets, swizzle
mode), so a descriptor that points at the wrong bytes gives wrong numbers here too. The
accumulator is an ``!llvm.struct`` of ``n/2`` f32 registers per thread: the interpreter gathers
the 128 threads' registers into the 64 x n tile through
``kiln.layout.wgmma_m64_accumulator(n)``, multiplies, and scatters back. The MMA keeps its operand bytes "being read" until ``wgmma.wait.group``
retires its group, so a TMA load into a stage an MMA still reads is a race.

WGMMA with A from registers is inline PTX (``kiln.nvidia.wgmma.wgmma_mma_async_regs``), declared
as ``nvidia.wgmma.mma_async.rs``: :func:`_mma_async_rs` reads shape, dtype and ``imm-trans-b``
from the op's ``kiln.op_args``, gathers
A from the four b32 registers of each thread (element ``2i`` in the low half of register ``i``;
FP8: byte ``j`` of register ``i`` is element ``4i + j``)
through ``kiln.wgmma.a_fragment_layout()`` (``a_fragment_layout_8bit()`` for e4m3/e5m2, k32), B through its descriptor, and applies
``D = A @ B + (scale_d != 0) * D`` like the descriptor form.
"""

from __future__ import annotations

import functools
import re

import numpy as np
from mlir import ir
from mlir.dialects import llvm

from kiln.core.ops import op_args
from kiln.core.errors import KilnValueError, OutOfBoundsError, UnsupportedError
from kiln.layout import wgmma_m64_accumulator
from kiln.nvidia.wgmma import MMA_ASYNC_RS
from kiln.swizzle import Swizzle

from .ops_hopper import commit_group, retire_groups
from .plan import attr_int, location, np_dtype, semantics
from .state import uniform
from kiln.core.dtypes import dtype as kiln_dtype
from kiln.wgmma import a_fragment_layout, a_fragment_layout_8bit

WARP_GROUP = 128
INSTRUCTION_K = 16
_SWIZZLE_BYTES = {1: 128, 2: 64, 3: 32}  # descriptor bits 62-63
# (operand type, K) of the descriptor form: k16 for 2-byte types, k32 for FP8.
_SHAPES = {("f16", 16), ("bf16", 16), ("e4m3", 32), ("e5m2", 32)}
_FP8_PTX = {"e4m3": "f8e4m3", "e5m2": "f8e5m2"}  # register-A op's dtype arg -> kiln dtype


# ---- LLVM struct values: arrays of shape (threads, fields) ----------------------------------

@semantics("llvm.mlir.undef", "llvm.mlir.poison")
def _undef(op, p):
    out = p.result(op)
    body = llvm.StructType(op.results[0].type).body
    dtypes = {np_dtype(t) for t in body}
    if len(dtypes) != 1:
        raise UnsupportedError("the interpreter handles LLVM structs of one element type only",
                               loc=location(op))
    value = np.full((1, len(body)), np.nan, dtypes.pop())  # undefined: NaN poison

    def run(env, ctx):
        env[out] = value

    return run


@semantics("llvm.insertvalue")
def _insertvalue(op, p):
    container, value = p.operands(op)
    out = p.result(op)
    (pos,) = list(ir.DenseI64ArrayAttr(op.attributes["position"]))

    def run(env, ctx):
        c, v = env[container], env[value]
        lead = max(c.shape[0], v.shape[0])
        result = np.array(np.broadcast_to(c, (lead,) + c.shape[1:]))
        result[:, pos] = v
        env[out] = result

    return run


@semantics("llvm.extractvalue")
def _extractvalue(op, p):
    (container,) = p.operands(op)
    out = p.result(op)
    (pos,) = list(ir.DenseI64ArrayAttr(op.attributes["position"]))

    def run(env, ctx):
        env[out] = env[container][:, pos]

    return run


# ---- shared-memory matrix descriptors ------------------------------------------------------

def decode_descriptor(desc: int) -> tuple[int, int, int, int]:
    """``(start byte, leading byte offset, stride byte offset, swizzle bytes)`` of a wgmma
    shared-memory matrix descriptor (PTX "Matrix Descriptor Format")."""
    desc &= (1 << 64) - 1
    start = (desc & 0x3FFF) << 4
    leading = ((desc >> 16) & 0x3FFF) << 4
    stride = ((desc >> 32) & 0x3FFF) << 4
    swizzle = _SWIZZLE_BYTES.get((desc >> 62) & 0x3, 0)
    return start, leading, stride, swizzle


def operand_addresses(desc: int, mn: int, k: int, item: int, k_major: bool, loc) -> np.ndarray:
    """Byte addresses ``[mn, k]`` of an ``mn x k`` operand read through ``desc``.

    K-major: rows of the swizzle width along K, 8-row groups ``stride`` apart along M/N.
    MN-major: swizzle-wide chunks along M/N ``leading`` apart, 8-row groups of K ``stride``
    apart. The swizzle XORs the absolute address, as the hardware does.
    """
    start, leading, stride, swizzle = decode_descriptor(desc)
    if not swizzle:
        raise UnsupportedError("the interpreter reads swizzled (32/64/128-byte) wgmma operands "
                               "only", fix="use a swizzled descriptor (kiln.wgmma.smem_descriptor)",
                               loc=loc)
    m = np.arange(mn)[:, None]
    kk = np.arange(k)[None, :]
    if k_major:
        addr = start + (m // 8) * stride + (m % 8) * swizzle + kk * item
    else:
        per_row = swizzle // item
        addr = start + (m // per_row) * leading + (kk // 8) * stride + (kk % 8) * swizzle \
            + (m % per_row) * item
    return Swizzle.tma(swizzle, 1)(addr)


@functools.lru_cache(maxsize=256)
def _operand_bytes(desc: int, mn: int, k: int, item: int, k_major: bool):
    """``(byte addresses, their max, their min)`` of an operand read through ``desc`` (the
    same few descriptors recur every loop trip and CTA: computed once each), or None for an
    unswizzled descriptor."""
    if not decode_descriptor(desc)[3]:
        return None
    addrs = operand_addresses(desc, mn, k, item, k_major, None)
    byte_addrs = (addrs[..., None] + np.arange(item)).reshape(-1)
    byte_addrs.flags.writeable = False  # shared by every read through this descriptor
    return byte_addrs, int(byte_addrs.max()), int(byte_addrs.min())


def _read_operand(ctx, desc: int, mn: int, k: int, dtype, k_major: bool, loc):
    item = np.dtype(dtype).itemsize
    cached = _operand_bytes(desc, mn, k, item, k_major)
    if cached is None:
        operand_addresses(desc, mn, k, item, k_major, loc)  # raises, naming the user's line
    byte_addrs, high, low = cached
    shared = ctx.cta.shared
    if high >= shared.arena.size or low < 0:
        raise OutOfBoundsError(f"a wgmma operand descriptor reads shared bytes up to "
                               f"{high}, past the {shared.arena.size} bytes of "
                               "shared memory", loc=loc)
    shared.check(byte_addrs, False, "this wgmma", loc)
    if shared.tma_loads:  # the warp group's MMA reads the tile for all of its threads
        active = ctx.thread_ids if ctx.mask is None else ctx.thread_ids[ctx.mask]
        shared.check_observed(byte_addrs[None, :], active, ctx.cta.cluster.clock,
                              ctx.cta.rank, "reads (wgmma operand)", loc)
    values = shared.arena[byte_addrs].view(dtype).reshape(mn, k)
    return values, byte_addrs


def _attr_text(op, name: str) -> str:
    return str(op.attributes[name])


def _lanes_of(value: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    return value if value.shape[0] == 1 else value[lanes]


def _warp_groups(ctx, loc):
    """``(threads of the context, their index in the warp group)`` for each warp group that
    issues (all of its active threads). ``wgmma`` is warp-group-wide (``.sync.aligned``): a
    group whose warps took different sides of a branch is an error, as it hangs a GPU."""
    group_of = ctx.thread_ids // WARP_GROUP
    active = ctx.active()
    for g in np.unique(group_of):
        lanes = np.flatnonzero(group_of == g)
        if not active[lanes].any():
            continue
        if not active[lanes].all():
            raise KilnValueError(f"wgmma.mma_async is issued by {int(active[lanes].sum())} of "
                                 f"the {len(lanes)} threads of warp group {g}",
                                 fix="branch on a value that is the same in the whole warp "
                                     "group (kiln.nvidia_asm.named_barrier_any, not a per-warp "
                                     "vote) around warp-group-wide instructions", loc=loc)
        yield lanes, ctx.thread_ids[lanes] % WARP_GROUP


def _issue(ctx, loc, byte_sets) -> None:
    """Record an issued WGMMA that keeps ``byte_sets`` being read until its group retires."""
    op_id = ctx.cta.shared.begin("wgmma", loc, read_bytes=np.concatenate(byte_sets))
    ctx.pending_wgmma.append(op_id)


@semantics(MMA_ASYNC_RS.name)
def _mma_async_rs(op, p):
    """Semantics of the register-A ``wgmma.mma_async`` (module docstring)."""
    loc = location(op)
    args = op_args(op)
    n, trans_b = args["n"], args["trans_b"] == 1
    fp8 = args["dtype"] in _FP8_PTX
    dtype = kiln_dtype(_FP8_PTX.get(args["dtype"], args["dtype"])).numpy
    k = 2 * INSTRUCTION_K if fp8 else INSTRUCTION_K
    layout = a_fragment_layout_8bit() if fp8 else a_fragment_layout()
    operands = p.operands(op)
    half = n // 2
    # Operands: the n/2 accumulators (tied to the outputs), 4 A registers, B, scale-d.
    acc_slots, a_slots = operands[:half], operands[half:half + 4]
    b_slot, scale_slot = operands[half + 4], operands[half + 5]
    out = p.result(op)
    a_rows, a_cols = layout.coords()  # [128 threads, 8 values (16 for FP8)]
    rows, cols = wgmma_m64_accumulator(n).coords()

    def run(env, ctx):
        def lanes_of(slot):
            return np.broadcast_to(env[slot], (ctx.size,))

        acc = np.stack([lanes_of(s) for s in acc_slots], axis=1).astype(np.float32)
        packed = np.stack([lanes_of(s) for s in a_slots], axis=1).astype(np.int32)
        a_values = np.ascontiguousarray(packed).view(dtype)  # [threads, 8 or 16]
        accumulate = lanes_of(scale_slot) != 0
        result = np.empty_like(acc)
        for lanes, t in _warp_groups(ctx, loc):
            if len(lanes) != WARP_GROUP:
                raise UnsupportedError("wgmma with A in registers needs all 128 threads of the "
                                       "warp group", loc=loc)
            b_desc = int(uniform(_lanes_of(env[b_slot], lanes), None, "the B descriptor", loc))
            keep = uniform(accumulate[lanes], None, "the scale-d flag", loc)
            b, b_bytes = _read_operand(ctx, b_desc, n, k, dtype, not trans_b, loc)
            a = np.empty((64, k))
            a[a_rows[t], a_cols[t]] = a_values[lanes].astype(np.float64)
            tile = np.zeros((64, n), np.float64)
            if keep:
                tile[rows[t], cols[t]] = acc[lanes]
            tile += a @ b.astype(np.float64).T
            result[lanes] = tile[rows[t], cols[t]]
            _issue(ctx, loc, [b_bytes])
        env[out] = result

    return run


@semantics("nvvm.wgmma.mma_async")
def _mma_async(op, p):
    acc_slot, a_slot, b_slot = p.operands(op)
    out = p.result(op)
    loc = location(op)
    m, n, k = (int(v) for v in re.findall(r"=\s*(\d+)", _attr_text(op, "shape")))
    type_a = re.search(r"<(\w+)>", _attr_text(op, "typeA")).group(1)
    type_b = re.search(r"<(\w+)>", _attr_text(op, "typeB")).group(1)
    if (type_a, k) not in _SHAPES or (type_b, k) not in _SHAPES or m != 64:
        raise UnsupportedError(f"the interpreter runs wgmma m64nNk16 with f16/bf16 operands or "
                               f"m64nNk32 with e4m3/e5m2, not m{m}n{n}k{k} {type_a}/{type_b}",
                               loc=loc)

    dtype, b_dtype = kiln_dtype(type_a).numpy, kiln_dtype(type_b).numpy
    a_k_major = "row" in _attr_text(op, "layoutA")
    b_k_major = "col" in _attr_text(op, "layoutB")
    accumulate = "one" in _attr_text(op, "scaleD")
    rows, cols = wgmma_m64_accumulator(n).coords()  # [128 threads, n/2 registers]

    def run(env, ctx):
        acc = np.broadcast_to(env[acc_slot], (ctx.size,) + env[acc_slot].shape[1:])
        result = np.array(acc, np.float32)
        for lanes, t in _warp_groups(ctx, loc):
            a_desc = int(uniform(_lanes_of(env[a_slot], lanes), None, "the A descriptor", loc))
            b_desc = int(uniform(_lanes_of(env[b_slot], lanes), None, "the B descriptor", loc))
            a, a_bytes = _read_operand(ctx, a_desc, m, k, dtype, a_k_major, loc)
            b, b_bytes = _read_operand(ctx, b_desc, n, k, b_dtype, b_k_major, loc)
            tile = np.zeros((m, n), np.float64)
            if accumulate:
                tile[rows[t], cols[t]] = acc[lanes]
            tile += a.astype(np.float64) @ b.astype(np.float64).T
            result[lanes] = tile[rows[t], cols[t]]
            op_id = ctx.cta.shared.begin("wgmma", loc,
                                         read_bytes=np.concatenate([a_bytes, b_bytes]))
            ctx.pending_wgmma.append(op_id)
        env[out] = result

    return run


@semantics("nvvm.wgmma.commit.group.sync.aligned")
def _commit(op, p):
    def run(env, ctx):
        commit_group(ctx, "wgmma", ctx.pending_wgmma)

    return run


@semantics("nvvm.wgmma.wait.group.sync.aligned")
def _wait(op, p):
    keep = attr_int(op, "group", 0)

    def run(env, ctx):
        retire_groups(ctx, "wgmma", keep)

    return run


@semantics("nvvm.wgmma.fence.aligned")
def _fence(op, p):
    return None  # register/shared ordering: every access already happens in program order
