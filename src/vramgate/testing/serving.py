"""vLLM's OpenAI-compatible servers for the serving suite: one per engine configuration and session, reused by
every load that differs only in traffic, replaced when one dies.

:class:`Servers` (the ``servers`` fixture) starts a :class:`~vramgate.engine.server.ApiServer` the first time a
test asks for a spec (its profile applied, ``--gate-profile`` as for engine runs) and hands the same one to every
later test of the session (of the pytest-xdist worker) that asks for it. A server that failed to start fails
every test that asks for it with the same error, without starting again; a server that dies while a test uses
it fails that test and is dropped, so the next test gets a fresh one. All are stopped when the session ends, and
a session that is killed outright leaves none (Note [no child outlives its gate] in
:mod:`vramgate.runtime.process`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from vramgate.engine import EngineSpec, UnsupportedHere, with_session_profile
from vramgate.engine.leak import WarmUp, device_memory_slope, memory_slope, paired_slope
from vramgate.engine.load import ONE_PIECE, Load, LoadRun, run_loads, run_plan
from vramgate.engine.paired_load import PairedBursts, paired_settings, run_paired_bursts
from vramgate.engine.server import ApiServer, ServerError
from vramgate.matrix import Entry, ServingLoad
from vramgate.runtime import process, quiet

__all__ = [
    "ONE_PIECE",
    "LoadRun",
    "Servers",
    "ServingLoad",
    "WarmUp",
    "device_memory_slope",
    "memory_slope",
    "paired_burst",
    "paired_settings",
    "paired_slope",
    "rate_load",
    "sustained_loads",
    "workload_trace",
]

#: The workload fields every server's spec gets (see :meth:`Servers.get`).
_ANY = EngineSpec(model="any")


class Servers:
    """The session's servers, by engine spec (see the module's docstring)."""

    def __init__(self, root: Path, base_dir: Path, *, cache_root: Path | None = None,
                 profile: str | None = None, exclusive: bool | None = None) -> None:
        self.root, self.base_dir, self.cache_root, self.profile = root, base_dir, cache_root, profile
        self._exclusive = exclusive
        self._up: dict[str, ApiServer] = {}
        self._failed: dict[str, ServerError] = {}
        self._started = 0
        self._this_test: set[str] = set()
        """The keys of the servers handed to the running test (Note [servers hold the device])."""

    @property
    def exclusive(self) -> bool:
        """Whether the servers hold a device, so that only the running test's stay up (Note [servers hold the
        device]): given, or the engine tier's (``gpu``)."""
        if self._exclusive is None:
            from vramgate.engine import engine_tier

            self._exclusive = engine_tier() == "gpu"
        return self._exclusive

    def up(self) -> list[ApiServer]:
        """The servers up now."""
        return list(self._up.values())

    def after_test(self, next_uses_servers: bool) -> None:
        """The running test is done: on a device, stop every server unless the next test asks for servers too
        (Note [servers hold the device])."""
        self._this_test.clear()
        if self.exclusive and not next_uses_servers:
            self.close()

    def _stop_idle(self) -> None:
        """Stop the servers the running test was not handed (Note [servers hold the device])."""
        for key in [k for k in self._up if k not in self._this_test]:
            self._stop(self._up.pop(key))

    def get(self, spec: EngineSpec) -> ApiServer:
        """The session's server for *spec*, started now if it is not up; fails the test (with the reason and
        the server's log tail) when it cannot start, skips it when this machine's kernels cannot run *spec*."""
        spec = with_session_profile(spec, self.profile)
        # A server serves whatever traffic it is sent: a spec's workload is not the server's (entries that differ
        # in their workload only share one).
        spec = spec.replace(workload=_ANY.workload, requests=_ANY.requests, seed=_ANY.seed, workload_params={},
                            arrival_rate=None)
        key = spec.key()
        if key in self._failed:
            pytest.fail(f"(the same server failed to start earlier in this session)\n{self._failed[key]}",
                        pytrace=False)
        server = self._up.pop(key, None)
        if server is not None and server.proc is not None and server.proc.poll() is None:
            self._up[key] = server
            self._this_test.add(key)
            return server
        if server is not None:  # it died since the last test: a fresh one
            self._stop(server)
        if self.exclusive:
            self._stop_idle()
        self._started += 1
        try:
            server = ApiServer(spec, self.root, self.base_dir / f"{spec.model}-{key}-{self._started}",
                               cache_root=self.cache_root)
            server.start()
        except UnsupportedHere as exc:
            pytest.skip(f"not on this machine: {exc}")
        except ServerError as exc:
            self._failed[key] = exc
            pytest.fail(str(exc), pytrace=False)
        assert server.proc is not None
        process.keep_for_session(server.proc)  # reused by later tests: not a child this test left behind
        self._up[key] = server
        self._this_test.add(key)
        return server

    def _drop_dead(self) -> None:
        """Stop and forget every server that exited or no longer answers ``/health`` (after a failed load)."""
        for key, server in list(self._up.items()):
            if server.proc is None or server.proc.poll() is not None or not server.healthy(timeout_s=10.0):
                self._stop(server)
                del self._up[key]

    @staticmethod
    def _stop(server: ApiServer) -> None:
        if server.proc is not None:
            process.release(server.proc)
        server.stop()

    def loads(self, server: ApiServer, loads: Sequence[Load], run_dir: Path, *,
              warmup: WarmUp | None = None) -> LoadRun:
        """:func:`~vramgate.engine.load.run_loads` on *server* (after a warm-up until its memory settles, with
        *warmup*); a failure fails the test with the reason and the log tails (a server that died is replaced for
        the next test)."""
        try:
            return run_loads(server, loads, run_dir, warmup=warmup)
        except ServerError as exc:
            self._drop_dead()
            pytest.fail(str(exc), pytrace=False)

    def plan(self, items: list[tuple[int, Load, str]], servers: Sequence[ApiServer], run_dir: Path, *,
             warmup: WarmUp | None = None) -> LoadRun:
        """:func:`~vramgate.engine.load.run_plan` on *servers* (each warmed up until its memory settles, in turn,
        with *warmup*); failures as :meth:`loads`."""
        try:
            return run_plan(items, servers, run_dir, warmup=warmup)
        except ServerError as exc:
            self._drop_dead()
            pytest.fail(str(exc), pytrace=False)

    def paired(self, reference: ApiServer, candidate: ApiServer, burst: Load, rounds: int, run_dir: Path, *,
               seed: int = 0, quiet_section: bool = False) -> PairedBursts:
        """:func:`~vramgate.engine.paired_load.run_paired_bursts` on two servers; failures as :meth:`loads`.
        *quiet_section*: the bursts run with the session's other workers waiting (a second look: Note [second
        look] in :mod:`vramgate.engine.paired`)."""
        try:
            with quiet.quiet() if quiet_section else contextlib.nullcontext():
                return run_paired_bursts(reference, candidate, burst, rounds, run_dir, seed=seed)
        except ServerError as exc:
            self._drop_dead()
            pytest.fail(str(exc), pytrace=False)

    def close(self) -> None:
        """Stop every server of the session."""
        for server in self._up.values():
            self._stop(server)
        self._up.clear()


def rate_load(load: ServingLoad, request_rate: float, trace: Path | None = None) -> Load:
    """The client's load for one of the entry's request rates; with *trace* (:func:`workload_trace`), the
    workload's requests at that rate instead of the client's random prompts."""
    prompts = load.num_prompts  # a saved trace may hold fewer requests than asked for: all of them are sent
    if trace is not None:
        prompts = sum(1 for line in trace.read_text(encoding="utf-8").splitlines() if line.strip())
    return Load(num_prompts=prompts, request_rate=request_rate, burstiness=load.burstiness,
                max_concurrency=load.max_concurrency, input_len=load.input_len, output_len=load.output_len,
                goodput={name: seconds * 1e3 for name, seconds in load.slo},
                trace=None if trace is None else str(trace))


def workload_trace(entry: Entry, root: Path, folder: Path) -> Path | None:
    """The entry's workload (a built-in generator or a saved trace, ``workload = ...`` in the matrix) as the
    client's ``timed_trace`` file in *folder*: its requests' lengths and shared prefixes (:attr:`num_prompts` of
    them, at most the serving configuration's ``max_model_len`` each); None for an entry without one."""
    from vramgate.engine.load import write_timed_trace
    from vramgate.workloads import WorkloadError, build

    wl = entry.workload
    if wl is None or entry.load is None:
        return None
    max_len = entry.serving.max_model_len if entry.serving else 2048
    try:
        built = build(wl.engine_name, requests=entry.load.num_prompts, seed=wl.seed or 0, max_model_len=max_len,
                      root=root, **wl.params)
    except WorkloadError as exc:
        pytest.fail(f"matrix entries[{entry.index}].workload: {exc}", pytrace=False)
    folder.mkdir(parents=True, exist_ok=True)
    return write_timed_trace([(r.arrival_s, r.prompt_len, r.output_len) for r in built.requests],
                             folder / f"{wl.name}.jsonl", prefix_lens=[r.prefix_len for r in built.requests])


def sustained_loads(load: ServingLoad, *, soak: bool = False) -> tuple[WarmUp, Load]:
    """The warm-up (until the server's memory settles: Note [settled warm-up] in :mod:`vramgate.engine.leak`) and
    the sustained load whose memory slope is gated (*soak*: the nightly soak's, ``soak_requests`` long): at the
    entry's sustained concurrency, all requests queued at once, so that the server runs the same batch shapes from
    the first request to the last (an open-loop rate past the server's capacity would grow its queue, and its
    memory with it)."""
    base = Load(num_prompts=load.soak_requests if soak else load.sustained_requests, request_rate=math.inf,
                max_concurrency=load.sustained_concurrency, input_len=load.input_len, output_len=load.output_len,
                seed=3 if soak else 1)
    return WarmUp(chunk=max(5 * load.sustained_concurrency, 8)), base


def paired_burst(load: ServingLoad) -> Load:
    """The burst each server of a paired A/B serves per round (Note [paired bursts] in
    :mod:`vramgate.engine.paired_load`)."""
    return Load(num_prompts=load.paired_requests, request_rate=math.inf, max_concurrency=load.paired_concurrency,
                input_len=load.input_len, output_len=load.output_len, seed=100)
