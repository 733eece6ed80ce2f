"""The GPU-state guard through pytester: throttled or unguarded measurements, with NVML faked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HW = ("--gate-hardware", "testkey", "--gate-baselines", "stored")
NODE = "test_guard.py::test_measure"

# STATE picks what the faked NVML reads: a clean GPU, a throttled one, or no NVML at all.
TEST_FILE = """
import os

from vramgate.machine.probes import gpu_state
from vramgate.machine.probes.gpu_state import GPUState
from vramgate.machine.probes.nvml import NVMLUnavailable

STATES = {
    "clean": (("gpu idle",), {os.getpid(): 1}),
    "throttled": (("HW slowdown", "SW power cap"), {os.getpid(): 1}),
}


def fake_read_state(index=0):
    mode = os.environ["STATE"]
    if mode == "nonvml":
        raise NVMLUnavailable("nvidia-ml-py is not installed (faked)")
    reasons, processes = STATES[mode]
    return GPUState(index, 1100, 1980, 3201, 80, reasons, processes)


def test_measure(gate, monkeypatch):
    monkeypatch.setattr(gpu_state, "read_state", fake_read_state)
    with gate.gpu_guard():
        pass
    gate.record_samples("latency_s", [0.010, 0.011, 0.012, 0.010, 0.011], unit="s")
    gate.record("bytes", 1, unit="B", scope="machine")  # an allocator figure: machine-bound
"""


def baseline(pytester: pytest.Pytester) -> Path:
    return pytester.path / "stored" / "testkey" / "guard.json"


def report(pytester: pytest.Pytester) -> dict:
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    (test,) = [t for t in data["tests"] if t["nodeid"] == NODE]
    return test


# In a subprocess: an in-process run drops the modules it imported (numpy, for the report's plot; the faked
# gpu_state), and numpy cannot be loaded twice in one process.
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str, *args: str) -> pytest.RunResult:
    monkeypatch.setenv("STATE", mode)
    return pytester.runpytest_subprocess(*HW, "--gate-report", "out", *args)


@pytest.fixture
def guarded(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_guard=TEST_FILE)
    return pytester


def test_throttled_measurement_fails_untrusted_and_records_nothing(
    guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run(guarded, monkeypatch, "throttled", "--gate-missing=record")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "untrusted" in out
    assert "throttled (HW slowdown)" in out
    assert "latency_s measured on a GPU in an untrustworthy state" in out
    assert "not compared: GPU 0 throttled (HW slowdown) at 1100 MHz of 1980 MHz" in out
    assert "SW power cap)" not in out  # a power-capped boost clock is not distrusted
    assert not baseline(guarded).exists()

    test = report(guarded)
    assert test["test_passed"] and test["failed"]
    verdicts = {m["name"]: (m["verdict"], m["failed"]) for m in test["metrics"]}
    # the exact metric neither fails nor gets recorded: the test as a whole is not trusted
    assert verdicts == {"latency_s": ("untrusted", True), "bytes": ("not compared", False)}
    (latency,) = [m for m in test["metrics"] if m["name"] == "latency_s"]
    # throttled before and after: one message, not one per reading
    assert latency["decided_by"] == "GPU 0 throttled (HW slowdown) at 1100 MHz of 1980 MHz"
    (condition,) = test["gpu_conditions"]
    assert condition["guarded"] is True
    assert condition["before"]["reasons"] == ["HW slowdown", "SW power cap"]
    assert all(isinstance(pid, str) for pid in condition["after"]["processes"])


def test_throttled_measurement_never_replaces_a_baseline(
    guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(guarded, monkeypatch, "clean", "--gate-update").assert_outcomes(passed=1)
    recorded = baseline(guarded).read_text()
    assert set(json.loads(recorded)["tests"][NODE]["metrics"]) == {"latency_s", "bytes"}

    for extra in ("--gate-update", "--gate-missing=record"):
        result = run(guarded, monkeypatch, "throttled", extra)
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*latency_s: now *, not compared: GPU 0 throttled (HW slowdown)*"])
        assert baseline(guarded).read_text() == recorded
        verdicts = {m["name"]: m["verdict"] for m in report(guarded)["metrics"]}
        assert verdicts == {"latency_s": "untrusted", "bytes": "ok"}

    run(guarded, monkeypatch, "clean").assert_outcomes(passed=1)


def test_without_nvml_the_measurement_passes_unguarded(
    guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run(guarded, monkeypatch, "nonvml", "--gate-missing=record")
    result.assert_outcomes(passed=1)
    assert report(guarded)["gpu_conditions"] == [
        {"guarded": False, "why": "nvidia-ml-py is not installed (faked)"}
    ]
    data = json.loads(baseline(guarded).read_text())
    assert set(data["tests"][NODE]["metrics"]) == {"latency_s", "bytes"}


def test_clean_gpu_passes_and_records(guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(guarded, monkeypatch, "clean", "--gate-missing=record")
    result.assert_outcomes(passed=1)
    assert "untrusted" not in result.stdout.str()
    test = report(guarded)
    assert {m["verdict"] for m in test["metrics"]} == {"new"}
    (condition,) = test["gpu_conditions"]
    assert condition["guarded"] is True and condition["after"]["reasons"] == ["gpu idle"]
    assert baseline(guarded).exists()
    run(guarded, monkeypatch, "clean").assert_outcomes(passed=1)


# A GPU test that never calls gate.gpu_guard() itself: the plugin guards its call (Note [default GPU guard]).
DEFAULT_GUARD_CONFTEST = """
import os

from vramgate.machine import hardware
from vramgate.machine.probes import gpu_state
from vramgate.machine.probes.gpu_state import GPUState

hardware.probe_gpus = lambda: ((hardware.GPUInfo("Faked GPU", 80 * 10**9, (9, 0)),), "580.0", "13.0")


def fake_read_state(index=0):
    reasons = ("HW slowdown",) if os.environ["STATE"] == "throttled" else ("gpu idle",)
    return GPUState(index, 1100, 1980, 3201, 80, reasons, {os.getpid(): 1})


gpu_state.read_state = fake_read_state
"""

DEFAULT_GUARD_TEST = """
import pytest


@pytest.mark.requires_gpus(1)
def test_gpu_measure(gate):
    gate.record_samples("latency_s", [0.010, 0.011, 0.012, 0.010, 0.011], unit="s")


def test_cpu_measure(gate):
    gate.record_samples("latency_s", [0.010, 0.011, 0.012, 0.010, 0.011], unit="s")
"""


@pytest.mark.parametrize(("state", "outcome"), [("clean", {"passed": 2}), ("throttled", {"passed": 1, "failed": 1})])
def test_gpu_tests_are_guarded_by_default(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, state: str, outcome: dict[str, int]
) -> None:
    pytester.makeconftest(DEFAULT_GUARD_CONFTEST)
    pytester.makepyfile(test_default=DEFAULT_GUARD_TEST)
    result = run(pytester, monkeypatch, state, "--gate-missing=record")
    result.assert_outcomes(**outcome)
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    tests = {t["nodeid"].split("::")[-1]: t for t in data["tests"]}
    assert tests["test_gpu_measure"]["gpu_conditions"], "the GPU test's call was not guarded"
    assert not tests["test_cpu_measure"].get("gpu_conditions"), "a CPU test must not read NVML"
    if state == "throttled":
        result.stdout.fnmatch_lines(["*latency_s measured on a*"])
        assert "HW slowdown" in result.stdout.str()
