"""CUDA-event timing shared by the benchmarks (see ../shared/device/METHOD-notes.md)."""

from __future__ import annotations

import statistics


def time_ms(fn, repeat: int, batch: int = 1, warmup: int = 3, queued: bool = False,
            sleep_cycles: int = 20_000_000) -> float:
    """Median milliseconds per call of ``fn`` over ``repeat`` samples, each timing ``batch``
    back-to-back calls between one pair of CUDA events (after ``warmup`` untimed calls).
    ``queued``: keep the stream busy (``torch.cuda._sleep`` of ``sleep_cycles``, ~10 ms by
    default) while the host queues the calls, so the events see only the kernels and no host
    time (see :func:`queued_ms`)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        if queued:
            torch.cuda._sleep(sleep_cycles)  # spinning longer than queuing takes
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / batch)
    return statistics.median(times)


def queued_ms(fn, repeat: int, calls: int = 20, warmup: int = 3,
              sleep_cycles: int = 20_000_000) -> float:
    """Median GPU milliseconds per call of ``fn`` with no host time counted: ``calls`` calls
    queued behind a busy stream (``sleep_cycles`` of spinning: more than the host takes to
    queue them). Use it to separate kernel speed from launch overhead."""
    return time_ms(fn, repeat, calls, warmup, queued=True, sleep_cycles=sleep_cycles)


def host_us(fn, repeat: int, calls: int = 20, warmup: int = 3) -> float:
    """Median host microseconds per call of ``fn`` while the GPU is kept busy: ``calls`` calls
    queue behind ``torch.cuda._sleep``, so the host never waits for the device and the time
    is the Python, allocation and launch work of one call."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda._sleep(20_000_000)  # ~10 ms of spinning, longer than the calls take
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def interleaved_samples(fns: dict, repeat: int, batch: int, warmup: int = 3) -> dict:
    """Per-call milliseconds of each of ``fns`` (name -> callable), ``repeat`` samples each,
    taken round-robin: each round times ``batch`` back-to-back calls of every candidate in
    turn (CUDA events), so clock changes as a power-limited GPU heats up fall on all alike.
    Returns name -> list of samples (round order); see :func:`interleaved_ms`."""
    import torch

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start.record()
            for _ in range(batch):
                fn()
            stop.record()
            stop.synchronize()
            samples[name].append(start.elapsed_time(stop) / batch)
    return samples


def interleaved_ms(fns: dict, repeat: int, batch: int) -> dict:
    """Median ms per call of each of ``fns``, sampled round-robin
    (:func:`interleaved_samples`)."""
    return {name: statistics.median(times)
            for name, times in interleaved_samples(fns, repeat, batch).items()}


def round_ratios(samples: dict, name: str, peer: str) -> tuple[float, float]:
    """(min, median) over rounds of ``peer``'s time / ``name``'s time in the same round: the
    speed-up of ``name`` with both measured at the same clocks."""
    ratios = [p / s for s, p in zip(samples[name], samples[peer])]
    return min(ratios), statistics.median(ratios)
