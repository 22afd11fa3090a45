"""OnlineSoftmax: every method through the CPU interpreter on both vendors' score tiles.

Score tiles are fed per lane in their fragment layout (the host permutes them with the
layout's coordinates) and the kernel runs the online recurrence over several KV tiles with an
elementwise stand-in for P @ V (``o += p * v``), so the float64 reference is
``o[r, c] = sum_t exp2(s_t[r, c] - M_r) v_t[r, c] / Z_r`` with ``Z_r`` the row's full
denominator. Layouts: gfx950 MFMA 32x32 ``S^T`` in the col_l view (``q_axis="col"``) and the
Hopper WGMMA m64n64 accumulator (``q_axis="row"``).
"""

import numpy as np
import pytest

import kiln
from kiln import layout as L
from kiln.kernels.attention.online_softmax import OnlineSoftmax
from kiln.tiles import RegTile

# name -> (fragment layout, grid, q_axis, target, num_warps)
TILES = {
    "mfma32_colL": (L.mfma_32x32_accumulator(), (2, 1), "col", "gfx950", 1),
    "wgmma_m64n64": (L.wgmma_m64_accumulator(64), (1, 1), "row", "sm_90a", 4),
}
SENTINEL = -10000.0  # a mask value in log2 units: its first growth is huge


def _frag_coords(name):
    tv, (gm, gn), *_ = TILES[name]
    rows, cols = tv.coords()                              # [lanes, values]
    fr, fc = tv.tile
    return [(i * fr + rows, j * fc + cols) for i in range(gm) for j in range(gn)], tv


def to_lanes(name, tiles: np.ndarray) -> np.ndarray:
    """``[T, R, C]`` matrices -> flat ``[T, frag, lane, value]`` in the fragment layout."""
    coords, _ = _frag_coords(name)
    return np.stack([np.stack([t[r, c] for r, c in coords]) for t in tiles]).ravel()


def from_lanes(name, flat: np.ndarray, shape) -> np.ndarray:
    coords, tv = _frag_coords(name)
    out = np.full(shape, np.nan)
    data = flat.reshape(len(coords), tv.num_threads, tv.num_values)
    for f, (r, c) in enumerate(coords):
        out[r, c] = data[f]
    return out


def tile_shape(name):
    tv, (gm, gn), *_ = TILES[name]
    return gm * tv.tile[0], gn * tv.tile[1]


def make_kernel(name, *, tiles, cadence, att=kiln.f32, scaled=None, sink=None, epilogue=0,
                empty=False):
    """A kernel running ``tiles`` KV tiles through the recurrence; writes o and the state.

    ``cadence``: "unconditional", "lazy" (threshold 8) or "lazy_deferred" (the same decision
    by ``lazy_scale_decision``, o rescaled after it under ``fired``); ``scaled``: log2_scale for the raw
    score methods; ``sink``: sink score in log2 units; ``epilogue``: extra unconditional
    norm rescales after the loop (the tail clusters of the gfx950 epilogue); ``empty``: start
    from ``reseed_empty`` and take tile 0 through the cadence too (the gfx950 prefill's way).
    """
    tv, grid, q_axis, _, _ = TILES[name]
    nv, frags = tv.num_values, grid[0] * grid[1]
    Softmax = OnlineSoftmax[att]

    @kiln.kernel
    def run(s_in: kiln.Tensor[att], v_in: kiln.Tensor[kiln.f32], o_out: kiln.Tensor[kiln.f32],
            state_out: kiln.Tensor[kiln.f32], fired_out: kiln.Tensor[kiln.i32]):
        lane = kiln.thread_id(0)

        def load(src, t):
            return RegTile([src.load(((t * frags + f) * tv.num_threads + lane) * nv, width=nv)
                            for f in range(frags)], tv, grid)

        s = load(s_in, 0)
        sm = Softmax.init(s, q_axis=q_axis)
        if sink is not None:
            sm.reseed_with_sink(sink)
        elif empty:
            sm.reseed_empty()
        o = RegTile.full(tv, grid, 0.0)
        for t in kiln.static_range(tiles):
            s = load(s_in, t)
            if t == 0 and sink is None and not empty:
                s = sm.seed_tile0(s) if scaled is None else sm.seed_tile0_scaled(s, scaled)
                fired = True
            else:
                if scaled is None:
                    sm.col_max_acc(s)
                else:
                    sm.col_max_acc_scaled(s, scaled)
                if cadence == "lazy":
                    fired, o = sm.lazy_rescale_decision(o, 8.0)
                elif cadence == "lazy_deferred":  # Hopper: o rescaled later, under the flag
                    fired = sm.lazy_scale_decision(8.0)
                else:
                    sm.update_scale_unconditional()
                    o = sm.rescale_output(o)
                    fired = True
                s = sm.sub_max(s) if scaled is None else sm.sub_max_scaled(s, scaled)
                if cadence == "lazy_deferred":
                    if fired:
                        o = sm.rescale_output(o)
            p = s.exp2()
            if cadence in ("lazy", "lazy_deferred"):
                sm.apply_norm_rescale_if_pending(fired)
            else:
                sm.apply_unconditional_norm_rescale()
            sm.col_sum_acc(p)
            p32 = p.cast(kiln.f32)
            o = o + p32 * load(v_in, t)
            fired_out[t * tv.num_threads + lane] = kiln.cast(fired, kiln.i32)
        for _ in kiln.static_range(epilogue):
            sm.apply_unconditional_norm_rescale()
        o = sm.normalize_output(o)
        for f in range(frags):
            o_out.store((f * tv.num_threads + lane) * nv, o.fragments[f])
        lse = sm.log_sum_exp()
        fields = [sm.max_vec, sm.max_vec_prev, sm.norm_vec, sm.scale_vec, lse]
        per_field = sum(len(line) for line in sm.max_vec.values)
        for k, vec in enumerate(fields):
            flat = [x for line in vec.values for x in line]
            for n, x in enumerate(flat):
                state_out[(k * tv.num_threads + lane) * per_field + n] = x

    return run, per_field_count(name)


def per_field_count(name):
    tv, grid, q_axis, *_ = TILES[name]
    rows, _ = (tv if q_axis == "row" else L.transpose(tv)).coords()
    groups = len({tuple(rows[:, v]) for v in range(tv.num_values)})
    return groups * (grid[0] if q_axis == "row" else grid[1])


def state_rows(name):
    """``[lane, slot]`` -> query row index that lane's state slot describes."""
    tv, grid, q_axis, *_ = TILES[name]
    t = tv if q_axis == "row" else L.transpose(tv)
    rows, _ = t.coords()
    keys, first = {}, []
    for v in range(tv.num_values):
        if tuple(rows[:, v]) not in keys:
            keys[tuple(rows[:, v])] = v
            first.append(v)
    lines = grid[0] if q_axis == "row" else grid[1]
    return np.concatenate([rows[:, first] + line * t.tile[0] for line in range(lines)], axis=1)


def run_case(name, s_tiles, v_tiles, **options):
    tv, grid, q_axis, target, warps = TILES[name]
    att = options.get("att", kiln.f32)
    kernel, per_field = make_kernel(name, tiles=len(s_tiles), **options)
    s_flat = to_lanes(name, s_tiles).astype(att.numpy)
    v_flat = to_lanes(name, v_tiles).astype(np.float32)
    o_flat = np.full(v_flat.size // len(v_tiles), np.nan, np.float32)
    state = np.full(5 * tv.num_threads * per_field, np.nan, np.float32)
    fired = np.full(len(s_tiles) * tv.num_threads, -1, np.int32)
    kernel.interpret[(1,)](s_flat, v_flat, o_flat, state, fired, num_warps=warps, target=target)
    o = from_lanes(name, o_flat, tile_shape(name))
    state = state.reshape(5, tv.num_threads, per_field)
    return o, state, fired.reshape(len(s_tiles), tv.num_threads)


def reference(name, s_tiles, v_tiles, *, scaled=None, sink=None):
    """float64 o and natural-log LSE per query row (query rows first)."""
    q_axis = TILES[name][2]
    s = np.asarray(s_tiles, np.float64) * (1.0 if scaled is None else scaled)
    v = np.asarray(v_tiles, np.float64)
    if q_axis == "col":
        s, v = s.transpose(0, 2, 1), v.transpose(0, 2, 1)
    m = s.max(axis=(0, 2))
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp2(s - m[None, :, None])
    z = p.sum(axis=(0, 2)) + (0.0 if sink is None else np.exp2(sink - m))
    o = (p * v).sum(axis=0) / z[:, None]
    lse = (m + np.log2(z)) * np.log(2.0)
    return (o if q_axis == "row" else o.T), lse


def random_tiles(name, n, rng, spread=4.0):
    shape = tile_shape(name)
    return rng.standard_normal((n,) + shape) * spread, rng.standard_normal((n,) + shape)


def check_lse(name, state, lse_ref):
    rows = state_rows(name)
    np.testing.assert_allclose(state[4], lse_ref[rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(TILES))
@pytest.mark.parametrize("cadence", ["unconditional", "lazy", "lazy_deferred"])
def test_recurrence_matches_float64(name, cadence, rng):
    s, v = random_tiles(name, 3, rng)
    s[1] += 12.0 * rng.random(s.shape[1:])         # some rows grow past the lazy threshold
    o, state, _ = run_case(name, s, v, cadence=cadence)
    o_ref, lse_ref = reference(name, s, v)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    check_lse(name, state, lse_ref)


@pytest.mark.parametrize("name", sorted(TILES))
def test_scaled_methods_fold_the_scale(name, rng):
    s, v = random_tiles(name, 3, rng, spread=10.0)
    log2_scale = float(rng.uniform(0.05, 0.3)) * np.log2(np.e)
    o, state, _ = run_case(name, s, v, cadence="lazy", scaled=log2_scale)
    o_ref, lse_ref = reference(name, s, v, scaled=log2_scale)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    check_lse(name, state, lse_ref)


@pytest.mark.parametrize("name", sorted(TILES))
def test_sink_seeds_the_denominator(name, rng):
    s, v = random_tiles(name, 2, rng)
    sink = float(rng.uniform(1.0, 3.0))
    o, state, _ = run_case(name, s, v, cadence="unconditional", sink=sink)
    o_ref, lse_ref = reference(name, s, v, sink=sink)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    check_lse(name, state, lse_ref)


@pytest.mark.parametrize("name", sorted(TILES))
@pytest.mark.parametrize("cadence", ["unconditional", "lazy", "lazy_deferred"])
def test_empty_start_takes_very_negative_rows_against_their_own_max(name, cadence, rng):
    """reseed_empty, then every tile through the cadence: rows whose scores all sit near an
    offset from 0 down to -1e4 * log2(e), and rows whose first tile is fully masked, come
    out as in float64 (a max starting at 0 underflows the denominators below about -126)."""
    s, v = random_tiles(name, 3, rng)
    q_axis = TILES[name][2]
    rows = s.shape[1] if q_axis == "row" else s.shape[2]
    offsets = -np.geomspace(1.0, 1.0e4 * np.log2(np.e), rows)
    offsets[::4] = 0.0
    s = s + (offsets[None, :, None] if q_axis == "row" else offsets[None, None, :])
    masked = np.zeros(s.shape[1:], bool)
    if q_axis == "row":
        masked[1::3, :] = True
    else:
        masked[:, 1::3] = True
    s[0][masked] = -np.inf
    s = s.astype(np.float32).astype(np.float64)     # the values the kernel sees
    o, state, _ = run_case(name, s, v, cadence=cadence, empty=True)
    o_ref, lse_ref = reference(name, s, v)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    check_lse(name, state, lse_ref)


@pytest.mark.parametrize("name", sorted(TILES))
def test_f16_scores(name, rng):
    s, v = random_tiles(name, 2, rng)
    s = s.astype(np.float16).astype(np.float64)     # the values the kernel sees
    o, _, _ = run_case(name, s, v, cadence="lazy", att=kiln.f16)
    o_ref, _ = reference(name, s, v)
    np.testing.assert_allclose(o, o_ref, rtol=5e-3, atol=5e-3)   # p is rounded to f16


@pytest.mark.parametrize("name", sorted(TILES))
@pytest.mark.parametrize("cadence", ["lazy", "lazy_deferred"])
def test_skip_path_resets_scale_after_sentinel_growth(name, cadence, rng):
    """Tile 0 fully masked (sentinel), tile 1 grows by ~10000 (fires with scale ~ 0), tile 2
    grows by < 8 (skips): scale must be exactly 1 again, so three epilogue rescales of the
    norm are identities and the output is finite and right."""
    s, v = random_tiles(name, 3, rng, spread=1.0)
    s[0] = SENTINEL
    s[2] = s[1] + rng.uniform(0.0, 2.0, s.shape[1:])
    o, state, fired = run_case(name, s, v, cadence=cadence, epilogue=3)
    assert fired[1].all() and not fired[2].any()
    np.testing.assert_array_equal(state[3], 1.0)                 # scale_vec
    np.testing.assert_array_equal(state[0], state[1])            # max rolled back to prev
    o_ref, lse_ref = reference(name, s, v)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    check_lse(name, state, lse_ref)


@pytest.mark.parametrize("name", sorted(TILES))
@pytest.mark.parametrize("cadence", ["lazy", "lazy_deferred"])
def test_lazy_decision_is_warp_uniform(name, cadence, rng):
    """Only query row 0 grows past the threshold; every lane of its warp fires (its max is
    not rolled back), lanes of other warps keep their rolled-back max."""
    s, v = random_tiles(name, 2, rng, spread=0.5)
    q_axis = TILES[name][2]
    grow = np.zeros(tile_shape(name))
    if q_axis == "row":
        grow[0] = 20.0
    else:
        grow[:, 0] = 20.0
    s[1] = s[0] + grow + 1.0
    _, state, fired = run_case(name, s, v, cadence=cadence)
    warp = 32 if TILES[name][3].startswith("sm") else 64
    assert fired[1, :warp].all()
    q_max = (s.max(axis=(0, 2)) if q_axis == "row" else s.max(axis=(0, 1)))
    rows = state_rows(name)
    np.testing.assert_allclose(state[0, :warp], q_max[rows[:warp]], rtol=1e-6)
    if state.shape[1] > warp:                    # WGMMA: warps 1..3 skipped
        assert not fired[1, warp:].any()
        np.testing.assert_allclose(state[0, warp:], s[0].max(axis=1)[rows[warp:]], rtol=1e-6)


def test_score_methods_reject_another_dtype():
    tv, grid, *_ = TILES["wgmma_m64n64"]

    @kiln.kernel
    def wrong(out: kiln.Tensor[kiln.f32]):
        s = RegTile.full(tv, grid, 1.0, kiln.f16)
        sm = OnlineSoftmax[kiln.f32].init(RegTile.full(tv, grid, 0.0), q_axis="row")
        sm.col_max_acc(s)

    with pytest.raises(kiln.KilnTypeError, match="f32 score tiles, got a f16 RegTile") as info:
        wrong.trace(np.zeros(4, np.float32), target="sm_90a", num_warps=4)
    assert "sm.col_max_acc(s)" in str(info.value)


def test_unsupported_att_dtype_and_axis():
    with pytest.raises(kiln.UnsupportedError, match="bf16"):
        OnlineSoftmax[kiln.bf16]
    tv, grid, *_ = TILES["wgmma_m64n64"]

    @kiln.kernel
    def bad_axis(out: kiln.Tensor[kiln.f32]):
        OnlineSoftmax.init(RegTile.full(tv, grid, 0.0), q_axis="kv")

    with pytest.raises(kiln.KilnValueError, match="q_axis"):
        bad_axis.trace(np.zeros(4, np.float32), target="sm_90a", num_warps=4)


@pytest.mark.lower
@pytest.mark.parametrize("name", sorted(TILES))
def test_lazy_cadence_lowers_to_machine_code(name):
    """The whole recurrence (warp vote: one vote.sync on NVIDIA, a shuffle OR on AMD; scf.if
    rescale) reaches cubin/hsaco."""
    tv, grid, q_axis, target, warps = TILES[name]
    kernel, per_field = make_kernel(name, tiles=2, cadence="lazy", scaled=0.125 * np.log2(np.e))
    frags = grid[0] * grid[1] * tv.num_threads * tv.num_values
    args = (np.zeros(2 * frags, np.float32), np.zeros(2 * frags, np.float32),
            np.zeros(frags, np.float32), np.zeros(5 * tv.num_threads * per_field, np.float32),
            np.zeros(2 * tv.num_threads, np.int32))
    compiled = kernel.compile(*args, target=target, num_warps=warps)
    final = "cubin" if target.startswith("sm") else "obj"
    assert compiled.asm[final]
    if target.startswith("sm"):
        assert "vote.sync.any.pred" in compiled.asm["ptx"]
