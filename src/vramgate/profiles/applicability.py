"""What a profile would do on another vLLM release: does its diff series apply there (at its place, at offsets,
or not), and a proposed rebased series made by git's three-way merge.

Note [profiles on another release]: the check reads another install's package folder and applies the series to
copies of the touched files, as the overlay does (:func:`vramgate.profiles.overlay.patched_files`, with the
profile's own version check off: a version outside the profile's specifier is reported, not refused). When
a hunk does not match, or matches only at an offset, and the package folder of the release the profile was
written for (the *base*) is at hand, each touched file is merged with ``git merge-file``: base = the base
release's file, ours = that file with the profile applied, theirs = the other release's file. Files that merge
cleanly make a proposed diff against the other release (paths ``a/vllm/...``, as the profile's own diffs);
a file that does not keeps its merged text with conflict markers. Nothing is written into either install or
into ``patches/``: the proposal is returned as text, and :func:`write_proposal` writes it into a report folder.
A series is applied diff by diff, all-or-nothing, so a conflict in one diff hides what the later ones would do.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vramgate.profiles.diff import HunkFailure, HunkOffset, PatchError, parse_diff
from vramgate.profiles.manifest import Profile
from vramgate.profiles.overlay import patched_files, target_covers
from vramgate.store.files import atomic_write_text

#: What :func:`check_applicability` finds: every hunk at its place, some at an offset, some not matching, no diffs.
STATUSES = ("applies", "offsets", "conflicts", "no-diffs")


@dataclass(frozen=True)
class FileMerge:
    """One touched file merged three ways: ``merged`` (clean), ``conflicts`` (``text`` has conflict markers,
    ``conflicts`` regions) or ``absent`` (the other release has no such file; ``text`` is empty)."""

    path: str
    outcome: str
    text: str
    conflicts: int = 0


@dataclass(frozen=True)
class Proposal:
    """The profile rebased onto the other release by three-way merges: every touched file's merge, and the
    unified diff (against the other release) of the files that merged cleanly."""

    base_version: str
    files: tuple[FileMerge, ...]
    patch: str

    @property
    def complete(self) -> bool:
        """Whether every touched file merged cleanly, so :attr:`patch` is the whole rebased series."""
        return all(f.outcome == "merged" for f in self.files)

    @property
    def unmerged(self) -> tuple[str, ...]:
        """The files that did not merge cleanly (conflicts, or absent from the other release)."""
        return tuple(f.path for f in self.files if f.outcome != "merged")


@dataclass(frozen=True)
class Applicability:
    """What a profile's diffs do on one release of the target (Note [profiles on another release])."""

    profile: str
    target: str
    """The profile's version specifier (``==0.32.0``)."""
    version: str
    in_target: bool
    """Whether :attr:`version` is inside :attr:`target`; outside is reported, not refused."""
    status: str
    """One of :data:`STATUSES`."""
    offsets: tuple[HunkOffset, ...] = ()
    conflicts: tuple[HunkFailure, ...] = ()
    proposal: Proposal | None = None
    proposal_problem: str = ""
    """Why no proposal could be made although one was asked for (the profile does not apply to the base)."""

    def summary(self) -> str:
        """One line: the status, whether the target specifier covers the version, then :meth:`details`."""
        spec = f"{self.target} {'covers' if self.in_target else 'does not cover'} {self.version}"
        return "; ".join([f"{self.profile}: {self.status}", spec, *self.details()])

    def details(self) -> list[str]:
        """The hunks moved or refused, and what the three-way merge proposes (or why it proposes nothing)."""
        parts: list[str] = []
        if self.offsets:
            parts.append("moved: " + ", ".join(f"{o.path} hunk {o.hunk} by {o.offset:+d}" for o in self.offsets))
        if self.conflicts:
            parts.append("refused: " + ", ".join(f"{c.path} hunk {c.hunk}" if c.hunk else c.path
                                                  for c in self.conflicts))
        if self.proposal is not None:
            if self.proposal.complete:
                parts.append(f"3-way from {self.proposal.base_version}: merges cleanly")
            else:
                parts.append(f"3-way from {self.proposal.base_version}: does not merge: "
                             + ", ".join(self.proposal.unmerged))
        elif self.proposal_problem:
            parts.append(f"no 3-way proposal: {self.proposal_problem}")
        return parts


def _package_folder(profile: Profile, path: Path, what: str) -> Path:
    if not path.is_dir():
        raise PatchError(f"{profile.name}: {what} {path} is not a folder")
    if path.name != profile.package:
        raise PatchError(f"{profile.name}: {what} {path} is not a {profile.package!r} package folder")
    return path


def check_applicability(profile: Profile, package_dir: Path, version: str, *, base_dir: Path | None = None,
                        base_version: str = "") -> Applicability:
    """Check *profile*'s diff series against the package folder *package_dir* of release *version* (only read).

    With *base_dir* (the package folder of the release the profile was written for, *base_version* its
    version), a series that applies only at offsets or not at all gets a three-way :class:`Proposal`.
    :class:`PatchError` when the profile itself is at fault (a diff that does not parse, a path outside the
    package) or a folder is not the target package; a hunk that does not match is a conflict, not an error.
    """
    _package_folder(profile, package_dir, "package folder")
    if base_dir is not None:
        _package_folder(profile, base_dir, "base package folder")
    in_target = target_covers(profile, version)
    if not profile.series:
        return Applicability(profile.name, profile.version, version, in_target, "no-diffs")
    for diff in profile.series:  # a malformed diff is the profile's fault on any release: refuse it first
        parse_diff(diff.read_text(encoding="utf-8"), f"{profile.name}/{diff.name}")
    offsets: list[HunkOffset] = []
    conflicts: tuple[HunkFailure, ...] = ()
    try:
        patched_files(profile, package_dir, version, any_version=True, offsets=offsets)
    except PatchError as exc:
        if not exc.failures:
            raise
        conflicts = exc.failures
    status = "conflicts" if conflicts else "offsets" if offsets else "applies"
    proposal, problem = None, ""
    if base_dir is not None and status != "applies":
        label = base_version or "base"
        try:
            ours = patched_files(profile, base_dir, label, any_version=True)
        except PatchError as exc:
            problem = f"it does not apply to the base {label} either ({exc})"
        else:
            proposal = _propose(profile, ours, base_dir, package_dir, label, version)
    return Applicability(profile.name, profile.version, version, in_target, status, tuple(offsets), conflicts,
                         proposal, problem)


def _propose(profile: Profile, ours: dict[str, str], base_dir: Path, other_dir: Path, base_version: str,
             version: str) -> Proposal:
    """Merge every touched file three ways and diff the clean merges against the other release."""
    files: list[FileMerge] = []
    diffs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vramgate-merge-") as tmp:
        for rel, patched in ours.items():
            base_file, other_file = base_dir.parent / rel, other_dir.parent / rel
            base_text = base_file.read_text(encoding="utf-8") if base_file.is_file() else None
            other_text = other_file.read_text(encoding="utf-8") if other_file.is_file() else None
            if other_text is None and base_text is not None:
                files.append(FileMerge(rel, "absent", ""))
                continue
            labels = (f"{profile.name} on {base_version}", base_version, version)
            text, count = _merge_file(Path(tmp), patched, base_text or "", other_text or "", labels)
            files.append(FileMerge(rel, "conflicts" if count else "merged", text, count))
            if not count:
                diffs.append(unified_diff(rel, other_text, text))
    return Proposal(base_version, tuple(files), "".join(diffs))


def _merge_file(tmp: Path, ours: str, base: str, theirs: str, labels: tuple[str, str, str]) -> tuple[str, int]:
    """``git merge-file --diff3 -p`` of three texts (copies in *tmp*): the merged text and how many conflicts."""
    paths = [tmp / "ours", tmp / "base", tmp / "theirs"]
    for path, text in zip(paths, (ours, base, theirs), strict=True):
        path.write_text(text, encoding="utf-8")
    command = ["git", "merge-file", "-p", "--diff3", "-L", labels[0], "-L", labels[1], "-L", labels[2],
               *map(str, paths)]
    try:
        out = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "LC_ALL": "C", "GIT_CEILING_DIRECTORIES": str(tmp.parent)})
    except (OSError, subprocess.SubprocessError) as exc:
        raise PatchError(f"git merge-file could not run: {exc}") from None
    if not 0 <= out.returncode < 128:  # git merge-file: the number of conflicts, or negative on an error
        raise PatchError(f"git merge-file failed: {out.stderr.strip() or f'exit status {out.returncode}'}")
    return out.stdout, out.returncode


def unified_diff(rel: str, old: str | None, new: str) -> str:
    """A unified diff of one file, ``--- a/<rel>`` / ``+++ b/<rel>`` (``/dev/null`` for a new file), as the
    profiles' diffs are written; "" when the texts are equal."""
    lines = difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                 "/dev/null" if old is None else f"a/{rel}", f"b/{rel}")
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def write_proposal(result: Applicability, out_dir: Path) -> list[Path]:
    """Write *result*'s proposal under ``<out_dir>/<profile>/``: ``proposed.patch`` when every file merged,
    else ``<file>.conflict`` (the merged text with conflict markers, at the file's path) for each file that did
    not and ``merged.patch`` for those that did. What an earlier call wrote there goes first, so the folder
    shows this proposal only. Returns the files written (none without a proposal)."""
    folder = out_dir / result.profile
    if folder.is_dir():
        for old in [folder / "proposed.patch", folder / "merged.patch", *folder.rglob("*.conflict")]:
            old.unlink(missing_ok=True)
    proposal = result.proposal
    if proposal is None:
        return []
    written: list[Path] = []
    if proposal.patch:
        written.append(folder / ("proposed.patch" if proposal.complete else "merged.patch"))
        atomic_write_text(written[-1], proposal.patch)
    for merge in proposal.files:
        if merge.outcome == "conflicts":
            written.append(folder / f"{merge.path}.conflict")
            atomic_write_text(written[-1], merge.text)
    return written
