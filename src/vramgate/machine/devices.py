"""Which GPUs this process sees: ``CUDA_VISIBLE_DEVICES`` mapped onto NVML's devices.

NVML numbers every GPU of the host; CUDA numbers the devices this process may
use, ``0..n-1`` in the order ``CUDA_VISIBLE_DEVICES`` lists them. So NVML's
index 0 is another GPU than CUDA's device 0 whenever the variable is set
(``CUDA_VISIBLE_DEVICES=3``: CUDA's 0 is NVML's 3). Every NVML reading of the
gate (fingerprint, GPU-state guard, hygiene, cleanup, suites) goes through
:func:`visible_devices` and :func:`handle` here, by CUDA index.

Note [CUDA_VISIBLE_DEVICES]: entries are separated by commas. An entry is a
device index (``3``), a GPU UUID or a unique prefix of one (``GPU-8932f937``),
or a MIG instance's UUID (``MIG-...``). Index entries are NVML's order (PCI bus
order), which is CUDA's under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: the gate sets
that for every engine it starts (on a host of identical GPUs the orders agree
anyway). Like CUDA, parsing stops at the first
entry that is empty, malformed, or names no device: ``0,,1`` and ``0,7,1`` on a
host with two GPUs are device 0 only, and a device listed twice ends the list
there too. Unset: every device; set but empty (or stopping at its first
entry): none.

Note [full UUIDs for vLLM]: vLLM maps an entry that is not an index through
NVML's ``nvmlDeviceGetHandleByUUID`` (``platforms/cuda.py``,
``device_control_id_to_physical_device_id``), which takes a full UUID only; it
also splits the whole value, past the entry where CUDA stops. So every engine
the gate starts gets the value rewritten to what CUDA sees
(:func:`engine_value`, read against NVML by
:func:`vramgate.machine.probes.nvml.engine_visible_devices`): the devices CUDA resolves, an index as an index and a
UUID prefix as its full UUID.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

ENV = "CUDA_VISIBLE_DEVICES"
_INDEX = re.compile(r"\d+")


@dataclass(frozen=True)
class Physical:
    """One NVML device of the host: its NVML index and UUID, and its MIG instances' UUIDs."""

    nvml_index: int
    uuid: str
    migs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Visible:
    """One device this process sees: CUDA's index for it, and where NVML finds it."""

    cuda_index: int
    nvml_index: int
    """The NVML index of the physical GPU (a MIG instance's parent)."""
    uuid: str
    """The GPU's UUID, or the MIG instance's."""
    mig: bool = False


def entries(value: str | None) -> list[str] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, stripped; None when unset."""
    if value is None:
        return None
    return [e.strip() for e in value.split(",")]


def resolve(value: str | None, physical: list[Physical]) -> list[Visible]:
    """The devices CUDA would see under ``CUDA_VISIBLE_DEVICES=value`` on a host with *physical* GPUs.

    See Note [CUDA_VISIBLE_DEVICES]: parsing stops at the first entry that
    is not a device (empty, malformed, out of range, ambiguous, or repeated).
    """
    listed = entries(value)
    if listed is None:
        return [Visible(i, p.nvml_index, p.uuid) for i, p in enumerate(physical)]
    out: list[Visible] = []
    seen: set[str] = set()
    for entry in listed:
        found = _lookup(entry, physical)
        if found is None or found.uuid in seen:
            break
        seen.add(found.uuid)
        out.append(Visible(len(out), found.nvml_index, found.uuid, found.mig))
    return out


def _lookup(entry: str, physical: list[Physical]) -> Visible | None:
    if _INDEX.fullmatch(entry):
        index = int(entry)
        matches = [p for p in physical if p.nvml_index == index]
        return Visible(-1, matches[0].nvml_index, matches[0].uuid) if matches else None
    lowered = entry.lower()
    if lowered.startswith("mig-"):
        hits = [(p, m) for p in physical for m in p.migs if m.lower().startswith(lowered)]
        return Visible(-1, hits[0][0].nvml_index, hits[0][1], True) if len(hits) == 1 else None
    if lowered.startswith("gpu-"):
        gpus = [p for p in physical if p.uuid.lower().startswith(lowered)]
        return Visible(-1, gpus[0].nvml_index, gpus[0].uuid) if len(gpus) == 1 else None
    return None


def engine_value(value: str | None, physical: list[Physical]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a vLLM engine (Note [full UUIDs for vLLM]): the devices CUDA would see under
    *value*, indices as given and UUIDs (or their prefixes) in full; *value* itself when it is unset or names no
    device (an engine then fails as CUDA would)."""
    listed = entries(value)
    visible = resolve(value, physical)
    if listed is None or not visible:
        return value
    pairs = zip(listed[:len(visible)], visible, strict=True)  # CUDA stops at the first entry it cannot resolve
    return ",".join(entry if _INDEX.fullmatch(entry) else device.uuid for entry, device in pairs)


def needs_rewrite(value: str | None) -> bool:
    """Whether *value* has an entry vLLM may not take as it is (a UUID or a prefix of one): only then need NVML
    be read to give an engine its value."""
    listed = entries(value)
    return listed is not None and any(not _INDEX.fullmatch(e) for e in listed if e)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def physical_devices(nvml: Any) -> list[Physical]:
    """Every NVML device of the host with its UUID and its MIG instances' UUIDs (*nvml*: an initialized pynvml)."""
    out = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        migs: list[str] = []
        try:
            count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except Exception:  # no MIG support (or an NVML without it)
            count = 0
        for slot in range(count):
            try:
                migs.append(_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))))
            except Exception:  # an empty slot
                continue
        out.append(Physical(index, _text(nvml.nvmlDeviceGetUUID(handle)), tuple(migs)))
    return out


def visible_devices(nvml: Any) -> list[Visible]:
    """The devices this process sees, by CUDA index (*nvml*: an initialized pynvml)."""
    return resolve(os.environ.get(ENV), physical_devices(nvml))


class NotVisible(LookupError):
    """A CUDA device index that this process does not see."""


def handle(nvml: Any, cuda_index: int = 0, *, parent: bool = False) -> Any:
    """NVML's handle of CUDA device *cuda_index* (a MIG instance's own, or with *parent* its GPU's).

    :class:`NotVisible` names what ``CUDA_VISIBLE_DEVICES`` shows when the
    index is not among the visible devices.
    """
    visible = visible_devices(nvml)
    if not 0 <= cuda_index < len(visible):
        raise NotVisible(f"CUDA device {cuda_index} is not visible ({ENV}={os.environ.get(ENV)!r}: "
                         f"{len(visible)} device(s) visible)")
    return device_handle(nvml, visible[cuda_index], parent=parent)


def device_handle(nvml: Any, device: Visible, *, parent: bool = False) -> Any:
    """NVML's handle of *device*: a MIG instance's own (memory, processes), or with *parent* its GPU's."""
    if device.mig and not parent:
        return nvml.nvmlDeviceGetHandleByUUID(device.uuid)
    return nvml.nvmlDeviceGetHandleByIndex(device.nvml_index)
