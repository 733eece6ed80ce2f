"""``--gate-affected REF``: keep the tests whose inputs a change touches (Note [what a change touches] in
:mod:`vramgate.store.changes`).

Note [each test's inputs]: a test's inputs are derived, not listed by hand, from what the gate already knows:

- its suite's files: its own module, and every file of ``suites/`` that is not a test module in its folder or a
  folder above it (helpers, ``conftest.py``);
- what the suites' plugins declare through the hook ``pytest_vramgate_test_inputs`` (the profile a case runs:
  its folder under ``patches/``; the matrix entry it takes, compared as an entry, so that changing one entry
  keeps only that entry's cases);
- the fixtures it names: a changed ``fixtures/<kind>/<name>/`` is an input of the tests whose module or
  parameters name ``<name>``, and of every test when vramgate's own source names it;
- its baselines: a changed baseline file of its suite keeps it only where its own stored records differ;
- the paths of its ``gate_inputs`` mark.

A case of a profile that is kept keeps its unpatched reference (the same test's case marked ``gate_reference``,
its other parameters equal) too. Everything runs when a file every test reads changed (vramgate's source, the
pins, CI), or a file no rule knows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import pytest

from vramgate.store.baselines import BaselineError, parse_baseline
from vramgate.store.changes import ChangeSet, reach
from vramgate.store.durations import UNKNOWN_S

if TYPE_CHECKING:
    from vramgate.pytest_plugin.session import GateSession

#: The argument of a case that runs an optimization profile (a reference case has None).
PROFILE_ARG = "profile"


@dataclass(frozen=True)
class TestInput:
    """One input of a test: files (a folder ends in ``/``), relative to the project's root, and optionally a
    finer check of what the test takes of them."""

    __test__ = False  # not a test class, for pytest

    label: str
    """What the input is, as a person reads it (``profile kv-fp8``)."""
    paths: tuple[str, ...]
    unchanged: Callable[[ChangeSet], bool] | None = None
    """Where its files changed: whether what the test takes of them is the same at the change's base; an error
    counts as changed."""

    def touched(self, changes: ChangeSet) -> str | None:
        """Why this input changed (the first changed file), or None."""
        hits = [f for p in self.paths for f in changes.touches(p)]
        if not hits:
            return None
        if self.unchanged is not None:
            try:
                if self.unchanged(changes):
                    return None
            except Exception:
                pass
        return f"{self.label}: {hits[0]} changed"


@dataclass(frozen=True)
class Decision:
    """Whether a test runs under ``--gate-affected``, and why."""

    nodeid: str
    kept: bool
    why: str


@dataclass
class Selection:
    """What ``--gate-affected`` kept and left out, against which base."""

    ref: str
    base: str
    everything: str | None
    """Why every test runs (a file every test reads changed), or None."""
    decisions: list[Decision] = field(default_factory=list)

    @property
    def left_out(self) -> list[str]:
        """The node ids left out."""
        return [d.nodeid for d in self.decisions if not d.kept]

    def line(self) -> str:
        """One line for the summaries: what ran, what did not, and against what."""
        from vramgate.report.summary import affected_line
        from vramgate.store.report_files import AffectedFacts

        return affected_line(AffectedFacts(self.to_json())) or ""

    def time_line(self, durations: dict[str, float]) -> str:
        """What the kept tests took of the whole set's time, by the measured seconds in *durations* (a test the file
        does not list counts as :data:`~vramgate.store.durations.UNKNOWN_S`, as when the workers are dealt: the file
        leaves out the tests under half a second)."""
        whole = sum(durations.get(d.nodeid, UNKNOWN_S) for d in self.decisions)
        kept = sum(durations.get(d.nodeid, UNKNOWN_S) for d in self.decisions if d.kept)
        share = f" ({kept / whole:.0%})" if whole > 0 else ""
        return f"the kept tests took {kept:.0f} s of the {whole:.0f} s the whole set took when measured{share}"

    def to_json(self) -> dict[str, Any]:
        """As ``report.json``'s ``affected``."""
        return {"ref": self.ref, "base": self.base, "everything": self.everything,
                "kept": len(self.decisions) - len(self.left_out), "left_out": sorted(self.left_out)}


def _source_names(root: Path) -> str:
    """The text of vramgate's own source (its ``.py`` files), where fixture names are looked for."""
    import vramgate

    folder = Path(vramgate.__file__).parent
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(folder.rglob("*.py")))


def _fixture_name(path: str) -> str:
    """``fixtures/models/tiny-llama/config.json`` -> ``tiny-llama``."""
    return PurePosixPath(path).parts[2]


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text) is not None


def _suite_files(item: pytest.Item, root: Path, changes: ChangeSet) -> str | None:
    """Why *item*'s suite files changed: its module, or a non-test file of ``suites/`` at or above its folder."""
    try:
        module = item.path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None
    folder = PurePosixPath(module).parent
    for f in changes.files:
        if f == module:
            return f"its module {f} changed"
        p = PurePosixPath(f)
        if p.parts[0] != "suites" or p.name.startswith("test_") or f == "suites/durations.json":
            continue
        if p.parent == folder or p.parent in folder.parents:
            return f"its suite's file {f} changed"
    return None


def _baselines(item: pytest.Item, suite: str, folder: str, changes: ChangeSet) -> str | None:
    """Why *item*'s stored records changed: a baseline file of *suite* under *folder* whose records of the test
    differ from the base's (an unreadable side counts as changed)."""
    for f in changes.touches(folder + "/"):
        if not f.endswith(f"/{suite}.json"):
            continue
        old_text = changes.at_base(f)
        new_path = changes.root / f
        try:
            old = parse_baseline(new_path, old_text).tests.get(item.nodeid) if old_text is not None else None
            new = (parse_baseline(new_path, new_path.read_text(encoding="utf-8")).tests.get(item.nodeid)
                   if new_path.is_file() else None)
        except (BaselineError, OSError):
            return f"its baselines: {f} changed (unreadable on one side)"

        def metrics(node: Any) -> dict[str, Any]:
            return {k: m.to_json() for k, m in node.metrics.items()} if node is not None else {}
        if metrics(old) != metrics(new):
            return f"its baselines: its records in {f} changed"
    return None


def _group(item: pytest.Item) -> tuple[Any, ...] | None:
    """The test and parameters a profile's case shares with its reference case; None for a test without one."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or PROFILE_ARG not in callspec.params:
        return None
    others = tuple(sorted((k, repr(v)) for k, v in callspec.params.items() if k != PROFILE_ARG))
    return (str(item.path), getattr(item, "originalname", item.name), others)


def select(items: Iterable[pytest.Item], changes: ChangeSet, root: Path, *, baselines_folder: str,
           suite_of: Callable[[pytest.Item], str],
           inputs_of: Callable[[pytest.Item], list[TestInput]]) -> Selection:
    """Decide, for each of *items*, whether *changes* touch its inputs (Note [each test's inputs])."""
    items = list(items)
    selection = Selection(changes.ref, changes.base, None)
    everything = None
    if changes.outside:
        everything = f"{changes.outside[0]} changed, outside the project's root (the gate cannot tell its reach)"
    some: list[str] = []
    for f in changes.files:
        if everything:
            break
        r = reach(f, baselines_folder)
        if r.kind == "every":
            everything = f"{f} changed ({r.why})"
        elif r.kind == "some":
            some.append(f)
    fixtures = sorted({_fixture_name(f) for f in some if f.startswith("fixtures/")})
    if fixtures and not everything:
        source = _source_names(root)
        for name in fixtures:
            if _named(name, source):
                everything = f"fixture {name} changed, and vramgate's own source names it"
                break
    if everything:
        selection.everything = everything
        selection.decisions = [Decision(i.nodeid, True, everything) for i in items]
        return selection
    texts: dict[Path, str] = {}
    decided: dict[str, Decision] = {}
    for item in items:
        why = _suite_files(item, root, changes)
        if why is None and fixtures:
            text = texts.setdefault(item.path, item.path.read_text(encoding="utf-8", errors="replace")
                                    if item.path.is_file() else "")
            callspec = getattr(item, "callspec", None)
            params = repr(callspec.params) if callspec is not None else ""
            for name in fixtures:
                if _named(name, text) or _named(name, params):
                    why = f"fixture {name} changed, and the test names it"
                    break
        if why is None:
            for test_input in inputs_of(item):
                why = test_input.touched(changes)
                if why:
                    break
        if why is None:
            why = _baselines(item, suite_of(item), baselines_folder, changes)
        decided[item.nodeid] = Decision(item.nodeid, why is not None, why or "no input of it changed")
    kept_groups = {_group(i) for i in items
                   if decided[i.nodeid].kept and getattr(getattr(i, "callspec", None), "params", {}).get(PROFILE_ARG)
                   is not None}
    for item in items:
        d = decided[item.nodeid]
        if not d.kept and item.get_closest_marker("gate_reference") is not None and _group(item) in kept_groups:
            decided[item.nodeid] = Decision(item.nodeid, True, "the reference a kept profile's case is paired with")
    selection.decisions = [decided[i.nodeid] for i in items]
    return selection


def declared_inputs(item: pytest.Item) -> list[TestInput]:
    """The paths of *item*'s ``gate_inputs`` marks, as inputs."""
    out: list[TestInput] = []
    for mark in item.iter_markers("gate_inputs"):
        paths = tuple(str(p) for p in mark.args)
        out.append(TestInput("its gate_inputs mark", paths))
    return out


def plan_lines(selection: Selection, *, verbose: bool) -> list[str]:
    """``--gate-plan``'s lines: what ``--gate-affected`` kept and left out, and why (each test with ``-v``)."""
    lines = [f"--gate-affected {selection.ref}: {selection.line()}"]
    if verbose or selection.everything is None:
        reasons: dict[str, int] = {}
        for d in selection.decisions:
            reasons[("kept: " if d.kept else "left out: ") + d.why] = reasons.get(
                ("kept: " if d.kept else "left out: ") + d.why, 0) + 1
        if verbose:
            lines += [f"  {'kept' if d.kept else 'left out'} {d.nodeid}: {d.why}" for d in selection.decisions]
        else:
            lines += [f"  {n} {why}" for why, n in sorted(reasons.items())]
    return lines


def keep_affected(config: pytest.Config, items: list[pytest.Item], gs: GateSession) -> None:
    """``--gate-affected REF``: deselect the tests whose inputs the change does not touch; the selection goes into
    *gs* (for the report), and the terminal says what was kept (with ``--gate-plan``, why, per test with ``-v``)."""
    from vramgate.store.changes import ChangeError, changed_files

    ref = gs.options.affected
    assert ref is not None
    try:
        changes = changed_files(config.rootpath, ref)
    except ChangeError as exc:
        raise pytest.UsageError(f"--gate-affected {exc}") from None
    try:
        folder = gs.baselines_dir.resolve().relative_to(config.rootpath.resolve()).as_posix()
    except ValueError:
        folder = ""

    def inputs_of(item: pytest.Item) -> list[TestInput]:
        found = declared_inputs(item)
        for listed in config.hook.pytest_vramgate_test_inputs(item=item):
            found += list(listed or ())
        return found

    selection = select(items, changes, config.rootpath, baselines_folder=folder, suite_of=gs.suite_for,
                       inputs_of=inputs_of)
    gs.affected = selection.to_json()
    left = set(selection.left_out)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(config, "workerinput"):
        lines = plan_lines(selection, verbose=config.option.verbose > 0) if gs.options.plan else [selection.line()]
        if gs.options.durations:
            lines.append(selection.time_line(gs.options.durations))
        for line in lines:
            reporter.write_line(line)
    if left:
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in left])
        items[:] = [i for i in items if i.nodeid not in left]
