"""``vramgate matrix``: what the gate covers on this machine, from the project's matrix (``vramgate.toml``)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramgate.tools.commands.common import Subparsers, add_root, project_root

if TYPE_CHECKING:
    from vramgate.matrix import Matrix


def register(sub: Subparsers) -> None:
    """Add the ``matrix`` command."""
    cmd = sub.add_parser("matrix", help="the matrix's entries: which run on this machine, which skip and why")
    cmd.add_argument("--check", action="store_true", help="validate the file only (exit 1 naming file and field)")
    cmd.add_argument("--json", action="store_true", help="print the entries as JSON")
    cmd.add_argument("--file", metavar="PATH", help="the matrix file (default: vramgate.toml at the root, else "
                     "the built-in default)")
    add_root(cmd)
    cmd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the matrix (``--check``) or print its entries with what each does on this machine."""
    from vramgate.matrix import MatrixError, project_matrix

    root = project_root(args.root)
    try:
        matrix = project_matrix(root, args.file)
    except MatrixError as exc:
        print(f"vramgate matrix: {exc}", file=sys.stderr)
        return 1
    if args.check:
        print(f"{matrix.source}: {len(matrix.models)} models, {len(matrix.workloads)} workloads, {len(matrix.entries)} "
              "entries: valid")
        return 0
    rows = coverage(matrix, root)
    if args.json:
        print(json.dumps({"source": matrix.source, "entries": rows}, indent=2))
        return 0
    print(f"matrix: {matrix.source}")
    for row in rows:
        state = {"runs": "runs here", "skips": f"skips: {row['why']}",
                 "not collected": f"not collected: {row['why']}"}[row["here"]]
        print(f"entries[{row['index']}] {row['describe']}\n    {state}")
    counts = {k: sum(r["here"] == k for r in rows) for k in ("runs", "skips", "not collected")}
    print(f"{counts['runs']} run here, {counts['skips']} skip, {counts['not collected']} not collected")
    return 0


def coverage(matrix: Matrix, root: Path) -> list[dict[str, Any]]:
    """One row per entry of *matrix*: what it runs, and whether it runs on this machine (``runs``, ``skips``,
    ``not collected``) and why not."""
    from vramgate.engine import engine_tier
    from vramgate.machine import hardware
    from vramgate.matrix import Machine, collection_problem, gpu_count_problem, missing_trace

    tier = engine_tier()

    @functools.cache
    def machine() -> Machine:
        fp = hardware.detect()
        return Machine(tier, fp.key, len(fp.gpus), fp.isa or "")

    rows = []
    for entry in matrix.entries:
        why = collection_problem(entry, tier, machine)
        here = "not collected"
        if why is None:
            why = (gpu_count_problem(entry, machine()) if tier == "gpu" and entry.tp > 1 else None) \
                or missing_trace(entry, root)
            here = "skips" if why else "runs"
        rows.append({"index": entry.index, "suites": list(entry.suites), "model": entry.model.name,
                     "config": entry.model.config, "tier": entry.tier, "gpu": entry.gpu, "tp": entry.tp,
                     "block_size": list(entry.block_size), "kv_cache_dtype": list(entry.kv_cache_dtype),
                     "weights": "checkpoint" if entry.model.checkpoint else "dummy",
                     "budgets": [b.describe() for b in entry.budgets], "describe": entry.describe(), "here": here,
                     "why": why})
    return rows
