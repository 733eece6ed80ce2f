"""Benchmarks of the gate's own machinery (pytest-benchmark; not part of the gate's pass/fail).

    tox -e bench
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vramgate.engine import EngineSpec, run_engine

ROOT = Path(__file__).resolve().parents[1]


def test_simulator_10k_sharegpt(benchmark, tmp_path: Path) -> None:
    """`vramgate simulate` on a 10,000-request ShareGPT-like trace, import included (target: <= 60 s)."""
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "vramgate", "simulate", "--model", "tiny-llama", "--workload", "sharegpt",
           "--requests", "10000", "--seed", "0", "--json"]

    def run() -> dict:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    start = time.perf_counter()
    data = benchmark.pedantic(run, rounds=1, iterations=1)
    wall = time.perf_counter() - start
    benchmark.extra_info.update(
        wall_s=wall, requests_per_s=10000 / wall, steps=data["steps"], preemptions=data["preemptions"],
        loop_s=data["timing"]["loop_s"], import_s=data["timing"]["import_s"],
    )
    assert data["requests"] == 10000


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v2"])
def test_engine_start_to_first_result(benchmark, tmp_path: Path, model: str) -> None:
    """Engine subprocess start to its result: 1 request of 16 + 1 tokens."""
    spec = EngineSpec(model=model, requests=1, block_size=16 if "deepseek" in model else 32, max_model_len=256,
                      kv_budget_gib=0.0625, workload_params={"prompt_len": 16, "output_len": 1})
    result = benchmark.pedantic(lambda: run_engine(spec, ROOT, tmp_path / "run"), rounds=1, iterations=1)
    benchmark.extra_info.update(result.timing)
