"""The markers vramgate declares, with help text built from their signatures.

Each marker is described by a plain function whose signature is the marker's
signature: arguments are checked by binding them to it, so a misspelt keyword
or a missing argument is a usage error at collection, naming the test. The
hardware marks (``requires_*``) are evaluated lazily, at setup of a test that
carries one, never at import or collection.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from vramgate.core.verdicts import CHECKS
from vramgate.machine.hardware import GPUInfo


def gate_suite(name: str) -> str:
    """Store this test's metrics in the baseline file of suite NAME (default: its folder under suites/)."""
    if not isinstance(name, str) or not name.replace("_", "a").replace("-", "a").isalnum():
        raise ValueError(f"suite name {name!r} must be letters, digits, '_' and '-'")
    return name


def requires_gpus(count: int = 1) -> int:
    """Skip unless at least COUNT CUDA GPUs are visible."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    return count


def requires_gpu_memory(gb: float) -> float:
    """Skip unless every visible GPU has at least GB gigabytes (10^9 bytes) of memory."""
    if not isinstance(gb, int | float) or gb <= 0:
        raise ValueError(f"gb must be a positive number, got {gb!r}")
    return float(gb)


def requires_capability(major: int, minor: int = 0) -> tuple[int, int]:
    """Skip unless the first visible GPU's compute capability is at least (MAJOR, MINOR)."""
    if not isinstance(major, int) or not isinstance(minor, int):
        raise ValueError(f"major and minor must be integers, got {major!r}, {minor!r}")
    return (major, minor)


def gate_nightly(reason: str) -> str:
    """Not in the pre-merge set (tox -e cpu deselects it); the full gate (tox -e cpu-full) runs it. REASON: why.

    REASON says why the pre-merge set can do without the test: no optimization profile's gate depends on it.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"reason must say why the pre-merge set can do without this test, got {reason!r}")
    return reason


def gate_reference() -> None:
    """Other tests read what this one computes (a reference run, shared by the workers): under pytest-xdist with
    --gate-durations it starts first on its worker, so that no other test waits for it or computes it itself."""
    return None


def gate_together(group: str) -> str:
    """The tests marked with the same GROUP share something costly that a worker holds for its session (the
    serving suite's servers): under pytest-xdist with --gate-durations they are dealt to one worker, one after
    the other, so that only one worker starts it."""
    if not isinstance(group, str) or not group.strip():
        raise ValueError(f"group must name what the tests share, got {group!r}")
    return group


def gate_inputs(*paths: str) -> tuple[str, ...]:
    """Files of the project (a folder ends in /) this test reads that the gate cannot see by itself: under
    --gate-affected, a change to one of them keeps the test (Note [each test's inputs])."""
    if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise ValueError(f"paths must name files or folders of the project, got {paths!r}")
    return paths


def gate_judges(check: str) -> str:
    """This test settles CHECK (applies, answers, capacity, latency, leaks) for its 'profile' argument: each case
    fills that profile's cell in the report's profile table (Note [profile verdict] in vramgate.core.verdicts)."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
    return check


MARKERS: dict[str, Callable[..., object]] = {
    "gate_suite": gate_suite,
    "gate_judges": gate_judges,
    "gate_inputs": gate_inputs,
    "gate_nightly": gate_nightly,
    "gate_reference": gate_reference,
    "gate_together": gate_together,
    "requires_gpus": requires_gpus,
    "requires_gpu_memory": requires_gpu_memory,
    "requires_capability": requires_capability,
}

HARDWARE_MARKERS = ("requires_gpus", "requires_gpu_memory", "requires_capability")


def marker_help(name: str) -> str:
    """``name(signature): first line of the docstring`` for ``pytest --markers``."""
    fn = MARKERS[name]
    doc = (inspect.getdoc(fn) or "").splitlines()[0]
    sig = str(inspect.signature(fn, eval_str=True)).split(" ->")[0]
    return f"{name}{sig}: {doc}"


def marker_value(mark: pytest.Mark, nodeid: str) -> object:
    """Bind *mark*'s arguments to its signature; a :class:`pytest.UsageError` naming the test if they do not fit."""
    fn = MARKERS[mark.name]
    sig = inspect.signature(fn, eval_str=True)
    try:
        sig.bind(*mark.args, **mark.kwargs)
        return fn(*mark.args, **mark.kwargs)
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(
            f"{nodeid}: bad arguments to marker {mark.name}{str(sig).split(' ->')[0]}: {exc}"
        ) from None


@dataclass(frozen=True)
class HardwareNeed:
    """One hardware requirement of a test, from a ``requires_*`` mark."""

    marker: str
    value: object

    def describe(self) -> str:
        """The mark as written: ``requires_gpus(2)``."""
        if isinstance(self.value, tuple):
            args = ", ".join(str(v) for v in self.value)
        elif isinstance(self.value, float):
            args = f"{self.value:g}"
        else:
            args = str(self.value)
        return f"{self.marker}({args})"

    def unmet(self, gpus: tuple[GPUInfo, ...]) -> str | None:
        """The skip reason when *gpus* do not meet this need, else None."""
        have = f"{len(gpus)} visible" if gpus else "none visible (CPU only)"
        if self.marker == "requires_gpus":
            assert isinstance(self.value, int)
            if len(gpus) < self.value:
                return f"requires_gpus({self.value}): needs {self.value} CUDA GPU(s), {have}"
        elif self.marker == "requires_gpu_memory":
            assert isinstance(self.value, float)
            if not gpus:
                return f"requires_gpu_memory({self.value:g}): needs a GPU with {self.value:g} GB, {have}"
            smallest = min(g.memory_bytes for g in gpus)
            if smallest < self.value * 1e9:
                return (
                    f"requires_gpu_memory({self.value:g}): needs {self.value:g} GB per GPU, "
                    f"smallest visible has {smallest / 1e9:.1f} GB"
                )
        elif self.marker == "requires_capability":
            assert isinstance(self.value, tuple)
            want = f"{self.value[0]}.{self.value[1]}"
            if not gpus:
                return f"requires_capability({self.value[0]}, {self.value[1]}): needs compute capability {want}, {have}"
            cap = gpus[0].capability
            if cap is None or cap < self.value:
                got = f"{cap[0]}.{cap[1]}" if cap else "unknown"
                return (
                    f"requires_capability({self.value[0]}, {self.value[1]}): needs compute capability "
                    f">= {want}, {gpus[0].name} has {got}"
                )
        return None
