"""Ragged (varlen) prefill with FlashAttention's host-side ``max_seqlen_q`` / ``max_seqlen_k``:
interpreter results against the float64 reference (odd and empty sequences, a grid larger than
the longest sequence needs), device prefix sums never read on the host (a dry runtime), the
checks, and on a GPU one CUDA-graph capture replayed on fresh lengths."""

import importlib

import ml_dtypes
import numpy as np
import pytest

import kiln
from attention_reference import assert_attention_close, random_qkv
from kiln.kernels import runtime
from kiln.kernels.attention.prefill import prefill
from kiln.runtime.cuda import cuda_available

prefill_module = importlib.import_module("kiln.kernels.attention.prefill")
BF16 = ml_dtypes.bfloat16


def _ragged(rng, lengths_q, lengths_k, *, hq=2, hkv=1, d=64):
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=len(lengths_q), sq=None, sk=None, hq=hq,
                                     hkv=hkv, d=d, ragged_q=lengths_q, ragged_k=lengths_k)
    return [x.astype(BF16) for x in (q, k, v)], cu_q, cu_k


@pytest.mark.parametrize("lengths_q,lengths_k,extra,mask", [
    # empty query and key sequences, odd lengths; the grid is 3 q tiles larger than needed
    ([17, 0, 65, 1], [33, 5, 0, 130], 130, dict(causal=True)),
    ([0, 129], [61, 129], 0, dict(window=(20, 3))),
])
def test_max_seqlen_sizes_the_grid_and_matches_the_reference(rng, lengths_q, lengths_k,
                                                             extra, mask):
    """With ``max_seqlen_q`` at or above the longest query sequence the kernel skips the q
    tiles past each sequence's end (read from cu_seqlens on the device)."""
    (q, k, v), cu_q, cu_k = _ragged(rng, lengths_q, lengths_k)
    sinks = rng.standard_normal(2).astype(np.float32)
    o, lse = prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks,
                     max_seqlen_q=max(lengths_q) + extra, max_seqlen_k=max(lengths_k) + 1,
                     return_lse=True, backend="interpret", target="sm_90a", **mask)
    assert o.shape == q.shape and lse.shape == (2, sum(lengths_q))
    assert_attention_close(o, q, k, v, lse=lse, sinks=sinks, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, **mask)


def test_max_seqlen_k_zero_attends_nothing(rng):
    """No key in any sequence: ``o = 0`` and ``lse = -inf`` without a launch."""
    q = rng.standard_normal((5, 2, 64)).astype(BF16)
    k = np.zeros((0, 1, 64), BF16)
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.zeros(3, np.int32)
    with runtime.use_runtime(object()):  # neither a launch nor a compile may ask a runtime
        o, lse = prefill(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3,
                         max_seqlen_k=0, return_lse=True)
    assert not np.any(o.astype(np.float32)) and np.all(lse == -np.inf)


@pytest.mark.parametrize("kwargs,words", [
    (dict(max_seqlen_q=4), "below the longest"),        # a host check: sequence 1 has 5
    (dict(max_seqlen_q=5, max_seqlen_k=2), "max_seqlen_k=2 is below"),
    (dict(max_seqlen_q=-1), "must be an int >= 0"),
    (dict(max_seqlen_q=5.0), "must be an int >= 0"),
    (dict(max_seqlen_k=True), "must be an int >= 0"),
])
def test_bad_max_seqlen_is_refused_naming_the_argument(rng, kwargs, words):
    (q, k, v), cu_q, cu_k = _ragged(rng, [3, 5], [4, 3])
    with pytest.raises(kiln.KilnValueError, match=words):
        prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="interpret", **kwargs)


def test_max_seqlen_without_cu_seqlens_is_refused(rng):
    q = rng.standard_normal((1, 4, 2, 64)).astype(BF16)
    with pytest.raises(kiln.KilnValueError, match="cu_seqlens_q/k are not"):
        prefill(q, q[:, :, :1], q[:, :, :1], max_seqlen_q=4, backend="interpret")


def test_device_prefix_sums_are_not_read_on_the_host(monkeypatch):
    """Torch tensors standing in for device ones (``_on_device``): with ``max_seqlen_q`` the
    entry point launches with the grid it sizes from the bound and never reads the prefix
    sums, even ones no host check would pass; their lengths must still agree."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(prefill_module, "_on_device", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setattr(runtime.ArrayLib, "numpy", _refuse_reading)
    q = torch.zeros(300, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(90, 2, 64, dtype=torch.bfloat16)
    unread = torch.tensor([7, -3, 1000], dtype=torch.int32)  # no host check would pass these
    with runtime.use_runtime(runtime.DryRuntime()) as dry:
        o, lse = prefill(q, k, k, cu_seqlens_q=unread, cu_seqlens_k=unread, causal=True,
                         max_seqlen_q=200, max_seqlen_k=90, return_lse=True)
    (kernel, grid, options), = dry.launches
    assert o.shape == q.shape and lse.shape == (4, 300)
    block_m = prefill_module.HopperPrefillConfig.for_head_dim(64).block_m
    assert sorted(grid) == sorted((-(-200 // block_m), 4, 2))
    with pytest.raises(kiln.KilnValueError, match="B \\+ 1 entries"):
        prefill(q, k, k, cu_seqlens_q=unread, cu_seqlens_k=unread[:2], max_seqlen_q=200)


def _refuse_reading(x):
    raise AssertionError(f"read on the host: {type(x).__name__}")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
def test_ragged_prefill_with_max_seqlen_replays_in_a_cuda_graph(rng):
    """Captured once with device prefix sums and ``max_seqlen_q``, replayed after new lengths
    (same totals) are copied into the captured cu_seqlens: each replay matches the float64
    reference on the new ragged batch, with the output poisoned before it."""
    import torch

    hq, hkv, d = 4, 2, 128
    batches = [([70, 1, 0, 186], [129, 40, 77, 1]), ([128, 128, 1, 0], [1, 0, 200, 46]),
               ([1, 255, 0, 1], [2, 3, 4, 238])]
    (q, k, v), cu_q, cu_k = _ragged(rng, *batches[0], hq=hq, hkv=hkv, d=d)
    dev = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16) for x in (q, k, v)]
    cu = [torch.from_numpy(c).cuda() for c in (cu_q, cu_k)]
    bound = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=255, max_seqlen_k=238,
                 causal=True, return_lse=True)
    prefill(*dev, **bound)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = prefill(*dev, **bound)
    for lengths_q, lengths_k in batches:
        (q, k, v), cu_q, cu_k = _ragged(rng, lengths_q, lengths_k, hq=hq, hkv=hkv, d=d)
        for buffer, fresh in zip(dev + cu, (q, k, v, cu_q, cu_k)):
            host = torch.from_numpy(fresh.astype(np.float32) if fresh.dtype == BF16 else fresh)
            buffer.copy_(host.to(buffer.dtype))
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(o, q, k, v, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               causal=True)
