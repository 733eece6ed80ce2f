"""vLLM's environment for one gate run: offline, no usage reports, every file inside the run's folder.

One place decides what vLLM sees, for all its uses: the engine subprocess
(:func:`vramgate.engine.runner.engine_env`), the in-process simulator
(:func:`vramgate.sim.simulator.simulate`), the suites' ``vllm_env`` fixture and ``vramgate simulate``.

Note [vLLM log level]: an engine subprocess logs at ``INFO``, because its log is
evidence (the kernels vLLM chose, its memory figures, the tail shown when it
fails). vLLM inside the gate's own process (the simulator) logs at ``WARNING``:
its INFO lines would bury pytest's output. The two never mix: an engine's
environment always sets its level, whatever the gate's process has.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The level of an engine subprocess's log (Note [vLLM log level]).
ENGINE_LOG_LEVEL = "INFO"
#: The level of vLLM running inside the gate's own process (Note [vLLM log level]).
IN_PROCESS_LOG_LEVEL = "WARNING"

#: Offline and untracked, whatever the run: there is no model hub to reach and nothing to report to.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


def vllm_environment(run_dir: Path, *, cache_root: Path | None = None, log_level: str | None = ENGINE_LOG_LEVEL,
                     temp: bool = True) -> dict[str, str]:
    """The variables that make vLLM offline and keep its files in *run_dir*.

    *cache_root* (default ``run_dir/cache``) holds vLLM's cache of model
    inspections and the compiled Triton and Inductor kernels; runs of one
    session may share it (compiled kernels depend on the code and the shapes,
    not on the run). *temp* points ``TMPDIR`` into ``run_dir/tmp`` (created). *log_level* None leaves
    vLLM's log level to whoever sets it (Note [vLLM log level]).
    """
    cache = cache_root or run_dir / "cache"
    env = dict(OFFLINE)
    env.update({
        "HF_HOME": str(run_dir / "hf"),
        "VLLM_CACHE_ROOT": str(cache),
        "VLLM_CONFIG_ROOT": str(run_dir / "config"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    })
    if log_level is not None:
        env["VLLM_LOGGING_LEVEL"] = log_level
    if temp:
        tmp = run_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
    return env


def in_process_defaults() -> dict[str, str]:
    """What vLLM inside the gate's own process needs when nobody set up its environment: offline and
    quiet. Applied with :func:`setdefault`, so a fixture's or a user's settings win."""
    return {**OFFLINE, "VLLM_LOGGING_LEVEL": IN_PROCESS_LOG_LEVEL}


def setdefault(env: Mapping[str, str]) -> None:
    """Set each of *env* in this process unless it is set already."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
