"""``vramgate trace import``: a request trace from a local file saved as a seeded workload
(``fixtures/workloads/<name>.json``, which ``EngineSpec(workload=NAME)`` and ``--workload NAME`` then find)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``trace`` command and its ``import`` subcommand."""
    from vramgate.workloads.traces import DEFAULT_TOKENS_PER_WORD, FORMATS, TOO_LONG

    trace = sub.add_parser("trace", help="request traces: import one as a seeded workload")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    imp = trace_sub.add_parser(
        "import", help="save a trace file (ShareGPT JSON, vLLM benchmark JSONL, CSV of lengths) as a workload",
        description="Read a request trace from a local file, write fixtures/workloads/NAME.json and print its "
                    "request count and length statistics. Formats and token estimates: vramgate.workloads.traces.")
    imp.add_argument("file", help="the trace file")
    imp.add_argument("--format", choices=FORMATS,
                     help="the file's format (default: from its extension: .json sharegpt, .jsonl, .csv)")
    imp.add_argument("--name", help="the workload's name (default: the file's name without its extension)")
    imp.add_argument("--max-model-len", type=int, help="drop (or --too-long clip) requests longer than this")
    imp.add_argument("--too-long", choices=TOO_LONG, default="drop",
                     help="what to do with a request over --max-model-len (default: drop)")
    imp.add_argument("--requests", type=int, help="keep a seeded sample of this many requests (default: all)")
    imp.add_argument("--seed", type=int, default=0, help="the sample's and the workload's seed (default: 0)")
    imp.add_argument("--tokens-per-word", type=float, default=DEFAULT_TOKENS_PER_WORD,
                     help=f"tokens per whitespace word where the file has text, not counts "
                          f"(default: {DEFAULT_TOKENS_PER_WORD})")
    imp.add_argument("--output-len", type=int,
                     help="output tokens of JSONL records without 'output_tokens' or 'output_len'")
    add_root(imp)
    imp.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    """Import the trace, write the workload file and print where it went and the summary."""
    from vramgate.workloads.traces import import_trace, save_workload

    root = project_root(args.root)
    path = Path(args.file)
    workload, summary = import_trace(
        path, args.format, name=args.name, max_model_len=args.max_model_len, too_long=args.too_long,
        requests=args.requests, seed=args.seed, tokens_per_word=args.tokens_per_word, output_len=args.output_len)
    written = save_workload(workload, root)
    for line in summary.lines():
        print(line)
    print(f"wrote {written} (workload {workload.name!r}, seed {workload.seed})")
    return 0
