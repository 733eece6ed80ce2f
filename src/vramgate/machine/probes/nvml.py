"""Device memory seen by the driver (NVML, ``nvidia-ml-py``): whole device and per process.

NVML sees what the caching allocator does not: the CUDA context, NCCL buffers,
cuBLAS workspaces, memory of other processes. ``pynvml`` is imported on use.
:class:`TreeDeviceReader` keeps NVML open over many readings of a process tree's
device memory (a server's, sampled during a load).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from vramgate.machine import devices


class NVMLUnavailable(RuntimeError):
    """NVML cannot be used here (no nvidia-ml-py, no driver, or no GPU)."""


def open_nvml() -> Any:
    """Import ``pynvml`` and start NVML; the caller calls ``nvmlShutdown()`` when done.

    Returns the ``pynvml`` module; raises :class:`NVMLUnavailable` when it is not installed or NVML cannot start.
    """
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped]
    except ImportError:
        raise NVMLUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        raise NVMLUnavailable(f"NVML could not start: {exc}") from None
    return pynvml


def driver_cuda() -> str:
    """The CUDA version the installed NVIDIA driver supports (``13.0``); :class:`NVMLUnavailable` without NVML."""
    nvml = open_nvml()
    try:
        v = int(nvml.nvmlSystemGetCudaDriverVersion())
    finally:
        nvml.nvmlShutdown()
    return f"{v // 1000}.{v % 1000 // 10}"


@dataclass(frozen=True)
class DeviceMemory:
    """One NVML reading of one device."""

    index: int
    total_bytes: int
    used_bytes: int
    processes: dict[int, int]
    """Used bytes per process id (NVML reports compute processes only)."""


def read_device(index: int = 0) -> DeviceMemory:
    """Read CUDA device *index*'s memory and its processes' usage now (``CUDA_VISIBLE_DEVICES`` applied)."""
    nvml = open_nvml()
    try:
        try:
            handle = devices.handle(nvml, index)
        except devices.NotVisible as exc:
            raise NVMLUnavailable(str(exc)) from None
        return _device_memory(nvml, handle, index)
    finally:
        nvml.nvmlShutdown()


def _device_memory(nvml: Any, handle: Any, index: int) -> DeviceMemory:
    """One reading of the device behind *handle* (*nvml*: an initialized pynvml)."""
    info = nvml.nvmlDeviceGetMemoryInfo(handle)
    procs: dict[int, int] = {}
    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        used = proc.usedGpuMemory
        if used is not None:
            procs[int(proc.pid)] = procs.get(int(proc.pid), 0) + int(used)
    return DeviceMemory(index, int(info.total), int(info.used), procs)


def process_used_bytes(pid: int, index: int = 0) -> int:
    """Device memory used by *pid* and its threads on device *index* (0 when it has none)."""
    return read_device(index).processes.get(pid, 0)


@dataclass(frozen=True)
class TreeDeviceMemory:
    """One reading of a process tree's device memory on some devices."""

    tree_bytes: int | None
    """The usage NVML reports for the tree's pids, summed over the devices; None when it names none of them (a
    container with its own pid namespace sees other pids than NVML reports)."""
    device_bytes: int
    """The devices' whole used memory, summed: every process's, the driver's reservation included."""


class TreeDeviceReader:
    """NVML, open, for readings of a process tree's device memory on the devices of one ``CUDA_VISIBLE_DEVICES``
    value (the first *count* of them: a tensor-parallel engine's); :meth:`close` when done. :meth:`open`
    raises :class:`NVMLUnavailable` where NVML cannot be read or no device is visible."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nvml, self.handles = nvml, handles

    @classmethod
    def open(cls, visible: str | None, count: int = 1) -> TreeDeviceReader:
        """The reader of the first *count* devices ``CUDA_VISIBLE_DEVICES=visible`` shows (unset: every device)."""
        nvml = open_nvml()
        try:
            shown = devices.resolve(visible, devices.physical_devices(nvml))[:max(1, count)]
            if not shown:
                raise NVMLUnavailable(f"no device is visible ({devices.ENV}={visible!r})")
            return cls(nvml, [devices.device_handle(nvml, d) for d in shown])
        except BaseException:
            nvml.nvmlShutdown()
            raise

    def read(self, pids: Collection[int]) -> TreeDeviceMemory | None:
        """The device memory of *pids* (a process tree) and of the devices now; None when NVML fails to answer."""
        try:
            readings = [_device_memory(self._nvml, handle, i) for i, handle in enumerate(self.handles)]
        except Exception:  # pynvml's NVMLError (a lost GPU, a driver reset): no reading this time
            return None
        named = [used for r in readings for pid, used in r.processes.items() if pid in pids]
        return TreeDeviceMemory(sum(named) if named else None, sum(r.used_bytes for r in readings))

    def close(self) -> None:
        """End this reader's use of NVML."""
        self._nvml.nvmlShutdown()


def engine_visible_devices(value: str | None) -> str | None:
    """:func:`~vramgate.machine.devices.engine_value` of *value* against this host's NVML devices (Note [full UUIDs
    for vLLM] in :mod:`vramgate.machine.devices`); *value* unchanged where it holds indices only or NVML cannot be
    read."""
    if not devices.needs_rewrite(value):
        return value
    try:
        nvml = open_nvml()
    except NVMLUnavailable:
        return value
    try:
        return devices.engine_value(value, devices.physical_devices(nvml))
    finally:
        nvml.nvmlShutdown()
