"""Hygiene: a test fails when it leaves child processes, CUDA memory or device memory behind.

Note [hygiene]: at setup the plugin takes the state of the process tree (child processes; for
tests that use an engine fixture or a GPU also their resident memory and, through NVML, the device
memory of other processes) and of this process's CUDA allocator; at teardown, after the
fixtures are finalized, it takes it again. What is still there and was not before fails the
test that left it, named, with the numbers. A broader-scoped fixture (a session's server, say)
that is set up for this test is part of the starting state: the reading is retaken after setup.

The engine fixtures are the ini value ``gate_engine_fixtures`` (default: ``engine``).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import pytest

from vramgate.core.metrics import format_value
from vramgate.machine.gpu_processes import alive
from vramgate.machine.probes.cpu import children, rss_bytes
from vramgate.pytest_plugin.marks import HARDWARE_MARKERS
from vramgate.runtime import process
from vramgate.runtime.preload import interpreter_pids

#: Helper processes started once and kept for the life of the process: not leaks. Python's multiprocessing
#: helpers, and the symbolizers torch keeps to resolve C++ frames (allocator snapshots with C++ stacks).
PROCESS_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "addr2line -C -f -e ")
#: CUDA memory a test may leave allocated (caches of cuBLAS and friends) before hygiene fails it.
CUDA_LEAK_TOLERANCE = 8 << 20
#: Growth of the resident memory of this process's child processes (summed) that hygiene tolerates.
PROCESS_TREE_TOLERANCE = 64 << 20
#: Growth of device memory used by other processes than this one (NVML) that hygiene tolerates: lazily
#: loaded CUDA modules of this process are not attributed to it where NVML cannot name its pid.
NVML_LEAK_TOLERANCE = 256 << 20


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:200]
    except OSError:
        return "?"


@dataclass
class DeviceReading:
    """NVML's view of one device, for hygiene: memory used in all, and by this process where NVML names it."""

    used_bytes: int
    own_bytes: int | None
    """This process's device memory; None where NVML lists other pids only while this process holds a context."""
    processes: dict[int, int]


@dataclass
class HygieneState:
    """What hygiene reads before and after a test (see Note [hygiene])."""

    children: set[int]
    cuda_allocated: int | None
    tree: dict[int, int] | None = None
    """Resident bytes per live child process (helpers left out); None when memory is not checked."""
    devices: dict[int, DeviceReading] | None = None
    """NVML readings per device index; None when memory is not checked or NVML is unavailable."""
    cuda_context: bool = False
    """Whether this process held a CUDA context at the reading."""


def tree_rss(pids: set[int]) -> dict[int, int]:
    """Resident bytes of each running process in *pids*, leaving out zombies and Python's helpers."""
    out = {}
    for pid in pids:
        if not alive(pid) or any(helper in _cmdline(pid) for helper in PROCESS_HELPERS):
            continue
        try:
            out[pid] = rss_bytes(pid)
        except (OSError, ValueError):
            continue  # ended meanwhile
    return out


def device_readings() -> dict[int, DeviceReading] | None:
    """NVML's used memory of every device this process sees (by CUDA index), and this process's share where NVML
    names it; None without NVML."""
    from vramgate.machine.probes.nvml import NVMLUnavailable, open_nvml

    try:
        nvml = open_nvml()
    except NVMLUnavailable:
        return None
    torch = sys.modules.get("torch")
    context = torch is not None and torch.cuda.is_initialized()
    me = os.getpid()
    from vramgate.machine.devices import device_handle, visible_devices

    try:
        out = {}
        for device in visible_devices(nvml):  # this process's GPUs only: another tenant's are not its leaks
            index = device.cuda_index
            handle = device_handle(nvml, device)
            procs: dict[int, int] = {}
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                procs[int(proc.pid)] = procs.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
            own = procs.get(me, 0) if me in procs or not context else None
            out[index] = DeviceReading(int(nvml.nvmlDeviceGetMemoryInfo(handle).used), own, procs)
        return out
    except Exception:  # NVML lost mid-reading: no device check rather than a false one
        return None
    finally:
        nvml.nvmlShutdown()


def tree_leak(before: HygieneState, after: HygieneState) -> list[str]:
    """The hygiene line when the child processes' resident memory grew by more than the tolerance."""
    if before.tree is None or after.tree is None:
        return []
    start, end = sum(before.tree.values()), sum(after.tree.values())
    if end - start <= PROCESS_TREE_TOLERANCE:
        return []
    grown = sorted(((rss - before.tree.get(pid, 0), pid) for pid, rss in after.tree.items()), reverse=True)
    worst = ", ".join(f"pid {pid} +{format_value(d, 'B')} (now {format_value(after.tree[pid], 'B')}): "
                      f"{_cmdline(pid)[:80]}" for d, pid in grown[:3] if d > 0)
    return [f"child processes' memory did not return to its starting level: resident "
            f"{format_value(start, 'B')} before the test, {format_value(end, 'B')} after "
            f"(+{format_value(end - start, 'B')}, tolerance {format_value(PROCESS_TREE_TOLERANCE, 'B')}); {worst}"]


def device_leaks(before: HygieneState, after: HygieneState) -> list[str]:
    """Hygiene lines for devices whose memory used by other processes than this one grew past the tolerance.

    Where NVML does not name this process (host pids in a container) while it
    holds a CUDA context, its own share is taken as unchanged; a context this
    process created during the test then makes the reading unattributable and
    the device is not judged.
    """
    if before.devices is None or after.devices is None:
        return []
    out = []
    for index, b in sorted(before.devices.items()):
        a = after.devices.get(index)
        if a is None:
            continue
        if a.own_bytes is not None and b.own_bytes is not None:
            own_growth = a.own_bytes - b.own_bytes
        elif before.cuda_context:
            own_growth = 0
        else:
            continue  # this process's context appeared during the test and NVML cannot tell its share
        grown = a.used_bytes - b.used_bytes - own_growth
        if grown <= NVML_LEAK_TOLERANCE:
            continue
        me = os.getpid()
        holders = sorted(((used - b.processes.get(pid, 0), pid) for pid, used in a.processes.items()
                          if pid != me), reverse=True)
        named = ", ".join(f"pid {pid} +{format_value(d, 'B')}" for d, pid in holders[:3] if d > 0)
        out.append(f"GPU {index} memory used by other processes did not return to its starting level: "
                   f"+{format_value(grown, 'B')} (device used {format_value(b.used_bytes, 'B')} before the "
                   f"test, {format_value(a.used_bytes, 'B')} after; tolerance "
                   f"{format_value(NVML_LEAK_TOLERANCE, 'B')})" + (f"; {named}" if named else ""))
    return out


def cuda_allocated() -> int | None:
    """The bytes this process's CUDA allocator holds for live tensors; None where this process uses no GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None  # nothing on a GPU in this process; never initialize CUDA for a check
    # cuBLAS keeps a workspace per (handle, stream) in the caching allocator: a cache, not a leak.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    torch.cuda.synchronize()
    if clear is not None:
        clear()
    return int(torch.cuda.memory_allocated())


def hygiene_state(memory: bool = False) -> HygieneState:
    """The reading hygiene compares (*memory*: also the child processes' and the devices' memory).

    The gate's preloaded engine interpreters (Note [preloaded engines] in :mod:`vramgate.runtime.preload`)
    and the children kept for the session (the serving suite's servers, with their engine cores:
    :func:`vramgate.runtime.process.keep_for_session`) live as long as the process and are left out; the
    engines the interpreters fork are not (their command line is the preloaded interpreter's, so they are told
    apart by pid)."""
    kids = set(children(os.getpid())) - interpreter_pids() - process.session_pids()
    allocated = cuda_allocated()
    if not memory:
        return HygieneState(kids, allocated)
    torch = sys.modules.get("torch")
    context = False
    if torch is not None and torch.cuda.is_initialized():
        context = True
        torch.cuda.empty_cache()  # cached free blocks are this process's, not a leak of anyone's
    return HygieneState(kids, allocated, tree_rss(kids), device_readings(), context)


def leaks(before: HygieneState, cuda: bool = True) -> list[str]:
    """What a test left behind since *before*: child processes still running, CUDA memory still allocated (when
    *cuda*); where *before* read memory also child-process and device memory not returned."""
    memory = before.tree is not None
    torch = sys.modules.get("torch")
    if cuda and torch is not None and torch.cuda.is_initialized():
        # Reference cycles the test left hold CUDA memory that is garbage, not a leak. Only where CUDA is in
        # use: with torch and vLLM loaded a full collection takes about 0.4 s, for every test.
        gc.collect()
    after = hygiene_state(memory)
    after_cuda = after.cuda_allocated if cuda else None
    out = []
    for pid in sorted(after.children - before.children):
        cmd = _cmdline(pid)
        if alive(pid) and not any(helper in cmd for helper in PROCESS_HELPERS):
            out.append(f"child process {pid} still running: {cmd}")
    if after_cuda is not None and after_cuda - (before.cuda_allocated or 0) > CUDA_LEAK_TOLERANCE:
        grown = after_cuda - (before.cuda_allocated or 0)
        out.append(f"CUDA memory still allocated: {format_value(grown, 'B')} more "
                   f"than before the test (tolerance {format_value(CUDA_LEAK_TOLERANCE, 'B')})")
    if memory:
        out += tree_leak(before, after)
        out += device_leaks(before, after)
    return out


def _pending_broad_fixtures(item: pytest.Item) -> list[Any]:
    """Broader-scoped fixture definitions of *item* not set up yet (see Note [hygiene])."""
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", None) or {}
    return [d for ds in defs.values() for d in ds
            if getattr(d, "scope", "function") != "function" and getattr(d, "cached_result", 0) is None]


class HygienePlugin:
    """The hooks of hygiene (Note [hygiene]), registered by the gate's plugin when ``--gate-hygiene`` is on.

    *in_use* says whether the gate is in use in this session (Note [inert until asked]); *engine_fixtures* are
    the fixtures that start engine processes.
    """

    def __init__(self, in_use: Callable[[], bool], engine_fixtures: tuple[str, ...]) -> None:
        self.in_use = in_use
        self.engine_fixtures = engine_fixtures
        self._before: dict[str, HygieneState] = {}
        self._call_failed: set[str] = set()

    def memory_checked(self, item: pytest.Item) -> bool:
        """Whether hygiene checks *item*'s process-tree and device memory: it uses an engine fixture or a GPU."""
        names = getattr(item, "fixturenames", ())
        return any(f in names for f in self.engine_fixtures) or any(
            mark.name in HARDWARE_MARKERS for mark in item.iter_markers())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        """Take hygiene's starting reading around the setup of *item* (see Note [hygiene])."""
        if not self.in_use():
            return (yield)
        memory = self.memory_checked(item)
        pending = _pending_broad_fixtures(item)
        self._before[item.nodeid] = hygiene_state(memory)
        result = yield
        if any(getattr(d, "cached_result", None) is not None for d in pending):
            self._before[item.nodeid] = hygiene_state(memory)
        return result

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        """Fail at teardown the test that left something behind, naming it."""
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if report.when == "call" and not report.passed:
            self._call_failed.add(item.nodeid)
        if report.when != "teardown" or item.nodeid not in self._before:
            return
        # Fixtures are finalized by now; drop the item's stale references to their values so
        # that only what the test really leaked is still allocated.
        funcargs = getattr(item, "funcargs", None)
        if isinstance(funcargs, dict):
            funcargs.clear()
        # A failed or skipped test's traceback keeps its locals alive: check its processes only.
        leaked = leaks(self._before.pop(item.nodeid), cuda=item.nodeid not in self._call_failed)
        self._call_failed.discard(item.nodeid)
        if leaked and not report.failed:
            report.outcome = "failed"
            report.longrepr = f"vramgate hygiene: {item.nodeid} left behind:\n" + "\n".join(
                f"- {line}" for line in leaked)
