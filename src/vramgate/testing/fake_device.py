"""The fake GPU box of a rehearsal (Note [rehearsal] in :mod:`vramgate.testing.rehearsal`): a :class:`Box`, one
:class:`Ledger` per device (bytes claimed per process, a claim lasting while its process runs) and
:class:`FakeNVML`, the ``pynvml`` calls the gate makes, answered from the ledgers."""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from typing import Any

from vramgate.machine.gpu_processes import alive

#: The pid offset a box in a container reports (NVML lists host pids there).
CONTAINER_PID_OFFSET = 4_000_000


@dataclass(frozen=True)
class Box:
    """A GPU machine the rehearsal fakes."""

    name: str
    gpus: int
    gpu_name: str
    memory_bytes: int
    capability: tuple[int, int]
    container: bool = False
    """Whether NVML reports host pids (a container with its own pid namespace)."""
    driver: str = "570.124.06"
    cuda_driver: int = 12080


#: The boxes a rehearsal runs on: a bare 1xH100 and an 8xH100 runner in a container.
BOXES: dict[str, Box] = {
    "h100x1": Box("h100x1", 1, "NVIDIA H100 80GB HBM3", 81559 << 20, (9, 0)),
    "h100x8": Box("h100x8", 8, "NVIDIA H100 80GB HBM3", 81559 << 20, (9, 0), container=True),
}


@dataclass
class Ledger:
    """One device's memory: bytes claimed per process (a claim lasts while its process runs)."""

    index: int
    total_bytes: int
    claims: dict[int, int] = field(default_factory=dict)

    def live(self) -> dict[int, int]:
        """The claims of processes that still run (the gate's own always does)."""
        me = os.getpid()
        for pid in [p for p in self.claims if p != me and not alive(p)]:
            del self.claims[pid]
        return dict(self.claims)

    def used(self) -> int:
        """Bytes claimed by processes that still run."""
        return sum(self.live().values())

    def free(self) -> int:
        """Bytes not claimed."""
        return self.total_bytes - self.used()

    def claim(self, pid: int, nbytes: int) -> None:
        """*pid* holds *nbytes* more, until it ends."""
        self.claims[pid] = self.claims.get(pid, 0) + nbytes


def gib(nbytes: float) -> str:
    """*nbytes* in GiB, two decimals (as vLLM's messages print them)."""
    return f"{nbytes / 2**30:.2f}"


class FakeNVML(types.ModuleType):
    """``pynvml`` over the ledgers of a :class:`Box` (the calls the gate makes)."""

    NVMLError = RuntimeError

    def __init__(self, box: Box, ledgers: list[Ledger]) -> None:
        super().__init__("pynvml")
        self.box, self.ledgers = box, ledgers

    def _pid(self, pid: int) -> int:
        return pid + CONTAINER_PID_OFFSET if self.box.container else pid

    def nvmlInit(self) -> None:
        """``pynvml.nvmlInit``, answered from the box and its ledgers."""
        return None

    def nvmlShutdown(self) -> None:
        """``pynvml.nvmlShutdown``, answered from the box and its ledgers."""
        return None

    def nvmlSystemGetDriverVersion(self) -> str:
        """``pynvml.nvmlSystemGetDriverVersion``, answered from the box and its ledgers."""
        return self.box.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        """``pynvml.nvmlSystemGetCudaDriverVersion``, answered from the box and its ledgers."""
        return self.box.cuda_driver

    def nvmlDeviceGetCount(self) -> int:
        """``pynvml.nvmlDeviceGetCount``, answered from the box and its ledgers."""
        return self.box.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Ledger:
        """``pynvml.nvmlDeviceGetHandleByIndex``, answered from the box and its ledgers."""
        if not 0 <= index < len(self.ledgers):
            raise self.NVMLError(f"NVML: no device {index}")
        return self.ledgers[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: Any) -> Ledger:
        """``pynvml.nvmlDeviceGetHandleByUUID``, answered from the box and its ledgers."""
        for ledger in self.ledgers:
            if self.nvmlDeviceGetUUID(ledger) == (uuid.decode() if isinstance(uuid, bytes) else uuid):
                return ledger
        raise self.NVMLError(f"NVML: no device {uuid!r}")

    def nvmlDeviceGetUUID(self, handle: Ledger) -> str:
        """``pynvml.nvmlDeviceGetUUID``, answered from the box and its ledgers."""
        return f"GPU-5e4ea7a1-0000-4000-8000-{handle.index:012d}"

    def nvmlDeviceGetName(self, handle: Ledger) -> str:
        """``pynvml.nvmlDeviceGetName``, answered from the box and its ledgers."""
        return self.box.gpu_name

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Ledger) -> int:
        """``pynvml.nvmlDeviceGetMaxMigDeviceCount``, answered from the box and its ledgers."""
        return 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Ledger, slot: int) -> Any:
        """``pynvml.nvmlDeviceGetMigDeviceHandleByIndex``, answered from the box and its ledgers."""
        raise self.NVMLError("NVML: MIG is off")

    def nvmlDeviceGetCudaComputeCapability(self, handle: Ledger) -> tuple[int, int]:
        """``pynvml.nvmlDeviceGetCudaComputeCapability``, answered from the box and its ledgers."""
        return self.box.capability

    def nvmlDeviceGetMemoryInfo(self, handle: Ledger) -> Any:
        """``pynvml.nvmlDeviceGetMemoryInfo``, answered from the box and its ledgers."""
        used = handle.used()
        return types.SimpleNamespace(total=handle.total_bytes, used=used, free=handle.total_bytes - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Ledger) -> list[Any]:
        """``pynvml.nvmlDeviceGetComputeRunningProcesses``, answered from the box and its ledgers."""
        return [types.SimpleNamespace(pid=self._pid(pid), usedGpuMemory=nbytes)
                for pid, nbytes in sorted(handle.live().items())]

    def nvmlDeviceGetClockInfo(self, handle: Ledger, kind: int) -> int:
        """``pynvml.nvmlDeviceGetClockInfo``, answered from the box and its ledgers."""
        return 1980 if kind == 1 else 2619

    def nvmlDeviceGetMaxClockInfo(self, handle: Ledger, kind: int) -> int:
        """``pynvml.nvmlDeviceGetMaxClockInfo``, answered from the box and its ledgers."""
        return 1980 if kind == 1 else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Ledger) -> int:
        """``pynvml.nvmlDeviceGetCurrentClocksEventReasons``, answered from the box and its ledgers."""
        return 0

    def nvmlDeviceGetTemperature(self, handle: Ledger, sensor: int) -> int:
        """``pynvml.nvmlDeviceGetTemperature``, answered from the box and its ledgers."""
        return 40

    def nvmlDeviceGetMemoryBusWidth(self, handle: Ledger) -> int:
        """``pynvml.nvmlDeviceGetMemoryBusWidth``, answered from the box and its ledgers."""
        return 5120
