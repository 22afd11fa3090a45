"""Rows split over a thread-block cluster: ``kiln.cluster_rank``, ``kiln.reduce(cluster=True)``
through distributed shared memory (``kiln.nvidia.dsmem.store_remote``), ``kiln.reduce`` of a
tuple of tiles (one stage for all), and ``kiln.tiles.mask`` (the in-bounds elements of a GlobalTile, a compare per vector access):
the interpreter against float64 on ragged shapes, persistent and not, the PTX on sm_90a, the
errors, and (gpu) the same kernels on the GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.layout import blocked
from kiln.nvidia.dsmem import store_remote


def split_reduce_kernel(op, sites: int):
    """Row ``r`` of ``x`` split over the cluster's CTAs (``PART`` columns each); each writes
    its part of ``out[r] = reduce(x[r])`` broadcast (``sites`` 1: one cluster reduce a loop
    trip; 2: plus ``reduce(x[r] / 2)``, two a trip as a softmax's max and sum)."""
    @kiln.kernel(num_threads="THREADS")
    def k(x: kiln.Tensor[f32, 2], out: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
          PART: kiln.constexpr, THREADS: kiln.constexpr, SPLIT: kiln.constexpr,
          FILL: kiln.constexpr):
        first = kiln.cluster_rank(SPLIT) * PART
        tv = blocked((1, PART), THREADS, vec=4)
        for row in kiln.range(kiln.block_id(0) // SPLIT, m, grid // SPLIT):
            t = kiln.load(kiln.GlobalTile(x, (1, PART), (row, first), col_end=n, fill=FILL), tv)
            r = kiln.reduce(t, op, axis=1, cluster=True)
            if sites == 2:
                r = kiln.reduce(t * 0.5, op, axis=1, cluster=True) + r
            kiln.copy(t * 0.0 + r, kiln.GlobalTile(out, (1, PART), (row, first), col_end=n))

    return k


OPS = {"sum": ("sum", np.sum, 0.0), "max": ("max", np.max, -np.inf),
       "lambda_min": (lambda a, b: kiln.min(a, b), np.min, np.inf)}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("split,grid,sites", [(2, 2, 1), (4, 8, 2), (2, 6, 2), (8, 8, 1)])
def test_cluster_reduce_matches_numpy(name, split, grid, sites):
    """Every CTA of a cluster gets the row's result; clusters walk several rows (one or two
    cluster reduces a loop trip: the exchange buffer is reused safely either way)."""
    op, ref, fill = OPS[name]
    rng = np.random.default_rng()
    m, part = 5, 256
    n = split * part - 37
    x = rng.standard_normal((m, n)).astype(np.float32)
    out = np.full_like(x, np.nan)
    split_reduce_kernel(op, sites).interpret[(grid,)](x, out, m, n, grid, PART=part,
                                                      THREADS=64, SPLIT=split, FILL=fill,
                                                      target="sm_90a")
    want = ref(x.astype(np.float64), axis=1, keepdims=True)
    if sites == 2:
        want = ref(x * 0.5, axis=1, keepdims=True) + want
    np.testing.assert_allclose(out, np.broadcast_to(want, x.shape), rtol=1e-5, atol=1e-5)
    assert (out == out[:, :1]).all(), "every CTA must get the bitwise same result"


def test_cluster_of_one_is_the_block_reduce_on_every_target():
    x = np.random.default_rng().standard_normal((3, 100)).astype(np.float32)
    for target in ("sm_80", "sm_90a", "gfx950"):
        out = np.full_like(x, np.nan)
        split_reduce_kernel("sum", 1).interpret[(2,)](x, out, 3, 100, 2, PART=256, THREADS=64,
                                                      SPLIT=1, FILL=0.0, target=target)
        # a float32 sum of 100 terms can be off by ~100 ulps of sum|x|: relative error alone
        # fails whenever the row's sum cancels to near zero
        bound = 100 * np.finfo(np.float32).eps * np.abs(x).astype(np.float64).sum(1)
        assert np.all(np.abs(out[:, 0] - x.astype(np.float64).sum(1)) <= bound)


@pytest.mark.lower
def test_cluster_reduce_ptx_uses_dsmem_and_split_cluster_barriers():
    x = np.zeros((2, 1024), np.float32)
    ptx = split_reduce_kernel("sum", 1).compile(x, x, 2, 1024, 4, PART=256, THREADS=64,
                                                SPLIT=4, FILL=0.0, target="sm_90a").asm["ptx"]
    assert ".reqnctapercluster 4, 1, 1" in ptx
    assert re.search(r"mapa\.shared::cluster\.u64 .*st\.shared::cluster\.b32", ptx)
    # the standing arrive, then per exchange: wait, store, arrive, wait, read, arrive
    assert ptx.count("barrier.cluster.arrive") == 3 and ptx.count("barrier.cluster.wait") == 2


def test_cluster_rank_errors_name_the_fix():
    @kiln.kernel(num_threads=64)
    def ranked(x: kiln.Tensor[f32, 2], SPLIT: kiln.constexpr):
        x[0, kiln.cluster_rank(SPLIT)] = 1.0

    x = np.zeros((1, 4), np.float32)
    with pytest.raises(kiln.TargetError):
        ranked.trace(x, SPLIT=2, target="gfx950")
    with pytest.raises(kiln.TargetError):
        ranked.trace(x, SPLIT=2, target="sm_80")
    with pytest.raises(kiln.KilnValueError, match="positive int"):
        ranked.trace(x, SPLIT=0, target="sm_90a")


@kiln.kernel(num_threads=64)
def peer_store(out: kiln.Tensor[f32], SYNC: kiln.constexpr):
    rank = kiln.cluster_rank(2)
    buf = kiln.shared((2,), f32)
    if kiln.thread_id(0) < 2:
        store_remote(buf, rank, kiln.cast(rank, f32) + 1.0, kiln.thread_id(0))
    if SYNC:
        kiln.nvidia_asm.cluster_sync()
    if kiln.thread_id(0) == 0:
        out[rank] = buf[0] + buf[1] * 10.0
    kiln.nvidia_asm.cluster_sync()   # no CTA exits while its peer may still store into it


def test_store_remote_lands_in_the_peer_and_a_read_before_the_barrier_is_a_race():
    out = np.full(2, np.nan, np.float32)
    peer_store.interpret[(2,)](out, SYNC=True, target="sm_90a")
    np.testing.assert_array_equal(out, [21.0, 21.0])
    with pytest.raises(kiln.RaceError, match="peer CTA"):
        peer_store.interpret[(2,)](out, SYNC=False, target="sm_90a")


def test_store_remote_errors_name_the_fix():
    @kiln.kernel(num_threads=64)
    def wide(out: kiln.Tensor[f32]):
        buf = kiln.shared((2,), kiln.f16)
        store_remote(buf, 0, kiln.cast(1.0, kiln.f16), kiln.cluster_rank(2))

    @kiln.kernel(num_threads=64)
    def not_shared(out: kiln.Tensor[f32]):
        store_remote(out, 0, 1.0, kiln.cluster_rank(2))

    with pytest.raises(kiln.KilnTypeError, match="32-bit"):
        wide.trace(np.zeros(2, np.float32), target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="kiln.shared"):
        not_shared.trace(np.zeros(2, np.float32), target="sm_90a")


@kiln.kernel(num_threads=64)
def masked(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32,
           ALIGN: kiln.constexpr):
    tv = blocked((4, 256), 64, vec=4)
    g = kiln.GlobalTile(x, (4, 256), (1, 8), row_end=m, col_end=n, fill=7.0, align=ALIGN,
                        col_multiple=ALIGN // 4)
    t = kiln.where(kiln.tiles.mask(g, tv), kiln.load(g, tv) * 2.0, -1.0)
    kiln.copy(t, kiln.GlobalTile(y, (4, 256)))


@pytest.mark.parametrize("target", ("sm_90a", "gfx950"))
@pytest.mark.parametrize("n,align", [(200, 16), (203, 4)])
def test_tiles_mask_is_what_load_reads(target, n, align):
    rng = np.random.default_rng()
    m = 4
    x = rng.standard_normal((m, n)).astype(np.float32)
    y = np.full((4, 256), np.nan, np.float32)
    masked.interpret[(1,)](x, y, m, n, ALIGN=align, target=target)
    want = np.full((4, 256), -1.0, np.float32)
    want[:m - 1, :n - 8] = 2 * x[1:, 8:]
    np.testing.assert_array_equal(y, want)


def test_tiles_mask_errors_name_the_fix():
    @kiln.kernel(num_threads=64)
    def bad(x: kiln.Tensor[f32, 2]):
        kiln.tiles.mask(x, blocked((1, 256), 64))

    with pytest.raises(kiln.KilnTypeError, match="GlobalTile"):
        bad.trace(np.zeros((1, 256), np.float32), target="sm_90a")


@pytest.mark.gpu
@pytest.mark.parametrize("split,grid", [(2, 6), (8, 8)])
def test_cluster_reduce_on_gpu(split, grid):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    m, part = 37, 256
    n = split * part - 5
    x = torch.randn(m, n, device="cuda")
    out = torch.full_like(x, float("nan"))
    split_reduce_kernel("sum", 2)[(grid,)](x, out, m, n, grid, PART=part, THREADS=64,
                                          SPLIT=split, FILL=0.0)
    want = 1.5 * x.double().sum(1, keepdim=True)
    np.testing.assert_allclose(out.cpu().numpy(), np.broadcast_to(want.cpu().numpy(), x.shape),
                               rtol=1e-4, atol=1e-3)


@kiln.kernel(num_threads=128)
def two_sums(x: kiln.Tensor[f32, 2], out: kiln.Tensor[f32, 2], n: i32, SPLIT: kiln.constexpr):
    first = kiln.cluster_rank(SPLIT) * 512
    tv = blocked((2, 512), 128, vec=4)
    t = kiln.load(kiln.GlobalTile(x, (2, 512), (0, first), col_end=n), tv)
    s1, s2 = kiln.reduce((t, t * t), "sum", axis=1, cluster=True)
    kiln.copy(t * 0.0 + s1 + s2 * 1000.0, kiln.GlobalTile(out, (2, 512), (0, first), col_end=n))


@pytest.mark.parametrize("target,split", [("sm_90a", 1), ("gfx950", 1), ("sm_90a", 2)])
def test_reduce_of_a_tuple_is_each_reduce(target, split):
    rng = np.random.default_rng()
    n = 512 * split - 9
    x = rng.standard_normal((2, n)).astype(np.float32)
    out = np.full_like(x, np.nan)
    two_sums.interpret[(split,)](x, out, n, SPLIT=split, target=target)
    x64 = x.astype(np.float64)
    want = x64.sum(1, keepdims=True) + 1000.0 * (x64 * x64).sum(1, keepdims=True)
    np.testing.assert_allclose(out, np.broadcast_to(want, x.shape), rtol=1e-5)


def test_reduce_of_a_tuple_shares_one_shared_stage():
    x = np.zeros((2, 512), np.float32)
    text = two_sums.trace(x, x, 512, SPLIT=1, target="sm_90a").module_asm
    assert text.count("gpu.barrier") == 2   # one store-partials / read stage for both sums


def test_reduce_of_a_tuple_errors_name_the_fix():
    @kiln.kernel(num_threads=128)
    def mixed(x: kiln.Tensor[f32, 2]):
        t = kiln.load(kiln.GlobalTile(x, (1, 512)), blocked((1, 512), 128, vec=4))
        u = kiln.load(kiln.GlobalTile(x, (1, 512)), blocked((1, 512), 128, vec=2))
        kiln.reduce((t, u), "sum", axis=1)

    with pytest.raises(kiln.KilnValueError, match="one layout"):
        mixed.trace(np.zeros((1, 512), np.float32), target="sm_90a")
