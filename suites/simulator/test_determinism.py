"""The simulator is a pure function of its inputs, and its command line prints the same figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vramgate.pytest_plugin.fixture import Gate
from vramgate.sim.simulator import simulate
from vramgate.workloads import build


def test_two_runs_give_identical_figures(gate: Gate, model_shape) -> None:
    workload = build("sharegpt", requests=400, seed=5, max_model_len=4096, arrival_rate=20.0)
    kwargs = dict(block_size=16, num_gpu_blocks=600, max_model_len=4096)
    first = simulate(model_shape.path("tiny-deepseek-v2"), workload, **kwargs)  # type: ignore[arg-type]
    second = simulate(model_shape.path("tiny-deepseek-v2"), workload, **kwargs)  # type: ignore[arg-type]
    assert first.figures() == second.figures()
    gate.record("steps", first.steps, unit="count")
    gate.record("preemptions", first.preemptions, unit="count")
    gate.record("peak_blocks", first.peak_blocks_used, unit="blocks")


def test_cli_simulate_json(vllm_env: Path, project_root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vramgate", "simulate", "--model", "tiny-llama", "--workload", "shared-prefix",
         "--requests", "50", "--seed", "2", "--block-size", "32", "--kv-blocks", "400", "--json"],
        cwd=project_root, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["requests"] == 50 and data["block_size"] == 32
    assert data["prefix_cache_hit_rate"] > 0.5  # 49 of 50 requests reuse the shared 512-token prompt
    assert data["settings"]["chunked_prefill"] and data["settings"]["prefix_caching"]


def test_cli_rejects_unknown_names(vllm_env: Path, project_root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vramgate", "simulate", "--model", "tiny-llama", "--workload", "sharegtp",
         "--requests", "5"],
        cwd=project_root, capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 2
    assert "unknown workload 'sharegtp'; accepted: fixed, long-context, shared-prefix, sharegpt, uniform" in out.stderr
