"""MLA decode (DeepSeek-V2/V3 multi-head latent attention) over a paged latent cache.

``mla_decode(q, kv_cache, page_table, seq_lens)`` attends ``q[B, Sq, H, 576]`` (bf16; ``Sq``
1-2 new tokens, bottom-right causal among them: query ``i`` sees keys ``0 .. seq_len - Sq +
i``) to one latent head per token, ``kv_cache[num_pages, 64, 576]`` (bf16), whose first 512
columns are also the values, and returns ``(o [B, Sq, H, 512] bf16, lse [B, Sq, H] f32)``
(natural-log LSE, ``-inf`` for a row that sees no key).

The Hopper kernel (:mod:`~kiln.kernels.attention.mla_kernel`) splits each sequence's pages
over ``num_splits`` CTAs per 64 packed query rows, loads every page once with TMA through
the page table, and writes per-split partials (the :class:`Partials` contract of
:func:`mla_partials`); the last split CTA of each row block to finish merges them from L2
(the fused combine, one kernel; default where one CTA merges at most
``FUSED_COMBINE_MAX_BYTES``), or :func:`kiln.kernels.attention.combine` does
(``fused_combine=False``); with one split (``num_splits=1``, or the default where the batch
alone fills the GPU) the kernel writes ``o`` and ``lse`` itself and no combine runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

import kiln

from .. import runtime
from ..runtime import (ArrayLib, Dims, PlanCache, check_backend, check_paged_lengths,
                       check_positive, is_torch, resolve_target, spec)
from .combine import combine
from .decode_config import DEFAULT_SMS, FUSED_COMBINE_MAX_BYTES, LOG2E, MAX_DEFAULT_SPLITS
from .mla_balanced import BALANCE_OVERHEAD, BALANCED, BALANCED_IDLE, BALANCED_MIN_BATCH
from .mla_kernel import EARLY_LAUNCH, PREFETCH, SEESAW, SPLIT_KEYS, make_mla_kernel
from .mla_lead import LEAD_GROUP
from .mla_page import BLOCK_N, HEAD_DIM, HEAD_DIM_V, NUM_WARPS, ROWS
from .mla_transposed import (MAX_ROWS, TRANSPOSED, TRANSPOSED_DEFAULT_ROWS, TRANSPOSED_EARLY,
                             TRANSPOSED_EARLY_PAGES, transposed_rows)
from .partials import Partials
from ..workspaces import StreamWorkspaces

PRODUCER = "kiln.kernels.attention.mla_decode"  # the Partials producer name combine checks
MAX_SQ = 2  # new tokens a call takes (the MTP draft of DeepSeek-V3 is one)
# The balanced grid's CTAs a sequence by default, at most: one CTA merges that many partials;
# and the CTAs a call may ask for (num_splits).
BALANCED_PARTS = 32
BALANCED_MAX_CTAS = 1024
TRANSPOSED_MODES = (True, "ring", "pipelined", "ring-pipelined")  # transposed= values
# Split CTAs sharing a fused merge by default (1: the last one merges alone; 4 measured within
# 1% at batch 32 H 16, H200 session 37).
MERGE_SLICES = 1
# Pages prefetched into L2 before the grid-dependency wait with early launch, outside the
# transposed default (lead group at batch 32 H 16: 2 pages 45.8 vs 46.5 us; not measured at
# 128 heads, so off).
EARLY_PAGES = 0

__all__ = ["HEAD_DIM", "HEAD_DIM_V", "MAX_SQ", "compile_mla_decode", "default_mla_splits",
           "mla_decode", "mla_partials"]


def mla_partials(num_slots: int) -> Partials:
    """The :class:`Partials` contract of MLA decode's ``num_slots`` split slots: split-major
    f32 O of 512 columns, natural-log LSE, natural depth order, empty split = (-inf, zeros).
    Example: ``mla_partials(8).max_splits == 8``."""
    return Partials(producer=PRODUCER, max_splits=num_slots)


def default_mla_splits(batch: int, row_blocks: int, max_seq_len: int,
                       sms: int = DEFAULT_SMS) -> int:
    """Splits that fill one wave of one CTA per SM (a CTA takes 216 KB of shared memory),
    without splitting below one page each. Example: ``default_mla_splits(1, 2, 4096) == 64``."""
    tiles = max(1, -(-max_seq_len // BLOCK_N))
    return max(1, min(tiles, sms // (batch * row_blocks), MAX_DEFAULT_SPLITS))


@dataclass(frozen=True)
class MlaPlan:
    """What an MLA decode call of one shape class needs, worked out once."""

    kernel: object
    chip: object
    grid: tuple[int, int, int]
    slots: int
    shape: tuple[int, int, int]  # (B, Sq, H)
    cache_rows: int
    scale_log2: float
    fused: bool  # the last split CTA of a row block merges (no combine kernel)
    device: object  # q's torch device (None for other arrays)
    balanced: bool = False  # the page-balanced grid (mla_balanced): slots are its CTAs

    @functools.cached_property
    def spaces(self) -> StreamWorkspaces:
        """The fused kernel's ticket counters ``[B, row blocks, 2]`` (i64, zeroed once; each
        launch adds the split count), one set per stream and per CUDA-graph capture (see
        :class:`~kiln.kernels.workspaces.StreamWorkspaces`)."""
        import torch

        return StreamWorkspaces(lambda: torch.zeros((self.shape[0], self.grid[0], 2),
                                                    dtype=torch.int64, device=self.device),
                                runtime.capture_id)


PLANS = PlanCache("mla_decode")


def mla_decode(q, kv_cache, page_table, seq_lens, *, head_dim_v=HEAD_DIM_V, scale=None,
               num_splits=None, target=None, backend=None, validate=False, split_keys=None,
               fused_combine=None, seesaw=None, early_launch=None, lead_group=None,
               transposed=None, prefetch=None, merge_slices=None, early_pages=None,
               balanced=None):
    """Multi-head latent attention decode over a paged cache; returns ``(o, lse)``.

    ``q``: ``[B, Sq, H, 576]`` bf16 (``Sq`` 1-2; contiguous); ``kv_cache``: ``[num_pages,
    page_size, 576]`` bf16 (``page_size`` 64), one latent head whose first ``head_dim_v = 512``
    columns are V; ``page_table``: ``[B, max_pages]`` int32; ``seq_lens``: ``[B]`` int32
    (keys per sequence, the ``Sq`` new tokens included). ``scale`` defaults to
    ``576 ** -0.5``; ``num_splits`` (None: fill the GPU's SMs) splits each sequence's pages;
    ``backend="interpret"`` runs on the CPU interpreter; the scores schedule is by default
    the lead group's (``lead_group``, below), else ``split_keys`` picks it (True: each group
    scores half the keys; False: both score all; see
    :mod:`~kiln.kernels.attention.mla_kernel`);
    ``fused_combine``: with several splits, the last split CTA of each 64-row block merges
    them (True, one kernel; gpu-scope ticket counters kept per stream, so calls that may run
    at once must be on different streams) or :func:`~kiln.kernels.attention.combine` does
    (False); None: fused while one CTA merges at most ``FUSED_COMBINE_MAX_BYTES``;
    ``seesaw``: pages two at a time, one scored by each group (None: ``SEESAW``;
    :mod:`~kiln.kernels.attention.mla_seesaw`); ``early_launch``: each CTA lets the next
    kernel on the stream start on the SMs this call frees (programmatic dependent launch;
    None: ``EARLY_LAUNCH``, off, but ``TRANSPOSED_EARLY``, on, with the transposed
    schedule); ``lead_group``: warp group 0 scores every key and hands P
    to group 1, whose product runs while group 0 scores the next page (None: ``LEAD_GROUP``,
    on unless ``seesaw`` or ``split_keys`` is given; :mod:`~kiln.kernels.attention.mla_lead`;
    ``"pipelined"``: also group 0's scores of the next page issued behind its product);
    ``transposed``: with at most 32 packed rows (``Sq x H``), the keys are the products' M
    and the query rows their N, so no product computes padding rows (None: ``TRANSPOSED``,
    on at most ``TRANSPOSED_DEFAULT_ROWS = 16`` rows where no other schedule option is
    given; :mod:`~kiln.kernels.attention.mla_transposed`; no other schedule option with it;
    ``"ring"``: Q's shared memory trimmed to those rows and the bytes spent on a deeper ring
    of 8 KB chunk slots, :mod:`~kiln.kernels.attention.mla_transposed_ring`; ``"pipelined"``,
    ``"ring-pipelined"``: group 0's ``V^T P^T`` left in flight behind its next scores);
    ``prefetch``: pages of a split prefetched into L2 beyond the two in shared memory (0-4;
    None: ``PREFETCH``, 0; not with ``seesaw`` or ``lead_group="pipelined"``);
    ``merge_slices``: with the fused merge, the last 1, 2 or 4 split CTAs of a row block
    share it, a slice of the columns each (None: ``MERGE_SLICES``, 1; the interpreter
    always merges in one CTA); ``early_pages``: with ``early_launch``, Q and the split's
    first that many pages prefetched into L2 before the grid-dependency wait (None:
    ``EARLY_PAGES``, 0, but ``TRANSPOSED_EARLY_PAGES``, 2, with the transposed schedule);
    ``balanced`` (True, or the overhead units 0-16 a sequence counts): the transposed
    schedule (at most 32 packed rows) where every CTA takes an equal share of all the
    batch's pages across sequence boundaries and the last CTA of each sequence merges its
    parts (:mod:`~kiln.kernels.attention.mla_balanced`; ``num_splits`` is then the CTA
    count, None: the SMs, at most ``BALANCED_PARTS = 32`` a sequence; a sequence counts
    ``BALANCE_OVERHEAD`` units beyond its pages with True; None: ``BALANCED``, on with the
    transposed default (no ``transposed`` or ``num_splits`` given) at batch 32 or more where
    the default split would leave a fifth of the SMs idle (batch 48: 96 CTAs); no
    ``fused_combine=False`` or ``merge_slices`` with it; early launch and early pages as the
    transposed schedule's).
    Returns ``o [B, Sq, H, 512]`` bf16
    and ``lse [B, Sq, H]`` f32 (natural log; a row that sees no key has ``o = 0``,
    ``lse = -inf``). numpy inputs give numpy outputs; torch CUDA tensors stay on the device.

    Inputs are validated (a :class:`kiln.KilnError` naming the argument): kinds, ranks, dtypes
    and agreeing sizes; ``seq_lens`` within the page table and every page id a sequence uses
    within the cache (always for numpy; for torch tensors only with ``validate=True``, which
    synchronises).

    Example::

        o, lse = mla_decode(q, kv_cache, page_table, seq_lens)   # q [B, 1, 128, 576]
    """
    plan = _get_plan(q, kv_cache, page_table, seq_lens, head_dim_v, scale, num_splits, target,
                     backend, split_keys, fused_combine,
                     (seesaw, early_launch, lead_group, transposed, prefetch, merge_slices,
                      early_pages, balanced))
    lib = ArrayLib(q)
    B, Sq, H = plan.shape
    if plan.kernel is None:
        return (runtime.empty_like(q, (B, Sq, H, HEAD_DIM_V), kiln.bf16),
                runtime.empty_like(q, (B, Sq, H), kiln.f32))
    check_paged_lengths(page_table, seq_lens, num_pages=int(kv_cache.shape[0]),
                        page_size=int(kv_cache.shape[1]), validate=validate)
    _check_devices(q, kv_cache=kv_cache, page_table=page_table, seq_lens=seq_lens)
    slots = plan.slots
    # The kernel writes every element (each split all its rows, split 0 the counts); numpy
    # outputs are poisoned so that an element it missed shows.
    fill = (None, None) if lib.torch else (math.nan, -1)
    direct = slots == 1 and not plan.balanced  # one split writes o and lse: no combine
    final = direct or plan.fused  # the kernel writes o and lse
    o = lib.empty((B, Sq, H, HEAD_DIM_V) if final else (1, 1, 1, 1), "bf16", fill[0])
    lse = lib.empty((B, Sq, H) if final else (1, 1, 1), "f32", fill[0])
    # The balanced grid's partials: slot c + b for CTA c's part of sequence b.
    part_shape = (1, 1, 1, 1) if direct else (slots + B, 1, Sq, H) if plan.balanced \
        else (slots, B, Sq, H)
    o_part = lib.empty((*part_shape, 1 if direct else HEAD_DIM_V), "f32", fill[0])
    lse_part = lib.empty(part_shape, "f32", fill[0])
    counts = lib.empty((1, 1, 1) if plan.balanced else part_shape[1:], "i32", fill[1])
    tickets = _tickets(plan, lib, q)
    args = [q.reshape(B * Sq * H, HEAD_DIM), kv_cache.reshape(plan.cache_rows, HEAD_DIM),
            page_table, seq_lens, o_part, lse_part, counts, o, lse, tickets, slots, H, Sq,
            plan.scale_log2]
    results = (7, 8) if final else (4, 5, 6)
    if backend == "interpret":
        numpy_args = [lib.numpy(a) for a in args]
        runtime.interpret(plan.kernel, plan.grid, numpy_args, target=plan.chip.name,
                          num_warps=NUM_WARPS)
        outputs = [lib.copy_into(args[i], numpy_args[i]) for i in results]
    else:
        runtime.launch(plan.kernel, plan.grid, args, target=plan.chip.name,
                       num_warps=NUM_WARPS)
        outputs = [args[i] for i in results]
    if final:
        return tuple(outputs)
    return combine(*outputs, max_splits=slots, partials=mla_partials(slots), target=target,
                   backend=backend)


def _tickets(plan, lib, q):
    """The fused kernel's ticket counters (a placeholder otherwise): fresh zeros for numpy
    calls, the stream's kept set for torch ones."""
    if not plan.fused:
        return lib.empty((1, 1, 2), "i64")
    if not lib.torch:
        return lib.empty((plan.shape[0], plan.grid[0], 2), "i64", 0)
    import torch

    return plan.spaces.get(torch.cuda.current_stream(q.device).cuda_stream)


def _get_plan(q, kv_cache, page_table, seq_lens, head_dim_v, scale, num_splits, target,
              backend, split_keys, fused_combine, options) -> MlaPlan:
    key = (spec(q), spec(kv_cache), spec(page_table), spec(seq_lens), head_dim_v, scale,
           num_splits, target, backend, split_keys, fused_combine, options,
           type(options[7]))  # balanced=0 (an overhead count) is not False
    plan = PLANS.lookup(key)
    if plan is None:
        plan = PLANS.add(key, _make_plan(q, kv_cache, page_table, seq_lens, head_dim_v, scale,
                                         num_splits, target, backend, split_keys,
                                         fused_combine, options))
    return plan


def merge_rows(packed: int) -> int:
    """Rows of a fused merge: a power of two (4 to 64) covering a row block's real rows, so
    that ``256 / merge_rows`` threads share each. Example: ``merge_rows(16) == 16``."""
    return max(4, min(ROWS, 1 << max(0, packed - 1).bit_length()))


def _make_plan(q, kv_cache, page_table, seq_lens, head_dim_v, scale, num_splits, target,
               backend, split_keys, fused_combine, options) -> MlaPlan:
    asked = options[7] is not None and options[7] is not False  # (0 is an overhead count)
    dims = check_inputs(q, kv_cache, page_table, seq_lens, head_dim_v, scale, num_splits,
                        BALANCED_MAX_CTAS if asked else MAX_DEFAULT_SPLITS)
    check_backend(backend)
    B, Sq, H = dims["B"], dims["Sq"], dims["H"]
    num_pages, page_size = dims["num_pages"], dims["page_size"]
    row_blocks = -(-(Sq * H) // ROWS)
    sms = DEFAULT_SMS if backend == "interpret" else runtime.multiprocessor_count()
    slots = num_splits or default_mla_splits(B, row_blocks, dims["max_pages"] * page_size,
                                             sms=sms) if B * Sq * H else 1
    # The balanced grid runs the transposed page loop, asked for or not.
    narrow, ring, pipe = _transposed(True if asked and options[3] is None else options[3],
                                     Sq * H, split_keys, options[0], options[2])
    split_keys, seesaw, lead = _schedule(split_keys, options[0], options[2], narrow)
    rows = merge_rows(Sq * H)
    # By default only on the transposed default's shapes whose split leaves SMs idle.
    idle = num_splits is None and options[3] is None and B >= BALANCED_MIN_BATCH and \
        B * row_blocks * slots <= (1 - BALANCED_IDLE) * sms
    overhead = _balanced(options[7], narrow, ring or pipe, fused_combine, options[5], idle)
    balanced = overhead is not None
    if balanced:  # CTAs, not splits: every SM, at most BALANCED_PARTS a sequence on average
        slots = num_splits or min(BALANCED_PARTS * B, sms)
        fused_combine = True
    if fused_combine is None:  # one CTA's merge of its rows from L2, or a combine kernel
        fused_combine = slots * rows * HEAD_DIM_V * 4 <= FUSED_COMBINE_MAX_BYTES
    fused = slots > 1 and bool(fused_combine)
    # The transposed schedule has launch defaults of its own (measured with it).
    early = (TRANSPOSED_EARLY if narrow else EARLY_LAUNCH) if options[1] is None \
        else bool(options[1])
    own = fused and not balanced  # the split grid's fused merge
    kernel = make_mla_kernel(page_size, split_keys, slots == 1 and not balanced,
                             slots if own else 0, rows if fused or balanced else ROWS, seesaw,
                             early,
                             lead, narrow, _prefetch(options[4], seesaw or ring, lead),
                             ring, pipe,
                             _merge_slices(options[5], slots if fused else 0, backend),
                             _early_pages(options[6], early, narrow), overhead) \
        if B * Sq * H else None
    return MlaPlan(kernel=kernel, chip=mla_target(target),
                   grid=(row_blocks, int(slots), 1 if balanced else B),
                   slots=int(slots), shape=(B, Sq, H), cache_rows=num_pages * page_size,
                   scale_log2=float((HEAD_DIM ** -0.5 if scale is None else scale) * LOG2E),
                   fused=fused or balanced, device=q.device if is_torch(q) else None,
                   balanced=balanced)


def _balanced(balanced, transposed, ring_or_pipelined, fused_combine, merge_slices,
              idle=False) -> int | None:
    """The overhead units a sequence counts in the page-balanced grid, None without it
    (``balanced``: True for ``BALANCE_OVERHEAD``, or a count 0-16; None: ``BALANCED`` where
    the default split leaves SMs ``idle``, with the transposed page loop); refused beside
    options it does not take. Example: ``_balanced(2, 16, False, None, None) == 2``."""
    if balanced not in (None, False, True) and not (
            isinstance(balanced, int) and 0 <= balanced <= 16):
        raise kiln.KilnValueError(f"balanced={balanced!r} is neither a bool nor an overhead "
                                  "count", fix="pass balanced=True, False, None or 0..16")
    if balanced is None:
        balanced = BALANCED and idle and bool(transposed) and not ring_or_pipelined and \
            fused_combine is not False and merge_slices is None
    elif balanced is not False and (not transposed or ring_or_pipelined
                                    or fused_combine is False or merge_slices is not None):
        raise kiln.UnsupportedError("balanced=True runs the transposed page loop (at most 32 "
                                    "packed rows) and merges its own partials",
                                    fix="leave transposed unset or True, and fused_combine "
                                        "and merge_slices unset")
    if balanced is False:
        return None
    return BALANCE_OVERHEAD if balanced is True else balanced


def _early_pages(early_pages, early, transposed=0) -> int:
    """Pages prefetched before the grid-dependency wait (None: ``TRANSPOSED_EARLY_PAGES``
    with the ``transposed`` schedule, else ``EARLY_PAGES``); 0 without early launch.
    Example: ``_early_pages(2, True) == 2``."""
    if early_pages is not None and (isinstance(early_pages, bool)
                                    or not isinstance(early_pages, int)
                                    or not 0 <= early_pages <= 4):
        raise kiln.KilnValueError(f"early_pages={early_pages!r} is not a page count",
                                  fix="pass early_pages=0..4, or None")
    if early_pages is None:
        early_pages = TRANSPOSED_EARLY_PAGES if transposed else EARLY_PAGES
    pages = early_pages
    return pages if early else 0


def _merge_slices(merge_slices, fused_slots, backend) -> int:
    """The CTAs sharing a fused merge (``merge_slices``, None: ``MERGE_SLICES``); 1 without
    the fused merge or in the interpreter. Example: ``_merge_slices(2, 4, None) == 2``."""
    if merge_slices is not None and merge_slices not in (1, 2, 4):
        raise kiln.KilnValueError(f"merge_slices={merge_slices!r} must be 1, 2 or 4",
                                  fix="pass merge_slices=1, 2, 4 or None")
    slices = MERGE_SLICES if merge_slices is None else merge_slices
    if not fused_slots or backend == "interpret":
        return 1
    return min(slices, 1 << (int(fused_slots).bit_length() - 1))  # at most one a split


def _prefetch(prefetch, own_loop, lead) -> int:
    """Pages prefetched into L2 ahead of the ring (``prefetch``, None: ``PREFETCH``); the
    page loop's schedules only (``own_loop``: seesaw's or the chunk ring's loop).
    Example: ``_prefetch(1, False, 1) == 1``."""
    if prefetch is None:
        return PREFETCH if not (own_loop or lead == 2) else 0
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= 4:
        raise kiln.KilnValueError(f"prefetch={prefetch!r} is not a page count",
                                  fix="pass prefetch=0..4, or None")
    if prefetch and (own_loop or lead == 2):
        raise kiln.UnsupportedError("prefetch runs in the page loop, not the seesaw pairs, "
                                    "the chunk ring or the pipelined lead group",
                                    fix="leave prefetch unset with seesaw, transposed='ring' "
                                        "or lead_group='pipelined'")
    return prefetch


def _transposed(transposed, packed, split_keys=None, seesaw=None,
                lead_group=None) -> tuple[int, bool, bool]:
    """The transposed schedule's rows (0: off), whether it runs on the chunk ring and whether
    it is pipelined, from a call's ``transposed`` option and its ``packed = Sq x H`` rows;
    refused above 32 rows or beside another schedule option.
    Example: ``_transposed("ring", 16) == (16, True, False)``."""
    if transposed not in (None, False, *TRANSPOSED_MODES):
        raise kiln.KilnValueError(f"transposed={transposed!r} is not a transposed mode",
                                  fix="pass transposed=True, 'ring', 'pipelined', "
                                      "'ring-pipelined', False or None")
    if transposed is None:
        own = packed <= TRANSPOSED_DEFAULT_ROWS and split_keys is None and seesaw is None \
            and lead_group is None  # the default mode where no other schedule is asked for
        transposed = TRANSPOSED if own else False
    if not transposed:
        return 0, False, False
    if not transposed_rows(packed):
        raise kiln.UnsupportedError(f"transposed=True serves at most {MAX_ROWS} packed rows "
                                    f"(Sq x H), not {packed}", fix="leave transposed unset")
    if split_keys or seesaw or lead_group:
        raise kiln.UnsupportedError("transposed=True is its own schedule: it takes no "
                                    "split_keys, seesaw or lead_group",
                                    fix="leave the other schedule options unset")
    return (transposed_rows(packed), transposed in ("ring", "ring-pipelined"),
            transposed in ("pipelined", "ring-pipelined"))


def _schedule(split_keys=None, seesaw=None, lead_group=None,
              transposed=0) -> tuple[bool, bool, int]:
    """The kernel's scores schedule from a call's options (None: the defaults): ``(split_keys,
    seesaw, lead)``, ``lead`` as :func:`make_mla_kernel` takes it (0 off, 1 the lead group, 2
    pipelined). The default lead group gives way to an explicit ``seesaw=True`` or
    ``split_keys``. Example: ``_schedule(split_keys=True) == (True, False, 0)``."""
    if lead_group not in (None, False, True, "pipelined"):
        raise kiln.KilnValueError(f"lead_group={lead_group!r} is not a lead-group mode",
                                  fix="pass lead_group=True, 'pipelined', False or None")
    if lead_group is None:
        lead_group = LEAD_GROUP and not seesaw and split_keys is None and not transposed
    if lead_group and (seesaw or split_keys):
        raise kiln.UnsupportedError(f"lead_group={lead_group!r} has group 0 score every key: "
                                    "it takes no seesaw or split_keys=True",
                                    fix="leave seesaw and split_keys unset with lead_group")
    seesaw = SEESAW if seesaw is None else bool(seesaw)
    split_keys = SPLIT_KEYS if split_keys is None else bool(split_keys)
    lead = 2 if lead_group == "pipelined" else int(bool(lead_group))
    return split_keys and not (seesaw or lead or transposed), seesaw, lead


def mla_target(target):
    """The chip of an MLA decode call (None: the default); it needs TMA and WGMMA.
    Example: ``mla_target("sm_90a").name == "sm_90a"``."""
    chip = resolve_target(target)
    if not (chip.has_tma and chip.has_wgmma):
        raise kiln.UnsupportedError(f"MLA decode runs on Hopper's TMA and WGMMA, which "
                                    f"{chip.name} lacks", fix="use target='sm_90a'")
    return chip


def check_inputs(q, kv_cache, page_table, seq_lens, head_dim_v, scale, num_splits,
                 max_splits=MAX_DEFAULT_SPLITS) -> Dims:
    """Kinds, ranks, dtypes and agreeing sizes of a call's arguments (once per shape class;
    ``max_splits``: the most ``num_splits`` may be)."""
    dims = Dims()
    dims.tensor("q", q, "B Sq H D", dtype=kiln.bf16)
    dims.tensor("kv_cache", kv_cache, "num_pages page_size D", dtype=kiln.bf16)
    dims.tensor("page_table", page_table, "B max_pages", dtype=kiln.i32)
    dims.tensor("seq_lens", seq_lens, "B", dtype=kiln.i32)
    if dims["D"] != HEAD_DIM:
        raise kiln.UnsupportedError(f"q and kv_cache have head dim {dims['D']}; MLA decode "
                                    f"reads the {HEAD_DIM}-column latent head",
                                    fix=f"pass [.., {HEAD_DIM}] q and kv_cache (512 latent + "
                                        "64 rotary columns)")
    if head_dim_v != HEAD_DIM_V:
        raise kiln.UnsupportedError(f"head_dim_v={head_dim_v!r}: V is the first {HEAD_DIM_V} "
                                    "columns of the latent head", fix="leave head_dim_v=512")
    if dims["Sq"] > MAX_SQ:
        raise kiln.UnsupportedError(f"q has Sq={dims['Sq']} tokens; MLA decode takes "
                                    f"0..{MAX_SQ}", fix="split the new tokens into calls")
    if dims["page_size"] != BLOCK_N:
        raise kiln.UnsupportedError(f"kv_cache has pages of {dims['page_size']} rows; MLA "
                                    f"decode reads pages of {BLOCK_N}",
                                    fix=f"allocate the cache as [num_pages, {BLOCK_N}, "
                                        f"{HEAD_DIM}]")
    check_positive("kv_cache's num_pages", dims["num_pages"], integer=True,
                   fix="a paged cache needs at least one page")
    if num_splits is not None:
        check_positive("num_splits", num_splits, integer=True,
                       fix="leave num_splits=None for the default")
        if num_splits > max_splits:
            raise kiln.UnsupportedError(f"num_splits={num_splits} is more than the merge takes "
                                        f"({max_splits})", fix=f"pass at most {max_splits}")
    if scale is not None:  # the kernel takes row maxima of unscaled scores
        check_positive("scale", scale, fix="pass a positive softmax scale, or None for "
                                           "576 ** -0.5")
    for name, x in (("q", q), ("kv_cache", kv_cache)):
        if not (x.is_contiguous() if is_torch(x) else x.flags.c_contiguous):
            raise kiln.KilnValueError(f"{name} is not contiguous (TMA reads it as rows)",
                                      fix=f"pass {name}.contiguous()")
    return dims


def _check_devices(q, **tensors) -> None:
    """torch inputs must share q's device (a kernel given another device's address faults),
    and TMA reads q and the cache from 16-byte aligned addresses."""
    if not is_torch(q):
        return
    for name, t in (("q", q), *tensors.items()):
        if is_torch(t) and t.device != q.device:
            raise kiln.KilnValueError(f"{name} is on {t.device} but q is on {q.device}",
                                      fix=f"move {name} to {q.device}")
        if name in ("q", "kv_cache") and t.data_ptr() % 16:
            raise kiln.KilnValueError(f"{name}'s address {t.data_ptr():#x} is not 16-byte "
                                      "aligned (TMA reads it)", fix=f"pass {name}.clone()")


def compile_mla_decode(*, target="sm_90a", page_size=BLOCK_N, heads=128, sq=1,
                       split_keys=None, direct=False, fused_slots=0, seesaw=None,
                       early_launch=None, lead_group=None, transposed=None,
                       prefetch=None, merge_slices=1, early_pages=None, balanced=False):
    """Compile (without running) the MLA decode kernel (``direct``: the one-split kernel that
    writes ``o`` and ``lse`` itself; ``fused_slots``: the kernel whose last split CTA merges
    that many splits, shared by ``merge_slices`` CTAs; the schedule options as
    :func:`mla_decode` resolves them; ``balanced``: the page-balanced grid, with the
    transposed schedule); returns the ``CompiledKernel`` (``.asm`` stages,
    ``.metadata``).
    Example: ``compile_mla_decode(target="sm_90a").metadata["registers"]``."""
    chip = mla_target(target)
    bf16 = kiln.bf16.numpy
    args = [np.zeros((sq * heads, HEAD_DIM), bf16), np.zeros((2 * page_size, HEAD_DIM), bf16),
            np.zeros((1, 2), np.int32), np.zeros(1, np.int32),
            np.zeros((1, 1, sq, heads, HEAD_DIM_V), np.float32),
            np.zeros((1, 1, sq, heads), np.float32), np.zeros((1, sq, heads), np.int32),
            np.zeros((1, sq, heads, HEAD_DIM_V), bf16), np.zeros((1, sq, heads), np.float32),
            np.zeros((1, 1, 2), np.int64), 1, heads, sq, 0.1]
    asked = balanced is not None and balanced is not False  # (0 is an overhead count)
    narrow, ring, pipe = _transposed(True if asked and transposed is None else transposed,
                                     sq * heads, split_keys, seesaw, lead_group)
    overhead = _balanced(balanced, narrow, ring or pipe, None, None)
    split_keys, seesaw, lead = _schedule(split_keys, seesaw, lead_group, narrow)
    early = (TRANSPOSED_EARLY if narrow else EARLY_LAUNCH) if early_launch is None \
        else bool(early_launch)
    kernel = make_mla_kernel(page_size, split_keys, direct, fused_slots,
                             merge_rows(sq * heads) if fused_slots else ROWS, seesaw,
                             early, lead, narrow, _prefetch(prefetch, seesaw or ring, lead),
                             ring, pipe, _merge_slices(merge_slices, fused_slots, None),
                             _early_pages(early_pages, early, narrow), overhead)
    return kernel.compile(*args, target=chip.name, num_warps=NUM_WARPS)
