"""Metric scope through pytester: portable metrics under the tier's key, machine-bound ones under the hardware key,
a machine without baselines, and tolerances that mean the same in both directions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramgate.core.checks import check_baseline
from vramgate.core.metrics import Metric, default_scope, worse_change

TEST_FILE = """
import os
def test_kv(gate):
    gate.record("page_bytes", int(os.environ.get("PAGE", "65536")), unit="B")
    gate.record("weights_bytes", int(os.environ.get("WEIGHTS", "1000")), unit="B", scope="machine")
    gate.record_samples("ttft", [float(os.environ.get("TTFT", "0.010")) * (1 + i / 1000) for i in range(20)], unit="s")
"""


def stored(pytester: pytest.Pytester, key: str) -> dict[str, dict[str, object]]:
    data = json.loads((pytester.path / "baselines" / key / "kv.json").read_text())
    return dict(data["tests"]["test_kv.py::test_kv"]["metrics"])


@pytest.fixture
def recorded(pytester: pytest.Pytester) -> pytest.Pytester:
    """Baselines recorded on hardware key ``hw-a``."""
    pytester.makepyfile(test_kv=TEST_FILE)
    pytester.runpytest("--gate-hardware", "hw-a", "--gate-update").assert_outcomes(passed=1)
    return pytester


def test_defaults_follow_the_kind() -> None:
    assert default_scope("exact") == "portable" and default_scope("measured") == "machine"
    assert Metric("m", 1, "B").effective_scope == "portable"
    assert Metric("m", 1, "B", scope="machine").effective_scope == "machine"
    with pytest.raises(ValueError, match="scope 'everywhere' is not one of portable, machine"):
        Metric("m", 1, "B", scope="everywhere")  # type: ignore[arg-type]


def test_update_splits_a_test_over_the_tier_and_the_hardware_key(recorded: pytest.Pytester) -> None:
    portable, machine = stored(recorded, "cpu"), stored(recorded, "hw-a")
    assert set(portable) == {"page_bytes"} and portable["page_bytes"]["scope"] == "portable"
    assert set(machine) == {"weights_bytes", "ttft"}
    assert {m["scope"] for m in machine.values()} == {"machine"}


def test_another_machine_compares_portable_metrics_and_lists_the_rest(
    recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTS", "5000")  # another ISA repacks weights: not this key's business
    monkeypatch.setenv("TTFT", "1.0")  # 100x slower machine
    result = recorded.runpytest("--gate-hardware", "hw-b", "--gate-report", "rep")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*1 portable metric(s) compared under tier cpu; 0 machine-bound under hardware hw-b*",
        "*!! NOT COMPARED: 2 machine-bound metric(s) in 1 test(s): hw-b has no baselines. Record them on this machine*"
        "python -m pytest test_kv.py::test_kv --gate-missing record --gate-hardware hw-b*",
    ])
    report = json.loads((recorded.path / "rep" / "report.json").read_text())
    verdicts = {m["name"]: m["verdict"] for m in report["tests"][0]["metrics"]}
    assert verdicts == {"page_bytes": "ok", "weights_bytes": "no baselines", "ttft": "no baselines"}
    assert "NOT COMPARED: 2 machine-bound metric(s)" in (recorded.path / "rep" / "report.md").read_text()


def test_a_portable_regression_fails_on_a_machine_without_baselines(
    recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGE", "73728")  # one more KV head's worth
    result = recorded.runpytest("--gate-hardware", "hw-b")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*page_bytes: now 73,728 B (72.00 KiB), baseline 65,536 B (64.00 KiB): +12.50%*",
                                 "*git add baselines/cpu/kv.json*"])


def test_require_hardware_fails_with_the_list(recorded: pytest.Pytester) -> None:
    result = recorded.runpytest("--gate-hardware", "hw-b", "--gate-require-hardware")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "weights_bytes missing baseline" in out and "ttft missing baseline" in out
    assert "--gate-require-hardware is set and hw-b has no baselines: record them" in out
    assert "page_bytes" not in out.split("fall short")[0]  # the portable metric was compared and is fine


def test_the_recording_machine_compares_everything(recorded: pytest.Pytester) -> None:
    result = recorded.runpytest("--gate-hardware", "hw-a")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*1 portable metric(s) compared under tier cpu; 2 machine-bound under hardware hw-a*"])
    assert "NOT COMPARED" not in result.stdout.str()


def test_a_key_with_baselines_still_fails_a_missing_machine_metric(recorded: pytest.Pytester) -> None:
    recorded.makepyfile(test_more="""
def test_new(gate):
    gate.record("rss_bytes", 10, unit="B", scope="machine")
""")
    result = recorded.runpytest("--gate-hardware", "hw-a", "test_more.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rss_bytes missing baseline*"])


def test_recording_a_new_machine_leaves_the_portable_file_alone(recorded: pytest.Pytester) -> None:
    before = (recorded.path / "baselines" / "cpu" / "kv.json").read_text()
    result = recorded.runpytest("--gate-hardware", "hw-b", "--gate-missing", "record")
    result.assert_outcomes(passed=1)
    assert (recorded.path / "baselines" / "cpu" / "kv.json").read_text() == before
    assert set(stored(recorded, "hw-b")) == {"weights_bytes", "ttft"}


def test_a_tier_key_is_no_hardware_key(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    result = pytester.runpytest("--gate-hardware", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*hardware key 'cpu' is a tier's key*"])


def test_a_bad_scope_in_a_baseline_is_a_usage_error(recorded: pytest.Pytester) -> None:
    path: Path = recorded.path / "baselines" / "cpu" / "kv.json"
    path.write_text(path.read_text().replace('"scope": "portable"', '"scope": "local"'))
    result = recorded.runpytest("--gate-hardware", "hw-a")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "kv.json: tests['test_kv.py::test_kv'].metrics['page_bytes'].scope: must be one of" in result.stderr.str()


# -- tolerances that can fail -------------------------------------------------------------------------------


def test_worse_change_is_a_ratio_both_ways() -> None:
    assert worse_change(200.0, 100.0, "lower") == pytest.approx(1.0)  # twice the latency
    assert worse_change(50.0, 100.0, "higher") == pytest.approx(1.0)  # half the throughput
    assert worse_change(1.0, 100.0, "higher") == pytest.approx(99.0)
    assert worse_change(150.0, 100.0, "higher") < 0  # better
    assert worse_change(0.0, 100.0, "higher") == float("inf")


@pytest.mark.parametrize(("new", "verdict"), [(45.0, "regressed"), (1.0, "regressed"), (60.0, "ok"),
                                               (100.0, "ok"), (250.0, "improved")])
def test_exact_higher_is_better_at_tolerance_one(new: float, verdict: str) -> None:
    base = Metric("throughput", 100.0, "tokens/s", better="higher", tolerance=1.0)
    now = Metric("throughput", new, "tokens/s", better="higher", tolerance=1.0)
    assert check_baseline(now, base)[0] == verdict


THROUGHPUT = """
import os
def test_rate(gate):
    level = float(os.environ.get("LEVEL", "1000"))
    gate.record_samples("request_throughput", [level * (1 + (i % 5) / 100) for i in range(20)], unit="tokens/s",
                        better="higher", tolerance=1.0)
"""


@pytest.mark.parametrize(("level", "outcome"), [("480", "failed"), ("10", "failed"), ("600", "passed")])
def test_measured_throughput_below_half_fails_at_tolerance_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, level: str, outcome: str
) -> None:
    pytester.makepyfile(test_throughput_rule=THROUGHPUT)
    pytester.runpytest("--gate-hardware", "hw-a", "--gate-update").assert_outcomes(passed=1)
    monkeypatch.setenv("LEVEL", level)
    result = pytester.runpytest("--gate-hardware", "hw-a")
    result.assert_outcomes(**{outcome: 1})
    if outcome == "failed":
        result.stdout.fnmatch_lines(["*request_throughput*regressed (measured*higher is better, tolerance 100.00%*"])
