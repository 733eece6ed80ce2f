"""``--gate-memory-history``: each gated test's CUDA allocator history, kept next to the report.

Note [memory history] in :mod:`vramgate.machine.probes.memory_history` says where the history is recorded. Here
the session decides, per test, whether to record in the test process, takes the snapshots its engines wrote, and
when the test ends keeps them in ``<report>/memory-history/`` (every test with ``always``, failing tests with
``on-failure``) or deletes the one it made.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vramgate.machine.probes import memory_history as probe

#: The folder, in the report's, that holds the kept snapshots.
HISTORY_FOLDER = "memory-history"


def file_stem(nodeid: str) -> str:
    """A file name for *nodeid*: every run of characters other than letters, digits, ``_.-`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") or "test"


@dataclass
class CallHistory:
    """The snapshots of one test: the one its own process wrote (if any) and the ones of the engines it used."""

    nodeid: str
    recorder: probe.HistoryRecorder
    engine_files: list[Path] = field(default_factory=list)

    def files(self) -> list[Path]:
        """Every snapshot of the test, its own first."""
        own = [self.recorder.written] if self.recorder.written is not None else []
        return own + self.engine_files


class MemoryHistory:
    """The session's memory histories: *mode* is ``on-failure`` or ``always``; snapshots go to *folder*."""

    def __init__(self, mode: str, folder: Path, engine_fixtures: tuple[str, ...]) -> None:
        self.mode = mode
        self.folder = folder
        self.engine_fixtures = engine_fixtures

    def records_here(self, item: pytest.Item) -> bool:
        """Whether *item*'s own process should record: CUDA is in use here (torch loaded and its CUDA already
        initialized, or the test needs a GPU), and the test starts no engine (an engine records in its worker,
        and a CUDA context made here would take device memory from it)."""
        torch = probe.loaded_cuda_torch()
        if torch is None:
            return False
        names = getattr(item, "fixturenames", ())
        if any(f in names for f in self.engine_fixtures):
            return False
        return bool(torch.cuda.is_initialized()) or item.get_closest_marker("requires_gpus") is not None

    def begin(self, item: pytest.Item) -> CallHistory:
        """Start recording *item*'s call (in this process where :meth:`records_here`); engine snapshots noted
        before it are dropped."""
        probe.take_noted()
        torch = probe.loaded_cuda_torch() if self.records_here(item) else None
        path = self.folder / f"{file_stem(item.nodeid)}.pickle"
        history = CallHistory(item.nodeid, probe.HistoryRecorder(path, torch))
        history.recorder.__enter__()
        return history

    def end(self, history: CallHistory) -> str | None:
        """Stop recording: dump this process's snapshot and take the engines' snapshots noted during the call.
        Why the snapshot could not be written (a full disk, torch's own error), or None: a lost picture must not
        turn into an error of the test it pictures."""
        history.engine_files = probe.take_noted()
        try:
            history.recorder.__exit__(None, None, None)
        except Exception as exc:  # any failure to dump is reported, not raised
            return f"the memory history of {history.nodeid} could not be written: {exc}"
        return None

    def settle(self, history: CallHistory, failed: bool) -> list[Path]:
        """Keep the snapshots of *history* next to the report (``always``, or the test *failed*), the engines'
        copied in; else delete this process's. The kept files."""
        own = history.recorder.written
        if self.mode != "always" and not failed:
            if own is not None:
                with contextlib.suppress(FileNotFoundError):
                    own.unlink()
            return []
        kept = [own] if own is not None else []
        stem = file_stem(history.nodeid)
        for i, source in enumerate(history.engine_files):
            target = self.folder / f"{stem}.engine-{i + 1}.{source.name}"
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            except OSError:
                continue  # the engine's folder is gone: nothing to keep of it
            kept.append(target)
        return kept

    def lines(self, kept: list[Path], root: Path) -> str:
        """The lines a failure message gets for *kept* snapshots (paths from *root* where they lie under it)."""
        def rel(path: Path) -> str:
            try:
                return str(path.relative_to(root))
            except ValueError:
                return str(path)

        return "\n".join([f"Memory history (open at https://pytorch.org/memory_viz): {rel(kept[0])}",
                          *(f"    {rel(p)}" for p in kept[1:])])


def engine_switch(mode: str) -> dict[str, str]:
    """The environment that makes every engine worker record its allocator history (none for ``off``)."""
    return {} if mode == "off" else {probe.MEMORY_HISTORY_ENV: "1"}


def apply_engine_switch(mode: str) -> str | None:
    """Set :func:`engine_switch`'s variable in this process's environment (every engine inherits it); the value
    it had before (None when unset)."""
    before = os.environ.get(probe.MEMORY_HISTORY_ENV)
    os.environ.update(engine_switch(mode))
    return before
