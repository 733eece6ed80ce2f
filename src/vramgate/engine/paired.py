"""Paired A/B latency: a reference and a candidate engine, rounds interleaved.

Note [round answers]: on a model that answers a task (a recall model), each round of a paired run records the
tokens it generated (no logprobs: the rounds are timed), and :func:`round_answers` holds every round of both sides
to the reference's first: an engine whose answers change from round to round (a cache, a race, a buffer reused
wrongly) or a candidate that answers otherwise than its reference is a finding of the paired test, whatever its
speed. On dummy weights nothing is recorded, and the test's report says its answers were not judged.

Note [paired latency]: on a shared CPU (and, less so, on a GPU box) the speed of the machine drifts by more than the
regressions worth catching: comparing today's latency with a stored one mixes the two. Two engines that are up at the
same time and take turns on the same workload see the same machine state, so the *ratio* candidate / reference cancels
the drift. :class:`PairedEngines` starts both (each a ``vramgate.engine.worker --serve`` subprocess, see Note [paired
rounds] there), runs ``rounds`` round pairs in a seeded random order within each pair (reference first or candidate
first), and returns per-round statistics of both sides. The gate then records per-round ratios as a measured metric
(see :func:`round_ratios`) whose samples compare with a stored baseline and with a ceiling. ``vramgate calibrate``
measures how precise that is.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.core.metrics import median
from vramgate.core.records import record_fields
from vramgate.engine.runner import EngineError, engine_process_env, preload_folder
from vramgate.engine.spec import EngineSpec, apply_profile, validate
from vramgate.runtime import preload as preloading
from vramgate.runtime import process
from vramgate.runtime.engine_env import engine_python

#: Per-round statistics a round yields (see :func:`round_stat`).
STATISTICS = ("tpot", "ttft", "e2e", "step", "wall")


@dataclass
class Round:
    """One round of one engine: per-request latencies, engine step durations, wall time."""

    ttft_s: list[float]
    tpot_s: list[float]
    e2e_s: list[float]
    steps_s: list[float]
    wall_s: float
    token_ids: list[list[int]] | None = None
    """Per request the tokens the round generated, where the engine's model answers a task (a recall model:
    Note [round answers]); None on dummy weights."""

    @classmethod
    def from_json(cls, data: Any, where: str) -> Round:
        """The round in *data* (a server's ``round-N.json``); :class:`EngineError` naming *where* when it is not one."""
        fields = record_fields(cls, data, where, EngineError, ignore_unknown=True)
        try:
            tokens = fields.get("token_ids")
            return cls(ttft_s=list(fields["ttft_s"]), tpot_s=list(fields["tpot_s"]), e2e_s=list(fields["e2e_s"]),
                       steps_s=list(fields["steps_s"]), wall_s=float(fields["wall_s"]),
                       token_ids=None if tokens is None else [[int(t) for t in r] for r in tokens])
        except (TypeError, ValueError) as exc:
            raise EngineError(f"{where}: malformed round result ({exc!r})") from None


def round_stat(r: Round, stat: str) -> float:
    """The round's median TPOT / TTFT / end-to-end latency / engine step, or its wall time."""
    values = {"tpot": r.tpot_s, "ttft": r.ttft_s, "e2e": r.e2e_s, "step": r.steps_s}
    if stat == "wall":
        return r.wall_s
    if stat not in values:
        raise ValueError(f"unknown round statistic {stat!r}; known: {', '.join(STATISTICS)}")
    if not values[stat]:
        raise ValueError(f"the round has no {stat} samples")
    return median(values[stat])


@dataclass
class PairedResult:
    """Rounds of the reference (``a``) and candidate (``b``) engines, in pairs, with the order each pair ran in."""

    a: list[Round] = field(default_factory=list)
    b: list[Round] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    """``"ab"`` or ``"ba"`` per pair."""
    init_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    """The versions (python, vllm, torch) each side's engine reported, by side (``a``, ``b``)."""

    def stats(self, stat: str) -> tuple[list[float], list[float]]:
        """The per-round *stat* (see :func:`round_stat`) of the reference rounds and of the candidate rounds."""
        return [round_stat(r, stat) for r in self.a], [round_stat(r, stat) for r in self.b]

    def ratios(self, stat: str) -> list[float]:
        """The per-pair ratios candidate / reference of *stat* (the paired metric's samples)."""
        return round_ratios(*self.stats(stat))

    def answers(self) -> RoundAnswers:
        """What the rounds generated, side against side and round against round (Note [round answers])."""
        return round_answers(self.a, self.b)


@dataclass(frozen=True)
class RoundAnswers:
    """The answers of paired rounds (Note [round answers]): whether they were recorded, and the first place where a
    round generated other tokens than the reference's first round."""

    judged: bool
    """Every round of both sides recorded its tokens (a model that answers a task)."""
    rounds: int
    """Rounds compared, both sides together."""
    first_difference: str | None = None
    """Where a round first differs from the reference's first round, in words; None where none does."""
    candidate_differs: bool = False
    """Whether the first difference is the candidate's (every reference round agreeing)."""

    def merge(self, other: RoundAnswers) -> RoundAnswers:
        """Two looks' answers as one (the first difference found first)."""
        return RoundAnswers(self.judged and other.judged, self.rounds + other.rounds,
                            self.first_difference or other.first_difference,
                            self.candidate_differs if self.first_difference else other.candidate_differs)


def round_answers(reference: Sequence[Round], candidate: Sequence[Round]) -> RoundAnswers:
    """Every round of both sides against the reference's first round (Note [round answers])."""
    rounds = [*reference, *candidate]
    if not rounds or any(r.token_ids is None for r in rounds):
        return RoundAnswers(False, len(rounds))
    want = reference[0].token_ids or []
    for side, label in ((reference, "reference"), (candidate, "candidate")):
        for k, r in enumerate(side):
            got = r.token_ids or []
            if got == want:
                continue
            if len(got) != len(want):
                where = f"{len(got)} requests against {len(want)}"
            else:
                i = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
                pos = next((p for p, (x, y) in enumerate(zip(got[i], want[i], strict=False)) if x != y),
                           min(len(got[i]), len(want[i])))
                mine = got[i][pos] if pos < len(got[i]) else "nothing"
                theirs = want[i][pos] if pos < len(want[i]) else "nothing"
                where = f"request {i}, position {pos}: {mine}, the reference's first round {theirs}"
            return RoundAnswers(True, len(rounds), f"{label} round {k}: {where}", label == "candidate")
    return RoundAnswers(True, len(rounds))


def round_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-pair ratios candidate / reference (the paired metric's samples)."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in number: {len(a)} vs {len(b)}")
    if any(x <= 0 for x in a):
        raise ValueError("a reference round has a non-positive time")
    return [y / x for x, y in zip(a, b, strict=True)]


class EngineServer:
    """One ``vramgate.engine.worker --serve`` subprocess: rounds on request, an error with its log tail on failure."""

    def __init__(self, spec: EngineSpec, root: Path, run_dir: Path, *, cache_root: Path | None = None,
                 preload: Path | None = None, start: bool = True) -> None:
        resolved, paths = apply_profile(spec, root, run_dir / "overlay")
        validate(resolved, root)  # with the profile's engine arguments, as EngineCache validates it
        self.spec, self.run_dir = resolved, run_dir
        self.control = run_dir / "control"
        self.versions: dict[str, str] = {}
        """The versions the engine reported when it came up (python, vllm, torch)."""
        self.control.mkdir(parents=True, exist_ok=True)
        for stale in [*self.control.glob("round-*.json"), self.control / "ready.json"]:
            stale.unlink(missing_ok=True)  # an earlier server's answers must not pass for this one's
        spec_path, self.log_path = run_dir / "spec.json", run_dir / "engine.log"
        spec_path.write_text(json.dumps({"spec": resolved.to_json(), "root": str(root)}, indent=2, sort_keys=True))
        self.command = [resolved.python or engine_python(), "-m", "vramgate.engine.worker", "--serve",
                        str(spec_path), str(self.control)]
        self.env = engine_process_env(resolved, run_dir, paths, cache_root)
        self.proc: process.Child | None = None
        if start:
            self.start(preload)

    def start(self, preload: Path | None = None) -> None:
        """Start the server (forked from a preloaded interpreter where *preload*, a folder, allows: Note
        [preloaded engines] in :mod:`vramgate.runtime.preload`)."""
        self.proc = process.launch(self.command, self.log_path, env=self.env, cwd=self.run_dir,
                                   stdin=subprocess.PIPE, preload=preload)

    def _started(self) -> process.Child:
        if self.proc is None:
            raise RuntimeError("the engine server was not started")
        return self.proc

    def _fail(self, why: str) -> EngineError:
        self.close()
        return EngineError(f"engine server for {self.spec.model} ({self.spec.profile or 'unpatched'}) {why}",
                           process.tail(self.log_path), self.run_dir)

    def _wait_for(self, path: Path, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        proc = self._started()
        while not path.exists():
            try:
                rc = proc.poll()
            except preloading.PreloadError as exc:
                raise self._fail(str(exc)) from None
            if rc is not None:
                raise self._fail(f"exited with status {rc} before writing {path.name}")
            if time.monotonic() > deadline:
                raise self._fail(f"wrote no {path.name} within {timeout_s:g} s and was killed")
            time.sleep(0.02)
        try:
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise self._fail(f"wrote an unreadable {path.name} ({exc})") from None
        return data

    def ready(self) -> float:
        """Wait until the engine is up; its start-up time in seconds."""
        ready = self._wait_for(self.control / "ready.json", self.spec.timeout_s)
        self.versions = {str(k): str(v) for k, v in dict(ready.get("versions") or {}).items()}
        return float(ready["init_s"])

    def ask(self, index: int) -> None:
        """Start round *index* (:meth:`collect` waits for it)."""
        proc = self._started()
        assert proc.stdin is not None
        try:
            proc.stdin.write(f"round {index}\n".encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail("closed its input (it died)") from None

    def collect(self, index: int, timeout_s: float) -> Round:
        """Wait for round *index*, started by :meth:`ask`; its latencies."""
        path = self.control / f"round-{index}.json"
        return Round.from_json(self._wait_for(path, timeout_s), str(path))

    def close(self) -> None:
        """Ask the server to quit; kill its process group if it does not within 10 s."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(preloading.PreloadError):
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    proc.stdin.write(b"quit\n")
                    proc.stdin.flush()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        process.kill_group(proc)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()


class PairedEngines:
    """A reference and a candidate engine up together, taking turns on the same workload (Note [paired latency])."""

    def __init__(self, reference: EngineSpec, candidate: EngineSpec, root: Path, run_dir: Path,
                 *, cache_root: Path | None = None) -> None:
        if (reference.workload, reference.requests, reference.seed, reference.workload_params) != (
                candidate.workload, candidate.requests, candidate.seed, candidate.workload_params):
            raise ValueError("paired engines must run the same workload (workload, requests, seed, parameters)")
        self.servers: dict[str, EngineServer] = {}
        try:
            self.servers["a"] = EngineServer(reference, root, run_dir / "reference", cache_root=cache_root,
                                             start=False)
            self.servers["b"] = EngineServer(candidate, root, run_dir / "candidate", cache_root=cache_root,
                                             start=False)
            a, b = self.servers["a"], self.servers["b"]
            # Both sides start the same way (Note [preloaded engines]): forked only when both can be.
            same = preloading.same_imports(a.command, a.env, b.command, b.env)
            folder = preload_folder(run_dir.parent) if same else None
            for server in (a, b):
                server.start(folder)
            self.init_s = {side: s.ready() for side, s in self.servers.items()}
        except BaseException:
            self.close()
            raise
        self.next_index = 0

    def run(self, rounds: int, *, seed: int = 0, warmup: int = 1, round_timeout_s: float = 300.0,
            together: bool = False) -> PairedResult:
        """*warmup* unrecorded round pairs, then *rounds* recorded pairs in a seeded random order within each;
        *together*: both engines run each pair's rounds at the same time.

        Note [rounds together]: on a 2-core CPU, one engine per core, a round pair then takes the time of one
        round, not two, and the pairs' ratios spread about as much. But with both engines stepping at once beside
        the other worker, the candidate's extra CPU time is partly taken from the reference too: a planted delay
        realized far more widely with rounds together than one after the other, whose round pairs also spread
        less. A real CPU-bound regression would be understated the same way, so no tier runs rounds together; the
        way stays for campaigns (``vramgate calibrate paired run --together``). The order within the pair decides
        which engine is asked first either way. The measurements: docs/calibration.md, "Per gate run, on two
        workers (CPU)" (the time) and "Rounds one after the other: the CPU tier's way, and the targets"."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        rng = random.Random(seed)
        result = PairedResult(init_s=dict(self.init_s),
                              versions={side: s.versions for side, s in self.servers.items()})
        for i in range(warmup + rounds):
            order = "ab" if rng.random() < 0.5 else "ba"
            got = {}
            indices = {side: self.next_index + k for k, side in enumerate(order)}
            self.next_index += 2
            for side in order:  # together: every round is asked for before any is collected
                self.servers[side].ask(indices[side])
                if not together:
                    got[side] = self.servers[side].collect(indices[side], round_timeout_s)
            for side in order if together else ():
                got[side] = self.servers[side].collect(indices[side], round_timeout_s)
            if i >= warmup:
                result.a.append(got["a"])
                result.b.append(got["b"])
                result.order.append(order)
        return result

    def close(self) -> None:
        """Close both engine servers (see :meth:`EngineServer.close`)."""
        for server in self.servers.values():
            server.close()

    def __enter__(self) -> PairedEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class PairedDefaults:
    """How a paired latency test runs and judges, per tier (``vramgate calibrate``; docs/calibration.md)."""

    rounds: int
    """Round pairs per test."""
    stat: str
    """The per-round statistic whose ratio is gated (see :func:`round_stat`)."""
    tolerance: float
    """Candidate worse than its reference in the same run by more than this (and a clear signed-rank test of the
    round pairs' ratios: Note [paired comparison] in :mod:`vramgate.core.stats`) fails."""
    alpha: float
    """Level of that test."""
    history_tolerance: float
    """The ratios moving by more than this against the stored baseline fail."""
    together: bool = False
    """Both engines run each pair's rounds at the same time (Note [rounds together])."""
    screen: float | None = None
    """The first look's in-run tolerance: a first look worse than this asks for more looks (Note [three looks] in
    :mod:`vramgate.engine.looks`); ``None``: :attr:`tolerance`."""
    looks: int = 2
    """The most looks a test takes (2, or 3: Note [three looks])."""

    def __post_init__(self) -> None:
        if self.looks not in (2, 3):
            raise ValueError(f"a paired test takes 2 or 3 looks at most, not {self.looks}")
        if self.screen is not None and not 0 < self.screen <= self.tolerance:
            raise ValueError(f"the first look's screen {self.screen} must be above 0 and at most the tolerance "
                             f"{self.tolerance}")


#: Each tier's settings, and the campaign behind each (the figures are the campaigns', not copied here):
#: docs/calibration.md, "Per gate run, on two workers (CPU)" for the tolerance, alpha and history tolerance beside
#: the other xdist worker; "Three looks against two" for the CPU tier's three looks and its 5% screen; "Rounds one
#: after the other" for the CPU tier's way of running a pair's rounds; the GPU tier's from the kernel campaign on an
#: H200 (calibration/nvidia-h200-140gb-x1-kernel.md; engine pairs on a GPU are not measured yet).
PAIRED_DEFAULTS = {
    "cpu": PairedDefaults(rounds=30, stat="step", tolerance=0.075, alpha=0.05, history_tolerance=0.10, screen=0.05,
                          looks=3),
    "gpu": PairedDefaults(rounds=30, stat="step", tolerance=0.05, alpha=0.01, history_tolerance=0.05),
}


def paired_defaults(tier: str) -> PairedDefaults:
    """The paired latency test's settings on the ``cpu`` or ``gpu`` engine tier."""
    if tier not in PAIRED_DEFAULTS:
        raise ValueError(f"unknown engine tier {tier!r}; known: {', '.join(PAIRED_DEFAULTS)}")
    return PAIRED_DEFAULTS[tier]


def latency_spec(model: str) -> EngineSpec:
    """The paired latency runs' spec: 8 requests of 128 + 64 tokens (a round takes about 0.25 s on CPU)."""
    return EngineSpec(model=model, workload="fixed", requests=8, block_size=32, max_model_len=512,
                      kv_budget_gib=0.0625)
