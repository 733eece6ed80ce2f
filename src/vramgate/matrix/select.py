"""Which entries of a matrix run on this machine, and why the others do not.

Note [matrix selection]: an entry for another engine tier (``cpu``/``gpu``) or
another GPU class (whole words of the hardware key, :func:`vramgate.machine.hardware.matches_gpu_class`: ``l4``
is not ``l40s``), or for CPUs of another ISA class (``cpu_isa = "amx"`` or ``"not amx"``, the class in force:
``VRAMGATE_CPU_ISA`` applied; Note [CPU MLA backends] in :mod:`vramgate.machine.isa` is why), is not collected
at all, so each machine's node ids are those of its own entries (baselines are
keyed by node id); ``vramgate matrix`` lists them with the reason. An entry of
this tier and class whose TP size needs more GPUs than the machine has is
collected and skipped with the reason, and so is one whose workload is a trace not imported yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vramgate.machine.hardware import matches_gpu_class
from vramgate.machine.isa import selects
from vramgate.matrix.loader import Entry
from vramgate.workloads import workloads_dir


@dataclass(frozen=True)
class Machine:
    """What selection needs of a machine: its engine tier, hardware key, GPU count and CPU ISA class."""

    tier: str
    hardware_key: str
    gpu_count: int
    cpu_isa: str = ""
    """The CPU's ISA class in force (:func:`vramgate.machine.isa.effective_isa`); empty where not known."""


def collection_problem(entry: Entry, tier: str, machine: Callable[[], Machine]) -> str | None:
    """Why *entry* is not collected on a machine of engine tier *tier* (Note [matrix selection]), or None.

    *machine* is called only when the entry names a GPU class or an ISA class (reading the hardware may take a
    moment).
    """
    if entry.tier is not None and entry.tier != tier:
        return f"entry for the {entry.tier} tier; this machine's engine tier is {tier}"
    if entry.cpu_isa is not None:
        have = machine().cpu_isa
        if not selects(have, entry.cpu_isa):
            return f"entry for CPUs of ISA class {entry.cpu_isa}; this machine's class is {have or 'unknown'}"
    if entry.gpu is not None:
        key = machine().hardware_key
        if not matches_gpu_class(key, entry.gpu):
            return f"entry for GPU class {entry.gpu}; this machine's hardware key is {key}"
    return None


def gpu_count_problem(entry: Entry, machine: Machine) -> str | None:
    """Why a collected *entry* skips on *machine* (too few GPUs for its TP size), or None."""
    if machine.tier == "gpu" and entry.tp > machine.gpu_count:
        return f"TP {entry.tp} needs {entry.tp} GPUs; this machine has {machine.gpu_count}"
    return None


def missing_trace(entry: Entry, root: Path) -> str | None:
    """Why *entry*'s workload cannot run yet (its trace is not saved under ``<root>/fixtures/workloads``), or None.

    A matrix may name a trace before it is imported (``--check`` accepts it); its cases skip until it is there.
    """
    wl = entry.workload
    if wl is None or wl.trace is None or (workloads_dir(root) / f"{wl.trace}.json").is_file():
        return None
    return (f"workload {wl.name}: trace {wl.trace!r} is not imported yet (no fixtures/workloads/{wl.trace}.json; "
            "vramgate trace import writes it)")
