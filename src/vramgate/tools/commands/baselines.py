"""``vramgate baselines combine``: the baselines a sharded ``--gate-update`` re-recorded, merged into one folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramgate.store.baselines import BaselineError, combine_shards
from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``baselines`` command group: ``combine``."""
    base = sub.add_parser("baselines", help="stored baselines")
    base_sub = base.add_subparsers(dest="baselines_command", required=True)
    combine = base_sub.add_parser(
        "combine", help="merge the copies of the baselines folder that the shards of a --gate-update run "
                        "re-recorded, test by test (baselines.yml)")
    combine.add_argument("shards", nargs="+", help="each shard's copy of the baselines folder")
    combine.add_argument("--into", default="baselines",
                         help="the baselines folder every shard's copy began as (default: baselines)")
    combine.set_defaults(func=run_combine)


def run_combine(args: argparse.Namespace) -> int:
    """Combine; exit 1, writing nothing, when two shards changed the same test or a file cannot be read."""
    shards = [Path(p) for p in args.shards]
    missing = [str(p) for p in shards if not p.is_dir()]
    if missing:
        print(f"vramgate baselines combine: not a folder: {', '.join(missing)}", file=sys.stderr)
        return 1
    try:
        lines = combine_shards(Path(args.into), sorted(shards))
    except BaselineError as exc:
        print(f"vramgate baselines combine: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines) if lines else "no shard changed a baseline")
    return 0
