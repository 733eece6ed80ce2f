"""The pictures of a run: the Mermaid charts of report.md, changes.png and the self-contained HTML page."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from vramgate.report import ReportError, changed_bars, check_history, html_page, markdown, write_report_data
from vramgate.report.chart import plot_changes
from vramgate.report.mermaid import MERMAID_BARS, mermaid_text, xychart
from vramgate.tools.cli import main

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _test(nodeid: str, suite: str, metrics: list[tuple[str, float | None, str, bool, str]],
          failed_message: str | None = None) -> dict[str, Any]:
    """One test entry of report data; each metric is (name, change, verdict, failed, kind)."""
    rows, entries = [], []
    for name, change, verdict, failed, kind in metrics:
        rows.append({"test": nodeid, "suite": suite, "metric": name, "baseline": "1.00 KiB", "now": "1.00 KiB",
                     "change": "-" if change is None else f"{change * 100:+.2f}%", "limit": "+5.0% vs baseline",
                     "verdict": verdict, "change_value": change, "failed": failed, "scope": "portable", "key": "cpu"})
        entries.append({"name": name, "verdict": verdict, "failed": failed, "change": change,
                        "now": {"value": 1024, "unit": "B", "kind": kind, "better": "lower",
                                **({"samples": [1024.0]} if kind == "measured" else {})}})
    failed_test = any(m[3] for m in metrics)
    return {"nodeid": nodeid, "suite": suite, "test_passed": True, "failed": failed_test,
            "message": failed_message if failed_test else None, "baseline_file": "?", "version_mismatches": [],
            "gpu_conditions": [], "rows": rows, "metrics": entries}


def _report(tests: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema": 1,
        "hardware": {"key": "cpu-x86_64-avx512-bf16-amd-epyc", "tier": "cpu", "device": "cpu",
                     "cpu_model": "AMD EPYC", "cpu_count": 2, "memory_bytes": 25 * 2**30, "gpus": []},
        "software": {"python": "3.11.7", "torch": "2.13.0+cpu", "vllm": "0.32.0", "vramgate": "0.1.0"},
        "missing_policy": "fail", "update": False, "accept_args": ["--gate-update"], "version_mismatches": [],
        "tests": tests,
        "claims": [{"test": "suites/kv/test_kv.py::test_pages", "statement": "pages are 64 KiB", "held": True,
                    "evidence": "65,536 B", "source": "CLAIMS.md item 1"},
                   {"test": "suites/kv/test_kv.py::test_pages", "statement": "no <waste> & no padding",
                    "held": False, "evidence": "256 B padded", "source": "CLAIMS.md item 2"}],
        "baselines_written": [], "moved_baselines": None,
    }


@pytest.fixture
def run() -> dict[str, Any]:
    """A run with changes in two suites (a failing metric, an improvement, an exact figure moved within its
    tolerance) and a third suite where nothing changed (a measured metric moved within its noise)."""
    return _report([
        _test("suites/kv/test_kv.py::test_pages[llama]", "kv", [
            ("page_bytes", 0.25, "regressed", True, "exact"),
            ("num_blocks", -0.125, "ok", False, "exact"),
            ("capacity", 0.0, "ok", False, "exact"),
        ], failed_message="page_bytes regressed: 64.00 KiB -> 80.00 KiB"),
        _test("suites/kv/test_kv.py::test_missing", "kv", [("peak", None, "missing", True, "exact")],
              failed_message="peak has no baseline"),
        _test("suites/latency/test_latency.py::test_ttft", "latency", [
            ("ttft", -0.4, "improved", False, "measured"),
            ("tpot", 0.03, "ok", False, "measured"),
        ]),
        _test("suites/moe/test_moe.py::test_workspace", "moe", [("workspace", 0.01, "ok", False, "measured")]),
    ])


@pytest.fixture
def history() -> list[dict[str, Any]]:
    """A history of two series of the ``kv`` suite and one of ``latency``, in the shape ``vramgate history``
    writes."""
    def series(suite: str, test: str, metric: str, unit: str, values: list[float]) -> dict[str, Any]:
        return {"suite": suite, "test": test, "metric": metric, "unit": unit, "points": [
            {"commit": f"{i:07x}abc", "date": f"2026-11-{i + 1:02d}T10:00:00Z", "value": v,
             "source": "baseline" if i < len(values) - 1 else "run"} for i, v in enumerate(values)]}

    return [series("kv", "suites/kv/test_kv.py::test_pages[llama]", "page_bytes", "B", [65536, 65536, 81920]),
            series("kv", "suites/kv/test_kv.py::test_pages[llama]", "num_blocks", "blocks", [8, 8, 7]),
            series("latency", "suites/latency/test_latency.py::test_ttft", "ttft", "s", [0.1, 0.09, 0.06])]


def _mermaid_blocks(md: str) -> list[str]:
    return re.findall(r"```mermaid\n(.*?)\n```", md, re.S)


def _check_xychart(block: str) -> dict[str, Any]:
    """The gate's own rules for a chart it writes; returns the parts read."""
    lines = block.splitlines()
    init = re.fullmatch(r"%%\{init: (.*)\}%%", lines[0])
    assert init, lines[0]
    config = json.loads(init.group(1))
    assert lines[1] == "xychart-beta horizontal"
    title = re.fullmatch(r'    title "([^"`]*)"', lines[2])
    assert title, lines[2]
    axis = re.fullmatch(r"    x-axis \[(.*)\]", lines[3])
    assert axis, lines[3]
    labels = re.findall(r'"([^"]*)"', axis.group(1))
    assert axis.group(1) == ", ".join(f'"{label}"' for label in labels)  # nothing outside the quotes
    assert len(set(labels)) == len(labels)
    assert all("%%" not in label and "`" not in label for label in labels)
    y_axis = re.fullmatch(r'    y-axis "change \(%\)" (-?\d+(?:\.\d+)?) --> (-?\d+(?:\.\d+)?)', lines[4])
    assert y_axis, lines[4]
    lo, hi = float(y_axis.group(1)), float(y_axis.group(2))
    series = []
    for line in lines[5:]:
        kind, values = re.fullmatch(r"    (bar|line) \[(.*)\]", line).groups()  # type: ignore[union-attr]
        numbers = values.split(", ")
        assert all(NUMBER.fullmatch(n) for n in numbers), line
        assert len(numbers) == len(labels), f"{len(numbers)} values for {len(labels)} labels: {line}"
        assert all(lo <= float(n) <= hi for n in numbers)
        series.append((kind, [float(n) for n in numbers]))
    palette = config["themeVariables"]["xyChart"]["plotColorPalette"].split(", ")
    assert len(palette) == len(series)
    return {"title": title.group(1), "labels": labels, "series": series, "lo": lo, "hi": hi, "palette": palette}


def test_report_md_charts_the_changed_metrics_per_suite(run: dict[str, Any]) -> None:
    md = markdown(run, None)
    blocks = _mermaid_blocks(md)
    charts = [_check_xychart(b) for b in blocks]
    assert [c["title"] for c in charts] == ["kv: change vs baseline (%)", "latency: change vs baseline (%)"]
    kv, latency = charts
    # failing first; the exact figure that moved within its tolerance is a change; the unchanged one is not
    assert kv["labels"] == ["test_pages[llama] · page_bytes", "test_pages[llama] · num_blocks"]
    assert latency["labels"] == ["test_ttft · ttft"]  # tpot moved within its noise: not a change
    assert "moe" not in md.split("### Changes")[1].split("### Metrics")[0]
    assert "1 failing metric(s) have no change to draw: `test_missing` peak (missing)." in md
    assert "_`changes.png` left out: matplotlib is not installed._" in md


def test_negative_changes_are_drawn_from_zero(run: dict[str, Any]) -> None:
    """Note [mermaid bars from zero]: the coloured series reach max(change, 0), the mask min(change, 0)."""
    kv = _check_xychart(_mermaid_blocks(markdown(run, None))[0])
    (_, failing), (_, changed), (_, mask), (line, zero) = kv["series"]
    assert kv["lo"] < -12.5 and kv["hi"] >= 25
    assert failing == [25.0, kv["lo"]] and changed == [kv["lo"], 0.0]
    assert mask == [0.0, -12.5] and line == "line" and zero == [0.0, 0.0]
    assert kv["palette"] == ["#d62728", "#1f77b4", "#ffffff", "#57606a"]


def test_a_chart_is_capped_and_says_how_many_more() -> None:
    metrics = [(f"m{i:02d}", (i + 1) / 100, "regressed", True, "exact") for i in range(MERMAID_BARS + 3)]
    md = markdown(_report([_test("suites/kv/test_kv.py::test_many", "kv", metrics, "many")]), None)
    (block,) = _mermaid_blocks(md)
    chart = _check_xychart(block)
    assert len(chart["labels"]) == MERMAID_BARS
    assert chart["labels"][0] == f"test_many · m{MERMAID_BARS + 2:02d}"  # the largest change first
    assert "3 more changed metric(s) of `kv` not drawn" in md


def test_nothing_changed_means_no_chart_and_one_line(tmp_path: Path) -> None:
    data = _report([_test("suites/kv/test_kv.py::test_pages", "kv", [("page_bytes", 0.0, "ok", False, "exact")])])
    (tmp_path / "changes.png").write_bytes(b"\x89PNG from an earlier run")
    write_report_data(data, tmp_path)
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "```mermaid" not in md and "changes.png" not in md
    assert "No metric changed against its baseline: nothing to chart." in md
    assert not (tmp_path / "changes.png").exists()  # the earlier run's picture would mislead
    assert plot_changes(data, tmp_path / "again.png") == []
    assert not (tmp_path / "again.png").exists()


def test_changes_png_draws_only_the_changed_metrics(run: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    bars = plot_changes(run, tmp_path / "changes.png")
    assert bars is not None
    assert {(b.test.split("::")[-1], b.metric) for b in bars} == {
        ("test_pages[llama]", "page_bytes"), ("test_pages[llama]", "num_blocks"), ("test_ttft", "ttft")}
    assert [b.state for b in bars] == ["failing", "changed", "improved"]
    assert (tmp_path / "changes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_report_data(run, tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert "![changes](changes.png)" in md.split("<details><summary>The same changes")[1]


def test_mermaid_text_escapes_what_would_break_the_chart() -> None:
    assert mermaid_text('a "b" `c` 50%% #x; d\\e\nf') == "a 'b' 'c' 50% no.x, d/e f"
    bar = changed_bars(_report([_test('suites/kv/test_kv.py::test_x["q"]', "kv",
                                      [("m", 0.1, "regressed", True, "exact")], "x")]))
    block = xychart('k"v', bar)
    assert _check_xychart(block)["labels"] == ["test_x['q'] · m"]
    with pytest.raises(ValueError, match="suite kv: a chart needs at least one bar"):
        xychart("kv", [])


def test_html_page_references_nothing_external(run: dict[str, Any], history: list[dict[str, Any]]) -> None:
    page = html_page(run, history)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"https?://", page)
    assert not re.search(r"<script|<link|<img|<iframe|<object|<embed|@import|url\(", page, re.I)
    assert all(target.startswith("#") for target in re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page))
    assert "<style>" in page
    assert "no &lt;waste&gt; &amp; no padding" in page  # text is escaped
    assert "page_bytes regressed: 64.00 KiB -&gt; 80.00 KiB" in page
    for shown in ("cpu-x86_64-avx512-bf16-amd-epyc", "2.13.0+cpu", "not held", "CLAIMS.md item 2"):
        assert shown in page


def test_html_page_has_one_svg_per_suite_chart(run: dict[str, Any], history: list[dict[str, Any]]) -> None:
    page = html_page(run, history)
    assert len(re.findall(r"<svg\b", page)) == page.count("</svg>") == 4
    changes = re.findall(r'<svg class="changes".*?</svg>', page, re.S)
    assert len(changes) == 2  # kv and latency changed; moe did not
    assert [len(re.findall(r"<rect ", svg)) for svg in changes] == [2, 1]
    histories = re.findall(r'<svg class="history".*?</svg>', page, re.S)
    assert len(histories) == 2  # kv and latency have a history
    assert len(re.findall(r"<polyline ", histories[0])) == 2
    assert "No metric of this suite changed against its baseline." in page  # moe
    # The accepted values, then this run's own (its page_bytes is 1 KiB) as the last point.
    assert "64.00 KiB → 1.00 KiB" in histories[0] and "then this run" in histories[0]
    without = html_page(run)
    assert 'class="history"' not in without and len(re.findall(r"<svg\b", without)) == 2


def test_history_input_is_checked(history: list[dict[str, Any]]) -> None:
    assert check_history(history) == history
    with pytest.raises(ReportError, match=r"h\.json: a history must be a JSON list of series"):
        check_history({"suite": "kv"}, "h.json")
    history[1]["points"][2]["value"] = "seven"
    with pytest.raises(ReportError, match=r"h.json: series 1 \(suites/kv/test_kv.py::test_pages\[llama\] "
                                          r"num_blocks\), point 2: 'value' must be a finite number, not 'seven'"):
        check_history(history, "h.json")
    history[1]["points"][2]["value"] = 7
    history[2]["unit"] = "furlongs"
    with pytest.raises(ReportError, match=r"series 2 .* unknown unit 'furlongs'"):
        check_history(history, "h.json")
    del history[0]["metric"]
    with pytest.raises(ReportError, match="series 0: needs 'metric'"):
        check_history(history, "h.json")


def test_report_html_command(run: dict[str, Any], history: list[dict[str, Any]], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "report.json").write_text(json.dumps(run), encoding="utf-8")
    (tmp_path / "history.json").write_text(json.dumps(history), encoding="utf-8")
    assert main(["report", "html", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'report.html'}" in capsys.readouterr().out
    assert 'class="history"' not in (tmp_path / "report.html").read_text(encoding="utf-8")
    out = tmp_path / "page" / "run.html"
    assert main(["report", "html", str(tmp_path / "report.json"), "--history", str(tmp_path / "history.json"),
                 "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8").count('<svg class="history"') == 2
    (tmp_path / "history.json").write_text("[{]", encoding="utf-8")
    assert main(["report", "html", str(tmp_path), "--history", str(tmp_path / "history.json")]) == 2
    assert f"{tmp_path / 'history.json'}: not valid JSON" in capsys.readouterr().err
    (tmp_path / "report.json").write_text(json.dumps({"schema": 4}), encoding="utf-8")
    assert main(["report", "html", str(tmp_path)]) == 2
    assert "report.json of schema 4, newer than this vramgate reads (schema 3)" in capsys.readouterr().err


def test_a_flat_history_is_said_not_drawn(run: dict[str, Any], history: list[dict[str, Any]]) -> None:
    for series in history:
        series["test"] += "_elsewhere"  # no value in this run: only the (flat) accepted values
        for point in series["points"]:
            point["value"] = series["points"][0]["value"]
    page = html_page(run, history)
    assert 'class="history"' not in page
    assert "History: none of the 2 series of this suite moved." in page


def test_the_history_command_output_feeds_the_page(tmp_path: Path) -> None:
    """``vramgate history --json`` on a repository with two commits of a baseline is a history the page takes."""
    import subprocess
    import sys

    from vramgate.report import load_history

    repo = tmp_path / "repo"
    (repo / "baselines" / "cpu").mkdir(parents=True)
    (repo / "fixtures" / "models").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    for i, value in enumerate((65536, 69632)):
        entry = {"metrics": {"page_bytes": {"value": value, "unit": "B", "kind": "exact", "better": "lower",
                                            "tolerance": 0.0, "scope": "portable"}},
                 "recorded": {"commit": None, "date": f"2026-11-2{i}T00:00:00Z", "software": {"vllm": "0.32.0"}}}
        data = {"schema": 1, "suite": "kv", "hardware": {"key": "cpu"}, "tests": {"t.py::test_kv": entry}}
        (repo / "baselines" / "cpu" / "kv.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", f"v{i}"], check=True)
    out = subprocess.run([sys.executable, "-m", "vramgate", "history", "--json", "--root", str(repo)],
                         capture_output=True, text=True, check=True)
    path = tmp_path / "history.json"
    path.write_text(out.stdout)
    (series,) = load_history(path)
    assert [p["value"] for p in series["points"]] == [65536, 69632]


def test_the_page_draws_this_runs_keys_only(run: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """A series of another machine's hardware key is not this run's history."""
    assert html_page(run, history) != html_page(run, [])  # the fixture's history draws something
    other = [{**s, "hardware_key": "nvidia-h200-140gb-x1"} for s in history]
    assert html_page(run, other) == html_page(run, [])
    own = [{**s, "hardware_key": run["hardware"]["key"]} for s in history]
    assert html_page(run, own) == html_page(run, history)
