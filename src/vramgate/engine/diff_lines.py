"""Which of a profile's changed lines an engine executed.

Note [diff ran]: a check that passes a profile says something only where the profile's code ran. A CUDA-only
change on the CPU tier, a prefix-cache change under a workload without shared prefixes, a change behind an engine
argument the run does not set: the engine runs vLLM's own code, and every check passes. So a run of a profile with
a diff series (its overlay, Note [overlay] in :mod:`vramgate.profiles.overlay`) can be asked to watch the diff's
lines (:data:`TRACE_ENV` in its spec's environment):

* before the engine starts, :func:`changed_lines` reads the overlay: each patched file (a real file among the
  overlay's links) against the installed file it replaces, line by line (``difflib``); a line counts where the
  patched file's line is new or changed and the compiler gives it code (a comment does not), and a deletion counts as
  the next line with code (what runs in its place);
* in the engine's processes, :func:`install` (called by the worker and by the gate's vLLM plugin, so the ranks and
  a server's engine core too) sets a trace function that looks only at frames of those files and appends each
  watched line the first time it runs to a file of the run (one line each, flushed at once: a process vLLM kills
  loses nothing);
* after the run, :func:`lines_ran` reads that file into the result's :class:`DiffLines`.

Tracing slows the Python it watches, so only untimed runs ask for it (the answers check); a timed run never does.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Set to ``1`` in an engine spec's environment to have the run watch its profile's changed lines.
TRACE_ENV = "VRAMGATE_TRACE_DIFF"
#: The JSON file of the lines to watch (``{file: [line, ...]}``), set by the runner for the engine's processes.
WATCH_ENV = "VRAMGATE_DIFF_WATCH"
#: The file the engine's processes append the watched lines that ran to (``file:line`` per line).
RAN_ENV = "VRAMGATE_DIFF_RAN"


@dataclass(frozen=True)
class DiffLines:
    """A profile's changed lines with code, and those an engine run executed (paths relative to the overlay)."""

    changed: dict[str, list[int]] = field(default_factory=dict)
    ran: dict[str, list[int]] = field(default_factory=dict)

    @property
    def changed_count(self) -> int:
        """How many changed lines with code the diff has."""
        return sum(len(v) for v in self.changed.values())

    @property
    def ran_count(self) -> int:
        """How many of them ran."""
        return sum(len(v) for v in self.ran.values())

    def describe(self) -> str:
        """``3 of 5 changed lines ran (vllm/x.py: 12, 14, 20)``."""
        where = "; ".join(f"{f}: {', '.join(map(str, lines))}" for f, lines in sorted(self.ran.items()))
        return f"{self.ran_count} of {self.changed_count} changed line(s) with code ran" + (f" ({where})" if where
                                                                                           else "")

    def not_run_reason(self, tier: str) -> str | None:
        """Why a check of this run says nothing of the profile (none of its changed lines ran), or None."""
        if self.ran_count:
            return None
        files = ", ".join(sorted(self.changed))
        return (f"not judged here: none of the profile's {self.changed_count} changed line(s) with code ({files}) ran "
                f"in this run on the {tier} tier")

    def to_json(self) -> dict[str, Any]:
        """The lines as JSON data (what :meth:`from_json` reads)."""
        return {"changed": {k: list(v) for k, v in self.changed.items()},
                "ran": {k: list(v) for k, v in self.ran.items()}}

    @classmethod
    def from_json(cls, data: Any, where: str = "diff lines") -> DiffLines:
        """The lines in *data*; ``TypeError`` naming *where* when it is not such an object."""
        if not isinstance(data, dict) or not isinstance(data.get("changed"), dict) or \
                not isinstance(data.get("ran"), dict):
            raise TypeError(f"{where}: must be an object with 'changed' and 'ran'")
        return cls({str(k): [int(x) for x in v] for k, v in data["changed"].items()},
                   {str(k): [int(x) for x in v] for k, v in data["ran"].items()})


def _code_lines(code: types.CodeType) -> Iterator[int]:
    for _, _, line in code.co_lines():
        if line is not None:
            yield line
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_lines(const)


def code_lines(text: str, filename: str) -> set[int]:
    """The lines of *text* the compiler gives code (a module's, its functions' and classes')."""
    return set(_code_lines(compile(text, filename, "exec", dont_inherit=True)))


def changed_in(old: str, new: str, filename: str) -> list[int]:
    """The lines of *new* (1-based) with code that differ from *old* (Note [diff ran])."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    code = sorted(code_lines(new, filename))
    out: set[int] = set()
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            out.update(n for n in range(j1 + 1, j2 + 1) if n in code)
        elif tag == "delete":
            after = [n for n in code if n > j1]
            if after:
                out.add(after[0])
    return sorted(out)


def changed_lines(overlays: list[Path]) -> dict[str, list[int]]:
    """``{absolute path of the patched file in the overlay: [changed lines with code]}`` for every Python file the
    overlays patch (their real files: the rest are links to the installed package, Note [overlay])."""
    out: dict[str, list[int]] = {}
    for overlay in overlays:
        for path in sorted(overlay.rglob("*.py")):
            if path.is_symlink():
                continue
            rel = path.relative_to(overlay)
            original = _original(path, overlay)
            old = original.read_text(encoding="utf-8") if original is not None and original.is_file() else ""
            lines = changed_in(old, path.read_text(encoding="utf-8"), str(rel))
            if lines:
                out[str(path)] = lines
    return out


def _original(path: Path, overlay: Path) -> Path | None:
    """The installed file a patched file of *overlay* replaces: found through the nearest folder above it that holds
    a link into the installed package (every file the diff does not touch is one); None for a file the diff adds."""
    folder = path.parent
    while True:
        link = next((p for p in sorted(folder.iterdir()) if p.is_symlink()), None)
        if link is not None:
            return Path(os.path.realpath(link)).parent / path.relative_to(folder)
        if folder == overlay:
            return None
        folder = folder.parent


def relative(lines: dict[str, list[int]], overlays: list[Path]) -> dict[str, list[int]]:
    """*lines* keyed by the path inside the overlay (``vllm/...``), as a person reads it."""
    out = {}
    for path, ns in lines.items():
        key = path
        for overlay in overlays:
            try:
                key = Path(path).relative_to(overlay).as_posix()
                break
            except ValueError:
                continue
        out[key] = ns
    return out


def prepare(overlays: list[Path], run_dir: Path) -> dict[str, str]:
    """Write the lines to watch into *run_dir*; the environment that makes the engine's processes watch them."""
    watch = run_dir / "diff-watch.json"
    ran = run_dir / "diff-ran.txt"
    watch.write_text(json.dumps(changed_lines(overlays)), encoding="utf-8")
    ran.write_text("", encoding="utf-8")
    return {WATCH_ENV: str(watch), RAN_ENV: str(ran)}


def lines_ran(run_dir: Path, overlays: list[Path]) -> DiffLines:
    """What the run's processes found (:func:`install`), with the lines that were watched."""
    watch = json.loads((run_dir / "diff-watch.json").read_text(encoding="utf-8"))
    ran: dict[str, set[int]] = {}
    path = run_dir / "diff-ran.txt"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    for line in text.splitlines():
        file, _, n = line.rpartition(":")
        if file and n.isdigit():
            ran.setdefault(file, set()).add(int(n))
    return DiffLines(relative(watch, overlays), relative({k: sorted(v) for k, v in ran.items()}, overlays))


_installed = False


def install() -> None:
    """In an engine's process: watch the lines :data:`WATCH_ENV` names, appending each the first time it runs to
    :data:`RAN_ENV`'s file (Note [diff ran]); nothing where neither is set. Once per process."""
    global _installed
    watch_file, ran_file = os.environ.get(WATCH_ENV), os.environ.get(RAN_ENV)
    if _installed or not watch_file or not ran_file:
        return
    _installed = True
    raw = json.loads(Path(watch_file).read_text(encoding="utf-8"))
    watch: dict[str, set[int]] = {}
    named: dict[str, str] = {}  # the path a process imported the file by -> the path the runner wrote
    for path, lines in raw.items():
        left = set(lines)
        for name in {path, os.path.realpath(path)}:
            watch[name], named[name] = left, path
    if not watch:
        return
    lock = threading.Lock()
    out = open(ran_file, "a", encoding="utf-8")

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            lines = watch.get(frame.f_code.co_filename)
            if lines is not None and frame.f_lineno in lines:
                with lock:
                    if frame.f_lineno in lines:
                        lines.discard(frame.f_lineno)
                        out.write(f"{named[frame.f_code.co_filename]}:{frame.f_lineno}\n")
                        out.flush()
        return local

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename in watch else None

    threading.settrace(tracer)
    sys.settrace(tracer)
