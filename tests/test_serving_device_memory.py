"""The serving suite's device memory slope without a GPU: ``test_serving_memory`` itself, run against a stand-in
server (an HTTP ``/health`` and an "engine core" child: a process tree whose resident memory stays flat) and a
stand-in ``vllm bench serve`` (requests that complete every few milliseconds), with NVML faked.

The fake NVML reports the server's device memory growing by a fixed amount per completed request: per process
(the engine core's pid), or, as in a container with its own pid namespace, only in the device's whole used memory
under a host pid the gate cannot see (Note [device memory slope] in :mod:`vramgate.engine.leak`).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from serving_standin import HEALTH, RESULT, Pool
from vramgate.core.checks import check_budget
from vramgate.engine import EngineSpec, leak, load
from vramgate.engine import server as server_module
from vramgate.engine.leak import DeviceMemorySample, device_memory_slope
from vramgate.engine.load import LoadRun
from vramgate.engine.server import ApiServer
from vramgate.machine.probes.cpu import children
from vramgate.matrix import ServingLoad
from vramgate.matrix.loader import parse_budget
from vramgate.pytest_plugin.fixture import Gate

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
#: What the fake server's device memory grows by per completed request: a device leak far above the ceiling.
LEAK_PER_REQUEST = 4 * MIB
#: A host pid NVML names in a container: none of the gate's processes.
HOST_PID = 4_000_000

SERVER = """
import http.server, json, subprocess, sys
cfg = json.load(open(sys.argv[1]))
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the engine core
""" + HEALTH

CLIENT = """
import json, os, sys, time
""" + RESULT + """
STEP_S = 0.02
plan = json.load(open(sys.argv[1]))
done = 0
for item in plan["loads"]:
    argv = item["argv"]
    n = int(argv[argv.index("--num-prompts") + 1])
    t_start = time.perf_counter()
    starts, latencies = [], []
    for _ in range(n):
        s = time.perf_counter()
        time.sleep(STEP_S)
        starts.append(s)
        latencies.append(time.perf_counter() - s)
        done += 1
        with open(COUNT + ".tmp", "w") as f:
            f.write(str(done))
        os.replace(COUNT + ".tmp", COUNT)
    result = result_of(n, t_start, starts, latencies, 2)
    result.update(vramgate_t_start=t_start, vramgate_t_end=time.perf_counter())
    json.dump(result, open(item["result"], "w"))
"""


@dataclass
class FakeGPU:
    """One device of the fake NVML: its constant used memory and compute processes, plus what grows per request."""

    uuid: str
    used: int
    procs: dict[int, int] = field(default_factory=dict)
    growing_pid: int | None = None
    """The process whose usage grows by :data:`LEAK_PER_REQUEST` per completed request (None: nothing grows)."""


def fake_nvml(gpus: list[FakeGPU], completed: Path) -> Any:
    """A pynvml stand-in: the calls the gate's device lookup and the server's device sampling make."""

    def grown(gpu: FakeGPU) -> int:
        if gpu.growing_pid is None:
            return 0
        try:
            return LEAK_PER_REQUEST * int(completed.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def processes(gpu: FakeGPU) -> list[types.SimpleNamespace]:
        procs = dict(gpu.procs)
        if gpu.growing_pid is not None:
            procs[gpu.growing_pid] = procs.get(gpu.growing_pid, 0) + grown(gpu)
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in procs.items()]

    mod = types.SimpleNamespace(opened=0)

    def init() -> None:
        mod.opened += 1

    def shutdown() -> None:
        mod.opened -= 1

    mod.nvmlInit = init
    mod.nvmlShutdown = shutdown
    mod.nvmlDeviceGetCount = lambda: len(gpus)
    mod.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    mod.nvmlDeviceGetUUID = lambda h: h.uuid
    mod.nvmlDeviceGetMaxMigDeviceCount = lambda h: 0
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=80 << 30, used=h.used + sum(h.procs.values()) + grown(h))
    mod.nvmlDeviceGetComputeRunningProcesses = processes
    return mod


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineSpec:
    """A serving spec whose interpreter runs the stand-in server and client (no vLLM here)."""
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "client.py").write_text(f"COUNT = {str(tmp_path / 'completed')!r}\n" + CLIENT)
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$2" in
          vramgate.engine.api_server) exec {sys.executable} {tmp_path / 'server.py'} "$3" ;;
          vramgate.engine.load_client) exec {sys.executable} {tmp_path / 'client.py'} "$3" ;;
        esac
        exit 2
    """))
    fake.chmod(0o755)
    monkeypatch.setattr(load, "SAMPLE_EVERY_S", 0.04)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the server's device is NVML's 1
    return EngineSpec(model="tiny-llama", block_size=32, kv_budget_gib=None, cpu_memory_bytes=1 << 30,
                      gpu_memory_utilization=0.5, python=str(fake))


@pytest.fixture
def suite() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("suite_serving_device", ROOT / "suites/serving/test_serving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def started(stand_in: EngineSpec, tmp_path: Path) -> Iterator[tuple[ApiServer, int]]:
    """The stand-in server, up, and its engine core's pid."""
    server = ApiServer(stand_in, ROOT, tmp_path / "server", start_timeout_s=30).start()
    try:
        assert server.proc is not None
        kids = children(server.proc.pid)
        assert len(kids) == 1, kids
        yield server, kids[0]
    finally:
        server.stop()


def _memory_test(suite: types.ModuleType, server: ApiServer, tmp_path: Path) -> tuple[Gate, LoadRun]:
    """``test_serving_memory`` on *server*: 200 sustained requests at concurrency 2 (a warm-up of 10 first)."""
    gate = Gate("suites/serving/test_serving.py::test_serving_memory[tiny-llama]", "serving")
    case = types.SimpleNamespace(entry=types.SimpleNamespace(load=ServingLoad(
        request_rates=(4.0,), sustained_requests=200, sustained_concurrency=2)), engine_spec=lambda base: base)
    pool = Pool(server)
    suite.test_serving_memory(gate, pool, "tiny-llama", case, tmp_path / "test")
    (run,) = pool.runs
    return gate, run


def test_a_device_leak_under_flat_rss_fails_the_device_memory_slope(
        suite: types.ModuleType, started: tuple[ApiServer, int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML names the engine core: its own usage grows 4 MiB per request, another process's on the same device
    does not count, and the device the server does not use (NVML's 0, growing too) is not read."""
    server, core = started
    gpus = [FakeGPU("GPU-0000", 1 << 30, {HOST_PID + 1: 5 << 30}, growing_pid=HOST_PID + 1),
            FakeGPU("GPU-1111", 1 << 30, {core: 2 << 30, HOST_PID: 3 << 30}, growing_pid=core)]
    nvml = fake_nvml(gpus, tmp_path / "completed")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(server_module, "engine_tier", lambda: "gpu")
    gate, run = _memory_test(suite, server, tmp_path)
    assert nvml.opened == 0  # the sampler's NVML was shut down with it
    assert check_budget(gate.metrics["memory_slope"]) is None  # the resident memory is flat
    device = gate.metrics["device_memory_slope"]
    assert device.unit == "B/1k requests" and device.ceiling == suite.DEVICE_MEMORY_SLOPE_CEILING
    assert device.value == pytest.approx(LEAK_PER_REQUEST * 1000, rel=0.1)
    problem = check_budget(device)
    assert problem is not None and "above its ceiling" in problem, problem
    assert {"device_memory_slope": "processes"} in gate.conditions
    assert run.device_memory[0] and all(s.tree_bytes is not None for s in run.device_memory[0])


def test_where_nvml_names_none_of_the_servers_pids_the_device_total_is_fitted_and_the_record_says_so(
        suite: types.ModuleType, started: tuple[ApiServer, int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A container with its own pid namespace: NVML reports the engine core under a host pid. The server's device
    (NVML's 1) as a whole grows 4 MiB per request; the other device's growth is not read."""
    server, _ = started
    gpus = [FakeGPU("GPU-0000", 1 << 30, {HOST_PID + 1: 5 << 30}, growing_pid=HOST_PID + 1),
            FakeGPU("GPU-1111", 1 << 30, {HOST_PID: 3 << 30}, growing_pid=HOST_PID)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus, tmp_path / "completed"))
    monkeypatch.setattr(server_module, "engine_tier", lambda: "gpu")
    gate, run = _memory_test(suite, server, tmp_path)
    assert run.device_memory[0] and all(s.tree_bytes is None for s in run.device_memory[0])
    assert all(s.device_bytes >= (4 << 30) for s in run.device_memory[0])  # NVML's 1 only: 1 + 3 GiB and growth
    device = gate.metrics["device_memory_slope"]
    assert device.value == pytest.approx(LEAK_PER_REQUEST * 1000, rel=0.1)
    assert "above its ceiling" in (check_budget(device) or "")
    assert gate.conditions[-1] == {"device_memory_slope": "device total"}


@pytest.mark.parametrize(("tier", "nvml"), [("cpu", True), ("gpu", False)], ids=["cpu-tier", "no-nvml"])
def test_without_device_samples_no_device_slope_is_recorded(
        suite: types.ModuleType, started: tuple[ApiServer, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tier: str, nvml: bool) -> None:
    """The CPU tier reads no NVML, even on a machine with a GPU whose memory grows; nor does a GPU tier whose NVML
    cannot be read. The figures are the resident ones only, as they always were."""
    server, core = started
    gpus = [FakeGPU("GPU-0000", 1 << 30), FakeGPU("GPU-1111", 1 << 30, {core: 1 << 30}, growing_pid=core)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus, tmp_path / "completed") if nvml else None)
    monkeypatch.setattr(server_module, "engine_tier", lambda: tier)
    gate, run = _memory_test(suite, server, tmp_path)
    assert run.device_memory == [[]] and [set(c) for c in gate.conditions] == [{"warm_up", "warm_up_requests"}]
    assert set(gate.metrics) == {"memory_slope", "memory_slope_per_token", "server_rss_bytes"}
    assert gate.metrics["memory_slope"].value == round(
        leak.memory_slope(run.memory[0], run.results[0][-1].completions, run.measured_from(0)).per_1k)


def _device(points: list[tuple[float, int | None, int]]) -> list[DeviceMemorySample]:
    return [DeviceMemorySample(t, tree, total) for t, tree, total in points]


def test_the_device_slope_is_the_resident_slopes_fit_and_never_mixes_its_sources() -> None:
    done = [(float(t) + 0.5, 32) for t in range(100)]
    figures = [3e9 + (t ** 0.5 * 1e8 if t < 10 else 0) + 1e6 * t for t in range(100)]
    rss = leak.memory_slope([leak.MemorySample(float(t), int(b)) for t, b in enumerate(figures)], done, 10.0)
    own = device_memory_slope(_device([(float(t), int(b), 9 << 30) for t, b in enumerate(figures)]), done, 10.0)
    assert own.source == leak.FROM_PROCESSES and rss.source == leak.FROM_RSS
    assert (own.per_1k, own.samples, own.requests, own.start_bytes, own.end_bytes) == \
        (rss.per_1k, rss.samples, rss.requests, rss.start_bytes, rss.end_bytes)
    # one measured sample without the server's pids: the whole slope is the devices' total's
    mixed = device_memory_slope(_device([(float(t), None if t == 60 else int(b), (8 << 30) + 2_000_000 * t)
                                         for t, b in enumerate(figures)]), done, 10.0)
    assert mixed.source == leak.FROM_DEVICE_TOTAL and mixed.per_1k == pytest.approx(2e9, rel=1e-6)
    # before the measured part it does not matter
    early = device_memory_slope(_device([(float(t), None if t < 10 else int(b), 8 << 30)
                                         for t, b in enumerate(figures)]), done, 10.0)
    assert early.source == leak.FROM_PROCESSES and early.per_1k == pytest.approx(1e9, rel=1e-6)
    with pytest.raises(ValueError, match="at least 8 completed requests"):
        device_memory_slope(_device([(0.0, 1, 1)]), done[:5], 0.0)


@pytest.mark.parametrize("text", ["<= 64 MiB", "<= 64 MiB per 1000 requests"])
def test_an_entrys_budget_on_the_device_slope_is_bytes_per_thousand_requests(text: str) -> None:
    budget = parse_budget("vramgate.toml", "entries[0].budgets", "device_memory_slope", text)
    assert (budget.op, budget.value, budget.unit) == ("<=", 64 * MIB, "B/1k requests")
