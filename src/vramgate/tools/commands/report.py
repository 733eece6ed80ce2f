"""``vramgate report merge``: gate reports."""

from __future__ import annotations

import argparse
from pathlib import Path

from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``report`` command group: ``merge``."""
    rep = sub.add_parser("report", help="gate reports")
    rep_sub = rep.add_subparsers(dest="report_command", required=True)
    merge = rep_sub.add_parser("merge", help="merge the report.json of several shards into one report")
    merge.add_argument("reports", nargs="+", help="report.json files (or folders holding one)")
    merge.add_argument("--out", required=True, help="folder for the merged report.md, report.json, changes.png")
    merge.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    """Merge the shards' reports into one; exit 1 when a test in them failed."""
    from vramgate.report import merge_report_files

    paths = [Path(p) / "report.json" if Path(p).is_dir() else Path(p) for p in args.reports]
    merged = merge_report_files(paths, Path(args.out))
    failing = sum(1 for t in merged["tests"] if t["failed"])
    print(f"merged {len(paths)} report(s): {len(merged['tests'])} test(s), {failing} failing -> {args.out}")
    return 1 if failing else 0
