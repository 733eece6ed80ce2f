"""Pre-merge integrity: an installed plugin that stays out of other projects, baselines a change moves surfaced
first, and metrics in junit."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

UNRELATED = """
import subprocess, sys
def test_plain():
    assert 1 + 1 == 2

def test_leaves_a_child():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
"""


def test_an_unrelated_project_sees_nothing_of_the_gate(pytester: pytest.Pytester) -> None:
    golden = pytester.path / "baselines" / "golden"
    golden.mkdir(parents=True)
    (golden / "snap.json").write_text('{"not": "a vramgate baseline"}')
    pytester.makepyfile(test_plain=UNRELATED)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    out = result.stdout.str() + result.stderr.str()
    gate_lines = [line for line in out.splitlines() if "vramgate" in line and not line.startswith("plugins:")]
    assert gate_lines == [] and "hygiene" not in out
    time.sleep(1.0)  # the inner test's child ends before this test's own hygiene looks


def test_asking_for_the_gate_validates_baselines_again(pytester: pytest.Pytester) -> None:
    (pytester.path / "baselines" / "golden").mkdir(parents=True)
    (pytester.path / "baselines" / "golden" / "snap.json").write_text("{}")
    pytester.makepyfile(test_plain=UNRELATED)
    result = pytester.runpytest("--gate-missing", "fail")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unusable baseline file*snap.json: not a vramgate baseline file: schema is None*"])


def test_the_plugin_can_be_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv="def test_kv(gate):\n    gate.record('x', 1, unit='B')\n")
    result = pytester.runpytest("-p", "no:vramgate")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'gate' not found*"])


# -- baselines a change moves -------------------------------------------------------------------------------

KV = """
import os
def test_kv(gate):
    gate.record("page_bytes", int(os.environ.get("PAGE", "18432")), unit="B")
    gate.record("blocks", 100, unit="blocks", better="higher")
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project whose baselines are committed on its main branch."""
    pytester.makepyfile(test_kv=KV)
    pytester.runpytest("--gate-update").assert_outcomes(passed=1)
    git(pytester.path, "init", "-q", "-b", "main")
    git(pytester.path, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(pytester.path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return pytester


def test_a_change_that_rewrites_its_own_baseline_is_surfaced_first(
    repo: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGE", "20480")
    repo.runpytest("--gate-update").assert_outcomes(passed=1)  # the "PR" accepts its regression
    result = repo.runpytest("--gate-baselines-ref", "main", "--gate-report", "rep")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    head = out.index("BASELINES THIS CHANGE MOVES")
    assert head < out.index("metric(s) in 1 test(s)")
    result.stdout.fnmatch_lines([
        "*BASELINES THIS CHANGE MOVES (against main): 1 metric(s) in 1 file(s)*",
        "*file*test*metric*at ref*now stored*change*this run*",
        "*baselines/cpu/kv.json*test_kv*page_bytes*18,432 B*20,480 B*+11.11%*20,480 B (20.00 KiB), matches the new",
    ])
    md = (repo.path / "rep" / "report.md").read_text()
    assert md.index("Baselines this change moves") < md.index("### Metrics")
    assert md.splitlines()[2].startswith("> **1 baseline metric(s) moved")  # right under the title
    data = json.loads((repo.path / "rep" / "report.json").read_text())
    (moved,) = data["moved_baselines"]["metrics"]
    assert (moved["metric"], moved["old"], moved["new"], moved["now"]) == ("page_bytes", 18432, 20480, 20480)
    assert data["moved_baselines"]["ref"] == "main"


def test_no_section_when_no_baseline_moved(repo: pytest.Pytester) -> None:
    result = repo.runpytest("--gate-baselines-ref", "main", "--gate-report", "rep")
    result.assert_outcomes(passed=1)
    assert "MOVES" not in result.stdout.str()
    assert "moves" not in (repo.path / "rep" / "report.md").read_text()
    assert json.loads((repo.path / "rep" / "report.json").read_text())["moved_baselines"]["metrics"] == []


def test_added_and_removed_baselines_are_listed(repo: pytest.Pytester) -> None:
    repo.makepyfile(test_more="def test_new(gate):\n    gate.record('pages', 7, unit='blocks')\n")
    repo.runpytest("test_more.py", "--gate-update").assert_outcomes(passed=1)
    result = repo.runpytest("test_more.py", "--gate-baselines-ref", "main")
    result.stdout.fnmatch_lines(["*test_new*pages*(none)*7 blocks*added*"])


def test_an_unknown_ref_is_a_usage_error(repo: pytest.Pytester) -> None:
    result = repo.runpytest("--gate-baselines-ref", "no-such-ref")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-baselines-ref 'no-such-ref': not a commit of *"])


# -- junit ------------------------------------------------------------------------------------------------------


def test_metrics_are_properties_of_their_junit_test_case(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=KV)
    pytester.runpytest("--gate-update").assert_outcomes(passed=1)
    pytester.runpytest("--junitxml", "junit.xml").assert_outcomes(passed=1)
    case = ET.parse(pytester.path / "junit.xml").getroot().find(".//testcase")
    assert case is not None
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["vramgate.page_bytes"] == ("18432 B; baseline 18432 B; verdict ok; exact, lower is better, "
                                            "portable, tolerance 0")
    assert props["vramgate.blocks"].startswith("100 blocks; baseline 100 blocks; verdict ok")


# -- PR comments only where they belong ---------------------------------------------------------------------

HARNESS = r"""
const fs = require('fs');
const [scriptPath, prHead, runHead, listed] = process.argv.slice(2);
const calls = [], warnings = [];
const github = {
  paginate: async () => [],
  rest: {
    pulls: { get: async ({ pull_number }) => ({ data: { number: pull_number, head: { sha: prHead } } }) },
    issues: {
      listComments: 'listComments',
      updateComment: async (a) => calls.push(['update', a.issue_number]),
      createComment: async (a) => calls.push(['create', a.issue_number]),
    },
  },
};
const core = { info: () => {}, warning: (m) => warnings.push(m) };
const context = { repo: { owner: 'o', repo: 'r' },
  payload: { workflow_run: { id: 7, head_sha: runHead, pull_requests: JSON.parse(listed) } } };
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
new AsyncFunction('require', 'github', 'core', 'context', fs.readFileSync(scriptPath, 'utf8'))(
  require, github, core, context).then(() => console.log(JSON.stringify({ calls, warnings })));
"""


def comment(tmp_path: Path, number: str, pr_head: str, run_head: str, listed: list[int]) -> dict[str, list]:
    """Run pr-report.yml's comment script against fake GitHub APIs, with an artifact that names PR *number*."""
    import shutil

    import yaml  # type: ignore[import-untyped]

    node = shutil.which("node")
    if node is None:
        pytest.skip("needs node to run the workflow's script")
    flow = yaml.safe_load((Path(__file__).resolve().parents[1] / ".github/workflows/pr-report.yml").read_text())
    (step,) = [s for s in flow["jobs"]["comment"]["steps"] if "github-script" in s["uses"]]
    (tmp_path / "script.js").write_text(step["with"]["script"])
    (tmp_path / "harness.js").write_text(HARNESS)
    report = tmp_path / "reports" / "vramgate-report-cpu"
    report.mkdir(parents=True)
    (report / "report.md").write_text("## vramgate: pass\n")
    (report / "pr-number.txt").write_text(number)
    out = subprocess.run([node, "harness.js", "script.js", pr_head, run_head, json.dumps(
        [{"number": n} for n in listed])], cwd=tmp_path, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def test_the_comment_goes_to_the_pr_the_run_tested(tmp_path: Path) -> None:
    assert comment(tmp_path, "12", "abc", "abc", [12]) == {"calls": [["create", 12]], "warnings": []}


@pytest.mark.parametrize(("number", "pr_head", "listed", "why"), [
    ("13", "abc", [12], "PR #13 is not a PR of run 7"),  # a number the run does not know
    ("13", "fff", [], "PR #13 is at fff, the run tested abc"),  # a fork's run: checked against the PR's head
    ("12; rm -rf", "abc", [12], "bad PR number"),
])
def test_a_forged_number_gets_no_comment(tmp_path: Path, number: str, pr_head: str, listed: list[int],
                                         why: str) -> None:
    result = comment(tmp_path, number, pr_head, "abc", listed)
    assert result["calls"] == []
    assert why in result["warnings"][0]


# -- pytest-xdist ------------------------------------------------------------------------------------------------

MANY = """
import os
import pytest

@pytest.mark.parametrize("i", range(6))
def test_page(gate, i):
    grow = int(os.environ.get("GROW", "0")) if i == 3 else 0
    gate.record("page_bytes", 1024 * (i + 1) + grow, unit="B")
    gate.record_samples("ttft", [0.01 * (1 + k / 100) for k in range(10)], unit="s", scope="portable")
    gate.claim(f"page {i} is small", held=i < 5, evidence=f"{1024 * (i + 1)} B")
"""


def normalized_report(path: Path) -> dict[str, object]:
    data = json.loads(path.read_text())
    durations = data.pop("durations")  # seconds differ between any two runs; every test has its entry
    assert sorted(durations) == sorted(t["nodeid"] for t in data["tests"])
    for test in data["tests"]:
        for metric in test["metrics"]:
            if metric["baseline_recorded"]:
                metric["baseline_recorded"]["date"] = "-"
                metric["baseline_recorded"]["commit"] = "-"
        if test["message"]:
            test["message"] = "\n".join(line for line in test["message"].splitlines() if "recorded" not in line)
    return data


@pytest.mark.parametrize("case", ["update", "pass", "regress"])
def test_xdist_gives_the_serial_report(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                       case: str) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_many=MANY)
    if case != "update":
        pytester.runpytest("--gate-update").assert_outcomes(passed=6)
    args = ["--gate-update"] if case == "update" else []
    if case == "regress":
        monkeypatch.setenv("GROW", "512")
    reports = {}
    written = {}
    for mode, extra in (("serial", []), ("xdist", ["-n", "2"])):
        if case == "update":
            shutil.rmtree(pytester.path / "baselines", ignore_errors=True)  # both record from nothing
        result = pytester.runpytest_subprocess(*args, *extra, "--gate-report", f"rep-{mode}")
        result.assert_outcomes(passed=6 if case != "regress" else 5, failed=0 if case != "regress" else 1)
        result.stdout.fnmatch_lines(["*12 metric(s) in 6 test(s)*"])
        assert result.stdout.str().count("== vramgate ==") <= 1
        reports[mode] = normalized_report(pytester.path / f"rep-{mode}" / "report.json")
        stored = json.loads((pytester.path / "baselines" / "cpu" / "many.json").read_text())["tests"]
        written[mode] = {n: t["metrics"] for n, t in stored.items()}
    assert reports["xdist"] == reports["serial"]
    assert written["xdist"] == written["serial"]  # the workers' baselines merged into one file
    assert len(reports["serial"]["tests"]) == 6 and len(reports["serial"]["claims"]) == 6


NOISY = """
import random

def test_noisy(gate):
    rng = random.Random(1)
    ref = [0.01 * rng.lognormvariate(0, 0.6) for _ in range(12)]
    cand = [0.01 * rng.lognormvariate(0, 0.6) for _ in range(12)]
    gate.record_paired("step_ratio", ref, cand, tolerance=0.05, alpha=0.05)

def test_quiet(gate):
    gate.record("page_bytes", 1024, unit="B")
"""


def test_xdist_carries_why_a_verdict_is_untrusted(pytester: pytest.Pytester) -> None:
    """A worker's untrusted finding reaches the controller with its reason, and a paired metric with its two sides
    and its looks: the report it writes reads back (the reason a field of each metric) and says the same as a
    serial run's, the failure message (with the noise guard's line) included."""
    pytest.importorskip("xdist")
    from vramgate.store.report_files import ReportError, read_report

    pytester.makepyfile(test_noisy=NOISY)
    reports = {}
    for mode, extra in (("serial", []), ("xdist", ["-n", "2"])):
        shutil.rmtree(pytester.path / "baselines", ignore_errors=True)  # both from nothing stored
        result = pytester.runpytest_subprocess(*extra, "--gate-missing", "record", "--gate-report", f"rep-{mode}")
        result.assert_outcomes(passed=1, failed=1)
        result.stdout.fnmatch_lines(["*too noisy to judge*"])
        data = json.loads((pytester.path / f"rep-{mode}" / "report.json").read_text())
        report = read_report(data, f"rep-{mode}", ReportError)
        reasons = {m.metric.name: m.record.untrusted for m in report.metrics()}
        assert reasons == {"step_ratio": "too noisy", "page_bytes": None}, mode
        reports[mode] = normalized_report(pytester.path / f"rep-{mode}" / "report.json")
    assert reports["xdist"] == reports["serial"]
