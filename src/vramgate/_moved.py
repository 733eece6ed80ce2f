"""The package's former module names, kept importable while code moves to the layered names.

``import vramgate.plugin`` gives the very module :mod:`vramgate.pytest_plugin.plugin` (the same object, never a
second copy) and warns ``DeprecationWarning: vramgate.plugin moved to vramgate.pytest_plugin.plugin``.
Submodules of a moved package follow it (``vramgate.probes.cpu`` is :mod:`vramgate.machine.probes.cpu`); a name
that is neither a module nor a moved one still raises :class:`ModuleNotFoundError`. :func:`install` puts the
finder first on :data:`sys.meta_path`, ahead of the path finder that would load a moved module's file a
second time under its old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: Former module name -> its module now. Names whose module kept its name (``vramgate.engine``,
#: ``vramgate.models``, ``vramgate.report``, ``vramgate.tp``, ``vramgate.workloads``) need no entry.
MOVED = {
    "vramgate.metrics": "vramgate.core.metrics",
    "vramgate.stats": "vramgate.core.stats",
    "vramgate.checks": "vramgate.core.checks",
    "vramgate.baselines": "vramgate.store.baselines",
    "vramgate.moves": "vramgate.store.moves",
    "vramgate.provenance": "vramgate.machine.software",
    "vramgate.hardware": "vramgate.machine.hardware",
    "vramgate.gpuclean": "vramgate.machine.gpu_processes",
    "vramgate.probes": "vramgate.machine.probes",
    "vramgate.probes.isa": "vramgate.machine.isa",
    "vramgate.probes.devices": "vramgate.machine.devices",
    "vramgate.attention": "vramgate.models.attention",
    "vramgate.moe": "vramgate.models.moe",
    "vramgate.quant": "vramgate.models.quant",
    "vramgate.quantpack": "vramgate.models.checkpoints",
    "vramgate.vllm_kv": "vramgate.models.vllm_kv",
    "vramgate.patches": "vramgate.profiles",
    "vramgate.simulate": "vramgate.sim",
    "vramgate.engine_worker": "vramgate.engine.worker",
    "vramgate.paired": "vramgate.engine.paired",
    "vramgate.tp_worker": "vramgate.tp.worker",
    "vramgate.plugin": "vramgate.pytest_plugin.plugin",
    "vramgate.marks": "vramgate.pytest_plugin.marks",
    "vramgate.transport": "vramgate.pytest_plugin.transport",
    "vramgate.gate": "vramgate.pytest_plugin.fixture",
    "vramgate.cli": "vramgate.tools.cli",
    "vramgate.install": "vramgate.tools.install",
    "vramgate.calibrate": "vramgate.tools.calibration.engine_latency",
    "vramgate.kernel_calibrate": "vramgate.tools.calibration.kernel_latency",
}


def new_name(old: str) -> str | None:
    """The module *old* names now: its own entry in :data:`MOVED`, else its longest moved parent's new name
    with the rest appended (``vramgate.probes.cpu`` -> ``vramgate.machine.probes.cpu``); None if not moved."""
    parts = old.split(".")
    for n in range(len(parts), 1, -1):
        moved = MOVED.get(".".join(parts[:n]))
        if moved is not None:
            return ".".join([moved, *parts[n:]])
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a former module name and loads it as the module it names now (:data:`MOVED`)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for a moved name whose new module exists; None for every other name."""
        new = new_name(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=new)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The new module itself (imported if it is not yet), after the deprecation warning."""
        new = new_name(spec.name)
        assert new is not None
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


def install() -> None:
    """Put the finder first on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
