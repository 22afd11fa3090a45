"""The events reaching a value (:mod:`kiln.passes.reaching_events`): forwarded by register data
movement, through a loop's iter_args (each loop run until they stop growing) and the results
of ``scf.for`` / ``scf.if``; a value no event flows into reaches none."""

from __future__ import annotations

from types import SimpleNamespace

from mlir import ir

from kiln.passes.reaching_events import ReachingEvents

# %e stands for an event's result; the loop rotates it through three iter_args (it reaches %a
# only on the third trip), %d carries only its initial value, and the scf.if yields it on one arm.
_TEXT = """
func.func @f(%lo: index, %hi: index, %st: index, %x: f32, %p: i1) -> f32 {
  %e = arith.addf %x, %x : f32
  %r:4 = scf.for %i = %lo to %hi step %st iter_args(%a = %x, %b = %x, %c = %x, %d = %x)
      -> (f32, f32, f32, f32) {
    %ci = arith.bitcast %c : f32 to i32
    %c2 = arith.bitcast %ci : i32 to f32
    %s = arith.mulf %d, %x : f32
    scf.yield %b, %c2, %e, %s : f32, f32, f32, f32
  }
  %y = scf.if %p -> (f32) {
    scf.yield %r#0 : f32
  } else {
    scf.yield %x : f32
  }
  %u = arith.mulf %y, %r#3 : f32
  return %u : f32
}
"""


def _tree(block: ir.Block) -> list:
    """The op tree ReachingEvents walks: each op with its kind and nested blocks."""
    steps = []
    for view in block.operations:
        op = view.operation
        kind = {"scf.for": "for", "scf.if": "if"}.get(op.name, "op")
        steps.append(SimpleNamespace(op=op, kind=kind, blocks=[
            _tree(b) for region in op.regions for b in region.blocks]))
    return steps


def test_events_rotate_through_iter_args_to_a_fixed_point():
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(_TEXT)
        func = module.body.operations[0]
        entry = func.regions[0].blocks[0]
        event_op = entry.operations[0].operation
        loop = entry.operations[1]
        reaching = ReachingEvents({event_op: "E"}, _tree(entry))
        body = loop.regions[0].blocks[0]
        a, b, c, d = list(body.arguments)[1:]
        for value in (a, b, c, body.operations[1].result, loop.results[0], loop.results[2],
                      entry.operations[2].results[0]):
            assert reaching(value) == {"E"}, value
        for value in (d, body.arguments[0], loop.results[3], body.operations[2].result,
                      entry.arguments[3], entry.operations[3].result):
            assert reaching(value) == set(), value
        assert reaching.rounds <= 7  # the function, the body until %a stops growing, two arms
