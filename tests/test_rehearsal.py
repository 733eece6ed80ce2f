"""The GPU session rehearsed on CPU (Note [rehearsal] in vramgate.testing.rehearsal): the GPU plan of ``tox -e gpu``,
of each shard of ``gpu-gate.yml`` and of the baselines job, on a fake 1xH100 and a fake 8xH100 in a container, with
every engine and server stood in by a process that claims what vLLM would claim and is refused where vLLM would
refuse. And the serving pool's rule on a device (Note [servers hold the device] in vramgate.testing.serving).

The rehearsal builds the profiles' overlays from the pinned vLLM's source (a CUDA wheel's ``.py`` files:
``scripts/vllm_sources.py``; ``tox -e unit`` fetches it and names it in ``VRAMGATE_REHEARSAL_VLLM``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from vramgate import VLLM_VERSION
from vramgate.engine import EngineSpec
from vramgate.testing import fake_device, rehearsal
from vramgate.testing.serving import Servers

ROOT = Path(__file__).resolve().parents[1]


def _vllm_source() -> Path | None:
    given = os.environ.get("VRAMGATE_REHEARSAL_VLLM")
    candidates = [Path(given)] if given else [ROOT / ".tox" / "vllm-sources" / VLLM_VERSION / "vllm"]
    for path in candidates:
        if (path / "v1" / "worker" / "gpu_worker.py").is_file():
            return path
    if given:
        raise AssertionError(f"VRAMGATE_REHEARSAL_VLLM={given} holds no vLLM source")
    return None


SOURCE = _vllm_source()
needs_source = pytest.mark.skipif(SOURCE is None, reason=f"no vLLM {VLLM_VERSION} source: tox -e unit fetches it "
                                                        "(scripts/vllm_sources.py) and sets VRAMGATE_REHEARSAL_VLLM")

#: The GPU plans the rehearsal runs: ``tox -e gpu`` (every suite, one process) on the 1xH100; each shard of
#: ``gpu-gate.yml`` and of the baselines job (the same shards, recording) on the 8xH100 runner in a container.
PLANS: dict[str, tuple[str, list[str]]] = {
    "tox-e-gpu": ("h100x1", []),
    "gpu-gate-shard-1": ("h100x8", ["--gate-shard", "1/2"]),
    "gpu-gate-shard-2": ("h100x8", ["--gate-shard", "2/2"]),
}


def _command(box: str, args: list[str], out: Path, paths: list[str] | None) -> tuple[list[str], dict[str, str]]:
    assert SOURCE is not None
    env = {k: v for k, v in os.environ.items() if k not in ("VRAMGATE_REQUIRE_VLLM", "PYTEST_ADDOPTS",
                                                            "PYTEST_XDIST_WORKER", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    shutil.copytree(ROOT / "baselines", out / "baselines")  # the baselines job records into a copy
    cmd = [sys.executable, "-m", "pytest", *(paths or ["suites"]), "-p", "vramgate.testing.rehearsal",
           "--gate-rehearse", box, "--gate-rehearse-vllm", str(SOURCE), "--gate-rehearse-out",
           str(out / "rehearsal.json"), "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
           "-p", "no:cacheprovider", "-q", "--tb=no", "--basetemp", str(out / "tmp"),
           "--gate-baselines", str(out / "baselines"), *args]
    return cmd, env


def _result(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    stdout, _ = proc.communicate(timeout=900)
    report = out / "rehearsal.json"
    assert report.is_file(), f"the rehearsal wrote no findings:\n{stdout[-6000:]}"
    data: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
    data["output"], data["returncode"] = stdout[-6000:], proc.returncode
    return data


def rehearse(box: str, args: list[str], out: Path, paths: list[str] | None = None) -> dict[str, Any]:
    """Run the rehearsal of ``pytest suites ARGS`` (or of *paths*) on *box*; its findings and starts."""
    cmd, env = _command(box, args, out, paths)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _result(proc, out)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every plan of :data:`PLANS` rehearsed, all at once (each is one process, mostly waiting on its stand-ins)."""
    started = {}
    for name, (box, args) in PLANS.items():
        out = tmp_path_factory.mktemp(name)
        cmd, env = _command(box, args, out, None)
        started[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True), out)
    try:
        yield {name: _result(proc, out) for name, (proc, out) in started.items()}
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@needs_source
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_the_gpu_plan_comes_up_clean_on_the_rehearsal_boxes(plan: str, plans: dict[str, Any]) -> None:
    """No start vLLM would refuse, no memory held past its process's end, no test distrusted for the gate's own
    processes; and the plan did start engines and servers (the rehearsal ran, it did not skip)."""
    data = plans[plan]
    lines = [f"{f['kind']}: {f['test']}: {f['message']}" for f in data["findings"]]
    assert not lines, "\n".join(lines)
    kinds = {s["what"].split(" for ")[0] for s in data["starts"]}
    assert "engine" in kinds, data["output"]
    assert data["returncode"] in (0, 1), data["output"]  # the suites' own verdicts are not the rehearsal's


@needs_source
def test_the_shards_together_rehearse_what_one_process_does(plans: dict[str, Any]) -> None:
    """Every kind of engine or server the whole plan starts, one of the shards starts too, and the shards start
    nothing else but the tensor-parallel engines only the 8xH100 has the GPUs for. (A shard may start again what
    the other ran: a session runs each spec once, and a test of one shard may be the first to ask for it.)"""
    def started(*names: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for name in names:
            for s in plans[name]["starts"]:
                out.setdefault(s["what"], set()).add(s["test"])
        return out

    whole = started("tox-e-gpu")
    sharded = started("gpu-gate-shard-1", "gpu-gate-shard-2")
    assert set(whole) <= set(sharded), sorted(set(whole) - set(sharded))
    extra = {what: tests for what, tests in sharded.items() if what not in whole}
    assert extra and all("test_vllm_tp" in t for tests in extra.values() for t in tests), extra


@needs_source
def test_the_baselines_job_records_without_holding_the_device(tmp_path: Path) -> None:
    """The baselines job's first shard (``--gate-update``, into a copy of the baselines) on the 8xH100 runner."""
    data = rehearse("h100x8", ["--gate-shard", "1/2", "--gate-update"], tmp_path,
                    paths=["suites/serving", "suites/serving_capacity", "suites/tp_overlap/test_vllm_tp.py"])
    assert not data["findings"], data["findings"]
    assert any(s["what"].startswith("vLLM server") for s in data["starts"]), data["starts"]


PLANTED_THIRD_SERVER = '''
from vramgate.engine import EngineSpec

def test_a_third_server(servers):
    pair = EngineSpec(model="tiny-llama", block_size=16, max_model_len=1024, kv_budget_gib=None,
                      gpu_memory_utilization=0.44)
    servers.get(pair)
    servers.get(pair.replace(max_num_seqs=32))
    servers.get(pair.replace(gpu_memory_utilization=0.9))
'''


@needs_source
def test_a_planted_third_server_at_0_9_fails_the_rehearsal(tmp_path: Path) -> None:
    """Two servers of a pair up, and a third at 0.9 asked for in the same test: vLLM would refuse it."""
    plant = tmp_path / "plant" / "test_third_server.py"
    plant.parent.mkdir()
    plant.write_text(PLANTED_THIRD_SERVER, encoding="utf-8")
    data = rehearse("h100x1", ["-p", "vramgate.testing.fixtures"], tmp_path, paths=[str(plant)])
    refused = [f for f in data["findings"] if f["kind"] == "refused"]
    assert len(refused) == 1, data["findings"]
    assert "test_a_third_server" in refused[0]["test"]
    assert "utilization 0.9" in refused[0]["message"] and "vLLM server for tiny-llama" in refused[0]["message"]


# -- the pieces, without a session


def test_the_ledger_refuses_where_vllm_request_memory_would(tmp_path: Path) -> None:
    box = fake_device.BOXES["h100x1"]
    ledger = fake_device.Ledger(0, box.memory_bytes)
    ledger.claim(os.getpid(), rehearsal.GATE_CONTEXT_BYTES)
    nvml = fake_device.FakeNVML(box, [ledger])
    info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
    assert info.used == rehearsal.GATE_CONTEXT_BYTES and info.total == box.memory_bytes
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ledger.claim(proc.pid, 70 << 30)
        assert ledger.free() == box.memory_bytes - rehearsal.GATE_CONTEXT_BYTES - (70 << 30)
        listed = nvml.nvmlDeviceGetComputeRunningProcesses(ledger)
        assert {p.pid for p in listed} == {os.getpid(), proc.pid}
    finally:
        proc.kill()
        proc.wait()
    assert ledger.free() == box.memory_bytes - rehearsal.GATE_CONTEXT_BYTES, "a claim ends with its process"
    container = fake_device.FakeNVML(fake_device.BOXES["h100x8"], [ledger])
    assert [p.pid for p in container.nvmlDeviceGetComputeRunningProcesses(ledger)] == [
        os.getpid() + fake_device.CONTAINER_PID_OFFSET]


def test_what_an_engine_claims() -> None:
    """Without a KV budget the utilization's share of the device; with one the budget, the rank's weights and the
    overhead, at the utilization the gate passes vLLM."""
    total = fake_device.BOXES["h100x1"].memory_bytes
    auto = EngineSpec(model="tiny-llama", kv_budget_gib=None, gpu_memory_utilization=0.9)
    assert rehearsal.claim_of(auto, ROOT, total) == (0.9, -(-total * 9 // 10))
    budget = EngineSpec(model="tiny-llama", kv_budget_gib=1.0)
    utilization, nbytes = rehearsal.claim_of(budget, ROOT, total)
    assert 0 < utilization < 0.1
    assert (1 << 30) + rehearsal.RANK_OVERHEAD_BYTES <= nbytes < (2 << 30) + rehearsal.RANK_OVERHEAD_BYTES


@pytest.mark.parametrize(("command", "kind"), [
    (["py", "-m", "vramgate.engine.worker", "spec.json", "result.json"], "engine"),
    (["py", "-m", "vramgate.engine.worker", "--serve", "spec.json", "control"], "serve"),
    (["py", "-m", "vramgate.engine.api_server", "server.json"], "server"),
    (["py", "-m", "vramgate.engine.load_client", "x"], "client"),
    (["py", "-m", "vramgate.sim.isolated", "a", "b"], None),
])
def test_which_launches_are_stood_in(command: list[str], kind: str | None) -> None:
    assert rehearsal.engine_kind(command) == kind


class _FakeServer:
    started: ClassVar[list[str]] = []
    stopped: ClassVar[list[str]] = []

    def __init__(self, spec: EngineSpec, root: Path, run_dir: Path, *, cache_root: Path | None = None) -> None:
        self.spec, self.name = spec, f"{spec.max_num_seqs}"
        self.proc: Any = None

    def start(self) -> _FakeServer:
        class Proc:
            pid = 0
            returncode = None

            def poll(self) -> None:
                return None
        self.proc = Proc()
        _FakeServer.started.append(self.name)
        return self

    def stop(self) -> None:
        _FakeServer.stopped.append(self.name)
        self.proc = None


@pytest.mark.parametrize("exclusive", [True, False], ids=["device", "cpu"])
def test_on_a_device_the_pool_keeps_only_the_running_tests_servers(exclusive: bool, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from vramgate.runtime import process
    from vramgate.testing import serving

    monkeypatch.setattr(serving, "ApiServer", _FakeServer)
    monkeypatch.setattr(process, "keep_for_session", lambda proc: None)
    monkeypatch.setattr(process, "release", lambda proc: None)
    _FakeServer.started, _FakeServer.stopped = [], []
    pool = Servers(ROOT, tmp_path, exclusive=exclusive)
    a, b, c = (EngineSpec(model="tiny-llama", max_num_seqs=n) for n in (8, 16, 32))
    pool.get(a)                       # test 1: one server
    pool.after_test(next_uses_servers=True)
    pool.get(a)                       # test 2: the same one, kept
    pool.get(b)                       # ... and a second beside it (a pair)
    pool.after_test(next_uses_servers=True)
    pool.get(c)                       # test 3: another one
    if exclusive:
        assert _FakeServer.stopped == ["8", "16"], "the idle servers stop before a new one starts"
        assert [s.spec.max_num_seqs for s in pool.up()] == [32]
        pool.after_test(next_uses_servers=False)
        assert pool.up() == [], "no server outlives the last test that asks for servers"
    else:
        assert _FakeServer.stopped == []
        pool.after_test(next_uses_servers=False)
        assert len(pool.up()) == 3
    assert _FakeServer.started == ["8", "16", "32"]


def test_memory_held_past_the_gates_stop_is_a_finding() -> None:
    """A stand-in still running after the gate ended its group (a stop that missed a process), and one still
    running at the session's end: each is a ``held`` finding, and the second is ended then."""
    r = rehearsal.Rehearsal(fake_device.BOXES["h100x1"], None)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
             for _ in range(2)]
    try:
        for proc in procs:
            r.standins[proc.pid] = "vLLM server for tiny-llama (unpatched)"
        r._killer(lambda proc, grace_s=None: None)(procs[0])  # a stop that ends nothing
        assert [f.kind for f in r.findings] == ["held"] and str(procs[0].pid) in r.findings[0].message
        procs[0].kill()
        procs[0].wait()
        r.still_held()
        assert [f.kind for f in r.findings] == ["held", "held"] and r.findings[1].test == "(session end)"
        assert procs[1].wait(timeout=10) is not None, "the rehearsal ends what the session left"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
