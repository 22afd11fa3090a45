"""A library call's fresh torch outputs from one allocation (the torch bridge's joint makers,
``TorchOutputs.fast``), and each on its own inside a torch custom op (``separate_outputs``),
whose outputs may not share a storage. Torch CPU tensors (the GPU machine runs the same)."""

import shutil

import numpy as np
import pytest

from kiln.kernels import runtime
from kiln.kernels.attention import combine, decode, decode_attention
from kiln.kernels.workspaces import SEPARATE, TorchOutputs, separate_outputs
from kiln.runtime import native_torch

from decode_problems import torch_paged

torch = pytest.importorskip("torch")


@pytest.fixture
def bridge():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    made = native_torch.load_bridge("c++")
    assert made is not None  # a real torch and a compiler: the bridge must build and load
    previous = native_torch._LOADED[:]
    native_torch.use_bridge(made)
    yield made
    native_torch.use_bridge(previous[0] if previous else None)
    if not previous:
        native_torch._LOADED.clear()


SPECS = (((3, 5, 7), torch.float32), ((3, 5), torch.bfloat16), ((9,), torch.int32))


def test_a_joint_maker_carves_aligned_disjoint_tensors_from_one_storage(bridge, rng):
    fresh = TorchOutputs(torch.zeros(2), *SPECS)
    assert len(fresh.fast) == 1 and type(fresh.fast[0]).__name__ == "JointMaker"
    made = fresh.fast[0]()
    assert len(made) == 3
    base = made[0].untyped_storage().data_ptr()
    for tensor, (shape, dtype) in zip(made, SPECS):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.untyped_storage().data_ptr() == base  # one allocation
        assert (tensor.data_ptr() - base) % 256 == 0  # parts 256 bytes apart, as allocations
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in made)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    values = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
              if dtype != torch.int32 else
              torch.from_numpy(rng.integers(-9, 9, shape).astype(np.int32))
              for shape, dtype in SPECS]
    for tensor, value in zip(made, values):
        tensor.copy_(value)
    for tensor, value in zip(made, values):  # no write reached another part
        assert torch.equal(tensor, value)


def test_a_second_call_gives_new_memory(bridge):
    fresh = TorchOutputs(torch.zeros(2), *SPECS)
    first = fresh.fast[0]()
    second = fresh.fast[0]()
    assert first[0].untyped_storage().data_ptr() != second[0].untyped_storage().data_ptr()


def test_joint_outputs_off_or_one_output_keep_one_maker_a_tensor(bridge, monkeypatch):
    single = TorchOutputs(torch.zeros(2), SPECS[0])
    assert single.fast is single.makers
    monkeypatch.setenv("KILN_JOINT_OUTPUTS", "0")
    off = TorchOutputs(torch.zeros(2), *SPECS)
    assert off.fast is off.makers and len(off.makers) == 3


def test_under_deterministic_fill_a_joint_maker_gives_separate_filled_tensors(bridge):
    fresh = TorchOutputs(torch.zeros(2), SPECS[0], SPECS[1])
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        o, lse = fresh.fast[0]()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert o.untyped_storage().data_ptr() != lse.untyped_storage().data_ptr()
    assert torch.isnan(o).all() and torch.isnan(lse.float()).all()  # torch's NaN fill


def test_separate_outputs_nests_and_is_per_thread():
    import threading

    assert SEPARATE.depth == 0
    with separate_outputs():
        with separate_outputs():
            assert SEPARATE.depth == 2
        seen = []
        thread = threading.Thread(target=lambda: seen.append(SEPARATE.depth))
        thread.start()
        thread.join()
        assert SEPARATE.depth == 1 and seen == [0]
    assert SEPARATE.depth == 0


def _shared(tensors) -> bool:
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_entry_points_share_one_allocation_but_in_a_custom_op(bridge, rng):
    """decode's three partials, decode_attention's and combine's (o, lse): one storage from a
    direct call, one each inside separate_outputs and through torch.ops.kiln (whose aliasing
    check would refuse shared outputs)."""
    from kiln.kernels import torch_ops

    paged = torch_paged(torch, rng)
    with runtime.use_runtime(runtime.DryRuntime()):
        partials = decode(*paged, target="sm_90a")
        assert _shared(partials)
        assert _shared(decode_attention(*paged, target="sm_90a"))
        assert _shared(combine(*partials, max_splits=partials[0].shape[0], target="sm_90a"))
        with separate_outputs():
            assert not _shared(decode(*paged, target="sm_90a"))
            assert not _shared(decode_attention(*paged, target="sm_90a"))
        assert not _shared(torch_ops.decode(*paged))
        assert not _shared(torch_ops.decode_attention(*paged))
        assert not _shared(torch_ops.combine(*partials, max_splits=partials[0].shape[0]))
