"""Tile ops: GlobalTile masks on both dimensions, kiln.load / kiln.copy / kiln.reduce on
block-wide register tiles, elementwise math on tiles, and their errors.

Every kernel runs in the interpreter as on sm_90a (warp 32) and gfx950 (wavefront 64), on fresh
random inputs at ragged sizes, against float64 numpy, with poisoned (NaN) outputs so a masked
element that is written, or one that is missed, fails."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import bf16, f32, i32
from kiln.layout import blocked
from kiln.tile_gemm_wgmma import accumulator_layout

from sample_kernels import two_stage_sum

TARGETS = ("sm_90a", "gfx950")


@kiln.kernel(num_threads="THREADS")
def masked_copy(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32,
                BM: kiln.constexpr, BN: kiln.constexpr, THREADS: kiln.constexpr,
                FILL: kiln.constexpr):
    r0 = kiln.block_id(0) * BM
    c0 = kiln.block_id(1) * BN
    tv = blocked((BM, BN), THREADS, vec=4)
    t = kiln.load(kiln.GlobalTile(x, (BM, BN), (r0, c0), row_end=m, col_end=n, fill=FILL), tv)
    # the fill shows through: every element of the output tile is written unmasked
    kiln.copy(t, kiln.GlobalTile(y, (BM, BN), (r0, c0)))


@pytest.mark.parametrize("target", TARGETS)
def test_load_masks_rows_and_columns_with_fill(target):
    rng = np.random.default_rng()
    m, n = 37, 75
    x = rng.standard_normal((m, n)).astype(np.float32)
    y = np.full((48, 96), np.nan, np.float32)   # 3 x 3 tiles of 16 x 32, ragged on both
    masked_copy.interpret[(3, 3)](x, y, m, n, BM=16, BN=32, THREADS=128, FILL=-7.5,
                                  target=target)
    want = np.full_like(y, -7.5)
    want[:m, :n] = x
    np.testing.assert_array_equal(y, want)


@kiln.kernel(num_threads="THREADS")
def masked_scale(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32,
                 BM: kiln.constexpr, BN: kiln.constexpr, THREADS: kiln.constexpr):
    r0 = kiln.block_id(0) * BM
    c0 = kiln.block_id(1) * BN
    tv = blocked((BM, BN), THREADS, vec=4)
    t = kiln.load(kiln.GlobalTile(x, (BM, BN), (r0, c0), row_end=m, col_end=n), tv)
    kiln.copy(t * 2.0, kiln.GlobalTile(y, (BM, BN), (r0, c0), row_end=m, col_end=n))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(37, 75), (16, 33), (5, 3)])
def test_store_masks_rows_and_columns(target, shape):
    """Stores skip masked elements: the exact-size output stays in bounds (the interpreter's
    bounds check would fail otherwise) and its neighbours' poison is untouched."""
    rng = np.random.default_rng()
    m, n = shape
    x = rng.standard_normal((m, n)).astype(np.float32)
    y = np.full((m, n), np.nan, np.float32)
    grid = (-(-m // 16), -(-n // 32))
    masked_scale.interpret[grid](x, y, m, n, BM=16, BN=32, THREADS=128, target=target)
    np.testing.assert_array_equal(y, x * 2)


def test_masked_accesses_compile_to_vector_and_masked_ops():
    x = np.zeros((37, 75), np.float32)
    text = masked_scale.trace(x, x, 37, 75, BM=16, BN=32, THREADS=128,
                              target="sm_90a").module_asm
    assert "vector.maskedload" in text and "vector.maskedstore" in text
    assert "vector.load" in text and "vector.store" in text   # the whole-chunk fast path


@kiln.kernel(num_threads=128)
def shared_copy(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32,
                ALIGN: kiln.constexpr):
    s = kiln.SharedTile((32, 32), f32)
    kiln.copy(kiln.GlobalTile(x, (32, 32), (0, 0), row_end=m, col_end=n, align=ALIGN), s)
    kiln.barrier()
    kiln.copy(kiln.load(s, blocked((32, 32), 128)), kiln.GlobalTile(y, (32, 32)))


@pytest.mark.parametrize("target", ("sm_80", "sm_90a", "gfx950"))
@pytest.mark.parametrize("width,align", [(19, 4), (20, 16)])
def test_copy_global_to_shared_masks_both_dims(target, width, align):
    """Rows of 19 floats promise 4-byte alignment (synchronous copies), rows of 20 promise 16
    (cp.async on NVIDIA); 19 columns are valid either way."""
    rng = np.random.default_rng()
    x = rng.standard_normal((29, width)).astype(np.float32)
    y = np.full((32, 32), np.nan, np.float32)
    shared_copy.interpret[(1,)](x, y, 29, 19, ALIGN=align, target=target)
    want = np.zeros_like(y)
    want[:29, :19] = x[:, :19]
    np.testing.assert_array_equal(y, want)


def _cp_async_widths(text: str) -> set[int]:
    return {int(w) for w in re.findall(r"nvgpu.device_async_copy [^:]*\], (\d+)", text)}


def test_copy_global_to_shared_is_cp_async_as_wide_as_the_alignment_on_sm80():
    x = np.zeros((29, 20), np.float32)
    assert _cp_async_widths(shared_copy.trace(x, x, 29, 19, ALIGN=16,
                                              target="sm_80").module_asm) == {4}
    assert _cp_async_widths(shared_copy.trace(x, x, 29, 19, ALIGN=4,
                                              target="sm_80").module_asm) == {1}
    assert not _cp_async_widths(shared_copy.trace(x, x, 29, 19, ALIGN=16,
                                                  target="gfx950").module_asm)


def test_a_broken_alignment_promise_is_caught_by_the_interpreter():
    """cp.async from a misaligned address faults on the GPU; the interpreter says where."""
    x = np.zeros((29, 19), np.float32)
    with pytest.raises(kiln.KilnValueError, match="not 16-byte aligned"):
        shared_copy.interpret[(1,)](x, np.zeros((32, 32), np.float32), 29, 19, ALIGN=16,
                                    target="sm_80")


@pytest.mark.lower
def test_cp_async_wait_is_placed_by_the_pass():
    x = np.zeros((29, 20), np.float32)
    ptx = shared_copy.compile(x, x, 29, 19, ALIGN=16, target="sm_80").asm["ptx"]
    copy_at, wait_at = ptx.index("cp.async.cg"), ptx.index("cp.async.wait_group")
    assert copy_at < wait_at < ptx.index("bar.sync", wait_at - 200 if wait_at > 200 else 0)


def reduce_kernel(op, axis):
    @kiln.kernel(num_threads="THREADS")
    def k(x: kiln.Tensor[f32, 2], out: kiln.Tensor[f32, 2], m: i32, n: i32,
          BM: kiln.constexpr, BN: kiln.constexpr, THREADS: kiln.constexpr, VEC: kiln.constexpr,
          FILL: kiln.constexpr):
        tv = blocked((BM, BN), THREADS, vec=VEC)
        t = kiln.load(kiln.GlobalTile(x, (BM, BN), row_end=m, col_end=n, fill=FILL), tv)
        r = kiln.reduce(t, op, axis=axis)
        # broadcast back: every element of the output holds its row's (column's) result
        kiln.copy(t * 0.0 + r, kiln.GlobalTile(out, (BM, BN), row_end=m, col_end=n))

    return k


@kiln.func
def logaddexp(a: f32, b: f32) -> f32:
    """log(exp(a) + exp(b)): associative and commutative, unlike anything built in."""
    hi = kiln.max(a, b)
    return hi + kiln.log(1.0 + kiln.exp(kiln.min(a, b) - hi))


REDUCTIONS = {
    "sum": ("sum", lambda x, ax: x.sum(axis=ax), 0.0),
    "max": ("max", lambda x, ax: x.max(axis=ax), -np.inf),
    "min": ("min", lambda x, ax: x.min(axis=ax), np.inf),
    "lambda_sum": (lambda a, b: a + b, lambda x, ax: x.sum(axis=ax), 0.0),
    "func_logaddexp": (logaddexp, lambda x, ax: np.logaddexp.reduce(x, axis=ax), -1e30),
}
# (tile, threads, vec): the rows (columns) span registers + lanes, several warps, the block
SHAPES = [((4, 256), 256, 4), ((1, 1024), 256, 4), ((64, 16), 128, 1), ((8, 64), 64, 2)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("axis", (0, 1))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0][0]}x{s[0][1]}t{s[1]}")
def test_reduce(target, name, axis, shape):
    (bm, bn), threads, vec = shape
    op, ref, fill = REDUCTIONS[name]
    rng = np.random.default_rng()
    m, n = bm - (bm > 1), bn - 3
    x = rng.standard_normal((m, n)).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    reduce_kernel(op, axis).interpret[(1,)](x, out, m, n, BM=bm, BN=bn, THREADS=threads,
                                            VEC=vec, FILL=fill, target=target)
    want = np.broadcast_to(np.expand_dims(ref(x.astype(np.float64), axis), axis), x.shape)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_reduce_across_warps_uses_one_shared_stage_and_shuffles_within():
    x = np.zeros((1, 1024), np.float32)
    text = reduce_kernel("sum", 1).trace(x, x, 1, 1024, BM=1, BN=1024, THREADS=256, VEC=4,
                                         FILL=0.0, target="sm_90a").module_asm
    assert text.count("gpu.shuffle") == 5          # 32 lanes: masks 1..16
    assert text.count("gpu.barrier") == 2          # store partials, read them; reuse guard
    gfx = reduce_kernel("sum", 1).trace(x, x, 1, 1024, BM=1, BN=1024, THREADS=256, VEC=4,
                                        FILL=0.0, target="gfx950").module_asm
    assert "amdgpu.dpp" in gfx and "rocdl.ds_swizzle" in gfx


@pytest.mark.lower
def test_reduce_across_warps_reads_the_partials_with_broadcast_vector_loads():
    """A slot per warp (not per thread), read as 16-byte loads of constant addresses."""
    x = np.zeros((1, 1024), np.float32)
    ck = reduce_kernel("max", 1).compile(x, x, 1, 1024, BM=1, BN=1024, THREADS=256, VEC=4,
                                         FILL=-np.inf, target="sm_90a")
    assert ck.metadata["shared_bytes"] == 8 * 4     # 8 warps' partials
    ptx = ck.asm["ptx"]
    assert ptx.count("ld.shared.v4.b32") == 2 and ptx.count("st.shared.b32") == 1


@kiln.kernel(num_threads=128)
def tile_math(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], n: i32):
    tv = blocked((2, 256), 128)
    t = kiln.load(kiln.GlobalTile(x, (2, 256), col_end=n, fill=1.0), tv)
    _, cols = kiln.tiles.coords(tv)
    u = kiln.where(cols < 100, kiln.exp(t), kiln.sqrt(kiln.abs(t)))
    u = kiln.max(u, 0.5) + kiln.min(1.0, t) * kiln.rcp(kiln.reduce(kiln.abs(t), "max", 1))
    kiln.copy(kiln.cast(kiln.cast(u, kiln.bf16), f32), kiln.GlobalTile(y, (2, 256), col_end=n))


@pytest.mark.parametrize("target", TARGETS)
def test_elementwise_math_where_cast_and_broadcast_on_tiles(target):
    import ml_dtypes
    rng = np.random.default_rng()
    n = 201
    x = rng.standard_normal((2, n)).astype(np.float32)
    y = np.full_like(x, np.nan)
    tile_math.interpret[(1,)](x, y, n, target=target)
    x64 = x.astype(np.float64)
    u = np.where(np.arange(n) < 100, np.exp(x64), np.sqrt(np.abs(x64)))
    u = np.maximum(u, 0.5) + np.minimum(1.0, x64) / np.abs(x64).max(axis=1, keepdims=True)
    want = u.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(y, want, rtol=1e-2, atol=1e-2)


def test_reduce_errors():
    @kiln.kernel(num_threads=128)
    def f16_reduce(x: kiln.Tensor[kiln.f16, 2]):
        t = kiln.load(kiln.GlobalTile(x, (1, 512)), blocked((1, 512), 128))
        kiln.reduce(t, "sum", 1)

    @kiln.kernel(num_threads=128)
    def bad_op(x: kiln.Tensor[f32, 2]):
        t = kiln.load(kiln.GlobalTile(x, (1, 512)), blocked((1, 512), 128))
        kiln.reduce(t, "prod", 1)

    with pytest.raises(kiln.KilnTypeError, match="32-bit"):
        f16_reduce.trace(np.zeros((1, 512), np.float16), target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="prod"):
        bad_op.trace(np.zeros((1, 512), np.float32), target="sm_90a")


def test_load_and_tile_errors():
    @kiln.kernel(num_threads=128)
    def wrong_layout(x: kiln.Tensor[f32, 2]):
        kiln.load(kiln.GlobalTile(x, (2, 512)), blocked((1, 512), 128))

    @kiln.kernel(num_threads=64)
    def too_many_threads(x: kiln.Tensor[f32, 2]):
        kiln.load(kiln.GlobalTile(x, (1, 512)), blocked((1, 512), 128))

    @kiln.kernel(num_threads=128)
    def one_d_rows(x: kiln.Tensor[f32]):
        tv = blocked((2, 512), 128)
        g = kiln.GlobalTile(x, (2, 512))
        kiln.copy(kiln.load(g, tv), g)

    @kiln.kernel(num_threads=128)
    def warp_tile_store(x: kiln.Tensor[f32, 2]):
        acc = kiln.RegTile.full(kiln.layout.mma_m16n8_accumulator(), (1, 1), 0.0)
        kiln.copy(acc, kiln.GlobalTile(x, (16, 8)))

    x2 = np.zeros((2, 512), np.float32)
    with pytest.raises(kiln.KilnValueError, match="held by 32 threads"):
        warp_tile_store.trace(np.zeros((16, 8), np.float32), target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="layout covers a 1x512"):
        wrong_layout.trace(x2, target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="128 threads"):
        too_many_threads.trace(x2, target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="repeats one row"):
        one_d_rows.trace(np.zeros(512, np.float32), target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="cannot spread"):
        blocked((1, 64), 128, vec=4)
    with pytest.raises(kiln.KilnValueError, match="vec=3"):
        blocked((4, 64), 16, vec=3)


@kiln.kernel
def block_agnostic(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32):
    i = kiln.global_id(0)
    if i < n:
        y[i] = x[i] * 3.0
    tv = blocked((1, 1024))                      # over the block's threads, whatever they are
    start = kiln.block_id(0) * 1024
    t = kiln.load(kiln.GlobalTile(x, (1, 1024), (0, start), col_end=n), tv)
    kiln.copy(t + kiln.reduce(t, "sum", 1), kiln.GlobalTile(y, (1, 1024), (0, n + start),
                                                            col_end=2 * n))


@pytest.mark.parametrize("target", TARGETS)
def test_global_id_and_default_blocked_threads_follow_the_launch(target):
    """4 warps are 128 threads on sm_90a and 256 on gfx950: the kernel is right on both."""
    rng = np.random.default_rng()
    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    y = np.full(2 * n, np.nan, np.float32)
    threads = 4 * kiln.core.targets.get_target(target).warp_size
    block_agnostic.interpret[(-(-n // threads),)](x, y, n, num_warps=4, target=target)
    np.testing.assert_allclose(y[:n], x * 3.0, rtol=1e-6)
    np.testing.assert_allclose(y[n:], x + x.astype(np.float64).sum(), rtol=1e-5, atol=1e-4)


@kiln.kernel(num_threads=128)
def past_the_end(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32):
    s = kiln.SharedTile((32, 32), f32)
    # block 1's tile starts past both ends of x: every chunk reads nothing, fills zeros
    g = kiln.GlobalTile(x, (32, 32), (kiln.block_id(0) * 32, kiln.block_id(0) * 32),
                        row_end=m, col_end=n, align=16)
    kiln.copy(g, s)
    kiln.barrier()
    kiln.copy(kiln.load(s, blocked((32, 32), 128)),
              kiln.GlobalTile(y, (32, 32), (kiln.block_id(0) * 32, 0)))


@pytest.mark.parametrize("target", ("sm_80", "gfx950"))
def test_copy_of_a_tile_wholly_past_the_end_reads_nothing(target):
    x = np.random.default_rng().standard_normal((29, 20)).astype(np.float32)
    y = np.full((64, 32), np.nan, np.float32)
    past_the_end.interpret[(2,)](x, y, 29, 19, target=target)
    want = np.zeros_like(y)
    want[:29, :19] = x[:, :19]
    np.testing.assert_array_equal(y, want)


@kiln.kernel(num_threads=128)
def no_barrier(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2]):
    s = kiln.SharedTile((32, 32), f32)
    kiln.copy(kiln.GlobalTile(x, (32, 32)), s)
    # no kiln.barrier(): threads read chunks other threads copied
    kiln.copy(kiln.load(s, blocked((32, 32), 128, vec=1)), kiln.GlobalTile(y, (32, 32)))


@pytest.mark.parametrize("target", ("sm_80", "gfx950"))
def test_interpreter_still_catches_a_missing_barrier_after_a_tile_copy(target):
    x = np.ones((32, 32), np.float32)
    with pytest.raises(kiln.RaceError):
        no_barrier.interpret[(1,)](x, np.zeros_like(x), target=target)


@kiln.kernel(num_threads=128)
def overreach(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], n: i32):
    tv = blocked((1, 256), 128, vec=2)
    # col_end past the tensor's width: the mask lets out-of-bounds elements through
    t = kiln.load(kiln.GlobalTile(x, (1, 256), col_end=n + 8), tv)
    kiln.copy(t, kiln.GlobalTile(y, (1, 256), col_end=n))


def test_masked_loads_are_still_bounds_checked_per_element():
    x = np.ones((1, 200), np.float32)
    with pytest.raises(kiln.OutOfBoundsError):
        overreach.interpret[(1,)](x, np.zeros((1, 256), np.float32), 200, target="sm_90a")


def test_tile_argument_errors_name_the_fix():
    @kiln.kernel(num_threads=128)
    def bad_axis(x: kiln.Tensor[f32, 2]):
        kiln.reduce(kiln.load(kiln.GlobalTile(x, (1, 512)), blocked((1, 512), 128)), "sum", 2)

    @kiln.kernel(num_threads=128)
    def bad_copy(x: kiln.Tensor[f32, 2]):
        kiln.copy(x, kiln.GlobalTile(x, (1, 512)))

    @kiln.kernel(num_threads=128)
    def bad_align(x: kiln.Tensor[f32, 2]):
        kiln.GlobalTile(x, (1, 512), align=12)

    @kiln.kernel(num_threads=128)
    def bad_fill(x: kiln.Tensor[f32, 2]):
        kiln.GlobalTile(x, (1, 512), fill="zero")

    x = np.zeros((1, 512), np.float32)
    for kernel, error, text in ((bad_axis, kiln.KilnValueError, "axis"),
                                (bad_copy, kiln.KilnTypeError, "cannot copy a TensorRef"),
                                (bad_align, kiln.KilnValueError, "power-of-two"),
                                (bad_fill, kiln.KilnTypeError, "fill")):
        with pytest.raises(error, match=text) as info:
            kernel.trace(x, target="sm_90a")
        assert "test_tile_ops.py" in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("target", ("sm_80", "gfx950"))
def test_two_stage_pipeline_waits_are_placed_by_the_pass(target):
    rng = np.random.default_rng()
    x = rng.standard_normal((200, 32)).astype(np.float32)
    y = np.zeros((32, 32), np.float32)
    two_stage_sum.interpret[(1,)](x, y, 200, target=target)
    padded = np.zeros((256, 32))
    padded[:200] = x
    np.testing.assert_allclose(y, padded.reshape(-1, 32, 32).sum(axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.lower
def test_two_stage_pipeline_compiles_with_a_wait_per_stage():
    x = np.zeros((200, 32), np.float32)
    gpu = two_stage_sum.compile(x, x[:32], 200, target="sm_80").asm["gpu"]
    waits = [line for line in gpu.splitlines() if "nvgpu.device_async_wait" in line]
    assert waits and all("numGroups = 1" in w for w in waits), waits


@kiln.kernel(num_threads=128)
def reciprocal(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], APPROX: kiln.constexpr):
    tv = blocked((8, 64), 128, vec=4)
    t = kiln.load(kiln.GlobalTile(x, (8, 64)), tv)
    kiln.copy(kiln.rcp(1.0 + kiln.exp(-t), approx=APPROX), kiln.GlobalTile(y, (8, 64)))


@pytest.mark.parametrize("target", TARGETS)
def test_approximate_reciprocal_on_tiles_matches_numpy_through_overflow(target):
    """A sigmoid whose ``1 + exp(-x)`` overflows to inf for half the inputs: 0 there."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((8, 64)) * 200).astype(np.float32)
    y = np.full_like(x, np.nan)
    reciprocal.interpret[(1,)](x, y, APPROX=True, target=target)
    with np.errstate(over="ignore"):
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-30)


@pytest.mark.lower
@pytest.mark.parametrize("target,fast,slow", [("sm_90a", "rcp.approx.f32", "rcp.rn.f32"),
                                              ("gfx950", "v_rcp_f32", "v_div_scale_f32")])
def test_approximate_reciprocal_has_no_slow_path(target, fast, slow):
    x = np.zeros((8, 64), np.float32)
    asm = "ptx" if target.startswith("sm") else "amdgcn"
    approx = reciprocal.compile(x, x, APPROX=True, target=target).asm[asm]
    exact = reciprocal.compile(x, x, APPROX=False, target=target).asm[asm]
    assert fast in approx and slow not in approx and slow in exact


@kiln.kernel(num_threads=128)
def accumulator_store(x: kiln.Tensor[bf16, 2], y: kiln.Tensor[bf16, 2], m: i32, n: i32,
                      STAGED: kiln.constexpr):
    r0, c0 = kiln.block_id(0) * 64, kiln.block_id(1) * 128
    t = kiln.load(kiln.GlobalTile(x, (64, 128), (r0, c0), row_end=m, col_end=n),
                  accumulator_layout(64, 128))   # pairs of columns, 8 rows apart
    kiln.copy(t, kiln.GlobalTile(y, (64, 128), (r0, c0), row_end=m, col_end=n, align=16),
              staged=STAGED)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(100, 200), (64, 128), (7, 9)])
def test_staged_store_of_an_accumulator_writes_exactly_the_unmasked_part(target, shape):
    rng = np.random.default_rng()
    x = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    y = np.full(shape, np.nan, ml_dtypes.bfloat16)
    grid = (-(-shape[0] // 64), -(-shape[1] // 128))
    accumulator_store.interpret[grid](x, y, *shape, STAGED=True, target=target)
    np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))


@pytest.mark.lower
def test_staged_store_is_coalesced_16_byte_row_stores():
    """The accumulator's 4-byte runs go into shared memory whole (one 4-byte store each: the
    store carries its alignment) and out as 16-byte row runs."""
    x = np.zeros((128, 256), ml_dtypes.bfloat16)
    plain = accumulator_store.compile(x, x, 128, 256, STAGED=False, target="sm_90a").asm["ptx"]
    ptx = accumulator_store.compile(x, x, 128, 256, STAGED=True, target="sm_90a").asm["ptx"]
    assert "st.global.v4.b32" in ptx and "st.global.v4.b32" not in plain
    assert "st.shared.b32" in ptx and "st.shared.b16" not in ptx


def test_staged_copy_errors_name_the_fix():
    x = np.zeros((64, 128), ml_dtypes.bfloat16)

    @kiln.kernel(num_threads=128)
    def into_shared(x: kiln.Tensor[bf16, 2]):
        t = kiln.load(kiln.GlobalTile(x, (64, 128)), accumulator_layout(64, 128))
        kiln.copy(t, kiln.SharedTile((64, 128), bf16), staged=True)

    with pytest.raises(kiln.KilnTypeError, match="staged=True"):
        into_shared.trace(x, target="sm_90a")

    @kiln.kernel(num_threads=128)
    def not_bool(x: kiln.Tensor[bf16, 2]):
        t = kiln.load(kiln.GlobalTile(x, (64, 128)), accumulator_layout(64, 128))
        kiln.copy(t, kiln.GlobalTile(x, (64, 128)), staged=1)

    with pytest.raises(kiln.KilnTypeError, match="must be a bool"):
        not_bool.trace(x, target="sm_90a")


@pytest.mark.gpu
def test_staged_store_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    x = torch.randn(100, 200, device="cuda").to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    accumulator_store[(2, 2)](x, y, 100, 200, STAGED=True)
    assert torch.equal(y, x)
