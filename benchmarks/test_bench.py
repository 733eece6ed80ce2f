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
from vramgate.testing.engines import small_run_block_size

ROOT = Path(__file__).resolve().parents[1]


#: A fixed pure-Python loop (the gate's machine speed probe, :func:`vramgate.machine.speed.measure`, once over
#: 300,000 calls): machines differ about 3x in single-thread speed, and a pure-Python timing divided by this loop's,
#: taken in the same run, compares across machines.
REFERENCE_LOOP = "from vramgate.machine.speed import measure\nprint(measure(repeats=1, iterations=300_000))\n"


def reference_loop_s() -> float:
    """The reference loop's wall time on this machine now, in a fresh interpreter (seconds)."""
    out = subprocess.run([sys.executable, "-c", REFERENCE_LOOP], capture_output=True, text=True, check=True)
    return float(out.stdout)


def test_simulator_10k_sharegpt(benchmark, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`vramgate simulate` on a 10,000-request ShareGPT-like trace, cold (fresh vLLM cache), import included.

    Reported against the reference loop (target: <= 15x it) and split into vLLM's own scheduler time (its
    ``schedule()`` and ``update_from_output()``: the floor no harness can go under), the harness's share of the
    step loop above it, and the import and setup (vLLM's config, model inspection, the requests).
    """
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "vramgate", "simulate", "--model", "tiny-deepseek-v2", "--workload", "sharegpt",
           "--requests", "10000", "--seed", "0", "--json"]

    def run() -> dict:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    before = reference_loop_s()
    start = time.perf_counter()
    data = benchmark.pedantic(run, rounds=1, iterations=1)
    wall = time.perf_counter() - start
    loop = min(before, reference_loop_s())
    timing = data["timing"]
    harness = timing["loop_s"] - timing["scheduler_s"]
    figures = {
        "wall_s": wall, "reference_loop_s": loop, "wall_x_loop": wall / loop,
        "vllm_scheduler_x_loop": timing["scheduler_s"] / loop, "harness_step_loop_x_loop": harness / loop,
        "harness_us_per_step": harness / data["steps"] * 1e6,
        "import_and_setup_s": timing["setup_s"],  # setup_s counts from the start, import included
        "steps": data["steps"], "preemptions": data["preemptions"],
    }
    benchmark.extra_info.update(figures, **timing)
    with capsys.disabled():
        print(f"\n10,000-request simulation, cold: {wall:.1f} s = {wall / loop:.1f}x the reference loop ({loop:.2f} s);"
              f" vLLM's schedule() + update_from_output() {timing['scheduler_s']:.1f} s"
              f" ({timing['scheduler_s'] / loop:.1f}x: the floor); the harness's step loop above it {harness:.2f} s"
              f" ({harness / data['steps'] * 1e6:.0f} us per step, {data['steps']} steps); import"
              f" {timing['import_s']:.1f} s, then setup {timing['setup_s'] - timing['import_s']:.1f} s")
    assert data["requests"] == 10000


@pytest.fixture(scope="module")
def vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One vLLM cache folder for the engine benchmarks, as a gate session has (its path is part of what a
    preloaded interpreter must share with the runs it forks)."""
    return tmp_path_factory.mktemp("vllm-cache")


@pytest.mark.parametrize("start", ["fresh", "preloaded"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v2"])
def test_engine_start_to_first_result(benchmark, tmp_path: Path, vllm_cache: Path, model: str, start: str) -> None:
    """Engine subprocess start to its result: 1 request of 16 + 1 tokens, in a fresh interpreter or forked from
    the preloaded one (started, and its model inspected, by an untimed run first: Note [preloaded engines])."""
    spec = EngineSpec(model=model, requests=1, block_size=small_run_block_size(model), max_model_len=256,
                      kv_budget_gib=0.0625, workload_params={"prompt_len": 16, "output_len": 1})
    preload = tmp_path / "preload" if start == "preloaded" else None
    cache = vllm_cache
    if preload is not None:
        run_engine(spec, ROOT, tmp_path / "warm", cache_root=cache, preload=preload)
    result = benchmark.pedantic(lambda: run_engine(spec, ROOT, tmp_path / "run", cache_root=cache, preload=preload),
                                rounds=1, iterations=1)
    benchmark.extra_info.update(result.timing)
    print(f"\n{model}, {start}: {result.timing['subprocess_wall_s']:.1f} s from start to result (import "
          f"{result.timing['import_s']:.1f} s, engine {result.timing['init_s']:.1f} s, generate "
          f"{result.timing['generate_s']:.2f} s)")
    assert (result.timing["import_s"] < 0.5) == (start == "preloaded")
