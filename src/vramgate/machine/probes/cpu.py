"""Peak resident memory of a process on Linux, with a resettable high-water mark.

Note [resetting VmHWM]: writing ``5`` to ``/proc/<pid>/clear_refs`` resets the
kernel's peak-RSS counter (``VmHWM``) to the current RSS, so the peak of a
region is read as ``VmHWM`` after it. Resetting needs write access to the
process's ``clear_refs`` (own processes and children: yes). Where the reset is
refused the probe says so (``reset_ok``), and its peak is then the peak since
the process started, never less than the truth.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/{pid}/status has no {field} line")


def rss_bytes(pid: int | None = None) -> int:
    """Current resident set size of *pid* (default: this process) in bytes."""
    return _status_kib(pid or os.getpid(), "VmRSS") * 1024


def file_rss_bytes(pid: int | None = None) -> int:
    """The file-backed part of *pid*'s resident set (``RssFile``: mapped pages of its executable, libraries and other
    files) in bytes. How much of a library is resident after the same code ran depends on the page cache's state,
    not on the process (Note [file-backed RSS] in :mod:`vramgate.engine.memory_decision`)."""
    return _status_kib(pid or os.getpid(), "RssFile") * 1024


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident set size (``VmHWM``) of *pid* in bytes since start or the last reset."""
    return _status_kib(pid or os.getpid(), "VmHWM") * 1024


def reset_peak_rss(pid: int | None = None) -> bool:
    """Reset *pid*'s ``VmHWM`` to its current RSS; False where the kernel refuses (see the Note)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/<pid>/stat`` says of a process: its parent, its state, and when it started.

    ``start_ticks`` (clock ticks after boot) tells a process from a later one that got its pid: a signal is
    sent only to the process that was seen (Note [pid reuse] in :mod:`vramgate.machine.gpu_processes`).
    """

    pid: int
    ppid: int
    state: str
    start_ticks: int
    pgrp: int = 0
    """Its process group."""


def proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` of *pid*, or None when there is no such process (any more)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        return ProcStat(pid, int(fields[1]), fields[0], int(fields[19]), int(fields[2]))
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """All descendants of *pid*, from every process's parent in ``/proc/<pid>/stat`` (as psutil reads them;
    ``/proc/<pid>/task/*/children`` is a debugging interface that kernels may leave out)."""
    by_parent: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None:
                by_parent.setdefault(stat.ppid, []).append(stat.pid)
    out: list[int] = []
    stack = [pid]
    while stack:
        kids = by_parent.get(stack.pop(), [])
        out.extend(kids)
        stack.extend(kids)
    return out


@dataclass
class PeakRSS:
    """Peak resident memory of a process over a ``with`` block.

    ``peak_bytes`` is the high-water mark during the block; ``delta_bytes`` is
    that peak minus the RSS at entry (what the block added at its worst).
    """

    pid: int = 0
    start_bytes: int = 0
    peak_bytes: int = 0
    reset_ok: bool = False

    def __enter__(self) -> PeakRSS:
        self.pid = self.pid or os.getpid()
        self.reset_ok = reset_peak_rss(self.pid)
        self.start_bytes = rss_bytes(self.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_bytes = peak_rss_bytes(self.pid)

    @property
    def delta_bytes(self) -> int:
        """How far the peak RSS rose above the RSS at entry, in bytes (0 when it did not)."""
        return max(0, self.peak_bytes - self.start_bytes)


def pin_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Make glibc serve every allocation of *nbytes* or more with its own mmap, returned to the OS on free.

    glibc raises its mmap threshold as large blocks are freed, after which
    large buffers come from (and stay in) the heap and a region's peak RSS no
    longer shows them. Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``)
    keeps large allocations visible to :class:`PeakRSS`; free heap memory is
    trimmed (``malloc_trim``) so earlier frees do not hide later allocations.
    False where this is not glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        pinned = bool(libc.mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
        return pinned
    except (OSError, AttributeError):
        return False


def tree_rss_bytes(pid: int) -> int:
    """The resident memory of *pid* and every descendant, summed (pages two of them share count twice, as in
    ``ps``); 0 when *pid* is gone. A process that exits while it is read counts as 0."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            total += rss_bytes(p)
        except (OSError, ValueError):
            continue
    return total


def group_members(pgid: int) -> list[int]:
    """The live processes (not zombies) of process group *pgid*, from ``/proc``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None and stat.pgrp == pgid and stat.state != "Z":
                found.append(stat.pid)
    return found
