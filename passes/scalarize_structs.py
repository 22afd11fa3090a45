"""``kiln-scalarize-structs``: carry ``!llvm.struct`` values through ``scf.for``/``scf.if`` as
their fields.

A WGMMA accumulator is one ``!llvm.struct<(f32 x N)>`` (N up to 128) from trace to LLVM IR, so
a loop or branch that carries it becomes a struct phi fed by a chain of N ``insertvalue``.
LLVM's (IP)SCCP keeps a lattice value per field and revisits every ``insertvalue`` of a chain
whenever one field changes: on the D 256 prefill it was over half of LLVM's optimisation
(``bench/nvptx_pipeline.py``). This pass makes each such loop-carried value or branch result
N scalars: the struct is taken apart (``llvm.extractvalue``) where it is yielded or enters a
loop and built again (``llvm.insertvalue``) where the loop body or the code after the op reads
it; canonicalization then folds every ``extractvalue`` of a rebuilt struct to the scalar, so
no struct phi and no insert chain reach LLVM IR. It runs after the ``gpu`` stage (where
``scf``'s own canonicalization of wide loops would take seconds) and before the loops become
branches.

Example (``kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-scalarize-structs)'``)::

    %r = scf.for %i = %lo to %hi step %c1 iter_args(%acc = %init) -> (!llvm.struct<(f32, f32)>)
    // becomes
    %r:2 = scf.for %i = %lo to %hi step %c1 iter_args(%a0 = %f0, %a1 = %f1) -> (f32, f32)
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm

from kiln.passes import register_pass

NAME = "kiln-scalarize-structs"
_CARRIERS = ("scf.for", "scf.if")
_FUNCTIONS = ("gpu.func", "func.func", "llvm.func")
_STRUCT = llvm.StructType.static_typeid
# SCCP's work on a chain is quadratic in its length: the 128-register accumulators (a
# 64 x 256 WGMMA tile) dominate it; scalarising narrower ones made LLVM slower (D 64 prefill's
# 96-register scores: 113 -> 243 ms of optimisation)
MIN_FIELDS = 128


def _fields(ty: ir.Type) -> list[ir.Type] | None:
    """The field types of a literal ``!llvm.struct`` of scalars, else None."""
    if ty.typeid != _STRUCT:
        return None
    struct = llvm.StructType(ty)
    if struct.opaque or struct.name is not None:
        return None
    body = list(struct.body)
    scalar = all(isinstance(t.maybe_downcast(), (ir.FloatType, ir.IntegerType)) for t in body)
    return body if scalar and len(body) >= MIN_FIELDS else None


def _split(values, loc) -> tuple[list[ir.Value], list]:
    """``values`` with each struct replaced by its fields (extracted at the insertion point),
    and per value its field types (None: kept whole)."""
    out, shapes = [], []
    for value in values:
        fields = _fields(value.type)
        shapes.append(fields)
        if fields is None:
            out.append(value)
        else:
            out += [llvm.extractvalue(t, value, [i], loc=loc) for i, t in enumerate(fields)]
    return out, shapes


def _pack(struct_type: ir.Type, fields: list[ir.Value], loc) -> ir.Value:
    value = llvm.mlir_undef(struct_type, loc=loc)
    for i, field in enumerate(fields):
        value = llvm.insertvalue(value, field, [i], loc=loc)
    return value


def _expanded(types: list[ir.Type]) -> list[ir.Type]:
    out = []
    for ty in types:
        out += _fields(ty) or [ty]
    return out


def _rewrite_yield(block: ir.Block) -> None:
    """Replace ``block``'s ``scf.yield`` by one yielding every struct operand's fields."""
    old = block.operations[len(block.operations) - 1]
    with ir.InsertionPoint(old), old.location:
        operands, _ = _split(list(old.operands), old.location)
        ir.Operation.create("scf.yield", operands=operands)
    old.erase()


def _rebuild_results(old: ir.Operation, new: ir.Operation) -> None:
    """Make uses of ``old``'s results read ``new``'s (struct results packed after ``new``)."""
    results = list(new.results)
    pos = 0
    with ir.InsertionPoint(old), old.location:  # new sits right before old
        for result in old.results:
            fields = _fields(result.type)
            if fields is None:
                result.replace_all_uses_with(results[pos])
                pos += 1
                continue
            packed = _pack(result.type, results[pos:pos + len(fields)], old.location)
            result.replace_all_uses_with(packed)
            pos += len(fields)


def _scalarize_for(op: ir.Operation) -> None:
    loc = op.location
    operands = list(op.operands)
    with ir.InsertionPoint(op):
        inits, shapes = _split(operands[3:], loc)
    new = ir.Operation.create("scf.for", results=_expanded([r.type for r in op.results]),
                              operands=operands[:3] + inits, regions=1, loc=loc,
                              attributes={a.name: a.attr for a in op.attributes},
                              ip=ir.InsertionPoint(op))
    body = op.regions[0].blocks[0]
    body.append_to(new.regions[0])
    old_args = list(body.arguments)[1:]
    new_args = [body.add_argument(t, loc) for t in _expanded([a.type for a in old_args])]
    first = body.operations[0]
    pos = 0
    with ir.InsertionPoint(first):
        for arg, fields in zip(old_args, shapes):
            if fields is None:
                arg.replace_all_uses_with(new_args[pos])
                pos += 1
            else:
                arg.replace_all_uses_with(_pack(arg.type, new_args[pos:pos + len(fields)], loc))
                pos += len(fields)
    for index in range(len(old_args), 0, -1):
        body.erase_argument(index)
    _rewrite_yield(body)
    _rebuild_results(op, new)
    op.erase()


def _scalarize_if(op: ir.Operation) -> None:
    new = ir.Operation.create("scf.if", results=_expanded([r.type for r in op.results]),
                              operands=list(op.operands), regions=2, loc=op.location,
                              attributes={a.name: a.attr for a in op.attributes},
                              ip=ir.InsertionPoint(op))
    for region, target in zip(op.regions, new.regions):
        block = region.blocks[0]
        block.append_to(target)
        _rewrite_yield(block)
    _rebuild_results(op, new)
    op.erase()


def scalarize_structs(module_op: ir.Operation, pass_=None) -> None:
    """In each function where a loop or branch rebuilds a wide struct it carries, carry every
    wide struct of that function as its fields (all of them: one left whole would keep its
    struct phi, fed by the fields packed again)."""
    found: dict = {}  # function -> its carriers, inner ones first

    def visit(op: ir.Operation):
        if op.name in _CARRIERS and any(_fields(r.type) for r in op.results):
            found.setdefault(_function(op), []).append(op.operation)
        return ir.WalkResult.ADVANCE

    module_op.walk(visit, ir.WalkOrder.POST_ORDER)
    for carriers in found.values():
        if not any(_rebuilt(op) for op in carriers):
            continue
        for op in carriers:  # inner ops first; each moves its blocks, so outer ones stay valid
            (_scalarize_for if op.name == "scf.for" else _scalarize_if)(op)


def _function(op: ir.Operation) -> ir.Operation:
    while op.parent is not None and op.name not in _FUNCTIONS:
        op = op.parent
    return op


def _rebuilt(op: ir.Operation) -> bool:
    """Whether a struct ``op`` carries is built by ``insertvalue`` in one of its bodies."""
    for region in op.regions:
        block = region.blocks[0]
        terminator = block.operations[len(block.operations) - 1]
        for value in terminator.operands:
            if _fields(value.type) and not isinstance(value.owner, ir.Block) \
                    and value.owner.name == "llvm.insertvalue":
                return True
    return False


register_pass(NAME, scalarize_structs,
              "Carry literal !llvm.struct values of scalars through scf.for and scf.if as their "
              "fields, so LLVM sees no struct phis or insertvalue chains")
