"""The profile table (Note [profile verdict] in vramgate.core.verdicts): every profile gets a row and every check a
cell, decided by the ``gate_judges`` cases that ran, or saying why none did; and which of a diff's lines ran (Note
[diff ran] in vramgate.engine.diff_lines)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vramgate.core.verdicts import COLUMNS, DIFF_RAN, NO_WATCH, UNCOVERED, Judgement, profile_rows
from vramgate.engine.diff_lines import DiffLines, changed_in, changed_lines

T = "suites/x.py::test_"


def _row(judgements: list[Judgement], profiles: tuple[str, ...] = ("p",)) -> dict[str, str]:
    (row,) = [r for r in profile_rows(profiles, judgements) if r.profile == "p"]
    return {k: c.text for k, c in row.cells.items()}


def test_every_profile_has_a_cell_per_check_and_none_is_empty() -> None:
    rows = profile_rows(["a", "b"], [Judgement("a", "answers", T + "a", "passed")])
    assert [r.profile for r in rows] == ["a", "b"]
    for row in rows:
        assert tuple(row.cells) == COLUMNS
        assert all(c.text for c in row.cells.values())
    b = rows[1].cells
    assert b["answers"].text == "not judged: no test of this check ran for it"
    assert b["leaks"].text == "not judged: no test of this check ran for it" and not UNCOVERED
    assert rows[0].verdict == rows[1].verdict == "partly judged"


def test_a_failure_wins_over_passes_and_skips_and_fails_the_row() -> None:
    cells = _row([Judgement("p", "answers", T + "1", "passed"),
                  Judgement("p", "answers", T + "2", "failed", "the test failed"),
                  Judgement("p", "answers", T + "3", "not judged", "not on this tier")])
    assert cells["answers"] == "failed (1 of 2)"
    rows = profile_rows(["p"], [Judgement("p", "answers", T + "2", "failed")])
    assert rows[0].failed and rows[0].verdict == "regression"


def test_a_partial_pass_counts_the_cases_that_did_not_judge_and_keeps_their_reasons() -> None:
    (row,) = profile_rows(["p"], [Judgement("p", "answers", T + "1", "passed"),
                                  Judgement("p", "answers", T + "2", "nightly", "one run each (tox -e cpu-full)")])
    cell = row.cells["answers"]
    assert (cell.state, cell.text) == ("passed", "passed (1 of 2)")
    assert cell.reasons == ("1 more case(s) judged nightly (tox -e cpu-full)",)


def test_cells_that_did_not_judge_say_why() -> None:
    cells = _row([Judgement("p", "latency", T + "1", "nightly", "slow"),
                  Judgement("p", "capacity", T + "2", "not judged", "needs CUDA"),
                  Judgement("p", "capacity", T + "3", "nightly", "slow"),
                  Judgement("p", "applies", T + "4", "left out", "this change does not touch its inputs")])
    assert cells["latency"] == "nightly: slow"
    assert cells["capacity"] == "not judged: needs CUDA; 1 more case(s) judged nightly (tox -e cpu-full)"
    assert cells["applies"] == "not judged: this change does not touch its inputs"


def test_one_case_keeps_its_worst_phase() -> None:
    cells = _row([Judgement("p", "answers", T + "1", "passed"), Judgement("p", "answers", T + "1", "failed", "td")])
    assert cells["answers"] == "failed"
    cells = _row([Judgement("p", "answers", T + "1", "left out", "x"), Judgement("p", "answers", T + "1", "passed")])
    assert cells["answers"] == "passed"


def test_the_diff_column_says_whether_a_watching_run_executed_the_diff() -> None:
    ran = _row([Judgement("p", "answers", T + "1", "passed", lines_ran=3, lines_changed=22)])
    assert ran[DIFF_RAN] == "passed"
    idle = _row([Judgement("p", "answers", T + "1", "not judged", "not judged here: none ran", 0, 22),
                 Judgement("p", "latency", T + "2", "passed")])
    assert idle[DIFF_RAN].startswith("not judged: none of its 22 changed line(s) with code ran")
    (row,) = profile_rows(["p"], [Judgement("p", c, T + c, "passed") for c in COLUMNS if c != DIFF_RAN])
    assert row.cells[DIFF_RAN].reasons == (NO_WATCH,)
    assert row.verdict == "safe on what ran"  # engine arguments only: nothing to watch
    (row,) = profile_rows(["p"], [Judgement("p", c, T + c, "passed", lines_ran=0, lines_changed=4)
                                  for c in COLUMNS if c != DIFF_RAN])
    assert row.verdict == "partly judged"  # every check passed, but none ran its code
    (row,) = profile_rows(["p"], [Judgement("p", c, T + c, "nightly" if c == "leaks" else "passed")
                                  for c in COLUMNS if c != DIFF_RAN])
    assert row.verdict == "safe pre-merge"  # every check that ran passed; leaks waits for the nightly tier


def test_judgements_read_back_and_bad_ones_are_refused() -> None:
    j = Judgement("p", "answers", T + "1", "not judged", "why", 0, 5)
    assert Judgement.from_json(json.loads(json.dumps(j.to_json()))) == j
    for bad, message in (({**j.to_json(), "state": "maybe"}, "state 'maybe'"),
                         ({**j.to_json(), "profile": ""}, "non-empty 'profile'"),
                         ({**j.to_json(), "lines_ran": -1}, "counts or null")):
        with pytest.raises(ValueError, match=message):
            Judgement.from_json(bad)


# -- the report ----------------------------------------------------------------------------------------------------

def _report(judgements: list[Judgement]) -> dict[str, Any]:
    from report_samples import summary
    from vramgate.report.data import report_data

    return report_data(dataclasses.replace(summary(), judgements=judgements, profiles=["a", "b"]))


def test_the_report_opens_with_the_profiles_and_a_failed_cell_fails_it() -> None:
    from vramgate.report.html import html_page
    from vramgate.report.markdown import markdown
    from vramgate.store.report_files import ReportError, read_report

    data = _report([Judgement("a", "answers", T + "1", "failed", "the test failed"),
                    Judgement("b", "latency", T + "2", "not judged", "needs CUDA")])
    report = read_report(json.loads(json.dumps(data)), "report.json", ReportError)
    assert [r.profile for r in report.profile_rows()] == ["a", "b"]
    md = markdown(report, None)
    lines = md.splitlines()
    assert lines[0] == "## vramgate: ❌ regression"
    table = lines.index("| profile | verdict | applies | answers | capacity | latency | leaks | diff ran |")
    assert table < min(i for i, line in enumerate(lines) if line.startswith("### ") and "Profiles" not in line)
    assert "| `a` | ❌ regression | ⚪ <sup>1</sup> | ❌ <sup>2</sup> |" in md
    assert f"2. failed by `{T}1`" in md and "needs CUDA" in md
    page = html_page(report)
    assert page.index('class="profiles"') < page.index("<nav>")
    assert 'class="status fail"' in page


def test_a_report_of_schema_2_reads_with_an_empty_profile_table() -> None:
    from vramgate.store.report_files import ReportError, read_report

    data = _report([])
    data["schema"] = 2
    del data["profiles"], data["judgements"]
    report = read_report(data, "old.json", ReportError)
    assert report.profiles == [] and report.judgements == [] and report.profile_rows() == []
    bad = {**_report([]), "judgements": [{"profile": "a"}]}
    with pytest.raises(ReportError, match=r"old\.json: judgements: a judgement needs a non-empty 'check'"):
        read_report(bad, "old.json", ReportError)


def test_merged_shards_keep_every_judgement() -> None:
    from vramgate.report.data import merge_reports

    one = _report([Judgement("a", "answers", T + "1", "passed")])
    two = _report([Judgement("a", "latency", T + "2", "failed")])
    two["tests"] = []
    merged = merge_reports([one, two])
    cells = {c: merged.profile_rows()[0].cells[c].state for c in ("answers", "latency")}
    assert cells == {"answers": "passed", "latency": "failed"}


# -- the plugin ----------------------------------------------------------------------------------------------------

MANIFEST = """\
name = "{name}"
description = "d"
hypothesis = "h"
suites = []

[target]
distribution = "vllm"
package = "vllm"
version = "==0.32.0"

[engine_args]
block_size = 16
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_the_plugin_fills_each_profiles_row_from_its_cases(pytester: pytest.Pytester, workers: int) -> None:
    """Passed, failed, skipped (with its reason) and nightly cases land in their cells, serially and under xdist;
    the unpatched reference case and unmarked tests leave none; the terminal shows the table."""
    for name in ("good", "broken", "cuda-only"):
        folder = pytester.path / "patches" / name
        folder.mkdir(parents=True)
        (folder / "manifest.toml").write_text(MANIFEST.format(name=name))
    pytester.makeconftest('pytest_plugins = ["vramgate.testing.fixtures"]')
    pytester.makepyfile(test_judged=textwrap.dedent("""
        import pytest

        @pytest.mark.gate_judges("answers")
        @pytest.mark.gate_profiles(reference="baseline")
        def test_answers(profile, request):
            if profile is not None and profile.name == "cuda-only":
                request.node.user_properties.append(("vramgate.diff_lines", (0, 7)))
                pytest.skip("not judged here: none of its lines ran")
            assert profile is None or profile.name != "broken"

        @pytest.mark.gate_judges("latency")
        @pytest.mark.gate_nightly("slow")
        @pytest.mark.gate_profiles()
        def test_latency(profile):
            pass

        def test_other():
            pass
    """))
    args = ["-p", "no:cacheprovider", "-m", "not gate_nightly", "--gate-report", "out", "-rs"]
    if workers:
        args += ["-n", str(workers)]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    out = result.stdout.str()
    assert "profiles (one row per optimization" in out
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert report["profiles"] == ["broken", "cuda-only", "good"]
    by = {(j["profile"], j["check"]): j for j in report["judgements"]}
    assert {k: v["state"] for k, v in by.items()} == {
        ("broken", "answers"): "failed", ("cuda-only", "answers"): "not judged", ("good", "answers"): "passed",
        ("broken", "latency"): "nightly", ("cuda-only", "latency"): "nightly", ("good", "latency"): "nightly"}
    assert by[("cuda-only", "answers")]["reason"] == "not judged here: none of its lines ran"
    assert (by[("cuda-only", "answers")]["lines_ran"], by[("cuda-only", "answers")]["lines_changed"]) == (0, 7)
    assert by[("good", "latency")]["reason"] == "slow (tox -e cpu-full)"
    md = (pytester.path / "out" / "report.md").read_text()
    assert md.startswith("## vramgate: ❌ regression")
    assert "| `good` | ⚠️ partly judged | ⚪" in md


# -- which lines of a diff ran ---------------------------------------------------------------------------------------

def test_changed_lines_are_the_new_lines_with_code() -> None:
    old = "def f(x):\n    y = x + 1\n    return y\n\n\ndef g():\n    return 2\n"
    new = ("def f(x):\n    # a comment\n    y = x + 2\n    return y\n\n\ndef g():\n    return 2\n")
    assert changed_in(old, new, "m.py") == [3]  # the comment has no code
    removed = "def f(x):\n    return x + 1\n\n\ndef g():\n    return 2\n"
    assert changed_in(old, removed, "m.py") == [2]  # a deletion counts as what runs in its place
    assert changed_in(old, old, "m.py") == []


def _overlay(tmp_path: Path, installed: dict[str, str], patched: dict[str, str]) -> Path:
    """A package ``pkg`` installed with *installed* files and an overlay of it (Note [overlay]): the *patched*
    files written, every other installed file a link."""
    pkg, overlay = tmp_path / "site" / "pkg", tmp_path / "overlay"
    for rel, text in installed.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    for rel in installed.keys() | patched.keys():
        (overlay / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel in patched:
            (overlay / "pkg" / rel).write_text(patched[rel])
        else:
            (overlay / "pkg" / rel).symlink_to(pkg / rel)
    return overlay


def test_an_overlays_patched_files_are_found_against_the_installed_ones(tmp_path: Path) -> None:
    overlay = _overlay(tmp_path, {"a.py": "def f():\n    return 1\n", "b.py": "X = 1\n", "sub/c.py": "Y = 1\n"},
                       {"a.py": "def f():\n    return 2\n", "sub/c.py": "Y = 1\nZ = 2\n"})  # sub/: no link there
    found = changed_lines([overlay])
    assert found == {str(overlay / "pkg" / "a.py"): [2], str(overlay / "pkg" / "sub" / "c.py"): [2]}
    d = DiffLines({"pkg/a.py": [2]}, {})
    assert d.not_run_reason("cpu") == ("not judged here: none of the profile's 1 changed line(s) with code "
                                       "(pkg/a.py) ran in this run on the cpu tier")
    assert DiffLines({"pkg/a.py": [2]}, {"pkg/a.py": [2]}).not_run_reason("cpu") is None


def test_the_watch_in_an_engine_process_records_each_line_once(tmp_path: Path) -> None:
    """A real interpreter with the watch installed (as the worker and the vLLM plugin install it) runs a patched
    module: the lines that ran are written, once each; the one that did not, not."""
    from vramgate.engine import diff_lines

    overlay = _overlay(tmp_path, {"__init__.py": "", "m.py": "def f(x):\n    if x:\n        return 1\n    return 0\n"},
                       {"m.py": "def f(x):\n    if x:\n        return 2\n    return -1\n"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = diff_lines.prepare([overlay], run_dir)
    code = ("from vramgate.engine import diff_lines; diff_lines.install(); import threading\n"
            "from pkg import m\nfor _ in range(3): m.f(1)\nt = threading.Thread(target=m.f, args=(1,)); t.start(); "
            "t.join()\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path,
                   env={**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(overlay), *sys.path])})
    found = diff_lines.lines_ran(run_dir, [overlay])
    assert found.changed == {"pkg/m.py": [3, 4]}
    assert found.ran == {"pkg/m.py": [3]}
    assert (run_dir / "diff-ran.txt").read_text().count("\n") == 1
    assert found.describe() == "1 of 2 changed line(s) with code ran (pkg/m.py: 3)"
