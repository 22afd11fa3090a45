"""``kiln.autotune`` on the CPU: an injected timer decides, the winner persists on disk."""

import json

import numpy as np
import pytest

import kiln
from kiln.autotune import autotune


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    return tmp_path


def make_entry(cost_of, calls):
    def timer(run):
        run()
        return cost_of[calls[-1]]

    @autotune(configs=["small", "medium", "large"], key=["n"], warmup=1, repeat=3, timer=timer,
              progress=False)
    def entry(x, n, *, config):
        calls.append(config)
        return f"{config}:{n}"

    return entry


def test_picks_the_fastest_config_once_per_key():
    calls = []
    cost = {"small": 3.0, "medium": 1.0, "large": 2.0}
    entry = make_entry(cost, calls)
    assert entry(np.zeros(4), 10) == "medium:10"
    tuned_calls = len(calls)
    assert tuned_calls == 3 * (1 + 3) + 1  # warm-up + repeats per config, then the real call
    assert entry(np.zeros(4), 10) == "medium:10"
    assert len(calls) == tuned_calls + 1  # no re-tuning for a known key
    cost["large"] = 0.5
    assert entry(np.zeros(4), 11) == "large:11"  # a new key tunes again


def test_winner_persists_across_processes(private_cache):
    cost = {"small": 1.0, "medium": 2.0, "large": 3.0}
    first = make_entry(cost, [])
    assert first(None, 7) == "small:7"
    files = list((private_cache / "autotune").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == {"n=7": 0}
    calls = []
    cost = {"small": 9.0, "medium": 9.0, "large": 0.1}  # would now pick "large" if it re-tuned
    second = make_entry(cost, calls)
    assert second(None, 7) == "small:7" and calls == ["small"]


def test_failing_configs_are_skipped_and_progress_is_drawn(capsys):
    @autotune(configs=[1, 2, 3], key=["n"], warmup=0, repeat=1, timer=lambda run: run() or 1.0)
    def entry(n, *, config):
        if config != 2:
            raise kiln.ResourceError(f"config {config} does not fit", fix="skip it")
        return config

    assert entry(5) == 2
    err = capsys.readouterr().err
    assert "[kiln.autotune]" in err and "3/3" in err and "#" * 24 in err


def test_every_config_failing_is_an_error():
    @autotune(configs=[1], key=["n"], warmup=0, repeat=1, timer=lambda run: run() or 1.0,
              progress=False)
    def entry(n, *, config):
        raise kiln.ResourceError("too big", fix="smaller")

    with pytest.raises(kiln.KilnValueError, match="every autotune config"):
        entry(3)


def test_bad_arguments():
    with pytest.raises(kiln.KilnValueError, match="at least one config"):
        autotune(configs=[], key=["n"])
    with pytest.raises(kiln.KilnTypeError, match="list of argument names"):
        autotune(configs=[1], key="n")
    with pytest.raises(kiln.KilnValueError, match="not parameters"):
        autotune(configs=[1], key=["m"])(lambda n, *, config: n)


@kiln.kernel
def scale(x: kiln.Tensor[kiln.f32], n: kiln.i32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        x[i] = x[i] * 2.0


def test_kernel_configs_become_launch_keywords(monkeypatch):
    launched = []

    def fake_launch(self, grid, *args, **kwargs):
        launched.append((grid, kwargs))

    monkeypatch.setattr(type(scale), "_launch", fake_launch)
    tuned = autotune(configs=[{"BLOCK": 64, "num_warps": 2}, {"BLOCK": 128, "num_warps": 4}],
                     key=["n"], warmup=0, repeat=1, progress=False,
                     timer=lambda run: run() or float(launched[-1][1]["BLOCK"]))(scale)
    x = np.random.default_rng().random(100).astype(np.float32)
    tuned[(2,)](x, 100)
    assert tuned.best == {"n=100": {"BLOCK": 64, "num_warps": 2}}
    assert launched[-1] == ((2,), {"BLOCK": 64, "num_warps": 2})
    with pytest.raises(kiln.KilnTypeError, match="launch it with a grid"):
        tuned(x, 100)


# ---- the on-disk store: no lost updates, trusts only private JSON ------------------------------
_WRITERS, _KEYS_PER_WRITER = 8, 25


def _tune_keys(writer: int) -> int:
    """Worker: tune distinct keys (n values) while the other writers do the same."""
    entry = make_entry({"small": 1.0, "medium": 2.0, "large": 3.0}, [])
    for n in range(writer * _KEYS_PER_WRITER, (writer + 1) * _KEYS_PER_WRITER):
        entry(None, n)
    return writer


@pytest.mark.slow  # worker processes, 2-3 s (CI runs the slow tier)
def test_concurrent_tuners_lose_no_keys(private_cache):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(_WRITERS) as pool:
        assert pool.map(_tune_keys, range(_WRITERS)) == list(range(_WRITERS))
    (store,) = (private_cache / "autotune").glob("*.json")
    assert json.loads(store.read_text()) == {f"n={n}": 0 for n in range(_WRITERS * _KEYS_PER_WRITER)}
    assert not list((private_cache / "autotune").glob(".*.tmp"))


def _stored_file(private_cache):
    make_entry({"small": 1.0, "medium": 2.0, "large": 3.0}, [])(None, 7)
    (store,) = (private_cache / "autotune").glob("*.json")
    return store


@pytest.mark.filterwarnings("ignore::kiln.core.errors.CacheWarning")
@pytest.mark.parametrize("content", ['{"n=7": "2; import os"}', '{"n=7": true}', "[2]",
                                     "not json", '{"n=7": 99}',
                                     "[" * 100_000])  # deep enough for RecursionError
def test_a_malformed_store_is_ignored(private_cache, monkeypatch, content):
    from kiln.core import trusted_dir

    monkeypatch.setattr(trusted_dir, "_warned", set())
    store = _stored_file(private_cache)
    store.write_text(content)
    calls = []
    cost = {"small": 9.0, "medium": 0.5, "large": 9.0}
    assert make_entry(cost, calls)(None, 7) == "medium:7"  # re-tuned, no crash
    assert json.loads(store.read_text())["n=7"] == 1


def test_an_untrusted_store_directory_is_not_used(private_cache, monkeypatch):
    from kiln.core.errors import CacheWarning
    from kiln.core import trusted_dir

    monkeypatch.setattr(trusted_dir, "_warned", set())
    store = _stored_file(private_cache)
    store.parent.chmod(0o777)
    store.write_text('{"n=7": 2}')  # what another user could plant
    cost = {"small": 0.1, "medium": 9.0, "large": 9.0}
    with pytest.warns(CacheWarning, match=f"chmod 700 {store.parent}"):
        assert make_entry(cost, [])(None, 7) == "small:7"
    assert json.loads(store.read_text()) == {"n=7": 2}  # not written either


def test_kernel_configs_are_compiled_concurrently_before_timing(monkeypatch):
    """Every config's kernel is compiled (in memory) before the first timed launch, with the
    lowering of several configs in flight at once (ptxas and native stages overlap)."""
    import threading

    from kiln.runtime import cache

    launched, in_flight, peak = [], [0], [0]
    real_compile = cache.compile_kernel
    lock = threading.Lock()

    def counting_compile(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            return real_compile(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    @kiln.kernel
    def doubled(x: kiln.Tensor[kiln.f32], n: kiln.i32, BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
        if i < n:
            x[i] = x[i] * 2.0

    def fake_launch(self, grid, *args, **kwargs):
        launched.append(len(doubled._compiled))

    monkeypatch.setattr(cache, "compile_kernel", counting_compile)
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setattr(type(doubled), "_launch", fake_launch)
    configs = [{"BLOCK": 32 * 2 ** i, "num_warps": 1 + i % 2} for i in range(4)]
    tuned = autotune(configs=configs, key=["n"], warmup=0, repeat=1, progress=False,
                     timer=lambda run: run() or 1.0)(doubled)
    tuned[(2,)](np.full(100, np.nan, np.float32), 100)
    assert launched[0] == len(configs)  # all compiled before the first timed run
    assert peak[0] >= 2


def test_entry_precompile_runs_every_config_at_once():
    barrier = __import__("threading").Barrier(3, timeout=10)
    compiled, runs = [], []

    def precompile(config, n):
        barrier.wait()  # breaks (BrokenBarrierError) unless the three run concurrently
        compiled.append(config)

    @autotune(configs=[1, 2, 3], key=["n"], warmup=0, repeat=1, progress=False,
              timer=lambda run: run() or 1.0, precompile=precompile)
    def entry(n, *, config):
        runs.append(list(compiled))
        return config

    assert entry(5) == 1
    assert sorted(compiled) == [1, 2, 3] and runs[0] == compiled


def test_amd_configs_compile_concurrently_like_one_at_a_time(monkeypatch):
    """compile_all lowers AMD configs on threads; llvmlite's global context and the shared
    target machines are used under a lock, so each result matches its serial compile."""
    from kiln.autotune import compile_all

    @kiln.kernel
    def scaled(x: kiln.Tensor[kiln.f32], n: kiln.i32, BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
        if i < n:
            x[i] = x[i] * 3.0

    monkeypatch.setenv("KILN_NO_CACHE", "1")
    x = np.full(64, np.nan, np.float32)
    configs = [{"BLOCK": 64 * (i + 1), "num_warps": i + 1} for i in range(4)]
    compile_all(lambda cfg: scaled.compile(x, 64, target="gfx950", **cfg), configs)
    threaded = [scaled.compile(x, 64, target="gfx950", **cfg).asm["amdgcn"] for cfg in configs]
    scaled._compiled.clear()
    serial = [scaled.compile(x, 64, target="gfx950", **cfg).asm["amdgcn"] for cfg in configs]
    assert threaded == serial
