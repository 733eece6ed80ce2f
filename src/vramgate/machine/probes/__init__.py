"""Memory and time probes. Each module imports torch or NVML lazily, inside its functions.

- :mod:`vramgate.machine.probes.cpu`: peak resident memory of a process (resettable high-water mark).
- :mod:`vramgate.machine.probes.cuda`: ``torch.cuda.memory_stats`` around a region.
- :mod:`vramgate.machine.probes.memory_history`: the CUDA allocator's memory history, dumped as a snapshot.
- :mod:`vramgate.machine.probes.nvml`: device-used and per-process used memory from NVML.
- :mod:`vramgate.machine.probes.timers`: ``perf_counter_ns`` and CUDA-event timers with warm-up.
"""

from typing import Protocol


class MemoryProbe(Protocol):
    """A probe that measures the peak memory of a region: ``with probe: ...`` then ``probe.peak_bytes``."""

    peak_bytes: int

    def __enter__(self) -> "MemoryProbe": ...

    def __exit__(self, *exc: object) -> None: ...
