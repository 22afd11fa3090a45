"""Repeat calls of the library entry points on the GPU (issue 42's host path). A steady-state
call of ``prefill``, ``decode``, ``decode_attention``, ``combine`` or ``matmul`` is its plan's
guard (torch's C++ tensor guard where this torch has one) and one C call of its bound launch
(``launch_outputs``: the fresh outputs, the addresses, the launch), and every repeat call one
C call of the one-call object the first installed (:mod:`kiln.kernels.one_call`). Checked here on fresh
random inputs and a poisoned allocator pool: right values, outputs fresh per call (a call's
outputs one allocation through the torch bridge, apart, sharing no storage with an earlier
call's or an input), the plan hit (no new plan), the current torch stream followed, and the
calls captured in a CUDA graph replaying with new inputs written into the captured ones."""

import numpy as np
import pytest

from attention_reference import (_host, assert_attention_close, assert_paged_attention_close,
                                 poison_cuda_pool)
from kiln.core import env
from kiln.kernels import one_call
from kiln.kernels.one_call import one_call_hits
from kiln.runtime import native_torch

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _bf16(*shape):
    return torch.randn(*shape, device="cuda").to(torch.bfloat16)


def _paged(B=2, Hkv=2, group=4, page=64, L=700, D=128):
    pages = -(-L // page)
    kc, vc = _bf16(B * pages, page, Hkv, D), _bf16(B * pages, page, Hkv, D)
    table = torch.randperm(B * pages, device="cuda").view(B, pages).int()
    lens = torch.tensor([L, L // 3], device="cuda", dtype=torch.int32)[:B]
    return [_bf16(B, 1, Hkv * group, D), kc, vc, table, lens]


def _combine_reference(o_part, lse_part, counts):
    """combine's O and LSE in float64 (slots past a row's count ignored)."""
    o_part, lse_part, counts = (_host(x).astype(np.float64) for x in (o_part, lse_part, counts))
    slot = np.arange(o_part.shape[0]).reshape(-1, 1, 1, 1)
    lse = np.where(slot < counts[None], lse_part, -np.inf)
    top = lse.max(axis=0)
    weights = np.exp(lse - top[None])
    total = weights.sum(axis=0)
    o = (weights[..., None] * np.nan_to_num(o_part)).sum(axis=0) / total[..., None]
    return o, np.log(total) + top


def _check_combine(o, lse, o_part, lse_part, counts):
    want_o, want_lse = _combine_reference(o_part, lse_part, counts)
    np.testing.assert_allclose(_host(o).astype(np.float64), want_o, rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(_host(lse), want_lse, rtol=1e-5, atol=1e-5)


def _check_partials(partials, q, kc, vc, table, lens):
    from kiln.kernels.attention import combine

    o_part = partials[0]
    o, lse = combine(*partials, max_splits=o_part.shape[0])
    assert_paged_attention_close(o, lse, q, kc, vc, table, lens)


def _cases():
    """name -> (inputs(): a list of tensors, call(*inputs), check(outputs, *inputs))."""
    from kiln.kernels.attention import combine, decode, decode_attention, prefill
    from kiln.kernels.gemm import matmul

    def dense():
        return [_bf16(1, 192, 4, 64), _bf16(1, 192, 2, 64), _bf16(1, 192, 2, 64)]

    def partials():
        o_part = torch.randn(5, 2, 1, 8, 128, device="cuda")
        counts = torch.randint(1, 6, (2, 1, 8), device="cuda", dtype=torch.int32)
        return [o_part, torch.randn(5, 2, 1, 8, device="cuda"), counts]

    def attention_check(o, q, k, v, lse=None):
        assert_attention_close(o, *(_host(x) for x in (q, k, v)), lse=lse, causal=True)

    def matmul_check(c, a, b):
        want = a.double() @ b.double()
        bound = 2 ** -8 * (a.double().abs() @ b.double().abs()) + 1e-6
        assert ((c.double() - want).abs() <= bound).all()

    return {
        "prefill": (dense, lambda q, k, v: prefill(q, k, v, causal=True),
                    lambda o, *qkv: attention_check(o, *qkv)),
        "prefill return_lse": (dense, lambda q, k, v: prefill(q, k, v, causal=True,
                                                               return_lse=True),
                               lambda out, *qkv: attention_check(out[0], *qkv, lse=out[1])),
        "decode": (_paged, decode, _check_partials),
        "decode_attention": (_paged, decode_attention,
                             lambda out, *args: assert_paged_attention_close(*out, *args)),
        "decode_attention unfused": (
            _paged, lambda *args: decode_attention(*args, fused_combine=False),
            lambda out, *args: assert_paged_attention_close(*out, *args)),
        "combine": (partials, lambda o, lse, c: combine(o, lse, c, max_splits=5),
                    lambda out, *parts: _check_combine(*out, *parts)),
        "matmul": (lambda: [_bf16(64, 128), _bf16(128, 256)], matmul, matmul_check),
    }


CASES = ["prefill", "prefill return_lse", "decode", "decode_attention",
         "decode_attention unfused", "combine", "matmul"]


def _tensors(out):
    return list(out) if isinstance(out, tuple) else [out]


def _storages(tensors):
    return [t.untyped_storage().data_ptr() for t in tensors]


@pytest.mark.parametrize("name", CASES)
def test_repeat_calls_return_fresh_right_outputs_on_the_current_stream(name):
    from kiln.kernels import runtime

    make, call, check = _cases()[name]
    inputs = make()
    before = [slot.call for slot in one_call._SLOTS]
    check(call(*inputs), *inputs)  # compiles, plans, binds (the check's own calls too)
    # the one-call objects the first call installed (none for split-K's paired launch)
    installed = [slot.call for slot, was in zip(one_call._SLOTS, before)
                 if slot.call is not was and slot.call is not None]
    builds = [cache.builds for cache in runtime._CACHES]
    kept, side, served = [], torch.cuda.Stream(), 0
    for i in range(3):
        for x, fresh in zip(inputs, make()):  # new values, same tensors: the plan's guard hits
            x.copy_(fresh)
        poison_cuda_pool(torch, 64 << 20)
        hits = one_call_hits()
        if i == 2:  # on a side stream: the launch follows torch's current stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = call(*inputs)
            torch.cuda.current_stream().wait_stream(side)
        else:
            out = call(*inputs)
        served += one_call_hits() - hits
        torch.cuda.synchronize()
        check(out, *inputs)
        kept.append(_tensors(out))
    assert [cache.builds for cache in runtime._CACHES] == builds  # every repeat call a hit
    assert served == (3 if installed else 0)  # each a call of the installed one-call object
    seen = _storages(inputs) + [_storages(outs)[0] for outs in kept]
    assert len(set(seen)) == len(seen)  # no call's outputs share storage with another's or an input
    joint = native_torch.torch_bridge() is not None and env.joint_outputs()
    for outs in kept:  # a call's outputs: one allocation (the bridge's joint makers), apart
        assert len(set(_storages(outs))) == (1 if joint else len(outs))
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in outs)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("name", CASES)
def test_repeat_calls_capture_and_replay_in_a_cuda_graph(name):
    make, call, check = _cases()[name]
    inputs = make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch's docs say
        call(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*inputs)
    for _ in range(2):
        for x, fresh in zip(inputs, make()):
            x.copy_(fresh)
        for t in _tensors(out):
            t.fill_(float("nan") if t.is_floating_point() else -1)
        graph.replay()
        torch.cuda.synchronize()
        check(out, *inputs)


def test_a_captured_one_call_takes_a_workspace_of_its_own():
    """decode_attention's one C call inside a CUDA-graph capture: the driver's capture check
    sends it to the capture's own partials and tickets (not the eager ones of any stream),
    and the graph replays right on new inputs."""
    from kiln.kernels.attention import decode_attention
    from kiln.kernels.attention.decode_plan import PLANS

    inputs = _paged()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # plans and installs, then one eager one call
        decode_attention(*inputs)
        decode_attention(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    spaces = PLANS.last[1].spaces
    # the plan may hold the capture sets of an earlier test's graphs (same worker, same plan)
    kept, captured, hits = dict(spaces._kept), set(spaces._captured), one_call_hits()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*inputs)
    assert one_call_hits() - hits == 1 and len(set(spaces._captured) - captured) == 1
    assert spaces._kept == kept  # no eager set made or taken
    for x, fresh in zip(inputs, _paged()):
        x.copy_(fresh)
    for t in out:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_paged_attention_close(*out, *inputs)
