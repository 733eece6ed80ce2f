"""``vramgate patches check|show|against``: the optimization profiles under ``patches/`` (``against``:
:mod:`vramgate.tools.commands.patches_against`)."""

from __future__ import annotations

import argparse

from vramgate.tools.commands import patches_against
from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``patches`` command group: ``check``, ``show`` and ``against``."""
    pat = sub.add_parser("patches", help="optimization profiles under patches/")
    pat_sub = pat.add_subparsers(dest="patches_command", required=True)
    chk = pat_sub.add_parser("check", help="does every profile apply to the installed vLLM? (exit 1 if not)")
    add_root(chk)
    chk.set_defaults(func=run_check)
    show = pat_sub.add_parser("show", help="print what a profile changes")
    show.add_argument("name")
    add_root(show)
    show.set_defaults(func=run_show)
    patches_against.register(pat_sub)


def run_check(args: argparse.Namespace) -> int:
    """Say for every profile whether it applies to the installed vLLM; exit 1 if one does not."""
    from vramgate.profiles import check, load_profiles

    root = project_root(args.root)
    profiles = load_profiles(root)
    failed = 0
    for profile in profiles:
        notes: list[str] = []
        problem = check(profile, notes)
        kind = f"{len(profile.series)} diff(s)" if profile.series else "config only"
        status = "applies" if problem is None else f"DOES NOT APPLY: {problem}"
        failed += problem is not None
        print(f"{profile.name:<32} {profile.distribution}{profile.version:<10} {kind:<12} {status}")
        for note in notes:  # a fork of the release: the diff applies, a few lines away from where it says
            print(f"    {note}")
    print(f"{len(profiles)} profile(s), {failed} not applying")
    return 1 if failed else 0


def run_show(args: argparse.Namespace) -> int:
    """Print a profile's manifest and its diffs."""
    from vramgate.profiles import find_profile, parse_diff

    profile = find_profile(project_root(args.root), args.name)
    print(f"{profile.name}: {profile.description.strip()}")
    if profile.hypothesis:
        print(f"\nhypothesis: {profile.hypothesis.strip()}")
    print(f"\ntarget: {profile.distribution} {profile.version} (package {profile.package})")
    print(f"suites: {', '.join(profile.suites) or '-'}; requires: device {profile.requires.device}")
    for key, value in profile.engine_args.items():
        print(f"engine argument: {key} = {value!r}")
    for key, value in profile.env.items():
        print(f"environment: {key}={value}")
    if profile.checkpoint:
        print(f"checkpoint: {profile.checkpoint.format}, group size {profile.checkpoint.group_size}")
    for claim in profile.claims:
        print(f"claim: {claim.describe()}")
    print(f"outputs: {profile.outputs.describe()} ({profile.outputs.origin or 'the manifest'})")
    for diff in profile.series:
        files = parse_diff(diff.read_text(encoding="utf-8"), diff.name)
        print(f"\n{diff.name}: " + ", ".join(f"{f.path} ({len(f.hunks)} hunk(s))" for f in files))
        print(diff.read_text(encoding="utf-8"))
    return 0
