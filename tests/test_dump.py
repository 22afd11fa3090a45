"""KILN_DUMP_DIR: file names carry target and specialisation, cache hits dump too, and an
unusable directory is one warning while compiling goes on."""

import warnings

import numpy as np
import pytest
from source_modules import write_kernel_module

from kiln.core.errors import CompilationError
from kiln.runtime import cache

pytestmark = pytest.mark.lower

SOURCE = """
    import kiln
    from kiln import f32

    @kiln.kernel
    def scale(x: kiln.Tensor[f32], BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
        x[i] = x[i] * 2.0
    """


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(dump dir, cache dir), both fresh; the cache is on."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    monkeypatch.delenv("KILN_DUMP_DIR", raising=False)
    cache.toolchain_versions.cache_clear()
    yield tmp_path / "dump", tmp_path / "cache"
    cache.toolchain_versions.cache_clear()


def _stage_files(dump, ck) -> dict:
    """stage -> dumped file of ``ck``, by its prefix."""
    return {p.name[len(ck.dump_prefix) + 1:].split(".")[0]: p
            for p in dump.iterdir() if p.name.startswith(ck.dump_prefix + ".")}


def test_targets_and_specialisations_get_their_own_files(dirs, tmp_path, monkeypatch):
    dump, _ = dirs
    monkeypatch.setenv("KILN_DUMP_DIR", str(dump))
    module = write_kernel_module(tmp_path, "dump_targets_kernel", SOURCE)
    x = np.zeros(256, np.float32)
    compiled = [module.scale.compile(x, BLOCK=64, target="sm_90a"),
                module.scale.compile(x, BLOCK=128, target="sm_90a"),
                module.scale.compile(x, BLOCK=64, target="gfx950")]
    assert len({ck.dump_prefix for ck in compiled}) == 3
    assert all(ck.dump_prefix.startswith(f"scale.{ck.target.name}.") for ck in compiled)
    for ck in compiled:
        files = _stage_files(dump, ck)
        assert set(files) == set(ck.asm), (ck, sorted(files))
        for stage, artifact in ck.asm.items():
            on_disk = files[stage].read_bytes()
            assert on_disk == (artifact if isinstance(artifact, bytes) else artifact.encode())
    assert len(list(dump.glob("*.kiln.mlir"))) == 3


def test_cache_hits_dump_their_stages(dirs, tmp_path, monkeypatch):
    dump, cache_dir = dirs
    x = np.zeros(256, np.float32)
    first = write_kernel_module(tmp_path, "dump_hit_kernel", SOURCE)
    ck = first.scale.compile(x, BLOCK=64, target="gfx942")  # compiled and cached, no dump dir
    assert not dump.exists()

    monkeypatch.setenv("KILN_DUMP_DIR", str(dump))
    again = first.scale.compile(x, BLOCK=64, target="gfx942")  # in-memory hit
    assert again is ck and set(_stage_files(dump, ck)) == set(ck.asm)

    for path in dump.iterdir():
        path.unlink()
    fresh = write_kernel_module(tmp_path, "dump_hit_kernel", SOURCE)  # a new process's view
    hit = fresh.scale.compile(x, BLOCK=64, target="gfx942")  # disk-cache hit
    assert hit is not ck and hit.asm == ck.asm
    (entry,) = cache_dir.rglob("meta.json")  # <root>/<key[:2]>/<key>/meta.json
    assert hit.dump_prefix == f"scale.gfx942.{entry.parent.name[:8]}"
    files = _stage_files(dump, hit)
    assert set(files) == set(ck.asm)
    assert files["amdgcn"].read_text() == ck.asm["amdgcn"]


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_unusable_dump_dir_is_one_warning_and_compiling_goes_on(dirs, tmp_path, monkeypatch,
                                                                 target):
    not_a_dir = tmp_path / "taken"
    not_a_dir.write_text("a file where the dump directory should be")
    monkeypatch.setenv("KILN_DUMP_DIR", str(not_a_dir))
    module = write_kernel_module(tmp_path, "dump_unusable_kernel", SOURCE)
    x = np.zeros(256, np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in (32, 64):
            ck = module.scale.compile(x, BLOCK=block, target=target)
            assert "kiln" in ck.asm and len(ck.asm) >= 5
    messages = [str(w.message) for w in caught if "KILN_DUMP_DIR" in str(w.message)]
    assert len(messages) == 1, messages
    assert str(not_a_dir) in messages[0] and "unset it" in messages[0]


def test_failed_stage_with_unusable_dump_dir_still_gives_a_reproducer(dirs, tmp_path,
                                                                      monkeypatch):
    """The reproducer falls back to a temporary directory instead of raising OSError."""
    not_a_dir = tmp_path / "taken"
    not_a_dir.write_text("")
    monkeypatch.setenv("KILN_DUMP_DIR", str(not_a_dir / "sub"))
    module = write_kernel_module(tmp_path, "dump_repro_kernel", """
        import kiln
        from kiln import f32
        from mlir.dialects import gpu

        @kiln.kernel
        def warp_sum(x: kiln.Tensor[f32]):
            i = kiln.thread_id(0)
            x[i] = kiln.Value(gpu.subgroup_reduce(x[i].ir, gpu.AllReduceOperation.ADD))
        """)
    with warnings.catch_warnings(record=True), pytest.raises(CompilationError) as caught:
        warnings.simplefilter("always")
        module.warp_sum.compile(np.zeros(32, np.float32), target="sm_90a")
    reproducer = caught.value.reproducer
    assert reproducer.endswith(".nvvm.repro.mlir") and "kiln-repro-" in reproducer
    assert "gpu.subgroup_reduce" in open(reproducer).read()
