"""Grouped (MoE) GEMM on Hopper: one persistent launch over the tiles of every group.

``C[offs[g]:offs[g+1]] = A[offs[g]:offs[g+1]] @ B[g]`` for ``g < G``: ``A`` holds the rows of
all groups back to back (``[total_M, K]``), ``B`` one ``K x N`` matrix per group (``[G, K, N]``,
or ``[G, N, K]`` with ``trans_b``), ``group_offsets`` the ``G + 1`` row boundaries. The main loop
is the Hopper GEMM's (:mod:`.hopper`: TMA ring, warp-specialised producer, two WGMMA consumer
warp groups, 128B-swizzled operands); what differs is which tile a CTA works on and how its
rows are stored.

| phase | who | what |
| --- | --- | --- |
| tile table | all threads, then thread 0 | thread ``i`` reads ``offs[i], offs[i+1]`` and writes group ``i``'s tile count ``ceil(M_i / BM) * ceil(N / BN)`` to a shared table (``TABLE`` entries, a power of two above ``G``; the rest a sentinel); thread 0 turns the counts into first-tile indices (an exclusive prefix sum); no host round trip, so device ``group_offsets`` need no synchronisation |
| tile walk | every warp group | global tiles ``t = cta, cta + grid, ...`` up to the total; ``t``'s group is the last table entry ``<= t`` (a binary search of ``log2(TABLE)`` shared loads); within the group the tiles are swept column by column, ``GROUP_M`` row tiles at a time (:func:`.hopper._tile_origin`) |
| producer | warp group 0, one thread | A box at row ``offs[g] + m``: its last tile reads rows of the next group, which only reach output rows that are not stored; B box at row ``g * b_rows`` of B viewed as ``[G * rows, cols]`` |
| consumers | warp groups 1, 2 | WGMMA as in :mod:`.hopper`, except that a consumer whose 64 rows all lie past its group's end (in the group's last tile) only waits for each stage and releases it, so the other consumer has the tensor cores: a group pads to 64 rows, not 128; the epilogue stages 64-row slices in swizzled shared tiles, and a slice that lies inside its group (or runs past ``total_M``, which TMA clips) leaves by TMA store, the group's last, partial slice by masked 16-byte stores of the rows ``< offs[g+1]`` |

B's K edge: with B MN-major (``[G, K, N]``) a box past row ``K`` of group ``g`` would read group
``g + 1``'s rows (A's columns there are zero, but ``0 * inf`` is NaN), so the entry point pads
K to a multiple of ``BK`` for B in that case. Unchecked device offsets that are not monotone or
exceed ``total_M`` give meaningless rows but never a write outside ``C``: tile counts are
clamped at zero, TMA clips its stores, and the masked stores check ``0 <= row < total_M``.
"""

import functools

import numpy as np

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma

from .hopper import (K_STEP, ROW_BYTES, SWIZZLE, SWIZZLE_ALIGN, WARP_GROUP_THREADS,
                     HopperGemmConfig, _tile_origin)
from kiln.shared import dynamic_shared

MAX_GROUPS = 1024
MIN_TABLE = 64  # fewer table sizes, fewer specialisations
SENTINEL = 1 << 30  # table entries past G: above every tile index
UNIT_BYTES = 16  # one swizzle unit: what a masked store writes at a time


def table_size(groups: int) -> int:
    """Entries of the shared tile table for ``groups`` groups: a power of two > ``groups``."""
    size = MIN_TABLE
    while size <= groups:
        size *= 2
    return size


def grouped_config(groups: int) -> HopperGemmConfig:
    """The tile configuration for ``groups`` groups: the dense GEMM's default, or 3 stages
    when the tile table (4 bytes an entry) would not fit beside 4."""
    return HopperGemmConfig() if table_size(groups) <= 256 else HopperGemmConfig(stages=3)


@functools.lru_cache(maxsize=None)
def make_grouped_kernel(dtype: str, out_dtype: str, b_major: str, config: HopperGemmConfig):
    """The ``@kiln.kernel`` of the grouped GEMM (single CTAs: ``config.cluster_m`` must be 1).

    Run-time parameters: ``a_map`` (A ``[total_M, K]``, box BM x BK), ``b_map`` (B viewed as
    ``[G * b_rows, cols]``), ``c_map`` (C, box 64 x 128 bytes), ``c`` (C again, for the masked
    stores), ``offsets`` (i32 ``[G + 1]``), ``groups``, ``m`` (total_M), ``n``, ``k``,
    ``b_rows`` (rows of one group's B in that view: padded K for "mn", padded N for "k").
    """
    if config.cluster_m != 1:
        raise kiln.UnsupportedError("the grouped GEMM runs single CTAs",
                                    fix="use a HopperGemmConfig with cluster_m=1")
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    b_box = (bk, 64) if b_major == "mn" else (bn, bk)
    chunks = bn // 64 if b_major == "mn" else 1
    b_leading = bk * ROW_BYTES if b_major == "mn" else 16
    b_k_step = K_STEP * ROW_BYTES if b_major == "mn" else K_STEP * in_type.itemsize
    c_cols = ROW_BYTES // out_type.itemsize
    epilogue_n = config.epilogue_columns(out_type.itemsize)
    c_tiles_per_round = epilogue_n // c_cols
    threads = WARP_GROUP_THREADS * (config.consumers + 1)

    def b_coords(k0, n0, row0):  # TMA coordinates, innermost first
        return (n0, row0 + k0) if b_major == "mn" else (k0, row0 + n0)

    def grouped_gemm(a_map: kiln.TensorMap[in_type, (bm, bk), SWIZZLE],
                     b_map: kiln.TensorMap[in_type, b_box, SWIZZLE],
                     c_map: kiln.TensorMap[out_type, (64, c_cols), SWIZZLE],
                     c: kiln.Tensor[out_type, 2], offsets: kiln.Tensor[kiln.i32, 1],
                     groups: kiln.i32, m: kiln.i32, n: kiln.i32, k: kiln.i32, b_rows: kiln.i32,
                     BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
                     STAGES: kiln.constexpr, GROUP_M: kiln.constexpr,
                     PRODUCER_REGS: kiln.constexpr, CONSUMER_REGS: kiln.constexpr,
                     TABLE: kiln.constexpr):
        a_tiles = dynamic_shared((STAGES, BM, BK), in_type, align=SWIZZLE_ALIGN)
        b_tiles = dynamic_shared((STAGES * chunks,) + b_box, in_type, align=SWIZZLE_ALIGN)
        c_tiles = dynamic_shared((BM // 64 * c_tiles_per_round, 64, c_cols), out_type,
                                 align=SWIZZLE_ALIGN)
        table = kiln.shared((TABLE,), kiln.i32)
        full = mbarrier.group(num_barriers=STAGES)
        empty = mbarrier.group(num_barriers=STAGES)
        tid = kiln.thread_id(0)
        warp_group = tid // WARP_GROUP_THREADS
        first_thread = tid % WARP_GROUP_THREADS == 0
        for s in kiln.static_range(STAGES):
            full.init(s, count=1, predicate=tid == 0)
            empty.init(s, count=BM // 64, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        tiles_n = (n + BN - 1) // BN
        _build_tile_table(table, offsets, groups, tiles_n, tid, BM, TABLE, threads)
        num_tiles = table[groups]
        k_tiles = (k + BK - 1) // BK
        first_tile = kiln.block_id(0)
        tile_step = kiln.num_blocks(0)
        stage_bytes = tma.box_bytes(a_map) + chunks * tma.box_bytes(b_map)
        if warp_group == 0:
            nvidia_asm.setmaxnreg(PRODUCER_REGS, increase=False)
            if tid == 0:
                tma.prefetch_descriptor(a_map)
                tma.prefetch_descriptor(b_map)
                use = 0
                for tile in kiln.range(first_tile, num_tiles, tile_step):
                    g, m0, n0, row_end = _locate_tile(table, offsets, tile, tiles_n, BM, BN,
                                                      GROUP_M, TABLE)
                    for kt in kiln.range(0, k_tiles):
                        stage = use % STAGES
                        empty.try_wait(stage, (use // STAGES) % 2 ^ 1)
                        full.arrive_expect_tx(stage, stage_bytes)
                        tma.load(a_map, a_tiles.tile(stage), (kt * BK, m0), full, stage)
                        for j in kiln.static_range(chunks):
                            tma.load(b_map, b_tiles.tile(stage * chunks + j),
                                     b_coords(kt * BK, n0 + 64 * j, g * b_rows), full, stage)
                        use = use + 1
        else:
            nvidia_asm.setmaxnreg(CONSUMER_REGS, increase=True)
            consumer = warp_group - 1
            a_base = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                           byte_offset=consumer * 64 * ROW_BYTES)
            b_base = wgmma.smem_descriptor(b_tiles.tile(0), leading_bytes=b_leading,
                                           stride_bytes=1024)
            a_stage_units = BM * BK * in_type.itemsize // 16  # descriptor address units
            b_stage_units = BN * BK * in_type.itemsize // 16
            use = 0
            for tile in kiln.range(first_tile, num_tiles, tile_step):
                g, m0, n0, row_end = _locate_tile(table, offsets, tile, tiles_n, BM, BN,
                                                  GROUP_M, TABLE)
                row0 = m0 + consumer * 64
                # In a group's last tile the lower 64 rows may all lie past its end: that
                # consumer only passes the stages on, leaving the tensor cores to the other.
                active = row0 < row_end
                acc = wgmma.fragment_zeros(BN)
                if active:
                    for kt in kiln.range(0, k_tiles):
                        stage = use % STAGES
                        full.try_wait(stage, (use // STAGES) % 2)
                        stage64 = kiln.cast(stage, kiln.i64)
                        a_desc = a_base + stage64 * a_stage_units
                        b_desc = b_base + stage64 * b_stage_units
                        wgmma.fence()
                        for ks in kiln.static_range(BK // K_STEP):
                            acc = wgmma.mma_async(acc,
                                                  a_desc + ks * K_STEP * in_type.itemsize // 16,
                                                  b_desc + ks * b_k_step // 16, dtype=in_type,
                                                  b_major=b_major)
                        wgmma.commit()
                        wgmma.wait_group(1)
                        if (kt > 0) & first_thread:
                            empty.arrive((use + STAGES - 1) % STAGES)
                        use = use + 1
                    wgmma.wait_group(0)
                    if first_thread & (k_tiles > 0):
                        empty.arrive((use + STAGES - 1) % STAGES)
                    _store_group_tile(acc, c_map, c, c_tiles, consumer, row0, n0,
                                      kiln.minimum(row_end, m), n, first_thread,
                                      BN // epilogue_n, c_tiles_per_round, c_cols)
                else:
                    for kt in kiln.range(0, k_tiles):
                        stage = use % STAGES
                        full.try_wait(stage, (use // STAGES) % 2)
                        if first_thread:
                            empty.arrive(stage)
                        use = use + 1
            if first_thread:
                tma.wait_group(0, read=True)  # the staging tiles must outlive the last store

    grouped_gemm.__name__ = grouped_gemm.__qualname__ = \
        f"hopper_grouped_gemm_{dtype}_{out_dtype}_{b_major}"
    return kiln.kernel(grouped_gemm)


@kiln.func
def _build_tile_table(table, offsets, groups, tiles_n, tid, BM, TABLE, THREADS):
    """``table[g]`` = index of group ``g``'s first tile for ``g <= groups`` (``table[groups]``
    is the total), ``SENTINEL`` past it. Every thread of the CTA calls it; it ends in a
    barrier, after which the table is read-only."""
    for i in kiln.range(tid, TABLE, THREADS):
        rows = offsets.load(i + 1, mask=i < groups, other=0) - \
            offsets.load(i, mask=i < groups, other=0)
        count = kiln.maximum(rows + BM - 1, 0) // BM * tiles_n
        table[i] = kiln.where(i > groups, SENTINEL, count)
    kiln.barrier()
    if tid == 0:
        start = 0
        for i in kiln.range(0, groups + 1):
            tiles = table[i]
            table[i] = start
            start = start + tiles
    kiln.barrier()


@kiln.func
def _locate_tile(table, offsets, tile, tiles_n, BM, BN, GROUP_M, TABLE):
    """(group, first row in A/C, first column, the group's end row) of global tile ``tile``:
    the group is the last table entry ``<= tile`` (empty groups share their start with the
    next group, so the search passes over them)."""
    g = tile * 0
    for level in kiln.static_range(TABLE.bit_length() - 1):
        probe = g + (TABLE >> (level + 1))
        g = kiln.where(table[probe] <= tile, probe, g)
    row_start = offsets[g]
    row_end = offsets[g + 1]
    tiles_m = (row_end - row_start + BM - 1) // BM
    m_local, n0 = _tile_origin(tile - table[g], tiles_m, tiles_n, BM, BN, GROUP_M)
    return g, row_start + m_local, n0, row_end


@kiln.func
def _store_group_tile(acc, c_map, c, c_tiles, consumer, row0, col0, row_end, n, first_thread,
                      rounds, tiles_per_round, tile_cols):
    """Epilogue of one consumer's 64 rows: stage ``acc`` in swizzled shared tiles as
    :func:`.hopper._store_tile` does; rows that all lie before ``row_end`` (the group's end,
    capped at total_M) leave by TMA store (which clips C's edges), a slice that straddles
    ``row_end`` by masked 16-byte stores of its rows before it."""
    columns = tiles_per_round * tile_cols
    whole = row0 + 64 <= row_end
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    row = lane // 2  # two threads per staged row, four 16-byte units each
    unit = UNIT_BYTES // c.dtype.itemsize  # elements of one swizzle unit
    in_rows = (row0 + row < row_end) & (row0 + row >= 0)
    for r in kiln.static_range(rounds):
        if first_thread:
            tma.wait_group(0, read=True)
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
        wgmma.store_fragment_swizzled(acc, c_tiles, consumer * tiles_per_round,
                                      columns=(r * columns, (r + 1) * columns))
        nvidia_asm.fence_proxy_async()  # generic-proxy writes before the async-proxy TMA read
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
        if whole:
            if first_thread:
                for j in kiln.static_range(tiles_per_round):
                    tma.store(c_tiles.tile(consumer * tiles_per_round + j), c_map,
                              (col0 + r * columns + j * tile_cols, row0))
                tma.commit_group()
        else:
            for j in kiln.static_range(tiles_per_round):
                staged = c_tiles.tile(consumer * tiles_per_round + j)
                for q in kiln.static_range(ROW_BYTES // UNIT_BYTES // 2):
                    u = (lane % 2) * (ROW_BYTES // UNIT_BYTES // 2) + q
                    col = col0 + r * columns + j * tile_cols + u * unit
                    values = staged.load(row, (u ^ (row % 8)) * unit, width=unit,
                                         align=UNIT_BYTES)
                    if in_rows & (col < n):
                        c.store(row0 + row, col, values, align=UNIT_BYTES)


# ---------------------------------------------------------------------------------------------
# Host entry points
# ---------------------------------------------------------------------------------------------

FP8_DTYPES = ("f8e4m3", "f8e5m2", "f8e4m3fn", "f8e4m3fnuz", "f8e5m2fnuz")
FP8_UNSUPPORTED = "FP8 grouped GEMM is not supported yet"


def compile_grouped_matmul(dtype, *, target, out_dtype=None, trans_b=False, groups=8):
    """Compile (without running) the grouped GEMM for ``dtype`` inputs and ``groups`` groups
    (which sets the tile table's size) on ``target``; returns the ``CompiledKernel``.
    Example: ``compile_grouped_matmul("bf16", target="sm_90a").asm["ptx"]``."""
    from ..inputs import resolve_target
    from . import _output_dtype

    chip = resolve_target(target)
    name = _grouped_input_dtype(dtype)
    _require_hopper(chip)
    out = _output_dtype(out_dtype, "bf16")
    cfg = grouped_config(groups)
    placeholder = np.empty((1, 1), kiln.dtype(name).numpy)
    c = np.empty((1, 1), kiln.dtype(out).numpy)
    offsets = np.zeros(groups + 1, np.int32)
    return make_grouped_kernel(name, out, "k" if trans_b else "mn", cfg).compile(
        placeholder, placeholder, c, c, offsets, groups, 1, 1, 1, 1, target=chip.name,
        num_warps=cfg.num_warps, **_grouped_constexprs(cfg, groups))


def grouped_matmul(a, b, group_offsets, *, trans_b=False, scale_a=None, scale_b=None,
                   out_dtype=None, target=None, backend=None, validate=False):
    """Grouped (MoE) GEMM: ``c[o[g]:o[g+1]] = a[o[g]:o[g+1]] @ b[g]`` for every group ``g``
    (``@ b[g].T`` with ``trans_b``), ``o = group_offsets``, in one persistent launch.

    ``a`` is ``[total_M, K]`` (the rows of all groups back to back), ``b`` ``[G, K, N]``
    (``[G, N, K]`` with ``trans_b``), ``group_offsets`` int32 ``[G + 1]``: non-decreasing, from
    0 to ``total_M`` (empty groups allowed), ``G <= 1024``. Inputs are bf16 or f16 (f32
    accumulation); the output is bf16 unless ``out_dtype`` says otherwise (bf16, f16, f32).
    ``scale_a`` / ``scale_b`` and FP8 inputs are accepted by the signature but raise
    :class:`kiln.UnsupportedError` ("FP8 grouped GEMM is not supported yet").

    torch CUDA tensors run asynchronously on the current stream and return a torch tensor;
    numpy arrays are copied to the device and back (or, with ``backend="interpret"``, run in
    Kiln's CPU interpreter). ``group_offsets`` of numpy are always checked; torch tensors only
    with ``validate=True`` (one device-side reduction and one synchronisation), so that an
    unchecked call never synchronises and can be captured in a CUDA graph: unchecked bad
    offsets give meaningless rows but no write outside ``c`` (see ``docs/kernels.md``).
    Runs on sm_90a (Hopper WGMMA); AMD targets raise :class:`kiln.UnsupportedError`.

    Example::

        offs = torch.tensor([0, 300, 300, 1024], dtype=torch.int32, device="cuda")
        c = grouped_matmul(tokens, expert_weights, offs)   # [1024, K] x [3, K, N] -> [1024, N]
    """
    from ..inputs import Dims, check_backend, dtype_of, empty_like, is_torch, resolve_target
    from . import _empty_like, _output_dtype

    chip = resolve_target(target)
    if scale_a is not None or scale_b is not None:
        raise kiln.UnsupportedError(f"{FP8_UNSUPPORTED} (scale_a / scale_b were given)",
                                    fix="pass bf16 or f16 operands without scales")
    dims = Dims()
    dims.tensor("a", a, "total_M K")
    dims.tensor("b", b, "G N K" if trans_b else "G K N")
    dims.tensor("group_offsets", group_offsets, "G_plus_1")
    name = _grouped_input_dtype(dtype_of("a", a), "a")
    if _grouped_input_dtype(dtype_of("b", b), "b") != name:
        raise kiln.KilnTypeError(f"grouped_matmul operands must share a dtype, got a: {name} "
                                 f"and b: {dtype_of('b', b).name}",
                                 fix="convert one operand first")
    if dtype_of("group_offsets", group_offsets) is not kiln.i32:
        raise kiln.KilnTypeError(f"group_offsets must be int32, got "
                                 f"{dtype_of('group_offsets', group_offsets)}",
                                 fix="convert it, e.g. offsets.astype(np.int32) / "
                                     ".to(torch.int32)")
    groups, total_m, k, n = dims["G"], dims["total_M"], dims["K"], dims["N"]
    if dims["G_plus_1"] != groups + 1:
        raise kiln.KilnValueError(f"group_offsets has {dims['G_plus_1']} entries, but b holds "
                                  f"G={groups} groups (G + 1 entries expected)",
                                  fix="pass the G + 1 row boundaries, starting with 0")
    if groups > MAX_GROUPS:
        raise kiln.UnsupportedError(f"grouped_matmul supports at most {MAX_GROUPS} groups, "
                                    f"got {groups}", fix="split the call into several")
    kinds = {is_torch(x) for x in (a, b, group_offsets)}
    if len(kinds) > 1:
        raise kiln.KilnTypeError("a, b and group_offsets must all be numpy arrays or all torch "
                                 "tensors", fix="move them to the same kind first")
    out = _output_dtype(out_dtype, "bf16")
    check_backend(backend)
    check_group_offsets(group_offsets, total_m, validate=validate)
    if total_m * n == 0 or k == 0:  # nothing to multiply: an empty c, or zeros for K = 0
        return empty_like(a, (total_m, n), kiln.dtype(out), fill=0.0)
    _require_hopper(chip)
    cfg = grouped_config(groups)
    kp, np_ = _round_up(k, 8), _round_up(n, 8)  # TMA row strides are multiples of 16 bytes
    if trans_b:
        b_rows = np_
        b_in = _padded(b, (groups, np_, kp)).reshape(groups * np_, kp)
    else:
        # A box past K would read the next group's rows: pad each group's K to whole boxes.
        b_rows = _round_up(k, cfg.block_k)
        b_in = _padded(b, (groups, b_rows, np_)).reshape(groups * b_rows, np_)
    a_in = _padded(a, (total_m, kp))
    offsets = group_offsets.contiguous() if is_torch(group_offsets) else \
        np.ascontiguousarray(group_offsets)
    c = _empty_like(a, (total_m, np_), out)
    if backend == "interpret":
        args = [a_in, b_in, c, c, offsets, groups, total_m, np_, k, b_rows]
        kernel = make_grouped_kernel(name, out, "k" if trans_b else "mn", cfg)
        _interpret(kernel, chip, cfg, args, _grouped_constexprs(cfg, groups))
    else:
        run_grouped(a_in, b_in, c, offsets, k=k, b_rows=b_rows, trans_b=trans_b,
                    target=chip.name, config=cfg)
    return c if np_ == n else c[:, :n].contiguous() if is_torch(c) else \
        np.ascontiguousarray(c[:, :n])


def run_grouped(a, b, c, offsets, *, k, b_rows, trans_b, target="sm_90a", config=None,
                stream=None):
    """Launch the grouped kernel on prepared operands: ``a`` ``[total_M, Kp]``, ``b`` viewed as
    ``[G * b_rows, cols]`` (see :func:`make_grouped_kernel`), ``c`` ``[total_M, Np]`` (Kp, Np
    multiples of 8), ``offsets`` int32 ``[G + 1]``; ``config`` defaults to
    :func:`grouped_config`. The grid is one CTA per SM (for numpy offsets, at most one per
    tile). Example (a poisoned ``c`` in a test): ``run_grouped(a, b, c, offs, k=k, b_rows=k,
    trans_b=False)``."""
    from kiln.lowering.cuda import driver

    from ..inputs import is_torch

    groups = int(offsets.shape[0]) - 1
    (total_m, n), cfg = c.shape, config or grouped_config(groups)
    grid = driver().multiprocessor_count()
    if not is_torch(offsets):  # known tile count: no CTA without a tile
        grid = max(1, min(grid, grouped_tiles(offsets, n, cfg)))
    kernel = make_grouped_kernel(kiln.dtype(a.dtype).name, kiln.dtype(c.dtype).name,
                                 "k" if trans_b else "mn", cfg)
    kernel[(grid, 1, 1)](a, b, c, c, offsets, groups, total_m, n, k, b_rows, target=target,
                         num_warps=cfg.num_warps, stream=stream,
                         **_grouped_constexprs(cfg, groups))


def check_group_offsets(offsets, total_m: int, *, validate: bool = False) -> None:
    """``offsets[0] == 0``, non-decreasing, ``offsets[-1] == total_m``: always for numpy,
    for torch tensors only with ``validate`` (one reduction and one synchronisation; not
    inside a CUDA graph capture)."""
    from ..inputs import is_torch

    if is_torch(offsets):
        if not validate:
            return
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise kiln.KilnValueError(
                "group_offsets of device tensors are checked with a synchronisation, which a "
                "CUDA graph capture cannot contain",
                fix="check them with validate=True before capturing, not inside the graph")
        ok = (offsets[0] == 0) & (offsets[-1] == total_m) & \
            (offsets[1:] >= offsets[:-1]).all()
        if bool(ok):  # the one synchronisation
            return
        offsets = offsets.cpu().numpy()
    offsets = np.asarray(offsets).astype(np.int64)
    if offsets[0] != 0:
        raise kiln.KilnValueError(f"group_offsets[0] = {offsets[0]}, but it must be 0",
                                  fix="start group_offsets with 0 (group 0 starts at row 0)")
    drops = np.flatnonzero(offsets[1:] < offsets[:-1])
    if drops.size:
        g = int(drops[0])
        raise kiln.KilnValueError(f"group_offsets decreases at group {g}: group_offsets[{g}] ="
                                  f" {offsets[g]} > group_offsets[{g + 1}] = {offsets[g + 1]}",
                                  fix="pass cumulative row counts (e.g. a prefix sum of the "
                                      "group sizes)")
    if offsets[-1] != total_m:
        raise kiln.KilnValueError(f"group_offsets[-1] = {offsets[-1]}, but a has total_M = "
                                  f"{total_m} rows", fix="end group_offsets with a.shape[0]")


def grouped_tiles(offsets, n: int, cfg: HopperGemmConfig) -> int:
    """Output tiles of all groups (host-side, from numpy offsets)."""
    rows = np.diff(np.asarray(offsets).astype(np.int64))
    return int((-(-rows // cfg.block_m)).sum() * -(-n // cfg.block_n))


def _interpret(kernel, chip, cfg, args, constexprs) -> None:
    from kiln.lowering.interpret import interpret_kernel

    from . import _like, _numpy

    host = [_numpy(x) if hasattr(x, "shape") else x for x in args]
    host[3] = host[2]  # C's tensor map and tensor are one array
    # Two CTAs at most: the persistent walk over several tiles and groups is what is tested.
    grid = max(1, min(2, grouped_tiles(host[4], host[7], cfg)))
    traced = kernel.trace(*host, target=chip.name, num_warps=cfg.num_warps, **constexprs)
    interpret_kernel(traced, (grid, 1, 1), host, chip.name)
    if host[2] is not args[2]:
        args[2][...] = _like(args[2], host[2])


def _grouped_constexprs(cfg: HopperGemmConfig, groups: int) -> dict:
    return dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages,
                GROUP_M=cfg.group_m, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers, TABLE=table_size(groups))


def _grouped_input_dtype(dtype, what: str = "dtype") -> str:
    name = kiln.dtype(dtype).name
    if name in FP8_DTYPES or name.startswith("f8"):
        raise kiln.UnsupportedError(f"{FP8_UNSUPPORTED} ({what} is {name})",
                                    fix="convert the operands to bf16")
    if name not in ("bf16", "f16"):
        raise kiln.UnsupportedError(f"grouped_matmul does not support {name} inputs "
                                    f"({what})", fix="convert to bf16 or f16")
    return name


def _require_hopper(chip) -> None:
    if chip.is_amd:
        raise kiln.UnsupportedError(f"grouped_matmul has no {chip.name} kernel yet (the AMD "
                                    "GEMM is dense only)",
                                    fix="target sm_90a, or loop kiln.kernels.gemm.matmul over "
                                        "the groups")
    if not chip.has_wgmma:
        raise kiln.UnsupportedError(f"grouped_matmul needs WGMMA (sm_90a); {chip.name} has none",
                                    fix="compile for target='sm_90a'")


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _padded(x, shape: tuple):
    """``x`` itself when already ``shape`` and contiguous, else a zero-padded copy."""
    from ..inputs import is_torch

    if tuple(x.shape) == shape:
        return x.contiguous() if is_torch(x) else np.ascontiguousarray(x)
    out = x.new_zeros(shape) if is_torch(x) else np.zeros(shape, x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out
