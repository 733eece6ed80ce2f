"""vLLM's environment for one gate run: offline, no usage reports, every file inside the run's folder.

One place decides what vLLM sees, for all its uses: the engine subprocess
(:func:`vramgate.engine.runner.engine_process_env`), the in-process simulator
(:func:`vramgate.sim.simulator.simulate`), the suites' ``vllm_env`` fixture and ``vramgate simulate``.

Note [vLLM log level]: an engine subprocess logs at ``INFO``, because its log is
evidence (the kernels vLLM chose, its memory figures, the tail shown when it
fails). vLLM inside the gate's own process (the simulator) logs at ``WARNING``:
its INFO lines would bury pytest's output. The two never mix: an engine's
environment always sets its level, whatever the gate's process has.
"""

from __future__ import annotations

import os
import tempfile
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


#: What vLLM writes into the environment of a process it runs in, for the processes it would start (Note [vLLM's
#: environment changes] in :mod:`vramgate.models.vllm_kv`): its CPU platform's ``check_and_update_config``
#: (tcmalloc and torch's libgomp in ``LD_PRELOAD``, the workers' start method, thread counts, the SSM state layout,
#: the world size), its AITER module on import (``_aiter_ops``), and OpenCV's loader, which its video decoders
#: import (``LD_LIBRARY_PATH``). Held to the pinned vLLM by ``tests/test_vllm_contracts.py``.
VLLM_WRITES = frozenset({
    "AITER_SITUV2_A4W4", "AITER_SITUV2_A8W4", "LD_LIBRARY_PATH", "LD_PRELOAD", "LOCAL_WORLD_SIZE",
    "NUMEXPR_MAX_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_WORKER_MULTIPROC_METHOD",
})
#: The values of :data:`VLLM_WRITES` when the gate's process started (before it ran vLLM itself).
_AT_START = {key: os.environ.get(key) for key in VLLM_WRITES}


def child_environment() -> dict[str, str]:
    """This process's environment for a child it starts, with what vLLM wrote into it undone.

    Note [a clean start for every child]: vLLM inside the gate's own process (a simulation, a KV reading) writes
    :data:`VLLM_WRITES` into it. A child started after that would inherit them: tcmalloc and libgomp loaded into
    an engine from its first instruction (``LD_PRELOAD`` acts at exec), where one started before would run on the
    C library's allocator, so an engine's memory and speed would depend on which tests ran before it on the same
    worker; and no engine could be forked from the preloaded interpreter any more, whose environment is the one it
    started with (Note [preloaded engines] in :mod:`vramgate.runtime.preload`), so each would import torch and
    vLLM afresh (docs/running.md, "Where the time goes"). So each of them is set back to its value when the gate
    started (or removed); a child's vLLM then writes them for its own children, as it does in a team's server."""
    env = dict(os.environ)
    for key, value in _AT_START.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


#: The longest path of a Unix socket (``sizeof(sockaddr_un.sun_path)`` less its terminator): libzmq refuses longer.
UNIX_SOCKET_PATH_MAX = 107


def rpc_dir() -> Path:
    """The folder of vLLM's IPC sockets (``VLLM_RPC_BASE_PATH``) for every vLLM the gate runs.

    Note [IPC socket path]: vLLM names every IPC socket ``ipc://{VLLM_RPC_BASE_PATH}/{uuid4}``
    (``utils/network_utils.get_open_zmq_ipc_path``: the API server and its engine core, a tensor-parallel run's
    message queues, ``shm_broadcast``), and ``VLLM_RPC_BASE_PATH`` defaults to the temporary folder, which the
    gate points into the run's folder: ``<basetemp>/engine0/<model>-<key>/tmp`` is about 100 bytes before the
    socket's name, past the 107 a socket's path may have. So the sockets go to a short folder of this user under
    ``/tmp`` instead (made once, mode 0700); the names are unique, so every run can share it."""
    base = "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else tempfile.gettempdir()
    path = Path(base) / f"vramgate-rpc-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


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
        "VLLM_RPC_BASE_PATH": str(rpc_dir()),  # Note [IPC socket path]
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
