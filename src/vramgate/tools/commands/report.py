"""``vramgate report merge``, ``compare``, ``html``, ``export`` and ``durations``: gate reports."""

from __future__ import annotations

import argparse
from pathlib import Path

from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``report`` command group: ``merge``, ``compare``, ``html``, ``export``, ``durations``."""
    rep = sub.add_parser("report", help="gate reports")
    rep_sub = rep.add_subparsers(dest="report_command", required=True)
    merge = rep_sub.add_parser("merge", help="merge the report.json of several shards into one report")
    merge.add_argument("reports", nargs="+", help="report.json files (or folders holding one)")
    merge.add_argument("--out", required=True, help="folder for the merged report.md, report.json, changes.png")
    merge.set_defaults(func=run_merge)
    compare = rep_sub.add_parser(
        "compare", help="compare two runs' report.json metric by metric (the first plays the baseline)")
    compare.add_argument("old", help="the first run's report.json (or a folder holding one)")
    compare.add_argument("new", help="the second run's report.json (or a folder holding one)")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    compare.add_argument("--markdown", metavar="FILE", help="also write the comparison as markdown to FILE")
    compare.add_argument("--all", action="store_true", help="list unchanged metrics too")
    compare.set_defaults(func=run_compare)
    page = rep_sub.add_parser(
        "html", help="one self-contained HTML page of a run: header, claims, failures, tables and charts")
    page.add_argument("report", help="the run's report.json (or a folder holding one)")
    page.add_argument("--history", metavar="FILE", help="a history JSON (vramgate history) for per-suite line charts")
    page.add_argument("--out", metavar="FILE", help="the page to write (default: report.html beside report.json)")
    page.set_defaults(func=run_html)
    export = rep_sub.add_parser(
        "export", help="convert a run's report.json for a dashboard: Bencher Metric Format or PyTorch benchmark "
                       "records")
    export.add_argument("report", help="the run's report.json (or a folder holding one)")
    export.add_argument("--format", required=True, choices=("bmf", "pytorch"),
                        help="bmf (Bencher Metric Format) or pytorch (the PyTorch benchmark database's records)")
    export.add_argument("--out", metavar="FILE", help="write to FILE instead of printing")
    export.set_defaults(func=run_export)
    durations = rep_sub.add_parser(
        "durations", help="the seconds each test of a run took, as the file --gate-durations orders tests by")
    durations.add_argument("report", help="the run's report.json (or a folder holding one)")
    durations.add_argument("--min-seconds", type=float, default=0.5, metavar="S",
                           help="leave out tests shorter than S seconds (default 0.5: they order last anyway)")
    durations.add_argument("--out", metavar="FILE", help="write to FILE instead of printing")
    durations.set_defaults(func=run_durations)


def run_merge(args: argparse.Namespace) -> int:
    """Merge the shards' reports into one; exit 1 when a test in them failed."""
    from vramgate.report import merge_report_files

    paths = [Path(p) / "report.json" if Path(p).is_dir() else Path(p) for p in args.reports]
    merged = merge_report_files(paths, Path(args.out))
    failing = sum(1 for t in merged["tests"] if t["failed"])
    print(f"merged {len(paths)} report(s): {len(merged['tests'])} test(s), {failing} failing -> {args.out}")
    return 1 if failing else 0


def run_compare(args: argparse.Namespace) -> int:
    """Compare two runs; exit 1 when a metric regressed, 0 otherwise (2 for bad input, from the caller)."""
    import json

    from vramgate.report import compare_report_files
    from vramgate.store.files import atomic_write_text

    result = compare_report_files(Path(args.old), Path(args.new))
    if args.markdown:
        atomic_write_text(Path(args.markdown), result.markdown(everything=args.all))
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        print(result.text(everything=args.all), end="")
    return 1 if result.regressions else 0


def run_html(args: argparse.Namespace) -> int:
    """Write the run's HTML page; 0 (2 for bad input, from the caller)."""
    from vramgate.report import ReportError, html_page, load_history, load_report, read_report
    from vramgate.store.files import atomic_write_text

    source = Path(args.report)
    report_file = source / "report.json" if source.is_dir() else source
    data = read_report(load_report(source), str(report_file), ReportError)
    history = load_history(Path(args.history)) if args.history else None
    out = Path(args.out) if args.out else report_file.parent / "report.html"
    atomic_write_text(out, html_page(data, history))
    print(f"wrote {out}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Print (or write to ``--out``) a report's metrics in the export format; 0 (2 for bad input, from the caller)."""
    from vramgate.report import export_text, load_report
    from vramgate.store.files import atomic_write_text

    path = Path(args.report)
    source = str(path / "report.json" if path.is_dir() else path)
    text = export_text(load_report(path), args.format, source)
    if args.out:
        atomic_write_text(Path(args.out), text)
    else:
        print(text, end="")
    return 0


def run_durations(args: argparse.Namespace) -> int:
    """Print (or write to ``--out``) the run's seconds per test; 0 (2 for bad input, from the caller)."""
    from vramgate.report import ReportError, load_report
    from vramgate.store.durations import DurationsError, check_durations, durations_text
    from vramgate.store.files import atomic_write_text

    path = Path(args.report)
    source = str(path / "report.json" if path.is_dir() else path)
    data = load_report(path)
    if "durations" not in data:
        raise ReportError(f"{source}: records no durations (written by an older vramgate): run the tests again")
    try:
        durations = check_durations(data["durations"], f"{source}: durations")
    except DurationsError as exc:
        raise ReportError(str(exc)) from None
    text = durations_text(durations, args.min_seconds)
    if args.out:
        atomic_write_text(Path(args.out), text)
        print(f"wrote {args.out}: {text.count(chr(10)) - 2} test(s) of at least {args.min_seconds:g} s")
    else:
        print(text, end="")
    return 0
