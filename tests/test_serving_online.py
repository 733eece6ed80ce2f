"""Online serving end to end on the CPU engine: the real server and vLLM's client, their faults, and the planted
regressions the serving suite must catch. Needs vLLM (the cpu-full env runs it); several minutes.

- a port that is taken and an engine argument vLLM refuses fail the start with the reason and the log's tail;
- a server whose engine core dies during a load fails that load, and the next test gets a fresh server;
- a pytest killed with SIGKILL or SIGTERM while its server is up leaves no process of the server behind;
- ``plant-request-leak`` (64 KiB kept per request: the pre-merge target of docs/online-serving.md, "The leak
  floor") fails the memory slope on its bound, the unchanged server passes it;
- ``plant-step-delay`` (every engine step 15% longer) fails the paired check under load.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vramgate.engine import EngineSpec
from vramgate.engine.load import Load
from vramgate.engine.server import ApiServer, ServerError
from vramgate.machine.probes.cpu import children, group_members
from vramgate.testing.serving import Servers

ROOT = Path(__file__).resolve().parents[1]
SPEC = EngineSpec(model="tiny-llama", block_size=32, max_model_len=1024, max_num_seqs=32, kv_budget_gib=None,
                  cpu_memory_bytes=2 << 30, gpu_memory_utilization=0.9)


@pytest.fixture(autouse=True)
def _offline() -> None:
    pytest.importorskip("vllm")
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
        os.environ.setdefault(key, value)


def test_a_taken_port_and_a_refused_argument_fail_the_start_with_the_reason(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ApiServer(SPEC, ROOT, tmp_path / "port", port=port)
        with pytest.raises(ServerError) as info:
            server.start()
    text = str(info.value)
    assert "before it was up" in text and "ddress already in use" in text, text
    bad = ApiServer(SPEC.replace(engine_args={"max_num_batched_tokens": 8}), ROOT, tmp_path / "arg")
    with pytest.raises(ServerError) as info:
        bad.start()
    assert "before it was up" in str(info.value) and "max_num_batched_tokens" in str(info.value), info.value
    assert bad.proc is None and server.proc is None


def test_a_server_that_dies_during_a_load_fails_it_and_is_replaced(tmp_path: Path) -> None:
    pool = Servers(ROOT, tmp_path / "pool")
    try:
        server = pool.get(SPEC)
        assert server.proc is not None
        core = [pid for pid in children(server.proc.pid) if "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert core, "no engine core process under the server"
        threading.Timer(3.0, os.kill, (core[0], signal.SIGKILL)).start()
        with pytest.raises(pytest.fail.Exception) as info:
            pool.loads(server, [Load(num_prompts=400, max_concurrency=4)], tmp_path / "load")
        assert "vLLM server for tiny-llama" in str(info.value) or "requests failed" in str(info.value), info.value
        deadline = time.monotonic() + 60
        while server.proc is not None and server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # vLLM's API server exits when its engine core is gone
        fresh = pool.get(SPEC)
        assert fresh is not server and fresh.healthy()
        result = pool.loads(fresh, [Load(num_prompts=8)], tmp_path / "again").results[0][0]
        assert result.completed == 8
    finally:
        pool.close()


KILLED = """
import time
from vramgate.engine import EngineSpec

def test_hold_a_server(servers):
    spec = EngineSpec(model="tiny-llama", block_size=32, max_model_len=1024, kv_budget_gib=None,
                      cpu_memory_bytes=2 << 30, gpu_memory_utilization=0.9)
    server = servers.get(spec)
    print("SERVER", server.proc.pid, flush=True)
    time.sleep(600)
"""


def _project(pytester: pytest.Pytester, *, profiles: tuple[str, ...] = ()) -> pytest.Pytester:
    shutil.copytree(ROOT / "suites" / "serving", pytester.path / "suites" / "serving")
    shutil.copytree(ROOT / "fixtures" / "models" / "tiny-llama", pytester.path / "fixtures" / "models" / "tiny-llama")
    shutil.copy(ROOT / "conftest.py", pytester.path / "conftest.py")
    for name in profiles:
        shutil.copytree(ROOT / "tests" / "data" / "profiles" / name, pytester.path / "patches" / name)
    return pytester


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_pytest_leaves_no_server_behind(pytester: pytest.Pytester, sig: signal.Signals) -> None:
    """SIGKILL (a runner that gives up, an out-of-memory kill) and SIGTERM (a CI timeout): pytest runs no
    finalizer on either, so the servers end themselves."""
    project = _project(pytester)
    (project.path / "vramgate.toml").write_text("[models.tiny-llama]\n")
    (project.path / "test_hold.py").write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "test_hold.py"],
                            cwd=project.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        pid = None
        deadline = time.monotonic() + 600
        for line in proc.stdout:  # pytest's progress line may precede it: "test_hold.py SERVER 123"
            if "SERVER " in line:
                pid = int(line.split("SERVER ", 1)[1].split()[0])
                break
            if time.monotonic() > deadline:
                break
        assert pid is not None, "the server did not come up"
        assert len(group_members(pid)) >= 2, "the server and its engine core should be up"
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_members(pid) == [], f"processes of the server's group outlived pytest: {group_members(pid)}"
    finally:
        proc.kill()


LOAD_MATRIX = """
[models.tiny-llama]

[[entries]]
suites = ["serving"]
model = "tiny-llama"
tier = "cpu"
block_size = 32
[entries.serving]
cpu_memory = "2 GiB"
enforce_eager = true
max_model_len = 1024
max_num_seqs = 32
[entries.load]
request_rates = [4]
num_prompts = 16
"""


def _metric(report: Path, name: str) -> dict[str, object]:
    data = json.loads(report.read_text())
    found = [m for t in data["tests"] for m in t["metrics"] if m["name"] == name]
    assert len(found) == 1, found
    return found[0]


def test_a_leak_of_64_kib_per_request_fails_the_memory_slope(pytester: pytest.Pytester) -> None:
    project = _project(pytester, profiles=("plant-request-leak",))
    (project.path / "vramgate.toml").write_text(LOAD_MATRIX)
    args = ("-p", "no:cacheprovider", "suites", "-k", "test_serving_memory", "-m", "not gate_nightly",
            "--gate-missing", "record")
    project.runpytest_subprocess(*args, "--gate-report", "same").assert_outcomes(passed=1)
    unchanged = _metric(project.path / "same" / "report.json", "memory_slope")
    result = project.runpytest_subprocess(*args, "--gate-profile", "plant-request-leak", "--gate-report", "leak")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "memory_slope" in out and "lower bound" in out and "ceiling" in out, out
    leak = _metric(project.path / "leak" / "report.json", "memory_slope")
    assert leak["now"]["value"] == pytest.approx(64 << 20, rel=0.25), leak  # type: ignore[index]
    assert abs(unchanged["now"]["value"]) < 16 << 20, unchanged  # type: ignore[index]
    assert "this run's floor" in str(unchanged["decided_by"]) and leak["now"]["fit"]["levels"]  # type: ignore[index]


def test_a_step_delay_of_15_percent_fails_the_paired_check_under_load(pytester: pytest.Pytester) -> None:
    project = _project(pytester, profiles=("plant-step-delay",))
    (project.path / "vramgate.toml").write_text("[models.tiny-llama]\n")
    manifest = project.path / "patches" / "plant-step-delay" / "manifest.toml"
    manifest.write_text(manifest.read_text().replace("suites = []", 'suites = ["serving"]'))
    # the paired A/B alone (test_serving_memory_paired judges every profile too: its leaks cell)
    result = project.runpytest_subprocess("-p", "no:cacheprovider", "suites", "-k", "test_serving_paired",
                                          "--gate-missing", "record", "--gate-report", "out")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "tpot_ratio" in out and "first look" in out and "pooled (the verdict)" in out, out


def test_the_paired_memory_slope_catches_a_leak_in_a_session_that_applies_it(pytester: pytest.Pytester) -> None:
    """``test_serving_memory_paired`` with ``plant-request-leak`` (64 KiB per request) in a session that applies the
    plant to every server naming no profile (``--gate-profile``, as a team runs a candidate): the reference stays
    unpatched (Note [the unpatched reference] in vramgate.engine.spec), so the difference of the two servers fails
    on its bound. Before, the reference took the plant too and the difference read flat."""
    project = _project(pytester, profiles=("plant-request-leak",))
    (project.path / "vramgate.toml").write_text("[models.tiny-llama]\n")
    result = project.runpytest_subprocess("-p", "no:cacheprovider", "suites", "-k", "test_serving_memory_paired",
                                          "--gate-profile", "plant-request-leak", "--gate-missing", "record",
                                          "--gate-report", "out")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "memory_slope_difference" in out and "lower bound" in out, out
    metric = _metric(project.path / "out" / "report.json", "memory_slope_difference")
    assert metric["now"]["value"] == pytest.approx(64 << 20, rel=0.3), metric  # type: ignore[index]
    data = json.loads((project.path / "out" / "report.json").read_text())
    assert data["profiles"] == ["plant-request-leak"], data["profiles"]
    leaks = [j for j in data["judgements"] if j["check"] == "leaks"]
    assert [(j["profile"], j["state"]) for j in leaks] == [("plant-request-leak", "failed")], leaks
