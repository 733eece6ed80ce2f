"""Load on a running server with vLLM's own benchmark client, and what the gate reads from it.

:class:`Load` is one ``vllm bench serve`` run (its dataset, request rate, burstiness, concurrency and SLOs);
:func:`run_loads` runs a list of them, in one client process (:mod:`vramgate.engine.load_client`), against one
:class:`~vramgate.engine.server.ApiServer`, while a thread samples the server's memory; :class:`LoadResult` holds
the client's figures (its percentiles, throughput, goodput, failures, and per request: TTFT, TPOT, E2E, start),
read from the result the client's ``main`` returned. :func:`memory_slope` turns
the memory samples into bytes per 1,000 requests over the steady part of a load (Note [memory slope]), and
:func:`device_memory_slope` the device memory samples a server on the GPU tier also gives (Note [device memory
slope]).

Note [memory slope]: a leak keeps memory per request (or per engine step) alive, so the server's resident
memory grows with the requests it has served. The slope is fitted (least squares) to the resident memory of the
server's whole process tree, sampled every :data:`SAMPLE_EVERY_S`, against the number of requests completed at
each sample, over the steady part of the load: after the first :data:`STEADY_AFTER` of its requests (the
allocator's first growth, the first batches' buffers), up to the last completion. It is reported per 1,000
requests, so that it reads the same at any request rate.

Note [device memory slope]: on a GPU the server keeps its tensors in device memory, which its resident memory
does not show: a leak of device memory leaves the resident slope flat. So on the GPU tier the same thread also
reads NVML at each sample (:class:`~vramgate.machine.probes.nvml.TreeDeviceReader`, on the devices the server's
``CUDA_VISIBLE_DEVICES`` shows, as many as its tensor-parallel size): the usage NVML reports for the pids of the
server's process tree, and the devices' whole used memory. The device slope is the same fit (:func:`_fit`), to the
tree's usage where NVML named some of its pids at every sample of the steady part (source
:data:`FROM_PROCESSES`), else to the devices' total (:data:`FROM_DEVICE_TOTAL`): NVML reports host pids, so in a
container with its own pid namespace it names none of the server's, and the devices' total is what is left.
That total counts every other process on the devices too (another server of the session on the same GPU moves
it); the slope's ``source`` says which was fitted, and one slope never mixes the two. On the CPU tier, or where
NVML cannot be read, no device sample is taken and nothing else changes.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.engine.runner import engine_process_env
from vramgate.engine.server import ApiServer, ServerError
from vramgate.machine.probes.nvml import TreeDeviceReader
from vramgate.runtime import process
from vramgate.runtime.engine_env import engine_python
from vramgate.runtime.exits import describe_exit

#: Seconds between two samples of a server's memory during a load.
SAMPLE_EVERY_S = 0.2
#: The share of a load's requests before its steady part (Note [memory slope]).
STEADY_AFTER = 0.25
#: What a :class:`Slope` was fitted to: the server's resident memory (Note [memory slope]), NVML's usage of the
#: server's processes, or the devices' whole used memory (Note [device memory slope]).
FROM_RSS = "rss"
FROM_PROCESSES = "processes"
FROM_DEVICE_TOTAL = "device total"
#: The per-request latencies a result keeps, and the client's names for them.
LATENCIES = ("ttft", "tpot", "itl", "e2el")
#: The percentiles the client reports (``--metric-percentiles``).
PERCENTILES = (50, 90, 99)


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
    seed: int = 0
    trace: str | None = None
    """A ``timed_trace`` JSONL file (see :func:`write_timed_trace`): the requests' lengths (and arrival times) from
    a workload instead of the ``random`` dataset."""
    self_timed: bool = False
    """With a trace: send at the trace's own arrival times, not at :attr:`request_rate`."""
    goodput: dict[str, float] = field(default_factory=dict)
    """SLOs in milliseconds by the client's names (``ttft``, ``tpot``, ``e2el``): goodput counts the requests
    that meet all of them."""

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
                 str(load.output_len), "--random-range-ratio", "0"]
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
    errors: list[str]
    t_start: float
    t_end: float

    @property
    def completions_s(self) -> list[float]:
        """When each successful request ended (monotonic clock), in order."""
        return sorted(s + e for s, e in zip(self.start_s, self.e2el_s, strict=True))

    def median(self, latency: str) -> float:
        """The client's median *latency* (``ttft``, ``tpot``, ``itl``, ``e2el``) in s."""
        return self.percentiles[latency][50]

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
                percentiles=pct, ttft_s=ttfts, tpot_s=tpot, e2el_s=e2el, start_s=starts, errors=errors,
                t_start=float(data["vramgate_t_start"]), t_end=float(data["vramgate_t_end"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ServerError(f"{where}: not a result of vLLM's benchmark client ({exc!r})") from None


@dataclass(frozen=True)
class MemorySample:
    """The server's resident memory (its whole process tree) at a moment of the monotonic clock."""

    t: float
    rss_bytes: int


@dataclass(frozen=True)
class DeviceMemorySample:
    """The server's device memory at a moment of the monotonic clock (Note [device memory slope])."""

    t: float
    tree_bytes: int | None
    """NVML's usage of the server's process tree on its devices; None when NVML named none of its pids."""
    device_bytes: int
    """The whole used memory of the server's devices."""


@dataclass(frozen=True)
class Slope:
    """A fitted memory slope (Note [memory slope])."""

    bytes_per_1k_requests: float
    samples: int
    requests: int
    """Requests completed over the steady part."""
    start_bytes: int
    end_bytes: int
    source: str = FROM_RSS
    """What was fitted: :data:`FROM_RSS`, :data:`FROM_PROCESSES` or :data:`FROM_DEVICE_TOTAL`."""


def memory_slope(samples: Sequence[MemorySample], completions_s: Sequence[float],
                 steady_after: float = STEADY_AFTER) -> Slope:
    """The least-squares slope of resident memory against requests completed, per 1,000 requests, over the
    steady part of a load (Note [memory slope]); ValueError when that part is too short to fit."""
    return _fit([(s.t, s.rss_bytes) for s in samples], completions_s, steady_after, FROM_RSS)


def device_memory_slope(samples: Sequence[DeviceMemorySample], completions_s: Sequence[float],
                        steady_after: float = STEADY_AFTER) -> Slope:
    """The slope of the server's device memory, fitted as :func:`memory_slope`'s: to its processes' usage where
    NVML named them at every sample of the steady part, else to its devices' whole used memory; the slope's
    ``source`` says which (Note [device memory slope]). ValueError as :func:`memory_slope`'s."""
    first, last = _steady_span(sorted(completions_s), steady_after)
    steady = [s for s in samples if first <= s.t <= last]
    if steady and all(s.tree_bytes is not None for s in steady):
        own = [(s.t, s.tree_bytes) for s in samples if s.tree_bytes is not None]
        return _fit(own, completions_s, steady_after, FROM_PROCESSES)
    return _fit([(s.t, s.device_bytes) for s in samples], completions_s, steady_after, FROM_DEVICE_TOTAL)


def _steady_span(done: Sequence[float], steady_after: float) -> tuple[float, float]:
    """The steady part of a load whose requests completed at *done* (sorted), as its first and last moment
    (Note [memory slope]); ValueError when too few requests completed."""
    if len(done) < 8:
        raise ValueError(f"a memory slope needs at least 8 completed requests, got {len(done)}")
    return done[int(len(done) * steady_after)], done[-1]


def _fit(samples: Sequence[tuple[float, int]], completions_s: Sequence[float], steady_after: float,
         source: str) -> Slope:
    """The least-squares slope of the bytes of *samples* (moment, bytes) against requests completed, per 1,000
    requests, over the steady part of a load (Note [memory slope])."""
    done = sorted(completions_s)
    first, last = _steady_span(done, steady_after)
    steady = [s for s in samples if first <= s[0] <= last]
    if len(steady) < 5:
        raise ValueError(f"a memory slope needs at least 5 memory samples in the steady part of the load, got "
                         f"{len(steady)} (sampled every {SAMPLE_EVERY_S:g} s): the load is too short")
    import bisect

    xs = [float(bisect.bisect_right(done, t)) for t, _ in steady]
    ys = [float(b) for _, b in steady]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("no request completed during the steady part of the load: no slope to fit")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return Slope(slope * 1000.0, len(steady), int(xs[-1] - xs[0]), steady[0][1], steady[-1][1], source)


class _Sampler:
    """A thread sampling servers' memory every :data:`SAMPLE_EVERY_S` until stopped: resident memory, and on the
    GPU tier device memory too (Note [device memory slope])."""

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
    """Each server's device memory samples (Note [device memory slope]); empty lists on the CPU tier."""


#: Seconds the client gets per request of a plan, on top of a fixed allowance (its import, its warm-up).
CLIENT_S_PER_REQUEST = 5.0
CLIENT_BASE_S = 300.0


def run_plan(items: list[tuple[int, Load, str]], servers: Sequence[ApiServer], run_dir: Path) -> LoadRun:
    """Run *items* (server index, load, label) in one client process, sampling every server's memory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("load-*.json"):
        stale.unlink()
    paths = [run_dir / f"load-{n:03d}.json" for n in range(len(items))]
    plan = [{"argv": client_argv(load, servers[i], label=label), "result": str(path)}
            for (i, load, label), path in zip(items, paths, strict=True)]
    plan_path = run_dir / "plan.json"
    plan_path.write_text(json.dumps({"loads": plan}, indent=1), encoding="utf-8")
    log_path = run_dir / "client.log"
    env = engine_process_env(servers[0].spec, run_dir)
    cmd = [servers[0].spec.python or engine_python(), "-m", "vramgate.engine.load_client",
           str(plan_path)]
    timeout = CLIENT_BASE_S + CLIENT_S_PER_REQUEST * sum(load.num_prompts for _, load, _ in items)
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
                time.sleep(0.2)
        finally:
            process.kill_group(proc, grace_s=1.0)
    if proc.returncode != 0:
        for server in servers:
            server.check_alive(f"the load (client log: {log_path})")
        raise ServerError(f"vLLM's benchmark client {describe_exit(proc.returncode or 0)}",
                          process.tail(log_path), run_dir)
    results: list[list[LoadResult]] = [[] for _ in servers]
    for (i, load, _), path in zip(items, paths, strict=True):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ServerError(f"vLLM's benchmark client left no readable result {path.name} ({exc})",
                              process.tail(log_path), run_dir) from None
        result = LoadResult.from_client(load, data, str(path))
        if result.failed or result.errors:
            first = result.errors[0] if result.errors else "(no error text)"
            raise ServerError(f"{result.failed} of {load.num_prompts} requests failed on {servers[i].describe()} "
                              f"({load.describe()}); first error: {first}", servers[i].tail(), servers[i].run_dir)
        results[i].append(result)
    return LoadRun(results, sampler.samples, sampler.device)


def run_loads(server: ApiServer, loads: Sequence[Load], run_dir: Path) -> LoadRun:
    """Run *loads* one after the other against *server*, in one client process; any failed request fails it
    (:class:`ServerError` with the server's log tail), as does the server exiting during the load."""
    return run_plan([(0, load, f"load-{n}") for n, load in enumerate(loads)], [server], run_dir)
