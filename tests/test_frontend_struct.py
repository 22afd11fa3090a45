"""@kiln.struct: fields with dtypes, rewritten methods, flowing through loops and ifs."""

import re
from typing import TypeVar

import numpy as np
import pytest

import kiln
from kiln import f16, f32, i32


@kiln.struct
class OnlineMax:
    m: f32
    count: i32 = 0

    @classmethod
    def start(cls):
        return cls(m=-float("inf"))

    def update(self, x):
        if x > self.m:
            self.m = x
        self.count = self.count + 1


V = np.zeros(8, np.float32)


def trace(fn, *args, **kw) -> str:
    return kiln.kernel(fn).trace(*args, **kw).module_asm


def test_struct_is_loop_carried_and_methods_are_rewritten():
    def k(x: kiln.Tensor[f32], n: i32):
        state = OnlineMax.start()
        for j in kiln.range(n):
            state.update(x[j])
        x[0] = state.m + kiln.cast(state.count, f32)

    asm = trace(k, V, 8)
    assert "scf.for" in asm and "-> (f32, i32)" in asm
    assert "scf.if" in asm  # the `if` inside update()


def test_struct_through_traced_if_updates_the_instance():
    def k(x: kiln.Tensor[f32], n: i32):
        s = OnlineMax(x[0], 1)
        alias = s
        if n > 3:
            s.m = x[1]
        x[2] = alias.m  # the alias sees the scf.if result

    asm = trace(k, V, 1)
    assert "scf.if" in asm and "-> (f32, i32)" in asm  # the whole struct is yielded
    assert re.search(r"memref.store %\d+#0, %arg0", asm)  # alias.m reads the if's result


def test_field_dtype_is_enforced(marker_line):
    def k(x: kiln.Tensor[f16]):
        s = OnlineMax.start()
        s.m = x[0]  # @bad-field

    with pytest.raises(kiln.KilnTypeError) as info:
        trace(k, np.zeros(2, np.float16))
    err = info.value
    assert "OnlineMax.m is declared f32 but was given f16" in err.message
    assert err.loc.line == marker_line("@bad-field")


def test_unknown_and_missing_fields():
    def missing(x: kiln.Tensor[f32]):
        OnlineMax(count=1)

    def unknown(x: kiln.Tensor[f32]):
        s = OnlineMax.start()
        s.total = 1.0

    with pytest.raises(kiln.KilnTypeError, match="missing field 'm'"):
        trace(missing, V)
    with pytest.raises(kiln.KilnTypeError, match="has no field 'total'"):
        trace(unknown, V)


def test_struct_flatten_roundtrip():
    seen = []

    def k(x: kiln.Tensor[f32]):
        s = OnlineMax(x[0], 2)
        leaves, aux = s.__kiln_flatten__()
        t = OnlineMax.__kiln_unflatten__(aux, leaves)
        seen.append((len(leaves), t.m.ir == s.m.ir, t.count.dtype))

    trace(k, V)
    assert seen == [(2, True, i32)]


T = TypeVar("T")


@kiln.struct
class Pair:
    lo: T
    hi: T

    def widen(self, v):
        self.lo = kiln.minimum(self.lo, v)
        self.hi = kiln.maximum(self.hi, v)


def test_generic_struct_specialises_field_dtypes():
    assert Pair[f32] is Pair[f32] and Pair[f32] is not Pair[f16]
    seen = []

    def k(x: kiln.Tensor[f16]):
        p = Pair[f16](x[0], x[1])
        p.widen(x[2])
        seen.append((p.lo.dtype, type(p).__name__))
        with pytest.raises(kiln.KilnTypeError, match=r"Pair\[f16\].lo is declared f16"):
            p.lo = kiln.cast(x[0], f32)

    trace(k, np.zeros(4, np.float16))
    assert seen == [(f16, "Pair[f16]")]


def test_generic_struct_needs_matching_parameter_count():
    with pytest.raises(kiln.KilnTypeError, match="takes 1 type parameters"):
        Pair[f16, f32]


def test_struct_class_named_inside_a_traced_if_is_not_carried():
    """Constructing a struct inside a traced ``if`` names its class: only instances are carried."""

    @kiln.struct
    class Pair:
        a: kiln.f32
        b: kiln.f32

    @kiln.kernel
    def build(x: kiln.Tensor[kiln.f32], n: kiln.i32):
        i = kiln.thread_id(0)
        total = 0.0
        if i < n:
            p = Pair(a=x[i], b=x[i] * 2.0)
            total = p.a + p.b
        x[i] = total

    asm = build.trace(np.zeros(8, np.float32), 8, target="sm_90a").module_asm
    assert "scf.if" in asm and "arith.mulf" in asm
