"""Baselines a change moves: the stored metrics that differ between a git ref (a PR's base) and the tree.

A pull request may re-record its own baselines (``--gate-update``) and so make its own regression pass. That is
the accept path, and it stays; but a reviewer must see it. ``--gate-baselines-ref REF`` reads every baseline file
as it is at REF and lists, first in the summary, ``report.md`` and the PR comment, each metric whose stored
figure differs, added or removed, old -> new, and whether this run's figure matches the new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vramgate.core.metrics import Metric, format_change, relative_change
from vramgate.machine.software import GitError, git
from vramgate.store.baselines import BaselineError, BaselineFile, parse_baseline
from vramgate.store.report_files import MovedMetric


class RefError(ValueError):
    """A ref that names no commit, or a baselines folder outside the ref's repository."""


@dataclass(frozen=True)
class Move:
    """One stored metric that differs between the ref and the tree (None: absent on that side)."""

    file: str
    """The baseline file, relative to the repository root."""
    nodeid: str
    metric: str
    old: Metric | None
    new: Metric | None

    @property
    def change(self) -> str:
        """``added``, ``removed``, or the change from old to new value as a signed percentage."""
        if self.old is None:
            return "added"
        if self.new is None:
            return "removed"
        return format_change(relative_change(self.new.value, self.old.value))

    def record(self, now: Metric | None, matches: bool | None) -> MovedMetric:
        """This move as a report's record, with the value measured *now* (None: not measured) and whether it
        *matches* new."""
        either = self.new or self.old
        assert either is not None, "a move has at least one side"
        return MovedMetric(self.file, self.nodeid, self.metric, self.old.value if self.old else None,
                           self.new.value if self.new else None, either.unit, self.change,
                           now.value if now else None, matches)


def _parse(path: Path, text: str) -> BaselineFile | None:
    try:
        return parse_baseline(path, text)
    except BaselineError:
        return None  # a file unusable at the ref: every metric of the tree's counts as added


def _same(a: Metric, b: Metric) -> bool:
    return a.to_json() == b.to_json()


def resolve(root: Path, ref: str, baselines_dir: Path) -> tuple[Path, str]:
    """(repository top, baselines folder relative to it); :class:`RefError` when *ref* names no commit there."""
    try:
        top = Path(git(root, "rev-parse", "--show-toplevel").strip())
        git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except GitError:
        raise RefError(f"--gate-baselines-ref {ref!r}: not a commit of {root} (fetch it first, e.g. "
                       f"git fetch origin {ref})") from None
    try:
        return top, baselines_dir.resolve().relative_to(top.resolve()).as_posix()
    except ValueError:
        raise RefError(f"--gate-baselines-ref: the baselines folder {baselines_dir} is outside the repository "
                       f"{top}") from None


def moved(root: Path, ref: str, baselines_dir: Path) -> list[Move]:
    """Every stored metric under *baselines_dir* that differs between *ref* and the working tree."""
    top, folder = resolve(root, ref, baselines_dir)
    listed = git(top, "ls-tree", "-r", "--name-only", ref, "--", folder).split()
    old_files = {name: git(top, "show", f"{ref}:{name}") for name in listed if name.endswith(".json")}
    new_files = {p.relative_to(top).as_posix(): p.read_text(encoding="utf-8")
                 for p in sorted(baselines_dir.glob("*/*.json")) if p.is_file()}
    out: list[Move] = []
    for name in sorted(set(old_files) | set(new_files)):
        old = _parse(top / name, old_files[name]) if name in old_files else None
        new = _parse(top / name, new_files[name]) if name in new_files else None
        nodeids = set(old.tests if old else ()) | set(new.tests if new else ())
        for nodeid in sorted(nodeids):
            a = old.tests[nodeid].metrics if old and nodeid in old.tests else {}
            b = new.tests[nodeid].metrics if new and nodeid in new.tests else {}
            for metric in sorted(set(a) | set(b)):
                if metric in a and metric in b and _same(a[metric], b[metric]):
                    continue
                out.append(Move(name, nodeid, metric, a.get(metric), b.get(metric)))
    return out
