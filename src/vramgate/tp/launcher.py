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
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.runtime.process import pythonpath

#: The MLP variants a worker runs (see :mod:`vramgate.tp.worker`); ``fused`` needs CUDA symmetric memory.
VARIANTS = ("sync", "overlap", "fused")
DEVICES = ("cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPES = tuple(DTYPE_BYTES)
LOG_TAIL_LINES = 40
POLL_S = 0.05


class TPSpecError(ValueError):
    """A tensor-parallel spec that cannot run; names the field and the accepted values."""


class TPError(RuntimeError):
    """A tensor-parallel run that failed: a rank died, exited non-zero, or the run timed out.

    ``rank`` is the rank blamed (None when the whole run timed out), ``log_tail``
    its output's last lines, ``run_dir`` the run's folder.
    """

    def __init__(self, message: str, *, rank: int | None = None, log_tail: str = "",
                 run_dir: Path | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.log_tail = log_tail
        self.run_dir = run_dir


@dataclass(frozen=True)
class MLPShape:
    """A gated MLP block (gate/up projection, SiLU-and-multiply, down projection) over ``tokens`` tokens.

    ``intermediate`` is the whole block's intermediate size; each of the
    ``world_size`` ranks holds ``intermediate / world_size`` of it.
    """

    tokens: int
    hidden: int
    intermediate: int

    def check(self, world_size: int, chunks: int, where: str = "shape") -> None:
        """Raise :class:`TPSpecError` when the shape cannot be split over *world_size* ranks and *chunks*."""
        for name in ("tokens", "hidden", "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TPSpecError(f"{where} field {name!r} = {value!r}: need a positive integer")
        if self.tokens % (world_size * chunks):
            raise TPSpecError(
                f"{where} field 'tokens' = {self.tokens}: must be a multiple of world_size x chunks = "
                f"{world_size} x {chunks} = {world_size * chunks} (each rank's sequence shard is split in chunks)")
        if self.intermediate % world_size:
            raise TPSpecError(f"{where} field 'intermediate' = {self.intermediate}: must be a multiple of "
                              f"world_size {world_size} (column/row-parallel split)")

    def weight_bytes_per_rank(self, world_size: int, dtype_bytes: int) -> int:
        """Bytes of one rank's weight shards: gate/up ``hidden x 2I/w`` and down ``I/w x hidden``."""
        return 3 * self.hidden * (self.intermediate // world_size) * dtype_bytes

    def tensor_bytes(self, world_size: int, dtype_bytes: int) -> dict[str, int]:
        """Bytes of the tensors one rank's step creates, and the most of them alive at once (``step_peak``).

        ``gathered`` (tokens x hidden), ``gate_up`` (tokens x 2I/w), ``act``
        (tokens x I/w), ``down`` (tokens x hidden, the partial sums) and
        ``out`` (tokens/w x hidden). A step frees each after its consumer:
        gathered + gate_up, then gate_up + act, act + down, down + out.
        """
        i_loc = self.intermediate // world_size
        t = {
            "gathered": self.tokens * self.hidden * dtype_bytes,
            "gate_up": self.tokens * 2 * i_loc * dtype_bytes,
            "act": self.tokens * i_loc * dtype_bytes,
            "down": self.tokens * self.hidden * dtype_bytes,
            "out": self.tokens // world_size * self.hidden * dtype_bytes,
        }
        t["step_peak"] = max(t["gathered"] + t["gate_up"], t["gate_up"] + t["act"], t["act"] + t["down"],
                             t["down"] + t["out"])
        return t


@dataclass(frozen=True)
class TPSpec:
    """One tensor-parallel measurement run: what every rank executes."""

    world_size: int
    device: str
    shape: MLPShape
    variants: tuple[str, ...] = ("sync", "overlap")
    dtype: str = "float32"
    chunks: int = 4
    """Pieces each rank's sequence shard is split into for the overlapped variant's pipeline."""
    samples: int = 12
    """Measured rounds; each round times every variant, communication alone and compute alone once."""
    warmup: int = 2
    seed: int = 0
    timeout_s: float = 120.0
    """Deadline for the whole run, from the start of the first rank."""
    collective_timeout_s: float = 60.0
    """``torch.distributed`` timeout of each collective."""
    hold_rank: int | None = None
    """A rank that waits ``hold_s`` seconds after its warm-up (``rank<R>.holding`` marks it), to test failures."""
    hold_s: float = 0.0

    @property
    def backend(self) -> str:
        return BACKENDS[self.device]

    def validate(self, where: str = "tp spec") -> None:
        """Raise :class:`TPSpecError` naming the first field that cannot run."""

        def positive_int(name: str, value: object, minimum: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise TPSpecError(f"{where} field {name!r} = {value!r}: need an integer >= {minimum}")

        positive_int("world_size", self.world_size)
        if self.device not in DEVICES:
            raise TPSpecError(f"{where} field 'device' = {self.device!r}: accepted: {', '.join(DEVICES)}")
        if not isinstance(self.shape, MLPShape):
            raise TPSpecError(f"{where} field 'shape': need an MLPShape, got {type(self.shape).__name__}")
        positive_int("chunks", self.chunks)
        positive_int("samples", self.samples, 2)
        positive_int("warmup", self.warmup, 0)
        positive_int("seed", self.seed, 0)
        self.shape.check(self.world_size, self.chunks, f"{where} shape")
        if not self.variants:
            raise TPSpecError(f"{where} field 'variants': need at least one of {', '.join(VARIANTS)}")
        for v in self.variants:
            if v not in VARIANTS:
                raise TPSpecError(f"{where} field 'variants': {v!r} is not one of {', '.join(VARIANTS)}")
        if len(set(self.variants)) != len(self.variants):
            raise TPSpecError(f"{where} field 'variants': {list(self.variants)} names a variant twice")
        if "fused" in self.variants and self.device != "cuda":
            raise TPSpecError(f"{where} field 'variants': 'fused' (torch's symmetric-memory fused all-gather "
                              "matmul) runs on device 'cuda' only")
        if self.dtype not in DTYPES:
            raise TPSpecError(f"{where} field 'dtype' = {self.dtype!r}: accepted: {', '.join(DTYPES)}")
        for name in ("timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise TPSpecError(f"{where} field {name!r} = {value!r}: need a positive number of seconds")
        if self.hold_rank is not None and not (
                isinstance(self.hold_rank, int) and 0 <= self.hold_rank < self.world_size):
            raise TPSpecError(f"{where} field 'hold_rank' = {self.hold_rank!r}: need a rank in "
                              f"0..{self.world_size - 1} or None")
        if isinstance(self.hold_s, bool) or not isinstance(self.hold_s, int | float) or self.hold_s < 0:
            raise TPSpecError(f"{where} field 'hold_s' = {self.hold_s!r}: need a number of seconds >= 0")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["variants"] = list(self.variants)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "tp spec") -> TPSpec:
        """Build and validate a spec; errors name *where* and the field."""
        if not isinstance(data, dict):
            raise TPSpecError(f"{where}: must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TPSpecError(f"{where}: unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(names))}")
        shape = data.get("shape")
        if not isinstance(shape, dict) or set(shape) != {"tokens", "hidden", "intermediate"}:
            raise TPSpecError(f"{where} field 'shape': need an object with tokens, hidden, intermediate; got {shape!r}")
        fields = dict(data)
        fields["shape"] = MLPShape(**shape)
        if isinstance(fields.get("variants"), list):
            fields["variants"] = tuple(fields["variants"])
        try:
            spec = cls(**fields)
        except TypeError as exc:
            raise TPSpecError(f"{where}: {exc}") from None
        spec.validate(where)
        return spec


@dataclass
class VariantResult:
    """What one rank measured for one MLP variant."""

    step_s: list[float]
    """Wall time of each measured step (one per round), after a barrier that lines the ranks up."""
    peak_bytes: list[int]
    """Peak memory each measured step added (CPU: peak RSS; CUDA: allocator peak + memory outside the allocator)."""
    max_abs_err: float
    """Largest difference of this rank's output rows from a single-process reference."""
    allocator_peak_bytes: list[int] = field(default_factory=list)
    """CUDA only: the caching allocator's peak above what was allocated at the step's start."""
    comm_s: list[float] = field(default_factory=list)
    """Per round: this variant's collectives alone, without the compute (the ``fused`` variant cannot be split:
    its figure is the plain all-gather and reduce-scatter of the same tensors)."""
    comm_peak_bytes: list[int] = field(default_factory=list)
    """Per round: peak memory the collectives alone added (with the tensors they are handed)."""
    outside_allocator_bytes: int | None = None
    """CUDA only: device memory (NVML) the variant added that the allocator did not reserve (NCCL, symmetric memory)."""


@dataclass
class RankResult:
    """One rank's result file (``rank<R>.json``)."""

    rank: int
    world_size: int
    backend: str
    device: str
    device_name: str
    versions: dict[str, str]
    memory_probe: str
    variants: dict[str, VariantResult]
    compute_s: list[float]
    """Per round: the MLP's compute alone, on an input already gathered."""
    tolerance: float
    """The largest output error accepted against the reference (relative to its largest value)."""
    reference_max_abs: float
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Any, where: str) -> RankResult:
        """Parse a rank's result; :class:`TPError` naming *where* and the field when it is malformed."""
        if not isinstance(data, dict):
            raise TPError(f"{where}: must be a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data and n != "notes"]
        if missing:
            raise TPError(f"{where}: missing field(s) {', '.join(missing)}")
        variants = data["variants"]
        if not isinstance(variants, dict) or not variants:
            raise TPError(f"{where} field 'variants': need an object of variant results, got {variants!r}")
        parsed: dict[str, VariantResult] = {}
        vnames = {f.name for f in dataclasses.fields(VariantResult)}
        for name, v in variants.items():
            if not isinstance(v, dict) or not {"step_s", "peak_bytes", "max_abs_err", "comm_s"} <= set(v):
                raise TPError(f"{where} field 'variants.{name}': need step_s, peak_bytes, comm_s and max_abs_err")
            parsed[name] = VariantResult(**{k: val for k, val in v.items() if k in vnames})
        if not isinstance(data["compute_s"], list) or len(data["compute_s"]) < 2:
            raise TPError(f"{where} field 'compute_s': need a list of at least 2 samples")
        rounds = len(data["compute_s"])
        for name, v in parsed.items():
            if not len(v.step_s) == len(v.peak_bytes) == len(v.comm_s) == len(v.comm_peak_bytes) == rounds:
                raise TPError(f"{where} field 'variants.{name}': {len(v.step_s)} step times, {len(v.peak_bytes)} "
                              f"peaks and {len(v.comm_s)} communication times for {rounds} rounds")
        fields = {n: data[n] for n in names if n in data}
        fields["variants"] = parsed
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def overlap(self, variant: str) -> list[float]:
        """Per round, the fraction of the shorter of communication and compute that *variant* hid."""
        v = self.variants[variant]
        return [overlap_fraction(c, k, s) for c, k, s in zip(v.comm_s, self.compute_s, v.step_s, strict=True)]


def overlap_fraction(t_comm: float, t_compute: float, t_step: float) -> float:
    """How much of the shorter of communication and compute a step hid, in [0, 1].

    ``(t_comm + t_compute - t_step) / min(t_comm, t_compute)``, clipped: 0 when
    the step took as long as both run back to back, 1 when it took no longer
    than the longer one alone.
    """
    for name, value in (("t_comm", t_comm), ("t_compute", t_compute), ("t_step", t_step)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"overlap_fraction: {name} must be a positive number of seconds, got {value!r}")
    hidden = (t_comm + t_compute - t_step) / min(t_comm, t_compute)
    return min(1.0, max(0.0, hidden))


def peak_change(baseline: float, candidate: float) -> float:
    """Relative change of *candidate*'s peak against *baseline*'s (-0.19 = 19% lower)."""
    if baseline <= 0:
        raise ValueError(f"peak_change: the baseline peak must be positive, got {baseline!r}")
    return candidate / baseline - 1.0


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
    env["PYTHONPATH"] = pythonpath(env)
    return env


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last *lines* lines of *path* (empty when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


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
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started_at = 0.0

    def log_path(self, rank: int) -> Path:
        return self.run_dir / f"rank{rank}.log"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> Launcher:
        """Start every rank (a fresh loopback port unless one was given)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        port = self.port or free_port()
        self.started_at = time.monotonic()
        try:
            for rank in range(self.world_size):
                with open(self.log_path(rank), "wb") as log:
                    self.procs.append(subprocess.Popen(
                        self.command, stdout=log, stderr=subprocess.STDOUT, cwd=self.run_dir,
                        env=rank_env(self.base_env, rank=rank, world_size=self.world_size, port=port,
                                     device=self.device),
                        start_new_session=True,
                    ))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every rank's process group: SIGTERM, a grace period, then SIGKILL; reap them all."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            # The group may hold children of a rank even when the rank itself is gone.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

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
            state = _describe(codes[rank]) if rank in codes else "was still running and was stopped"
            last = tail(self.log_path(rank), 1)
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
                    log_tail = tail(self.log_path(blamed))
                    raise TPError(
                        f"{self.label} rank {blamed} of {self.world_size} {_describe(failed[blamed])} after "
                        f"{self._elapsed():.1f} s; every rank was stopped\n{self._others(blamed, final)}\n"
                        f"--- rank {blamed} log tail ({self.log_path(blamed)}) ---\n{log_tail}",
                        rank=blamed, log_tail=log_tail, run_dir=self.run_dir)
                if all(rc == 0 for rc in codes.values()):
                    return
                if time.monotonic() > deadline:
                    running = [r for r, rc in codes.items() if rc is None]
                    self.stop()
                    tails = "\n".join(f"--- rank {r} log tail ({self.log_path(r)}) ---\n{tail(self.log_path(r))}"
                                      for r in running)
                    raise TPError(
                        f"{self.label} run timed out after {self.timeout_s:g} s with rank(s) "
                        f"{', '.join(map(str, running))} of {self.world_size} still running; every rank was "
                        f"stopped\n{tails}",
                        rank=running[0] if len(running) == 1 else None,
                        log_tail=tail(self.log_path(running[0])), run_dir=self.run_dir)
                time.sleep(POLL_S)
        except BaseException:
            self.stop()
            raise


def worker_command(spec_path: Path, python: str | None = None) -> list[str]:
    """The command line of one rank of :mod:`vramgate.tp.worker`."""
    return [python or sys.executable, "-m", "vramgate.tp.worker", str(spec_path)]


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
                          f"--- rank {rank} log tail ---\n{tail(run_dir / f'rank{rank}.log')}",
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
            if attempt == attempts or "address already in use" not in tail(run_dir / "rank0.log").lower():
                raise
    return read_results(run_dir, spec.world_size)
