"""Seconds per test in report.json, the durations file, and the longest-first order under pytest-xdist
(Note [longest first] in vramgate.store.durations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramgate.store.durations import (
    UNKNOWN_S,
    DurationsError,
    check_durations,
    durations_text,
    read_durations,
    worker_order,
)
from vramgate.tools.cli import main

TESTS = """
import os, time

import pytest


@pytest.mark.parametrize("name", ["short", "long", "middle", "unknown"])
def test_sleep(gate, name):
    gate.record("n", 1, unit="count")
    time.sleep({"short": 0.05, "long": 0.6, "middle": 0.3, "unknown": 0.0}[name])
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'serial')} {name}\\n")


@pytest.mark.gate_nightly("left out with -m")
@pytest.mark.parametrize("name", ["a", "b"])
def test_nightly(name):
    pass
"""


def test_one_worker_runs_longest_first_with_ties_in_order_and_unknown_tests_at_half_a_second() -> None:
    ids = ["a", "b", "c", "d", "e"]
    assert UNKNOWN_S == 0.5
    assert worker_order(ids, {"a": 0.1, "b": 5.0, "c": 0.1, "e": 2.0}, 1) == [1, 4, 3, 0, 2]
    assert worker_order(ids, {}, 1) == [0, 1, 2, 3, 4]


def test_workers_get_equally_many_tests_of_about_equal_seconds() -> None:
    seconds = {"s1": 32.0, "s2": 31.0, "p1": 25.0, "p2": 25.0, "p3": 24.0, "e1": 20.0, "e2": 16.0}
    ids = [*seconds, *(f"quick{i}" for i in range(9))]  # 16 tests, 9 of them unknown (0.5 s)
    order = worker_order(ids, seconds, 2)
    first, second = [ids[i] for i in order[:8]], [ids[i] for i in order[8:]]
    assert first[0] == "s1" and second[0] == "s2"  # the two longest start at once, on different workers
    total = [sum(seconds.get(n, UNKNOWN_S) for n in run) for run in (first, second)]
    # Greedy dealing is off by at most one test (the last long one, 16 s); collection order would give 173 / 4.5.
    assert abs(total[0] - total[1]) <= 16.0
    assert sorted(order) == list(range(16))
    # Three workers and 10 tests: worksteal gives them 3, 3 and 4.
    order = worker_order([f"t{i}" for i in range(10)], {f"t{i}": float(i) for i in range(10)}, 3)
    runs = [order[:3], order[3:6], order[6:]]
    assert [len(r) for r in runs] == [3, 3, 4]
    assert all(r == sorted(r, reverse=True) for r in runs)
    assert worker_order([], {}, 2) == []


def test_references_start_first_on_different_workers() -> None:
    seconds = {"sim[base]": 24.0, "sim[a]": 31.0, "eng[base]": 8.0, "eng[a]": 14.0, "lat[a]": 27.0, "lat[b]": 25.0}
    ids = list(seconds)
    order = worker_order(ids, seconds, 2, first=[0, 2])
    runs = [[ids[i] for i in order[:3]], [ids[i] for i in order[3:]]]
    # Each reference leads a run; the longest profile test goes after the shorter reference, so the other
    # worker has finished the reference it needs by then.
    assert runs == [["sim[base]", "lat[a]", "eng[a]"], ["eng[base]", "sim[a]", "lat[b]"]]


def test_bad_files_name_the_file_and_the_entry(tmp_path: Path) -> None:
    with pytest.raises(DurationsError, match="no such durations file"):
        read_durations(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(DurationsError, match=r"bad\.json: not valid JSON \(line 1"):
        read_durations(bad)
    for data, why in (([1], "expected an object"), ({"t": -1}, "entry 't'"), ({"t": "3"}, "entry 't'"),
                      ({"t": True}, "entry 't'"), ({"t": float("nan")}, "entry 't'")):
        with pytest.raises(DurationsError, match=why):
            check_durations(data, "where")
    assert json.loads(durations_text({"b": 2.04, "a": 0.2, "c": 0.61}, min_s=0.5)) == {"b": 2.0, "c": 0.6}


def test_report_records_durations_and_the_file_orders_xdist_workers(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_sleepy=TESTS)
    log = pytester.path / "order.log"
    monkeypatch.setenv("ORDER_LOG", str(log))
    result = pytester.runpytest_subprocess("--gate-report", "rep", "--gate-missing", "record", "-m",
                                           "not gate_nightly")
    result.assert_outcomes(passed=4)
    data = json.loads((pytester.path / "rep" / "report.json").read_text())
    seconds = {k.split("[")[1].rstrip("]"): v for k, v in data["durations"].items()}
    # Lower bounds only: each test sleeps at least this long, however busy the machine.
    assert seconds["long"] >= 0.6 and seconds["middle"] >= 0.3 and seconds["short"] >= 0.05
    out = pytester.path / "durations.json"
    assert main(["report", "durations", str(pytester.path / "rep"), "--min-seconds", "0.02",
                 "--out", str(out)]) == 0
    written = read_durations(out)
    # Each of these slept at least 0.05 s, so each passes --min-seconds 0.02 (the 0-second one may or may not).
    assert {k.split("[")[1].rstrip("]") for k in written} >= {"long", "middle", "short"}
    # The ordering below is checked against fixed seconds, not this machine's (which depend on its load), and
    # a long nightly test in the file must not count once -m has left it out.
    fixed = {"long": 0.6, "middle": 0.3, "short": 0.05}
    written = {f"test_sleepy.py::test_sleep[{name}]": seconds for name, seconds in fixed.items()}
    written["test_sleepy.py::test_nightly[a]"] = 9.0
    out.write_text(json.dumps(written), encoding="utf-8")
    assert "wrote" in capsys.readouterr().out
    # Serial: collection order, the file or not.
    log.unlink()
    pytester.runpytest_subprocess(f"--gate-durations={out}", "-m", "not gate_nightly").assert_outcomes(passed=4)
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["short", "long", "middle", "unknown"]
    # One xdist worker: longest first, an unknown test at half a second.
    log.unlink()
    pytester.runpytest_subprocess("-n", "1", f"--gate-durations={out}", "-m",
                                  "not gate_nightly").assert_outcomes(passed=4)
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["long", "unknown", "middle", "short"]
    # Two workers under worksteal: two tests each, about equally long (0.6 + 0.05 and 0.5 + 0.3).
    log.unlink()
    pytester.runpytest_subprocess("-n", "2", "--dist", "worksteal", f"--gate-durations={out}", "-m",
                                  "not gate_nightly").assert_outcomes(passed=4)
    by_worker: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        worker, name = line.split()
        by_worker.setdefault(worker, []).append(name)
    assert sorted(by_worker.values()) == [["long", "short"], ["unknown", "middle"]]


def test_a_bad_durations_file_stops_the_run(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    (pytester.path / "d.json").write_text('{"test_one.py::test_one": "slow"}', encoding="utf-8")
    result = pytester.runpytest_subprocess("-n", "1", "--gate-durations=d.json")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--gate-durations: *d.json: entry 'test_one.py::test_one': seconds must be*"])


def test_report_without_durations_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema": 1, "tests": []}), encoding="utf-8")
    assert main(["report", "durations", str(report)]) == 2
    assert "records no durations" in capsys.readouterr().err


def test_tests_that_share_a_server_are_dealt_to_one_worker_one_after_the_other() -> None:
    seconds = {"serve[4rps]": 60.0, "serve[memory]": 50.0, "sim[a]": 31.0, "sim[b]": 30.0, "eng[a]": 20.0,
               "eng[b]": 20.0}
    ids = list(seconds)
    order = worker_order(ids, seconds, 2, together=[[0, 1]])
    runs = [[ids[i] for i in order[:3]], [ids[i] for i in order[3:]]]
    # Alone, the two longest would start on different workers (and each would start its own server).
    assert runs[0][:2] == ["serve[4rps]", "serve[memory]"], runs
    assert sorted(order) == list(range(6))
    assert worker_order(ids, seconds, 2)[:1] == [0] and worker_order(ids, seconds, 2)[3] == 1
