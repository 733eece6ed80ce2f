"""Timers: wall clock (``perf_counter_ns``) and CUDA events, with warm-up.

Both return seconds per call as a list of samples, ready for
``gate.record_samples(name, samples, unit="s")``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_cpu(fn: Callable[[], object], *, samples: int = 10, warmup: int = 2, inner: int = 1) -> list[float]:
    """Seconds per call of *fn*: *warmup* discarded rounds, then *samples* rounds of *inner* calls each."""
    if samples < 1 or inner < 1 or warmup < 0:
        raise ValueError("samples and inner must be >= 1 and warmup >= 0")
    for _ in range(warmup * inner):
        fn()
    out = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter_ns() - start) / 1e9 / inner)
    return out


def time_cuda(
    fn: Callable[[], object],
    *,
    samples: int = 10,
    warmup: int = 3,
    flush_l2: bool = True,
    stream: Any = None,
) -> list[float]:
    """Seconds per call of *fn* on the GPU, timed with CUDA events.

    Each sample is one call between two events on *stream* (default: the
    current stream). With ``flush_l2`` a buffer twice the L2 size is written
    before each call, outside the timed region, so calls do not hit a warm L2.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA device; none is available")
    stream = stream or torch.cuda.current_stream()
    flush = None
    if flush_l2:
        l2 = getattr(torch.cuda.get_device_properties(stream.device), "L2_cache_size", 64 << 20)
        flush = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device=stream.device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(stream.device)
    out = []
    with torch.cuda.stream(stream):
        for _ in range(samples):
            if flush is not None:
                flush.zero_()
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            out.append(begin.elapsed_time(end) / 1e3)
    return out
