"""``vramgate history``: every accepted value of the stored metrics, from git, with the drift rule's verdict."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vramgate.core.drift import DriftRule, DriftVerdict, check_drift
from vramgate.core.metrics import format_change, format_value, relative_change
from vramgate.report.table import aligned
from vramgate.store.history import (
    History,
    HistoryPoint,
    SeriesKey,
    baseline_history,
    merge_history,
    report_points,
    select,
)
from vramgate.tools.commands.common import Subparsers, add_root


def register(sub: Subparsers) -> None:
    """Add the ``history`` command."""
    hist = sub.add_parser(
        "history", help="every accepted value of the stored metrics, from git, and whether one drifts")
    hist.add_argument("selector", nargs="?", help="only series whose test node id, metric name or suite contains this")
    hist.add_argument("--key", help="only this hardware (or tier) key, e.g. cpu")
    hist.add_argument("--reports", nargs="+", metavar="FILE_OR_DIR", default=[],
                      help="report.json files (or folders searched for them) whose values go between the accepted ones")
    hist.add_argument("--baselines", default="baselines", help="the baselines folder (default: baselines)")
    hist.add_argument("--rev", default="HEAD", help="the revision whose first-parent history is read (default: HEAD)")
    hist.add_argument("--json", action="store_true", help="print JSON for tools")
    hist.add_argument("--drift", action="store_true", help="judge each series by the drift rule")
    hist.add_argument("--fail-on-drift", action="store_true", help="exit 1 when a series drifts (implies --drift)")
    add_root(hist)
    hist.set_defaults(func=run)


def _change(point: HistoryPoint, before: HistoryPoint | None) -> float | None:
    return None if before is None else relative_change(point.value, before.value)


def _point_json(point: HistoryPoint, before: HistoryPoint | None) -> dict[str, Any]:
    change = _change(point, before)
    return {**point.to_json(), "change": change if change is None or abs(change) != float("inf") else str(change)}


def _series_lines(key: SeriesKey, points: list[HistoryPoint], verdict: DriftVerdict | None) -> list[str]:
    last = points[-1]
    lines = [f"{key.suite}  {key.test}  {key.metric}  [{key.hardware_key}]  "
             f"({last.kind}, {last.better} is better; {len(points)} value(s))"]
    cells: list[tuple[str, ...]] = []
    for i, p in enumerate(points):
        change = _change(p, points[i - 1] if i else None)
        cells.append((p.commit[:12] if p.source == "baseline" else p.commit, p.date,
                      format_value(p.value, p.unit, precise=True), "-" if change is None else format_change(change),
                      p.source, p.software.get("vllm", "-"), p.software.get("torch", "-")))
    head = ("commit", "date", "value", "change", "source", "vllm", "torch")
    lines.extend("  " + line for line in aligned(head, cells))
    if verdict is not None:
        lines.append(f"  drift: {verdict.reason}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print the history of the selected series (and their drift verdicts); exit 1 with ``--fail-on-drift`` when
    one drifts, 2 for bad input (from the caller)."""
    root = Path(args.root) if args.root else Path.cwd()
    history: History = baseline_history(root, args.baselines, key=args.key, rev=args.rev)
    if args.reports:
        history = merge_history(history, report_points(args.reports))
    chosen = select(history, args.selector, key=args.key)
    if args.selector and not chosen:
        raise ValueError(f"no stored metric's test, name or suite contains {args.selector!r}"
                         + (f" under key {args.key!r}" if args.key else ""))
    judge = args.drift or args.fail_on_drift
    rule = DriftRule()
    verdicts = {k: check_drift([p.value for p in points], points[-1].better, rule)
                for k, points in chosen.items() if judge and points}
    drifting = sorted(k for k, v in verdicts.items() if v.drifting)
    if args.json:
        out: dict[str, Any] = {
            "series": [
                {"suite": k.suite, "test": k.test, "metric": k.metric, "hardware_key": k.hardware_key,
                 "unit": points[-1].unit, "better": points[-1].better, "kind": points[-1].kind,
                 "points": [_point_json(p, points[i - 1] if i else None) for i, p in enumerate(points)],
                 **({"drift": verdicts[k].to_json()} if k in verdicts else {})}
                for k, points in sorted(chosen.items()) if points
            ],
            "warnings": chosen.warnings,
        }
        if judge:
            out["drift_rule"] = rule.to_json()
            out["drifting"] = len(drifting)
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for warning in chosen.warnings:
            print(f"vramgate: warning: {warning}", file=sys.stderr)
        blocks = ["\n".join(_series_lines(k, points, verdicts.get(k)))
                  for k, points in sorted(chosen.items()) if points]
        print("\n\n".join(blocks) if blocks else "no stored metric has a history here")
        if judge:
            print(f"\n{len(drifting)} of {len(verdicts)} series drifting"
                  + "".join(f"\n  {k.suite}  {k.test}  {k.metric}  [{k.hardware_key}]" for k in drifting))
    return 1 if args.fail_on_drift and drifting else 0
