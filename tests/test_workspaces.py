"""Per-stream internal buffers of library plans (kiln.kernels.workspaces): one kept set per
stream for eager calls, one set per CUDA-graph capture; on the GPU,
decode_attention's partials and tickets on two concurrent streams and around a capture."""

import itertools

import pytest

from kiln.kernels.workspaces import StreamWorkspaces

from attention_reference import assert_paged_attention_close


def _counter():
    made = itertools.count()
    return lambda: ("set", next(made))


def _no_capture(stream):
    raise AssertionError("no capture id is asked for outside a capture")


def test_eager_calls_reuse_one_set_per_stream():
    spaces = StreamWorkspaces(_counter(), _no_capture, capturing=lambda: False)
    first, second = spaces.get(11), spaces.get(22)
    assert first != second  # two streams may run at once: two sets
    assert spaces.get(11) is first and spaces.get(22) is second and spaces.get(None) not in (
        first, second)
    assert len(spaces) == 3


def test_each_capture_gets_its_own_set_and_keeps_no_eager_one():
    capturing, capture = [False], [None]
    spaces = StreamWorkspaces(_counter(), lambda stream: capture[0],
                              capturing=lambda: capturing[0])
    eager = spaces.get(7)
    capturing[0], capture[0] = True, 101  # a graph captured on the stream eager calls use
    first = [spaces.get(7), spaces.get(7)]
    capture[0] = 102  # another graph, on the same stream
    second = [spaces.get(7), spaces.get(7)]
    assert first[0] is first[1] and second[0] is second[1]  # one set a capture
    assert len({eager, first[0], second[0]}) == 3
    capturing[0] = False
    assert spaces.get(7) is eager and len(spaces) == 1  # captures kept no eager set


def test_only_the_latest_captures_sets_are_held():
    capture = [0]
    spaces = StreamWorkspaces(_counter(), lambda stream: capture[0], capturing=lambda: True)
    sets = []
    for capture[0] in range(StreamWorkspaces.CAPTURES_KEPT + 2):
        sets.append(spaces.get(1))
    assert len(set(sets)) == len(sets)
    assert len(spaces._captured) == StreamWorkspaces.CAPTURES_KEPT


def test_sets_too_large_to_keep_are_made_per_call():
    spaces = StreamWorkspaces(_counter(), _no_capture, keep=False, capturing=lambda: False)
    assert spaces.get(1) != spaces.get(1) and len(spaces) == 0


def _paged(torch, B=2, Hkv=2, group=8, page=64, L=3000, D=128):
    pages = -(-L // page)
    kc = torch.randn(B * pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * pages, device="cuda").view(B, pages).int()
    lens = torch.tensor([L, L // 3], device="cuda", dtype=torch.int32)[:B]
    q = torch.randn(B, 1, Hkv * group, D, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, table, lens


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_decode_attention_workspaces_on_two_streams_and_around_a_capture(fused, rng):
    """Two streams running at once use two kept sets (results stay right); a graph captured
    on a stream with a kept set gets its own set, so eager calls on that stream running
    beside the graph's replays on another stream do not share partials or tickets."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the inputs follow the reported seed
    from kiln.kernels.attention import decode_plan
    from kiln.kernels.attention.decode import decode_attention

    q, kc, vc, table, lens = _paged(torch)
    decode_attention(q, kc, vc, table, lens, fused_combine=fused)  # compile and bind
    plan = decode_plan.PLANS.find((q, kc, vc, table, lens, None, None, None, None, None, None,
                                   None, fused))
    assert plan is not None and plan.bound is not None and (plan.merge is not None or fused)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    queries = [torch.randn_like(q) for _ in streams]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # the inputs above
    results = []
    for s, qs in zip(streams, queries):  # queued back to back: the two may overlap
        with torch.cuda.stream(s):
            results.append([decode_attention(qs, kc, vc, table, lens, fused_combine=fused)
                            for _ in range(3)])
    torch.cuda.synchronize()
    for qs, calls in zip(queries, results):
        for o, lse in calls:
            assert_paged_attention_close(o, lse, qs, kc, vc, table, lens)
    kept = len(plan.spaces)
    made = []
    make = plan.spaces._make
    plan.spaces._make = lambda: made.append(1) or make()
    graph, capture_stream = torch.cuda.CUDAGraph(), streams[0]
    with torch.cuda.graph(graph, stream=capture_stream):
        decode_attention(q, kc, vc, table, lens, fused_combine=fused)  # shares the set
        out, lse = decode_attention(q, kc, vc, table, lens, fused_combine=fused)
    assert len(made) == 1 and len(plan.spaces) == kept  # one set of its own, not kept
    eager_q = torch.randn_like(q)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()  # on the current stream, beside eager calls on the capture stream
        with torch.cuda.stream(capture_stream):
            eager = [decode_attention(eager_q, kc, vc, table, lens, fused_combine=fused)
                     for _ in range(2)]
        torch.cuda.synchronize()
        assert_paged_attention_close(out, lse, q, kc, vc, table, lens)
        for o, eager_lse in eager:
            assert_paged_attention_close(o, eager_lse, eager_q, kc, vc, table, lens)
