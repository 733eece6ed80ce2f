"""``--gate-memory-history``: the CUDA allocator's history of a gated test, kept next to the report.

No GPU here: a stand-in ``torch`` whose ``torch.cuda.memory`` functions record their calls (and whose snapshot
dump writes a small file) is put in ``sys.modules``, where the gate looks for a torch the test process loaded.
The gated runs are real pytester runs in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from vramgate.engine.measure import worker_memory_history_dump, worker_memory_history_start
from vramgate.machine.probes import memory_history

TEST_FILE = """
import os

import pytest

from vramgate.machine.probes import memory_history


@pytest.fixture
def engine(tmp_path):
    return tmp_path


def test_grows(gate):
    gate.record("peak_delta_bytes", int(os.environ.get("PEAK", "1024")), unit="B", scope="machine")


def test_steady(gate):
    gate.record("other_bytes", 512, unit="B", scope="machine")


def test_engine_run(gate, engine):
    assert os.environ.get("VRAMGATE_MEMORY_HISTORY", "") == os.environ.get("EXPECT_SWITCH", "")
    snapshot = engine / "memory-history-rank0.pickle"
    snapshot.write_bytes(b"engine snapshot")
    memory_history.note([str(snapshot)])
    gate.record("engine_bytes", int(os.environ.get("PEAK", "1024")), unit="B", scope="machine")
"""


class FakeMemory:
    """``torch.cuda.memory``'s history functions, recording each call; a dump writes the calls so far."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _record_memory_history(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.calls.append(("record", {"enabled": enabled, **kwargs}))

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        self.calls.append(("dump", {"filename": filename}))
        Path(filename).write_bytes(b"snapshot")


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> FakeMemory:
    """A stand-in torch with one initialized CUDA device, in ``sys.modules``; its recorded history calls."""
    memory = FakeMemory()
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, memory=memory,
                                 device_count=lambda: 0)  # no device to fingerprint: the run keeps hardware hw-a
    torch = types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda=None))
    monkeypatch.setitem(sys.modules, "torch", torch)
    return memory


def gate_run(pytester: pytest.Pytester, *args: str, **env: str) -> pytest.RunResult:
    """One gate run of TEST_FILE on hardware key ``hw-a`` with *env* set (hygiene off: it would probe the
    stand-in torch)."""
    pytester.makepyfile(test_mem=TEST_FILE)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        return pytester.runpytest("--gate-hardware", "hw-a", "--gate-hygiene", "off", *args)


@pytest.fixture
def recorded(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project whose baselines a first run (without the memory history) recorded."""
    gate_run(pytester, "--gate-missing=record").assert_outcomes(passed=3)
    return pytester


def test_on_failure_keeps_the_failing_tests_history_and_names_it(
    recorded: pytest.Pytester, fake_torch: FakeMemory
) -> None:
    result = gate_run(recorded, "--gate-report", "out", "--gate-memory-history", "on-failure", PEAK="2048",
                      EXPECT_SWITCH="1")
    result.assert_outcomes(passed=1, failed=2)
    folder = recorded.path / "out" / "memory-history"
    result.stdout.fnmatch_lines([
        "*peak_delta_bytes +100.00% vs baseline*",
        "Memory history (open at https://pytorch.org/memory_viz): out/memory-history/test_mem.py_test_grows.pickle",
    ])
    # The engine test records in its engine, not here: its snapshot is the engine's, copied next to the report.
    result.stdout.fnmatch_lines([
        "Memory history (open at https://pytorch.org/memory_viz): "
        "out/memory-history/test_mem.py_test_engine_run.engine-1.memory-history-rank0.pickle"])
    assert sorted(p.name for p in folder.iterdir()) == [
        "test_mem.py_test_engine_run.engine-1.memory-history-rank0.pickle", "test_mem.py_test_grows.pickle"]
    assert (folder / "test_mem.py_test_engine_run.engine-1.memory-history-rank0.pickle").read_bytes() == \
        b"engine snapshot"
    # Recorded in this process around the two in-process tests' calls: start, dump, stop each.
    start = ("record", {"enabled": "all", "max_entries": memory_history.MAX_ENTRIES, "stacks": "python"})
    stop = ("record", {"enabled": None})
    dumps = [c[1]["filename"] for c in fake_torch.calls if c[0] == "dump"]
    assert fake_torch.calls == [start, ("dump", {"filename": dumps[0]}), stop,
                                start, ("dump", {"filename": dumps[1]}), stop]
    assert [Path(d).name for d in dumps] == ["test_mem.py_test_grows.pickle", "test_mem.py_test_steady.pickle"]
    assert os.environ.get(memory_history.MEMORY_HISTORY_ENV) is None  # the switch ends with the session


def test_always_keeps_every_test_s_history(recorded: pytest.Pytester, fake_torch: FakeMemory) -> None:
    result = gate_run(recorded, "-rP", "--gate-report", "out", "--gate-memory-history", "always", EXPECT_SWITCH="1")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([  # a passing test's section, which -rP shows
        "*vramgate memory history*",
        "Memory history (open at https://pytorch.org/memory_viz): out/memory-history/test_mem.py_test_grows.pickle"])
    assert sorted(p.name for p in (recorded.path / "out" / "memory-history").iterdir()) == [
        "test_mem.py_test_engine_run.engine-1.memory-history-rank0.pickle", "test_mem.py_test_grows.pickle",
        "test_mem.py_test_steady.pickle"]


def test_off_records_nothing(recorded: pytest.Pytester, fake_torch: FakeMemory) -> None:
    result = gate_run(recorded, "--gate-report", "out", PEAK="2048")
    result.assert_outcomes(passed=1, failed=2)
    assert fake_torch.calls == []
    assert not (recorded.path / "out" / "memory-history").exists()
    assert "Memory history" not in result.stdout.str()


def test_without_cuda_in_the_test_process_only_the_engines_record(
    recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    result = gate_run(recorded, "--gate-report", "out", "--gate-memory-history", "on-failure", PEAK="2048",
                      EXPECT_SWITCH="1")
    result.assert_outcomes(passed=1, failed=2)
    assert "torch" not in sys.modules
    assert [p.name for p in (recorded.path / "out" / "memory-history").iterdir()] == [
        "test_mem.py_test_engine_run.engine-1.memory-history-rank0.pickle"]


def test_the_memory_history_needs_a_report_folder(pytester: pytest.Pytester) -> None:
    result = gate_run(pytester, "--gate-memory-history", "always")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-memory-history always: needs --gate-report DIR*"])


def test_the_engine_worker_records_each_rank_and_dumps_into_its_folder(
    fake_torch: FakeMemory, tmp_path: Path
) -> None:
    rank = types.SimpleNamespace(rank=1)
    assert worker_memory_history_start(rank, driver_pid=os.getpid()) is True
    assert fake_torch.calls == []  # the engine's own process records since before the engine started
    assert worker_memory_history_start(rank, driver_pid=-1) is True
    assert fake_torch.calls[-1][1]["stacks"] == "python"
    path = worker_memory_history_dump(rank, str(tmp_path))
    assert path == str(tmp_path / "memory-history-rank1.pickle") and Path(path).read_bytes() == b"snapshot"
    assert fake_torch.calls[-1] == ("record", {"enabled": None})


def test_the_switch_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory_history.MEMORY_HISTORY_ENV, raising=False)
    assert not memory_history.requested()
    monkeypatch.setenv(memory_history.MEMORY_HISTORY_ENV, "0")
    assert not memory_history.requested()
    monkeypatch.setenv(memory_history.MEMORY_HISTORY_ENV, "1")
    assert memory_history.requested()


def test_the_plugin_imports_without_torch() -> None:
    code = ("import sys; import vramgate.pytest_plugin.plugin, vramgate.engine.worker, vramgate.report; "
            "sys.exit('torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


def test_a_snapshot_that_cannot_be_written_is_a_session_error_not_a_crash(
    recorded: pytest.Pytester, fake_torch: FakeMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(filename: str = "dump_snapshot.pickle") -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fake_torch, "_dump_snapshot", full)
    result = gate_run(recorded, "--gate-report", "out", "--gate-memory-history", "always", EXPECT_SWITCH="1")
    result.assert_outcomes(passed=3)  # the tests' own outcomes stand
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "the memory history of test_mem.py::test_grows could not be written: [Errno 28] No space left" in \
        result.stdout.str()
    assert ("record", {"enabled": None}) in fake_torch.calls  # recording stopped all the same
