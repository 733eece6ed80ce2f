"""``vramgate changes REF``: the files a change touches and how far each reaches (Note [what a change touches]), for
a workflow deciding which jobs a pull request needs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``changes`` command."""
    cmd = sub.add_parser("changes", help="the files a change touches against REF's merge base, and how far each "
                                         "reaches: every test, some, or none (docs)")
    cmd.add_argument("ref", metavar="REF", help="the base the change is judged against (a PR's base)")
    cmd.add_argument("--github-output", metavar="FILE", help="also write 'tests=true|false' (whether any changed file "
                     "is an input of a test: the harness's or the gate's) and 'gate=true|false' (of a gate test) "
                     "to FILE, as GitHub Actions' $GITHUB_OUTPUT reads them")
    add_root(cmd)
    cmd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print each changed file with its reach; exit 1 naming the ref when it names no commit."""
    from vramgate.store.changes import ChangeError, changed_files, reach

    root = project_root(args.root)
    try:
        changes = changed_files(root, args.ref)
    except ChangeError as exc:
        print(f"vramgate changes {exc}", file=sys.stderr)
        return 1
    reaches = {f: reach(f) for f in changes.files}
    gate = bool(changes.outside) or any(r.kind != "none" for r in reaches.values())
    tests = gate or any(f.startswith(("tests/", "examples/")) for f in changes.files)
    print(f"{len(changes.files)} file(s) changed against {args.ref} (merge base {changes.short})")
    for f, r in reaches.items():
        print(f"  {r.kind:>5}  {f}: {r.why}")
    for f in changes.outside:
        print(f"  every  {f}: outside the project's root")
    print("the gate's tests: " + ("--gate-affected selects them" if gate else "none is touched") + "; the harness's: "
          + ("run" if tests else "none is touched (docs only)"))
    if args.github_output:
        with Path(args.github_output).open("a", encoding="utf-8") as out:
            out.write(f"tests={'true' if tests else 'false'}\ngate={'true' if gate else 'false'}\n")
    return 0
