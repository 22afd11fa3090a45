"""Warp-group MMA (WGMMA, sm_90a): a 128-thread warp group computes ``D = A @ B + D``.

One op, :func:`mma_async`, issues ``wgmma.mma_async.m64nNk16`` (f32 += f16/bf16 x f16/bf16),
parameterised like the PTX instruction by where A lives (:func:`a_location`) and the operand
majors:

- A in shared memory: an i64 matrix descriptor (:func:`smem_descriptor`), ``a_major`` ``"k"``
  or ``"mn"``;
- A in registers: ``vector<8 x T>`` per thread laid out as :func:`a_fragment_layout` (a
  fragment of :func:`a_fragment_from_accumulator`'s tile), always K-major; for FP8
  (``m64nNk32``) ``vector<16 x f8>`` laid out as :func:`a_fragment_layout_8bit`.

B always comes through a descriptor. The accumulator is a :class:`~kiln.tiles.RegTile`, Kiln's
one register-fragment type: a 1 x 1 tile of f32 registers in layout
:func:`kiln.layout.wgmma_m64_accumulator` (``n // 2`` registers per thread), held as the
``!llvm.struct`` the instruction reads and writes. Tile-level code (row reductions,
``OnlineSoftmax``) works on it directly, or on :func:`fragment_to_tile`'s vector form (one
conversion instead of one per use); ``acc.element(i)`` and
:meth:`~kiln.tiles.RegTile.from_registers` give and take the raw registers. The register A
operands are a RegTile too (layout :func:`a_fragment_layout`, one fragment per 16 columns).

Example (a pipelined product: issue, commit, wait)::

    a = kiln.wgmma.smem_descriptor(a_tile, leading_bytes=16, stride_bytes=1024)
    b = kiln.wgmma.smem_descriptor(b_tile, leading_bytes=16, stride_bytes=1024)
    acc = kiln.wgmma.fragment_zeros(64)
    kiln.wgmma.fence()
    for k in kiln.static_range(4):                       # K = 64: four k16 steps, 32 B each
        acc = kiln.wgmma.mma_async(acc, a + 2 * k, b + 2 * k, dtype=kiln.bf16)
    kiln.wgmma.commit()
    kiln.wgmma.wait_group(0)

``kiln.mma.atom(64, n, 16, dtype)`` on sm_90a is this op's atom. ``mma_async_regs`` and
``Fragment`` are aliases kept from the separate register-A op and accumulator type.
Supported: ``m64nNk16``, f16 or bf16 A/B, f32 accumulator, N a multiple of 8 in 8..256,
operands in 128-byte-swizzled shared memory; and ``m64nNk32`` with f8e4m3/f8e5m2 A and B
(``dtype=kiln.f8e4m3``), both K-major in shared memory (one k32 step is 32 bytes, as for k16
of a 2-byte dtype, so descriptors advance by 2 units per step either way), or with FP8 A
from registers (:func:`a_fragment_from_accumulator` with ``k_permuted=True``: the 8-bit A
fragment holds other columns than the accumulator, so the keys come in the order
:data:`FP8_A_K_ORDER`, which B's K rows must follow).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, memref, nvvm, vector

from .core.dtypes import DType, dtype as as_dtype, f32
from .core.errors import KilnTypeError, KilnValueError, UnsupportedError
from .layout import Layout, ThreadValueLayout, concat_modes, wgmma_m64_accumulator
from .nvidia.cvt import pack_f8x4
from .nvidia.sync import as_index, ir_value, require_feature
from .nvidia.wgmma import keep_registers_live, wgmma_mma_async_regs
from .ops import thread_id
from .reg_tile import RegTile, pack_struct
from .values import Value, cast

WARPGROUP_M = 64
INSTRUCTION_K = 16
MAX_N = 256
SWIZZLE_ROW_BYTES = 128
OPERAND_DTYPES = ("f16", "bf16")
FP8_DTYPES = ("f8e4m3", "f8e5m2")  # m64nNk32, A and B K-major in shared memory
FP8_K = 32
SUPPORTED = ("m64nNk16 with f16 or bf16 A/B, or m64nNk32 with f8e4m3/f8e5m2 A/B (K-major; A "
             "from shared memory or registers), and an f32 accumulator; N % 8 == 0 with "
             "8 <= N <= 256")
SWIZZLE_128B_LAYOUT = 1  # descriptor bits 62-63: 1 = 128-byte swizzle
SWIZZLE_ATOM_BYTES = 1024  # 8 rows x 128 bytes: the repeating unit of a 128B-swizzled tile
_WGMMA_TYPES = {"f16": nvvm.WGMMATypes.f16, "bf16": nvvm.WGMMATypes.bf16,
                "f8e4m3": nvvm.WGMMATypes.e4m3, "f8e5m2": nvvm.WGMMATypes.e5m2}
MAJORS = ("k", "mn")
A_REGISTER_VALUES = 8  # 64 x 16 A tile over 128 threads: 8 elements = 4 packed b32 registers
A_REGISTER_VALUES_8BIT = 16  # 64 x 32 FP8 A tile over 128 threads: 16 bytes = 4 b32 registers
# Column of a 32-column accumulator block that FP8 A column k holds (a_fragment_from_accumulator
# with k_permuted=True): thread l%4 holds accumulator columns 2t, 2t+1, 2t+8, 2t+9 (+16) of its
# rows, the 8-bit A fragment wants columns 4t..4t+3 (+16); relabelling the K index costs nothing.
FP8_A_K_ORDER = tuple(16 * (k // 16) + 2 * ((k % 16) // 4) + k % 2 + 8 * ((k % 4) // 2)
                      for k in range(FP8_K))
# Accumulator register (within a 32-column block: 16 per thread) of FP8 A value v.
_FP8_A_FROM_ACC = (0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15)

# The accumulator type of earlier releases: accumulators are RegTiles now.
Fragment = RegTile


def fence() -> None:
    """``wgmma.fence``: order register/shared writes before the next WGMMA reads them."""
    require_feature("wgmma", "kiln.wgmma.fence")
    nvvm.wgmma_fence_aligned()


def commit() -> None:
    """``wgmma.commit_group``: close the group of WGMMAs issued since the last commit."""
    require_feature("wgmma", "kiln.wgmma.commit")
    nvvm.wgmma_commit_group_sync_aligned()


def wait_group(pending: int = 0, *, reads=()) -> None:
    """``wgmma.wait_group pending``: wait until at most ``pending`` WGMMA groups are in flight.

    ``reads``: the register A operands (a RegTile from :func:`a_fragment_from_accumulator`, or
    its fragments) of the groups this wait completes. LLVM takes a WGMMA's register operands
    as read when it is issued, and may then give their registers to new values (say, the next
    P written while this P V is still on the tensor cores); ptxas answers by serialising every
    WGMMA of the kernel. Naming them here keeps them live until the wait. Example::

        o = kiln.wgmma.mma_async(o, p.fragment(0, 0), v_desc, dtype=kiln.bf16, b_major="mn")
        kiln.wgmma.commit()
        p_next = kiln.wgmma.a_fragment_from_accumulator(s_next, kiln.bf16)
        kiln.wgmma.wait_group(0, reads=p)
    """
    require_feature("wgmma", "kiln.wgmma.wait_group")
    if not isinstance(pending, int) or pending < 0:
        raise KilnValueError(f"pending must be an int >= 0, got {pending!r}",
                             fix="use 0 to wait for every committed WGMMA group")
    registers = [r for frag in reads for r in _a_registers(frag)]
    nvvm.wgmma_wait_group_sync_aligned(pending)
    if registers:
        keep_registers_live(registers)



def smem_descriptor(tile, *, leading_bytes: int, stride_bytes: int, byte_offset=0):
    """The 64-bit matrix descriptor of a 128B-swizzled operand at ``tile`` + ``byte_offset``.

    For a K-major tile (rows of 64 bf16/f16 along K): ``stride_bytes=1024`` (one 8-row swizzle
    atom to the next along M/N), ``leading_bytes`` unused (pass 16). For an MN-major tile
    stored as 64-column chunks of ``BK`` rows: ``stride_bytes=1024`` (8 rows of K to the next
    8) and ``leading_bytes=BK * 128`` (one 64-column chunk to the next). The tile must start on
    a 1024-byte boundary; ``byte_offset`` (int or traced) moves inside it, e.g. 32 bytes per
    16-element K step of a K-major tile. Returns an i64 ``kiln.Value``.

    Example: ``a = kiln.wgmma.smem_descriptor(a_tile, leading_bytes=16, stride_bytes=1024)``.
    """
    require_feature("wgmma", "kiln.wgmma.smem_descriptor")
    for name, value in (("leading_bytes", leading_bytes), ("stride_bytes", stride_bytes)):
        if not isinstance(value, int) or value % 16 or not 0 <= value < 2**18:
            raise KilnValueError(f"descriptor {name}={value!r} must be a multiple of 16 below "
                                 "2^18", fix="pass the byte stride of the swizzle atoms")
    value = ir_value(tile, "shared tile")
    if not isinstance(value.type, ir.MemRefType):
        raise KilnTypeError(f"smem_descriptor needs a shared-memory tile, got {value.type}",
                            fix="pass a kiln.shared / kiln.dynamic_shared buffer")
    i64 = ir.IntegerType.get_signless(64)
    address = arith.index_cast(i64, memref.extract_aligned_pointer_as_index(value))
    address = arith.addi(address, arith.index_cast(i64, as_index(byte_offset, "byte offset")))
    # Bits 0-13: address >> 4 (shared addresses are below 2^18).
    start = arith.shrui(arith.andi(address, arith.constant(i64, 0x3FFFF)),
                        arith.constant(i64, 4))
    fields = ((leading_bytes >> 4) << 16) | ((stride_bytes >> 4) << 32) \
        | (SWIZZLE_128B_LAYOUT << 62)
    if fields >= 2**63:  # i64 constants are signed
        fields -= 2**64
    return Value(arith.ori(start, arith.constant(i64, fields)))


# ---------------------------------------------------------------------------------------------
# Accumulators and register A operands: RegTiles
# ---------------------------------------------------------------------------------------------


def fragment_zeros(n: int) -> RegTile:
    """A zero 64 x ``n`` accumulator for :func:`mma_async` (n a multiple of 8 up to 256)."""
    require_feature("wgmma", "kiln.wgmma.fragment_zeros")
    layout = _accumulator_layout(n)
    zero = arith.constant(f32.mlir_type(), 0.0)
    return RegTile.from_struct(pack_struct([zero] * (n // 2)), layout)


def fragment_from_elements(values) -> RegTile:
    """The 64 x ``2 * len(values)`` accumulator whose register ``i`` is ``values[i]`` (f32
    ``kiln.Value`` s, in :meth:`~kiln.tiles.RegTile.element` order): elementwise work on an
    accumulator (softmax on WGMMA scores, rescaling an output) reads registers, computes, and
    rebuilds. Example:
    ``acc = fragment_from_elements([acc.element(i) * 2.0 for i in range(acc.shape[1] // 2)])``.
    """
    require_feature("wgmma", "kiln.wgmma.fragment_from_elements")
    values = list(values)
    layout = _accumulator_layout(2 * len(values))
    for i, element in enumerate(values):
        if not isinstance(element, Value) or element.shape or element.dtype is not f32:
            raise KilnTypeError(f"fragment element {i} must be f32 (a scalar), got {element!r}",
                                fix="kiln.cast the value to kiln.f32 first")
    return RegTile.from_struct(pack_struct([v.ir for v in values]), layout)


def fragment_to_tile(acc: RegTile) -> RegTile:
    """``acc`` with its registers as one vector fragment, for tile-level work (row reductions,
    ``OnlineSoftmax``) that reads them all: one conversion here instead of one per use.
    Example: ``s = fragment_to_tile(scores); m = s.row_max()``."""
    _check_accumulator(acc, "fragment_to_tile")
    return acc.unpacked()


def fragment_from_tile(tile: RegTile) -> RegTile:
    """``tile`` (an accumulator RegTile) with its registers in the struct the WGMMA reads, the
    inverse of :func:`fragment_to_tile`. Example: ``acc = fragment_from_tile(o_tile)``."""
    n = _check_accumulator(tile, "fragment_from_tile")
    return RegTile.from_struct(tile.struct(), wgmma_m64_accumulator(n))


def scale_rows(acc: RegTile, factors) -> RegTile:
    """``acc`` with each of the thread's two rows multiplied by its factor: ``factors[0]`` for
    row ``16*w + l//4``, ``factors[1]`` for row ``+ 8`` (register ``i`` is on row
    ``(i // 2) % 2``, see :func:`kiln.layout.wgmma_m64_accumulator`). The online-softmax
    rescale of an output ``O`` whose width differs from the score tile's; call it before the
    :func:`fence` of the next product that reads ``acc``, not while an earlier group is in
    flight (ptxas then serialises every WGMMA).
    Example: ``o = kiln.wgmma.scale_rows(o, [alpha_top, alpha_bottom])``."""
    n = _check_accumulator(acc, "scale_rows")
    if len(factors) != 2:
        raise KilnValueError(f"scale_rows needs 2 factors (the thread's two rows), got "
                             f"{len(factors)}", fix="pass [top_row_factor, bottom_row_factor]")
    return fragment_from_elements([acc.element(i) * factors[(i // 2) % 2]
                                   for i in range(n // 2)])


def a_fragment_layout() -> ThreadValueLayout:
    """``(thread, value) -> (row, col)`` of the 64 x 16 A operand held in registers.

    The same positions as the accumulator of a 64 x 16 product,
    :func:`kiln.layout.wgmma_m64_accumulator` ``(16)`` (PTX ISA "Register Fragments, Matrix A"
    for ``wgmma .m64nNk16``): warp ``w = t // 32`` owns rows ``16w..16w+15``; value ``v`` of lane
    ``l`` is row ``16w + l // 4 + 8 * (v // 2 % 2)``, column ``8 * (v // 4) + 2 * (l % 4) + v % 2``.
    Values ``2i, 2i+1`` share b32 register ``i`` (``2i`` in the low half).

    Worked example: thread 37 (warp 1, lane 5) holds rows 17 and 25, columns 2, 3, 10, 11;
    its value 5 is ``(17, 11)``::

        >>> kiln.wgmma.a_fragment_layout()(37, 5)
        (17, 11)
    """
    return wgmma_m64_accumulator(INSTRUCTION_K)


def a_fragment_layout_8bit() -> ThreadValueLayout:
    """``(thread, value) -> (row, col)`` of the 64 x 32 FP8 A operand held in registers.

    PTX ISA "Register Fragments, Matrix A" for ``wgmma .m64nNk32`` with ``.e4m3``/``.e5m2``:
    warp ``w`` owns rows ``16w..16w+15``; value ``v`` (byte ``v % 4`` of b32 register
    ``v // 4``) of lane ``l`` is row ``16w + l // 4 + 8 * (v // 4 % 2)``, column
    ``4 * (l % 4) + v % 4 + 16 * (v // 8)``.

    Worked example: thread 37 (warp 1, lane 5) holds rows 17 and 25, columns 4..7 and 20..23;
    its value 9 is ``(17, 21)``::

        >>> kiln.wgmma.a_fragment_layout_8bit()(37, 9)
        (17, 21)
    """
    threads = Layout((4, 8, 4), (4, FP8_K, 16 * FP8_K))
    values = Layout((4, 2, 2), (1, 8 * FP8_K, 16))
    return ThreadValueLayout(concat_modes(threads, values), (WARPGROUP_M, FP8_K))


def a_fragment_from_accumulator(acc: RegTile, dtype, *, k_permuted: bool = False) -> RegTile:
    """Convert a 64 x ``n`` f32 accumulator (e.g. ``P = softmax(S)``) to ``dtype`` with one
    bulk cast, as the register A operands of :func:`mma_async`: a 1 x ``n // 16`` RegTile of
    layout :func:`a_fragment_layout` whose fragment ``(0, j)`` (``vector<8 x dtype>``) holds
    columns ``16j .. 16j+15`` (accumulator registers ``8j .. 8j+7`` are exactly that
    fragment, so no data moves).

    Example: ``p = a_fragment_from_accumulator(s, kiln.bf16)`` then
    ``o = mma_async(o, p.fragment(0, j), v_desc_j, dtype=kiln.bf16, b_major="mn")`` per 16 keys.

    FP8 (``f8e4m3``/``f8e5m2``, ``k_permuted=True`` required): a 1 x ``n // 32`` RegTile of
    layout :func:`a_fragment_layout_8bit` (``vector<16 x f8>``, rounded and saturated by
    ``cvt.rn.satfinite``) whose column ``k`` of fragment ``j`` is accumulator column
    ``32j + FP8_A_K_ORDER[k]``: no data crosses threads, so row ``k`` of the B operand must be
    the product's row ``32j + FP8_A_K_ORDER[k]`` (FP8 attention writes V's transpose in that
    order). Example: ``p = a_fragment_from_accumulator(s, kiln.f8e4m3, k_permuted=True)``.
    """
    require_feature("wgmma", "kiln.wgmma.a_fragment_from_accumulator")
    out_dtype = _operand_dtype(dtype, "a_fragment_from_accumulator", fp8=True)
    n = _check_accumulator(acc, "a_fragment_from_accumulator")
    if out_dtype.name in FP8_DTYPES:
        return _fp8_a_fragments(acc, out_dtype, n, k_permuted)
    if n % INSTRUCTION_K:
        raise UnsupportedError(f"a 64 x {n} accumulator does not split into 16-column A "
                               "operands", fix="use an accumulator whose N is a multiple of 16")
    converted = cast(acc.fragment(0, 0), out_dtype)
    frags = [Value(vector.shuffle(converted.ir, converted.ir,
                                  list(range(A_REGISTER_VALUES * j, A_REGISTER_VALUES * (j + 1)))),
                   out_dtype) for j in range(n // INSTRUCTION_K)]
    return RegTile(frags, a_fragment_layout(), (1, n // INSTRUCTION_K))


def _fp8_a_fragments(acc: RegTile, dtype: DType, n: int, k_permuted: bool) -> RegTile:
    """:func:`a_fragment_from_accumulator` for an FP8 dtype: four ``cvt`` pairs per register."""
    if not k_permuted:
        raise UnsupportedError("FP8 register A operands hold the accumulator's columns in the "
                               "order FP8_A_K_ORDER, not 0..31",
                               fix="pass k_permuted=True and store B's K rows in "
                                   "kiln.wgmma.FP8_A_K_ORDER")
    if n % FP8_K:
        raise UnsupportedError(f"a 64 x {n} accumulator does not split into 32-column FP8 A "
                               "operands", fix="use an accumulator whose N is a multiple of 32")
    i32 = ir.IntegerType.get_signless(32)
    frag_type = ir.VectorType.get([A_REGISTER_VALUES_8BIT], dtype.mlir_type())
    frags = []
    for j in range(n // FP8_K):
        source = [acc.element(FP8_K // 2 * j + r) for r in _FP8_A_FROM_ACC]
        words = [pack_f8x4(source[4 * w:4 * w + 4], dtype).ir for w in range(4)]
        packed = vector.from_elements(ir.VectorType.get([4], i32), words)
        frags.append(Value(vector.bitcast(frag_type, packed), dtype))
    return RegTile(frags, a_fragment_layout_8bit(), (1, n // FP8_K))


# ---------------------------------------------------------------------------------------------
# The WGMMA op
# ---------------------------------------------------------------------------------------------
# One instruction, two forms of A: a shared-memory descriptor (upstream ``nvvm.wgmma.mma_async``)
# or four b32 registers (inline PTX, :func:`kiln.nvidia_asm.wgmma_mma_async_regs`, since the
# upstream op only takes descriptors). Descriptors follow PTX "Matrix Descriptor Format":
# https://docs.nvidia.com/cuda/parallel-thread-execution/#asynchronous-warpgroup-level-matrix-shared-memory-layout-matrix-descriptor


def a_location(a) -> str:
    """Where the A operand ``a`` of :func:`mma_async` lives: ``"shared"`` for an i64 matrix
    descriptor, ``"registers"`` for a ``vector<8 x f16/bf16>`` fragment (or a 1 x 1 RegTile)
    of :func:`a_fragment_layout`. Raises KilnTypeError for anything else."""
    if isinstance(a, RegTile) and a.grid == (1, 1) \
            and a.layout in (a_fragment_layout(), a_fragment_layout_8bit()):
        return "registers"
    if isinstance(a, Value) and ((a.shape == (A_REGISTER_VALUES,)
                                  and a.dtype.name in OPERAND_DTYPES)
                                 or (a.shape == (A_REGISTER_VALUES_8BIT,)
                                     and a.dtype.name in FP8_DTYPES)):
        return "registers"
    value = getattr(a, "ir", a)
    if isinstance(value, ir.Value) and value.type == ir.IntegerType.get_signless(64):
        return "shared"
    raise KilnTypeError(f"the WGMMA A operand must be an i64 shared-memory descriptor or a "
                        f"vector<{A_REGISTER_VALUES} x bf16/f16> register fragment, got {a!r}",
                        fix="build it with kiln.wgmma.smem_descriptor or "
                            "kiln.wgmma.a_fragment_from_accumulator")


def mma_async(acc: RegTile, a, b_desc, *, dtype, a_major: str = "k", b_major: str = "k",
              accumulate=True) -> RegTile:
    """Issue one ``wgmma.mma_async.m64nNk16`` (f32 += ``dtype`` x ``dtype``): ``acc += A @ B``
    with A (64 x 16) from shared memory or registers (:func:`a_location`) and B (16 x N)
    through descriptor ``b_desc``; returns the new accumulator.

    ``a_major``/``b_major``: ``"k"`` when K is the contiguous dimension of the operand's
    shared tile, ``"mn"`` otherwise (``b_major="mn"`` reads a row-major K x N B); A in
    registers is always ``"k"``. ``accumulate=False`` computes ``A @ B`` and ignores ``acc``'s
    values; with A in registers it may be a traced boolean.

    Asynchronous: bracket the issues with :func:`fence` before (it also orders writes of A's
    registers) and :func:`commit` after, then :func:`wait_group` before reading ``acc`` or
    overwriting the operands; do not touch ``acc`` or A in between.

    Example (K-major A from shared memory, then FlashAttention-3's O += P @ V with P in
    registers and V stored keys x depth)::

        kiln.wgmma.fence()
        for k in kiln.static_range(4):
            s = kiln.wgmma.mma_async(s, q_desc + 2 * k, k_desc + 2 * k, dtype=kiln.bf16)
        kiln.wgmma.commit()
        p = kiln.wgmma.a_fragment_from_accumulator(s, kiln.bf16)   # 64 x 64 P: 4 A operands
        kiln.wgmma.fence()
        for j in kiln.static_range(4):
            o = kiln.wgmma.mma_async(o, p.fragment(0, j), v_desc + 128 * j, dtype=kiln.bf16,
                                     b_major="mn")
        kiln.wgmma.commit()
    """
    require_feature("wgmma", "kiln.wgmma.mma_async")
    n = _check_accumulator(acc, "mma_async")
    operand = _operand_dtype(dtype, "mma_async", fp8=True)
    _check_major("a_major", a_major)
    _check_major("b_major", b_major)
    b_value = _descriptor(b_desc, "B descriptor")
    instruction_k = INSTRUCTION_K
    if operand.name in FP8_DTYPES:
        _check_fp8_operands(a, a_major, b_major)
        instruction_k = FP8_K
    if a_location(a) == "registers":
        if a_major != "k":
            raise UnsupportedError("a WGMMA A operand in registers is K-major by definition",
                                   fix="drop a_major (or stage A in shared memory)")
        a_frag = a.fragment(0, 0) if isinstance(a, RegTile) else a
        if a_frag.dtype is not operand:
            values = A_REGISTER_VALUES_8BIT if operand.is_fp8 else A_REGISTER_VALUES
            raise KilnTypeError(f"mma_async A operand must be a vector<{values}x"
                                f"{operand}> per thread, got {a_frag!r}",
                                fix="convert A with a_fragment_from_accumulator(acc, dtype)")

        ptx_type = _WGMMA_TYPES[operand.name].name if operand.name in FP8_DTYPES \
            else operand.name
        result = wgmma_mma_async_regs([r.ir for r in acc.registers()], _a_registers(a_frag),
                                      b_value, _scale_d(accumulate), ptx_type=ptx_type,
                                      trans_b=int(b_major == "mn"))
        return RegTile.from_struct(result, wgmma_m64_accumulator(n))
    if not isinstance(accumulate, bool):
        raise UnsupportedError("a traced accumulate flag needs A in registers (nvvm.wgmma "
                               "takes scale-d as an attribute)",
                               fix="pass accumulate=True/False, or start from fragment_zeros")
    # No typed getter exists in the Python bindings for #nvvm.shape.
    shape = ir.Attribute.parse(f"#nvvm.shape<m = {WARPGROUP_M}, n = {n}, k = {instruction_k}>")
    kind = _WGMMA_TYPES[operand.name]
    # NVVM spells operand order as layouts: A "row" and B "col" are K-major (no transpose).
    layout_a = nvvm.MMALayout.row if a_major == "k" else nvvm.MMALayout.col
    layout_b = nvvm.MMALayout.col if b_major == "k" else nvvm.MMALayout.row
    scale = nvvm.WGMMAScaleOut.one if accumulate else nvvm.WGMMAScaleOut.zero
    struct = acc.struct()
    result = nvvm.wgmma_mma_async(struct.type, struct, _descriptor(a, "A descriptor"), b_value,
                                  shape, kind, kind, nvvm.WGMMATypes.f32, scale,
                                  nvvm.WGMMAScaleIn.one, nvvm.WGMMAScaleIn.one, layout_a,
                                  layout_b)
    return RegTile.from_struct(result, wgmma_m64_accumulator(n))


mma_async_regs = mma_async  # the register-A op of earlier releases: the one op, A in registers


def store_fragment_swizzled(acc: RegTile, chunks, first_chunk, *, columns=None) -> None:
    """Stage ``acc`` (converted to ``chunks``' dtype) in shared memory for a TMA store.

    ``chunks`` is a :func:`kiln.dynamic_shared` buffer of 64 x ``128 / itemsize`` tiles laid out
    with the 128-byte swizzle (what a ``kiln.TensorMap[dtype, (64, 128 / itemsize), 128]``
    store reads), or of 64 x ``64 / itemsize`` tiles with the 64-byte swizzle (a
    ``kiln.TensorMap[dtype, (64, 64 / itemsize), 64]``: tiles whose N is an odd multiple of
    ``64 / itemsize``): column ``col`` of ``columns = (c0, c1)`` (default all) goes to tile
    ``first_chunk + (col - c0) // chunk_cols``, row ``r``, its 16-byte unit XORed with
    ``r % 8`` (128-byte rows) or ``(r // 2) % 4`` (64-byte rows). The swizzle keeps the 32
    lanes' stores on distinct banks. Call from all 128 threads of the warp group.
    Example: ``store_fragment_swizzled(acc, c_tiles, group * 4)`` then ``kiln.tma.store``.
    """
    require_feature("wgmma", "kiln.wgmma.store_fragment_swizzled")
    n = _check_accumulator(acc, "store_fragment_swizzled")
    itemsize = chunks.dtype.itemsize
    chunk_cols = SWIZZLE_ROW_BYTES // itemsize
    if tuple(chunks.shape[1:]) == (WARPGROUP_M, chunk_cols // 2):
        chunk_cols //= 2  # 64-byte rows, 64-byte swizzle
    if tuple(chunks.shape[1:]) != (WARPGROUP_M, chunk_cols):
        raise KilnValueError(f"staging tiles must be {WARPGROUP_M} x {chunk_cols} "
                             f"{chunks.dtype}, got {chunks.shape[1:]}",
                             fix=f"allocate dynamic_shared((n, {WARPGROUP_M}, {chunk_cols}), ...)")
    c0, c1 = columns if columns is not None else (0, n)
    if c0 % chunk_cols or c1 % chunk_cols or not 0 <= c0 < c1 <= n:
        raise KilnValueError(f"columns {columns} must be whole {chunk_cols}-column chunks of "
                             f"0..{n}", fix=f"use multiples of {chunk_cols}")
    lane_in_group = thread_id(0) % 128
    warp, lane = lane_in_group // 32, lane_in_group % 32
    row = warp * 16 + lane // 4
    unit = 16 // itemsize  # elements per 16-byte swizzle unit
    wide = chunk_cols * itemsize == SWIZZLE_ROW_BYTES
    pair_type = ir.VectorType.get([2], f32.mlir_type())
    out_type = ir.VectorType.get([2], chunks.dtype.mlir_type())
    for half in range(2):
        r = row + 8 * half
        # the 16-byte unit's index XOR address bits 7.. (Swizzle(3 or 2, 4, 3) on bytes)
        flip = (r % 8) * unit if wide else ((r // 2) % 4) * unit
        for j in range(c0 // 8, c1 // 8):
            col = 8 * j + 2 * (lane % 4)
            tile = chunks.tile(first_chunk + (8 * j - c0) // chunk_cols)
            pair = vector.from_elements(pair_type, [acc.element(4 * j + 2 * half).ir,
                                                    acc.element(4 * j + 2 * half + 1).ir])
            if chunks.dtype is not f32:
                pair = arith.truncf(out_type, pair)
            tile.store(r, (col % chunk_cols) ^ flip, Value(pair, chunks.dtype))


def _accumulator_layout(n) -> ThreadValueLayout:
    if not isinstance(n, int) or isinstance(n, bool) or n % 8 or not 8 <= n <= MAX_N:
        raise UnsupportedError(f"WGMMA accumulator 64x{n} is not supported",
                               fix=f"use e.g. 64x64 or 64x128 ({SUPPORTED})")
    return wgmma_m64_accumulator(n)


def _check_accumulator(acc, what: str) -> int:
    """``acc``'s N, after checking it is a 1 x 1 f32 RegTile of layout
    ``wgmma_m64_accumulator(n)``."""
    n = acc.shape[1] if isinstance(acc, RegTile) else None
    if n is None or acc.grid != (1, 1) or acc.dtype is not f32 \
            or acc.layout != wgmma_m64_accumulator(n):
        raise KilnTypeError(f"{what} needs a WGMMA accumulator (a 1 x 1 f32 RegTile of layout "
                            f"wgmma_m64_accumulator(n)), got {acc!r}",
                            fix="start from kiln.wgmma.fragment_zeros(n)")
    return n


def _a_registers(a_frag) -> list[ir.Value]:
    """The four b32 registers of a register A operand (``vector<8 x bf16/f16>``, or
    ``vector<16 x f8>``)."""
    if not isinstance(a_frag, Value) or a_frag.shape != (16 // a_frag.dtype.itemsize,) \
            or a_frag.dtype.itemsize not in (1, 2):
        raise KilnTypeError(f"a register A operand must be a vector<{A_REGISTER_VALUES} x "
                            f"bf16/f16> per thread, got {a_frag!r}",
                            fix="build it with kiln.wgmma.a_fragment_from_accumulator")
    i32 = ir.IntegerType.get_signless(32)
    packed = vector.bitcast(ir.VectorType.get([A_REGISTER_VALUES // 2], i32), a_frag.ir)
    return [vector.extract(packed, [], [i]) for i in range(A_REGISTER_VALUES // 2)]


def _check_major(what: str, major) -> None:
    if major not in MAJORS:
        raise KilnValueError(f"{what}={major!r} must be 'k' or 'mn'",
                             fix="'k' when K is the contiguous dimension, else 'mn'")


def _descriptor(desc, what: str) -> ir.Value:
    """``desc`` as the i64 matrix descriptor an MMA reads (from :func:`smem_descriptor`)."""
    value = ir_value(desc, what)
    if value.type != ir.IntegerType.get_signless(64):
        raise KilnTypeError(f"{what} must be an i64 from smem_descriptor, got {value.type}",
                            fix="build it with kiln.wgmma.smem_descriptor")
    return value


def _operand_dtype(dtype, what: str, *, fp8: bool = False) -> DType:
    operand = as_dtype(dtype)
    if operand.name not in OPERAND_DTYPES + (FP8_DTYPES if fp8 else ()):
        raise UnsupportedError(f"{what} operand dtype {operand} is not supported",
                               fix=f"use f16 or bf16 (supported: {SUPPORTED})")
    return operand


def _check_fp8_operands(a, a_major: str, b_major: str) -> None:
    """FP8 WGMMA (``m64nNk32``) reads both operands K-major (PTX ISA: the transpose
    immediates are only valid for f16/bf16); A from shared memory or from registers."""
    if a_major != "k" or b_major != "k":
        raise UnsupportedError("FP8 wgmma.mma_async needs A and B K-major "
                               f"(got A in {a_location(a)}, a_major={a_major!r}, "
                               f"b_major={b_major!r})",
                               fix="stage both operands K-major (B stored N x K, e.g. V "
                                   "transposed in shared memory) and pass shared-memory "
                                   "descriptors or FP8 register A operands")


def _scale_d(accumulate) -> ir.Value:
    """``accumulate`` (bool or traced i1) as the i32 the PTX turns into the scale-d predicate."""
    i32 = ir.IntegerType.get_signless(32)
    if isinstance(accumulate, bool):
        return arith.constant(i32, int(accumulate))
    flag = ir_value(accumulate, "accumulate")
    if flag.type != ir.IntegerType.get_signless(1):
        raise KilnTypeError(f"accumulate must be a bool or a traced boolean, got {flag.type}",
                            fix="compare first, e.g. accumulate=(k > 0)")
    return arith.extui(i32, flag)
