"""Unified diffs of a profile's series: parsing, checking their paths, ``git apply``, and saying where a hunk
does not match.

Note [diffs as git applies them] (:func:`vramgate.profiles.overlay.patched_files`) says how a series is applied.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class HunkFailure:
    """A hunk that does not apply where it says (its context differs), or a file the diff needs that is absent
    (or, for a new file, present): the diff, the file, the hunk (1-based in its file; 0 for the whole file), its
    ``@@`` header and the whole message."""

    diff: str
    path: str
    hunk: int
    header: str
    message: str


@dataclass(frozen=True)
class HunkOffset:
    """A hunk that applied a few lines away from where its diff says: the diff, the file, the hunk (1-based in
    its file), the line it applied at and the offset in lines."""

    diff: str
    path: str
    hunk: int
    line: int
    offset: int


class PatchError(ValueError):
    """A diff that cannot be applied; names the diff, the file, the hunk and the reason.

    ``failures`` lists the hunks that do not match the files (every failing file of the diff, its first failing
    hunk), empty when the diff itself is at fault (unparseable, a path outside the package).
    """

    def __init__(self, message: str, failures: tuple[HunkFailure, ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass
class Hunk:
    """One hunk of a diff: its ``@@`` header, where it starts in the old file and how many old lines it spans."""

    header: str
    old_start: int
    old_len: int
    lines: list[str]


@dataclass
class FilePatch:
    """The hunks of one file of a diff."""

    path: str
    """Path relative to the folder that holds the package (``vllm/v1/...``); "" for a new file's source."""
    new_file: bool
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path


def parse_diff(text: str, where: str) -> list[FilePatch]:
    """Parse a unified diff; :class:`PatchError` names the line that is not one."""
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(f"{where}: line {i + 1}: '---' without a following '+++'")
            old, new = _strip(line[4:]), _strip(lines[i + 1][4:])
            if new == "/dev/null":
                raise PatchError(f"{where}: line {i + 2}: deleting {old} is not supported")
            files.append(FilePatch(path=new, new_file=old == "/dev/null", hunks=[]))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchError(f"{where}: line {i + 1}: hunk before any file header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            body: list[str] = []
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                b = lines[i]
                if b.startswith("\\"):
                    i += 1
                    continue
                tag = b[:1] if b else " "
                if tag not in " +-":
                    raise PatchError(f"{where}: line {i + 1}: unexpected line in hunk {line!r}: {b[:60]!r}")
                body.append(tag + b[1:])
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise PatchError(f"{where}: hunk {line!r} is truncated (expected {old_len}/{new_len} lines, "
                                 f"found {seen_old}/{seen_new})")
            files[-1].hunks.append(Hunk(line, int(m.group(1)), old_len, body))
            continue
        i += 1
    if not files:
        raise PatchError(f"{where}: no file changes found (not a unified diff?)")
    return files


def check_path(path: str, package: str, where: str) -> PurePosixPath:
    """Refuse a diff path outside the target package."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] != package or len(p.parts) < 2:
        raise PatchError(f"{where}: {path!r} is outside the target package {package!r}; refused")
    return p


def mismatch(original: list[str], hunk: Hunk) -> str:
    """Where *hunk*'s context first differs from *original* at the hunk's own line: ``at line N: expected ...,
    found ...`` (what a reader needs to mend the diff), or "" when it matches there."""
    cur = hunk.old_start - 1 if hunk.old_len else hunk.old_start
    for line in hunk.lines:
        tag, body = line[0], line[1:]
        if tag in " -":
            found = original[cur] if cur < len(original) else "<end of file>"
            if found != body:
                return f"at line {cur + 1}: expected {body!r}, found {found!r}"
            cur += 1
    return ""


_GIT_HUNK_OK = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?", re.M)
_GIT_FAILED = re.compile(r"patch failed: (.+):(\d+)")
_GIT_CHECKING = re.compile(r"^Checking patch (.+)\.\.\.$", re.M)


def _sections(log: str) -> dict[str, str]:
    """``git apply --verbose``'s log cut into what it says of each file (after its ``Checking patch`` line)."""
    marks = list(_GIT_CHECKING.finditer(log))
    return {m.group(1): log[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(log)]
            for i, m in enumerate(marks)}


def git_apply(diff: Path, work: Path, fps: list[FilePatch], where: str, notes: list[str] | None) -> list[HunkOffset]:
    """Apply *diff* to the files under *work* with ``git apply`` (Note [diffs as git applies them]); return the
    hunks that applied at an offset (also written into *notes*).

    Raises :class:`PatchError` naming the diff, the file, the hunk and git's reason (its ``failures`` list every
    file that does not apply); *work* is then left as ``git apply`` leaves it on failure: unchanged (it applies
    all of a diff or nothing).
    """
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work.parent), "LC_ALL": "C"}
    try:
        out = subprocess.run(["git", "apply", "--verbose", "--whitespace=nowarn", str(diff.resolve())], cwd=work,
                             env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PatchError(f"{where}: git apply could not run: {exc}") from None
    log = out.stdout + out.stderr
    if out.returncode == 0:
        offsets = [HunkOffset(where, path, int(m.group(1)), int(m.group(2)), int(m.group(3)))
                   for path, section in _sections(log).items()
                   for m in _GIT_HUNK_OK.finditer(section) if m.group(3)]
        if notes is not None:
            notes.extend(f"{where}: hunk {o.hunk} applied at line {o.line} (offset {o.offset} lines)" for o in offsets)
        return offsets
    errors = [line.removeprefix("error: ") for line in log.splitlines() if line.startswith("error:")]
    reason = next((e for e in errors if "patch failed" in e or "does not apply" in e or "corrupt" in e),
                  errors[0] if errors else log.strip() or f"exit status {out.returncode}")
    failed = list(_GIT_FAILED.finditer(log))
    if not failed:
        path = fps[0].path if fps else "?"
        raise PatchError(f"{where}: {path}: does not apply (git apply: {reason})")
    sections = _sections(log)
    failures = tuple(_failure(where, m.group(1), int(m.group(2)), fps, work, sections.get(m.group(1), ""))
                     for m in failed)
    raise PatchError(failures[0].message, failures)


def _failure(where: str, path: str, line: int, fps: list[FilePatch], work: Path, section: str) -> HunkFailure:
    """The hunk of *path* that ``git apply`` could not place (it names the hunk by its old start *line*)."""
    reason = f"patch failed: {path}:{line}"
    fp = next((f for f in fps if f.path == path), None)
    if fp is None or not fp.hunks:
        return HunkFailure(where, path, 0, "", f"{where}: {path}: does not apply (git apply: {reason})")
    # git names the failing hunk by its old start; the hunks before it were applied (at an offset, or reported
    # as such when moved), which counts them where two hunks start on the same line.
    starts = [i for i, h in enumerate(fp.hunks, 1) if h.old_start == line]
    n = starts[0] if len(starts) == 1 else min(len(_GIT_HUNK_OK.findall(section)) + 1, len(fp.hunks))
    hunk = fp.hunks[n - 1]
    current = (work / path).read_text(encoding="utf-8").splitlines() if (work / path).is_file() else []
    detail = mismatch(current, hunk) or (
        "as written: unified diffs anchor a hunk with less context after than before it to the end of the file "
        "(regenerate the diff with `git diff` or `diff -u`); fuzz is refused")
    return HunkFailure(where, path, n, hunk.header,
                       f"{where}: {path}: hunk {n} {hunk.header!r} does not apply {detail} (git apply: {reason})")
