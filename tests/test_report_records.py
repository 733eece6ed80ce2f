"""Report records: report.json read into its dataclasses and written back byte for byte, and every renderer's
output of a rich run held unchanged (the golden files under ``tests/data/report_golden``, made by
``tests/report_samples.py``)."""

from __future__ import annotations

import pytest

from report_samples import GOLDEN, outputs

OUTPUTS = outputs()


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_every_renderer_output_is_unchanged(name: str) -> None:
    assert OUTPUTS[name] == (GOLDEN / name).read_text(encoding="utf-8")


def test_the_golden_files_are_all_checked() -> None:
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(OUTPUTS)


def test_a_rich_report_reads_into_records_and_back_to_the_same_json() -> None:
    import json

    from report_samples import summary
    from vramgate.report.data import report_data, report_record
    from vramgate.store.report_files import ReportError, read_report

    data = report_data(summary())
    report = read_report(json.loads(json.dumps(data)), "report.json", ReportError)
    assert report == read_report(report, "report.json", ReportError)
    assert json.dumps(report.to_json(), indent=2, sort_keys=True) == json.dumps(data, indent=2, sort_keys=True)
    assert report.to_json() == report_record(summary()).to_json()
    # Every field the renderers read is there, typed.
    metrics = {m.metric.name: m.record for m in report.metrics()}
    assert (metrics["page_bytes"].verdict, metrics["page_bytes"].outside_budget) == ("regressed", True)
    assert metrics["page_bytes"].verdict_text == "regressed, outside budget"
    assert (metrics["weights"].verdict, metrics["weights"].verdict_text) == ("ok", "outside budget")
    assert metrics["step_ratio"].untrusted == "too noisy" and metrics["tpot"].untrusted == "gpu state"
    assert metrics["ttft"].untrusted is None and metrics["inf_bytes"].change == float("inf")
    assert [c.verdict for c in report.claims] == ["not held", "held", "not judged"]
    assert [m.change for m in report.moved] == ["+25.00%", "removed", "added"]
    assert report.affected is not None
    assert (report.affected.kept, report.affected.left_out) == (3, ["suites/x.py::test_y"])
    rows = {r.metric: r for r in report.rows()}
    assert (rows["weights"].verdict, rows["weights"].outside_budget) == ("ok", True)


def test_a_report_of_schema_1_reads_as_the_current_one_with_its_untrusted_reasons() -> None:
    """report.json of schema 1 kept why a verdict is untrusted only in the text of ``decided_by``; it migrates to
    schema 2 (the reason a field of each metric) and reads as the same records as the report written now."""
    import json
    from pathlib import Path

    from report_samples import summary
    from vramgate.report.data import report_data
    from vramgate.store.report_files import ReportError, read_report

    old = json.loads((Path(__file__).parent / "data" / "report-schema-1.json").read_text(encoding="utf-8"))
    assert old["schema"] == 1
    assert all("untrusted" not in m for t in old["tests"] for m in t["metrics"])
    now = read_report(report_data(summary(verdicts=False)), "now", ReportError)
    migrated = read_report(old, "report-schema-1.json", ReportError)
    assert migrated == now
    assert {m.metric.name: m.record.untrusted for m in migrated.metrics() if m.record.untrusted} == {
        "step_ratio": "too noisy", "tpot": "gpu state"}


def test_an_untrusted_reason_that_does_not_fit_its_verdict_is_refused() -> None:
    from report_samples import summary
    from vramgate.report.data import report_data
    from vramgate.store.report_files import ReportError, read_report

    for reason, verdict in (("too noisy", "ok"), (None, "untrusted"), ("bad luck", "untrusted")):
        data = report_data(summary())
        metric = data["tests"][0]["metrics"][0]
        metric["untrusted"], metric["verdict"] = reason, verdict
        with pytest.raises(ReportError, match=f"untrusted {reason!r} with the verdict {verdict!r}"):
            read_report(data, "report.json", ReportError)


def test_a_row_whose_verdict_is_not_its_metrics_is_refused() -> None:
    from report_samples import summary
    from vramgate.report.data import report_data
    from vramgate.store.report_files import ReportError, read_report

    data = report_data(summary())
    data["tests"][0]["rows"][0]["verdict"] = "regressed"
    with pytest.raises(ReportError, match=r"row 'page_bytes': verdict 'regressed' is not its metric's"):
        read_report(data, "report.json", ReportError)


def test_merging_one_shard_gives_the_same_report() -> None:
    from report_samples import summary
    from vramgate.report.data import merge_reports, report_data

    data = report_data(summary())
    moved = data["moved_baselines"]
    ordered = sorted(moved["metrics"], key=lambda m: (m["file"], m["test"], m["metric"]))  # the merge orders them
    assert merge_reports([data]).to_json() == {**data, "moved_baselines": {**moved, "metrics": ordered}}


def test_the_upgrade_reads_the_paired_run_through_the_records() -> None:
    from report_samples import summary
    from vramgate.report.data import report_record
    from vramgate.tools.upgrade import paired_rows

    row = next(r for r in paired_rows(report_record(summary())) if r.metric == "step_ratio")
    assert row.to_json() == {"test": "suites/latency/test_latency.py::test_ttft[tiny]", "metric": "step_ratio",
                             "median": 1.05, "low": 0.47, "high": 2.29, "rounds": 6, "tolerance": 0.02,
                             "failed": True, "message": row.message}
    assert str(row.message).startswith("vramgate: step_ratio untrusted: too noisy to judge")


def test_upgrade_json_reads_into_records_and_back_to_the_same_json() -> None:
    import json

    from report_samples import upgrade_sample
    from vramgate.report.upgrade_files import read_upgrade

    data = upgrade_sample()
    upgrade = read_upgrade(json.loads(json.dumps(data)))
    assert json.dumps(upgrade.to_json(), sort_keys=True) == json.dumps(data, sort_keys=True)
    assert upgrade.paired is not None and upgrade.paired.run is not None
    assert (upgrade.paired.run.env.vllm, upgrade.profiles[0].old.proposal_files) == ("0.32.0", ["out/p/x.py.conflict"])
    assert read_upgrade({**data, "paired": {}}).paired is None


def test_an_upgrade_json_of_a_newer_schema_is_refused() -> None:
    from report_samples import upgrade_sample
    from vramgate.report.upgrade_files import read_upgrade
    from vramgate.store.report_files import ReportError

    with pytest.raises(ReportError, match=r"upgrade\.json of schema 2, newer than this vramgate reads"):
        read_upgrade({**upgrade_sample(), "schema": 2})


def test_the_paired_rule_says_the_noise_line_once() -> None:
    import dataclasses

    from report_samples import _noisy
    from vramgate.core.checks import check_budget, check_noise
    from vramgate.core.paired import TOO_NOISY, paired_rule

    metric = _noisy()
    rule = paired_rule(metric)
    assert rule is not None and paired_rule(dataclasses.replace(metric, paired=None)) is None
    assert rule.message_lines() == ["look 1: 6 rounds, ratios 0.54 - 1.6", rule.noise()[1]]
    assert metric.paired is not None
    judged = dataclasses.replace(metric.paired, noise_in_looks=True)
    assert paired_rule(dataclasses.replace(metric, paired=judged)).message_lines() == list(judged.looks)
    assert check_noise(metric) == rule.too_noisy() and str(rule.too_noisy()).startswith(TOO_NOISY)
    assert check_budget(metric) == rule.in_run()


def test_one_function_makes_a_verdicts_text() -> None:
    from vramgate.core.checks import verdict_text

    assert [verdict_text("regressed", False), verdict_text("regressed", True), verdict_text("ok", True),
            verdict_text("ok", True, name_ok=True)] == ["regressed", "regressed, outside budget", "outside budget",
                                                         "ok, outside budget"]


def test_the_junit_properties_name_every_verdict() -> None:
    from report_samples import summary
    from vramgate.report.data import junit_properties

    found = [m.finding for node in summary().nodes for m in node.metrics]
    properties = dict(junit_properties(found))
    assert "; verdict ok, outside budget; " in properties["vramgate.weights"]
    assert "; verdict regressed, outside budget; " in properties["vramgate.page_bytes"]
    assert "; verdict ok; " in properties["vramgate.num_blocks"]
