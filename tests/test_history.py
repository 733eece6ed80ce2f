"""The history of stored values read from git, report points merged in, the drift rule, ``vramgate history``."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vramgate.core.drift import DriftRule, check_drift, first_drift, kendall_trend_p, sen_slope
from vramgate.core.metrics import Metric
from vramgate.core.provenance import Provenance
from vramgate.store import (
    HistoryError,
    SeriesKey,
    baseline_history,
    history_json,
    merge_history,
    report_points,
    select,
)
from vramgate.store.baselines import DirectoryStorage, NodeBaseline
from vramgate.tools.cli import main

NODE = "suites/kv/test_kv.py::test_kv"
OTHER = "suites/kv/test_kv.py::test_other"
KEY = SeriesKey("kv", NODE, "page_bytes", "cpu")


class Repo:
    """A git repository in a temporary folder whose commits write baselines through the store's own writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.day = 0
        path.mkdir()
        self.git("init", "-q", "-b", "main")

    def git(self, *args: str, date: str | None = None) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
        if date:
            env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
        out = subprocess.run(["git", *args], cwd=self.path, env=env, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def commit(self, message: str) -> str:
        self.day += 1
        self.git("add", "-A")
        self.git("commit", "-qm", message, date=f"2025-01-{self.day:02d}T12:00:00+02:00")
        return self.git("rev-parse", "HEAD")

    def record(self, value: float, *, vllm: str = "0.32.0", node: str = NODE, better: str = "lower",
               key: str = "cpu") -> str:
        """Write *value* as *node*'s ``page_bytes`` (through :class:`DirectoryStorage`) and commit it."""
        metric = Metric("page_bytes", value, "B", better=better)  # type: ignore[arg-type]
        recorded = Provenance(commit=None, date=f"2025-01-{self.day + 1:02d}T09:00:00Z",
                              software={"python": "3.11.7", "torch": "2.9.0", "vllm": vllm})
        DirectoryStorage(self.path / "baselines").update(
            key, "kv", {"device": "cpu"}, {node: NodeBaseline({"page_bytes": metric}, recorded)})
        return self.commit(f"record {value}")

    def write(self, text: str) -> str:
        """Commit *text* as the baseline file itself (to make a malformed version)."""
        (self.path / "baselines" / "cpu" / "kv.json").write_text(text, encoding="utf-8")
        return self.commit("hand edit")

    def unlink(self) -> None:
        """Remove the baseline file from the work tree (not committed)."""
        (self.path / "baselines" / "cpu" / "kv.json").unlink()


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    """An empty git repository."""
    return Repo(tmp_path / "repo")


@pytest.fixture
def five(repo: Repo) -> tuple[Repo, list[str]]:
    """Five commits, each accepting a new ``page_bytes``, the last two with another vLLM."""
    values = [(16384, "0.31.0"), (18432, "0.31.0"), (20480, "0.32.0"), (18432, "0.32.0"), (24576, "0.33.0")]
    return repo, [repo.record(v, vllm=vllm) for v, vllm in values]


# -- the store layer ---------------------------------------------------------------------------------------------


def test_five_commits_give_five_values_in_order_with_their_provenance(five: tuple[Repo, list[str]]) -> None:
    repo, commits = five
    history = baseline_history(repo.path)
    assert list(history) == [KEY] and history.warnings == []
    points = history[KEY]
    assert [p.value for p in points] == [16384, 18432, 20480, 18432, 24576]
    assert [p.commit for p in points] == commits
    assert [p.date for p in points] == [f"2025-01-0{d}T10:00:00Z" for d in range(1, 6)]  # the commit's, in UTC
    assert [p.software["vllm"] for p in points] == ["0.31.0", "0.31.0", "0.32.0", "0.32.0", "0.33.0"]
    assert {(p.source, p.unit, p.hardware_key, p.better, p.kind, p.file) for p in points} == {
        ("baseline", "B", "cpu", "lower", "exact", "baselines/cpu/kv.json")}


def test_a_commit_that_leaves_a_value_as_it_was_is_collapsed_into_the_first(repo: Repo) -> None:
    first = repo.record(100)
    repo.record(100, vllm="0.33.0")  # re-recorded, same figure: one point, the first commit's
    repo.record(50, node=OTHER)  # the file changes for another test only
    third = repo.record(120)
    points = baseline_history(repo.path)[KEY]
    assert [(p.commit, p.value, p.software["vllm"]) for p in points] == [(first, 100, "0.32.0"), (third, 120, "0.32.0")]
    assert [p.value for p in baseline_history(repo.path)[SeriesKey("kv", OTHER, "page_bytes", "cpu")]] == [50]


def test_a_version_that_does_not_parse_is_skipped_with_a_warning_naming_commit_and_file(repo: Repo) -> None:
    repo.record(100)
    bad = repo.write("{ not json")
    repo.unlink()  # the store never overwrites a file it cannot parse: a person repairs it
    repo.record(110)
    wrong = repo.write(json.dumps({"schema": 9, "suite": "kv", "tests": {}}))
    repo.unlink()
    repo.record(120)
    history = baseline_history(repo.path)
    assert [p.value for p in history[KEY]] == [100, 110, 120]
    assert len(history.warnings) == 2
    assert history.warnings[0].startswith(f"commit {bad[:12]} ")
    assert "baselines/cpu/kv.json: not valid JSON (line 1, column 3" in history.warnings[0]
    assert history.warnings[0].endswith("this version skipped")
    assert f"commit {wrong[:12]}" in history.warnings[1] and "schema 9, newer than" in history.warnings[1]


def test_a_merged_branch_is_one_point_named_by_its_merge(repo: Repo) -> None:
    first = repo.record(100)
    repo.git("checkout", "-qb", "feature")
    repo.record(104)
    repo.record(108)
    repo.git("checkout", "-q", "main")
    repo.git("merge", "-q", "--no-ff", "-m", "merge feature", "feature", date="2025-01-09T00:00:00Z")
    merge = repo.git("rev-parse", "HEAD")
    points = baseline_history(repo.path)[KEY]
    assert [(p.commit, p.value) for p in points] == [(first, 100), (merge, 108)]
    assert [p.value for p in baseline_history(repo.path, rev="feature")[KEY]] == [100, 104, 108]


def test_key_suite_and_selector_narrow_the_history(repo: Repo) -> None:
    repo.record(100)
    repo.record(7, key="cpu-x86_64-avx2-test", node=OTHER)
    assert set(baseline_history(repo.path, key="cpu")) == {KEY}
    assert baseline_history(repo.path, suite="nope") == {}
    history = baseline_history(repo.path)
    assert set(select(history, "test_other")) == {SeriesKey("kv", OTHER, "page_bytes", "cpu-x86_64-avx2-test")}
    assert set(select(history, "page_bytes", key="cpu")) == {KEY}
    assert set(select(history, "kv")) == set(history)


def test_outside_a_repository_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="not in a git repository"):
        baseline_history(tmp_path)


def report(tmp: Path, name: str, value: float, **extra: Any) -> Path:
    """A ``report.json`` in the shape the gate writes (:func:`vramgate.report.report_data`), one test."""
    now = Metric("page_bytes", value, "B").to_json()
    machine = Metric("weights_bytes", value * 2, "B", scope="machine").to_json()
    data = {"schema": 1, "hardware": {"key": "cpu-x86_64-avx512-test", "tier": "cpu"},
            "software": {"vllm": "0.32.0", "torch": "2.9.0"}, **extra,
            "tests": [{"nodeid": NODE, "suite": "kv", "test_passed": True, "failed": False,
                       "metrics": [{"name": "page_bytes", "now": now}, {"name": "weights_bytes", "now": machine}]},
                      {"nodeid": OTHER, "suite": "kv", "test_passed": False, "failed": True,
                       "metrics": [{"name": "page_bytes", "now": now}]}]}
    path = tmp / name / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_report_points_merge_between_the_accepted_values_by_date(five: tuple[Repo, list[str]], tmp_path: Path) -> None:
    repo, _ = five
    report(tmp_path / "runs", "a", 19000, commit="abc123", date="2025-01-03T18:00:00+00:00")
    undated = report(tmp_path / "runs", "b", 21000)
    os.utime(undated, (1735819200, 1735819200))  # 2025-01-02T12:00:00Z
    points = report_points([tmp_path / "runs"])
    assert set(points) == {KEY, SeriesKey("kv", NODE, "weights_bytes", "cpu-x86_64-avx512-test")}  # by scope
    merged = merge_history(baseline_history(repo.path), points)
    series = merged[KEY]
    assert [(p.value, p.source) for p in series] == [
        (16384, "baseline"), (18432, "baseline"), (21000, "report"), (20480, "baseline"), (19000, "report"),
        (18432, "baseline"), (24576, "baseline")]
    assert (series[2].commit, series[2].date) == (str(undated), "2025-01-02T12:00:00Z")  # the file names it
    assert (series[4].commit, series[4].date, series[4].software["vllm"]) == (
        "abc123", "2025-01-03T18:00:00Z", "0.32.0")
    assert SeriesKey("kv", OTHER, "page_bytes", "cpu") not in merged  # its test failed its own assertions


def test_a_file_that_is_not_a_report_is_named(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("[]", encoding="utf-8")
    with pytest.raises(HistoryError, match=r"x\.json: not a vramgate report.json"):
        report_points([tmp_path / "x.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(HistoryError, match=r"no report\.json in this folder"):
        report_points([tmp_path / "empty"])
    with pytest.raises(HistoryError, match="no such file or folder"):
        report_points([tmp_path / "missing.json"])
    bad = report(tmp_path, "r", 1)
    data = json.loads(bad.read_text())
    data["tests"][0]["metrics"][0]["now"]["unit"] = "furlongs"
    bad.write_text(json.dumps(data))
    with pytest.raises(HistoryError, match=r"metric '[a-z_]+': now\.unit: unknown unit 'furlongs'"):
        report_points([bad])


def test_history_json_is_plain_data_per_series(five: tuple[Repo, list[str]]) -> None:
    repo, commits = five
    (entry,) = history_json(baseline_history(repo.path))
    assert {k: entry[k] for k in ("suite", "test", "metric", "unit", "hardware_key")} == {
        "suite": "kv", "test": NODE, "metric": "page_bytes", "unit": "B", "hardware_key": "cpu"}
    assert entry["points"][0] == {"commit": commits[0], "date": "2025-01-01T10:00:00Z", "value": 16384,
                                  "source": "baseline"}
    json.dumps(entry)


# -- the drift rule ----------------------------------------------------------------------------------------------

#: Noise of the synthetic series: multiplicative, lognormal, with this coefficient of variation.
CV = 0.05
#: The documented bound on the false-alarm rate over 1,000 flat series of 60 merges (measured: 0 of 1,000).
FALSE_ALARM_BOUND = 3 / 1000
#: The documented number of merges within which a +2%-per-merge series is flagged (measured: 9 to 21).
DETECTION_WITHIN = 21


def synthetic(seed: int, merges: int, step: float, cv: float = CV) -> list[float]:
    """A series of *merges* values growing by *step* per merge, with lognormal noise of CV *cv* (mean 1)."""
    rng = random.Random(seed)
    s = math.sqrt(math.log1p(cv * cv))
    return [1000.0 * (1 + step) ** i * math.exp(rng.gauss(-s * s / 2, s)) for i in range(merges)]


def test_a_flat_noisy_series_is_not_flagged_in_1000_trials() -> None:
    alarms = [first_drift(synthetic(seed, 60, 0.0), "lower") for seed in range(1000)]
    rate = sum(a is not None for a in alarms) / len(alarms)
    assert rate <= FALSE_ALARM_BOUND, f"false-alarm rate {rate:.2%} over 1,000 flat series of 60 merges"


def test_a_creep_of_2_percent_per_merge_is_flagged_within_the_documented_merges() -> None:
    delays = [first_drift(synthetic(10**6 + seed, 60, 0.02), "lower") for seed in range(1000)]
    found = [d for d in delays if d is not None]
    assert len(found) == 1000, f"{1000 - len(found)} creeping series never flagged"
    assert max(found) <= DETECTION_WITHIN
    assert 14 <= statistics.median(found) <= 18  # measured: 16
    # Higher is better: the same creep toward worse is a fall, and is found as soon.
    falling = [first_drift([1 / v for v in synthetic(10**6 + seed, 60, 0.02)], "higher") for seed in range(200)]
    assert falling == delays[:200]


def test_exact_series_flat_never_creeping_at_the_fewest_points() -> None:
    assert first_drift([18432.0] * 60, "lower") is None
    assert first_drift([1000 * 1.02**i for i in range(60)], "lower") == 9
    assert first_drift([1000 * 1.005**i for i in range(60)], "lower") == 11  # +5.1% over 10 merges
    assert first_drift([1000 * 1.001**i for i in range(60)], "lower") is None  # 2.4% over the window: too small
    assert first_drift([1000 * 1.02**i for i in range(60)], "higher") is None  # rising throughput is better
    verdict = check_drift([1000 * 1.02**i for i in range(30)], "lower")
    assert verdict.drifting and verdict.points == 25
    assert verdict.change == pytest.approx(1.02**24 - 1) and verdict.per_merge == pytest.approx(0.02)
    assert verdict.reason.startswith("drifting: +60.84% worse over the last 25 values (+2.00% per value)")


def test_series_with_zeros_are_judged_on_their_own_scale() -> None:
    rising = [0.0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]
    verdict = check_drift(rising, "lower")
    assert verdict.drifting and verdict.per_merge == pytest.approx(sen_slope(rising) / statistics.median(rising))
    assert not check_drift([0.0] * 12, "lower").drifting


def test_kendall_exact_p_value_matches_every_ordering() -> None:
    n = 6
    scores = []
    for perm in itertools.permutations(range(n)):
        scores.append(sum((perm[j] > perm[i]) - (perm[j] < perm[i]) for i in range(n) for j in range(i + 1, n)))
    for values in ([0, 1, 2, 3, 4, 5], [1, 0, 2, 4, 3, 5], [5, 4, 3, 2, 1, 0], [2, 0, 5, 1, 4, 3]):
        s = sum((values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n))
        assert kendall_trend_p([float(v) for v in values]) == pytest.approx(
            sum(x >= s for x in scores) / len(scores))
    assert kendall_trend_p([1.0, 1, 1, 1]) == 1.0
    assert kendall_trend_p([1.0, 1, 2, 2, 3, 3, 4, 4, 5, 5]) < 1e-3  # ties: the normal approximation


def test_too_few_values_and_bad_parameters() -> None:
    verdict = check_drift([1.0, 2, 3], "lower")
    assert not verdict.drifting and verdict.reason == "too few values to judge (3; the rule needs 9)"
    with pytest.raises(ValueError, match="min_points <= window"):
        DriftRule(window=5, min_points=9)
    with pytest.raises(ValueError, match="alpha must be between 0 and 1"):
        DriftRule(alpha=0)
    with pytest.raises(ValueError, match="better must be"):
        check_drift([1.0] * 10, "up")  # type: ignore[arg-type]


# -- vramgate history --------------------------------------------------------------------------------------------


def test_the_command_prints_each_value_with_provenance(five: tuple[Repo, list[str]],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    repo, commits = five
    assert main(["history", "page_bytes", "--root", str(repo.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kv  {NODE}  page_bytes  [cpu]  (exact, lower is better; 5 value(s))"
    rows = [line.split() for line in lines[3:8]]
    assert [r[0] for r in rows] == [c[:12] for c in commits]
    assert [r[-4] for r in rows] == ["-", "+12.50%", "+11.11%", "-10.00%", "+33.33%"]
    assert [r[-2:] for r in rows][-1] == ["0.33.0", "2.9.0"]
    assert "24,576 B (24.00 KiB)" in lines[7]


def test_the_command_exit_codes_and_json(repo: Repo, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(10):
        repo.record(round(18432 * 1.02**i))
    root = ["--root", str(repo.path)]
    assert main(["history", *root, "--drift"]) == 0  # --drift reports, does not fail
    out = capsys.readouterr().out
    assert "drift: drifting: +19.51% worse over the last 10 values" in out and "1 of 1 series drifting" in out
    assert main(["history", *root, "--fail-on-drift"]) == 1
    capsys.readouterr()
    assert main(["history", *root, "--json", "--drift", "--reports", str(report(tmp_path, "r", 23000))]) == 0
    data = json.loads(capsys.readouterr().out)
    series = {(s["metric"], s["hardware_key"]): s for s in data["series"]}
    kv = series["page_bytes", "cpu"]
    assert [p["source"] for p in kv["points"]][-1] == "report" and len(kv["points"]) == 11
    assert kv["points"][1]["change"] == pytest.approx(18801 / 18432 - 1)
    assert kv["drift"]["drifting"] is True and data["drift_rule"]["window"] == 25 and data["drifting"] == 1
    assert main(["history", "no-such-metric", *root]) == 2
    assert "no stored metric's test, name or suite contains 'no-such-metric'" in capsys.readouterr().err
    outside = tmp_path / "plain"
    outside.mkdir()
    assert main(["history", "--root", str(outside)]) == 2
    assert "not in a git repository" in capsys.readouterr().err


def test_the_command_on_a_flat_history_passes_and_warns_on_stderr(repo: Repo,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(10):
        repo.record(18432 + (i % 2))
    repo.write("{")
    assert main(["history", "--root", str(repo.path), "--fail-on-drift"]) == 0
    out, err = capsys.readouterr()
    assert "0 of 1 series drifting" in out
    assert "vramgate: warning: commit " in err and "baselines/cpu/kv.json: not valid JSON" in err
