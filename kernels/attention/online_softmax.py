"""``OnlineSoftmax``: the FlashAttention-2 row state shared by the prefill and decode kernels.

The state is four f32 per-query-row vectors, whatever the attention tile's dtype:

==================  ==========================================================================
``max_vec``         running row max of the scores, in log2 units (scores arrive prescaled by
                    ``scale * log2(e)``, or raw with the ``*_scaled`` methods)
``max_vec_prev``    the max the output accumulator is currently expressed against
``norm_vec``        running denominator ``sum exp2(s - max)``
``scale_vec``       pending rescale ``exp2(max_prev - max_new)``; exactly 1 whenever no rescale
                    fired, so ``norm_vec *= scale_vec`` is then an identity
==================  ==========================================================================

Each field is a :class:`kiln.tiles.TileVector` shaped like one reduction of the attention
tile along its KV axis, so the same struct serves both vendors' accumulators:

- gfx950 MFMA 32x32, ``S^T = K Q^T`` in the ``col_l`` view: a lane owns one column = one query
  row, the KV axis is the tile's rows: ``init(s, q_axis="col")``, one scalar per lane per
  grid column (the two half-waves sharing a column hold identical copies).
- NVIDIA WGMMA m64nN, ``S = Q K^T``: a thread holds 2 query rows, the KV axis is the tile's
  columns: ``init(s, q_axis="row")``, a 2-wide state per thread per grid row.

``att_dtype`` (``OnlineSoftmax[kiln.f32]``, the default, or ``OnlineSoftmax[kiln.f16]`` for the
fp8 path with KV >= 128) is the exact dtype every score-tile method accepts; anything else is a
KilnTypeError at the call site. The output accumulator ``o`` is always an f32 RegTile.
Reductions of an f16 tile widen it to f32 first (cross-lane shuffles move 32-bit values).

Kiln tiles are SSA values: methods that change a tile return it (``s = sm.sub_max(s)``,
``o = sm.rescale_output(o)``). Rebinding the name is what carries it through ``kiln.range``;
no second accumulator is materialised (``normalize_output`` multiplies ``o`` by one reciprocal
per row).

Lifetimes, as the kernels use the methods (``s``: scores of KV tile ``j``, ``o``: the f32
output accumulator; the lazy cadence is the gfx950 MhaPrefillV2 main loop, threshold 8)::

    sm = OnlineSoftmax[kiln.f32].init(s, q_axis="col")  # or sm.reseed_with_sink(sink_log2)
    s = sm.seed_tile0(s)            # tile 0: max = prev = max(s); s -= max
    p = s.exp2(); sm.col_sum_acc(p); o = P0 @ V0
    for j in kiln.range(1, n):      # every later tile, unconditional cadence (Hopper)
        sm.col_max_acc(s)           # max = max(prev, max(s))
        sm.update_scale_unconditional()          # scale = exp2(prev - max); prev = max
        o = sm.rescale_output(o)                 # o *= scale
        s = sm.sub_max(s); p = s.exp2()
        sm.apply_unconditional_norm_rescale()    # norm *= scale
        sm.col_sum_acc(p); o += P @ V
    #   lazy cadence instead of the two rescale steps:
    #     fired, o = sm.lazy_rescale_decision(o, 8.0)   (skip: max rolled back, scale = 1)
    #     ... sm.apply_norm_rescale_if_pending(fired)
    o = sm.normalize_output(o)      # o /= norm; norm_vec lives until here
    lse = sm.log_sum_exp()          # natural-log LSE for partials / return_lse

``max_vec``, ``max_vec_prev`` and ``scale_vec`` die at the last rescale; ``norm_vec`` lives to
``normalize_output``. With a sink, ``reseed_with_sink`` replaces ``seed_tile0``'s role: tile 0
then goes through the ``col_max_acc`` cadence like every other tile; without one,
``reseed_empty`` does (max = ``EMPTY_MAX``: the first key always fires the rescale).
"""

from __future__ import annotations

import math
from typing import Any

import kiln
from kiln import layout as kiln_layout
from kiln.tiles import RegTile, TileVector

LN2 = math.log(2.0)
# The running max of a row that has seen no key (log2 units): finite, so EMPTY_MAX - EMPTY_MAX
# is 0 (no inf - inf), and exp2(EMPTY_MAX - m) is 0 for any real score m, so the first key's
# rescale wipes nothing that exists.
EMPTY_MAX = -1.0e30
SUPPORTED_ATT_DTYPES = (kiln.f32, kiln.f16)
Q_AXES = ("row", "col")


def _call_site() -> kiln.core.errors.SourceLoc | None:
    """The kernel line that called into this module: errors point there, not at the method."""
    return kiln.core.errors.caller_location(callers_of=__file__)


def _value_groups(tv: kiln_layout.ThreadValueLayout) -> tuple[int, ...]:
    """Which of a fragment's values share a row in every lane (the layout's row groups):
    the structure of a row reduction's TileVector."""
    rows, _ = tv.coords()
    keys: dict[tuple, int] = {}
    return tuple(keys.setdefault(tuple(rows[:, v]), len(keys)) for v in range(tv.num_values))


def _full_vector(like: RegTile, q_axis: str, value: float) -> TileVector:
    """A TileVector of ``q_axis`` reductions of ``like``, every scalar ``value`` (f32)."""
    tv = like.layout if q_axis == "row" else kiln_layout.transpose(like.layout)
    group_of = _value_groups(tv)
    lines = like.grid[0] if q_axis == "row" else like.grid[1]
    scalar = kiln.values.constant(value, kiln.f32)
    return TileVector([[scalar] * (max(group_of) + 1) for _ in range(lines)], group_of, q_axis)


def _fragment_operand(vec: TileVector, tile: RegTile, i: int, j: int) -> kiln.Value:
    """``vec`` broadcast onto fragment ``(i, j)`` of ``tile``, in the tile's dtype."""
    frag = vec.fragment(i if vec.axis == "row" else j, tile.layout.num_values)
    return frag if frag.dtype is tile.dtype else kiln.cast(frag, tile.dtype)


def _positive_scale(log2_scale: Any) -> Any:
    if isinstance(log2_scale, (int, float)) and not log2_scale > 0:
        raise kiln.KilnValueError(f"log2_scale must be positive, got {log2_scale!r} (the max of "
                                  "scaled scores is taken on the raw scores)",
                                  fix="pass softmax_scale * log2(e) with softmax_scale > 0",
                                  loc=_call_site())
    return log2_scale


@kiln.struct
class OnlineSoftmax:
    """Online-softmax row state (see the module docs for the recurrence and lifetimes).

    Example (Hopper WGMMA scores ``s``, already in log2 units)::

        sm = OnlineSoftmax[kiln.f32].init(s, q_axis="row")
        s = sm.seed_tile0(s)
        p = s.exp2()
        sm.col_sum_acc(p)
    """

    max_vec: TileVector
    max_vec_prev: TileVector
    norm_vec: TileVector
    scale_vec: TileVector

    # --- state set-up

    @classmethod
    def init(cls, like: RegTile, *, q_axis: str) -> "OnlineSoftmax":
        """max/prev/norm = 0, scale = 1, shaped for score tiles like ``like``; ``q_axis`` says
        which tile axis holds query rows (``"row"``: S = QK^T, ``"col"``: S^T, e.g. MFMA col_l).
        """
        att = cls._check_att(like)
        if q_axis not in Q_AXES:
            raise kiln.KilnValueError(f"q_axis must be 'row' or 'col', got {q_axis!r}",
                                      fix="q_axis='row' when tile rows are query rows (WGMMA "
                                          "S = QK^T), 'col' for the transposed MFMA tile",
                                      loc=_call_site())
        zero = _full_vector(att, q_axis, 0.0)
        return cls(max_vec=zero, max_vec_prev=zero, norm_vec=zero,
                   scale_vec=_full_vector(att, q_axis, 1.0))

    def reseed_empty(self) -> None:
        """Start a row with no key seen: max = prev = :data:`EMPTY_MAX`, norm = 0, scale = 1.
        For a kernel that sends tile 0 through the :meth:`col_max_acc` cadence instead of
        :meth:`seed_tile0` (e.g. behind a lazy vote): the first tile with a key then always
        grows the max past any threshold, so scores however negative are taken against their
        own max (starting at 0 instead would leave a row whose scores are all below about -126
        log2 units with a denormal or zero denominator). A row that never sees a key keeps
        norm 0: output 0, LSE -inf."""
        self.max_vec = self.max_vec.map(lambda _: kiln.values.constant(EMPTY_MAX, kiln.f32))
        self.max_vec_prev = self.max_vec
        self.norm_vec = self.norm_vec.map(lambda _: kiln.values.constant(0.0, kiln.f32))
        self.reset_scale()

    def reseed_with_sink(self, sink_log2: Any) -> None:
        """Seed the virtual sink key: max = prev = ``sink_log2`` (its score in log2 units,
        log2(e) * the sink logit), norm = 1 (its ``exp2(0)``); scale stays 1."""
        sink = kiln.cast(sink_log2, kiln.f32)
        self.max_vec = self.max_vec.map(lambda _: sink)
        self.max_vec_prev = self.max_vec
        self.norm_vec = self.norm_vec.map(lambda _: kiln.values.constant(1.0, kiln.f32))

    # --- score-tile methods (tile dtype must be att_dtype)

    @classmethod
    def _check_att(cls, tile: Any) -> RegTile:
        att = cls.att_dtype
        if not isinstance(tile, RegTile) or tile.dtype is not att:
            got = f"a {tile.dtype} RegTile" if isinstance(tile, RegTile) else repr(tile)
            raise kiln.KilnTypeError(f"{cls.__name__} works on {att} score tiles, got {got}",
                                     fix=f"cast the scores with s.cast(kiln.{att}), or "
                                         "specialise OnlineSoftmax on the tile's dtype",
                                     loc=_call_site())
        return tile

    def _reduce(self, tile: RegTile, combine) -> TileVector:
        tile = self._check_att(tile)
        if tile.dtype is not kiln.f32:
            tile = tile.cast(kiln.f32)
        if self.max_vec.axis == "row":
            return tile.row_reduce(combine)
        return tile.col_reduce(combine)

    def _tile_max(self, tile: RegTile) -> TileVector:
        return self._reduce(tile, kiln.maximum)

    def seed_tile0(self, s: RegTile) -> RegTile:
        """Tile 0 without a sink: max = prev = max(s) along KV; returns ``s - max``."""
        self.max_vec = self._tile_max(s)
        self.max_vec_prev = self.max_vec
        return self.sub_max(s)

    def col_max_acc(self, s: RegTile) -> None:
        """Running max: max = max(prev, max(s)). The prev = max shadow write is left to
        :meth:`lazy_rescale_decision` / :meth:`update_scale_unconditional`."""
        self.max_vec = self.max_vec_prev.maximum(self._tile_max(s))

    def sub_max(self, s: RegTile) -> RegTile:
        """Returns ``s - max`` (ready for ``exp2``)."""
        s = self._check_att(s)
        gm, gn = s.grid
        return RegTile([s.fragment(i, j) - _fragment_operand(self.max_vec, s, i, j)
                        for i in range(gm) for j in range(gn)], s.layout, s.grid)

    def seed_tile0_scaled(self, raw: RegTile, log2_scale: Any) -> RegTile:
        """:meth:`seed_tile0` on raw QK scores: max = log2_scale * max(raw) (scaled log2
        domain, valid since log2_scale > 0); returns ``log2_scale * raw - max`` (one FMA)."""
        self.max_vec = self._tile_max(raw) * _positive_scale(log2_scale)
        self.max_vec_prev = self.max_vec
        return self.sub_max_scaled(raw, log2_scale)

    def col_max_acc_scaled(self, raw: RegTile, log2_scale: Any) -> None:
        """max = max(prev, log2_scale * max(raw)): the same rescale math as :meth:`col_max_acc`
        while the tile stays raw."""
        self.max_vec = self.max_vec_prev.maximum(self._tile_max(raw) * _positive_scale(log2_scale))

    def sub_max_scaled(self, raw: RegTile, log2_scale: Any) -> RegTile:
        """Returns ``fma(raw, log2_scale, -max)``: the QK scale folded into the subtract."""
        raw = self._check_att(raw)
        scale = kiln.cast(_positive_scale(log2_scale), raw.dtype)
        gm, gn = raw.grid
        return RegTile([kiln.fma(raw.fragment(i, j), scale,
                                 -_fragment_operand(self.max_vec, raw, i, j))
                        for i in range(gm) for j in range(gn)], raw.layout, raw.grid)

    def col_sum_acc(self, p: RegTile) -> None:
        """Running denominator: norm += sum(p) along KV (``p = exp2(s - max)``)."""
        self.norm_vec = self.norm_vec + self._reduce(p, lambda a, b: a + b)

    # --- rescale of the state and of the output accumulator

    def lazy_rescale_decision(self, o: RegTile, threshold: float) -> tuple[kiln.Value, RegTile]:
        """Rescale only when some row's max grew by more than ``threshold`` log2 units.

        The vote is warp-uniform (:func:`kiln.shuffle.any_lane`), so the branch never
        diverges. Fired: scale = exp2(prev - max), ``o *= scale``, prev = max.
        Skipped: max rolls back to prev (scores then stay below ``2**threshold`` after
        :meth:`sub_max`) and scale resets to 1 -- load-bearing: a stale scale from an earlier
        fire (e.g. ``exp2(-10000)`` after a masked tile 0) would otherwise be re-applied by
        the unconditional epilogue rescales and flush norm to 0. Returns ``(fired, o)``.
        """
        o = self._check_output(o)
        fired = self.lazy_scale_decision(threshold)
        if fired:
            o = self.rescale_output(o)
        return fired, o

    def lazy_scale_decision(self, threshold: float) -> kiln.Value:
        """:meth:`lazy_rescale_decision` for a kernel whose ``o`` is still being accumulated
        (Hopper: the previous ``P V`` is on the tensor cores): the same vote and state update,
        ``o`` left alone. Returns ``fired``; rescale ``o`` under it before the next ``P V``::

            fired = sm.lazy_scale_decision(8.0)
            ...                                   # the previous P V completes
            if fired:
                o = sm.rescale_output(o)
        """
        fired = self._max_grew(threshold)
        if fired:
            self.update_scale_unconditional()
        else:
            self.max_vec = self.max_vec_prev
            self.reset_scale()
        return fired

    def reset_scale(self) -> None:
        """scale = 1: no rescale pending (the skip path of a lazy vote; the unconditional
        rescales then leave norm and ``o`` as they are)."""
        self.scale_vec = self.scale_vec.map(lambda _: kiln.values.constant(1.0, kiln.f32))

    def _max_grew(self, threshold: float) -> kiln.Value:
        """Whether some row of the warp has max - prev > ``threshold`` (a warp-uniform i1)."""
        return kiln.shuffle.any_lane((self.max_vec - self.max_vec_prev).any_greater(threshold))

    def update_scale_unconditional(self) -> None:
        """scale = exp2(prev - max), then prev = max. Does not touch ``o`` (the kernel places
        :meth:`rescale_output` where it fits its schedule)."""
        self.scale_vec = (self.max_vec_prev - self.max_vec).map(kiln.exp2)
        self.max_vec_prev = self.max_vec

    def _check_output(self, o: Any) -> RegTile:
        if not isinstance(o, RegTile) or o.dtype is not kiln.f32:
            raise kiln.KilnTypeError(f"the output accumulator must be an f32 RegTile, got {o!r}",
                                     fix="accumulate P @ V in f32", loc=_call_site())
        return o

    def _scale_rows(self, o: RegTile, vec: TileVector) -> RegTile:
        o = self._check_output(o)
        gm, gn = o.grid
        return RegTile([o.fragment(i, j) * _fragment_operand(vec, o, i, j)
                        for i in range(gm) for j in range(gn)], o.layout, o.grid)

    def rescale_output(self, o: RegTile) -> RegTile:
        """Returns ``o * scale`` per query row. ``o`` must hold query rows on the same axis
        as the scores (re-tag with ``.T`` / ``as_view`` first when it does not)."""
        return self._scale_rows(o, self.scale_vec)

    def apply_norm_rescale_if_pending(self, pending: Any) -> None:
        """``if pending: norm *= scale`` (``pending`` from :meth:`lazy_rescale_decision`)."""
        if pending:
            self.apply_unconditional_norm_rescale()

    def apply_unconditional_norm_rescale(self) -> None:
        """norm *= scale; an identity when no rescale fired (scale == 1)."""
        self.norm_vec = self.norm_vec * self.scale_vec

    # --- results

    def _inverse_norm(self) -> TileVector:
        # A row that saw no key has norm 0: its output is 0, not 0 * inf.
        return self.norm_vec.map(lambda n: kiln.where(n > 0.0, kiln.rcp(n), 0.0))

    def normalize_output(self, o: RegTile) -> RegTile:
        """Returns ``o / norm`` (one reciprocal per row, then multiplies); rows with norm 0
        give 0."""
        return self._scale_rows(o, self._inverse_norm())

    def log_sum_exp(self) -> TileVector:
        """Natural-log LSE per row, ``ln 2 * (max + log2 norm)`` (scores in log2 units);
        ``-inf`` for a row with norm 0."""
        return (self.max_vec + self.norm_vec.map(kiln.log2)) * LN2


OnlineSoftmax.att_dtype = kiln.f32
_specialised: dict = {}


def _specialise(cls, att_dtype: Any) -> type:
    att = kiln.dtype(att_dtype)
    if att not in SUPPORTED_ATT_DTYPES:
        raise kiln.UnsupportedError(f"OnlineSoftmax att_dtype {att} is not supported",
                                    fix="use OnlineSoftmax[kiln.f32] (bf16 path) or "
                                        "OnlineSoftmax[kiln.f16] (fp8 path, KV >= 128)",
                                    loc=_call_site())
    if att not in _specialised:
        name = f"OnlineSoftmax[{att.name}]"
        _specialised[att] = kiln.struct(type(name, (OnlineSoftmax,), {
            "__annotations__": dict(OnlineSoftmax.__annotations__), "att_dtype": att,
            "__module__": __name__, "__qualname__": name}))
    return _specialised[att]


OnlineSoftmax.__class_getitem__ = classmethod(_specialise)
