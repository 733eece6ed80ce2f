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
from collections.abc import Callable, Sequence
from types import CodeType, ModuleType

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

#: Names a former module defined that live elsewhere now: ``{module now: {name: "module:name"}}``. A module
#: listed here resolves them through :func:`forwarding` (its ``__getattr__``), with a DeprecationWarning.
FORWARDED: dict[str, dict[str, str]] = {
    "vramgate.engine": {
        "BLOCK_SIZES": "vramgate.engine.spec:BLOCK_SIZES",
        "DTYPES": "vramgate.engine.spec:DTYPES",
        "KILL_GRACE_S": "vramgate.runtime.process:KILL_GRACE_S",
        "KNOWN_CAUSES": "vramgate.engine.runner:KNOWN_CAUSES",
        "KV_CACHE_DTYPES": "vramgate.engine.spec:KV_CACHE_DTYPES",
        "LOG_TAIL_LINES": "vramgate.runtime.process:LOG_TAIL_LINES",
        "WNA16_METHODS": "vramgate.engine.spec:WNA16_METHODS",
        "diagnose": "vramgate.engine.runner:diagnose",
        "kv_budget_bytes": "vramgate.engine.spec:kv_budget_bytes",
    },
    "vramgate.engine.worker": {
        "GPU_HEADROOM_BYTES": "vramgate.engine.arguments:GPU_HEADROOM_BYTES",
        "GPU_UTILIZATION_MAX": "vramgate.engine.arguments:GPU_UTILIZATION_MAX",
        "PLANT_DELAY_ENV": "vramgate.engine.measure:PLANT_DELAY_ENV",
        "gpu_utilization": "vramgate.engine.arguments:gpu_utilization",
    },
    "vramgate.machine.probes.gpu_state": {
        "memory_bandwidth_peak": "vramgate.machine.probes.gpu_state:device_peak_bandwidth",
    },
    "vramgate.models.attention": {
        "peak_memory_bandwidth": "vramgate.machine.probes.gpu_state:dram_bandwidth",
    },
    "vramgate.models.quant": {
        "load_config": "vramgate.models.config:read_config",
        "Resident": "vramgate.models.cpu_resident:Resident",
        "vllm_cpu_resident": "vramgate.models.cpu_resident:vllm_cpu_resident",
    },
    "vramgate.profiles": {
        "COMPARES": "vramgate.profiles.manifest:COMPARES",
        "Claim": "vramgate.profiles.manifest:ProfileClaim",
        "DEVICES": "vramgate.profiles.manifest:DEVICES",
        "OPERATORS": "vramgate.profiles.manifest:OPERATORS",
        "SAME_SOURCE": "vramgate.profiles.manifest:SAME_SOURCE",
    },
    "vramgate.pytest_plugin.fixture": {
        "Claim": "vramgate.core.claims:ClaimVerdict",
    },
    "vramgate.pytest_plugin.plugin": {
        "CUDA_LEAK_TOLERANCE": "vramgate.pytest_plugin.hygiene:CUDA_LEAK_TOLERANCE",
        "DeviceReading": "vramgate.pytest_plugin.hygiene:DeviceReading",
        "ENGINE_FIXTURES": "vramgate.pytest_plugin.options:DEFAULT_ENGINE_FIXTURES",
        "HygieneState": "vramgate.pytest_plugin.hygiene:HygieneState",
        "MISSING_POLICIES": "vramgate.pytest_plugin.options:MISSING_POLICIES",
        "MISSING_VERDICTS": "vramgate.pytest_plugin.session:MISSING_VERDICTS",
        "NVML_LEAK_TOLERANCE": "vramgate.pytest_plugin.hygiene:NVML_LEAK_TOLERANCE",
        "PROCESS_HELPERS": "vramgate.pytest_plugin.hygiene:PROCESS_HELPERS",
        "PROCESS_TREE_TOLERANCE": "vramgate.pytest_plugin.hygiene:PROCESS_TREE_TOLERANCE",
        "UPDATE_SCOPES": "vramgate.pytest_plugin.options:UPDATE_SCOPES",
        "device_leaks": "vramgate.pytest_plugin.hygiene:device_leaks",
        "device_readings": "vramgate.pytest_plugin.hygiene:device_readings",
        "parse_shard": "vramgate.pytest_plugin.options:parse_shard",
        "tree_leak": "vramgate.pytest_plugin.hygiene:tree_leak",
        "tree_rss": "vramgate.pytest_plugin.hygiene:tree_rss",
    },
    "vramgate.report": {
        "coverage_lines": "vramgate.report.table:coverage_lines",
        "moved_lines": "vramgate.report.table:moved_lines",
    },
    "vramgate.sim": {
        "DEFAULT_STEP_COST": "vramgate.sim.simulator:DEFAULT_STEP_COST",
    },
    "vramgate.store.baselines": {
        "new_file_mode": "vramgate.store.files:new_file_mode",
        "stage_text": "vramgate.store.files:stage_text",
    },
    "vramgate.tools.calibration.engine_latency": {
        "latency_spec": "vramgate.engine.paired:latency_spec",
    },
    "vramgate.tools.cli": {
        "doctor_facts": "vramgate.tools.commands.doctor:doctor_facts",
    },
    "vramgate.tp": {
        "BACKENDS": "vramgate.tp.spec:BACKENDS",
        "DEVICES": "vramgate.tp.spec:DEVICES",
        "DTYPES": "vramgate.tp.spec:DTYPES",
        "LOG_TAIL_LINES": "vramgate.runtime.process:LOG_TAIL_LINES",
        "POLL_S": "vramgate.tp.launch:POLL_S",
        "VARIANTS": "vramgate.tp.spec:VARIANTS",
        "free_port": "vramgate.tp.launch:free_port",
        "prepare": "vramgate.tp.launch:prepare",
        "rank_env": "vramgate.tp.launch:rank_env",
        "tail": "vramgate.runtime.process:tail",
        "worker_command": "vramgate.tp.launch:worker_command",
    },
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

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m <former name>`` (runpy runs it as ``__main__``); says where the
        module went with a FutureWarning, which Python shows by default."""
        new = new_name(fullname)
        assert new is not None
        warnings.warn(f"{fullname} moved to {new}: run python -m {new}", FutureWarning, stacklevel=2)
        spec = importlib.util.find_spec(new)
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"{new} cannot be run as a module", name=fullname)
        return loader.get_code(new)

    def is_package(self, fullname: str) -> bool:
        """Whether the module the former name names now is a package."""
        new = new_name(fullname)
        spec = importlib.util.find_spec(new) if new is not None else None
        return spec is not None and spec.submodule_search_locations is not None


def forwarding(module: str) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) for *module*: a name :data:`FORWARDED` lists resolves to where it lives
    now, with a DeprecationWarning; any other name raises AttributeError as usual.

    Modules assign it under ``if not TYPE_CHECKING``, so that the type checker still rejects unknown names.
    """
    table = FORWARDED.get(module, {})

    def __getattr__(name: str) -> object:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, attr = target.partition(":")
        warnings.warn(f"{module}.{name} moved to {where}.{attr}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), attr)

    return __getattr__


def install() -> None:
    """Put the finder first on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
