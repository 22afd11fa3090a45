"""Split-KV paged decode attention (Hopper): TMA page loads, tensor-core consumer (mma.sync, or
WGMMA for 64-row blocks).

``decode(q, k_cache, v_cache, page_table, seq_lens)`` attends ``q[B, Sq, Hq, D]`` (``Sq`` 1–16
draft tokens, causal within the cache: query ``i`` sees keys ``0 .. L - Sq + i``) to a paged
bf16 cache ``[num_pages, page_size, Hkv, D]`` and returns per-split partials for
:func:`kiln.kernels.attention.combine`:

``O_partial[split, b, i, h, :]`` (f32, normalised within the split), ``LSE_partial[split, b, i,
h]`` (natural log, ``-inf`` for a split that saw no key) and ``split_counts[b, i, h]`` (the
splits holding keys for that row; slots past it are ignored by ``combine``).

Schedule: grid ``(num_splits, Hkv * row_blocks, B)`` (block-sparse: ``(top_k, Hkv *
row_blocks, B * Sq)``). A CTA serves one KV head and a block of *packed* query rows (row ``r``
= query token ``r // group``, head ``r % group``) as m16 tiles padded with zero rows that are
never stored, and reads each of its pages once. Its ``num_warps`` warps form ``warp_groups``
groups; group ``g`` serves ``m_tiles`` m16 tiles (Q's fragments and O stay in registers) and
its warps split every BN-key tile, each keeping its own ``(m, l, O)``:

| D | m tiles a warp | warp groups | most rows a CTA | keys a warp (BN 64, default warps) |
| --- | --- | --- | --- | --- |
| 64 | 2 (1 for <= 16 rows) | 1 | 32 | 16 (4 warps) |
| 128 | 1 | 2 when > 16 rows (e.g. Sq 4 x GQA 8) | 32 | 16 (4 warps, or 8 for two groups) |
| 256 | 1 | 1 | 16 | 16 (4 warps) |

More rows than a CTA serves take ``row_blocks`` CTAs per KV head, run side by side and sharing
its pages in L2 (``DecodeConfig.warp_groups`` stops widening where O and S would exceed
``MAX_ACCUMULATORS`` f32 registers a lane). The default split count gives one CTA per SM of the
GPU the call launches on (``DEFAULT_SMS`` when interpreted).

| phase | who | what |
| --- | --- | --- |
| prefetch (early launch only) | the last warp's first lane | before the grid-dependency wait, TMA prefetches into L2 of the K and V of the split's first tiles (:func:`early_launch_tiles`); after the wait, ``launch_dependents`` |
| load q | each lane | its A fragments of its group's packed q rows, straight from global memory into registers as 32-bit bf16 pairs (zero padding rows) |
| load | warp 0, one elected lane issues | tile ``t + stages - 1``: ``PagedRowIndices.populate`` (the page look-up, before the wait; the prologue's ``stages`` tiles are looked up together), wait ``empty[s]`` (tile ``t - 1`` released by every thread), one TMA per page and 64-column half of K and V (128-byte swizzled boxes) completing on ``full[s]`` |
| scores | each warp | its key slice: ``S = Q K^T`` with ``mma.sync`` m16n8k16: Q A-fragments of its group's m tiles (kept in registers), K B-fragments (``ldmatrix.x4``) |
| softmax | each warp | base-2 streaming update, ``scale * log2 e`` folded into the exp2's FMA; with ``DecodeConfig.lazy_rescale`` (default below D 256) a row's max moves, and O is rescaled, only on a tile where a score passed it by 2^8 (one ``vote.any``), else the row max over the 4 lanes of a row every tile; row sums kept per lane until the end; f32 denormals flushed (one MUFU op an exp2) |
| P·V | each warp | P's accumulators, cast to bf16, are the A fragments (two n8 accumulators = one k16 A); V B-fragments by ``ldmatrix.x4.trans`` |
| release | every thread | arrive on ``empty[s]`` |
| merge | all | per row, the ``(m, l, O)`` of its group's warps through shared memory (the ring reused as f32), then ``O / l``, ``LSE = (m + log2 l) * ln 2`` (sinks join here); split 0 writes ``split_counts`` |
| combine (fused kernel of :func:`decode_attention` only) | all | one CTA of each (batch, KV head, row block), or with ``merge_slices > 1`` the last few, merges every split's partial, read from L2, into ``o`` (bf16) and ``lse``, ``combine_threads_per_row`` threads a row, each CTA its slice of the columns; the merging CTAs are picked by tickets (see :func:`~kiln.kernels.attention.decode_fused.combine_if_last`) |

``DecodeConfig(consumer="wgmma")`` (the default from 33 packed rows at D 128, e.g. Sq 8 x
GQA 8): the CTA is one warp group of 4 warps serving 64 packed rows (more take ``row_blocks``
CTAs); warp ``w`` holds rows ``16 w ..`` of the ``m64`` products and their Q A fragments. Per
tile ``t``: issue ``S_t = Q K_t^T`` (``wgmma m64nBNk16``, A from registers, K K-major from the
ring) and ``O += P_{t-1} V_{t-1}`` (P from registers, V MN-major) back to back, wait for
``S_t``, run its softmax (each row is a thread quad's; in a tile past the sequence the V rows
past the end are first zeroed in shared memory) while the P·V product runs, wait for it, and
release tile ``t - 1``'s stage, so a stage is held one iteration longer and the producer loads
tile ``t + stages - 2``. After the loop, the last P·V; then each quad stores its rows of
``O / l`` straight from the accumulator: no merge through shared memory.

Shared memory: a ring of ``stages`` K/V tiles; tile rows are stored as 64-column halves, each
``BN x 64`` bf16 with 128-byte rows, so a TMA box of ``eff_page x 64`` lands at a multiple of
``eff_page * 128`` bytes. With pages of 8 rows or more that is 1024-byte aligned and the boxes
use the TMA 128-byte swizzle (``ldmatrix`` then reads 8 rows in 8 different bank groups);
smaller pages use unswizzled boxes (correct, with ldmatrix bank conflicts).

Keys past the sequence end never reach the sums, even when the cache holds NaN there: scores
are masked to ``-inf`` and, in a tile that ends past the sequence, the V fragments of those keys
are zeroed before ``P·V`` (``0 * NaN`` would poison the row). That is what lets V's tensor map
fill out-of-bounds boxes with NaN (K's with zeros): the pages past a sequence's end (looked up
as an out-of-bounds row) never reach the sums, while a page id outside ``[0, num_pages)``
inside the sequence (only with ``validate=False``, which skips the host check) reads a NaN box
and poisons its rows' ``O`` (the LSE stays finite, so ``combine`` keeps the NaN) instead of
silently attending to zeros; so does a ``seq_len`` past the page table (look-ups stop at its
width). Ids are i32: ``id * page_size`` must fit in 31 bits. Attention sinks (``sinks[Hq]``,
natural-log logits that only enlarge the denominator) join split 0's merge.

Block-sparse selection (``block_table[B, Sq, Hkv, top_k]`` of BN-key block indices, ``-1``
padded at the end): slot ``j`` of row ``(b, i, kv head)`` is the partial over block
``block_table[b, i, h_kv, j]``; ``split_counts`` is the number of non-negative entries, so a
row that selects nothing has ``C = 0`` (combine returns ``O = 0``, ``LSE = -inf``).

Synchronisation: the only CTA-wide barriers are at top level (after initialising the
mbarriers; before and after the merge; around the fused kernel's tickets: a gpu-scope fence
before a CTA publishes its partials and, in a merging CTA, an acquire before it reads the
others', see :func:`~kiln.kernels.attention.decode_fused.combine_if_last`). The WGMMA consumer
adds one named barrier (its whole CTA, in a CTA-uniform branch) after zeroing V rows past the
sequence. ``elect_sync`` runs once, converged, before any branch. The K/V ring is a full/empty
mbarrier pair per stage: ``full[s]`` is re-armed only after every thread arrived on
``empty[s]`` for the tile it held, and those arrivals come after each thread's wait on
``full[s]``, so no phase is reused while a waiter may still be on it.

Launch: programmatic dependent launch (``grid_dependency_wait`` right after the mbarrier
set-up, before any global memory access), so a call's CTAs start while the previous kernel on
the stream finishes; each CTA asks for ``MIN_SHARED_BYTES`` of shared memory, so no two share
an SM. Early launch (where :func:`early_launch_tiles` finds splits of 8-64 tiles, one page a
tile): before the wait the last warp's first lane prefetches the K and V of its split's first
tiles into L2 (TMA prefetches; the seq_lens and page-table reads that aim them may see stale
values, which only misaims a prefetch), and after the wait it lets the next kernel on the
stream launch. Back-to-back calls then overlap: the next call's CTAs start on the SMs that
this call's non-merging CTAs free and fill L2 while the merge runs, when HBM would idle. When
it issues the first tiles, the producer also prefetches the ``AHEAD_PREFETCH_TILES`` tiles
after the prefetched ones, so that HBM streams them while the consumers read L2.

Modules, by job: :mod:`~kiln.kernels.attention.decode_config` (the tuning table,
:class:`DecodeConfig`, defaults), :mod:`~kiln.kernels.attention.decode_kernel` (the kernel's
skeleton: set-up, producer, main loop, epilogue), its two consumers
:mod:`~kiln.kernels.attention.decode_mma_sync` and :mod:`~kiln.kernels.attention.decode_wgmma`,
:mod:`~kiln.kernels.attention.decode_rows` (per-row state helpers both share),
:mod:`~kiln.kernels.attention.decode_fused` (the fused combine),
:mod:`~kiln.kernels.attention.decode_plan` (input checks and cached plans), and this module
(the entry points).
"""

from __future__ import annotations


from __future__ import annotations

import numpy as np

import kiln

from .. import runtime
from ..runtime import ArrayLib, empty_like, is_torch
from .decode_config import (AHEAD_PREFETCH_TILES, CTAS_PER_SM, DEFAULT_SMS, EARLY_LAUNCH_TILES,
                            FUSED_COMBINE_MAX_BYTES, KV_EVICTION, LAZY_RESCALE_HEAD_DIMS,
                            LAZY_RESCALE_THRESHOLD, MAX_ACCUMULATORS, MAX_COMBINE_LOADS,
                            MAX_DEFAULT_SPLITS, MAX_UNROLLED_PAGES, MERGE_HELPER_MIN_ROWS,
                            MERGE_SLICES, MIN_SHARED_BYTES, PREFETCH_BYTES, PRODUCER, Q_ALIGN,
                            SHORT_SPLIT_PREFETCH_TILES, SHORT_SPLIT_TILES, SUPPORTED_HEAD_DIMS,
                            WGMMA_MIN_ROWS, DecodeConfig, decode_partials, default_config,
                            default_num_splits, early_launch_tiles)
from .decode_kernel import make_kernel
from ..one_call import OneCallSlot, address, one_call, output, space, value
from ..workspaces import SEPARATE
from .decode_plan import PLANS, check_values, get_plan, nvidia_target

OUT_ALIGN = 16  # bytes: the alignment decode_attention's out= and lse_out= must have

__all__ = [
    "AHEAD_PREFETCH_TILES", "CTAS_PER_SM", "DEFAULT_SMS", "EARLY_LAUNCH_TILES",
    "FUSED_COMBINE_MAX_BYTES", "KV_EVICTION", "LAZY_RESCALE_HEAD_DIMS", "LAZY_RESCALE_THRESHOLD",
    "MAX_ACCUMULATORS", "MAX_COMBINE_LOADS", "MAX_DEFAULT_SPLITS", "MAX_UNROLLED_PAGES",
    "MERGE_HELPER_MIN_ROWS", "MERGE_SLICES", "MIN_SHARED_BYTES", "PREFETCH_BYTES", "PRODUCER",
    "SHORT_SPLIT_PREFETCH_TILES", "SHORT_SPLIT_TILES", "SUPPORTED_HEAD_DIMS", "WGMMA_MIN_ROWS",
    "DecodeConfig", "compile_decode", "decode", "decode_attention", "decode_partials",
    "default_config", "default_num_splits", "early_launch_tiles", "make_kernel",
]


def decode(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None, block_table=None,
           scale=None, sinks=None, target=None, backend=None, config=None, validate=False):
    """Split-KV paged decode attention; returns ``(o_partial, lse_partial, split_counts)``
    (see the module docs) for :func:`kiln.kernels.attention.combine`.

    ``q``: ``[B, Sq, Hq, D]`` bf16 (a 4-byte aligned address); ``k_cache``/``v_cache``:
    ``[num_pages, page_size, Hkv, D]`` bf16; ``page_table``: ``[B, max_pages]`` int32;
    ``seq_lens``: ``[B]`` int32 (including the ``Sq`` new tokens); ``block_table``: optional
    ``[B, Sq, Hkv, top_k]`` int32 block indices; ``sinks``: optional ``[Hq]`` f32; ``scale``
    defaults to ``D ** -0.5``; ``config``: a :class:`DecodeConfig` (None:
    :func:`default_config` of the shape).
    numpy inputs give numpy outputs; torch CUDA tensors stay on the device (the three torch
    partials share one allocation, one each through ``torch.ops.kiln.decode``).

    Inputs are validated (a :class:`kiln.KilnError` naming the argument): kinds, ranks, dtypes
    and agreeing sizes once per shape class; ``num_splits >= 1``, ``scale > 0``; per call,
    ``0 <= seq_lens[b] <= max_pages * page_size`` and every page id a sequence uses in
    ``[0, num_pages)``. That per-call check always runs for numpy inputs; for torch CUDA
    tensors it costs a device-side reduction and a synchronisation, so it runs only with
    ``validate=True`` (not inside a CUDA graph capture). Unchecked, an out-of-range id inside
    a sequence reads a NaN-filled box (never another page or zeros), so its rows' outputs are
    NaN. An empty batch (``B``, ``Sq`` or ``Hq`` of
    0) returns empty partials and launches nothing.
    Example::

        o_part, lse_part, counts = decode(q, k_cache, v_cache, page_table, seq_lens)
        o, lse = kiln.kernels.attention.combine(o_part, lse_part, counts)
    """
    call = _DECODE.call
    if call is not None and not SEPARATE.depth:  # one C call (kiln.kernels.one_call)
        made = call(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                    scale, target, backend, config, validate)
        if made is not None:
            return made
    guard, plan = PLANS.last
    if not guard((q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                  scale, target, backend, config, False)):
        plan = get_plan(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table,
                        scale, sinks, target, backend, config, fused=False)
    bound = plan.bound
    if validate or bound is None:  # bound plans take torch tensors, checked on request
        if plan.kernel is None:
            return plan.torch_partials() if plan.device is not None else plan.numpy_partials()
        check_values(k_cache, page_table, seq_lens, block_table, validate)
    if bound is not None:
        q_ptr = q.data_ptr()
        if q_ptr % Q_ALIGN == 0:  # one C call: the partials, the addresses, the launch
            if not validate:
                values = (q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                          num_splits, scale, target, backend, config, validate)
                _DECODE.install(plan.calls, "decode", lambda: _decode_call(plan, values))
            block_address, sinks_address = plan.placeholder_pointers
            fresh = plan.partial_outputs  # one allocation for the three, but in a custom op
            return bound.launch_outputs(
                fresh.makers if SEPARATE.depth else fresh.fast, bound.current_stream(), q_ptr,
                k_cache, v_cache,
                page_table, seq_lens, block_address if block_table is None else block_table,
                sinks_address if sinks is None else sinks, None, None, None,
                *plan.no_output_pointers)
    return _run_unbound(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                        backend)


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None,
                     block_table=None, scale=None, sinks=None, target=None, backend=None,
                     config=None, fused_combine=None, validate=False, out=None, lse_out=None):
    """Split-KV decode attention with the splits merged: the attention output
    ``[B, Sq, Hq, D]`` (bf16) and its natural-log LSE ``[B, Sq, Hq]`` (f32). Same keywords as
    :func:`decode`.

    ``fused_combine=True``: one kernel. Each split CTA stores its partials and takes tickets
    (gpu-scope atomic counters per batch, KV head and row block); the last CTA (or the last
    few, for large merges) merges the splits of its rows as
    :func:`kiln.kernels.attention.combine` would, saving the combine's launch. ``False``:
    :func:`decode`, then ``combine`` (two kernels, the merge spread over many CTAs). Inputs are
    validated as :func:`decode` describes (``validate=True`` adds the per-call check of device
    tensors' page ids and lengths); an empty batch returns empty ``o`` and ``lse``.
    ``None`` (default): fused while one CTA merges at most ``FUSED_COMBINE_MAX_BYTES`` of
    partials (every shape of ``bench/decode.py``'s grid).

    With contiguous torch CUDA tensors a repeat call of one shape class is one bound launch
    (two: decode's and combine's, back to back, when not fused) and one allocation (the
    returned ``o`` and ``lse``, one each through ``torch.ops.kiln``), and it can be captured
    in a CUDA graph (``torch.cuda.graph``) and replayed with no host work per step (check the
    page table before capturing, e.g. with one ``validate=True`` call; the kernel poisons
    rows with bad ids). The ticket counters and
    the partials (up to ``SCRATCH_MAX_BYTES``; larger ones are allocated per call) are kept per
    plan and per stream: calls on one stream are ordered, so each reuses the last one's, and
    calls that may run at once must be on different streams (a graph's launches are those of
    its capture stream). Each launch adds the split count to each ticket counter.
    ``out`` / ``lse_out``: optional preallocated outputs (``[B, Sq, Hq, D]`` bf16 and
    ``[B, Sq, Hq]`` float32 of q's kind; torch ones on q's device, contiguous and 16-byte
    aligned), written and returned instead of fresh ones: a decode loop that reuses them
    allocates nothing per call. Either may be given alone.
    Example: ``o, lse = decode_attention(q, k_cache, v_cache, page_table, seq_lens)``.
    """
    call = _ATTENTION.call
    if call is not None and not SEPARATE.depth:  # one C call (kiln.kernels.one_call)
        made = call(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                    scale, target, backend, config, fused_combine, validate, out, lse_out)
        if made is not None:
            return made
    guard, plan = PLANS.last
    if not guard((q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                  scale, target, backend, config, fused_combine)):
        plan = get_plan(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table,
                        scale, sinks, target, backend, config, fused=fused_combine)
    bound = plan.bound
    if plan.fused and bound is not None and out is None and lse_out is None and not validate:
        q_ptr = q.data_ptr()
        if not q_ptr % Q_ALIGN:  # the steady state: one C call makes (o, lse) and launches
            values = (q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                      scale, target, backend, config, fused_combine, validate, out, lse_out)
            _ATTENTION.install(plan.calls, "attention", lambda: _attention_call(plan, values))
            stream = bound.current_stream()
            # owners: held until the launch is queued
            owners, (o_part, lse_part, counts, tickets) = plan.spaces.get(stream)
            block_address, sinks_address = plan.placeholder_pointers
            fresh = plan.torch_outputs  # one allocation for o and lse, but in a custom op
            return bound.launch_outputs(
                fresh.makers if SEPARATE.depth else fresh.fast, stream, q_ptr, k_cache, v_cache,
                page_table, seq_lens, block_address if block_table is None else block_table,
                sinks_address if sinks is None else sinks, o_part, lse_part, counts, None, None,
                tickets)
    given = out is not None or lse_out is not None
    if given:
        _check_given_outputs(plan, q, out, lse_out)
    if validate or bound is None:  # bound plans take torch tensors, checked on request
        if plan.kernel is None:
            shape = plan.partial_shape[1:]
            return _delivered((empty_like(q, shape, kiln.bf16),
                               empty_like(q, shape[:3], kiln.f32)), out, lse_out)
        check_values(k_cache, page_table, seq_lens, block_table, validate)
    q_ptr = None if bound is None else q.data_ptr()
    if q_ptr is not None and q_ptr % Q_ALIGN == 0 and (plan.fused or plan.merge is not None):
        if not validate and (out is None) == (lse_out is None):
            values = (q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                      scale, target, backend, config, fused_combine, validate, out, lse_out)
            _ATTENTION.install(plan.calls, "attention_out" if given else "attention",
                               lambda: _attention_call(plan, values))
        stream = bound.current_stream()
        owners, workspace = plan.spaces.get(stream)  # owners: held until the launches are queued
        block_address, sinks_address = plan.placeholder_pointers
        inputs = (q_ptr, k_cache, v_cache, page_table, seq_lens,
                  block_address if block_table is None else block_table,
                  sinks_address if sinks is None else sinks)
        if plan.fused:  # one C call: (o, lse), the addresses, the launch
            o_part, lse_part, counts, tickets = workspace
            if not given:
                fresh = plan.torch_outputs  # one allocation for o and lse, but in a custom op
                return bound.launch_outputs(fresh.makers if SEPARATE.depth else fresh.fast,
                                            stream, *inputs, o_part, lse_part, counts, None,
                                            None, tickets)
            o, lse = _bound_outputs(plan, out, lse_out)
            bound.launch_outputs((), stream, *inputs, o_part, lse_part, counts, o, lse,
                                 tickets)
            return o, lse
        bound.launch_outputs((), stream, *inputs, *workspace, *plan.no_output_pointers)
        merge = plan.merge.bound
        if not given:
            fresh = plan.merge.fresh
            return merge.launch_outputs(fresh.makers if SEPARATE.depth else fresh.fast, stream,
                                        *workspace, None, None)
        o, lse = _bound_outputs(plan, out, lse_out)
        merge.launch_on(stream, *workspace, o.data_ptr(), lse.data_ptr())
        return o, lse
    if plan.fused:
        return _delivered(_run_unbound(plan, q, k_cache, v_cache, page_table, seq_lens,
                                       block_table, sinks, backend), out, lse_out)
    from .combine import combine

    o_part, lse_part, counts = decode(q, k_cache, v_cache, page_table, seq_lens,
                                      num_splits=num_splits, block_table=block_table,
                                      scale=scale, sinks=sinks, target=target, backend=backend,
                                      config=config, validate=False)  # checked above
    slots = o_part.shape[0]
    return _delivered(combine(o_part, lse_part, counts, max_splits=slots,
                              partials=decode_partials(slots), target=target,
                              backend="interpret" if backend == "interpret" else None),
                      out, lse_out)


# The one-call objects of decode's and decode_attention's last bound plans.
_DECODE, _ATTENTION = OneCallSlot(), OneCallSlot()


def _inputs(plan, block_table, sinks) -> list:
    """The one-call items of a bound decode launch's inputs (values 0-6 of both entries)."""
    block_address, sinks_address = plan.placeholder_pointers
    return [value(0), value(1), value(2), value(3), value(4),
            address(block_address) if block_table is None else value(5),
            address(sinks_address) if sinks is None else value(6)]


def _decode_call(plan, values: tuple):
    """:func:`decode`'s one-call object of a bound plan (its values in the entry's order)."""
    items = _inputs(plan, values[5], values[6]) + [output(0), output(1), output(2)] + \
        [address(p) for p in plan.no_output_pointers]
    return one_call(values, [(plan.bound, items)], stream=plan.bound.current_stream,
                    makers=plan.partial_outputs.fast, aligns=((0, Q_ALIGN),))


def _attention_call(plan, values: tuple):
    """:func:`decode_attention`'s one-call object of a bound plan: fused, one launch; else
    decode's then combine's, through the plan's per-stream partials; with ``out=`` and
    ``lse_out=`` (values 14 and 15) into those."""
    given = values[14] is not None
    outs = [value(14), value(15)] if given else [output(0), output(1)]
    partials = [space(0), space(1), space(2)]
    inputs = _inputs(plan, values[5], values[6]) + partials
    if plan.fused:
        launches = [(plan.bound, inputs + outs + [space(3)])]
        makers = plan.torch_outputs.fast
    else:
        launches = [(plan.bound, inputs + [address(p) for p in plan.no_output_pointers]),
                    (plan.merge.bound, partials + outs)]
        makers = plan.merge.fresh.fast
    aligns = ((0, Q_ALIGN),) + (((14, OUT_ALIGN), (15, OUT_ALIGN)) if given else ())
    return one_call(values, launches, stream=plan.bound.current_stream,
                    makers=None if given else makers, result=(14, 15) if given else None,
                    workspace=plan.spaces, aligns=aligns)


def _check_given_outputs(plan, q, out, lse_out) -> None:
    """:func:`_check_outputs` unless these outputs are laid out as the last checked ones
    (their guard) and aligned (the addresses are read per call)."""
    guard = plan.checked_outputs[0]
    if guard is not None and guard((out, lse_out)) and \
            (out is None or out.data_ptr() % OUT_ALIGN == 0) and \
            (lse_out is None or lse_out.data_ptr() % OUT_ALIGN == 0):
        return
    _check_outputs(plan, q, out, lse_out)
    if plan.bound is not None:  # the plan's key fixed q's device, which these were checked on
        plan.checked_outputs[0] = runtime.guard_of((out, lse_out))


def _check_outputs(plan, q, out, lse_out) -> None:
    """``out`` / ``lse_out`` as :func:`decode_attention` documents them (KilnValueError naming
    the argument otherwise)."""
    shape = tuple(plan.partial_shape[1:])
    bound = plan.bound is not None  # torch dtypes to compare with: the placeholders'
    for name, given, want_shape, dtype in (("out", out, shape, kiln.bf16),
                                           ("lse_out", lse_out, shape[:3], kiln.f32)):
        if given is None:
            continue
        if bound:  # the per-call check of a serving loop: torch attributes only
            like = plan.no_outputs[0] if name == "out" else plan.no_sinks
            fits = is_torch(given) and given.dtype == like.dtype and \
                given.shape == want_shape and given.get_device() == q.get_device() and \
                given.is_contiguous() and given.data_ptr() % OUT_ALIGN == 0
        else:
            fits = is_torch(given) == is_torch(q) and tuple(given.shape) == want_shape and \
                runtime.dtype_of(name, given) is dtype
            if fits and is_torch(q):
                fits = given.device == q.device and given.is_contiguous() and \
                    given.data_ptr() % OUT_ALIGN == 0
        if not fits:
            raise kiln.KilnValueError(
                f"decode_attention's {name} must be a contiguous, {OUT_ALIGN}-byte aligned "
                f"{dtype} array of shape {want_shape} like q (same kind and device); got "
                f"{type(given).__name__} {getattr(given, 'dtype', '?')} of shape "
                f"{tuple(getattr(given, 'shape', ()))}",
                fix=f"allocate it like q with shape {want_shape} and dtype {dtype}, or leave "
                    f"{name}=None")


def _bound_outputs(plan, out, lse_out):
    """``(o, lse)`` of a bound call with caller outputs: those given (checked), fresh ones for
    the other."""
    if out is None or lse_out is None:
        o, lse = plan.outputs(like=plan.no_sinks)
        return (o if out is None else out), (lse if lse_out is None else lse_out)
    return out, lse_out


def _delivered(results, out, lse_out):
    """``results`` (o, lse) written into the caller's outputs where given."""
    o, lse = results
    if out is not None:
        out[...] = o
        o = out
    if lse_out is not None:
        lse_out[...] = lse
        lse = lse_out
    return o, lse


def _run_unbound(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, backend):
    """The launch (or interpretation) of ``plan`` through the general path: numpy inputs,
    the interpreter, or torch tensors the bound launch cannot take. Returns the partials,
    or ``(o, lse)`` for a fused plan."""
    _check_torch_inputs(q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                        seq_lens=seq_lens, block_table=block_table, sinks=sinks)
    lib = ArrayLib(q)
    o_part, lse_part, counts = plan.torch_partials() if lib.torch else plan.numpy_partials()
    if plan.fused:
        o, lse = plan.outputs(like=lse_part if lib.torch else None)
        outputs = [o, lse, lib.full(plan.grid_cells, 0, "i64")]
    else:
        outputs = list(plan.no_outputs)
    args = [q, k_cache.reshape(plan.cache_rows, plan.cache_cols),
            v_cache.reshape(plan.cache_rows, plan.cache_cols), page_table, seq_lens,
            block_table if block_table is not None else plan.no_block_table,
            sinks if sinks is not None else plan.no_sinks,
            o_part, lse_part, counts, *outputs, plan.slots, plan.scale_log2]
    results = (10, 11) if plan.fused else (7, 8, 9)
    if backend == "interpret":
        numpy_args = [lib.numpy(a) for a in args]
        runtime.interpret(plan.kernel, plan.grid, numpy_args, target=plan.chip.name,
                          num_warps=plan.num_warps)
        return tuple(lib.copy_into(args[i], numpy_args[i]) for i in results)
    # numpy arrays (copied per launch) and non-contiguous torch tensors (strides read per call)
    runtime.launch(plan.kernel, plan.grid, args, target=plan.chip.name,
                   num_warps=plan.num_warps)
    return tuple(args[i] for i in results)


def _check_torch_inputs(q, **tensors) -> None:
    """torch inputs must share q's device: a kernel given another device's address faults.
    q must be 4-byte aligned: the kernel reads its bf16 pairs as 32-bit words."""
    if not is_torch(q):
        return
    if q.data_ptr() % Q_ALIGN:
        raise kiln.KilnValueError(f"q's address {q.data_ptr():#x} is not {Q_ALIGN}-byte "
                                  "aligned (a view starting at an odd element?)",
                                  fix="pass q.clone(), or a view that starts at an even element")
    for name, t in tensors.items():
        if is_torch(t) and t.device != q.device:
            raise kiln.KilnValueError(f"{name} is on {t.device} but q is on {q.device}",
                                      fix=f"move {name} to {q.device}")


def compile_decode(dtype="bf16", *, target, head_dim=128, group=8, sq=1, page_size=64,
                   block_sparse=False, sinks=False, config=None, fused_slots=0,
                   merge_slices=1, prefetch_tiles=0):
    """Compile (without running) the decode kernel of one shape class (``config`` None: the
    :func:`default_config` :func:`decode` would use; ``fused_slots``: the kernel of
    :func:`decode_attention` that merges that many splits itself, shared by
    ``merge_slices`` CTAs; ``prefetch_tiles``: early launch, see
    :func:`early_launch_tiles`); returns the
    ``CompiledKernel`` (``.asm`` stages, ``.metadata``).
    Example: ``compile_decode(target="sm_90a", page_size=16, sq=4).metadata["registers"]``."""
    if kiln.dtype(dtype) is not kiln.bf16:
        raise kiln.UnsupportedError(f"paged decode reads bf16 caches, not {kiln.dtype(dtype)}",
                                    fix="use dtype='bf16'")
    if merge_slices not in (1, 2, 4, 8) or merge_slices > max(fused_slots, 1):
        raise kiln.KilnValueError(f"merge_slices={merge_slices} must be 1, 2, 4 or 8 and at "
                                  f"most fused_slots={fused_slots}",
                                  fix="pass merge_slices=1, or fused_slots >= merge_slices")
    chip = nvidia_target(target)
    q_rows = 1 if block_sparse else sq
    config = config or default_config(q_rows * group, head_dim, page_size,
                                      block_sparse=block_sparse)
    rows = 2 * max(page_size, 1)  # placeholder arrays carry dtype and rank only
    bf16, hkv = kiln.bf16.numpy, 1
    hq = hkv * group
    args = [np.zeros((1, sq, hq, head_dim), bf16), np.zeros((rows, hkv * head_dim), bf16),
            np.zeros((rows, hkv * head_dim), bf16), np.zeros((1, 2), np.int32),
            np.zeros(1, np.int32), np.zeros((1, sq, hkv, 1), np.int32), np.zeros(1, np.float32),
            np.zeros((1, 1, sq, hq, head_dim), np.float32), np.zeros((1, 1, sq, hq), np.float32),
            np.zeros((1, sq, hq), np.int32), np.zeros((1, sq, hq, head_dim), bf16),
            np.zeros((1, sq, hq), np.float32), np.zeros((1, 1, 2), np.int64), 1, 0.1]
    kernel = make_kernel(head_dim, group, q_rows, page_size, block_sparse, sinks, config,
                         fused_slots, merge_slices, prefetch_tiles)
    return kernel.compile(*args, target=chip.name, num_warps=config.num_warps)

