"""Exports for dashboards: ``--gate-export`` and ``vramgate report export``.

The reports come from real pytester runs of gated tests with exact, measured and paired metrics. Each format's
output is held to an example of the format as its documentation gives it (Bencher's "Bencher Metric Format"
reference; the record of pytorch/test-infra's ``oss_ci_benchmark_v3`` table, the shape vLLM's benchmarks write):
the same keys at every level and the same types, with the figures of the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vramgate.report import ReportError, export_text, parse_export, to_bmf, to_pytorch
from vramgate.tools.cli import main

TEST_FILE = """
import os

def test_exact(gate):
    gate.record("page_bytes", int(os.environ.get("PAGE", "65536")), unit="B")
    gate.record("capacity", 8192, unit="tokens", better="higher", tolerance=0.1, floor=4096)

def test_measured(gate):
    gate.record_samples("ttft", [0.010, 0.012, 0.011, 0.013, 0.009], unit="s")

def test_paired(gate):
    gate.record_paired("step_ratio", [1.0, 1.01, 1.02], [0.98, 0.9999, 1.02], tolerance=0.1)
"""

#: Bencher's example of BMF: benchmark -> measure -> metric (value, and the optional lower and upper values).
BMF_EXAMPLE: dict[str, Any] = {
    "benchmark_name": {
        "latency": {"value": 88.0, "lower_value": 87.42, "upper_value": 88.88},
        "throughput": {"value": 5.55, "lower_value": 3.14, "upper_value": 6.30},
    },
}

#: A record of the v3 table as its schema declares it (every column a benchmark writes; the table's own metadata,
#: timestamp, repo and workflow, is added by the uploader).
PYTORCH_EXAMPLE: dict[str, Any] = {
    "benchmark": {"name": "cudagraphs", "mode": "inference", "dtype": "bfloat16", "extra_info": {"compile": "true"}},
    "model": {"name": "BERT_pytorch", "type": "model", "backend": "", "origins": ["torchbench"],
              "extra_info": {"key": "value"}},
    "inputs": {"x": {"dtype": "float32", "extra_info": {"shape": "[4, 8]"}}},
    "dependencies": {"torch": {"repo": "pytorch/pytorch", "branch": "main", "sha": "abc", "version": "2.6.0",
                               "extra_info": {}}},
    "metric": {"name": "speedup", "benchmark_values": [1.5, 1.6], "target_value": 1.4, "extra_info": {"unit": "x"}},
    "runners": [{"name": "linux.aws.h100", "type": "linux.aws.h100", "cpu_info": "x86_64", "cpu_count": 96,
                 "mem_info": "", "avail_mem_in_gb": 1024, "gpu_info": "NVIDIA H100", "gpu_count": 1,
                 "gpu_mem_info": "", "avail_gpu_mem_in_gb": 80, "extra_info": {}}],
}

#: The maps of a record: keys are names chosen by the benchmark, each value shaped like the example's.
MAPS = {"inputs", "dependencies"}


def same_shape(example: Any, ours: Any, where: str = "record") -> None:
    """*ours* has the keys of *example* at every level (maps: any keys, values shaped alike) and its types."""
    if isinstance(example, dict):
        assert isinstance(ours, dict), f"{where}: {ours!r} is not an object"
        if where.endswith("extra_info"):
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in ours.items()), f"{where}: {ours!r}"
            return
        if where.rsplit(".", 1)[-1] in MAPS:
            model = next(iter(example.values()))
            for key, value in ours.items():
                same_shape(model, value, f"{where}[{key}]")
            return
        assert set(ours) == set(example), f"{where}: keys {sorted(ours)} != {sorted(example)}"
        for key in example:
            same_shape(example[key], ours[key], f"{where}.{key}")
    elif isinstance(example, list):
        assert isinstance(ours, list) and ours, f"{where}: {ours!r} is not a non-empty list"
        for i, item in enumerate(ours):
            same_shape(example[0], item, f"{where}[{i}]")
    else:
        assert type(ours) is type(example), f"{where}: {ours!r} is a {type(ours).__name__}, not a " \
                                            f"{type(example).__name__}"


def gate_run(pytester: pytest.Pytester, *args: str, **env: str) -> pytest.RunResult:
    """One gate run of TEST_FILE on the hardware key ``hw-a`` with *env* set."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        return pytester.runpytest("--gate-hardware", "hw-a", *args)


@pytest.fixture
def exported(pytester: pytest.Pytester) -> Path:
    """A run with baselines (recorded by a first run) that writes both exports: its report folder."""
    pytester.makepyfile(test_gated=TEST_FILE)
    gate_run(pytester, "--gate-missing=record").assert_outcomes(passed=3)
    result = gate_run(pytester, "--gate-report", "out", "--gate-export", "bmf", "--gate-export",
                      "pytorch:records/pytorch.json", PAGE="69632")
    result.assert_outcomes(passed=2, failed=1)  # page_bytes regressed: its export says so
    return pytester.path


def test_bmf_export_has_the_documented_shape_and_the_run_s_figures(exported: Path) -> None:
    bmf = json.loads((exported / "out" / "bmf.json").read_text())
    assert sorted(bmf) == ["test_gated.py::test_exact", "test_gated.py::test_measured", "test_gated.py::test_paired"]
    for benchmark, measures in bmf.items():
        for measure, metric in measures.items():
            same_shape(BMF_EXAMPLE["benchmark_name"]["latency"], metric, f"{benchmark}.{measure}")
    exact = bmf["test_gated.py::test_exact"]
    assert exact["page_bytes"] == {"value": 69632.0, "lower_value": 69632.0, "upper_value": 69632.0}  # tolerance 0
    assert exact["capacity"] == {"value": 8192.0, "lower_value": pytest.approx(8192 / 1.1),
                                 "upper_value": pytest.approx(8192 * 1.1)}
    assert bmf["test_gated.py::test_measured"]["ttft"] == {"value": 0.011, "lower_value": 0.009,
                                                           "upper_value": 0.013}
    assert bmf["test_gated.py::test_paired"]["step_ratio"] == {"value": 0.99, "lower_value": 0.98,
                                                               "upper_value": 1.0}


def test_pytorch_export_has_the_v3_record_shape_and_the_run_s_figures(exported: Path) -> None:
    records = json.loads((exported / "records" / "pytorch.json").read_text())
    assert not (exported / "out" / "pytorch-benchmark.json").exists()  # written where the option said
    for record in records:
        same_shape(PYTORCH_EXAMPLE, record)
    by_metric = {r["metric"]["name"]: r for r in records}
    assert sorted(by_metric) == ["capacity", "page_bytes", "step_ratio", "ttft"]
    page = by_metric["page_bytes"]
    assert page["benchmark"]["name"] == "test_gated.py::test_exact"
    assert page["benchmark"]["extra_info"] == {"suite": "gated", "kind": "exact", "scope": "portable",
                                               "verdict": "regressed"}
    assert page["model"]["name"] == "test_exact" and page["model"]["extra_info"] == {"file": "test_gated.py"}
    assert page["metric"] == {"name": "page_bytes", "benchmark_values": [69632.0], "target_value": 65536.0,
                              "extra_info": {"unit": "B", "better": "lower", "tolerance": "0"}}
    assert by_metric["capacity"]["metric"]["extra_info"] == {"unit": "tokens", "better": "higher",
                                                              "tolerance": "0.1", "floor": "4096"}
    assert by_metric["ttft"]["metric"]["benchmark_values"] == [0.010, 0.012, 0.011, 0.013, 0.009]
    assert by_metric["step_ratio"]["metric"]["benchmark_values"] == [0.98, 0.99, 1.0]
    assert page["runners"][0]["name"] == "hw-a" and page["runners"][0]["gpu_count"] == 0


def test_the_command_converts_a_stored_report_as_the_run_did(
    exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["report", "export", str(exported / "out"), "--format", "bmf"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((exported / "out" / "bmf.json").read_text())
    out = exported / "converted.json"
    assert main(["report", "export", str(exported / "out" / "report.json"), "--format", "pytorch",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads((exported / "records" / "pytorch.json").read_text())


def test_the_command_names_a_bad_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"schema": 1, "tests": [{"nodeid": "t.py::a", "suite": "s", "metrics": [
        {"name": "x", "now": {"value": 1, "unit": "parsecs", "kind": "exact", "better": "lower"}}]}]}))
    assert main(["report", "export", str(bad), "--format", "bmf"]) == 2
    err = capsys.readouterr().err
    assert "test t.py::a: metric 'x'" in err and "unknown unit 'parsecs'" in err
    assert main(["report", "export", str(tmp_path / "missing.json"), "--format", "bmf"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "export", str(bad), "--format", "csv"])


def test_untrusted_metrics_are_not_exported() -> None:
    now = {"value": 2.0, "unit": "s", "kind": "measured", "better": "lower", "samples": [1.0, 3.0]}
    data = {"schema": 1, "hardware": {"key": "k", "tier": "cuda"}, "software": {"vllm": "0.32.0"}, "tests": [
        {"nodeid": "t.py::a", "suite": "s", "metrics": [
            {"name": "lat", "verdict": "untrusted", "now": now},
            {"name": "lat2", "verdict": "ok", "now": now, "baseline": {**now, "value": 1.5}}]}]}
    assert to_bmf(data) == {"t.py::a": {"lat2": {"value": 2.0, "lower_value": 1.0, "upper_value": 3.0}}}
    [record] = to_pytorch(data)
    assert record["metric"]["target_value"] == 1.5
    assert record["dependencies"] == {"vllm": {"repo": "vllm-project/vllm", "branch": "", "sha": "",
                                               "version": "0.32.0", "extra_info": {}}}
    with pytest.raises(ReportError, match="unknown export format 'csv'"):
        export_text(data, "csv")


def test_export_values_are_parsed_with_clear_errors() -> None:
    assert parse_export("bmf") == ("bmf", None)
    assert parse_export("pytorch:a/b.json") == ("pytorch", Path("a/b.json"))
    with pytest.raises(ValueError, match="must be one of bmf, pytorch"):
        parse_export("csv:x.json")
    with pytest.raises(ValueError, match="a path must follow the colon"):
        parse_export("bmf:")


def test_bad_export_options_stop_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gated=TEST_FILE)
    result = gate_run(pytester, "--gate-export", "csv")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-export: 'csv': the format must be one of bmf, pytorch*"])
    result = gate_run(pytester, "--gate-export", "bmf")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-export bmf: give a file (bmf:PATH) or --gate-report DIR*"])


def test_the_ini_value_names_exports_from_the_ini_file_s_folder(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gated=TEST_FILE)
    pytester.makeini("[pytest]\ngate_missing = skip\ngate_export =\n    bmf:dash/bmf.json\n")
    sub = pytester.mkdir("sub")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        result = pytester.runpytest("--gate-hardware", "hw-a", str(pytester.path))
    result.assert_outcomes(passed=3)
    assert "test_gated.py::test_paired" in json.loads((pytester.path / "dash" / "bmf.json").read_text())
