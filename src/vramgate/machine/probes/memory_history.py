"""The CUDA caching allocator's memory history: recorded around a region, dumped as a snapshot file that PyTorch's
memory viewer (pytorch.org/memory_viz) opens.

Note [memory history]: ``--gate-memory-history`` records the history where the allocator is. A test that
allocates in the test process (the attention, MoE and CUDA-graph suites) is recorded there, around its call
(:class:`HistoryRecorder`); an engine run is recorded in its worker process, switched on by the environment
variable :data:`MEMORY_HISTORY_ENV` (set for every engine of the session, or in one spec's ``env``), and
dumped per rank into the engine's run folder (:func:`vramgate.engine.measure.worker_memory_history_dump`).
Recording costs a little time on every allocation, so nothing records unless asked; with ``on-failure`` it
records every gated test and keeps the snapshots of the failing ones only, nothing is run twice.

torch is never imported here: the functions take the torch module, and :func:`loaded_cuda_torch` takes it
only from a process that imported it already.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

#: Set (to anything but ``""`` or ``0``) in an engine worker's environment: the worker records and dumps the
#: allocator's history of every rank into its run folder.
MEMORY_HISTORY_ENV = "VRAMGATE_MEMORY_HISTORY"
#: The most allocator events a history keeps (the oldest go first).
MAX_ENTRIES = 100_000


def requested() -> bool:
    """Whether this process's environment asks for the allocator's history (:data:`MEMORY_HISTORY_ENV`)."""
    return os.environ.get(MEMORY_HISTORY_ENV, "").strip() not in ("", "0")


def loaded_cuda_torch() -> Any | None:
    """torch, when this process imported it already and it sees a CUDA device; None otherwise (never imports)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return None
    return torch


def start(torch: Any) -> None:
    """Start recording the allocator's history in this process: each allocation and free with its Python stack
    (C++ frames are slow to gather and say little here)."""
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")


def stop(torch: Any) -> None:
    """Stop recording the allocator's history in this process (what was recorded is dropped)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump(torch: Any, path: Path) -> Path:
    """Write the allocator's snapshot with the history recorded so far to *path* (its folder made); *path*."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return path


class HistoryRecorder:
    """Records this process's allocator history around a ``with`` block and dumps it to ``path`` at its end.

    ``torch`` is the torch module to record with; None records nothing (no CUDA in this process), and then
    :attr:`written` stays None. Recording stops at the end of the block whatever happens in it.
    """

    def __init__(self, path: Path, torch: Any | None) -> None:
        self.path = path
        self.torch = torch
        self.written: Path | None = None
        """The snapshot's file once written."""

    def __enter__(self) -> HistoryRecorder:
        if self.torch is not None:
            start(self.torch)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.torch is None:
            return
        try:
            self.written = dump(self.torch, self.path)
        finally:
            stop(self.torch)


_noted: list[Path] = []


def note(paths: Any) -> None:
    """Note snapshot files that another process (an engine worker) wrote for the region being recorded now;
    the recording side takes them with :func:`take_noted`."""
    _noted.extend(Path(p) for p in paths or () if p)


def take_noted() -> list[Path]:
    """The files noted since the last call, each once, in the order noted; the list is emptied."""
    out = list(dict.fromkeys(_noted))
    _noted.clear()
    return out
