"""Tensor-parallel runs as real process groups: the launcher and the pure helpers.

A run is a :class:`TPSpec` (world size, device, MLP shape, variants, samples)
executed by ``python -m vramgate.tp.worker SPEC.json`` once per rank, each in
its own session (process group), with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``/``LOCAL_RANK`` set as ``torch.distributed``'s ``env://`` expects.
Every rank writes ``rank<R>.log`` (its stdout and stderr) and ``rank<R>.json``
(a :class:`RankResult`) into the run's folder.

Note [rank failure]: the parent polls all ranks against one deadline. The
first rank that exits non-zero (one killed by a signal wins over one that
exited with a status in the same poll, since a dead peer makes the others fail
too), or the deadline, stops every rank's process group (SIGTERM, then SIGKILL)
and raises :class:`TPError` naming that rank, with its log tail and a line on
each other rank. Nothing is left running. The ranks also carry
``torch.distributed`` timeouts, so a rank whose peer vanished fails on its own.

Nothing here imports torch; :mod:`vramgate.tp.worker` is the torch side.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from vramgate.runtime import process
from vramgate.runtime.engine_env import engine_python
from vramgate.runtime.exits import describe_exit
from vramgate.tp.spec import RankResult, TPError, TPSpec, TPSpecError

#: Seconds between two looks at the ranks.
POLL_S = 0.05
#: Seconds every rank gets to end after SIGTERM before the process groups are killed.
RANK_GRACE_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on *host* that nothing listens on now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(base: Mapping[str, str], *, rank: int, world_size: int, port: int, device: str) -> dict[str, str]:
    """The environment of one rank: ``env://`` rendezvous on loopback, one compute thread per rank on CPU."""
    env = dict(base)
    env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "PYTHONUNBUFFERED": "1",
    })
    if device == "cpu":
        # One thread per rank: two ranks with two threads each on a two-core machine stall in OpenMP barriers.
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = process.pythonpath(env)
    return env


class Launcher:
    """Starts *world_size* ranks of *command*, each in its own session, and watches them to the end.

    Use :meth:`start`, then :meth:`wait` (or :meth:`stop`); as a context manager
    it stops every rank on the way out, whatever happened.
    """

    def __init__(self, command: Sequence[str], world_size: int, run_dir: Path, *, device: str = "cpu",
                 timeout_s: float = 120.0, env: Mapping[str, str] | None = None, port: int | None = None,
                 label: str = "tensor-parallel") -> None:
        if world_size < 1:
            raise TPSpecError(f"world_size = {world_size!r}: need at least 1")
        self.command = list(command)
        self.world_size = world_size
        self.run_dir = run_dir
        self.device = device
        self.timeout_s = timeout_s
        self.base_env = dict(os.environ if env is None else env)
        self.port = port
        self.label = label
        self.procs: list[process.Child] = []
        self.started_at = 0.0

    def log_path(self, rank: int) -> Path:
        """The log file of rank *rank*."""
        return self.run_dir / f"rank{rank}.log"

    @property
    def pids(self) -> list[int]:
        """Process ids of the started ranks."""
        return [p.pid for p in self.procs]

    def start(self) -> Launcher:
        """Start every rank (a fresh loopback port unless one was given)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        port = self.port or free_port()
        self.started_at = time.monotonic()
        try:
            for rank in range(self.world_size):
                self.procs.append(process.launch(
                    self.command, self.log_path(rank), cwd=self.run_dir,
                    env=rank_env(self.base_env, rank=rank, world_size=self.world_size, port=port, device=self.device),
                ))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every rank's process group: SIGTERM, :data:`RANK_GRACE_S`, then SIGKILL; reap them all."""
        process.kill_groups(self.procs, RANK_GRACE_S)

    def __enter__(self) -> Launcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _elapsed(self) -> float:
        return time.monotonic() - self.started_at

    def _others(self, blamed: int | None, codes: Mapping[int, int]) -> str:
        lines = []
        for rank in range(self.world_size):
            if rank == blamed:
                continue
            state = describe_exit(codes[rank]) if rank in codes else "was still running and was stopped"
            last = process.tail(self.log_path(rank), 1)
            lines.append(f"  rank {rank} {state}" + (f"; its last line: {last}" if last else ""))
        return "\n".join(lines)

    def wait(self) -> None:
        """Wait for every rank to exit 0; otherwise stop them all and raise :class:`TPError` (Note [rank failure])."""
        deadline = self.started_at + self.timeout_s
        try:
            while True:
                codes = {r: p.poll() for r, p in enumerate(self.procs)}
                failed = {r: rc for r, rc in codes.items() if rc is not None and rc != 0}
                if failed:
                    blamed = min(failed, key=lambda r: (failed[r] > 0, r))  # a signal death first
                    self.stop()
                    final = {r: p.returncode for r, p in enumerate(self.procs) if p.returncode is not None}
                    log_tail = process.tail(self.log_path(blamed))
                    raise TPError(
                        f"{self.label} rank {blamed} of {self.world_size} {describe_exit(failed[blamed])} "
                        f"after {self._elapsed():.1f} s; every rank was stopped\n{self._others(blamed, final)}\n"
                        f"--- rank {blamed} log tail ({self.log_path(blamed)}) ---\n{log_tail}",
                        rank=blamed, log_tail=log_tail, run_dir=self.run_dir)
                if all(rc == 0 for rc in codes.values()):
                    return
                if time.monotonic() > deadline:
                    running = [r for r, rc in codes.items() if rc is None]
                    self.stop()
                    tails = "\n".join(
                        f"--- rank {r} log tail ({self.log_path(r)}) ---\n{process.tail(self.log_path(r))}"
                        for r in running)
                    raise TPError(
                        f"{self.label} run timed out after {self.timeout_s:g} s with rank(s) "
                        f"{', '.join(map(str, running))} of {self.world_size} still running; every rank was "
                        f"stopped\n{tails}",
                        rank=running[0] if len(running) == 1 else None,
                        log_tail=process.tail(self.log_path(running[0])), run_dir=self.run_dir)
                time.sleep(POLL_S)
        except BaseException:
            self.stop()
            raise


def worker_command(spec_path: Path, python: str | None = None) -> list[str]:
    """The command line of one rank of :mod:`vramgate.tp.worker`, under *python* (default: the engine
    environment's interpreter, whose torch the ranks measure)."""
    return [python or engine_python(), "-m", "vramgate.tp.worker", str(spec_path)]


def prepare(spec: TPSpec, run_dir: Path) -> Path:
    """Validate *spec*, write it to *run_dir*/spec.json and clear old results; returns the spec's path."""
    spec.validate()
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec.to_json(), indent=2, sort_keys=True), encoding="utf-8")
    for rank in range(spec.world_size):
        for suffix in (".json", ".holding"):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / f"rank{rank}{suffix}").unlink()
    return spec_path


def launcher(spec: TPSpec, run_dir: Path, *, env: Mapping[str, str] | None = None) -> Launcher:
    """A :class:`Launcher` for *spec* with its spec file written (not started yet)."""
    spec_path = prepare(spec, run_dir)
    return Launcher(worker_command(spec_path), spec.world_size, run_dir, device=spec.device,
                    timeout_s=spec.timeout_s, env=env)


def read_results(run_dir: Path, world_size: int) -> list[RankResult]:
    """Every rank's :class:`RankResult`; :class:`TPError` naming the rank whose file is missing or malformed."""
    out = []
    for rank in range(world_size):
        path = run_dir / f"rank{rank}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise TPError(f"rank {rank} exited 0 but left no readable result {path} ({exc})\n"
                          f"--- rank {rank} log tail ---\n{process.tail(run_dir / f'rank{rank}.log')}",
                          rank=rank, run_dir=run_dir) from None
        result = RankResult.from_json(data, str(path))
        if result.rank != rank:
            raise TPError(f"{path} field 'rank' = {result.rank}: expected {rank}", rank=rank, run_dir=run_dir)
        out.append(result)
    return out


def run_tp(spec: TPSpec, run_dir: Path, *, env: Mapping[str, str] | None = None, attempts: int = 3) -> list[RankResult]:
    """Run *spec* on ``spec.world_size`` ranks with their files in *run_dir*; one :class:`RankResult` per rank.

    A rank that fails raises :class:`TPError` (Note [rank failure]). Only when
    rank 0 could not bind the rendezvous port (taken between choosing and
    binding it) is the run retried, on a new port, up to *attempts* times.
    """
    for attempt in range(1, attempts + 1):
        try:
            with launcher(spec, run_dir, env=env) as ranks:
                ranks.wait()
            break
        except TPError:
            if attempt == attempts or "address already in use" not in process.tail(run_dir / "rank0.log").lower():
                raise
    return read_results(run_dir, spec.world_size)
