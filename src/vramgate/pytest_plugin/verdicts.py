"""The judgements of a session's ``gate_judges`` tests (Note [profile verdict] in :mod:`vramgate.core.verdicts`):
one per case that ran, was skipped or was deselected, for the report's profile table."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest

from vramgate.core.verdicts import Judgement, State
from vramgate.profiles import ProfileError, load_profiles

#: The mark that names a test's check.
MARK = "gate_judges"
#: The user property a judging case sets to ``(lines ran, lines changed)`` when its run watched the profile's diff
#: (Note [diff ran] in vramgate.engine.diff_lines).
DIFF_LINES_PROPERTY = "vramgate.diff_lines"
#: The key of an xdist worker's ``workeroutput`` that holds its judgements.
OUTPUT_KEY = "vramgate_judgements"


def judged_profile(item: pytest.Item) -> tuple[str, str] | None:
    """(profile, check) of a ``gate_judges`` case with a profile as its ``profile`` argument; None for the unpatched
    reference case and for every other test."""
    mark = item.get_closest_marker(MARK)
    if mark is None:
        return None
    callspec = getattr(item, "callspec", None)
    profile = callspec.params.get("profile") if callspec is not None else None
    name = getattr(profile, "name", None)
    if not isinstance(name, str):
        return None
    check = mark.args[0] if mark.args else mark.kwargs.get("check")
    return name, str(check)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def judgement_of(item: pytest.Item, report: pytest.TestReport) -> Judgement | None:
    """The judgement one phase's report of *item* leaves (None where it leaves none: not a judging case, a setup or
    teardown that passed)."""
    found = judged_profile(item)
    if found is None or hasattr(report, "wasxfail"):
        return None
    profile, check = found
    state: State
    if report.skipped:
        state, reason = "not judged", _skip_reason(report)
    elif report.failed:
        state = "failed"
        reason = "the test failed" if report.when == "call" else f"the test's {report.when} failed (an error)"
    elif report.when == "call":
        state, reason = "passed", ""
    else:
        return None
    lines = dict(item.user_properties).get(DIFF_LINES_PROPERTY)
    ran, changed = lines if isinstance(lines, tuple) and len(lines) == 2 else (None, None)
    return Judgement(profile, check, item.nodeid, state, reason, ran, changed)


def deselected_judgements(items: list[pytest.Item], affected: bool) -> list[Judgement]:
    """The judgements of deselected cases: nightly ones wait for the full gate; others were left out (by
    ``--gate-affected`` when *affected*, else by ``-k``/``-m``/a shard)."""
    out = []
    for item in items:
        found = judged_profile(item)
        if found is None:
            continue
        nightly = item.get_closest_marker("gate_nightly")
        if nightly is not None:
            why = str(nightly.args[0] if nightly.args else nightly.kwargs.get("reason", ""))
            out.append(Judgement(*found, item.nodeid, "nightly", f"{why} (tox -e cpu-full)"))
        else:
            why = ("this change does not touch its inputs (--gate-affected)" if affected
                   else "deselected in this run (-k, -m or another shard)")
            out.append(Judgement(*found, item.nodeid, "left out", why))
    return out


def project_profiles(root: Any, errors: list[str]) -> list[str]:
    """The names of the project's profiles (``patches/`` under *root*); a profile that cannot be read is an error
    of the session, not a missing row."""
    try:
        return [p.name for p in load_profiles(root)]
    except (ProfileError, OSError) as exc:
        errors.append(f"the profile table lists only the profiles its tests ran: {exc}")
        return []


class VerdictPlugin:
    """The hooks that keep each ``gate_judges`` case's judgement in the session (Note [profile verdict])."""

    def __init__(self, session: Any) -> None:
        self.session = session

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: after the gate's metrics may have failed the test
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
        """Keep the judgement of each phase's report of a judging case."""
        outcome = yield
        judgement = judgement_of(item, outcome.get_result())
        if judgement is not None:
            self.session.judgements.append(judgement)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        """A deselected case still names its cell: nightly, or left out (nothing under ``--collect-only``)."""
        if items and not items[0].config.option.collectonly:
            self.session.judgements += deselected_judgements(items, bool(self.session.options.affected))

    @pytest.hookimpl(tryfirst=True)  # before the gate's own, which reports from the session's judgements
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """An xdist worker hands its judgements to the controller (Note [xdist] in
        :mod:`vramgate.pytest_plugin.transport`), beside its findings."""
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[OUTPUT_KEY] = json.dumps([j.to_json() for j in self.session.judgements])

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: take a finished worker's judgements."""
        text = getattr(node, "workeroutput", {}).get(OUTPUT_KEY)
        if text:
            self.session.judgements += [Judgement.from_json(j) for j in json.loads(text)]
