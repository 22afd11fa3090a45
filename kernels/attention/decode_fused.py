"""The fused combine of :func:`kiln.kernels.attention.decode_attention`'s one-kernel path:
after storing its partials, a split CTA draws tickets, and the last CTA (or the last few) of
each (batch, KV head, row block) merges every split's partial, read from L2, into ``o`` and
``lse`` (:func:`combine_if_last`)."""

from __future__ import annotations

import math

import kiln
from kiln import nvidia_asm

from .decode_config import LN2, LOG2E, MAX_COMBINE_LOADS, PUBLISHED
from .decode_rows import interleaved_columns


@kiln.func
def combine_if_last(o_part, lse_part, o_out, lse_out, tickets, arrival, last, b, q_first,
                    kv_head, row0, tid, shape, slots, merge_slices, cta=None):
    """Merge all ``slots`` splits of this CTA's rows into ``o_out`` / ``lse_out`` if this CTA
    is (one of) the last of its (batch, KV head, row block), as
    :func:`kiln.kernels.attention.combine` would (every slot read: a split that saw no key
    has LSE ``-inf`` and weight 0). Each (batch, KV head, row block) has two i64 counters,
    ``tickets[z, y, ARRIVED]`` and ``tickets[z, y, PUBLISHED]``; they only grow (every launch
    adds ``slots`` to each), so ``ticket % slots`` is a CTA's place in its launch.

    - ``merge_slices == 1``: thread 0 took ``arrival``, its ARRIVED ticket, when the main loop
      ended, and its round trip overlapped the CTA's own merge. The CTA that arrived last
      merges: it waits (:func:`kiln.nvidia_asm.wait_for_count`) until the other ``slots - 1``
      have published, and so skips the fence after its own stores and the atomic round trip
      of a ticket drawn after them. The others fence and add to PUBLISHED (the last adds
      after its wait). It waits only for CTAs that arrived before it, so are running.
    - ``merge_slices > 1``: every CTA fences and draws a PUBLISHED ticket; the CTAs that drew
      the last ``merge_slices`` each merge ``D / merge_slices`` columns: slice ``k`` goes to
      the CTA ``k`` places before the last, which waits until PUBLISHED reaches the end of the
      launch. It waits for at most ``k`` CTAs of its (batch, KV head, row block), the ones
      without a ticket yet; CTAs start in block order and those splits are adjacent in it
      (``x``), so they are running or next to start.

    Ordering (CUTLASS's split-K semaphore pattern): the CTA barrier puts every thread's
    partial stores before thread 0's gpu-scope fence and PUBLISHED ticket; in a merging CTA
    thread 0 acquires (the wait's acquire loads, or a fence after the last ticket), and the
    second barrier orders its threads' reads of the other splits' partials (just written, so
    from L2) after that; its own partials are ordered by the barriers alone. Each of
    ``per_row`` threads of a row takes its 4-column chunks (:func:`interleaved_columns`, so
    a load instruction reads whole sectors); its loads of a chunk of splits are independent,
    so up to ``MAX_COMBINE_LOADS`` 16-byte loads a thread are in flight. ``cta``: the
    tickets' (row block) index (default ``(block_id(2), block_id(1))``, decode's grid);
    ``shape`` needs ``head_dim``, ``packed``, ``group`` (traced values allowed),
    ``combine_rows`` and ``combine_threads_per_row``."""
    if cta is None:
        cta = (kiln.block_id(2), kiln.block_id(1))
    kiln.barrier()
    if tid == 0:
        if merge_slices == 1:
            ticket = arrival
        else:
            kiln.fence("gpu")
            ticket = tickets.atomic_add(*cta, PUBLISHED, 1)
        place = ticket % slots
        slice_index = kiln.cast(slots - 1 - place, kiln.i32)  # 0: the last to arrive or publish
        last[0] = slice_index
        if merge_slices == 1:
            if slice_index == 0:
                # Every other split arrived first (and is running): wait until they published.
                nvidia_asm.wait_for_count(tickets, *cta, PUBLISHED,
                                          target=ticket - place + slots - 1)
            else:
                kiln.fence("gpu")
            tickets.atomic_add(*cta, PUBLISHED, 1)
        else:
            if slice_index == 0:
                kiln.fence("gpu")
            if (slice_index > 0) & (slice_index < merge_slices):
                nvidia_asm.wait_for_count(tickets, *cta, PUBLISHED,
                                          target=ticket - place + slots)
    kiln.barrier()
    width = shape.head_dim // merge_slices
    per_row = min(shape.combine_threads_per_row, width // 4)
    r = tid // per_row
    slice_index = last[0]
    columns = [slice_index * width + c for c in interleaved_columns(tid, per_row, width)]
    row = row0 + r
    if (slice_index < merge_slices) & (r < shape.combine_rows) & (row < shape.packed):
        q_index = q_first + row // shape.group
        head = kv_head * shape.group + row % shape.group
        m = lse_part[0, b, q_index, head]
        for s in kiln.static_range(1, slots):
            m = kiln.maximum(m, lse_part[s, b, q_index, head])
        m_safe = kiln.where(m == -math.inf, 0.0, m)  # every split empty: no -inf - -inf
        total = kiln.cast(0.0, kiln.f32)
        acc = [kiln.vector_constant([0.0] * 4, kiln.f32) for _ in columns]
        chunk = max(1, MAX_COMBINE_LOADS // len(columns))
        for first in kiln.static_range(0, slots, chunk):
            splits = range(first, min(first + chunk, slots))
            lses = [lse_part[s, b, q_index, head] for s in splits]
            parts = [[o_part.load(s, b, q_index, head, c, width=4, align=16)
                      for c in columns] for s in splits]
            for x, vectors in zip(lses, parts):
                w = kiln.exp2((x - m_safe) * LOG2E)
                total = total + w
                # One instruction a column: this merge is issue-bound, not bandwidth-bound.
                acc = [kiln.fma(v, w, a) for a, v in zip(acc, vectors)]
        valid = (total > 0.0) & (total < math.inf)
        inv = kiln.where(valid, 1.0 / kiln.maximum(total, 1e-30), 0.0)
        for c, a in zip(columns, acc):  # combine's contract: no valid denominator, O = 0
            o_out.store(b, q_index, head, c, kiln.cast(kiln.where(valid, a * inv, 0.0),
                                                       kiln.bf16), align=8)
        if (tid % per_row == 0) & (slice_index == 0):
            lse_out[b, q_index, head] = kiln.where(
                valid, m_safe + kiln.log2(kiln.maximum(total, 1e-30)) * LN2, -math.inf)

