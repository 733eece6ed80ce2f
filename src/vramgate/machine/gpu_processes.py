"""Stray GPU processes on a CI runner: find them (NVML) and end them, before and after a gate run.

A gate job that crashed or timed out can leave an engine holding device
memory; the next job would then measure someone else's allocations. Only
processes of the runner's own user are touched, never the caller or its
ancestors; other users' processes are reported, since they make measured
metrics untrustworthy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vramgate.machine.probes.cpu import proc_stat


@dataclass(frozen=True)
class GpuProcess:
    """One compute process on a visible GPU: pid, owner's uid (None when unknown), bytes used, CUDA index."""

    pid: int
    uid: int | None
    used_bytes: int
    device: int


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def ancestors(pid: int) -> set[int]:
    """*pid* and every process above it (never signalled by a cleanup)."""
    out = set()
    while pid > 1:
        out.add(pid)
        stat = proc_stat(pid)
        if stat is None:
            break
        pid = stat.ppid
    return out


def gpu_processes() -> list[GpuProcess]:
    """Compute processes on the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied: a concurrent job's
    GPUs are not this job's to clean), from NVML. :class:`~vramgate.machine.probes.nvml.NVMLUnavailable` where NVML
    cannot be used: a cleanup that cannot see the GPUs must say so, not pass as "nothing to do"."""
    from vramgate.machine.devices import device_handle, visible_devices
    from vramgate.machine.probes.nvml import open_nvml

    nvml = open_nvml()
    try:
        out = []
        for device in visible_devices(nvml):
            handle = device_handle(nvml, device)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                out.append(GpuProcess(int(proc.pid), _uid(int(proc.pid)), int(proc.usedGpuMemory or 0),
                                      device.cuda_index))
        return out
    finally:
        nvml.nvmlShutdown()


def stray(processes: Iterable[GpuProcess], own_uid: int, protected: set[int]) -> tuple[list[int], list[GpuProcess]]:
    """(pids to end: ours and not protected, processes of other users to report)."""
    ours, foreign = [], []
    for p in processes:
        if p.pid in protected:
            continue
        if p.uid == own_uid:
            if p.pid not in ours:
                ours.append(p.pid)
        else:
            foreign.append(p)
    return ours, foreign


def alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether *pid* runs (a zombie, ended but not yet reaped, does not count); with *start_ticks*, whether it is
    still the process that started then (Note [pid reuse])."""
    stat = proc_stat(pid)
    return stat is not None and stat.state != "Z" and (start_ticks is None or stat.start_ticks == start_ticks)


def end(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after *grace_s*; the pids still alive after that.

    Note [pid reuse]: each process is identified by its pid and its start time when first seen here; a pid
    that names another process by the time of a signal (the first ended and its pid was handed out again) is
    left alone.
    """
    seen = {pid: stat.start_ticks for pid in pids if (stat := proc_stat(pid)) is not None}

    def signal_all(running: list[int], sig: signal.Signals) -> None:
        for pid in running:
            if alive(pid, seen[pid]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    running = list(seen)
    signal_all(running, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while running and time.monotonic() < deadline:
        running = [p for p in running if alive(p, seen[p])]
        time.sleep(0.2)
    signal_all(running, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while running and time.monotonic() < deadline:
        running = [p for p in running if alive(p, seen[p])]
        time.sleep(0.1)
    return running
