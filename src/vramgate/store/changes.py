"""What a change touches: the files that differ between a git ref (a pull request's base) and the working tree,
and which of the project's tests each of them can be an input of.

Note [what a change touches]: the files are those of ``git diff`` between the merge base of REF and ``HEAD``
and the working tree (staged, unstaged, deleted, both sides of a rename), plus the untracked files git does not
ignore. The merge base, not REF itself: a pull request whose base branch moved on since it forked is judged on
its own changes, as GitHub shows them. Each file falls in one :class:`Reach`:

- ``every``: an input of every test (vramgate's source, ``conftest.py``, ``tox.ini``, ``pyproject.toml``, the
  dependency pins, CI, scripts, a file of ``patches/`` or ``fixtures/`` that belongs to no one profile or
  fixture), and any file no rule knows: the gate runs everything where it cannot tell;
- ``none``: an input of no gate test (docs, the harness's own tests, examples, calibration pages, benchmarks,
  the durations that only order the tests);
- ``some``: an input of the tests that declare it (the suites' files, a profile's folder, a fixture, the matrix,
  the built-in default matrix in vramgate's own source, a baseline file);
  :mod:`vramgate.pytest_plugin.affected` says which.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from vramgate.machine.software import GitError, git


class ChangeError(ValueError):
    """A ref that names no commit of the project's repository, or a project outside any repository."""


#: The built-in default matrix in vramgate's own source (package data): like a project's ``vramgate.toml``, an
#: input of the matrix cases whose entries it changes, where the gate's other source is an input of every test.
DEFAULT_MATRIX = "src/vramgate/matrix/default.toml"
#: (glob, why): files that are an input of every test; the first that matches names the reason.
EVERY_TEST = (
    ("src/*", "vramgate's own source"),
    ("conftest.py", "the project's conftest.py"),
    ("tox.ini", "tox.ini (the environments, the pinned engine)"),
    ("pyproject.toml", "pyproject.toml (the dependencies and the pinned vLLM)"),
    ("setup.py", "setup.py"),
    ("setup.cfg", "setup.cfg"),
    ("requirements*", "a requirements file"),
    ("constraints*", "a constraints file"),
    ("pytest.ini", "pytest.ini"),
    (".ci/*", "the CI entry point"),
    (".github/*", "the CI workflows"),
    ("scripts/*", "the project's scripts"),
)
#: (glob, why): files that are an input of no gate test.
NO_TEST = (
    ("docs/*", "docs"),
    ("*.md", "a text file"),
    ("*.rst", "a text file"),
    ("*.txt", "a text file"),
    ("LICENSE*", "the licence"),
    (".gitignore", "git's ignore list"),
    (".gitattributes", "git's attributes"),
    ("tests/*", "the harness's own tests (the unit environment runs them)"),
    ("examples/*", "examples (the unit environment checks them)"),
    ("calibration/*", "calibration pages and trials"),
    ("benchmarks/*", "the benchmarks"),
    ("suites/durations.json", "the durations that order the tests (no verdict reads them)"),
)


@dataclass(frozen=True)
class Reach:
    """How far a changed file reaches: ``every`` test, ``none``, or ``some`` (the tests that declare it)."""

    kind: str
    why: str


def _matches(path: str, pattern: str) -> bool:
    if pattern.endswith("/*"):
        return path.startswith(pattern[:-1])
    return fnmatch.fnmatchcase(path, pattern) if "/" in pattern else (
        "/" not in path and fnmatch.fnmatchcase(path, pattern))


def reach(path: str, baselines: str = "baselines") -> Reach:
    """The :class:`Reach` of a changed file, *path* relative to the project's root (POSIX); *baselines*: the
    baselines folder, relative to it."""
    parts = PurePosixPath(path).parts
    if baselines and path.startswith(baselines.rstrip("/") + "/"):
        rest = PurePosixPath(path[len(baselines.rstrip("/")) + 1:]).parts
        if len(rest) == 2 and path.endswith(".json"):
            return Reach("some", "a baseline file")
        return Reach("every", f"a file of {baselines}/ that is no baseline file")
    if path == DEFAULT_MATRIX:
        return Reach("some", f"the built-in default matrix ({path})")
    for pattern, why in EVERY_TEST:
        if _matches(path, pattern):
            return Reach("every", why)
    for pattern, why in NO_TEST:
        if _matches(path, pattern):
            return Reach("none", why)
    if path.endswith(".md") and not path.startswith(("suites/", "patches/", "fixtures/")):
        return Reach("none", "a text file")
    if parts[0] == "suites":
        return Reach("some", "a suite's file")
    if parts[0] in ("patches", "fixtures"):
        if len(parts) < 3:  # patches/README, fixtures/models.json: no one profile's or fixture's
            return Reach("every", f"a file of {parts[0]}/ that belongs to no one "
                                  f"{'profile' if parts[0] == 'patches' else 'fixture'}")
        return Reach("some", "a profile's file" if parts[0] == "patches" else "a fixture's file")
    if path == "vramgate.toml":
        return Reach("some", "the matrix (vramgate.toml)")
    return Reach("every", "a file no rule of the gate knows")


@dataclass(frozen=True)
class ChangeSet:
    """The files a change touches, relative to the project's root, against the merge base of a ref."""

    ref: str
    base: str
    """The merge base's commit (full hash)."""
    root: Path
    files: tuple[str, ...]
    """Changed files under the project's root, relative to it (POSIX), sorted."""
    outside: tuple[str, ...] = ()
    """Changed files of the repository outside the project's root (relative to the repository)."""
    prefix: str = ""
    """The project's root relative to the repository's top ("" or ending in "/")."""
    _texts: dict[str, str | None] = field(default_factory=dict, compare=False, repr=False)

    @property
    def short(self) -> str:
        """The merge base's short hash."""
        return self.base[:12]

    def at_base(self, path: str) -> str | None:
        """The text of *path* (relative to the project's root) at the merge base; None where it did not exist
        (or is not text)."""
        if path not in self._texts:
            try:
                self._texts[path] = git(self.root, "show", f"{self.base}:{self.prefix}{path}")
            except (GitError, UnicodeDecodeError):
                self._texts[path] = None
        return self._texts[path]

    def touches(self, prefix: str) -> list[str]:
        """The changed files at *prefix* (a file) or under it (a folder, ending in ``/``)."""
        if prefix.endswith("/"):
            return [f for f in self.files if f.startswith(prefix)]
        return [f for f in self.files if f == prefix]


def _lines(text: str) -> list[str]:
    return [line for line in text.split("\0") if line]


def changed_files(root: Path, ref: str) -> ChangeSet:
    """The :class:`ChangeSet` of the working tree at *root* against *ref*'s merge base with ``HEAD``;
    :class:`ChangeError` when *root* is in no repository or *ref* names no commit there."""
    try:
        top = Path(git(root, "rev-parse", "--show-toplevel").strip())
    except GitError as exc:
        raise ChangeError(f"{ref!r}: {root} is not in a git repository ({exc})") from None
    try:
        git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except GitError:
        raise ChangeError(f"{ref!r}: not a commit of {top} (fetch it first, e.g. git fetch origin "
                          f"{ref}; a shallow clone needs fetch-depth: 0)") from None
    try:
        base = git(root, "merge-base", ref, "HEAD").strip()
    except GitError as exc:
        raise ChangeError(f"{ref!r}: no merge base with HEAD in {top} ({exc}; a shallow clone "
                          "needs the history back to it)") from None
    try:
        listed = _lines(git(top, "diff", "--name-only", "--no-renames", "-z", base, "--"))
        listed += _lines(git(top, "ls-files", "--others", "--exclude-standard", "-z"))
    except GitError as exc:
        raise ChangeError(f"{ref!r}: git could not list the changes in {top}: {exc}") from None
    try:
        prefix = root.resolve().relative_to(top.resolve()).as_posix()
    except ValueError:
        prefix = "."
    prefix = "" if prefix == "." else prefix + "/"
    inside = sorted({f[len(prefix):] for f in listed if f.startswith(prefix)})
    outside = sorted({f for f in listed if not f.startswith(prefix)})
    return ChangeSet(ref=ref, base=base, root=root, files=tuple(inside), outside=tuple(outside), prefix=prefix)
