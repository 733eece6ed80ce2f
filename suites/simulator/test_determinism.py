"""The simulator is a pure function of its inputs."""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import ModelLoader
from vramgate.testing.simulator import build, simulate

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("the simulator's determinism: a property of the harness, not of a profile")


def test_two_runs_give_identical_figures(gate: Gate, model_shape: ModelLoader) -> None:
    workload = build("sharegpt", requests=400, seed=5, max_model_len=4096, arrival_rate=20.0)
    kwargs = dict(block_size=16, num_gpu_blocks=600, max_model_len=4096)
    first = simulate(model_shape.path("tiny-deepseek-v2"), workload, **kwargs)  # type: ignore[arg-type]
    second = simulate(model_shape.path("tiny-deepseek-v2"), workload, **kwargs)  # type: ignore[arg-type]
    assert first.figures() == second.figures()
    gate.record("steps", first.steps, unit="count")
    gate.record("preemptions", first.preemptions, unit="count")
    gate.record("peak_blocks", first.peak_blocks_used, unit="blocks")
