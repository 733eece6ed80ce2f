"""In-process vLLM configs leave the gate's environment as it was (Note [vLLM's environment changes])."""

from __future__ import annotations

import os

import pytest

from vramgate.models.vllm_kv import engine_config


class PlatformLike:
    """Sets and removes variables as vLLM's CPU platform does when it checks a config."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def create_engine_config(self) -> str:
        os.environ["LD_PRELOAD"] = "/somewhere/libtcmalloc_minimal.so.4"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ.pop("STAYS_OR_GOES", None)
        if self.fail:
            raise ValueError("bad config")
        return "config"


@pytest.mark.parametrize("fail", [False, True])
def test_changes_to_the_environment_are_undone(monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setenv("STAYS_OR_GOES", "1")
    before = dict(os.environ)
    if fail:
        with pytest.raises(ValueError, match="bad config"):
            engine_config(PlatformLike(fail=True))
    else:
        assert engine_config(PlatformLike()) == "config"
    assert dict(os.environ) == before
