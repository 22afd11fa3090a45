"""TiledMmaLoader: per-lane LDS addresses against numpy models of the tile, the ds_read_tr
semantics and the MFMA fragment layouts; errors; the gfx950 instructions and offsets."""

import numpy as np
import pytest

import kiln
from kiln.core.errors import KilnTypeError, KilnValueError, TargetError, UnsupportedError
from kiln.amd.loader import TiledMmaLoader, transpose_read_model
from kiln.mfma import operand_b_layout
from kiln.swizzle import AMD_LDS_TWO_XOR, Swizzle

LANES = np.arange(64)
rng = np.random.default_rng()


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """These kernels differ only in the Python callables they close over, which the compile
    cache key cannot see: compile each one afresh."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")


def _lds_holding(tile: np.ndarray, loader: TiledMmaLoader) -> np.ndarray:
    """A flat LDS image where logical element ``(r, c)`` sits at ``swizzled(r * cols + c)``."""
    rows, cols = tile.shape
    lds = np.full(rows * cols, np.nan)
    logical = np.arange(rows * cols)
    lds[loader.swizzled(logical)] = tile.reshape(-1)
    return lds


def _read(lds, offsets, width):
    """What each lane's plain ``width``-element LDS read fetches: ``[64, width]``."""
    return lds[np.asarray(offsets)[:, None] + np.arange(width)[None, :]]


# On byte offsets: 16-byte chunks XOR row bits (kept whole, as 16-byte LDS reads need).
BYTE_SWIZZLES = [None, Swizzle(3, 4, 3), Swizzle(2, 4, 3)]


def _in_elements(swizzle, dtype):
    return None if swizzle is None else swizzle.to_elements(dtype.itemsize)


@pytest.mark.parametrize("dtype,shape", [(kiln.bf16, (32, 32, 16)), (kiln.f16, (16, 16, 32)),
                                         (kiln.bf16, (32, 32, 8)), (kiln.f8e4m3, (16, 16, 128)),
                                         (kiln.f8e5m2, (32, 32, 64))])
@pytest.mark.parametrize("swizzle", BYTE_SWIZZLES, ids=str)
def test_load_b_addresses_give_the_mfma_b_fragment(dtype, shape, swizzle):
    _, n, k = shape
    loader = TiledMmaLoader(dtype, shape, swizzle=_in_elements(swizzle, dtype))
    tile = rng.standard_normal((4 * n, 2 * k + 64))  # N x K, K contiguous
    lds = _lds_holding(tile, loader)
    n0, k0 = n, k
    offsets = loader.b_offsets(LANES, tile.shape[1], n0, k0)
    piece = min(loader.values_per_lane, 16 // dtype.itemsize)
    assert len(offsets) == loader.values_per_lane // piece  # fp8 32-byte fragments: 2 halves
    fragment = np.concatenate([_read(lds, off, piece) for off in offsets], axis=1)
    krow, ncol = operand_b_layout(k, n).coords()
    assert np.array_equal(fragment, tile[n0 + ncol, k0 + krow])


def test_two_swizzles_compose_in_order():
    sw = Swizzle(1, 3, 2)
    both = TiledMmaLoader(kiln.bf16, (32, 32, 16), swizzle=sw, swizzle2=Swizzle(1, 4, 2))
    offsets = np.arange(4096)
    assert np.array_equal(both.swizzled(offsets), Swizzle(1, 4, 2)(sw(offsets)))
    elementwise = AMD_LDS_TWO_XOR.to_elements(2)
    loader = TiledMmaLoader(kiln.bf16, (32, 32, 8), swizzle=elementwise.first,
                            swizzle2=elementwise.second)
    assert np.array_equal(loader.swizzled(offsets), elementwise(offsets))


def test_transpose_read_model_is_the_isa_byte_transpose():
    """8-bit: even lane 2p / odd lane 2p+1 read 8 depths of key p; afterwards lane 2p holds the
    8 keys at depth p, lane 2p+1 at depth p + 8 (CDNA4 ISA, DS_READ_B64_TR_B8)."""
    keys, depths = np.meshgrid(np.arange(8), np.arange(16), indexing="ij")
    v = keys * 100 + depths  # V[key, depth]
    loaded = np.zeros((64, 8), dtype=np.int64)
    for lane in range(16):
        pair, odd = lane // 2, lane % 2
        loaded[lane] = v[pair, 8 * odd:8 * odd + 8]
    out = transpose_read_model(loaded)
    for lane in range(16):
        depth = lane // 2 + 8 * (lane % 2)
        assert list(out[lane]) == [key * 100 + depth for key in range(8)]


@pytest.mark.parametrize("dtype,shape", [(kiln.bf16, (32, 32, 16)), (kiln.f16, (16, 16, 32))])
@pytest.mark.parametrize("swizzle", BYTE_SWIZZLES, ids=str)
def test_load_b_tr_addresses_give_the_documented_fragment(dtype, shape, swizzle):
    _, n, k = shape
    loader = TiledMmaLoader(dtype, shape, swizzle=_in_elements(swizzle, dtype))
    tile = rng.standard_normal((2 * k, 2 * n))  # K x N, N contiguous
    lds = _lds_holding(tile, loader)
    k0, n0 = k, n
    halves = [transpose_read_model(_read(lds, off, 4))
              for off in loader.b_tr_offsets(LANES, tile.shape[1], k0, n0)]
    fragment = np.concatenate(halves, axis=1)
    krow, ncol = loader.b_tr_layout().coords()
    assert np.array_equal(fragment, tile[k0 + krow, n0 + ncol])
    # K rows are exactly the MFMA's; columns are permuted inside each 16-column block.
    assert np.array_equal(krow, operand_b_layout(k, n).coords()[0])
    assert np.array_equal(ncol[:, 0] % 16, 4 * (LANES % 4) + (LANES % 16) // 4)


@pytest.mark.parametrize("swizzle", [None, Swizzle(3, 3, 3)], ids=str)
def test_load_v_fp8_strip_gives_32_keys_at_a_butterfly_depth(swizzle):
    loader = TiledMmaLoader(kiln.f8e4m3, (16, 16, 128), swizzle=swizzle)
    v = rng.standard_normal((256, 64))  # keys x depth
    lds = _lds_holding(v, loader)
    key0, depth0 = 128, 32
    reads = [transpose_read_model(_read(lds, off, 8))
             for off in loader.v_fp8_strip_offsets(LANES, v.shape[1], key0, depth0)]
    fragment = np.concatenate(reads, axis=1)
    depth, key = loader.v_fp8_strip_layout().coords()
    assert np.array_equal(fragment, v[key0 + key, depth0 + depth])
    butterfly = (LANES % 16) // 2 + 8 * (LANES % 2)
    assert np.array_equal(depth[:, 0], butterfly)
    assert np.array_equal(key, 32 * (LANES[:, None] // 16) + np.arange(32)[None, :])


@pytest.mark.parametrize("swizzle", [None, Swizzle(3, 3, 3)], ids=str)
def test_load_v_fp8_strip_32x32x64_follows_the_seed_coordinates(swizzle):
    loader = TiledMmaLoader(kiln.f8e4m3, (32, 32, 64), swizzle=swizzle)
    rel_key, hw_key_shift, depth_base = loader.v_fp8_strip_coords(LANES)
    # The seed's per-lane coordinates, written out from its description.
    seed = [(8 * ((lane % 16) // 8) + ((lane % 16) // 2) % 4, 4 if lane >= 32 else 0,
             [0, 8, 16, 24][2 * ((lane // 16) % 2) + lane % 2]) for lane in range(64)]
    assert [tuple(int(x) for x in c) for c in zip(rel_key, hw_key_shift, depth_base)] == seed
    v = rng.standard_normal((192, 96))  # keys x depth
    lds = _lds_holding(v, loader)
    key0, depth0 = 64, 32
    offsets = loader.v_fp8_strip_offsets(LANES, v.shape[1], key0, depth0)
    for c, off in enumerate(offsets):  # key_base 0, 16, 32, 48
        unswizzled = (key0 + 16 * c + rel_key + hw_key_shift) * v.shape[1] + depth0 + depth_base
        assert np.array_equal(off, loader.swizzled(unswizzled))
    fragment = np.concatenate([transpose_read_model(_read(lds, off, 8)) for off in offsets],
                              axis=1)
    depth, key = loader.v_fp8_strip_layout().coords()
    assert np.array_equal(fragment, v[key0 + key, depth0 + depth])
    # Keys: the 32x32 accumulator's rows of values v % 16 in lane l, two accumulators.
    acc_row = 8 * ((np.arange(32) % 16) // 4) + 4 * (LANES[:, None] // 32) + np.arange(32) % 4
    assert np.array_equal(key, acc_row + 32 * (np.arange(32)[None, :] // 16))
    assert np.array_equal(depth[:, 0], depth_base + (LANES % 16) // 2)
    assert sorted(depth[:32, 0]) == list(range(32))  # each depth exactly once per half-wave


def test_loader_rejects_bad_parameters():
    with pytest.raises(UnsupportedError, match="single-block MFMA shape"):
        TiledMmaLoader(kiln.bf16, (32, 16, 8))
    with pytest.raises(KilnTypeError, match="must be a kiln.swizzle.Swizzle"):
        TiledMmaLoader(kiln.bf16, (32, 32, 16), swizzle=3)
    with pytest.raises(UnsupportedError, match=r"b_tr_layout of bf16 \(32, 32, 8\)"):
        TiledMmaLoader(kiln.bf16, (32, 32, 8)).b_tr_layout()
    with pytest.raises(UnsupportedError, match="v_fp8_strip_layout of f8e4m3"):
        TiledMmaLoader(kiln.f8e4m3, (32, 32, 128)).v_fp8_strip_layout()


def _compile(body, dtype, chip="gfx950", shape=(64, 64)):
    @kiln.kernel
    def loads(x: kiln.Tensor[dtype], out: kiln.Tensor[dtype]):
        tile = kiln.shared(shape, dtype)
        tile.store(kiln.thread_id(0) // 8, (kiln.thread_id(0) % 8) * 8,
                   x.load(kiln.thread_id(0) * 8, width=8))
        kiln.barrier()
        frag = body(tile)
        out.store(kiln.lane_id() * frag.shape[0], frag)

    args = (np.empty(4, dtype.numpy), np.empty(4, dtype.numpy))
    return loads.compile(*args, target=chip, num_warps=1)


@pytest.mark.lower
def test_gfx950_instructions_fold_the_immediate_offset():
    b = TiledMmaLoader(kiln.bf16, (32, 32, 16), swizzle=Swizzle(3, 3, 3))
    asm = _compile(lambda t: b.load_b(t, imm_offset_bytes=1024)[0], kiln.bf16).asm["amdgcn"]
    assert "ds_read_b128" in asm and "offset:1024" in asm
    tr = TiledMmaLoader(kiln.bf16, (16, 16, 32))
    compiled = _compile(lambda t: tr.load_b_tr(t, imm_offset_bytes=256), kiln.bf16)
    assert "amdgpu.transpose_load" in compiled.asm["kiln"]
    assert 'kiln.async = "lgkmcnt"' in compiled.asm["kiln"]
    lines = [ln for ln in compiled.asm["amdgcn"].splitlines() if "ds_read_b64_tr_b16" in ln]
    # half 1 reads 4 K rows (4 * 128 bytes) further: LLVM folds that into the offset too
    assert [ln.split()[-1] for ln in lines] == ["offset:256", "offset:768"]
    v = TiledMmaLoader(kiln.f8e4m3, (16, 16, 128))
    asm = _compile(lambda t: v.load_v_fp8_strip(t, imm_offset_bytes=64), kiln.f8e4m3,
                   shape=(128, 64)).asm["amdgcn"]
    assert asm.count("ds_read_b64_tr_b8") == 4
    v32 = TiledMmaLoader(kiln.f8e4m3, (32, 32, 64))
    asm = _compile(lambda t: v32.load_v_fp8_strip(t, key0=64, depth0=32), kiln.f8e4m3,
                   shape=(128, 64)).asm["amdgcn"]
    assert asm.count("ds_read_b64_tr_b8") == 4
    fp8 = TiledMmaLoader(kiln.f8e4m3, (16, 16, 128))
    asm = _compile(lambda t: fp8.load_b(t)[0], kiln.f8e4m3).asm["amdgcn"]
    assert asm.count("ds_read_b128") == 2  # the two 16-byte halves of a 32-byte fragment


@pytest.mark.lower
def test_loads_reject_misuse(marker_line):
    tr = TiledMmaLoader(kiln.bf16, (32, 32, 16))
    with pytest.raises(TargetError, match="needs gfx950"):
        _compile(lambda t: tr.load_b_tr(t), kiln.bf16, chip="gfx942")
    with pytest.raises(KilnValueError, match="multiple of 8"):
        _compile(lambda t: tr.load_b_tr(t, imm_offset_bytes=6), kiln.bf16)
    bad_swizzle = TiledMmaLoader(kiln.bf16, (32, 32, 16), swizzle=Swizzle(2, 1, 3))
    with pytest.raises(UnsupportedError, match="permutes inside such runs"):
        _compile(lambda t: bad_swizzle.load_b(t)[0], kiln.bf16)
    wrong_dtype = TiledMmaLoader(kiln.f16, (32, 32, 16))
    with pytest.raises(KilnTypeError, match="the LDS tile holds bf16"):
        _compile(lambda t: wrong_dtype.load_b(t)[0], kiln.bf16)
    with pytest.raises(UnsupportedError, match="load_v_fp8_strip of bf16"):
        _compile(lambda t: tr.load_v_fp8_strip(t), kiln.bf16)
