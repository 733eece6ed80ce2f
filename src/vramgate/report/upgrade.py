"""The upgrade report: what a vLLM upgrade moves, as markdown (``upgrade.md``), from ``upgrade.json``'s records
(:mod:`vramgate.report.upgrade_files`)."""

from __future__ import annotations

from typing import Any

from vramgate.core.metrics import format_change, format_value
from vramgate.report.compare import ComparedMetric
from vramgate.report.upgrade_files import OneSided, ProfileCheck, SideRecord, Upgrade, read_upgrade

#: How a profile's check reads in the report.
STATUS_WORDS = {"applies": "applies as is", "offsets": "applies with offsets", "conflicts": "CONFLICTS",
                "no-diffs": "no diffs (engine arguments only)"}


def _outcomes(run: SideRecord) -> str:
    counts = run.outcomes
    parts = [f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts.get(k)]
    return f"{', '.join(parts) or 'no tests'} in {run.seconds:.0f} s"


def _env_line(run: SideRecord) -> str:
    env = run.env
    return (f"- **{run.label}**: {env.vllm_distribution} {env.vllm}, torch {env.torch}, "
            f"python {env.python_version}: {_outcomes(run)}")


def _profile_cell(check: ProfileCheck) -> str:
    words = STATUS_WORDS.get(check.status, check.status)
    if not check.in_target:
        words += " (outside its target)"
    detail = "; ".join(str(n) for n in check.notes)
    files = check.proposal_files or []
    if files:
        detail = (detail + "; " if detail else "") + "proposal: " + ", ".join(f"`{f}`" for f in files)
    return words + (f": {detail}" if detail else "")


def _headline(rows: list[ComparedMetric], labels: tuple[str, str]) -> list[str]:
    out = [f"| suite | test | metric | {labels[0]} | {labels[1]} | change | verdict |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.suite, r.nodeid, r.metric)):
        change = format_change(float(r.change)) if r.change is not None else "-"
        old = format_value(r.old, r.unit) if r.old is not None else "-"
        new = format_value(r.new, r.unit) if r.new is not None else "-"
        out.append(f"| {r.suite} | `{r.nodeid.split('::', 1)[-1]}` | {r.metric} | {old} | {new} | {change} | "
                   f"{r.verdict} |")
    return out


def _one_sided(tests: list[OneSided], here: str, there: str) -> list[str]:
    if not tests:
        return []
    whys: dict[str, list[str]] = {}
    for t in tests:
        whys.setdefault(t.why, []).append(t.test)
    out = [f"**Only under {here}** ({len(tests)} test(s), {sum(t.metrics for t in tests)} metric(s)); under "
           f"{there}:", ""]
    for why, names in sorted(whys.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(f"`{n.split('::', 1)[-1]}`" for n in names[:4]) + (" ..." if len(names) > 4 else "")
        out.append(f"- {len(names)} skipped: {why} ({shown})" if why not in ("failed", "not collected")
                   else f"- {len(names)} {why}: {shown}")
    return [*out, ""]


def upgrade_markdown(data: Upgrade | dict[str, Any]) -> str:
    """``upgrade.md``: the runs, what moved (by suite, with each metric's verdict), the paired latency of the new
    version over the old one, and each profile's fate on both versions (*data*: the records, or ``upgrade.json``'s
    data read into them)."""
    up = read_upgrade(data)
    old, new = up.from_version, up.to_version
    verdict = "❌ regressions" if up.regressions else "✅ no regressions"
    lines = [f"## vramgate upgrade: vLLM {old} -> {new} ({up.tier} tier): {verdict}", ""]
    lines += [_env_line(run) for run in up.runs]
    for run in up.runs:
        for test in run.failed:
            lines.append(f"  - failed under {run.label}: `{test}`")
    labels = (f"vLLM {old}", f"vLLM {new}")
    if up.headline:
        suites = sorted({r.suite for r in up.headline})
        lines += ["", f"### Side by side ({', '.join(suites)})", "", *_headline(up.headline, labels)]
    if up.serving:
        lines += ["", "### Serving capacity: the memory the new version needs for the old KV cache", "",
                  f"| test | KV cache {labels[0]} | KV cache {labels[1]} | non-KV {labels[0]} | non-KV {labels[1]} | "
                  "memory utilization for the old KV cache |", "|---|---|---|---|---|---|"]
        for row in up.serving:
            factor = row.factor
            advice = (f"x{factor:.4f} ({format_change(factor - 1)}: e.g. 0.90 -> {min(1.0, 0.90 * factor):.4f}; "
                      f"{format_value(row.needed_bytes, 'B')} requested)")
            lines.append(f"| `{row.test.split('::', 1)[-1]}` | {format_value(row.old_kv_bytes, 'B')} | "
                         f"{format_value(row.new_kv_bytes, 'B')} | {format_value(row.old_non_kv_bytes, 'B')} | "
                         f"{format_value(row.new_non_kv_bytes, 'B')} | {advice} |")
    lines += ["", "### What the upgrade moves", "",
              "Each metric of the new version's run against the old one's, by the metric's own rule (the old "
              "version plays the baseline); unchanged metrics are counted, not listed.", "",
              up.comparison_markdown.rstrip(), ""]
    timings = up.unpaired_timings
    if timings:
        named = ", ".join(f"`{r.nodeid.split('::', 1)[-1]}` {r.metric} ({format_change(float(r.change or 0.0))})"
                          for r in timings)
        lines += [f"Not counted as the upgrade's regressions: {len(timings)} timing(s) of the two separate runs "
                  f"({named}); two runs on shared cores, with different tests beside them, differ by their load. "
                  "The paired latency below judges the upgrade's speed.", ""]
    lines += _one_sided(up.only_new, labels[1], labels[0])
    lines += _one_sided(up.only_old, labels[0], labels[1])
    if up.paired and up.paired.rows:
        lines += ["### Latency, paired (new / old, both engines up, taking turns)", "",
                  "| test | metric | median ratio | rounds (min - max) | tolerance | verdict |",
                  "|---|---|---|---|---|---|"]
        for p in up.paired.rows:
            spread = (f"{p.rounds} ({format_value(p.low or 0.0, 'ratio')} - {format_value(p.high or 0.0, 'ratio')})"
                      if p.rounds else "-")
            tol = f"{p.tolerance:.1%}" if p.tolerance is not None else "-"
            median = format_value(p.median, "ratio") if p.median is not None else "-"
            lines.append(f"| `{p.test}` | {p.metric} | {median} | {spread} | {tol} | "
                         f"{'❌ slower' if p.failed else 'ok'} |")
        lines.append("")
    changed = [t for t in (up.paired.run.failed if up.paired and up.paired.run else [])
               if "test_upgrade_answers" in t]
    if changed:
        lines += ["### Answers: this upgrade changes them", "",
                  "The new version's tokens or logprobs differ from the old one's on these recall models (each "
                  "test's message in the paired run's `pytest.log` has its first divergence):", "",
                  *[f"- ❌ `{t.split('::', 1)[-1]}`" for t in changed], ""]
    if up.profiles:
        lines += ["### Profiles", "", f"| profile | target | on vLLM {old} | on vLLM {new} |", "|---|---|---|---|"]
        for prof in up.profiles:
            lines.append(f"| {prof.profile} | `{prof.target}` | {_profile_cell(prof.old)} | "
                         f"{_profile_cell(prof.new)} |")
        lines += ["", "A proposal is git's three-way rebase of the profile onto the other version, for review: it "
                      "is never applied."]
    return "\n".join(lines) + "\n"
