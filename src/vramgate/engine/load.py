"""Load on a running server with vLLM's own benchmark client, and what the gate reads from it.

:class:`Load` is one ``vllm bench serve`` run (its dataset, request rate, burstiness, concurrency and SLOs);
:func:`run_loads` runs a list of them, in one client process (:mod:`vramgate.engine.load_client`), against one
:class:`~vramgate.engine.server.ApiServer`, while a thread samples the server's memory; :class:`LoadResult` holds
the client's figures (its percentiles, throughput, goodput, failures, and per request: TTFT, TPOT, E2E, start),
read from the result the client's ``main`` returned. A load may begin with a warm-up that runs until the
server's memory has settled (:class:`~vramgate.engine.leak.WarmUp`, Note [settled warm-up] in
:mod:`vramgate.engine.leak`, which also fits the memory samples). Longer than 400 lines: a load's whole path (its
command line, the client's result, the memory sampled beside it and the warm-up that steers it) reads in one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.engine.leak import DeviceMemorySample, MemorySample, WarmUp, chunk_level
from vramgate.engine.runner import engine_process_env
from vramgate.engine.server import ApiServer, ServerError
from vramgate.machine.probes.nvml import TreeDeviceReader
from vramgate.runtime import process
from vramgate.runtime.engine_env import engine_python
from vramgate.runtime.exits import describe_exit

#: Seconds between two samples of a server's memory during a load.
SAMPLE_EVERY_S = 0.2
#: The per-request latencies a result keeps, and the client's names for them.
LATENCIES = ("ttft", "tpot", "itl", "e2el")
#: The percentiles the client reports (``--metric-percentiles``).
PERCENTILES = (50, 90, 99)
#: A request whose first token reached the client after this share of its whole latency came in one piece (Note
#: [streams in one piece]).
ONE_PIECE = 0.9


@dataclass(frozen=True)
class Load:
    """One run of ``vllm bench serve``: which requests, at which rate, judged against which SLOs."""

    num_prompts: int = 40
    request_rate: float = math.inf
    """Requests per second (Poisson arrivals at burstiness 1); ``inf``: all at once."""
    burstiness: float = 1.0
    """The client's gamma shape: 1 is Poisson, lower is burstier."""
    max_concurrency: int | None = None
    input_len: int = 64
    output_len: int = 32
    input_spread: float = 0.0
    """The ``random`` dataset's range ratio: input lengths drawn from ``input_len`` x (1 -/+ this); 0: all equal."""
    seed: int = 0
    trace: str | None = None
    """A ``timed_trace`` JSONL file (see :func:`write_timed_trace`): the requests' lengths (and arrival times) from
    a workload instead of the ``random`` dataset."""
    self_timed: bool = False
    """With a trace: send at the trace's own arrival times, not at :attr:`request_rate`."""
    goodput: dict[str, float] = field(default_factory=dict)
    """SLOs in milliseconds by the client's names (``ttft``, ``tpot``, ``e2el``): goodput counts the requests
    that meet all of them."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.input_spread < 1.0:  # vLLM's client refuses a range ratio outside [0, 1)
            raise ValueError(f"a load's input_spread is in [0, 1), got {self.input_spread}")

    def describe(self) -> str:
        """One line: the load."""
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s"
        what = f"trace {Path(self.trace).name}" if self.trace else f"{self.input_len}+{self.output_len} tokens"
        extra = f", burstiness {self.burstiness:g}" if self.burstiness != 1.0 else ""
        if self.max_concurrency:
            extra += f", at most {self.max_concurrency} at once"
        return f"{self.num_prompts} requests of {what}, {rate}{extra}"


def client_argv(load: Load, server: ApiServer, *, label: str) -> list[str]:
    """The ``vllm bench serve`` command line of *load* against *server* (its tokenizer, its model name)."""
    argv = ["--backend", "openai", "--host", "127.0.0.1", "--port", str(server.port), "--endpoint", "/v1/completions",
            "--model", server.served_name, "--tokenizer", str(server.model_dir), "--num-prompts", str(load.num_prompts),
            "--request-rate", str(load.request_rate), "--burstiness", str(load.burstiness), "--seed", str(load.seed),
            "--percentile-metrics", ",".join(LATENCIES), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--ignore-eos", "--disable-tqdm", "--save-detailed", "--label", label, "--temperature", "0"]
    if load.trace:
        argv += ["--dataset-name", "timed_trace", "--dataset-path", load.trace,
                 "--self-timed" if load.self_timed else "--no-self-timed"]
    else:
        argv += ["--dataset-name", "random", "--random-input-len", str(load.input_len), "--random-output-len",
                 str(load.output_len), "--random-range-ratio", f"{load.input_spread:g}"]
    if load.max_concurrency:
        argv += ["--max-concurrency", str(load.max_concurrency)]
    if load.goodput:
        argv += ["--goodput", *(f"{k}:{v:g}" for k, v in sorted(load.goodput.items()))]
    return argv


def write_timed_trace(requests: Sequence[tuple[float, int, int]], path: Path, chunk: int = 16,
                      prefix_lens: Sequence[int] = ()) -> Path:
    """A ``timed_trace`` file of the client for *requests* (arrival in seconds, input tokens, output tokens). The
    client builds each prompt from hash ids, a chunk of *chunk* tokens each: a request's first ``prefix_len``
    tokens (*prefix_lens*, by request; none by default) are chunks every request with a prefix shares (a common
    system prompt, which vLLM's prefix cache then holds once), the rest its own."""
    lines = []
    next_hash = 1 << 20  # above the shared prefix's ids
    for n, (arrival, input_len, output_len) in enumerate(requests):
        shared = min(int(prefix_lens[n]) if n < len(prefix_lens) else 0, int(input_len)) // chunk
        own = max(1, -(-(int(input_len) - shared * chunk) // chunk))
        ids = [*range(shared), *range(next_hash, next_hash + own)]
        next_hash += own
        lines.append(json.dumps({"timestamp": float(arrival), "input_length": int(input_len),
                                 "output_length": int(output_len), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@dataclass
class LoadResult:
    """What the client measured in one load (times in seconds)."""

    load: Load
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float | None
    """The share of requests that met every SLO of the load (None without SLOs)."""
    percentiles: dict[str, dict[int, float]]
    """The client's percentiles by latency (``ttft``, ``tpot``, ``itl``, ``e2el``) and percentile, in s."""
    ttft_s: list[float]
    tpot_s: list[float]
    e2el_s: list[float]
    start_s: list[float]
    """Each successful request's start, on the monotonic clock the gate's memory samples use."""
    output_lens: list[int]
    """Each successful request's output tokens."""
    errors: list[str]
    t_start: float
    t_end: float

    @property
    def completions_s(self) -> list[float]:
        """When each successful request ended (monotonic clock), in order."""
        return sorted(s + e for s, e in zip(self.start_s, self.e2el_s, strict=True))

    @property
    def completions(self) -> list[tuple[float, int]]:
        """When each successful request ended (monotonic clock) and its output tokens, in order."""
        return sorted((s + e, n) for s, e, n in zip(self.start_s, self.e2el_s, self.output_lens, strict=True))

    def median(self, latency: str) -> float:
        """The client's median *latency* (``ttft``, ``tpot``, ``itl``, ``e2el``) in s."""
        return self.percentiles[latency][50]

    def streamed_tpot(self) -> list[float]:
        """The TPOT of each successful request of more than one output token that did not reach the client in one
        piece (Note [streams in one piece]): the ones whose TPOT times the server."""
        return [(e - t) / (n - 1) for t, e, n in zip(self.ttft_s, self.e2el_s, self.output_lens, strict=True)
                if n > 1 and t < ONE_PIECE * e]

    def in_one_piece(self) -> int:
        """How many of the successful requests of more than one output token reached the client in one piece: their
        first token after :data:`ONE_PIECE` of their whole latency.

        Note [streams in one piece]: vLLM's benchmark client stamps each SSE message as it reads it. On 2 cores the
        client's reads can fall behind a stream (likely, not measured: vLLM's CPU worker and its engine core spin on
        their shared-memory queue between steps, as ``shm_broadcast``'s readers busy-loop for a second after each
        read): it then reads a request's tokens together, its TTFT becomes nearly its whole latency and its TPOT a
        few microseconds. Such figures time the client, not the server; the end-to-end latency still times the
        request. What a nightly run measured at two request rates: docs/online-serving.md, "Streams in one piece"."""
        return sum(1 for n in self.output_lens if n > 1) - len(self.streamed_tpot())

    @classmethod
    def from_client(cls, load: Load, data: dict[str, Any], where: str) -> LoadResult:
        """The result the client's ``main`` returned (*where*: its file); :class:`ServerError` when it is an error
        or not such a result."""
        if "error" in data:
            raise ServerError(f"{where}: vLLM's benchmark client failed: {data['error']}")
        try:
            pct = {lat: {p: float(data[f"p{p}_{lat}_ms"]) / 1e3 for p in PERCENTILES} for lat in LATENCIES}
            errors = [str(e) for e in data.get("errors", []) if e]
            ok = [i for i, e in enumerate(data["errors"]) if not e] if "errors" in data else []
            ttfts = [float(data["ttfts"][i]) for i in ok]
            e2el = [float(data["latencies"][i]) for i in ok]
            starts = [float(data["start_times"][i]) for i in ok]
            outs = [int(data["output_lens"][i]) for i in ok]
            tpot = [(e - t) / (n - 1) for t, e, n in zip(ttfts, e2el, outs, strict=True) if n > 1]
            throughput = float(data["request_throughput"])
            goodput = data.get("request_goodput")
            return cls(
                load=load, completed=int(data["completed"]), failed=int(data["failed"]),
                duration_s=float(data["duration"]), request_throughput=throughput,
                output_throughput=float(data["output_throughput"]),
                goodput=None if goodput is None or not throughput else min(1.0, float(goodput) / throughput),
                percentiles=pct, ttft_s=ttfts, tpot_s=tpot, e2el_s=e2el, start_s=starts, output_lens=outs,
                errors=errors,
                t_start=float(data["vramgate_t_start"]), t_end=float(data["vramgate_t_end"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ServerError(f"{where}: not a result of vLLM's benchmark client ({exc!r})") from None


class _Sampler:
    """A thread sampling servers' memory every :data:`SAMPLE_EVERY_S` until stopped: resident memory, and on the
    GPU tier device memory too (Note [device memory slope] in :mod:`vramgate.engine.leak`)."""

    def __init__(self, servers: Sequence[ApiServer]) -> None:
        self.servers = list(servers)
        self.samples: list[list[MemorySample]] = [[] for _ in self.servers]
        self.device: list[list[DeviceMemorySample]] = [[] for _ in self.servers]
        self._readers: list[TreeDeviceReader | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramgate-server-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, server in enumerate(self.servers):
                rss = server.rss_bytes()
                if rss:
                    self.samples[i].append(MemorySample(time.perf_counter(), rss))
                    reader = self._readers[i]
                    used = reader.read(server.tree_pids()) if reader is not None else None
                    if used is not None:
                        self.device[i].append(DeviceMemorySample(time.perf_counter(), used.tree_bytes,
                                                                 used.device_bytes))
            self._stop.wait(SAMPLE_EVERY_S)

    def __enter__(self) -> _Sampler:
        self._readers = [server.device_reader() for server in self.servers]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for reader in self._readers:
            if reader is not None:
                reader.close()


@dataclass
class LoadRun:
    """The results of a plan's loads, by server, and each server's memory samples over the whole plan."""

    results: list[list[LoadResult]]
    memory: list[list[MemorySample]]
    device_memory: list[list[DeviceMemorySample]] = field(default_factory=list)
    """Each server's device memory samples (Note [device memory slope] in :mod:`vramgate.engine.leak`); empty lists
    on the CPU tier."""
    warmups: list[list[LoadResult]] = field(default_factory=list)
    """Each server's warm-up chunks that ran (Note [settled warm-up] in :mod:`vramgate.engine.leak`); empty lists
    without a warm-up."""
    warmup_levels: list[list[float]] = field(default_factory=list)
    """Each server's level after each of its warm-up chunks (Note [settled warm-up] in :mod:`vramgate.engine.leak`)."""
    warmup: WarmUp | None = None
    """The warm-up the servers ran, if any."""
    sweeps: list[list[LoadResult]] = field(default_factory=list)
    """Each server's shape sweep before its warm-up chunks (Note [settled warm-up] in :mod:`vramgate.engine.leak`);
    empty lists without one."""

    def warmup_note(self, server: int = 0) -> dict[str, Any]:
        """How *server*'s warm-up went, for a test's conditions: a line, and the requests it took (the shape sweep's
        too)."""
        if self.warmup is None:
            return {"warm_up": "none"}
        sweep = self.sweeps[server] if self.sweeps else []
        line = self.warmup.describe(self.warmup_levels[server], len(self.warmups[server]))
        if sweep:
            line = f"a shape sweep of {sum(r.completed for r in sweep)} requests, then {line}"
        return {"warm_up": line, "warm_up_requests": sum(r.completed for r in [*sweep, *self.warmups[server]])}

    def measured_from(self, server: int = 0) -> float:
        """When *server*'s first load after its warm-up began (monotonic clock)."""
        return self.results[server][0].t_start


#: Seconds the client gets per request of a plan, on top of a fixed allowance (its import, its warm-up).
CLIENT_S_PER_REQUEST = 5.0
CLIENT_BASE_S = 300.0


def _warmup_items(items: list[tuple[int, Load, str]], servers: int, warmup: WarmUp) -> list[tuple[int, Load, str]]:
    """The chunks of *warmup* for each of *servers* (in turn, round by round), shaped as each one's first load."""
    first = {i: load for i, load, _ in reversed(items)}
    return [(i, dataclasses.replace(first[i], num_prompts=warmup.chunk, seed=first[i].seed + 7919 * (k + 1)),
             f"warmup-{k}-{i}") for k in range(warmup.most) for i in range(servers) if i in first]


def _sweep_items(items: list[tuple[int, Load, str]], servers: int, warmup: WarmUp) -> list[tuple[int, Load, str]]:
    """The shape sweep of *warmup* for each of *servers* (Note [settled warm-up] in :mod:`vramgate.engine.leak`):
    requests one at a time, their prompt lengths spread around each one's first load's, two tokens out."""
    first = {i: load for i, load, _ in reversed(items)}
    return [(i, Load(num_prompts=warmup.shapes, max_concurrency=1, input_len=max(first[i].input_len, 8), output_len=2,
                     input_spread=SWEEP_SPREAD, seed=first[i].seed + 104729), f"shapes-{i}")
            for i in range(servers) if i in first]


#: The shape sweep's spread of prompt lengths (the client's range ratio, below 1).
SWEEP_SPREAD = 0.95


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError):
        return None


def run_plan(items: list[tuple[int, Load, str]], servers: Sequence[ApiServer], run_dir: Path, *,
             warmup: WarmUp | None = None) -> LoadRun:
    """Run *items* (server index, load, label) in one client process, sampling every server's memory; with
    *warmup*, each server first warms up until its memory settles (Note [settled warm-up] in
    :mod:`vramgate.engine.leak`), the servers' chunks in turn."""
    if len({id(server) for server in servers}) < len(servers):  # Note [the unpatched reference] in engine.spec
        raise ServerError("a plan's servers must be distinct: one server was given twice, so a paired load would "
                          f"compare it with itself ({', '.join(s.describe() for s in servers)})")
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("load-*.json"), *run_dir.glob("go-*.json")]:
        stale.unlink()
    sweeps = _sweep_items(items, len(servers), warmup) if warmup and warmup.shapes else []
    chunks = _warmup_items(items, len(servers), warmup) if warmup else []
    everything = sweeps + chunks + items
    skip = len(sweeps)  # the warm-up chunks' indices below are counted from the first chunk
    paths = [run_dir / f"load-{n:03d}.json" for n in range(len(everything))]
    conditional = {n for n in range(len(chunks)) if warmup and n >= warmup.least * len(set(i for i, _, _ in items))}
    plan = [{"argv": client_argv(load, servers[i], label=label), "result": str(path),
             **({"wait": str(run_dir / f"go-{n - skip:03d}.json")} if n - skip in conditional else {})}
            for n, ((i, load, label), path) in enumerate(zip(everything, paths, strict=True))]
    plan_path = run_dir / "plan.json"
    plan_path.write_text(json.dumps({"loads": plan}, indent=1), encoding="utf-8")
    log_path = run_dir / "client.log"
    env = engine_process_env(servers[0].spec, run_dir)
    cmd = [servers[0].spec.python or engine_python(), "-m", "vramgate.engine.load_client",
           str(plan_path)]
    timeout = CLIENT_BASE_S + CLIENT_S_PER_REQUEST * sum(load.num_prompts for _, load, _ in everything)
    levels: list[list[float]] = [[] for _ in servers]
    leveled: set[int] = set()
    decided: set[int] = set()
    proc = process.launch(cmd, log_path, env=env, cwd=run_dir)
    t0 = time.monotonic()
    with _Sampler(servers) as sampler:
        try:
            while proc.poll() is None:
                for server in servers:
                    server.check_alive(f"the load (client log: {log_path})")
                if time.monotonic() - t0 > timeout:
                    raise ServerError(f"vLLM's benchmark client ran past {timeout:g} s against "
                                      f"{', '.join(s.describe() for s in servers)}", process.tail(log_path), run_dir)
                if warmup is not None:
                    _steer(warmup, chunks, paths[skip:], conditional, sampler, levels, leveled, decided, run_dir)
                time.sleep(0.2)
            if warmup is not None:  # the last chunks' levels, if the client ended before the loop read them
                _steer(warmup, chunks, paths[skip:], conditional, sampler, levels, leveled, decided, run_dir)
        finally:
            process.kill_group(proc, grace_s=1.0)
    if proc.returncode != 0:
        for server in servers:
            server.check_alive(f"the load (client log: {log_path})")
        raise ServerError(f"vLLM's benchmark client {describe_exit(proc.returncode or 0)}",
                          process.tail(log_path), run_dir)
    results: list[list[LoadResult]] = [[] for _ in servers]
    warmups: list[list[LoadResult]] = [[] for _ in servers]
    swept: list[list[LoadResult]] = [[] for _ in servers]
    for n, ((i, load, _), path) in enumerate(zip(everything, paths, strict=True)):
        data = _read_result(path)
        if data is None:
            raise ServerError(f"vLLM's benchmark client left no readable result {path.name}",
                              process.tail(log_path), run_dir) from None
        if data.get("skipped"):
            continue
        result = LoadResult.from_client(load, data, str(path))
        if result.failed or result.errors:
            first = result.errors[0] if result.errors else "(no error text)"
            raise ServerError(f"{result.failed} of {load.num_prompts} requests failed on {servers[i].describe()} "
                              f"({load.describe()}); first error: {first}", servers[i].tail(), servers[i].run_dir)
        (swept if n < skip else warmups if n < skip + len(chunks) else results)[i].append(result)
    return LoadRun(results, sampler.samples, sampler.device, warmups, levels, warmup, swept)


def _steer(warmup: WarmUp, chunks: list[tuple[int, Load, str]], paths: list[Path], conditional: set[int],
           sampler: _Sampler, levels: list[list[float]], leveled: set[int], decided: set[int], run_dir: Path) -> None:
    """Read the level of each warm-up chunk that has finished, and tell the client whether each next chunk runs
    (Note [settled warm-up] in :mod:`vramgate.engine.leak`)."""
    for n, (i, _, _) in enumerate(chunks):
        if n in leveled:
            continue
        data = _read_result(paths[n])
        if data is None:
            break
        leveled.add(n)
        if not data.get("skipped") and "error" not in data:
            level = chunk_level(sampler.samples[i], float(data["vramgate_t_start"]), float(data["vramgate_t_end"]))
            if level is not None:
                levels[i].append(level)
    for n in sorted(conditional - decided):
        i = chunks[n][0]
        earlier = [m for m in range(n) if chunks[m][0] == i]
        if not all(m in leveled for m in earlier):
            break
        go = run_dir / f"go-{n:03d}.json"
        tmp = go.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run": not warmup.settled(levels[i])}), encoding="utf-8")
        os.replace(tmp, go)
        decided.add(n)


def run_loads(server: ApiServer, loads: Sequence[Load], run_dir: Path, *, warmup: WarmUp | None = None) -> LoadRun:
    """Run *loads* one after the other against *server*, in one client process (after a warm-up that runs until
    its memory settles, with *warmup*); any failed request fails it (:class:`ServerError` with the server's log
    tail), as does the server exiting during the load."""
    return run_plan([(0, load, f"load-{n}") for n, load in enumerate(loads)], [server], run_dir, warmup=warmup)
