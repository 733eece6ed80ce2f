"""``vramgate report compare``: two gate runs' report.json side by side, each metric judged by its own rule.

The reports come from real pytester runs of small gated tests whose figures move by environment variables.
Measured samples are seeded and far apart (or drawn from one distribution) so that the U test's verdicts are
certain, not a matter of chance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from vramgate.report import Comparison, ReportError, compare_report_files, compare_reports, load_report
from vramgate.tools.cli import main

TEST_FILE = """
import os
import random

def env(name, default):
    return float(os.environ.get(name, default))

def test_exact(gate):
    gate.record("page_bytes", int(env("PAGE", "65536")), unit="B")
    gate.record("capacity", int(env("CAP", "8192")), unit="tokens", better="higher")
    gate.record("blocks", int(env("BLOCKS", "100")), unit="blocks", tolerance=0.1)
    if os.environ.get("EXTRA"):
        gate.record("extra", 1, unit="count")
    else:
        gate.record("dropped", 1, unit="count")

def test_measured(gate):
    rng = random.Random(int(env("SEED", "1")))
    gate.record_samples("ttft", [env("TTFT", "0.010") * rng.gauss(1, 0.01) for _ in range(40)], unit="s")
    gate.record_samples("tput", [env("TPUT", "100") * rng.gauss(1, 0.01) for _ in range(40)], unit="tokens/s",
                        better="higher")

def test_paired(gate):
    rng = random.Random(int(env("SEED", "1")) + 7)
    reference = [rng.gauss(1.0, 0.01) for _ in range(30)]
    candidate = [r * env("RATIO", "0.7") * rng.gauss(1, 0.005) for r in reference]
    gate.record_paired("step_ratio", reference, candidate, tolerance=0.1)
"""


def run(pytester: pytest.Pytester, out: str, hardware: str = "hw-a", **env: str) -> Path:
    """One gate run of TEST_FILE with *env* set; its report folder."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        pytester.runpytest("--gate-hardware", hardware, "--gate-missing=skip", "--gate-report", out)
    return pytester.path / out


@pytest.fixture
def old(pytester: pytest.Pytester) -> Path:
    """The first run's report folder."""
    pytester.makepyfile(test_gated=TEST_FILE)
    return run(pytester, "old")


def compare(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``vramgate report compare *args``: its exit status, stdout and stderr (the runs' output drained first)."""
    capsys.readouterr()
    status = main(["report", "compare", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def verdicts(comparison: Comparison) -> dict[str, str]:
    return {r.metric: r.verdict for r in (*comparison.rows, *comparison.added, *comparison.removed)}


def test_regressions_improvements_and_equal_figures_of_every_kind(
    pytester: pytest.Pytester, old: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = run(pytester, "new", PAGE="81920", CAP="16384", BLOCKS="105", EXTRA="1", SEED="2", TTFT="0.015",
              TPUT="100", RATIO="0.95")
    comparison = compare_report_files(old, new / "report.json", labels=("before", "after"))
    assert verdicts(comparison) == {
        "page_bytes": "regressed", "capacity": "improved", "blocks": "ok",  # exact: +25%, x2, +5% within 10%
        "ttft": "regressed", "tput": "ok",  # measured: +50%; the same distribution, another seed
        "step_ratio": "regressed",  # paired ratios 0.7 -> 0.95, beyond their 10%
        "extra": "added", "dropped": "removed",
    }
    assert {r.metric for r in comparison.regressions} == {"page_bytes", "ttft", "step_ratio"}
    page = next(r for r in comparison.rows if r.metric == "page_bytes")
    assert (page.old, page.new, page.change, page.scope) == (65536, 81920, 0.25, "portable")
    assert page.decided_by == "exact, lower is better, tolerance 0.00%"
    ttft = next(r for r in comparison.rows if r.metric == "ttft")
    assert ttft.decided_by.startswith("measured, median of 40 vs 40 samples, lower is better, tolerance 5.00%")
    assert ttft.change == pytest.approx(0.5, abs=0.02)
    removed = comparison.removed[0]
    assert (removed.old, removed.new, removed.reason) == (1, None, "not in after")

    status, text, _ = compare(capsys, old, new, "--markdown", pytester.path / "c.md")
    assert status == 1
    lines = text.splitlines()
    assert lines[0] == "vramgate compare: A -> B"
    assert "Same software versions" in lines
    assert ("6 metric(s) in both: 3 regressed, 0 incompatible, 1 improved, 2 ok (1 unchanged), 0 not compared; "
            "1 added, 1 removed") in lines
    # Grouped by suite (the test file), regressions first; the unchanged measured tput is left out.
    table = lines[lines.index("suite gated") + 1:]
    order = [line.split()[1] for line in table[2:] if line.startswith("  test_")]
    assert order == ["page_bytes", "ttft", "step_ratio", "dropped", "extra", "capacity", "blocks"]
    assert ["test_exact", "page_bytes", "64.00 KiB", "80.00 KiB", "+25.00%", "regressed",
            "exact, lower is better, tolerance 0.00%"] in [re.split(r"\s{2,}", line.strip()) for line in table]
    assert lines[-1] == "1 unchanged metric(s) not listed (--all lists them)"
    markdown = (pytester.path / "c.md").read_text()
    assert markdown.startswith("## vramgate compare: A -> B: ❌ 3 regression(s)")
    assert "| `test_gated.py::test_exact` | page_bytes | 64.00 KiB | 80.00 KiB | +25.00% | regressed |" in markdown

    status, listed, _ = compare(capsys, old, new, "--all")
    assert status == 1
    assert "test_measured  tput" in listed and "not listed" not in listed


def test_improvements_only_exit_zero_and_json(
    pytester: pytest.Pytester, old: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = run(pytester, "new", CAP="16384", TTFT="0.005", TPUT="300", RATIO="0.5")
    status, out, _ = compare(capsys, old, new, "--json")
    assert status == 0
    data = json.loads(out)
    got = {r["metric"]: r["verdict"] for r in data["rows"]}
    assert got == {"page_bytes": "ok", "capacity": "improved", "blocks": "ok", "dropped": "ok", "ttft": "improved",
                   "tput": "improved", "step_ratio": "improved"}
    assert data["counts"]["regressed"] == 0 and data["counts"]["unchanged"] == 3
    assert data["hardware_differs"] is False and data["software_changes"] == []
    assert data["old"]["hardware_key"] == "hw-a" and data["added"] == [] and data["removed"] == []


def test_a_run_against_itself_is_all_unchanged(old: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = compare(capsys, old, old / "report.json")
    assert status == 0
    lines = out.splitlines()
    assert "suite gated" not in lines
    assert lines[-1] == "7 unchanged metric(s) not listed (--all lists them)"


def test_other_hardware_leaves_machine_bound_metrics_uncompared(
    pytester: pytest.Pytester, old: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = run(pytester, "new", hardware="hw-b", PAGE="81920", TTFT="0.020")
    comparison = compare_report_files(old, new)
    assert comparison.hardware_differs
    got = verdicts(comparison)
    # Portable (exact) metrics are compared; measured and paired ones are machine-bound.
    assert got["page_bytes"] == "regressed" and got["blocks"] == "ok"
    assert got["ttft"] == got["tput"] == got["step_ratio"] == "not compared"
    ttft = next(r for r in comparison.rows if r.metric == "ttft")
    assert ttft.reason == "machine-bound, and the hardware keys differ" and not ttft.failed
    status, out, _ = compare(capsys, old, new)
    assert status == 1
    assert ("!! Hardware keys differ (hw-a vs hw-b): machine-bound metrics are not compared, portable ones are"
            in out.splitlines())


def test_other_tiers_compare_nothing(old: Path) -> None:
    after = load_report(old)
    after["hardware"].update(key="gpu-h100", tier="cuda")
    comparison = compare_reports(load_report(old), after)
    assert {r.verdict for r in comparison.rows} == {"not compared"}
    assert {r.reason for r in comparison.rows} == {"the tiers differ"}
    assert "!! Tiers differ (cpu vs cuda): no metric is compared" in comparison.header_lines()


def test_labels_and_software_versions_in_memory(old: Path) -> None:
    before = load_report(old)
    after = json.loads(json.dumps(before))
    before["software"]["vllm"], after["software"]["vllm"] = "0.31.0", "0.32.0"
    comparison = compare_reports(before, after, labels=("vLLM 0.31.0", "vLLM 0.32.0"))
    assert comparison.software_changes == ["vllm 0.31.0 -> 0.32.0"]
    assert comparison.labels == ("vLLM 0.31.0", "vLLM 0.32.0") and not comparison.regressions
    text = comparison.text(everything=True)
    assert "Software differs: vllm 0.31.0 -> 0.32.0" in text
    heads = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.startswith("  test ")]
    assert heads == [["test", "metric", "vLLM 0.31.0", "vLLM 0.32.0", "change", "verdict", "decided by"]]
    assert text.splitlines()[1].startswith("vLLM 0.31.0: hardware hw-a (tier cpu); ")
    del after["tests"][0]["metrics"][0]["now"]
    with pytest.raises(ReportError, match=r"^vLLM 0\.32\.0: test test_gated\.py::test_exact: metric 'page_bytes' "):
        compare_reports(before, after, labels=("vLLM 0.31.0", "vLLM 0.32.0"))


def test_a_removed_metric_of_a_failing_test_says_so(pytester: pytest.Pytester, old: Path) -> None:
    after = load_report(old)
    test = next(t for t in after["tests"] if t["nodeid"].endswith("test_paired"))
    test["test_passed"], test["metrics"], test["rows"] = False, [], []
    comparison = compare_reports(load_report(old), after, labels=("old", "new"))
    assert [(r.metric, r.reason) for r in comparison.removed] == [("step_ratio", "the test failed in new")]


def test_an_incompatible_metric_fails(old: Path) -> None:
    after = load_report(old)
    metric = next(m for t in after["tests"] for m in t["metrics"] if m["name"] == "blocks")
    metric["now"]["unit"] = "count"
    comparison = compare_reports(load_report(old), after)
    row = next(r for r in comparison.rows if r.metric == "blocks")
    assert row.verdict == "incompatible" and row.failed and comparison.regressions == [row]


def report_with(old: Path, change: str) -> dict[str, Any]:
    """The first run's report data with one thing broken (*change* names it)."""
    data = load_report(old)
    metric = data["tests"][0]["metrics"][0]
    if change == "no now":
        del metric["now"]
    elif change == "no unit":
        del metric["now"]["unit"]
    elif change == "no samples":
        metric = next(m for t in data["tests"] for m in t["metrics"] if m["now"]["kind"] == "measured")
        del metric["now"]["samples"]
    elif change == "no name":
        del metric["name"]
    elif change == "schema":
        data["schema"] = 4
    elif change == "tests":
        data["tests"] = {}
    elif change == "no key":
        del data["hardware"]["key"]
    return data


@pytest.mark.parametrize(("change", "message"), [
    ("no now", r"bad\.json: test test_gated\.py::test_exact: metric 'page_bytes' has no 'now' figure"),
    ("no unit", r"bad\.json: test test_gated\.py::test_exact: metric 'page_bytes': now: missing field 'unit'"),
    ("no samples", r"bad\.json: test test_gated\.py::test_measured: metric 'ttft': now\.samples: a measured metric "
                   r"needs its samples"),
    ("no name", r"bad\.json: test test_gated\.py::test_exact: metrics\[0\] has no name"),
    ("schema", r"bad\.json: report\.json of schema 4, newer than this vramgate reads \(schema 3\): upgrade vramgate"),
    ("tests", r"bad\.json: tests: must be a list"),
    ("no key", r"bad\.json: hardware: must be an object with a key"),
])
def test_bad_reports_name_the_file_and_the_entry(pytester: pytest.Pytester, old: Path, change: str,
                                                 message: str) -> None:
    bad = pytester.path / "bad.json"
    bad.write_text(json.dumps(report_with(old, change)))
    with pytest.raises(ReportError, match=message):
        compare_report_files(old, bad)


def test_bad_input_on_the_command_line_exits_2(pytester: pytest.Pytester, old: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    p = pytester.path
    (p / "broken.json").write_text('{"schema": 1,')
    (p / "list.json").write_text("[]")
    (p / "empty").mkdir()
    cases = {
        str(p / "absent.json"): "absent.json: no such file",
        str(p / "empty"): "empty holds no report.json",
        str(p / "broken.json"): "broken.json: not valid JSON (line 1, column 14: Expecting property name",
        str(p / "list.json"): "list.json: not a vramgate report.json: the top level must be a JSON object",
    }
    for path, message in cases.items():
        status, _, err = compare(capsys, old, path)
        assert status == 2
        assert err.startswith("vramgate: error: ") and message in err, err


def test_a_budget_only_figure_is_not_compared_between_runs() -> None:
    """Note [budget-only figures]: the tail percentile of one load is held to its budgets, never to another run's
    figure; report compare says so instead of calling a noisy p90 regressed (it did, at tolerance 0)."""
    from vramgate.core.metrics import Metric
    from vramgate.report.compare import compare_reports

    def one(value: float) -> dict[str, Any]:
        metric = Metric("itl_p90", value, "s", scope="machine", history=False)
        return {"schema": 1, "hardware": {"key": "hw", "tier": "cpu"}, "software": {},
                "tests": [{"nodeid": "t.py::test_load", "suite": "serving",
                           "metrics": [{"name": "itl_p90", "now": metric.to_json()}]}]}

    (row,) = compare_reports(one(0.007), one(0.012)).rows
    assert row.verdict == "not compared" and "held to its budgets only" in row.reason
    assert not row.failed
