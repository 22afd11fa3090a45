"""``kiln.gemm`` on sm_90a: warpgroup MMA (``wgmma.mma_async``) with both operands in shared
memory, and the layout of the shared operand tiles it reads (``kiln.tiles.operand_tile``).

The block's warpgroups (128 threads each) split the ``BM x BN`` tile by rows: warpgroup ``g``
computes rows ``64g .. 64g+63`` with ``BK / 16`` instructions ``wgmma.m64nBNk16`` (f32 += bf16
or f16), one commit group per :func:`gemm` call, left in flight: ``kiln-insert-waits`` puts
the ``wgmma.wait_group`` before the first read of the accumulator and before the barrier ahead
of a copy that refills ``a`` or ``b`` (so every warpgroup's group is retired). WGMMA reads
128-byte-swizzled shared tiles through matrix descriptors (PTX ISA "Matrix Descriptor
Format"):

=====  ===================================  ==============================================
tile   layout (``operand_tile``)           descriptor
=====  ===================================  ==============================================
A      ``BM x BK``, K-major: 64-column      leading 16 B, stride 1024 B (8 rows); a k16
       chunks of ``BM`` 128-byte rows        step is +32 B, a 64-column chunk +``BM*128`` B
B      ``BK x BN``, N-major: 64-column      leading ``BK*128`` B (chunk to chunk along N),
       chunks of ``BK`` 128-byte rows        stride 1024 B; a k16 step is +2048 B
=====  ===================================  ==============================================

Each chunk is ``Swizzle.sw128b`` (16-byte units of a row XORed with the row's index mod 8) and
starts on a 1024-byte boundary, so WGMMA and the ``cp.async`` copies into it are free of bank
conflicts. The accumulator is a RegTile held as the ``!llvm.struct`` the instruction reads and
writes (no moves between steps) in the block-wide layout :func:`accumulator_layout`: the
warpgroup's ``wgmma_m64_accumulator(BN)`` stamped over the warpgroups. Elementwise math,
``kiln.reduce`` and ``kiln.copy`` read it as any RegTile; ``kiln-insert-waits`` puts the
``wgmma.wait_group`` before the first such read (the next :func:`gemm` accumulating into it
is not a read: WGMMAs accumulate in order).

Example (``kiln.gemm`` dispatches here for such tiles on sm_90a)::

    a_s = kiln.tiles.operand_tile((128, 64), kiln.bf16, "a")
    b_s = kiln.tiles.operand_tile((64, 256), kiln.bf16, "b")
    acc = kiln.gemm(a_s, b_s, kiln.accumulator(a_s, b_s))   # 256 threads: 2 warpgroups
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import arith, llvm, nvvm, vector

from . import builder
from .core import dtypes as dt
from .core.ops import AUTO_WAIT_ATTR
from .layout import Layout, ThreadValueLayout, concat_modes, make_layout
from .ops import thread_id
from .reg_tile import RegTile, pack_struct
from .nvidia.wgmma import fresh_descriptor
from .shared_tile import SharedTile
from .values import Value
from . import wgmma

WARPGROUP = 128
CHUNK_BYTES = 128          # one swizzled row: 64 elements of a 2-byte dtype
ATOM_BYTES = 1024          # 8 swizzled rows: the descriptor's stride and the tile alignment
K_STEP = wgmma.INSTRUCTION_K
# Counts the gemm calls traced so far: kiln.pipeline retires a loop's last group after it.
GROUPS_ATTR = "_kiln_wgmma_groups"


def _chunked(rows: int, cols: int, chunk: int) -> Layout:
    """``rows x cols`` as ``cols / chunk`` chunks of ``rows x chunk`` row-major elements."""
    if cols == chunk:
        return make_layout((rows, cols))
    return Layout((rows, (chunk, cols // chunk)), (chunk, (1, rows * chunk)))


def chunked_layout(rows: int, cols: int, dtype: Any) -> Layout:
    """WGMMA's operand layout of a ``rows x cols`` tile: 128-byte chunks of ``rows`` rows."""
    return _chunked(rows, cols, CHUNK_BYTES // dt.dtype(dtype).itemsize)


def wgmma_operand(shape: tuple[int, int], dtype: Any, operand: str, target=None) -> bool:
    """Whether a ``shape`` tile of ``dtype`` can be WGMMA operand ``operand`` on ``target``
    (default: the kernel's)."""
    dtype = dt.dtype(dtype)
    target = builder.current_target() if target is None else target
    if not target.has_wgmma or dtype.name not in wgmma.OPERAND_DTYPES:
        return False
    chunk = CHUNK_BYTES // dtype.itemsize
    return shape[1] % chunk == 0 and shape[0] % 8 == 0 and (operand == "a" or
                                                            shape[1] <= wgmma.MAX_N)


def _register_a(a: RegTile) -> bool:
    """Whether ``a`` is a WGMMA accumulator (:func:`accumulator_layout`) cast to bf16/f16: its
    values ``8j .. 8j+7`` are the register A operand of K step ``j`` (no data moves)."""
    return (a.grid == (1, 1) and a.dtype.name in wgmma.OPERAND_DTYPES
            and a.shape[1] % K_STEP == 0 and a.shape[0] % wgmma.WARPGROUP_M == 0
            and a.layout == accumulator_layout(a.shape[0], a.shape[1]))


def applies(a: SharedTile | RegTile, b: SharedTile) -> bool:
    """Whether :func:`gemm` runs ``a @ b``: A a tile laid out for WGMMA
    (``kiln.tiles.operand_tile(..., "a")``) or a cast accumulator of :func:`gemm`, with one
    64-row slab per warpgroup; B an ``operand_tile(..., "b")`` (N-major) or the ``.T`` of an
    ``operand_tile(..., "a")`` (K-major, e.g. ``k_s.T``)."""
    threads = builder.current().block[0]
    groups = threads // WARPGROUP
    if not builder.current_target().has_wgmma or threads % WARPGROUP:
        return False
    a_ok = _register_a(a) if isinstance(a, RegTile) else getattr(a, "wgmma_operand", None) == "a"
    return (a_ok and a.shape[0] == wgmma.WARPGROUP_M * groups
            and getattr(b, "wgmma_operand", None) in ("b", "b_kmajor")
            and b.shape[1] <= wgmma.MAX_N)


def accumulator_layout(tile_m: int, tile_n: int) -> ThreadValueLayout:
    """The ``tile_m x tile_n`` accumulator over ``tile_m / 64`` warpgroups: thread ``t`` holds
    what ``wgmma_m64_accumulator(tile_n)`` gives thread ``t % 128``, ``64 * (t // 128)`` rows
    down. E.g. for 128 x 256, thread 165 (warpgroup 1, thread 37) value 5 is (81, 11)."""
    one = wgmma.wgmma_m64_accumulator(tile_n).layout
    threads, values = one[0], one[1]
    groups = tile_m // wgmma.WARPGROUP_M
    stamped = Layout((threads.shape, groups), (threads.stride, wgmma.WARPGROUP_M * tile_n))
    return ThreadValueLayout(concat_modes(stamped, values), (tile_m, tile_n))


def accumulator(a: SharedTile, b: SharedTile, value: float = 0.0) -> RegTile:
    """A ``BM x BN`` f32 accumulator of ``value`` in :func:`accumulator_layout`, as a struct."""
    layout = accumulator_layout(a.shape[0], b.shape[1])
    fill = arith.constant(dt.f32.mlir_type(), float(value))
    tile = RegTile.from_struct(pack_struct([fill] * layout.num_values), layout)
    # gemm starts a zero accumulator with scale-d = 0: no register is filled with zeros
    tile.wgmma_zero = value == 0.0
    return tile


def _descriptor(tile: SharedTile, byte_offset: Any, leading: int) -> Any:
    """The tile's descriptor at ``byte_offset``, fresh in every call: the instructions of one
    :func:`gemm` add constants to it (LLVM would hoist every distinct one out of a loop)."""
    desc = wgmma.smem_descriptor(tile.buffer, leading_bytes=leading, stride_bytes=ATOM_BYTES,
                                 byte_offset=byte_offset)
    return Value(fresh_descriptor(desc.ir))


def _register_fragments(a: RegTile) -> list:
    """The ``BK / 16`` register A operands (``vector<8 x bf16>``) of this thread's slab."""
    whole = a.fragment(0, 0)
    per = wgmma.A_REGISTER_VALUES
    return [Value(vector.shuffle(whole.ir, whole.ir, list(range(per * j, per * (j + 1)))),
                  a.dtype) for j in range(a.shape[1] // K_STEP)]


def gemm(a: SharedTile | RegTile, b: SharedTile, acc: RegTile) -> RegTile:
    """Issue ``acc += a @ b`` as one WGMMA commit group (fence, ``BK / 16`` instructions,
    commit) and return the accumulator in flight: kiln-insert-waits retires the group before
    its result is read and before a copy or store may overwrite ``a`` or ``b``. ``a`` in
    registers (FlashAttention-3's P) is read as it lies: see :func:`_register_a`."""
    tile_m, tile_n, tile_k = a.shape[0], b.shape[1], a.shape[1]
    item = b.dtype.itemsize
    k_major_b = b.wgmma_operand == "b_kmajor"
    if isinstance(a, RegTile):
        a_ops = _register_fragments(a)
    else:
        # warpgroup g's 64 rows start 64 * 128 bytes into every chunk of A
        a_base = _descriptor(a, thread_id(0) // WARPGROUP * (wgmma.WARPGROUP_M * CHUNK_BYTES),
                             16)
        a_ops = [_plus(a_base, _k_offset(kk * K_STEP, tile_m, item))
                 for kk in range(tile_k // K_STEP)]
    b_base = _descriptor(b, 0, 16 if k_major_b else tile_k * CHUNK_BYTES)
    one = wgmma.wgmma_m64_accumulator(tile_n)
    zero = getattr(acc, "wgmma_zero", False)
    struct = llvm.mlir_undef(acc.struct().type) if zero else acc.struct()
    out = RegTile.from_struct(struct, one)
    wgmma.fence()
    for kk, a_op in enumerate(a_ops):
        if k_major_b:       # N x K stored as A is: the same chunks, N rows each
            b_desc = _plus(b_base, _k_offset(kk * K_STEP, tile_n, item))
        else:               # K x N: a k16 step is 16 rows of every chunk
            b_desc = _plus(b_base, kk * K_STEP * CHUNK_BYTES)
        out = wgmma.mma_async(out, a_op, b_desc, dtype=b.dtype,
                              b_major="k" if k_major_b else "mn", accumulate=kk > 0 or not zero)
    wgmma.require_feature("wgmma", "kiln.gemm")
    # the group's waits are kiln-insert-waits' (the interpreter runs the pass on such kernels)
    nvvm.wgmma_commit_group_sync_aligned().operation.attributes[AUTO_WAIT_ATTR] = \
        ir.UnitAttr.get()
    state = builder.current()
    setattr(state, GROUPS_ATTR, getattr(state, GROUPS_ATTR, 0) + 1)
    return RegTile.from_struct(out.struct(), acc.layout)


def _plus(descriptor: Any, byte_offset: int) -> Any:
    """``descriptor`` moved ``byte_offset`` bytes on (its start address counts 16-byte units)."""
    if not byte_offset:
        return descriptor
    i64 = ir.IntegerType.get_signless(64)
    return Value(arith.addi(descriptor.ir, arith.constant(i64, byte_offset >> 4)))


def _k_offset(col: int, rows: int, item: int) -> int:
    """Byte offset of column ``col`` in a K-major tile of 64-column chunks of ``rows`` rows."""
    chunk = CHUNK_BYTES // item
    return (col // chunk) * rows * CHUNK_BYTES + (col % chunk) * item
