"""Note [a clean start for every child] in vramgate.runtime.vllm_env: what vLLM writes into the gate's process
never reaches a child, whatever ran before it; everything else does."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate.runtime import vllm_env


def test_what_vllm_wrote_is_undone_and_the_rest_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_env, "_AT_START", {**{k: None for k in vllm_env.VLLM_WRITES},
                                                "NUMEXPR_MAX_THREADS": "4"})
    monkeypatch.setenv("LD_PRELOAD", "/vllm/libs/libtcmalloc_minimal.so.4:/torch/lib/libgomp.so.1")
    monkeypatch.setenv("NUMEXPR_MAX_THREADS", "2")
    monkeypatch.setenv("VRAMGATE_SOMETHING", "kept")
    env = vllm_env.child_environment()
    assert "LD_PRELOAD" not in env  # absent when the gate started: removed
    assert env["NUMEXPR_MAX_THREADS"] == "4"  # the user's own value when the gate started: restored
    assert env["VRAMGATE_SOMETHING"] == "kept"  # not vLLM's: as this process has it


def test_a_user_preload_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_env, "_AT_START", {**{k: None for k in vllm_env.VLLM_WRITES},
                                                "LD_PRELOAD": "/opt/jemalloc.so"})
    monkeypatch.setenv("LD_PRELOAD", "/vllm/libs/libtcmalloc_minimal.so.4:/opt/jemalloc.so")
    assert vllm_env.child_environment()["LD_PRELOAD"] == "/opt/jemalloc.so"


def test_every_engine_and_simulation_child_starts_clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The engine's environment (engine runs, servers, paired engines) and a patched simulation's child are built
    from it."""
    from vramgate.engine import EngineSpec
    from vramgate.engine.runner import engine_process_env

    monkeypatch.setattr(vllm_env, "_AT_START", {k: None for k in vllm_env.VLLM_WRITES})
    for key in vllm_env.VLLM_WRITES:
        monkeypatch.setenv(key, "written by vLLM")
    env = engine_process_env(EngineSpec(model="tiny-llama"), tmp_path)
    assert not vllm_env.VLLM_WRITES & env.keys()

    from vramgate.sim import isolated
    from vramgate.workloads import build

    seen: dict[str, dict[str, str]] = {}

    class Started(Exception):
        pass

    def launch(command: list[str], log: Path, *, env: dict[str, str], cwd: Path) -> None:
        seen["env"] = env
        raise Started

    monkeypatch.setattr(isolated, "launch", launch)
    with pytest.raises(Started):
        isolated.simulate_in_child(tmp_path, build("fixed", requests=1, seed=0), overlay=None, run_dir=tmp_path / "s")
    assert not vllm_env.VLLM_WRITES & seen["env"].keys()
