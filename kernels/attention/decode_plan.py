"""Host side of :func:`kiln.kernels.attention.decode`: input checks, and the plan of one
shape class (:class:`DecodePlan`: kernel, grid, placeholders and, for contiguous torch
tensors, the bound launch), cached in :data:`PLANS` (a :class:`kiln.kernels.runtime.PlanCache`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

import kiln

from .. import runtime
from ..runtime import (ArrayLib, Dims, PlanCache, check_backend, check_heads,
                       check_paged_lengths, check_positive, empty_like, is_torch, key_of,
                       resolve_target)
from ..workspaces import StreamWorkspaces
from .decode_config import (DEFAULT_SMS, FUSED_COMBINE_MAX_BYTES, LOG2E, MERGE_HELPER_MIN_ROWS,
                            MERGE_SLICES, SUPPORTED_HEAD_DIMS, DecodeShape,
                            decode_partials, default_config, default_num_splits,
                            early_launch_tiles, longest_split_tiles)
from .decode_kernel import make_kernel
from .paged import kv_sub_tile_rows

SCRATCH_MAX_BYTES = 16 << 20  # internal partials kept per plan and stream up to this size


@dataclass(frozen=True)
class DecodePlan:
    """What a decode call of one shape class needs, worked out once (see :data:`PLANS`)."""

    kernel: object  # the @kiln.kernel of make_kernel
    chip: object  # kiln.core.targets.Target
    grid: tuple[int, int, int]
    num_warps: int
    slots: int
    partial_shape: tuple[int, int, int, int, int]  # O_partial; LSE_partial drops D
    cache_rows: int
    cache_cols: int
    scale_log2: float
    no_block_table: object  # placeholders read by no kernel that lacks the feature
    no_sinks: object
    no_outputs: tuple  # (o_out, lse_out, tickets) of a kernel that does not combine
    fused: bool = False  # decode_attention's kernel: the last split CTA combines
    device: object = None  # torch device of q, or None for numpy
    # kiln.kernels.runtime.bind of the plan's contiguous torch tensors: a repeat call only
    # writes ten addresses into a prepared argument block.
    bound: object = None
    merge: object = None  # the combine plan (bound) for these partials, bound with `bound`
    # decode_attention's out= / lse_out= layouts checked last (kiln.kernels.plan_guard of
    # (out, lse_out)): a serving loop passing the same buffers skips the full check.
    checked_outputs: list = field(default_factory=lambda: [None])
    # The one-call objects of the plan's bound steady state, by entry point
    # (kiln.kernels.one_call; None where there is none).
    calls: dict = field(default_factory=dict)

    @property
    def grid_cells(self) -> tuple[int, int, int]:
        """Shape of the ticket counters: ``ARRIVED`` and ``PUBLISHED`` per (grid z, grid y)."""
        return self.grid[2], self.grid[1], 2

    def outputs(self, like=None):
        """Fresh ``(o, lse)`` of a fused call: bf16 ``[B, Sq, Hq, D]`` and f32 ``[B, Sq, Hq]``.
        ``like``: a torch tensor on the plan's device (:attr:`torch_outputs` makes them); None:
        numpy arrays, NaN-poisoned so an element the kernel missed shows."""
        if like is not None:
            return self.torch_outputs()
        shape = self.partial_shape[1:]
        return (np.full(shape, np.nan, kiln.bf16.numpy), np.full(shape[:3], np.nan, np.float32))

    @functools.cached_property
    def torch_outputs(self) -> runtime.TorchOutputs:
        """Fresh torch ``(o, lse)`` on the plan's device (the placeholders' dtypes)."""
        shape = self.partial_shape[1:]
        return runtime.TorchOutputs(self.no_sinks, (shape, self.no_outputs[0].dtype),
                                    (shape[:3], self.no_sinks.dtype))

    @functools.cached_property
    def placeholder_pointers(self) -> tuple[int, int]:
        """Addresses of :attr:`no_block_table` and :attr:`no_sinks` (bound for absent
        features)."""
        return self.no_block_table.data_ptr(), self.no_sinks.data_ptr()

    @functools.cached_property
    def no_output_pointers(self) -> tuple:
        """Addresses of :attr:`no_outputs` (what a kernel that does not combine is bound to)."""
        return tuple(t.data_ptr() for t in self.no_outputs)

    @functools.cached_property
    def lse_offset(self) -> int:
        """f32 words before LSE_partial in the one partials allocation (after O_partial)."""
        return math.prod(self.partial_shape)

    @functools.cached_property
    def counts_offset(self) -> int:
        """f32 words before split_counts (after LSE_partial, 16-byte aligned)."""
        return -(-(self.lse_offset + math.prod(self.partial_shape[:4])) // 4) * 4

    @functools.cached_property
    def partial_words(self) -> int:
        return self.counts_offset + math.prod(self.partial_shape[1:4])

    def torch_partial_words(self):
        """One uninitialised device allocation for O_partial, LSE_partial and split_counts,
        and their three addresses in it (what the bound launches take); the kernel writes
        every element (each split all its rows, split 0 the counts)."""
        words = self.no_sinks.new_empty(self.partial_words)  # f32, on the plan's device
        base = words.data_ptr()
        return words, (base, base + 4 * self.lse_offset, base + 4 * self.counts_offset)

    @functools.cached_property
    def spaces(self) -> StreamWorkspaces:
        """The internal buffers of bound :func:`decode_attention` calls, per stream:
        ``spaces.get(stream)`` is ``(owners, addresses)``, the addresses of the three partials
        (that never leave the call) and, fused, of the ticket counters (zeroed once; each
        launch adds ``slots`` to each), in the order the launch takes them. Kept per stream up
        to ``SCRATCH_MAX_BYTES`` of partials (made per call above it), one per CUDA-graph
        capture for the calls it records; the caller holds ``owners`` until its launches are queued (see
        :class:`~kiln.kernels.workspaces.StreamWorkspaces`)."""
        return StreamWorkspaces(self._new_workspace, runtime.capture_id,
                                keep=4 * self.partial_words <= SCRATCH_MAX_BYTES)

    def _new_workspace(self) -> tuple:
        import torch

        words, partials = self.torch_partial_words()
        if not self.fused:
            return words, partials
        tickets = torch.zeros(self.grid_cells, dtype=torch.int64, device=self.device)
        return (words, tickets), (*partials, tickets.data_ptr())

    @functools.cached_property
    def partial_outputs(self) -> runtime.TorchOutputs:
        """Fresh O_partial, LSE_partial (f32) and split_counts (int32) on the plan's device
        (:class:`~kiln.kernels.runtime.TorchOutputs`: ``fast``, one maker of the three from one
        allocation, is what a bound :func:`decode` call's ``launch_outputs`` calls; in a torch
        custom op ``makers``, three allocations). The kernel writes every element (each split
        all its rows, split 0 the counts)."""
        import torch

        shape = tuple(self.partial_shape)
        return runtime.TorchOutputs(self.no_sinks, (shape, torch.float32),
                                    (shape[:4], torch.float32), (shape[1:4], torch.int32))

    @property
    def partial_makers(self) -> tuple:
        """One maker per partial (three allocations; see :attr:`partial_outputs`)."""
        return self.partial_outputs.makers

    def torch_partials(self) -> tuple:
        """Fresh torch O_partial, LSE_partial and split_counts (see :attr:`partial_makers`)."""
        return tuple(make() for make in self.partial_makers)

    def numpy_partials(self):
        """The partials as numpy arrays filled with NaN / -1, so an element the kernel did
        not write shows in the interpreter tests."""
        shape = self.partial_shape
        return (np.full(shape, np.nan, np.float32), np.full(shape[:4], np.nan, np.float32),
                np.full(shape[1:4], -1, np.int32))


# Plans of decode and decode_attention by the tensors' specs and the options (see
# kiln.kernels.runtime): a repeat call skips validation, kernel selection and binding.
PLANS = PlanCache("decode")


def get_plan(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale, sinks,
             target, backend, config, fused) -> DecodePlan:
    """The cached plan of this call's shape class: the key holds each tensor's shape, dtype,
    strides and device, so a plan's bound launch fits every call that finds it."""
    values = (q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits, scale,
              target, backend, config, fused)
    plan = PLANS.find(values)
    if plan is None:
        plan = make_plan(ArrayLib(q), q, k_cache, v_cache, page_table, seq_lens, num_splits,
                         block_table, scale, sinks, target, backend, config, fused)
        if backend != "interpret" and plan.kernel is not None and \
                runtime.bindable(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks):
            plan = _bind(plan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                         target)
        PLANS.add(key_of(values), plan, values)
    return plan


def _bind(plan: DecodePlan, q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
          target) -> DecodePlan:
    """``plan`` with its decode launch bound to these contiguous torch tensors' layouts, and
    (unless the kernel combines itself) the bound combine plan of its partials."""
    from .combine import plan_combine

    partials = plan.torch_partials()
    # The example tickets carry the shape and strides the launch binds (the addresses of the
    # per-stream counters are passed per call).
    outputs = (*plan.outputs(like=partials[1]), empty_like(partials[1], plan.grid_cells, "i64")) \
        if plan.fused else plan.no_outputs
    args = [q, k_cache.reshape(plan.cache_rows, plan.cache_cols),
            v_cache.reshape(plan.cache_rows, plan.cache_cols), page_table, seq_lens,
            block_table if block_table is not None else plan.no_block_table,
            sinks if sinks is not None else plan.no_sinks, *partials, *outputs, plan.slots,
            plan.scale_log2]
    bound = runtime.bind(plan.kernel, plan.grid, args, target=plan.chip.name,
                         num_warps=plan.num_warps)
    if plan.fused:
        return replace(plan, bound=bound)
    merge = plan_combine(*partials, max_splits=plan.slots, partials=decode_partials(plan.slots),
                         target=target)
    return replace(plan, bound=bound, merge=merge if merge.bound is not None else None)


def make_plan(lib, q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale,
              sinks, target, backend, config, fused) -> DecodePlan:
    """The plan of a call's shape class, built from scratch (``lib``: the caller's
    :class:`ArrayLib`); :func:`get_plan` caches it."""
    dims = check_inputs(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks,
                        num_splits, scale)
    B, Sq, Hq, D = (dims[d] for d in ("B", "Sq", "Hq", "D"))
    num_pages, page_size, Hkv = dims["num_pages"], dims["page_size"], dims["Hkv"]
    check_backend(backend)
    if B * Sq * Hq == 0:  # nothing to attend: empty outputs, no kernel
        slots = block_table.shape[3] if block_table is not None else num_splits or 1
        return DecodePlan(kernel=None, chip=None, grid=(0, 0, 0), num_warps=0, slots=slots,
                          partial_shape=(slots, B, Sq, Hq, D), cache_rows=0, cache_cols=0,
                          scale_log2=0.0, no_block_table=None,
                          no_sinks=lib.full((1,), 0.0, "f32"),  # torch_partial_words' like
                          no_outputs=(), fused=bool(fused),
                          device=lib.device if lib.torch else None)
    group = Hq // Hkv
    q_rows = 1 if block_table is not None else Sq
    slots, row_blocks, config = split_layout(
        B, Sq, Hq, Hkv, D, page_size, num_pages, page_table.shape[1],
        None if block_table is None else block_table.shape[3], num_splits, config, backend)
    grid = (slots, Hkv * row_blocks, B * Sq if block_table is not None else B)
    rows = DecodeShape(D, group, q_rows, page_size, config).combine_rows
    if fused is None:
        fused = slots * rows * D * 4 <= FUSED_COMBINE_MAX_BYTES
    # The interpreter runs one CTA at a time: a CTA waiting for a later one would never return.
    # The slices split D, so their count is a power of two, and at most one slice a split.
    merge_slices = min(MERGE_SLICES, 1 << (int(slots).bit_length() - 1)) \
        if fused and backend != "interpret" and rows >= MERGE_HELPER_MIN_ROWS else 1
    prefetch_tiles = 0 if block_table is not None else early_launch_tiles(
        config, D, page_size, page_table.shape[1] * page_size, int(slots))
    kernel = make_kernel(D, group, q_rows, page_size, block_table is not None,
                         sinks is not None, config, int(slots) if fused else 0, merge_slices,
                         prefetch_tiles)
    return DecodePlan(kernel=kernel, chip=nvidia_target(target), grid=grid,
                      num_warps=config.num_warps, slots=int(slots),
                      partial_shape=(slots, B, Sq, Hq, D), cache_rows=num_pages * page_size,
                      cache_cols=Hkv * D,
                      scale_log2=float((D ** -0.5 if scale is None else scale) * LOG2E),
                      no_block_table=lib.full((1, 1, 1, 1), -1, "i32"),
                      no_sinks=lib.full((1,), 0.0, "f32"),
                      no_outputs=(lib.full((1, 1, 1, 1), 0.0, "bf16"),
                                  lib.full((1, 1, 1), 0.0, "f32"), lib.full((1, 1, 2), 0, "i64")),
                      fused=bool(fused), device=lib.device if lib.torch else None)


def split_layout(B, Sq, Hq, Hkv, D, page_size, num_pages, max_pages, block_slots, num_splits,
                 config, backend) -> tuple[int, int, object]:
    """``(slots, row_blocks, config)`` of a call from its sizes alone (``block_slots``: a
    block table's ``top_k``, else None): the partials' first dimension, so the torch op's fake
    implementation shapes them as the plan does."""
    q_rows = 1 if block_slots is not None else Sq
    packed = q_rows * (Hq // Hkv)
    chosen = config
    config = config or default_config(packed, D, page_size, block_sparse=block_slots is not None)
    kv_sub_tile_rows(config.block_n, page_size)  # page size must tile the key block
    row_blocks = config.row_blocks(packed, D)
    if block_slots is not None:
        return block_slots, row_blocks, config
    slots = num_splits or default_num_splits(B, Hkv, num_pages * page_size, config.block_n,
                                             sms=launch_sms(backend), row_blocks=row_blocks)
    if chosen is None:  # with the split count known only the stages can change
        tiles = longest_split_tiles(max_pages * page_size, config.block_n, slots)
        config = default_config(packed, D, page_size, tiles_per_split=tiles)
    return slots, row_blocks, config


def partial_slots(q_shape, cache_shape, max_pages, block_slots, num_splits, backend=None) -> int:
    """The partials' slot count of a :func:`decode` call on tensors of these shapes (q
    ``[B, Sq, Hq, D]``, cache ``[num_pages, page_size, Hkv, D]``), for a fake implementation.
    Example: ``partial_slots((1, 1, 32, 128), (256, 64, 8, 128), 256, None, None)``."""
    B, Sq, Hq, D = q_shape
    num_pages, page_size, Hkv, _ = cache_shape
    if B * Sq * Hq == 0:
        return block_slots if block_slots is not None else num_splits or 1
    return int(split_layout(B, Sq, Hq, Hkv, D, page_size, num_pages, max_pages, block_slots,
                            num_splits, None, backend)[0])


def launch_sms(backend) -> int:
    """The SMs whose one wave of CTAs the default split count fills: those of the GPU the call
    launches on (device 0, as every Kiln launch), or ``DEFAULT_SMS`` when interpreted. With
    132 assumed, a GPU of 114 SMs (H100 PCIe) would run a second wave of 14 CTAs, doubling the
    time."""
    if backend == "interpret":
        return DEFAULT_SMS
    return runtime.multiprocessor_count()


def check_inputs(q, k_cache, v_cache, page_table, seq_lens, block_table, sinks, num_splits,
                 scale) -> Dims:
    """Kinds, ranks, dtypes and agreeing sizes of a call's arguments (checked once per shape
    class: the plan caches the result); values are checked per call (:func:`check_values`)."""
    dims = Dims()
    dims.tensor("q", q, "B Sq Hq D", dtype=kiln.bf16)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        dims.tensor(name, cache, "num_pages page_size Hkv D", dtype=kiln.bf16)
    dims.tensor("page_table", page_table, "B max_pages", dtype=kiln.i32)
    dims.tensor("seq_lens", seq_lens, "B", dtype=kiln.i32)
    if block_table is not None:
        dims.tensor("block_table", block_table, "B Sq Hkv top_k", dtype=kiln.i32)
        check_positive("block_table's top_k", dims["top_k"], integer=True,
                       fix="give every row at least one slot (-1 selects nothing)")
    if sinks is not None:
        dims.tensor("sinks", sinks, "Hq", dtype=kiln.f32)
    check_heads(dims["Hq"], dims["Hkv"], q_name="q", kv_name="k_cache",
                error=kiln.UnsupportedError)
    if dims["D"] not in SUPPORTED_HEAD_DIMS:
        raise kiln.UnsupportedError(f"head dim {dims['D']} is not supported",
                                    fix=f"use one of {SUPPORTED_HEAD_DIMS}")
    if dims["Sq"] > 16:
        raise kiln.UnsupportedError(f"q has Sq={dims['Sq']} tokens; decode takes 0..16",
                                    fix="use prefill for long Sq")
    for dim in ("num_pages", "page_size"):
        check_positive(f"k_cache's {dim}", dims[dim], integer=True,
                       fix="a paged cache needs at least one page of at least one row")
    if num_splits is not None:
        check_positive("num_splits", num_splits, integer=True,
                       fix="leave num_splits=None for the default")
    if scale is not None:  # the kernel takes row maxima of unscaled scores
        check_positive("scale", scale, fix="pass a positive softmax scale, or None for 1/sqrt(D)")
    return dims


def check_values(k_cache, page_table, seq_lens, block_table, validate) -> None:
    """Page ids and lengths against the cache (see
    :func:`kiln.kernels.runtime.check_paged_lengths`), block-sparse indices at least -1 (numpy
    only: a larger index selects a block past the sequence, which the kernel skips)."""
    check_paged_lengths(page_table, seq_lens, num_pages=int(k_cache.shape[0]),
                        page_size=int(k_cache.shape[1]), validate=validate)
    selected = None if block_table is None or is_torch(block_table) else np.asarray(block_table)
    if selected is not None and selected.size and int(selected.min()) < -1:
        raise kiln.KilnValueError("block_table holds an entry below -1",
                                  fix="list selected block indices, padded with -1 at the end")


def nvidia_target(target):
    """The target chip of a decode call (None: the default); it must have TMA.
    Example: ``nvidia_target("sm_90a").name == "sm_90a"``."""
    chip = resolve_target(target)
    if not chip.has_tma:
        raise kiln.UnsupportedError(f"paged decode loads pages with TMA, which {chip.name} "
                                    "lacks", fix="use target='sm_90a'")
    return chip
