"""``vramgate upgrade FROM TO``: the suites under two vLLM releases, compared; paired latency; the profiles' fate."""

from __future__ import annotations

import argparse
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``upgrade`` command."""
    up = sub.add_parser("upgrade", help="what a vLLM upgrade does: the suites under both releases compared, paired "
                                        "latency new / old, every profile checked against both")
    up.add_argument("old", metavar="FROM", help="the vLLM release upgraded from, e.g. 0.31.0")
    up.add_argument("new", metavar="TO", help="the vLLM release upgraded to, e.g. 0.32.0")
    up.add_argument("--from-python", metavar="PY", help="FROM's engine environment (default: made under "
                                                        ".vramgate/engines/ with vramgate install-engine)")
    up.add_argument("--to-python", metavar="PY", help="TO's engine environment (default: as for --from-python)")
    up.add_argument("--no-install", action="store_true", help="fail instead of making a missing engine environment")
    up.add_argument("--tier", choices=("cpu", "gpu"), default="cpu", help="the engine build (default: cpu)")
    up.add_argument("--out", type=Path, default=Path("upgrade-report"), help="the report folder "
                                                                              "(default: upgrade-report)")
    up.add_argument("--suite", action="append", default=[], metavar="NAME",
                    help="a suite (or test path) to run; repeat; default: every suite")
    up.add_argument("-m", dest="marks", default="not gate_nightly",
                    help="pytest mark expression (default: 'not gate_nightly', the pre-merge set; '' for all)")
    up.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    up.add_argument("-n", dest="workers", type=int, default=2, help="pytest-xdist workers per run (default: 2)")
    up.add_argument("--no-paired", action="store_true", help="leave out the paired latency run")
    add_root(up)
    up.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the upgrade and print its report; 1 when it regresses something, 2 when it cannot run."""
    from vramgate.tools.upgrade import UpgradeError, main_exit, upgrade

    root = project_root(args.root)
    try:
        data = upgrade(root, args.old, args.new, out=args.out.absolute(), tier=args.tier,
                       old_python=args.from_python, new_python=args.to_python, install=not args.no_install,
                       suites=args.suite, marks=args.marks or None, keyword=args.keyword, workers=args.workers,
                       paired=not args.no_paired)
    except UpgradeError as exc:
        print(f"vramgate upgrade: {exc}")
        return 2
    print((args.out / "upgrade.md").read_text(encoding="utf-8"))
    print(f"vramgate upgrade: report in {args.out / 'upgrade.md'} and {args.out / 'upgrade.json'} "
          f"({data['seconds']:.0f} s)")
    return main_exit(data)
