"""Front end through lowering: compile for NVIDIA and AMD, launch on a GPU when present."""

import numpy as np
import pytest
from sample_kernels import row_stats, saxpy, sum_after_wait

import kiln

compiler = pytest.importorskip("kiln.lowering.compiler")


X = np.arange(8, dtype=np.float32)


@pytest.mark.lower
@pytest.mark.parametrize("target, stage", [("sm_90a", "ptx"), ("gfx950", "amdgcn")])
def test_compile_saxpy_for_both_vendors(target, stage, monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    ck = saxpy.compile(X, X, 8, 2.0, BLOCK=64, target=target, num_warps=2)
    assert list(ck.asm)[:2] == ["kiln", "gpu"] and stage in ck.asm
    assert "gpu.func @saxpy" in ck.asm["kiln"]
    assert ck.signature.block == (2 * (32 if target.startswith("sm") else 64), 1, 1)
    assert saxpy.compile(X, X, 8, 2.0, BLOCK=64, target=target, num_warps=2) is ck  # memoised


@pytest.mark.lower
def test_compile_struct_loop_and_shared_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    for target in ("sm_90a", "gfx942"):
        ck = row_stats.compile(np.zeros((2, 4), np.float32), np.zeros((2, 2), np.float32), 4,
                               target=target)
        assert "scf.for" in ck.asm["kiln"] and "memref.global" in ck.asm["kiln"]


@pytest.mark.lower
def test_disk_cache_is_used_across_kernel_objects(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    first = saxpy.compile(X, X, 8, 2.0, BLOCK=32)
    fresh = kiln.kernel(saxpy.fn)  # new JITKernel: no in-memory entry, same source
    traced = []
    monkeypatch.setattr(type(fresh), "_trace_specs",
                        lambda self, *a: traced.append(a) or pytest.fail("re-traced"))
    second = fresh.compile(X, X, 8, 2.0, BLOCK=32)
    assert traced == [] and second.asm["ptx"] == first.asm["ptx"]


def test_launch_path_is_memoised_and_passes_runtime_args(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    launches = []

    def fake_launch(self, grid, args, *, stream=None):
        launches.append((grid, [type(a).__name__ for a in args], stream))

    monkeypatch.setattr(compiler.CompiledKernel, "launch", fake_launch)
    kern = kiln.kernel(saxpy.fn)
    for _ in range(3):
        kern[lambda meta: (8 // meta["BLOCK"],)](X, X, 8, 2.0, BLOCK=4, stream=7)
    assert launches == [((2, 1, 1), ["ndarray", "ndarray", "int", "float"], 7)] * 3
    assert len(kern._compiled) == 1
    kern[(1,)](X, X, 8, np.float32(2.0), 8)  # BLOCK passed positionally: a new value compiles
    kern[(1,)](X, X, 8, np.float32(3.0), 8)  # a scalar's value does not
    assert len(kern._compiled) == 2 and len(launches) == 5
    assert launches[-1][1] == ["ndarray", "ndarray", "int", "float32"]


def _cuda_ok() -> bool:
    try:
        from kiln.runtime.cuda import cuda_available
    except ImportError:
        return False
    return cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs a CUDA GPU and driver")
def test_saxpy_and_row_stats_on_gpu():
    n = 1000
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    y = np.random.default_rng().standard_normal(n).astype(np.float32)
    y0 = y.copy()
    saxpy[((n + 127) // 128,)](x, y, n, 3.0, BLOCK=128, target="sm_90a", num_warps=4)
    # atol: the GPU may fuse 3x + y into one FMA, numpy rounds twice.
    np.testing.assert_allclose(y, 3.0 * x.astype(np.float64) + y0, rtol=1e-6, atol=1e-6)

    m = np.random.default_rng().standard_normal((5, 37)).astype(np.float32)
    out = np.full((5, 2), np.nan, np.float32)  # poisoned: both columns must be written
    row_stats[(5,)](m, out, 37, target="sm_90a")
    np.testing.assert_allclose(out[:, 0], m.max(axis=1))
    # An f32 sum of n terms is off by at most about n·eps·Σ|m|; rtol alone fails on rows whose
    # terms cancel.
    bound = m.shape[1] * np.finfo(np.float32).eps * np.abs(m).astype(np.float64).sum(axis=1)
    np.testing.assert_array_less(np.abs(out[:, 1] - m.astype(np.float64).sum(axis=1)), bound)


@kiln.kernel
def _dependent_copy(x: kiln.Tensor[kiln.f32, 1], y: kiln.Tensor[kiln.f32, 1]):
    kiln.nvidia_asm.grid_dependency_wait()
    i = kiln.thread_id(0)
    y[i] = x[i] * 2.0
    kiln.nvidia_asm.launch_dependents()


@kiln.kernel
def _conditional_wait(x: kiln.Tensor[kiln.f32, 1]):
    if kiln.thread_id(0) == 0:
        kiln.nvidia_asm.grid_dependency_wait()  # @conditional-wait
    x[kiln.thread_id(0)] = 1.0


@pytest.mark.lower
def test_grid_dependency_wait_opts_the_kernel_into_programmatic_launch(tmp_path, monkeypatch,
                                                                      marker_line):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    ck = _dependent_copy.compile(X, X, target="sm_90a", num_warps=1)
    ptx = ck.asm["ptx"]
    assert ck.signature.programmatic_launch
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert ptx.index("st.global") < ptx.index("griddepcontrol.launch_dependents")
    assert not saxpy.compile(X, X, 8, 2.0, BLOCK=64, target="sm_90a",
                             num_warps=2).signature.programmatic_launch
    with pytest.raises(kiln.KilnValueError, match="every path") as error:
        _conditional_wait.compile(X, target="sm_90a", num_warps=1)
    assert error.value.loc.line == marker_line("@conditional-wait")
    with pytest.raises(kiln.core.errors.TargetError):
        _dependent_copy.compile(X, X, target="gfx950", num_warps=1)


COUNTERS = np.zeros(1, np.int64)


@kiln.kernel
def _wait_on_i32(counters: kiln.Tensor[kiln.i32, 1]):
    kiln.nvidia_asm.wait_for_count(counters, 0, target=1)  # @i32-counters


@kiln.kernel
def _wait_for_float(counters: kiln.Tensor[kiln.i64, 1]):
    kiln.nvidia_asm.wait_for_count(counters, 0, target=1.5)  # @float-target


@pytest.mark.lower
def test_wait_for_count_spins_with_acquire_loads(tmp_path, monkeypatch, marker_line):
    """The wait is an acquire-load loop on the counter's address, after the ticket; wrong
    operands and non-NVIDIA targets fail at the call with what to change."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    ptx = sum_after_wait.compile(X, X, COUNTERS, X, target="sm_90a", num_warps=1).asm["ptx"]
    ticket = ptx.index("atom.global.add.u64")
    loop = ptx.index("KILN_WAIT_FOR_COUNT:", ticket)
    assert ptx.index("ld.acquire.gpu.global.b64", loop) < ptx.index("bra KILN_WAIT_FOR_COUNT", loop)
    with pytest.raises(kiln.KilnTypeError, match="i64 counters") as error:
        _wait_on_i32.compile(np.zeros(1, np.int32), target="sm_90a", num_warps=1)
    assert error.value.loc.line == marker_line("@i32-counters")
    with pytest.raises(kiln.KilnTypeError, match="must be an integer") as error:
        _wait_for_float.compile(COUNTERS, target="sm_90a", num_warps=1)
    assert error.value.loc.line == marker_line("@float-target")
    with pytest.raises(kiln.core.errors.TargetError, match="NVIDIA"):
        _wait_for_float.compile(COUNTERS, target="gfx950", num_warps=1)


@kiln.kernel
def _vote_and_fence(x: kiln.Tensor[kiln.f32, 1], out: kiln.Tensor[kiln.i32, 1]):
    scratch = kiln.shared((64,), kiln.i32)
    tid = kiln.thread_id(0)
    kiln.nvidia_asm.sched_barrier(scratch, tid)
    out[tid] = kiln.where(kiln.shuffle.any_lane(x[tid] > 0.5), 1, 0)


@kiln.kernel
def _fence_on_global(x: kiln.Tensor[kiln.i32, 1]):
    kiln.nvidia_asm.sched_barrier(x, 0)  # @global-scratch


@kiln.kernel
def _group_vote(x: kiln.Tensor[kiln.f32, 1], out: kiln.Tensor[kiln.i32, 1]):
    tid = kiln.thread_id(0)
    vote = kiln.nvidia_asm.named_barrier_any(1, 128, x[tid] > 0.5)
    out[tid] = kiln.where(vote, 1, 0)


@kiln.kernel
def _wait_reading_a_float(x: kiln.Tensor[kiln.f32, 1]):
    kiln.wgmma.wait_group(0, reads=[x[0]])  # @float-reads


@pytest.mark.lower
def test_named_barrier_any_votes_over_the_whole_group_and_wait_group_checks_reads(marker_line):
    """named_barrier_any is one bar.red.or over the 128 threads (4 warps): one true thread
    makes it true everywhere; wait_group(reads=) takes register A operands only."""
    out = np.full(128, -1, np.int32)
    for hot, want in ((None, 0), (97, 1)):
        x = np.zeros(128, np.float32)
        if hot is not None:
            x[hot] = 1.0
        _group_vote.interpret[1](x, out, num_warps=4)
        np.testing.assert_array_equal(out, [want] * 128)
    ptx = _group_vote.compile(x, out, target="sm_90a", num_warps=4).asm["ptx"]
    assert "bar.red.or.pred p," in ptx
    with pytest.raises(kiln.core.errors.TargetError, match="NVIDIA"):
        _group_vote.compile(x, out, target="gfx950", num_warps=4)
    with pytest.raises(kiln.KilnTypeError, match="register A operand") as error:
        _wait_reading_a_float.compile(x, target="sm_90a", num_warps=4)
    assert error.value.loc.line == marker_line("@float-reads")


@pytest.mark.lower
def test_any_lane_votes_per_warp_and_sched_barrier_checks_its_scratch(marker_line):
    """any_lane is true in every lane of a warp with one true lane and false in the other warp
    (interpreter; on NVIDIA one vote.sync, on AMD a shuffle OR); sched_barrier leaves no trace
    there, wants a shared i32 scratch and an NVIDIA target."""
    x = np.zeros(64, np.float32)
    x[37] = 1.0
    out = np.full(64, -1, np.int32)
    _vote_and_fence.interpret[1](x, out, num_warps=2)
    np.testing.assert_array_equal(out, [0] * 32 + [1] * 32)
    ptx = _vote_and_fence.compile(x, out, target="sm_90a", num_warps=2).asm["ptx"]
    assert "vote.sync.any.pred" in ptx and "mov.u32 t, %clock;" in ptx
    with pytest.raises(kiln.KilnTypeError, match="shared tensor of i32") as error:
        _fence_on_global.compile(np.zeros(4, np.int32), target="sm_90a", num_warps=1)
    assert error.value.loc.line == marker_line("@global-scratch")
    with pytest.raises(kiln.core.errors.TargetError, match="NVIDIA"):
        _vote_and_fence.compile(x, out, target="gfx950", num_warps=1)
