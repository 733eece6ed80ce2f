"""vLLM's OpenAI-compatible server as a child of the gate: started for an engine spec, up when ``/health`` says
so, read while it serves, stopped so that nothing of it is left.

:class:`ApiServer` starts ``python -m vramgate.engine.api_server`` (what ``vllm serve`` runs, for the spec's
engine arguments and profile: :mod:`vramgate.engine.api_server`) in its own session on 127.0.0.1 and a free port,
with vLLM's files in the run's folder and its log kept there. :meth:`ApiServer.start` waits for ``/health`` with
a timeout, and fails with the reason and the log's tail when the server exits first (a port taken, a bad engine
argument, an out-of-memory kill) or does not come up in time. :meth:`ApiServer.stop` sends SIGINT (uvicorn and
vLLM shut down cleanly on it), waits, then ends the whole process group (vLLM's engine core with it). A gate that
dies without stopping it leaves nothing either (Note [no child outlives its gate] in
:mod:`vramgate.runtime.process`). While it serves, its memory is read: its process tree's resident memory, and on
the GPU tier its device memory through NVML (:meth:`ApiServer.device_reader`; Note [device memory slope] in
:mod:`vramgate.engine.leak`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from vramgate.engine.runner import EngineError, engine_process_env
from vramgate.engine.spec import EngineSpec, apply_profile, engine_tier, validate
from vramgate.machine import devices
from vramgate.machine.probes.cpu import children, tree_rss_bytes
from vramgate.machine.probes.nvml import NVMLUnavailable, TreeDeviceReader
from vramgate.models.config import load_model
from vramgate.runtime import process
from vramgate.runtime.engine_env import engine_python
from vramgate.runtime.exits import describe_exit

#: The address every server of the gate listens on: this machine only.
HOST = "127.0.0.1"
#: Seconds a server gets to answer ``/health`` after it starts (CPU: 32-41 s measured alone on 2 cores, about
#: 105 s with four starting at once; a GPU box captures CUDA graphs and compiles first).
START_TIMEOUT_S = 900.0
#: Seconds a server gets to exit after SIGINT before its process group is killed.
STOP_GRACE_S = 20.0

#: oneDNN's environment variable for the capacity of its process-wide primitive cache, and the gate's CPU servers'
#: value (Note [oneDNN's shape cache]).
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = "0"

# Note [oneDNN's shape cache]: vLLM's CPU build runs every dense linear layer through oneDNN
# (``dispatch_cpu_unquantized_gemm`` in vllm/model_executor/layers/utils.py: ``create_onednn_mm(weight, 32)``), and
# a oneDNN matmul primitive is made, just in time, for each number of tokens in a step (M). Each layer's handler
# keeps 32 of them; oneDNN keeps every primitive made in its process-wide cache too, up to 1,024 by default. A
# server under load meets new step sizes for hundreds of requests (its batches of prefills and decodes combine in
# many ways), and each new one kept memory in the engine's worker: its anonymous memory grew in steps, per request,
# past the leak allowance on the AVX-512 kernels (far less on the AVX2 path's). That is a bounded
# cache filling, not a leak, but it fills for longer than any warm-up the gate can afford, and it read as a leak. The
# gate's CPU servers therefore run with oneDNN's process-wide cache off (capacity 0): the layers' own handlers still
# keep their 32 shapes each, so a step size the load repeats is not made again, and the server settles once its
# handlers are full, which the warm-up's shape sweep sees to (Note [settled warm-up] in vramgate.engine.leak).
# Measured: docs/online-serving.md, "oneDNN's shape cache".


class ServerError(EngineError):
    """A server that did not start, died while serving, or failed a request; carries its log's tail."""


def free_port(host: str = HOST) -> int:
    """A TCP port on *host* that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ApiServer:
    """One vLLM OpenAI-compatible server for *spec* (its profile applied), with its files in *run_dir*.

    The model folder it serves (the fixture's config and the tokenizer of Note [serving tokenizer] in
    :mod:`vramgate.engine.api_server`) is :attr:`model_dir`; vLLM's benchmark client loads the same tokenizer.
    Use it as a context manager, or call :meth:`stop`."""

    def __init__(self, spec: EngineSpec, root: Path, run_dir: Path, *, port: int | None = None,
                 cache_root: Path | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        resolved, paths = apply_profile(spec, root, run_dir / "overlay")
        validate(resolved, root)
        self.spec, self.root, self.run_dir = resolved, root, run_dir
        self._chosen_port = port is None
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.model_dir = run_dir / "model"
        self.log_path = run_dir / "server.log"
        self.served_name = spec.model
        self._paths, self._cache_root = paths, cache_root
        self.proc: process.Child | None = None
        self.startup_s: float | None = None
        """Seconds from the start of the process to its first healthy answer."""
        self.visible_devices: str | None = None
        """The ``CUDA_VISIBLE_DEVICES`` the server was started with (None: unset, every device)."""

    @property
    def url(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT``)."""
        return f"http://{HOST}:{self.port}"

    def describe(self) -> str:
        """One line: what this server runs, and where."""
        profile = f", profile {self.spec.profile}" if self.spec.profile else ""
        return f"vLLM server for {self.spec.model}{profile} at {self.url}"

    def start(self) -> ApiServer:
        """Start the server and wait for ``/health``; :class:`ServerError` with the log's tail when it exits first
        or is not healthy within the start timeout (then it is stopped). A port the gate chose that another process
        took before the server bound it is chosen again, once."""
        try:
            return self._start_once()
        except ServerError as exc:
            if not self._chosen_port or "ddress already in use" not in exc.log_tail:
                raise
        self.port = free_port()
        return self._start_once()

    def _start_once(self) -> ApiServer:
        if self.proc is not None:
            raise RuntimeError(f"{self.describe()} was started already")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = load_model(self.root, self.spec.model).path
        server_json = self.run_dir / "server.json"
        server_json.write_text(json.dumps({
            "spec": self.spec.to_json(), "root": str(self.root), "config": str(config),
            "model_dir": str(self.model_dir), "host": HOST, "port": self.port, "served_name": self.served_name,
        }, indent=2, sort_keys=True), encoding="utf-8")
        env = engine_process_env(self.spec, self.run_dir, self._paths, self._cache_root)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs its engine core as vLLM does: apart
        if engine_tier() == "cpu":  # Note [oneDNN's shape cache]; a spec's own env (a team's entry) may set another
            env[ONEDNN_CACHE_ENV] = self.spec.env.get(ONEDNN_CACHE_ENV, ONEDNN_CACHE_CAPACITY)
        self.visible_devices = env.get(devices.ENV)
        # Its API server and engine core talk over IPC sockets: Note [IPC socket path] in vramgate.runtime.vllm_env.
        cmd = [self.spec.python or engine_python(), "-m", "vramgate.engine.api_server", str(server_json)]
        t0 = time.monotonic()
        self.proc = process.launch(cmd, self.log_path, env=env, cwd=self.run_dir, stdin=subprocess.DEVNULL)
        try:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise self._error(f"{self.describe()} {describe_exit(rc)} before it was up")
                if self.healthy():
                    self.startup_s = time.monotonic() - t0
                    return self
                if time.monotonic() - t0 > self.start_timeout_s:
                    raise self._error(f"{self.describe()} was not healthy after {self.start_timeout_s:g} s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def check_alive(self, during: str) -> None:
        """:class:`ServerError` with the log's tail when the server has exited (*during*: what it was doing)."""
        if self.proc is None:
            raise RuntimeError(f"{self.describe()} was never started")
        rc = self.proc.poll()
        if rc is not None:
            raise self._error(f"{self.describe()} {describe_exit(rc)} during {during}")

    def rss_bytes(self) -> int:
        """The resident memory of the server's whole process tree (API server and engine core); 0 once it is
        gone."""
        return tree_rss_bytes(self.proc.pid) if self.proc is not None and self.proc.poll() is None else 0

    def tree_pids(self) -> set[int]:
        """The pids of the server's whole process tree now; empty once it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return set()
        return {self.proc.pid, *children(self.proc.pid)}

    def device_reader(self) -> TreeDeviceReader | None:
        """NVML, open on the devices this server uses (those its ``CUDA_VISIBLE_DEVICES`` shows, as many as its
        tensor-parallel size), for readings of its device memory; None on the CPU tier or where NVML cannot be
        read (Note [device memory slope] in :mod:`vramgate.engine.leak`). The caller closes it."""
        if engine_tier() != "gpu":
            return None
        try:
            return TreeDeviceReader.open(self.visible_devices, self.spec.tensor_parallel_size)
        except NVMLUnavailable:
            return None

    def tail(self) -> str:
        """The last lines of the server's log."""
        return process.tail(self.log_path)

    def _error(self, message: str) -> ServerError:
        return ServerError(message, self.tail(), self.run_dir)

    def stop(self) -> int | None:
        """SIGINT to the server's process group, up to :data:`STOP_GRACE_S` for it to exit, then the group ends
        (:func:`vramgate.runtime.process.kill_group`); the server's exit status (None when never started)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            process.signal_group(proc, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)
        process.kill_group(proc, grace_s=2.0)  # whatever of the group is left: vLLM's engine core, its helpers
        return proc.returncode

    def __enter__(self) -> ApiServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

