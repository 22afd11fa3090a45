"""CUDA-event timing shared by the benchmarks (see ../shared/device/METHOD-notes.md)."""

from __future__ import annotations

import statistics


def time_ms(fn, repeat: int, batch: int = 1, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn`` over ``repeat`` samples, each timing ``batch``
    back-to-back calls between one pair of CUDA events (after ``warmup`` untimed calls)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / batch)
    return statistics.median(times)


def queued_ms(fn, repeat: int, calls: int = 20, warmup: int = 3) -> float:
    """Median GPU milliseconds per call of ``fn`` with no host time counted: the stream is first
    kept busy (``torch.cuda._sleep``) while the host queues ``calls`` calls, so the events
    around them see only the kernels. Use it to separate kernel speed from launch overhead."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        torch.cuda._sleep(20_000_000)  # ~10 ms of spinning, longer than queuing takes
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)
