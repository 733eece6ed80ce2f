"""The GPU-state guard: is this GPU in a state where a measurement can be trusted?

Latency and bandwidth measured on a throttled GPU, or on one another process is
using, are not the code's figures. :func:`read_state` reads, from NVML, the
clocks, the clock-event (throttle) reasons and the compute processes of a
device; :func:`problems` judges a reading taken around a measurement and says
what makes it untrustworthy. Readings are recorded with the measurement either
way, so a report shows the conditions it was taken under.

Note [which throttle reasons distrust a measurement]: thermal slowdowns, the
hardware slowdown and the power brake mean the clocks were forced down by the
board's condition, not by the work: such figures are flagged. ``SW power cap``
is what a saturating load on a healthy GPU normally shows (the boost clock
settles at the power limit), and idle/application-clock settings are not
throttling at all: those are recorded but do not flag.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from vramgate.machine import devices
from vramgate.machine.probes.cpu import children
from vramgate.machine.probes.nvml import NVMLUnavailable, open_nvml

#: NVML clock-event reason bits (``nvmlClocksEventReason*``) and their names.
REASONS: dict[int, str] = {
    0x1: "gpu idle",
    0x2: "applications clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
    0x100: "display clock setting",
}

#: The reasons that flag a measurement (see Note [which throttle reasons distrust a measurement]).
DISTRUSTED_REASONS: frozenset[str] = frozenset(
    {"HW slowdown", "SW thermal slowdown", "HW thermal slowdown", "HW power brake slowdown"}
)


def reason_names(mask: int) -> list[str]:
    """The names of the reason bits set in *mask* (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    if unknown:
        names.append(f"unknown 0x{unknown:x}")
    return names


@dataclass(frozen=True)
class GPUState:
    """One NVML reading of one device's condition."""

    index: int
    sm_clock_mhz: int
    max_sm_clock_mhz: int
    mem_clock_mhz: int
    temperature_c: int | None
    reasons: tuple[str, ...]
    processes: dict[int, int] = field(default_factory=dict)
    """Device bytes per compute process id."""

    def to_json(self) -> dict[str, Any]:
        """This reading as JSON data (process ids as string keys, reasons as a list)."""
        data = asdict(self)
        data["processes"] = {str(k): v for k, v in self.processes.items()}
        data["reasons"] = list(self.reasons)
        return data


def read_state(index: int = 0) -> GPUState:
    """Read CUDA device *index*'s clocks, throttle reasons, temperature and compute processes now.

    *index* is CUDA's (``CUDA_VISIBLE_DEVICES`` applied, :mod:`vramgate.machine.devices`); clocks and
    reasons of a MIG instance are its GPU's.
    """
    nvml = open_nvml()
    try:
        try:
            h = devices.handle(nvml, index, parent=True)
        except devices.NotVisible as exc:
            raise NVMLUnavailable(str(exc)) from None
        get_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if get_reasons is None:
            get_reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        try:
            temperature: int | None = int(nvml.nvmlDeviceGetTemperature(h, 0))
        except Exception:  # some boards do not report it
            temperature = None
        procs: dict[int, int] = {}
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(h):
            procs[int(proc.pid)] = procs.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
        return GPUState(
            index=index,
            sm_clock_mhz=int(nvml.nvmlDeviceGetClockInfo(h, 1)),
            max_sm_clock_mhz=int(nvml.nvmlDeviceGetMaxClockInfo(h, 1)),
            mem_clock_mhz=int(nvml.nvmlDeviceGetClockInfo(h, 2)),
            temperature_c=temperature,
            reasons=tuple(reason_names(int(get_reasons(h)))),
            processes=procs,
        )
    finally:
        nvml.nvmlShutdown()


def dram_bandwidth(mem_clock_mhz: float, bus_width_bits: int, transfers_per_clock: int = 2) -> float:
    """Theoretical DRAM bandwidth in bytes/s from the memory clock and bus width (DDR/HBM: 2 per clock)."""
    if mem_clock_mhz <= 0 or bus_width_bits <= 0:
        raise ValueError("memory clock and bus width must be positive")
    return mem_clock_mhz * 1e6 * transfers_per_clock * bus_width_bits / 8


def device_peak_bandwidth(index: int = 0) -> float:
    """Theoretical memory bandwidth of CUDA device *index* in bytes/s (NVML: max memory clock x bus width x 2)."""
    nvml = open_nvml()
    try:
        h = devices.handle(nvml, index, parent=True)
        return dram_bandwidth(
            float(nvml.nvmlDeviceGetMaxClockInfo(h, 2)), int(nvml.nvmlDeviceGetMemoryBusWidth(h))
        )
    finally:
        nvml.nvmlShutdown()


def own_pids() -> set[int]:
    """This process and its descendants (their device use is the test's own)."""
    me = os.getpid()
    return {me, *children(me)}


def problems(states: list[GPUState], own: set[int]) -> list[str]:
    """Why readings *states* (taken around one measurement) make it untrustworthy; empty when they do not.

    NVML reports host process ids; in a container none of them is one of
    *own*. Then one listed process is taken to be this one, and any further
    ones are other processes.
    """
    out: list[str] = []
    seen: set[str] = set()
    for state in states:
        for reason in state.reasons:
            if reason in DISTRUSTED_REASONS and reason not in seen:
                seen.add(reason)
                out.append(f"GPU {state.index} throttled ({reason}) at {state.sm_clock_mhz} MHz "
                           f"of {state.max_sm_clock_mhz} MHz")
        listed = state.processes
        if listed and not own & set(listed):
            extra = len(listed) - 1
            key = f"unattributed {state.index}"
            if extra > 0 and key not in seen:
                seen.add(key)
                out.append(f"{extra} other process(es) are using GPU {state.index} "
                           f"(NVML pids {sorted(listed)}, none in this process's namespace)")
            continue
        for pid, used in sorted(listed.items()):
            key = f"pid {pid}"
            if pid not in own and key not in seen:
                seen.add(key)
                out.append(f"another process (pid {pid}, {used / 2**20:.0f} MiB) is using GPU {state.index}")
    return out
