"""``vramgate patches against``: what the profiles under ``patches/`` would do on another vLLM install.

Note [profiles on another release] (:mod:`vramgate.profiles.applicability`) says what is checked and proposed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add ``patches against`` to the ``patches`` command group (*sub* is its subcommands)."""
    cmd = sub.add_parser(
        "against", help="does every profile apply to another vLLM install (at its place, at offsets, or not)?",
        description="Check the profiles' diffs against the vLLM another interpreter has (read only). With "
                    "--base-python (the install the profiles were written for) a profile that moved or conflicts "
                    "gets a proposed rebased diff from git's three-way merge, written under --out. Nothing is "
                    "written into either install or into patches/. Exit 0 unless a profile cannot be read.")
    cmd.add_argument("--vllm-python", required=True, metavar="PY",
                     help="the interpreter whose vLLM the profiles are checked against")
    cmd.add_argument("--base-python", metavar="PY",
                     help="the interpreter whose vLLM the profiles were written for: three-way proposals from it")
    cmd.add_argument("--out", metavar="DIR",
                     help="write proposals here: <profile>/proposed.patch, or <profile>/<file>.conflict")
    cmd.add_argument("profiles", nargs="*", metavar="PROFILE",
                     help="profile names under patches/, or profile folders (default: every profile)")
    add_root(cmd)
    cmd.set_defaults(func=run_against)


def _folders(root: Path, names: list[str]) -> list[Path]:
    """The profile folders *names* means: a folder holding a manifest, else a name under ``patches/``."""
    from vramgate.profiles import patches_dir

    if not names:
        base = patches_dir(root)
        return [d for d in sorted(base.iterdir()) if d.is_dir()] if base.is_dir() else []
    return [Path(n) if (Path(n) / "manifest.toml").is_file() else patches_dir(root) / n for n in names]


def run_against(args: argparse.Namespace) -> int:
    """Print one line per profile (status, specifier, moved or refused hunks, the proposal); exit 1 if a profile
    cannot be read."""
    from vramgate.machine.software import vllm_install
    from vramgate.profiles import (
        STATUSES,
        PatchError,
        ProfileError,
        check_applicability,
        load_profile,
        write_proposal,
    )

    root = project_root(args.root)
    other = vllm_install(args.vllm_python)
    base = vllm_install(args.base_python) if args.base_python else None
    print(f"checked against {other.distribution} {other.version} ({other.package_dir})")
    if base is not None:
        print(f"three-way proposals from {base.distribution} {base.version} ({base.package_dir})")
    out = Path(args.out) if args.out else None
    counts: dict[str, int] = {}
    unreadable = 0
    for folder in _folders(root, args.profiles):
        try:
            profile = load_profile(folder)
            result = check_applicability(profile, other.package_dir, other.version,
                                         base_dir=base.package_dir if base else None,
                                         base_version=base.version if base else "")
        except (ProfileError, PatchError) as exc:
            unreadable += 1
            print(f"{folder.name:<32} CANNOT BE READ: {exc}")
            continue
        counts[result.status] = counts.get(result.status, 0) + 1
        covers = "covers" if result.in_target else "does not cover"
        print(f"{profile.name:<32} {result.status:<10} {result.target} {covers} {result.version}")
        for moved in result.offsets:
            print(f"    {moved.path}: hunk {moved.hunk} applies at line {moved.line} (offset {moved.offset} lines)")
        for refused in result.conflicts:
            print(f"    {refused.message}")
        if result.proposal is not None:
            proposal = result.proposal
            said = "merges cleanly" if proposal.complete else "does not merge: " + ", ".join(proposal.unmerged)
            written = write_proposal(result, out) if out is not None else []
            where = f" -> {', '.join(str(p) for p in written)}" if written else ""
            print(f"    three-way from {proposal.base_version}: {said}{where}")
        elif result.proposal_problem:
            print(f"    no three-way proposal: {result.proposal_problem}")
        elif result.status in ("offsets", "conflicts") and base is None:
            print("    (--base-python for a proposed rebased diff)")
    summary = ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts)
    print(f"{sum(counts.values()) + unreadable} profile(s): {summary or 'none checked'}"
          + (f", {unreadable} cannot be read" if unreadable else ""))
    return 1 if unreadable else 0
