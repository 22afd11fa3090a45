"""``kiln.autotune``: pick the fastest of several configurations, once per key, and remember it.

Decorate a ``@kiln.kernel`` (configs are dicts of constexprs and launch options such as
``num_warps``) or a Python entry function (configs are anything; the function receives the
one to use as ``config=``)::

    @kiln.autotune(configs=[{"BLOCK": 128, "num_warps": 4}, {"BLOCK": 256, "num_warps": 8}],
                   key=["n"])
    @kiln.kernel
    def scale(x: kiln.Tensor[kiln.f32], n: kiln.i32, BLOCK: kiln.constexpr): ...

    scale[lambda meta: (n + meta["BLOCK"] - 1) // meta["BLOCK"],](x, n)

    @kiln.autotune(configs=[GemmConfig(), GemmConfig(stages=3)], key=["m", "n", "k"])
    def run(a, b, c, m, n, k, *, config): ...

On the first call with a new key (the values of the ``key`` arguments), every config is run
``warmup`` times, then timed ``repeat`` times (CUDA events through torch; the median counts) while
a progress bar is drawn on stderr. The winner is kept in memory and in
``<kiln cache>/autotune/<name>.<digest of configs>.json``, so later processes skip tuning. That
store is plain JSON (key -> config index), updated under a lock so concurrent tuners lose
nothing, and trusted like the compile cache: a directory not yours or writable by others is not
used (one warning), nor is a file not yours. Configs that fail (a
compile error, too much shared memory) are skipped. ``timer`` replaces the measurement, e.g. to
tune on a CPU in tests: it gets a zero-argument callable running one config and returns ms.

Before timing, every config's kernel is compiled at once on a thread pool (tracing takes turns;
``ptxas`` and the compiler's native stages overlap), so tuning waits for about the slowest
compile rather than their sum. For a kernel this is automatic; an entry function opts in with
``precompile=fn``, called as ``fn(config, *args, **kwargs)`` to compile without running.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .core.errors import KilnError, KilnTypeError, KilnValueError
from .core.trusted_dir import private_dir, read_owned, usable_root, warn_once, write_atomic
from .fingerprint import WRAPPERS
from .kernel import JITKernel

BAR_WIDTH = 24


def autotune(configs: Sequence, key: Sequence[str], *, warmup: int = 3, repeat: int = 10,
             timer: Callable[[Callable[[], None]], float] | None = None,
             progress: bool = True, precompile: Callable | None = None) -> Callable:
    """Decorator: see the module docs. ``key`` names arguments of the decorated function."""
    configs = tuple(configs)
    if not configs:
        raise KilnValueError("kiln.autotune needs at least one config",
                             fix="pass configs=[...] with the variants to compare")
    if isinstance(key, str) or not all(isinstance(k, str) for k in key):
        raise KilnTypeError(f"kiln.autotune key must be a list of argument names, got {key!r}",
                            fix='e.g. key=["m", "n", "k"]')

    def decorate(target):
        return Autotuner(target, configs, tuple(key), warmup=warmup, repeat=repeat,
                         timer=timer, progress=progress, precompile=precompile)

    return decorate


class Autotuner:
    """What ``kiln.autotune`` returns: call it (entry functions) or index it with a grid
    (kernels) like the decorated object. ``best`` maps keys to the chosen config."""

    def __init__(self, target, configs: tuple, key: tuple[str, ...], *, warmup: int,
                 repeat: int, timer, progress: bool, precompile: Callable | None = None):
        self.target = target
        self.is_kernel = isinstance(target, JITKernel)
        fn = target.fn if self.is_kernel else target
        functools.update_wrapper(self, fn)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self._signature = inspect.signature(fn)
        missing = [k for k in key if k not in self._signature.parameters]
        if missing:
            raise KilnValueError(f"kiln.autotune key names {missing} are not parameters of "
                                 f"{fn.__qualname__}", fix=f"use names from {self._signature}")
        self.configs, self.key = configs, key
        self.warmup, self.repeat, self.progress = warmup, repeat, progress
        self.timer = timer or cuda_event_timer
        self.precompile = precompile
        self.best: dict[str, Any] = {}
        self._untuned: set[str] = set()  # keys :meth:`cached` found in no store
        # Positions of the key arguments, so a positional call is keyed without binding.
        names = list(self._signature.parameters)
        self._key_positions = tuple(names.index(k) for k in key)
        self._positional_arity = max(self._key_positions, default=-1) + 1
        self._by_values: dict[tuple, Any] = {}

    # ---- calling -----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.is_kernel:
            raise KilnTypeError(f"{self.name} is an autotuned kernel; launch it with a grid",
                                fix="call it as kernel[grid](*args)")
        build = None
        if self.precompile is not None:
            def build(cfg):
                self.precompile(cfg, *args, **kwargs)

        config = self._config_for(args, kwargs, lambda cfg: self.target(*args, **kwargs,
                                                                        config=cfg), build)
        return self.target(*args, **kwargs, config=config)

    def __getitem__(self, grid):
        if not self.is_kernel:
            raise KilnTypeError(f"{self.name} is an autotuned function, not a kernel",
                                fix="call it directly")
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        def run(cfg):
            self.target[grid](*args, **kwargs, **cfg)

        compile_kwargs = {k: v for k, v in kwargs.items() if k != "stream"}

        def build(cfg):
            self.target.compile(*args, **compile_kwargs, **cfg)

        config = self._config_for(args, kwargs, run, build)
        run(config)

    # ---- choosing ---------------------------------------------------------------------------
    def key_of(self, args: tuple, kwargs: dict) -> str:
        """The tuning key of a call: the ``key`` arguments' values (shapes for arrays)."""
        bound = self._signature.bind_partial(*args, **kwargs)
        parts = []
        for name in self.key:
            value = bound.arguments.get(name, self._signature.parameters[name].default)
            parts.append(f"{name}={_key_value(value)}")
        return ",".join(parts)

    def cached(self, args: tuple, kwargs: dict):
        """The config chosen for this call's key (in memory, else in the store), or None
        when the key was never tuned; tunes nothing. Example: a caller that falls back to a
        heuristic, ``tuner.cached(args, {}) or default_config``."""
        key = self.key_of(args, kwargs)
        if key not in self.best:
            if key in self._untuned:  # read the store once per key, not once per call
                return None
            index = self._stored().get(key)
            if index is None or not 0 <= index < len(self.configs):
                self._untuned.add(key)
                return None
            self.best[key] = self.configs[index]
        return self.best[key]

    def _config_for(self, args, kwargs, run: Callable[[Any], None],
                    build: Callable[[Any], None] | None = None):
        # Hot path: a repeat call with the key arguments passed positionally.
        fast_key = None
        if len(args) >= self._positional_arity:
            try:
                fast_key = tuple(_key_value(args[i]) for i in self._key_positions)
                return self._by_values[fast_key]
            except KeyError:
                pass
        config = self._config_for_key(self.key_of(args, kwargs), run, build)
        if fast_key is not None:
            self._by_values[fast_key] = config
        return config

    def _config_for_key(self, key: str, run: Callable[[Any], None],
                        build: Callable[[Any], None] | None = None):
        if key not in self.best:
            index = self._stored().get(key)
            if index is None or not 0 <= index < len(self.configs):
                index = self._tune(key, run, build)
                self._store(key, index)
            self.best[key] = self.configs[index]
        return self.best[key]

    def _tune(self, key: str, run: Callable[[Any], None],
              build: Callable[[Any], None] | None = None) -> int:
        times: list[float] = []
        errors: list[str] = []
        if build is not None:
            compile_all(build, self.configs)
        for i, config in enumerate(self.configs):
            self._draw(key, i)
            try:
                for _ in range(self.warmup):
                    run(config)
                times.append(statistics.median(self.timer(lambda: run(config))
                                               for _ in range(self.repeat)))
            except KilnError as err:  # an infeasible config (too much smem, bad shape): skip
                times.append(float("inf"))
                errors.append(f"config {i}: {err}")
        self._draw(key, len(self.configs), done=True)
        best = min(range(len(times)), key=times.__getitem__)
        if times[best] == float("inf"):
            raise KilnValueError(f"every autotune config of {self.name} failed for {key}:\n"
                                 + "\n".join(errors), fix="add a config that fits this shape")
        return best

    def _draw(self, key: str, done_count: int, *, done: bool = False) -> None:
        if not self.progress:
            return
        total = len(self.configs)
        filled = BAR_WIDTH * done_count // total
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        end = "\n" if done else ""
        sys.stderr.write(f"\r[kiln.autotune] {self.name} {key} [{bar}] {done_count}/{total}"
                         f"{end}")
        sys.stderr.flush()

    # ---- persistence ------------------------------------------------------------------------
    def _path(self) -> Path | None:
        """The store file, or None when the cache is off or its directory is not safe to use."""
        root = usable_root()
        directory = root and private_dir(root / "autotune", "autotune store", "KILN_CACHE_DIR")
        if directory is None:
            return None
        # The file name changes with the config list, so an edited list is tuned afresh.
        digest = hashlib.sha256(repr(self.configs).encode()).hexdigest()[:16]
        return directory / f"{self.name}.{digest}.json"

    def _stored(self) -> dict[str, int]:
        path = self._path()
        return _read_table(path) if path is not None else {}

    def _store(self, key: str, index: int) -> None:
        path = self._path()
        if path is None:
            return
        try:
            # Read-merge-write under an exclusive lock: concurrent tuners add keys, none is lost.
            with open(path.with_name(path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                table = _read_table(path)
                table[key] = index
                write_atomic(path, json.dumps(table, indent=1, sort_keys=True).encode())
        except OSError as err:  # a read-only store only costs re-tuning
            warn_once(("unwritable", str(path.parent)),
                      f"kiln: cannot write the autotune store {path} ({err.strerror or err}); "
                      "tuning results are kept in memory only. Fix: make it writable, or set "
                      "KILN_CACHE_DIR to a writable directory you own")


def _read_table(path: Path) -> dict[str, int]:
    """The stored ``{key: config index}``; a missing, foreign or corrupt file reads as empty."""
    try:
        table = json.loads(read_owned(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as err:  # bad or too deep JSON, not yours
        warn_once(("autotune-entry", str(path)), f"kiln: ignoring autotune store {path} ({err})")
        return {}
    # Keep only well-formed entries: an index is a plain int (bounds are checked on use).
    kept = {k: v for k, v in table.items() if type(v) is int} if isinstance(table, dict) else {}
    if not isinstance(table, dict) or len(kept) != len(table):
        warn_once(("autotune-entry", str(path)),
                  f"kiln: ignoring entries of autotune store {path} that are not config indices")
    return kept


def compile_all(build: Callable[[Any], None], configs: Sequence) -> None:
    """``build(config)`` for every config at once on a thread pool. A config that fails to
    compile is left for the timing loop, which meets the same error and skips the config."""
    from concurrent.futures import ThreadPoolExecutor  # only tuning needs it: keep import kiln lean

    def attempt(config):
        try:
            build(config)
        except KilnError:
            pass

    # More threads than cores: much of a compile waits on ptxas or holds no GIL.
    workers = min(len(configs), max(4, os.cpu_count() or 1))
    if workers <= 1:
        for config in configs:
            attempt(config)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-autotune") as pool:
        list(pool.map(attempt, configs))


def cuda_event_timer(run: Callable[[], None]) -> float:
    """Milliseconds ``run`` takes on the current CUDA stream, timed with torch CUDA events."""
    try:
        import torch
    except ImportError:
        raise KilnValueError("kiln.autotune times kernels with torch CUDA events, and torch is "
                             "not installed", fix="install torch, or pass timer=...") from None
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def _key_value(value) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{tuple(shape)}:{dtype}"
    return repr(value)


WRAPPERS[Autotuner] = lambda tuner: tuner.target  # keyed by what it tunes, not its results
