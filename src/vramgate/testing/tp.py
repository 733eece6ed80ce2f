"""Tensor-parallel runs for the suites: a :class:`~vramgate.tp.TPSpec` as real process groups."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from vramgate.tp import (
    DTYPE_BYTES,
    Launcher,
    MLPShape,
    RankResult,
    TPError,
    TPSpec,
    launcher,
    overlap_fraction,
    peak_change,
    run_tp,
)

__all__ = [
    "DTYPE_BYTES",
    "Launcher",
    "MLPShape",
    "RankResult",
    "TPError",
    "TPRunner",
    "TPSpec",
    "launcher",
    "overlap_fraction",
    "peak_change",
]


class TPRunner:
    """Runs tensor-parallel specs, each in a fresh folder; a failed rank fails the test with its log tail."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._ids = itertools.count()

    def run_dir(self, spec: TPSpec) -> Path:
        """A new folder for one run of *spec* (its spec, per-rank logs and results)."""
        return self.base_dir / f"{spec.device}-tp{spec.world_size}-{next(self._ids)}"

    def run(self, spec: TPSpec) -> list[RankResult]:
        """Run *spec* on its ranks: one result per rank."""
        try:
            return run_tp(spec, self.run_dir(spec))
        except TPError as exc:
            message = str(exc)
        pytest.fail(message, pytrace=False)  # outside the handler: the message alone, no chained traceback
