"""CUDA caching-allocator statistics around a region (``torch.cuda.memory_stats``).

Runs on any torch build with CUDA; needs no vLLM. torch is imported when a
probe is entered, not at import of this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AllocatorStats:
    """The allocator figures the gate uses, from one ``memory_stats`` snapshot."""

    allocated_bytes: int
    allocated_peak_bytes: int
    reserved_bytes: int
    reserved_peak_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    ooms: int

    @classmethod
    def from_memory_stats(cls, stats: dict[str, Any]) -> AllocatorStats:
        """The figures in *stats*, a ``torch.cuda.memory_stats()`` dictionary (a missing entry reads 0)."""
        def get(name: str) -> int:
            return int(stats.get(name, 0))

        return cls(
            allocated_bytes=get("allocated_bytes.all.current"),
            allocated_peak_bytes=get("allocated_bytes.all.peak"),
            reserved_bytes=get("reserved_bytes.all.current"),
            reserved_peak_bytes=get("reserved_bytes.all.peak"),
            inactive_split_bytes=get("inactive_split_bytes.all.current"),
            alloc_retries=get("num_alloc_retries"),
            ooms=get("num_ooms"),
        )

    @property
    def fragmentation(self) -> float:
        """Inactive split bytes as a fraction of reserved bytes (0 when nothing is reserved)."""
        return self.inactive_split_bytes / self.reserved_bytes if self.reserved_bytes else 0.0


@dataclass
class CudaRegion:
    """Allocator peaks of a ``with`` block on one device.

    On entry it synchronizes, resets the peak statistics and snapshots; on exit
    it synchronizes and snapshots again. ``peak_delta_bytes`` is the most the
    block had allocated beyond what was allocated at entry.
    """

    device: int = 0
    before: AllocatorStats | None = None
    after: AllocatorStats | None = None
    _torch: Any = field(default=None, repr=False)

    def __enter__(self) -> CudaRegion:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaRegion needs a CUDA device; none is available (torch.cuda.is_available() is False)")
        self._torch = torch
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.before = AllocatorStats.from_memory_stats(torch.cuda.memory_stats(self.device))
        return self

    def __exit__(self, *exc: object) -> None:
        self._torch.cuda.synchronize(self.device)
        self.after = AllocatorStats.from_memory_stats(self._torch.cuda.memory_stats(self.device))

    @property
    def peak_bytes(self) -> int:
        """The allocator's peak allocated bytes during the block (read after the block)."""
        assert self.after is not None, "read the probe after its block"
        return self.after.allocated_peak_bytes

    @property
    def peak_delta_bytes(self) -> int:
        """The most the block had allocated beyond what was allocated at entry, in bytes."""
        assert self.before is not None and self.after is not None, "read the probe after its block"
        return self.after.allocated_peak_bytes - self.before.allocated_bytes

    @property
    def new_alloc_retries(self) -> int:
        """cudaMalloc calls during the block that failed and were retried after freeing cached blocks."""
        assert self.before is not None and self.after is not None
        return self.after.alloc_retries - self.before.alloc_retries

    @property
    def new_ooms(self) -> int:
        """Out-of-memory errors the allocator raised during the block."""
        assert self.before is not None and self.after is not None
        return self.after.ooms - self.before.ooms
