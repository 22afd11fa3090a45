"""Warp-group MMA (WGMMA, sm_90a): a 128-thread warp group multiplies shared-memory tiles.

Thin wrappers over upstream ``nvgpu.warpgroup.*``. Operands live in shared memory and are named
by matrix descriptors built from the tile and the TMA map that filled it (the map carries the
swizzle); the accumulator lives in registers, fragmented over the warp group.

Example (A is an M x K tile, B a K x N tile with N contiguous, both TMA-loaded with 128B swizzle)::

    acc = kiln.wgmma.accumulator(64, 64)                      # zeros, f32
    a = kiln.wgmma.descriptor(a_smem, a_map)
    b = kiln.wgmma.descriptor(b_smem, b_map)
    acc = kiln.wgmma.mma(acc, a, b, transpose_b=True)         # m64n64k16 steps over K
    kiln.wgmma.store(acc, c, (0, 0))                          # c[0:64, 0:64] = acc

For pipelined kernels the descriptor-level API below issues ``nvvm.wgmma.mma_async`` on
hand-built descriptors (K- or MN-major operands, several groups in flight): ``smem_descriptor``,
``fragment_zeros``, ``scale_rows``, ``mma_async`` + ``fence``/``commit``/``wait_group``, and
``store_fragment_swizzled`` to stage the result for a TMA store (see
``kiln/kernels/gemm/hopper.py``). ``mma_async_regs`` takes A from registers instead
(``a_fragment_layout``; ``a_fragment_from_accumulator`` turns an f32 result such as softmax
probabilities into those operands with one cast), as FlashAttention-3 does for ``P @ V``.

Supported (what upstream ``nvgpu`` lowers): ``m64nNk16`` with f16 or bf16 inputs and f32
accumulators; M a multiple of 64, N a multiple of 8 in 8..256, K a multiple of 16; operands loaded
with a 128-byte swizzle whose box rows are exactly 128 bytes (64 elements).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, memref, nvgpu, nvvm, vector

from .dtypes import DType, dtype as as_dtype, f32, from_mlir
from .errors import KilnTypeError, KilnValueError, UnsupportedError
from .nvidia.sync import as_index, ir_value, require_feature

WARPGROUP_M = 64
INSTRUCTION_K = 16
MAX_N = 256
SWIZZLE_ROW_BYTES = 128
OPERAND_DTYPES = ("f16", "bf16")
SUPPORTED = ("m64nNk16 with f16 or bf16 A/B and an f32 accumulator; M % 64 == 0, N % 8 == 0 "
             "with 8 <= N <= 256, K % 16 == 0")


class Accumulator:
    """An ``m x n`` WGMMA accumulator held in the warp group's registers."""

    def __init__(self, value: ir.Value, m: int, n: int, dtype: DType):
        self.ir, self.m, self.n, self.dtype = value, m, n, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.m, self.n)

    def __kiln_flatten__(self):
        return [self.ir], (self.m, self.n, self.dtype)

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0], *aux)


class MatrixDescriptor:
    """A WGMMA operand: a shared-memory tile of ``shape`` and ``dtype`` plus its swizzle."""

    def __init__(self, value: ir.Value, shape: tuple[int, int], dtype: DType):
        self.ir, self.shape, self.dtype = value, shape, dtype

    def __kiln_flatten__(self):
        return [self.ir], (self.shape, self.dtype)

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0], *aux)


def accumulator(m: int, n: int, dtype=f32) -> Accumulator:
    """A zero-initialised ``m x n`` accumulator (``nvgpu.warpgroup.mma.init.accumulator``)."""
    require_feature("wgmma", "kiln.wgmma.accumulator")
    acc_dtype = as_dtype(dtype)
    if acc_dtype is not f32:  # nvgpu.warpgroup.mma.store only handles f32 fragments
        raise UnsupportedError(f"WGMMA accumulator dtype {acc_dtype} is not supported",
                               fix=f"use kiln.f32 (supported: {SUPPORTED})")
    _check_mn(m, n)
    return Accumulator(nvgpu.warpgroup_mma_init_accumulator(_accumulator_type(m, n, acc_dtype)),
                       m, n, acc_dtype)


def descriptor(tile, tensor_map) -> MatrixDescriptor:
    """Describe shared tile ``tile`` (2-D, filled through ``tensor_map``) as a WGMMA operand
    (``nvgpu.warpgroup.generate.descriptor``)."""
    require_feature("wgmma", "kiln.wgmma.descriptor")
    tile_value = ir_value(tile, "shared tile")
    tile_type = tile_value.type
    if not isinstance(tile_type, ir.MemRefType) or tile_type.rank != 2 \
            or not tile_type.has_static_shape:
        raise KilnTypeError(f"WGMMA operand must be a static 2-D shared tile, got {tile_type}",
                            fix="allocate it with kiln.shared((rows, cols), dtype, align=1024)")
    element = from_mlir(tile_type.element_type)
    if element.name not in OPERAND_DTYPES:
        raise UnsupportedError(f"WGMMA operand dtype {element} is not supported",
                               fix=f"use f16 or bf16 tiles (supported: {SUPPORTED})")
    map_value = ir_value(tensor_map, "tensor map")
    _check_operand_map(tensor_map, map_value)
    # No typed getter exists in the Python bindings for nvgpu.warpgroup.descriptor.
    desc_type = ir.Type.parse(f"!nvgpu.warpgroup.descriptor<tensor = {tile_type}>")
    value = nvgpu.warpgroup_generate_descriptor(desc_type, tile_value, map_value)
    return MatrixDescriptor(value, tuple(tile_type.shape), element)


def mma(acc: Accumulator, a: MatrixDescriptor, b: MatrixDescriptor, *, transpose_a: bool = False,
        transpose_b: bool = False, wait_group: int = 0) -> Accumulator:
    """``acc + a @ b`` for ``a``: M x K, ``b``: K x N (``nvgpu.warpgroup.mma``); returns the new
    accumulator.

    ``transpose_b=True`` when B's tile is stored K x N with N contiguous (a row-major B loaded by
    TMA); ``transpose_a`` likewise for an A stored with M contiguous. The op fences, issues the
    ``m64nNk16`` steps, commits them as one group and waits until at most ``wait_group`` groups
    are pending (0: the result is ready in registers).
    """
    require_feature("wgmma", "kiln.wgmma.mma")
    for name, obj, cls in (("acc", acc, Accumulator), ("a", a, MatrixDescriptor),
                           ("b", b, MatrixDescriptor)):
        if not isinstance(obj, cls):
            raise KilnTypeError(f"kiln.wgmma.mma argument {name} must be a {cls.__name__}, got "
                                f"{type(obj).__name__}",
                                fix="build it with kiln.wgmma.accumulator / kiln.wgmma.descriptor")
    (m, k), (kb, n) = a.shape, b.shape
    if a.dtype is not b.dtype:
        raise UnsupportedError(f"WGMMA operands must share a dtype, got {a.dtype} @ {b.dtype}",
                               fix=f"convert one tile (supported: {SUPPORTED})")
    if k != kb or (m, n) != acc.shape or k % INSTRUCTION_K:
        raise UnsupportedError(f"WGMMA shapes A {m}x{k} @ B {kb}x{n} -> acc {acc.m}x{acc.n} do "
                               "not form an m64nNk16 product",
                               fix=f"use A: M x K, B: K x N, acc: M x N ({SUPPORTED})")
    if not isinstance(wait_group, int) or wait_group < 0:
        raise KilnValueError(f"wait_group must be an int >= 0, got {wait_group!r}",
                             fix="use 0 to have the result ready when mma returns")
    result = nvgpu.warpgroup_mma(acc.ir.type, a.ir, b.ir, acc.ir, wait_group=wait_group,
                                 transpose_a=True if transpose_a else None,
                                 transpose_b=True if transpose_b else None)
    return Accumulator(result, acc.m, acc.n, acc.dtype)


def store(acc: Accumulator, dst, offsets=(0, 0)) -> None:
    """Write ``acc`` to ``dst[r0:r0+M, c0:c0+N]`` (``nvgpu.warpgroup.mma.store``).

    ``dst`` is a 2-D global tensor or shared tile of the accumulator's dtype; ``offsets``
    ``(r0, c0)`` are ints or traced integers.
    """
    require_feature("wgmma", "kiln.wgmma.store")
    if not isinstance(acc, Accumulator):
        raise KilnTypeError(f"kiln.wgmma.store needs an Accumulator, got {type(acc).__name__}",
                            fix="pass the value returned by kiln.wgmma.mma")
    dst_value = ir_value(dst, "destination tensor")
    dst_type = dst_value.type
    if not isinstance(dst_type, ir.MemRefType) or dst_type.rank != 2:
        raise KilnTypeError(f"WGMMA store destination must be a 2-D tensor, got {dst_type}",
                            fix="store into a 2-D kiln.Tensor or kiln.shared tile")
    if from_mlir(dst_type.element_type) is not acc.dtype:
        raise KilnTypeError(f"cannot store a {acc.dtype} accumulator into a "
                            f"{from_mlir(dst_type.element_type)} tensor",
                            fix=f"make the output tensor {acc.dtype}")
    if len(offsets) != 2:
        raise KilnValueError(f"WGMMA store offsets must be (row, col), got {offsets!r}",
                             fix="pass two offsets, e.g. (0, 0)")
    # The op needs a destination of exactly M x N, so take a static-size window of dst.
    strides, _ = dst_type.get_strides_and_offset()
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    window_type = ir.MemRefType.get([acc.m, acc.n], dst_type.element_type,
                                    layout=ir.StridedLayoutAttr.get(dynamic, strides),
                                    memory_space=dst_type.memory_space)
    window = memref.subview(dst_value, [as_index(o, "store offset") for o in offsets],
                            [acc.m, acc.n], [1, 1], result_type=window_type)
    nvgpu.warpgroup_mma_store(acc.ir, window)


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

    ``reads``: the register A operands (:func:`mma_async_regs`) of the groups this wait
    completes. LLVM takes a WGMMA's register operands as read when it is issued, and may then
    give their registers to new values (say, the next P written while this P V is still on the
    tensor cores); ptxas answers by serialising every WGMMA of the kernel. Naming them here
    keeps them live until the wait. Example::

        o = kiln.wgmma.mma_async_regs(o, p[0], v_desc, dtype=kiln.bf16, b_major="mn")
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
        from .nvidia.wgmma import keep_registers_live

        keep_registers_live(registers)


def _check_operand_map(tensor_map, map_value: ir.Value) -> None:
    """WGMMA descriptors assume the 128B-swizzled layout with 128-byte box rows."""
    swizzle, box, dtype = (getattr(tensor_map, attr, None) for attr in ("swizzle", "box", "dtype"))
    if swizzle is None:
        # A raw descriptor value: the bindings expose no accessors, so read its swizzle from text.
        swizzle = SWIZZLE_ROW_BYTES if "swizzle = swizzle_128b" in str(map_value.type) else 0
    if swizzle != SWIZZLE_ROW_BYTES:
        raise UnsupportedError(f"WGMMA operands must be loaded with a 128-byte swizzle, got "
                               f"{map_value.type}",
                               fix="declare the operand as kiln.TensorMap[dtype, box, 128]")
    if box is not None and box[-1] * as_dtype(dtype).itemsize != SWIZZLE_ROW_BYTES:
        raise UnsupportedError(f"WGMMA operand box {tuple(box)} of {as_dtype(dtype)} has "
                               f"{box[-1] * as_dtype(dtype).itemsize}-byte rows; 128B-swizzled "
                               "operands need rows of exactly 128 bytes",
                               fix=f"use an innermost box dim of "
                                   f"{SWIZZLE_ROW_BYTES // as_dtype(dtype).itemsize}")


def _check_mn(m: int, n: int) -> None:
    if not (isinstance(m, int) and isinstance(n, int) and m > 0 and m % WARPGROUP_M == 0
            and n % 8 == 0 and 8 <= n <= MAX_N):
        raise UnsupportedError(f"WGMMA accumulator {m}x{n} is not supported",
                               fix=f"use e.g. 64x64 or 64x128 ({SUPPORTED})")


def _accumulator_type(m: int, n: int, acc_dtype: DType) -> ir.Type:
    fragment = ir.VectorType.get([m, n], acc_dtype.mlir_type())
    # No typed getter exists in the Python bindings for nvgpu.warpgroup.accumulator.
    return ir.Type.parse(f"!nvgpu.warpgroup.accumulator<fragmented = {fragment}>")


# ---------------------------------------------------------------------------------------------
# Descriptor-level WGMMA: hand-built shared-memory descriptors, asynchronous issue
# ---------------------------------------------------------------------------------------------
# ``nvgpu.warpgroup.mma`` above waits on every call and only knows K-major operands of one
# 64-column box. Pipelined kernels keep several WGMMA groups in flight and read B in either
# major order, so they build the 64-bit matrix descriptors themselves (PTX ISA, "Matrix
# Descriptor Format"; https://docs.nvidia.com/cuda/parallel-thread-execution/#asynchronous-
# warpgroup-level-matrix-shared-memory-layout-matrix-descriptor) and issue ``nvvm.wgmma.mma_async``.

SWIZZLE_128B_LAYOUT = 1  # descriptor bits 62-63: 1 = 128-byte swizzle
SWIZZLE_ATOM_BYTES = 1024  # 8 rows x 128 bytes: the repeating unit of a 128B-swizzled tile
_WGMMA_TYPES = {"f16": nvvm.WGMMATypes.f16, "bf16": nvvm.WGMMATypes.bf16}
MAJORS = ("k", "mn")


class Fragment:
    """A 64 x ``n`` f32 accumulator of :func:`mma_async`: ``n // 2`` registers per thread of the
    warp group, as an ``!llvm.struct`` (what ``nvvm.wgmma.mma_async`` reads and writes).

    Element ``i`` of thread ``t`` (warp ``w = t // 32``, lane ``l = t % 32``) holds
    ``D[16*w + l//4 + 8*((i//2) % 2), 8*(i//4) + 2*(l%4) + i%2]`` — the accumulator layout
    of ``kiln.layout.wgmma_m64_accumulator(n)``.
    """

    def __init__(self, value: ir.Value, n: int):
        self.ir, self.n = value, n

    def __kiln_flatten__(self):
        return [self.ir], self.n

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0], aux)

    def element(self, i: int):
        """Register ``i`` (0 <= i < n // 2) of this thread, as a ``kiln.Value`` f32."""
        from .values import Value

        return Value(llvm.extractvalue(f32.mlir_type(), self.ir, [i]), f32)


def fragment_to_tile(acc: Fragment):
    """``acc`` as a 1 x 1 :class:`~kiln.tiles.RegTile` of layout
    :func:`~kiln.layout.wgmma_m64_accumulator` (same registers, same order), so tile-level code
    (row reductions, ``OnlineSoftmax``) can work on WGMMA results.
    Example: ``s = fragment_to_tile(scores); m = s.row_max()``.
    """
    from .layout import wgmma_m64_accumulator
    from .reg_tile import RegTile
    from .values import Value

    if not isinstance(acc, Fragment):
        raise KilnTypeError(f"fragment_to_tile needs a kiln.wgmma.Fragment, got "
                            f"{type(acc).__name__}", fix="pass the result of mma_async")
    width = acc.n // 2
    vector_type = ir.VectorType.get([width], f32.mlir_type())
    packed = vector.from_elements(vector_type, [acc.element(i).ir for i in range(width)])
    return RegTile([Value(packed, f32)], wgmma_m64_accumulator(acc.n), (1, 1))


def fragment_from_tile(tile) -> Fragment:
    """The :class:`Fragment` holding a 1 x 1 f32 RegTile of layout ``wgmma_m64_accumulator``
    (the inverse of :func:`fragment_to_tile`), ready for :func:`mma_async` or
    :func:`store_fragment_swizzled`. Example: ``acc = fragment_from_tile(o_tile)``."""
    from .layout import wgmma_m64_accumulator
    from .reg_tile import RegTile
    from .values import Value

    n = tile.shape[1] if isinstance(tile, RegTile) else None
    if n is None or tile.grid != (1, 1) or tile.dtype is not f32 \
            or tile.layout != wgmma_m64_accumulator(n):
        raise KilnTypeError(f"fragment_from_tile needs a 1 x 1 f32 RegTile of layout "
                            f"wgmma_m64_accumulator(n), got {tile!r}",
                            fix="build it with kiln.wgmma.fragment_to_tile")
    packed = tile.fragment(0, 0).ir
    return fragment_from_elements([Value(vector.extract(packed, [], [i]), f32)
                                   for i in range(n // 2)])


def fragment_from_elements(values) -> Fragment:
    """The 64 x ``2 * len(values)`` accumulator whose register ``i`` is ``values[i]`` (f32
    ``kiln.Value`` s, in :meth:`Fragment.element` order): elementwise work on an accumulator
    (softmax on WGMMA scores, rescaling an output) reads elements, computes, and rebuilds.
    Example: ``acc = fragment_from_elements([acc.element(i) * 2.0 for i in range(acc.n // 2)])``.
    """
    require_feature("wgmma", "kiln.wgmma.fragment_from_elements")
    values = list(values)
    _check_mn(WARPGROUP_M, 2 * len(values))
    f32_type = f32.mlir_type()
    value = llvm.mlir_undef(llvm.StructType.get_literal([f32_type] * len(values)))
    for i, element in enumerate(values):
        element_ir = ir_value(element, "fragment element")
        if element_ir.type != f32_type:
            raise KilnTypeError(f"fragment element {i} must be f32, got {element_ir.type}",
                                fix="kiln.cast the value to kiln.f32 first")
        value = llvm.insertvalue(value, element_ir, [i])
    return Fragment(value, 2 * len(values))


def scale_rows(acc: Fragment, factors) -> Fragment:
    """``acc`` with each of the thread's two rows multiplied by its factor: ``factors[0]`` for
    row ``16*w + l//4``, ``factors[1]`` for row ``+ 8`` (register ``i`` is on row
    ``(i // 2) % 2``, see :class:`Fragment`). The online-softmax rescale of an output ``O``
    whose width differs from the score tile's; call it before the :func:`fence` of the next
    product that reads ``acc``, not while an earlier group is in flight (ptxas then serialises
    every WGMMA). Example: ``o = kiln.wgmma.scale_rows(o, [alpha_top, alpha_bottom])``."""
    _check_accumulator(acc, "scale_rows")
    if len(factors) != 2:
        raise KilnValueError(f"scale_rows needs 2 factors (the thread's two rows), got "
                             f"{len(factors)}", fix="pass [top_row_factor, bottom_row_factor]")
    return fragment_from_elements([acc.element(i) * factors[(i // 2) % 2]
                                   for i in range(acc.n // 2)])


def fragment_zeros(n: int) -> Fragment:
    """A zero 64 x ``n`` accumulator for :func:`mma_async` (n a multiple of 8 up to 256)."""
    require_feature("wgmma", "kiln.wgmma.fragment_zeros")
    _check_mn(WARPGROUP_M, n)
    f32_type = f32.mlir_type()
    struct = llvm.StructType.get_literal([f32_type] * (n // 2))
    value = llvm.mlir_undef(struct)
    zero = arith.constant(f32_type, 0.0)
    for i in range(n // 2):
        value = llvm.insertvalue(value, zero, [i])
    return Fragment(value, n)


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
    from .values import Value

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


def mma_async(acc: Fragment, a_desc, b_desc, *, dtype, a_major: str = "k",
              b_major: str = "k") -> Fragment:
    """Issue one ``wgmma.mma_async.m64nNk16`` (f32 += ``dtype`` x ``dtype``): ``acc += A @ B``
    with A (64 x 16) and B (16 x N) read through descriptors; returns the new accumulator.

    Asynchronous: bracket the issues with :func:`fence` before and :func:`commit` after, then
    :func:`wait_group` before reading ``acc`` or overwriting the operands' shared memory.
    ``b_major="mn"`` reads B stored with N contiguous (a row-major K x N matrix).

    Example::

        kiln.wgmma.fence()
        for k in kiln.static_range(4):
            acc = kiln.wgmma.mma_async(acc, a_desc + 2 * k, b_desc + 128 * k, dtype=kiln.bf16,
                                       b_major="mn")
        kiln.wgmma.commit()
    """
    require_feature("wgmma", "kiln.wgmma.mma_async")
    _check_accumulator(acc, "mma_async")
    name = _operand_dtype(dtype, "mma_async").name
    _check_major("a_major", a_major)
    _check_major("b_major", b_major)
    descs = [_descriptor(a_desc, "A descriptor"), _descriptor(b_desc, "B descriptor")]
    # No typed getter exists in the Python bindings for #nvvm.shape.
    shape = ir.Attribute.parse(f"#nvvm.shape<m = {WARPGROUP_M}, n = {acc.n}, k = "
                               f"{INSTRUCTION_K}>")
    kind = _WGMMA_TYPES[name]
    # NVVM spells operand order as layouts: A "row" and B "col" are K-major (no transpose).
    layout_a = nvvm.MMALayout.row if a_major == "k" else nvvm.MMALayout.col
    layout_b = nvvm.MMALayout.col if b_major == "k" else nvvm.MMALayout.row
    result = nvvm.wgmma_mma_async(acc.ir.type, acc.ir, descs[0], descs[1], shape, kind, kind,
                                  nvvm.WGMMATypes.f32, nvvm.WGMMAScaleOut.one,
                                  nvvm.WGMMAScaleIn.one, nvvm.WGMMAScaleIn.one, layout_a, layout_b)
    return Fragment(result, acc.n)


def store_fragment_swizzled(acc: Fragment, chunks, first_chunk, *, columns=None) -> None:
    """Stage ``acc`` (converted to ``chunks``' dtype) in shared memory for a TMA store.

    ``chunks`` is a :func:`kiln.dynamic_shared` buffer of 64 x ``128 / itemsize`` tiles laid out
    with the 128-byte swizzle (what a ``kiln.TensorMap[dtype, (64, 128 / itemsize), 128]``
    store reads): column ``col`` of ``columns = (c0, c1)`` (default all) goes to tile
    ``first_chunk + (col - c0) // chunk_cols``, row ``r``, column
    ``(col % chunk_cols) ^ (8 * (r % 8) * 2 // itemsize)``. The swizzle keeps the 32 lanes'
    stores on distinct banks. Call from all 128 threads of the warp group.
    Example: ``store_fragment_swizzled(acc, c_tiles, group * 4)`` then ``kiln.tma.store``.
    """
    from .ops import thread_id
    from .values import Value

    require_feature("wgmma", "kiln.wgmma.store_fragment_swizzled")
    itemsize = chunks.dtype.itemsize
    chunk_cols = SWIZZLE_ROW_BYTES // itemsize
    if tuple(chunks.shape[1:]) != (WARPGROUP_M, chunk_cols):
        raise KilnValueError(f"staging tiles must be {WARPGROUP_M} x {chunk_cols} "
                             f"{chunks.dtype}, got {chunks.shape[1:]}",
                             fix=f"allocate dynamic_shared((n, {WARPGROUP_M}, {chunk_cols}), ...)")
    c0, c1 = columns if columns is not None else (0, acc.n)
    if c0 % chunk_cols or c1 % chunk_cols or not 0 <= c0 < c1 <= acc.n:
        raise KilnValueError(f"columns {columns} must be whole {chunk_cols}-column chunks of "
                             f"0..{acc.n}", fix=f"use multiples of {chunk_cols}")
    lane_in_group = thread_id(0) % 128
    warp, lane = lane_in_group // 32, lane_in_group % 32
    row = warp * 16 + lane // 4
    unit = 16 // itemsize  # elements per 16-byte swizzle unit
    pair_type = ir.VectorType.get([2], f32.mlir_type())
    out_type = ir.VectorType.get([2], chunks.dtype.mlir_type())
    for half in range(2):
        r = row + 8 * half
        flip = (r % 8) * unit
        for j in range(c0 // 8, c1 // 8):
            col = 8 * j + 2 * (lane % 4)
            tile = chunks.tile(first_chunk + (8 * j - c0) // chunk_cols)
            pair = vector.from_elements(pair_type, [acc.element(4 * j + 2 * half).ir,
                                                    acc.element(4 * j + 2 * half + 1).ir])
            if chunks.dtype is not f32:
                pair = arith.truncf(out_type, pair)
            tile.store(r, (col % chunk_cols) ^ flip, Value(pair, chunks.dtype))


# ---------------------------------------------------------------------------------------------
# WGMMA with A from registers (FlashAttention-3's P @ V)
# ---------------------------------------------------------------------------------------------
# ``wgmma.mma_async`` also reads A from four b32 registers per thread instead of a descriptor,
# so a softmax computed in registers feeds the next product without a trip through shared
# memory. Upstream ``nvvm.wgmma.mma_async`` only takes descriptors: the PTX is inline asm in
# :func:`kiln.nvidia.wgmma.wgmma_mma_async_regs`.

A_REGISTER_VALUES = 8  # 64 x 16 A tile over 128 threads: 8 elements = 4 packed b32 registers


def a_fragment_layout():
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
    from .layout import wgmma_m64_accumulator

    return wgmma_m64_accumulator(INSTRUCTION_K)


def a_fragment_from_accumulator(acc, dtype) -> list:
    """Convert a 64 x ``n`` f32 accumulator (a :class:`Fragment` or its
    :func:`fragment_to_tile` RegTile, e.g. ``P = softmax(S)``) to ``dtype`` with one bulk cast
    and split it into the ``n // 16`` A operands of :func:`mma_async_regs`: element ``j`` is
    ``vector<8 x dtype>`` holding columns ``16j .. 16j+15`` in :func:`a_fragment_layout` order
    (accumulator registers ``8j .. 8j+7`` are exactly that fragment, so no data moves).

    Example: ``p = a_fragment_from_accumulator(s, kiln.bf16)`` then
    ``o = mma_async_regs(o, p[j], v_desc_j, dtype=kiln.bf16, b_major="mn")`` per 16 keys.
    """
    from .layout import wgmma_m64_accumulator
    from .reg_tile import RegTile
    from .values import Value, cast

    require_feature("wgmma", "kiln.wgmma.a_fragment_from_accumulator")
    out_dtype = _operand_dtype(dtype, "a_fragment_from_accumulator")
    if isinstance(acc, Fragment):
        n = acc.n
        width = n // 2
        packed = Value(vector.from_elements(ir.VectorType.get([width], f32.mlir_type()),
                                            [acc.element(i).ir for i in range(width)]), f32)
    elif isinstance(acc, RegTile) and acc.grid == (1, 1) and acc.dtype is f32 \
            and acc.layout == wgmma_m64_accumulator(acc.shape[1]):
        n, packed = acc.shape[1], acc.fragment(0, 0)
    else:
        raise KilnTypeError(f"a_fragment_from_accumulator needs a kiln.wgmma.Fragment or a "
                            f"1 x 1 f32 RegTile of layout wgmma_m64_accumulator(n), got {acc!r}",
                            fix="pass the mma_async result (or fragment_to_tile of it)")
    if n % INSTRUCTION_K:
        raise UnsupportedError(f"a 64 x {n} accumulator does not split into 16-column A "
                               "operands", fix="use an accumulator whose N is a multiple of 16")
    converted = cast(packed, out_dtype)
    return [Value(vector.shuffle(converted.ir, converted.ir,
                                 list(range(A_REGISTER_VALUES * j, A_REGISTER_VALUES * (j + 1)))),
                  out_dtype) for j in range(n // INSTRUCTION_K)]


def _a_registers(a_frag) -> list[ir.Value]:
    """The four b32 registers of a register A operand (``vector<8 x bf16/f16>``)."""
    from .values import Value

    if not isinstance(a_frag, Value) or a_frag.shape != (A_REGISTER_VALUES,) \
            or a_frag.dtype.itemsize != 2:
        got = repr(a_frag) if isinstance(a_frag, Value) else type(a_frag).__name__
        raise KilnTypeError(f"a register A operand must be a vector<{A_REGISTER_VALUES} x "
                            f"bf16/f16> per thread, got {got}",
                            fix="build it with kiln.wgmma.a_fragment_from_accumulator")
    i32 = ir.IntegerType.get_signless(32)
    packed = vector.bitcast(ir.VectorType.get([A_REGISTER_VALUES // 2], i32), a_frag.ir)
    return [vector.extract(packed, [], [i]) for i in range(A_REGISTER_VALUES // 2)]


def mma_async_regs(acc: Fragment, a_frag, b_desc, *, dtype, b_major: str = "k",
                   accumulate=True) -> Fragment:
    """Issue one ``wgmma.mma_async.m64nNk16`` with A from registers: ``acc += A @ B`` where A
    (64 x 16) is this warp group's ``a_frag`` (``vector<8 x dtype>`` laid out as
    :func:`a_fragment_layout`) and B (16 x N) is read through descriptor ``b_desc``
    (:func:`smem_descriptor`; ``b_major="mn"`` for B stored with N contiguous).

    ``accumulate=False`` (or a traced boolean that is false) computes ``A @ B`` and ignores
    ``acc``'s values. Asynchronous like :func:`mma_async`: :func:`fence` first (it also orders
    the writes of ``a_frag``'s registers), :func:`commit` and :func:`wait_group` after; do not
    touch ``acc`` or ``a_frag`` in between.

    Example (FlashAttention-3's O += P @ V, V stored keys x depth with depth contiguous)::

        p = kiln.wgmma.a_fragment_from_accumulator(s, kiln.bf16)   # 64 x 64 P: 4 A operands
        kiln.wgmma.fence()
        for j in kiln.static_range(4):
            o = kiln.wgmma.mma_async_regs(o, p[j], v_desc + 128 * j, dtype=kiln.bf16,
                                          b_major="mn")
        kiln.wgmma.commit()
    """
    from .nvidia.wgmma import wgmma_mma_async_regs
    from .values import Value

    require_feature("wgmma", "kiln.wgmma.mma_async_regs")
    _check_accumulator(acc, "mma_async_regs")
    operand = _operand_dtype(dtype, "mma_async_regs")
    if not isinstance(a_frag, Value) or a_frag.dtype is not operand \
            or a_frag.shape != (A_REGISTER_VALUES,):
        got = repr(a_frag) if isinstance(a_frag, Value) else type(a_frag).__name__
        raise KilnTypeError(f"mma_async_regs A operand must be a vector<{A_REGISTER_VALUES}x"
                            f"{operand}> per thread, got {got}",
                            fix="build it with kiln.wgmma.a_fragment_from_accumulator")
    _check_major("b_major", b_major)
    b_value = _descriptor(b_desc, "B descriptor")
    result = wgmma_mma_async_regs([acc.element(i).ir for i in range(acc.n // 2)],
                                  _a_registers(a_frag),
                                  b_value, _scale_d(accumulate), ptx_type=operand.name,
                                  trans_b=int(b_major == "mn"))
    return Fragment(result, acc.n)


def _check_accumulator(acc, what: str) -> None:
    if not isinstance(acc, Fragment):
        raise KilnTypeError(f"{what} needs a kiln.wgmma.Fragment accumulator, got "
                            f"{type(acc).__name__}", fix="start from kiln.wgmma.fragment_zeros(n)")


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


def _operand_dtype(dtype, what: str) -> DType:
    operand = as_dtype(dtype)
    if operand.name not in OPERAND_DTYPES:
        raise UnsupportedError(f"{what} operand dtype {operand} is not supported",
                               fix=f"use f16 or bf16 (supported: {SUPPORTED})")
    return operand


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
