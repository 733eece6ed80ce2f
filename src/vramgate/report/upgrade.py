"""The upgrade report: what a vLLM upgrade moves, as markdown (``upgrade.md``), from ``upgrade.json``'s data."""

from __future__ import annotations

from typing import Any

from vramgate.core.metrics import format_change, format_value

#: How a profile's check reads in the report.
STATUS_WORDS = {"applies": "applies as is", "offsets": "applies with offsets", "conflicts": "CONFLICTS",
                "no-diffs": "no diffs (engine arguments only)"}


def _outcomes(run: dict[str, Any]) -> str:
    counts = run.get("outcomes") or {}
    parts = [f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts.get(k)]
    return f"{', '.join(parts) or 'no tests'} in {run.get('seconds', 0):.0f} s"


def _env_line(run: dict[str, Any]) -> str:
    env = run["env"]
    return (f"- **{run['label']}**: {env.get('vllm_distribution')} {env.get('vllm')}, torch {env.get('torch')}, "
            f"python {env.get('python_version')}: {_outcomes(run)}")


def _profile_cell(check: dict[str, Any]) -> str:
    words = STATUS_WORDS.get(str(check.get("status")), str(check.get("status")))
    if not check.get("in_target", True):
        words += " (outside its target)"
    detail = "; ".join(str(n) for n in check.get("notes") or [])
    files = check.get("proposal_files") or []
    if files:
        detail = (detail + "; " if detail else "") + "proposal: " + ", ".join(f"`{f}`" for f in files)
    return words + (f": {detail}" if detail else "")


def _headline(rows: list[dict[str, Any]], labels: tuple[str, str]) -> list[str]:
    out = [f"| suite | test | metric | {labels[0]} | {labels[1]} | change | verdict |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["suite"], r["nodeid"], r["metric"])):
        change = format_change(float(r["change"])) if r.get("change") is not None else "-"
        old = format_value(r["old"], r["unit"]) if r["old"] is not None else "-"
        new = format_value(r["new"], r["unit"]) if r["new"] is not None else "-"
        out.append(f"| {r['suite']} | `{r['nodeid'].split('::', 1)[-1]}` | {r['metric']} | {old} | {new} | {change} | "
                   f"{r['verdict']} |")
    return out


def _one_sided(tests: list[dict[str, Any]], here: str, there: str) -> list[str]:
    if not tests:
        return []
    whys: dict[str, list[str]] = {}
    for t in tests:
        whys.setdefault(t["why"], []).append(t["test"])
    out = [f"**Only under {here}** ({len(tests)} test(s), {sum(t['metrics'] for t in tests)} metric(s)); under "
           f"{there}:", ""]
    for why, names in sorted(whys.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(f"`{n.split('::', 1)[-1]}`" for n in names[:4]) + (" ..." if len(names) > 4 else "")
        out.append(f"- {len(names)} skipped: {why} ({shown})" if why not in ("failed", "not collected")
                   else f"- {len(names)} {why}: {shown}")
    return [*out, ""]


def upgrade_markdown(data: dict[str, Any]) -> str:
    """``upgrade.md``: the runs, what moved (by suite, with each metric's verdict), the paired latency of the new
    version over the old one, and each profile's fate on both versions."""
    old, new = data["from"], data["to"]
    verdict = "❌ regressions" if data["regressions"] else "✅ no regressions"
    lines = [f"## vramgate upgrade: vLLM {old} -> {new} ({data['tier']} tier): {verdict}", ""]
    lines += [_env_line(run) for run in data["runs"]]
    for run in data["runs"]:
        for test in run.get("failed") or []:
            lines.append(f"  - failed under {run['label']}: `{test}`")
    labels = (f"vLLM {old}", f"vLLM {new}")
    if data.get("headline"):
        suites = sorted({r["suite"] for r in data["headline"]})
        lines += ["", f"### Side by side ({', '.join(suites)})", "", *_headline(data["headline"], labels)]
    if data.get("serving"):
        lines += ["", "### Serving capacity: the memory the new version needs for the old KV cache", "",
                  f"| test | KV cache {labels[0]} | KV cache {labels[1]} | non-KV {labels[0]} | non-KV {labels[1]} | "
                  "memory utilization for the old KV cache |", "|---|---|---|---|---|---|"]
        for row in data["serving"]:
            factor = row["factor"]
            advice = (f"x{factor:.4f} ({format_change(factor - 1)}: e.g. 0.90 -> {min(1.0, 0.90 * factor):.4f}; "
                      f"{format_value(row['needed_bytes'], 'B')} requested)")
            lines.append(f"| `{row['test'].split('::', 1)[-1]}` | {format_value(row['old_kv_bytes'], 'B')} | "
                         f"{format_value(row['new_kv_bytes'], 'B')} | {format_value(row['old_non_kv_bytes'], 'B')} | "
                         f"{format_value(row['new_non_kv_bytes'], 'B')} | {advice} |")
    lines += ["", "### What the upgrade moves", "",
              "Each metric of the new version's run against the old one's, by the metric's own rule (the old "
              "version plays the baseline); unchanged metrics are counted, not listed.", "",
              data["comparison_markdown"].rstrip(), ""]
    timings = data.get("unpaired_timings") or []
    if timings:
        named = ", ".join(f"`{r['nodeid'].split('::', 1)[-1]}` {r['metric']} ({format_change(float(r['change']))})"
                          for r in timings)
        lines += [f"Not counted as the upgrade's regressions: {len(timings)} timing(s) of the two separate runs "
                  f"({named}); two runs on shared cores, with different tests beside them, differ by their load. "
                  "The paired latency below judges the upgrade's speed.", ""]
    lines += _one_sided(data.get("only_new") or [], labels[1], labels[0])
    lines += _one_sided(data.get("only_old") or [], labels[0], labels[1])
    paired = data.get("paired") or {}
    if paired.get("rows"):
        lines += ["### Latency, paired (new / old, both engines up, taking turns)", "",
                  "| test | metric | median ratio | rounds (min - max) | tolerance | verdict |",
                  "|---|---|---|---|---|---|"]
        for row in paired["rows"]:
            spread = (f"{row['rounds']} ({format_value(row['low'], 'ratio')} - {format_value(row['high'], 'ratio')})"
                      if row["rounds"] else "-")
            tol = f"{row['tolerance']:.1%}" if row.get("tolerance") is not None else "-"
            median = format_value(row["median"], "ratio") if row["median"] is not None else "-"
            lines.append(f"| `{row['test']}` | {row['metric']} | {median} | {spread} | {tol} | "
                         f"{'❌ slower' if row['failed'] else 'ok'} |")
        lines.append("")
    if data.get("profiles"):
        lines += ["### Profiles", "", f"| profile | target | on vLLM {old} | on vLLM {new} |", "|---|---|---|---|"]
        for row in data["profiles"]:
            lines.append(f"| {row['profile']} | `{row['target']}` | {_profile_cell(row['old'])} | "
                         f"{_profile_cell(row['new'])} |")
        lines += ["", "A proposal is git's three-way rebase of the profile onto the other version, for review: it "
                      "is never applied."]
    return "\n".join(lines) + "\n"
