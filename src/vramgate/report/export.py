"""A run's metrics for dashboards: Bencher Metric Format and the PyTorch OSS benchmark database's records.

Both exports are pure functions of ``report.json``'s data (:func:`vramgate.report.data.report_data`): the
plugin writes them at the end of a session (``--gate-export``), ``vramgate report export`` converts a stored
report. Every metric of every test is exported (benchmark = the test's node id, measure = the metric's name),
except an ``untrusted`` one: a measurement the GPU-state guard rejected, or a paired one too noisy to judge, is no
figure for a dashboard.

Bencher Metric Format (``bmf``), as bencher.dev's reference "Bencher Metric Format (BMF)" defines it and its
JSON schema ``https://bencher.dev/bmf.json`` checks it: one JSON object keyed by benchmark name, each an object
keyed by measure (name or slug), each holding a metric: ``value`` (required), ``lower_value`` and
``upper_value`` (optional numbers). Here ``value`` is the metric's figure (the median of a measured metric's
samples, of a paired metric's ratios); ``lower_value``/``upper_value`` are the samples' minimum and maximum, or
for an exact metric its tolerance band in the gate's ratio terms (``value / (1 + tolerance)`` to
``value * (1 + tolerance)``; the figure itself at tolerance 0). BMF has no field for a unit or for which way is
better: Bencher keeps the unit on the measure (created with ``bencher measure create --units``) and the
direction on its threshold (an upper boundary for lower-is-better, a lower one for higher-is-better).

PyTorch benchmark records (``pytorch``): a JSON list, one record per metric, in the "v3" shape of the
``benchmark.oss_ci_benchmark_v3`` table of pytorch/test-infra (``clickhouse_db_schema/oss_ci_benchmark_v3/
schema.sql``; the wiki page "PyTorch OSS benchmark infra" documents the record), the shape vLLM's own benchmarks
write for the PyTorch HUD (``convert_to_pytorch_benchmark_format`` in ``vllm/benchmarks/lib/utils.py``). Each
field as the schema's comments define it:

- ``benchmark``: ``name`` (the benchmark; here the test's node id), ``mode`` (training or inference: here
  ``inference``), ``dtype`` (the dtype or quantization the benchmark used: ``""``, the report does not say),
  ``extra_info`` (key/value strings: the suite, the metric's kind and scope, the gate's verdict).
- ``model``: ``name`` (the model or test name: the test's name after its file), ``type`` (open: ``test``),
  ``backend`` (a delegation backend: ``""``), ``origins`` (where it comes from: ``["vramgate:<suite>"]``),
  ``extra_info`` (the test's file).
- ``inputs``: a map of input name to ``dtype`` and ``extra_info``: empty, the report names no inputs.
- ``dependencies``: a map of dependency to ``repo``, ``branch``, ``sha``, ``version`` and ``extra_info``: vLLM
  and torch with the versions the run recorded.
- ``metric``: ``name`` (the metric's name), ``benchmark_values`` (the values of every run: the samples, else
  ``[value]``), ``target_value`` (the figure aimed at: the stored baseline's value, 0 without one, as
  test-infra's own converters default it), ``extra_info`` (key/value strings: ``unit``, ``better``,
  ``tolerance``, ``ceiling``/``floor``).
- ``runners``: the devices the benchmark ran on: ``name`` (the hardware key), ``type`` (the tier),
  ``cpu_info``, ``cpu_count``, ``mem_info``, ``avail_mem_in_gb``, ``gpu_info``, ``gpu_count``,
  ``gpu_mem_info``, ``avail_gpu_mem_in_gb`` and ``extra_info``.

The table's ``Map(String, String)`` columns take strings only, so every ``extra_info`` value is a string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.core.metrics import Metric
from vramgate.store.report_files import HardwareFacts, Report, ReportError, as_report

#: The export formats, by the name ``--gate-export`` and ``vramgate report export --format`` take.
EXPORT_FORMATS = ("bmf", "pytorch")
#: The file each format is written to in the report folder when ``--gate-export`` names no path.
EXPORT_FILES = {"bmf": "bmf.json", "pytorch": "pytorch-benchmark.json"}
#: Where a dependency of the PyTorch records comes from (its ``repo``).
DEPENDENCY_REPOS = {"vllm": "vllm-project/vllm", "torch": "pytorch/pytorch"}


@dataclass(frozen=True)
class ExportedMetric:
    """One metric of a report, as the exports read it: its test, its figure now, the baseline's, the verdict."""

    nodeid: str
    suite: str
    metric: Metric
    baseline: float | None
    verdict: str


def band(metric: Metric) -> tuple[float, float]:
    """(lower, upper) of *metric*: its samples' minimum and maximum, else its tolerance band in ratio terms."""
    if metric.samples:
        return min(metric.samples), max(metric.samples)
    tolerance = metric.effective_tolerance
    low, high = metric.value / (1 + tolerance), metric.value * (1 + tolerance)
    return (low, high) if low <= high else (high, low)  # a negative figure's band turns over


def exported_metrics(data: Report | Any, source: str = "report") -> list[ExportedMetric]:
    """Every metric of a report (its records, or its data read into them) in node id order, untrusted ones left
    out; :class:`ReportError` naming *source*, the test and the metric for data that is not a report."""
    out = []
    for m in as_report(data, source).metrics():
        if m.record.verdict == "untrusted":
            continue
        base = m.record.baseline
        out.append(ExportedMetric(m.nodeid, m.suite, m.metric, base.value if base else None,
                                  m.record.verdict or ""))
    return sorted(out, key=lambda e: (e.nodeid, e.metric.name))


def to_bmf(data: Report | Any, source: str = "report") -> dict[str, dict[str, dict[str, float]]]:
    """A report's metrics in Bencher Metric Format (see the module's docstring)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for e in exported_metrics(data, source):
        low, high = band(e.metric)
        out.setdefault(e.nodeid, {})[e.metric.name] = {
            "value": float(e.metric.value), "lower_value": float(low), "upper_value": float(high)}
    return out


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _gib(nbytes: Any) -> int:
    return int(nbytes) // 2**30 if isinstance(nbytes, int | float) else 0


def runner(hardware: HardwareFacts) -> dict[str, Any]:
    """The ``runners`` entry of the machine a report's ``hardware`` describes."""
    gpus = hardware.gpus
    names = sorted({g.name or "" for g in gpus})
    return {
        "name": hardware.key or "",
        "type": hardware.tier or "",
        "cpu_info": hardware.cpu_model,
        "cpu_count": hardware.cpu_count,
        "mem_info": "",
        "avail_mem_in_gb": _gib(hardware.memory_bytes),
        "gpu_info": ", ".join(names),
        "gpu_count": len(gpus),
        "gpu_mem_info": "",
        "avail_gpu_mem_in_gb": sum(_gib(g.memory_bytes) for g in gpus),
        "extra_info": hardware.extra,
    }


def to_pytorch(data: Report | Any, source: str = "report") -> list[dict[str, Any]]:
    """A report's metrics as PyTorch benchmark-database records, one per metric (see the module's docstring)."""
    report = as_report(data, source)
    metrics = exported_metrics(report, source)
    dependencies: dict[str, dict[str, Any]] = {
        name: {"repo": repo, "branch": "", "sha": "", "version": version, "extra_info": {}}
        for name, repo in DEPENDENCY_REPOS.items() if (version := report.version(name))
    }
    distribution = report.version("vllm_distribution")
    if distribution and "vllm" in dependencies:
        dependencies["vllm"]["extra_info"] = {"distribution": distribution}
    runners = [runner(report.hardware)]
    records = []
    for e in metrics:
        m = e.metric
        path, _, test = e.nodeid.rpartition("::")
        extra = {"unit": m.unit, "better": m.better, "tolerance": _num(m.effective_tolerance)}
        if m.ceiling is not None:
            extra["ceiling"] = _num(m.ceiling)
        if m.floor is not None:
            extra["floor"] = _num(m.floor)
        records.append({
            "benchmark": {"name": e.nodeid, "mode": "inference", "dtype": "",
                          "extra_info": {"suite": e.suite, "kind": m.kind, "scope": m.effective_scope,
                                         "verdict": e.verdict}},
            "model": {"name": test or e.nodeid, "type": "test", "backend": "", "origins": [f"vramgate:{e.suite}"],
                      "extra_info": {"file": path}},
            "inputs": {},
            "dependencies": dependencies,
            "metric": {"name": m.name, "benchmark_values": [float(v) for v in m.samples] or [float(m.value)],
                       "target_value": float(e.baseline) if e.baseline is not None else 0.0, "extra_info": extra},
            "runners": runners,
        })
    return records


def export_text(data: Report | Any, fmt: str, source: str = "report") -> str:
    """A report's metrics in the export format *fmt* (one of :data:`EXPORT_FORMATS`) as JSON text."""
    if fmt == "bmf":
        exported: Any = to_bmf(data, source)
    elif fmt == "pytorch":
        exported = to_pytorch(data, source)
    else:
        raise ReportError(f"unknown export format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    return json.dumps(exported, indent=2, sort_keys=True) + "\n"


def parse_export(text: str) -> tuple[str, Path | None]:
    """``"bmf"`` -> ``("bmf", None)``, ``"pytorch:out/records.json"`` -> ``("pytorch", Path(...))``;
    :class:`ValueError` naming the accepted formats for anything else."""
    fmt, sep, path = str(text).partition(":")
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"{text!r}: the format must be one of {', '.join(EXPORT_FORMATS)} (FORMAT or FORMAT:PATH)")
    if sep and not path:
        raise ValueError(f"{text!r}: a path must follow the colon (FORMAT:PATH)")
    return fmt, Path(path) if path else None
