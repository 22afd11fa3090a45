"""``scf.if`` and ``scf.for`` under per-thread masks.

A uniform condition (or uniform loop bounds) runs like Python. A divergent ``scf.if`` runs each
region that has an active thread, with the context's mask narrowed to those threads, and merges
the yielded values with ``np.where``. A ``scf.for`` with per-thread bounds runs the largest trip
count; a thread whose own count is exhausted is masked off and keeps its loop-carried values.
"""

from __future__ import annotations

import numpy as np

from .plan import np_dtype, semantics
from .state import select


@semantics("scf.if")
def _if(op, p):
    cond = p.operands(op)[0]
    then_block = p.block(op.regions[0].blocks[0])
    else_block = p.block(op.regions[1].blocks[0]) if len(op.regions[1].blocks) else None
    results = p.results(op)

    def branch(block, env, ctx, mask):
        outer = ctx.mask
        ctx.mask = mask
        try:
            block.run(env, ctx)
        finally:
            ctx.mask = outer
        return [env[s] for s in block.yields]

    def run(env, ctx):
        c = env[cond]
        outer = ctx.mask
        if c.shape[0] == 1:
            block = then_block if c[0] else else_block
            if block is not None:
                values = branch(block, env, ctx, outer)
                for r, v in zip(results, values):
                    env[r] = v
            return
        taken = c if outer is None else c & outer
        skipped = ~c if outer is None else ~c & outer
        any_taken, any_skipped = taken.any(), skipped.any()
        then_values = else_values = None
        if any_taken:
            then_values = branch(then_block, env, ctx, None if taken.all() else taken)
        if any_skipped and else_block is not None:
            else_values = branch(else_block, env, ctx, None if skipped.all() else skipped)
        for i, r in enumerate(results):
            if then_values is None:
                env[r] = else_values[i]
            elif else_values is None:
                env[r] = then_values[i]
            else:
                env[r] = select(c, then_values[i], else_values[i])

    return run


@semantics("scf.for")
def _for(op, p):
    lower, upper, step, *inits = p.operands(op)
    body = p.block(op.regions[0].blocks[0])
    iv, carried_slots = body.args[0], body.args[1:]
    iv_dtype = np_dtype(op.regions[0].blocks[0].arguments[0].type)
    results = p.results(op)

    def run(env, ctx):
        lo, hi, st = env[lower], env[upper], env[step]
        carried = [env[s] for s in inits]
        if lo.shape[0] == 1 and hi.shape[0] == 1 and st.shape[0] == 1:
            for k in range(int(lo[0]), int(hi[0]), int(st[0])):
                env[iv] = np.array([k], iv_dtype)
                for s, v in zip(carried_slots, carried):
                    env[s] = v
                body.run(env, ctx)
                carried = [env[y] for y in body.yields]
        else:
            carried = _divergent_loop(lo, hi, st, carried, env, ctx)
        for r, v in zip(results, carried):
            env[r] = v

    def _divergent_loop(lo, hi, st, carried, env, ctx):
        n = ctx.size
        lo, hi, st = (np.broadcast_to(x, (n,)).astype(np.int64) for x in (lo, hi, st))
        trips = np.maximum((hi - lo + st - 1) // st, 0)
        outer = ctx.mask
        if outer is not None:
            trips = np.where(outer, trips, 0)
        try:
            for k in range(int(trips.max(initial=0))):
                active = trips > k
                ctx.mask = None if active.all() else active
                env[iv] = (lo + k * st).astype(iv_dtype)
                for s, v in zip(carried_slots, carried):
                    env[s] = v
                body.run(env, ctx)
                carried = [select(active, env[y], old) for y, old in zip(body.yields, carried)]
        finally:
            ctx.mask = outer
        return carried

    return run
