"""The library entry points as torch custom ops (kernels/torch_ops.py): registration, fake
(meta) implementations, dynamo tracing without graph breaks, the user-kernel helper on the
interpreter; on a GPU, torch.compile(fullgraph=True) and CUDA-graph capture of every entry."""

import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import kiln

torch = pytest.importorskip("torch")

from kiln.kernels import torch_ops  # noqa: E402  (needs torch)

from attention_reference import (assert_attention_close, assert_paged_attention_close,  # noqa: E402
                                 poison_cuda_pool, random_qkv)
from gemm_reference import assert_matmul_close  # noqa: E402

OPS = ("prefill", "decode", "decode_attention", "combine", "matmul", "grouped_matmul")
BF16 = torch.bfloat16


def test_importing_kiln_does_not_import_torch():
    """torch is optional: only ``kiln.kernels.torch_ops`` imports it."""
    code = ("import sys, kiln, kiln.kernels, kiln.kernels.attention, kiln.kernels.gemm; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", OPS)
def test_ops_are_registered_without_mutation(name):
    schema = getattr(torch.ops.kiln, name).default._schema
    assert schema.name == f"kiln::{name}"
    assert not schema.is_mutable, schema


# --- fake implementations: shapes and dtypes without running anything ----------------------

def _fake_cases():
    """(call on the wrapper module, expected [(shape, dtype)] of the outputs)."""
    def t(*shape, dtype=BF16):
        return torch.empty(shape, dtype=dtype)
    i32, f32 = torch.int32, torch.float32
    return {
        "prefill": (lambda: torch_ops.prefill(t(2, 5, 8, 64), t(2, 7, 2, 64), t(2, 7, 2, 64)),
                    [((2, 5, 8, 64), BF16)]),
        "prefill_lse": (lambda: torch_ops.prefill(t(2, 5, 8, 128, dtype=torch.float16),
                                                  t(2, 7, 4, 128, dtype=torch.float16),
                                                  t(2, 7, 4, 128, dtype=torch.float16),
                                                  causal=True, window=(3, 0), return_lse=True),
                        [((2, 5, 8, 128), torch.float16), ((2, 8, 5), f32)]),
        "prefill_ragged": (lambda: torch_ops.prefill(
            t(9, 4, 64), t(11, 2, 64), t(11, 2, 64), cu_seqlens_q=t(3, dtype=i32),
            cu_seqlens_k=t(3, dtype=i32), sinks=t(4, dtype=f32), return_lse=True),
            [((9, 4, 64), BF16), ((4, 9), f32)]),
        "prefill_ragged_max_seqlen": (lambda: torch_ops.prefill(
            t(9, 4, 64), t(11, 2, 64), t(11, 2, 64), cu_seqlens_q=t(3, dtype=i32),
            cu_seqlens_k=t(3, dtype=i32), max_seqlen_q=7, max_seqlen_k=11),
            [((9, 4, 64), BF16)]),
        "decode": (lambda: torch_ops.decode(
            t(3, 2, 16, 128), t(10, 64, 2, 128), t(10, 64, 2, 128), t(3, 4, dtype=i32),
            t(3, dtype=i32), num_splits=5),
            [((5, 3, 2, 16, 128), f32), ((5, 3, 2, 16), f32), ((3, 2, 16), i32)]),
        "decode_block_sparse": (lambda: torch_ops.decode(
            t(2, 4, 8, 64), t(6, 64, 1, 64), t(6, 64, 1, 64), t(2, 3, dtype=i32),
            t(2, dtype=i32), block_table=t(2, 4, 1, 3, dtype=i32)),
            [((3, 2, 4, 8, 64), f32), ((3, 2, 4, 8), f32), ((2, 4, 8), i32)]),
        "decode_attention": (lambda: torch_ops.decode_attention(
            t(3, 2, 16, 128), t(10, 64, 2, 128), t(10, 64, 2, 128), t(3, 4, dtype=i32),
            t(3, dtype=i32)), [((3, 2, 16, 128), BF16), ((3, 2, 16), f32)]),
        "combine": (lambda: torch_ops.combine(t(5, 2, 1, 8, 64, dtype=f32), t(5, 2, 1, 8, dtype=f32),
                                              t(2, 1, 8, dtype=i32), out_dtype=kiln.f32),
                    [((2, 1, 8, 64), f32), ((2, 1, 8), f32)]),
        "combine_bf16": (lambda: torch_ops.combine(t(5, 2, 1, 8, 64, dtype=f32),
                                                   t(5, 2, 1, 8, dtype=f32), t(2, 1, 8, dtype=i32)),
                         [((2, 1, 8, 64), BF16), ((2, 1, 8), f32)]),
        "matmul": (lambda: torch_ops.matmul(t(30, 40, dtype=torch.float16),
                                            t(40, 17, dtype=torch.float16)),
                   [((30, 17), torch.float16)]),
        "matmul_trans_b": (lambda: torch_ops.matmul(t(30, 40), t(17, 40), trans_b=True,
                                                    out_dtype="f32"), [((30, 17), f32)]),
        "grouped_matmul": (lambda: torch_ops.grouped_matmul(t(50, 32, dtype=torch.float16),
                                                            t(3, 32, 24, dtype=torch.float16),
                                                            t(4, dtype=i32)),
                           [((50, 24), BF16)]),
        "grouped_matmul_trans_b": (lambda: torch_ops.grouped_matmul(
            t(50, 32), t(3, 24, 32), t(4, dtype=i32), trans_b=True, out_dtype=kiln.f16),
            [((50, 24), torch.float16)]),
    }


@pytest.mark.parametrize("case", list(_fake_cases()))
@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_fake_implementation_shapes(case, mode):
    """Under FakeTensorMode (or on meta tensors) each op gives outputs of the entry point's
    shapes and dtypes on the inputs' device without launching anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    call, expected = _fake_cases()[case]
    if mode == "fake":
        with FakeTensorMode():
            out = call()
    else:
        with torch.device("meta"):
            out = call()
    outs = out if isinstance(out, tuple) else (out,)
    assert [(tuple(o.shape), o.dtype) for o in outs] == expected
    assert all(o.device.type == ("cpu" if mode == "fake" else "meta") for o in outs)


@pytest.mark.parametrize("case", list(_fake_cases()))
def test_dynamo_traces_ops_without_graph_break(case):
    """``torch.compile(fullgraph=True)`` traces a function calling the op into one graph that
    holds the op (meta inputs: the graph runs on the fake implementations)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    call, expected = _fake_cases()[case]

    def fn(scale):
        out = call()
        outs = out if isinstance(out, tuple) else (out,)
        return [o * scale if o.is_floating_point() else o + 1 for o in outs]

    torch._dynamo.reset()
    with torch.device("meta"):
        outs = torch.compile(fn, fullgraph=True, backend=backend)(torch.tensor(2.0))
    assert [(tuple(o.shape), o.dtype) for o in outs] == expected
    assert len(graphs) == 1
    name = max((op for op in OPS if case.startswith(op)), key=len)
    assert f"torch.ops.kiln.{name}(" in graphs[0].code, graphs[0].code


def test_ops_forward_the_entry_points_keywords(monkeypatch):
    """Each op's real implementation calls its entry point with the wrapper's keywords (schema
    defaults mapped back: window (-1, -1) and chunk 0 are None) and returns its outputs."""
    import kiln.kernels.attention as attention
    import kiln.kernels.gemm as gemm

    calls = {}

    def recorder(name, outputs):
        def entry(*args, **kwargs):
            calls[name] = (args, kwargs)
            return outputs(*args, **kwargs)
        return entry

    x = torch.ones(2, 3, 4, 64)
    monkeypatch.setattr(attention, "prefill", recorder("prefill", lambda q, *_, return_lse, **__: (
        (q + 1, torch.zeros(2, 4, 3)) if return_lse else q + 1)))
    monkeypatch.setattr(attention, "decode_attention", recorder("decode", lambda q, *_, **__: (
        q + 2, torch.zeros(q.shape[:3]))))
    words = torch.arange(8.0)  # three allocations, as the entry point's partials are
    monkeypatch.setattr(attention, "decode", recorder("partials", lambda q, *_, **__: (
        q[None] + 4, words[:4].clone(), words[4:].view(torch.int32).clone())))
    monkeypatch.setattr(attention, "combine", recorder("combine", lambda o, *_, **__: (
        o[0] + 3, torch.zeros(o.shape[1:4]))))
    monkeypatch.setattr(gemm, "matmul", recorder("matmul", lambda a, b, **_: a @ b))
    monkeypatch.setattr(gemm, "grouped_matmul", recorder("grouped",
                                                         lambda a, b, o, **_: a @ b[0].T))

    o, lse = torch_ops.prefill(x, x, x, causal=True, window=(5, 0), scale=0.5, return_lse=True)
    assert torch.equal(o, x + 1) and lse.shape == (2, 4, 3)
    assert calls["prefill"][1] == dict(causal=True, window=(5, 0), chunk=None, sinks=None,
                                       scale=0.5, softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                                       max_seqlen_q=None, max_seqlen_k=None, return_lse=True)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    torch_ops.prefill(x[0], x[0], x[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2,
                      max_seqlen_k=3)
    assert calls["prefill"][1] | dict(cu_seqlens_q=None, cu_seqlens_k=None) == dict(
        causal=False, window=None, chunk=None, sinks=None, scale=None, softcap=0.0,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=2, max_seqlen_k=3, return_lse=False)
    o = torch_ops.prefill(x, x, x, chunk=16)
    assert torch.equal(o, x + 1)
    assert calls["prefill"][1]["window"] is None and calls["prefill"][1]["chunk"] == 16
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    o, _ = torch_ops.decode_attention(x, x, x, table, lens, num_splits=3, fused_combine=False)
    assert torch.equal(o, x + 2)
    assert calls["decode"][1] == dict(num_splits=3, block_table=None, scale=None, sinks=None,
                                      fused_combine=False)
    o_p, lse_p, counts = torch_ops.decode(x, x, x, table, lens, num_splits=2, scale=0.25)
    assert torch.equal(o_p, x[None] + 4) and torch.equal(lse_p, words[:4])
    assert torch.equal(counts, words[4:].view(torch.int32))
    assert calls["partials"][1] == dict(num_splits=2, block_table=None, scale=0.25, sinks=None)
    parts = torch.ones(3, 2, 3, 4, 64)
    o, _ = torch_ops.combine(parts, parts[..., 0], lens, max_splits=4, out_dtype=kiln.f32)
    assert torch.equal(o, parts[0] + 3)
    assert calls["combine"][1] == dict(max_splits=4, out_dtype="f32")
    a = torch.ones(5, 64)
    assert torch.equal(torch_ops.matmul(a, a.T, out_dtype=torch.float32), a @ a.T)
    assert calls["matmul"][1] == dict(trans_b=False, out_dtype="f32")
    torch_ops.grouped_matmul(a, a[None], torch.tensor([0, 5], dtype=torch.int32),
                             trans_b=True)
    assert calls["grouped"][1] == dict(trans_b=True, out_dtype=None)


def test_decode_op_runs_compiled_on_the_entry_points_partials(monkeypatch):
    """The op returns the entry point's three partials as they are (three allocations: an
    op's outputs may not alias), and a compiled graph around it (aot_eager: real outputs
    through the traced graph) gives eager's values."""
    import kiln.kernels.attention as attention

    def partials(q, *_, num_splits, **__):
        shape = (num_splits, *q.shape)
        o = torch.full(shape, float("nan")).copy_(
            q[None] + torch.arange(num_splits)[:, None, None, None, None])
        return o, torch.full(shape[:4], 0.5), torch.full(shape[1:4], 2, dtype=torch.int32)

    monkeypatch.setattr(attention, "decode", partials)
    q, cache = torch.randn(2, 1, 16, 64), torch.zeros(4, 64, 2, 64)
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)

    def fn(q):
        o, lse, counts = torch_ops.decode(q * 2, cache, cache, table, lens, num_splits=3)
        return o - 1, lse * 4, counts + 1

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q)
    for g, e in zip(got, fn(q)):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert got[0].shape == (3, 2, 1, 16, 64)
    torch.testing.assert_close(got[0][2], 2 * q + 1)  # slot 2 holds 2q + 2, less one
    assert torch.equal(got[2], torch.full((2, 1, 16), 3, dtype=torch.int32))


# --- the user-kernel helper ------------------------------------------------------------------

@kiln.kernel(num_threads="BLOCK")
def _scale_add(x, y, out, total, n: kiln.i32, a: kiln.f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        out[i] = a * x[i] + y[i]
        total[i] = kiln.cast(x[i] + y[i], kiln.f64)


def _scale_add_op(name):
    return torch_ops.custom_op(
        name, _scale_add, constexprs=dict(BLOCK=64),
        outputs={"out": lambda x, y, n, a: (x.shape, x.dtype),
                 "total": lambda x, y, n, a: (x.shape, torch.float64)},
        grid=lambda x, y, n, a: (-(-n // 64),))


_SCALE_ADD = _scale_add_op("kilntest::scale_add")


def test_custom_op_helper_runs_a_user_kernel(rng):
    """The helper's op runs the kernel (interpreter for CPU tensors) on fresh outputs, has the
    inferred schema, passes torch's opcheck and compiles without a graph break."""
    x = torch.from_numpy(rng.standard_normal(150).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal(150).astype(np.float32))
    schema = str(torch.ops.kilntest.scale_add.default._schema)
    assert schema == ("kilntest::scale_add(Tensor x, Tensor y, int n, float a) -> "
                      "(Tensor, Tensor)")
    out, total = _SCALE_ADD(x, y, 150, 2.5)
    x64, y64 = x.double(), y.double()
    torch.testing.assert_close(out.double(), 2.5 * x64 + y64, atol=1e-6, rtol=1e-6)
    assert total.dtype == torch.float64  # an output dtype of the helper's choosing
    torch.testing.assert_close(total, (x + y).double(), atol=0, rtol=0)
    torch.library.opcheck(_SCALE_ADD, (x, y, 150, 2.5))
    compiled = torch.compile(lambda x, y: _SCALE_ADD(x * 2, y, x.numel(), 0.5)[0] + 1,
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, y).double(), x64 + y64 + 1, atol=1e-6, rtol=1e-6)


def test_custom_op_helper_one_output_and_errors():
    with pytest.raises(kiln.KilnValueError, match="not run-time parameters"):
        torch_ops.custom_op("kilntest::bad", _scale_add, grid=lambda *a: (1,),
                            outputs={"nope": lambda *a: ((1,), torch.float32)})
    with pytest.raises(kiln.KilnValueError, match="needs a tensor input"):
        torch_ops.custom_op("kilntest::bad2", _scale_add, grid=lambda *a: (1,),
                            outputs={name: lambda *a: ((1,), torch.float32)
                                     for name in ("x", "y", "out", "total")})
    op = torch_ops.custom_op("kilntest::scale_add_one", _scale_add, constexprs=dict(BLOCK=64),
                             outputs={"total": lambda x, y, out, n, a: (x.shape, torch.float64)},
                             grid=lambda x, y, out, n, a: (1,))
    assert str(torch.ops.kilntest.scale_add_one.default._schema).endswith("-> Tensor")
    x = torch.arange(5, dtype=torch.float32)
    torch.testing.assert_close(op(x, x, torch.empty(5), 5, 1.0), 2 * x.double())
    copy = torch_ops.custom_op("kilntest::copy", _copy, constexprs=dict(BLOCK=64),
                               outputs={"y": lambda x, n: (x.shape, x.dtype)},
                               grid=lambda x, n: (1,))
    x = torch.randn(50).to(BF16)  # bf16 reaches the interpreter as an ml_dtypes array
    assert torch.equal(copy(x, 50), x)


@kiln.kernel(num_threads="BLOCK")
def _copy(x, y, n: kiln.i32, BLOCK: kiln.constexpr):
    i = kiln.thread_id(0)
    if i < n:
        y[i] = x[i]


# --- GPU: torch.compile and CUDA graphs -----------------------------------------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _entries():
    """The library entry points with the keywords the wrappers share."""
    from kiln.kernels.attention import combine, decode, decode_attention, prefill
    from kiln.kernels.gemm import grouped_matmul, matmul

    return types.SimpleNamespace(prefill=prefill, decode=decode,
                                 decode_attention=decode_attention, combine=combine,
                                 matmul=matmul, grouped_matmul=grouped_matmul)


class _Problem:
    """One small problem for an op: ``inputs()`` draws fresh device inputs, ``call(api, *x)``
    calls it through ``api`` (torch_ops or the entry points), ``check(out, *x)`` compares
    against a float64 reference."""

    def __init__(self, name, rng):
        self.name, self.rng = name, rng

    def inputs(self):
        dev, rng = _cuda(), self.rng
        if self.name == "prefill":
            q, k, v, _, _ = random_qkv(rng, batch=2, sq=70, sk=130, hq=4, hkv=2, d=64)
            return [torch.from_numpy(x).to(dev, BF16) for x in (q, k, v)]
        if self.name.startswith("prefill_ragged"):
            q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=0, sk=0, hq=4, hkv=1, d=64,
                                             ragged_q=[5, 70, 1], ragged_k=[40, 70, 129])
            return [torch.from_numpy(x).to(dev, BF16) for x in (q, k, v)] + \
                [torch.from_numpy(x).to(dev) for x in (cu_q, cu_k)]
        if self.name in ("decode", "decode_attention"):
            B, Hkv, group, page, L = 2, 2, 8, 64, 300
            pages = -(-L // page)
            kc = torch.randn(B * pages, page, Hkv, 64, device=dev, dtype=BF16)
            table = torch.randperm(B * pages, device=dev).view(B, pages).int()
            q = torch.randn(B, 1, Hkv * group, 64, device=dev, dtype=BF16)
            lens = torch.tensor([L, L - 77], device=dev, dtype=torch.int32)
            return [q, kc, torch.randn_like(kc), table, lens]
        if self.name == "combine":
            splits = 4
            o_p = torch.randn(splits, 2, 1, 8, 64, device=dev)
            lse_p = 3 * torch.randn(splits, 2, 1, 8, device=dev)
            counts = torch.randint(1, splits + 1, (2, 1, 8), device=dev, dtype=torch.int32)
            return [o_p, lse_p, counts]
        if self.name == "matmul":
            return [torch.randn(100, 64, device=dev, dtype=BF16),
                    torch.randn(64, 72, device=dev, dtype=BF16)]
        offs = torch.tensor([0, 70, 70, 200], device=dev, dtype=torch.int32)
        return [torch.randn(200, 64, device=dev, dtype=BF16),
                torch.randn(3, 64, 48, device=dev, dtype=BF16), offs]

    def call(self, api, *x):
        """The op (or entry point) on ``x``; its outputs as a tuple."""
        if self.name == "prefill":
            return api.prefill(*x, causal=True, return_lse=True)
        if self.name.startswith("prefill_ragged"):
            q, k, v, cu_q, cu_k = x
            # FlashAttention's host-side bounds (no synchronisation); "_host" reads cu_seqlens
            bounds = {} if self.name.endswith("_host") else dict(max_seqlen_q=70,
                                                                 max_seqlen_k=129)
            return api.prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                               return_lse=True, **bounds)
        if self.name == "decode":
            return api.decode(*x, num_splits=3)
        if self.name == "decode_attention":
            return api.decode_attention(*x)
        if self.name == "combine":
            return api.combine(*x, max_splits=8, out_dtype=kiln.f32)
        if self.name == "matmul":
            return (api.matmul(*x),)
        return (api.grouped_matmul(*x, out_dtype=kiln.f32),)

    def written(self, out):
        """``out`` with what the op leaves unwritten set to a fixed value: decode's partial
        slots at or past a row's split count (the combine reads only the first ``counts``)."""
        if self.name != "decode":
            return list(out)
        o_p, lse_p, counts = out
        live = torch.arange(o_p.shape[0], device=o_p.device)[:, None, None, None] < counts
        return [torch.where(live[..., None], o_p, 0.0),
                torch.where(live, lse_p, float("-inf")), counts]

    def check(self, out, *x):
        if self.name == "prefill":
            q, k, v = (t.float().cpu().numpy() for t in x)
            assert_attention_close(out[0], q, k, v, lse=out[1], causal=True)
        elif self.name.startswith("prefill_ragged"):
            q, k, v = (t.float().cpu().numpy() for t in x[:3])
            cu_q, cu_k = (t.cpu().numpy() for t in x[3:])
            assert_attention_close(out[0], q, k, v, lse=out[1], causal=True, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k)
        elif self.name == "decode_attention":
            assert_paged_attention_close(out[0], out[1], *x)
        elif self.name == "decode":  # the partials merged in float64
            o, lse = _combine_reference(*(t.double().cpu().numpy() for t in out))
            # held to decode's own output rounding: its P.V runs in bf16
            assert_paged_attention_close(o.astype(ml_dtypes.bfloat16), lse, *x)
        elif self.name == "combine":
            want_o, want_lse = _combine_reference(*(t.double().cpu().numpy() for t in x))
            for got, want in zip(out, (want_o, want_lse)):
                np.testing.assert_allclose(got.double().cpu().numpy(), want, atol=1e-5,
                                           rtol=1e-5)
        elif self.name == "matmul":
            assert_matmul_close(out[0], *(t.double().cpu().numpy() for t in x))
        else:
            a, b, offs = (t.double().cpu().numpy() for t in x)
            offs = offs.astype(int)
            for g in range(len(offs) - 1):
                rows = slice(offs[g], offs[g + 1])
                if offs[g + 1] > offs[g]:
                    assert_matmul_close(out[0][rows], a[rows], b[g])


def _halve_first(x):
    """``x`` with its first tensor (q, o_partial or a) halved: exact in every dtype here."""
    return [x[0] * 0.5, *x[1:]]


def _combine_reference(o_p, lse_p, counts):
    """Float64 merge of each row's first ``counts`` splits (natural-log LSE); the slots past
    them are never read (decode leaves them unwritten: NaN-poisoned here)."""
    live = np.arange(o_p.shape[0])[:, None, None, None] < counts[None]
    lse = np.where(live, lse_p, -np.inf)
    m = lse.max(axis=0)
    w = np.exp(lse - m[None])
    z = w.sum(axis=0)
    o = (w[..., None] * np.where(live[..., None], o_p, 0.0)).sum(axis=0)
    return o / z[..., None], m + np.log(z)


class _Module(torch.nn.Module):
    """The op between elementwise torch ops (scalings by powers of two, exact both ways)."""

    def __init__(self, problem):
        super().__init__()
        self.problem = problem

    def forward(self, *x):
        return tuple(o * 2 for o in self.problem.call(torch_ops, *_halve_first(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS + ("prefill_ragged", "prefill_ragged_host"))
def test_op_under_torch_compile_matches_eager_and_reference(name, rng):
    """torch.compile(fullgraph=True) of a module calling the op (between torch ops) gives
    eager's results bit for bit, and both match a float64 reference on NaN-poisoned memory."""
    _cuda()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    problem = _Problem(name, rng)
    x = problem.inputs()
    module = _Module(problem)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    poison_cuda_pool(torch, 1 << 24)
    eager = module(*x)
    poison_cuda_pool(torch, 1 << 24)
    got = compiled(*x)
    torch.cuda.synchronize()
    problem.check([o * 0.5 for o in got], *_halve_first(x))
    for g, e in zip(*(problem.written([o * 0.5 for o in out]) for out in (got, eager))):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=False)


@pytest.mark.gpu
@pytest.mark.parametrize("via", ["entry", "op"])
@pytest.mark.parametrize("name", [
    "prefill", "decode", "decode_attention", "combine",
    "matmul", "grouped_matmul",  # c's descriptor, new inside the capture: its arena
    "prefill_ragged"])  # with max_seqlen_q: cu_seqlens stay on the device
def test_entry_point_replays_in_a_cuda_graph(name, via, rng):
    """Each entry point (and its op) is captured once after a warm-up (compile, autotune,
    bind) and replayed on fresh inputs copied into the captured buffers, with its outputs
    poisoned before each replay."""
    _cuda()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    problem = _Problem(name, rng)
    api = torch_ops if via == "op" else _entries()
    static = problem.inputs()
    problem.call(api, *static)  # compile, tune and bind outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        problem.call(api, *static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the TMA-read inputs keep their (warm) addresses
        out = problem.call(api, *static)
    for _ in range(2):
        for buffer, fresh in zip(static, problem.inputs()):
            buffer.copy_(fresh)
        for o in out:  # split counts (int32) poisoned with -1
            o.fill_(float("nan") if o.is_floating_point() else -1)
        graph.replay()
        torch.cuda.synchronize()
        problem.check(out, *static)


@kiln.kernel(num_threads="BLOCK")
def _axpy(x, y, out, n: kiln.i32, a: kiln.f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        out[i] = a * x[i] + y[i]


_AXPY = torch_ops.custom_op("kilntest::axpy", _axpy, constexprs=dict(BLOCK=128),
                            outputs={"out": lambda x, y, n, a: (x.shape, x.dtype)},
                            grid=lambda x, y, n, a: (-(-n // 128),))


@pytest.mark.gpu
def test_custom_op_helper_compiles_and_replays_on_the_gpu(rng):
    """A user kernel turned into an op: torch.compile(fullgraph=True) matches eager and a
    float64 reference; a capture replays on fresh inputs with its output poisoned."""
    dev = _cuda()
    torch.manual_seed(int(rng.integers(2 ** 31)))
    x, y = torch.randn(1000, device=dev), torch.randn(1000, device=dev)

    def fn(x, y):
        return _AXPY(x * 2, y, x.numel(), 0.5) * 2

    def want(x, y):
        return (2 * (x.double() + y.double())).cpu()

    torch._dynamo.reset()
    poison_cuda_pool(torch, 1 << 20)
    eager = fn(x, y)
    got = torch.compile(fn, fullgraph=True)(x, y)
    torch.testing.assert_close(got, eager, atol=0, rtol=0)
    torch.testing.assert_close(got.double().cpu(), want(x, y), atol=1e-5, rtol=1e-5)
    _AXPY(x, y, x.numel(), 0.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _AXPY(x, y, x.numel(), 1.0)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        y.copy_(torch.randn_like(y))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double().cpu(), (x.double() + y.double()).cpu(),
                                   atol=1e-6, rtol=1e-6)
