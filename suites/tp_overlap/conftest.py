"""Fixtures of the tensor-parallel suite: run a :class:`~vramgate.tp.launch.TPSpec` as real process groups."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from vramgate.tp.launch import RankResult, TPError, TPSpec, run_tp


class TPRunner:
    """Runs tensor-parallel specs, each in a fresh folder; a failed rank fails the test with its log tail."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._ids = itertools.count()

    def run_dir(self, spec: TPSpec) -> Path:
        return self.base_dir / f"{spec.device}-tp{spec.world_size}-{next(self._ids)}"

    def run(self, spec: TPSpec) -> list[RankResult]:
        try:
            return run_tp(spec, self.run_dir(spec))
        except TPError as exc:
            message = str(exc)
        pytest.fail(message, pytrace=False)  # outside the handler: the message alone, no chained traceback


@pytest.fixture(scope="session")
def tp_runner(tmp_path_factory: pytest.TempPathFactory) -> TPRunner:
    """Run a :class:`~vramgate.tp.launch.TPSpec` on its ranks: ``tp_runner.run(spec)`` -> one result per rank.

    Needs torch (skips without it). Each run's spec, per-rank logs and results
    stay in this session's temporary folder.
    """
    pytest.importorskip("torch")
    return TPRunner(tmp_path_factory.mktemp("tp"))
