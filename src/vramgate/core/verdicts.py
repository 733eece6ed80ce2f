"""One verdict per optimization profile: what each standard check found of it, and what it was not judged on.

Note [profile verdict]: a team asks the gate one question of a profile: is it safe to merge? Every profile is
judged on the same checks (:data:`CHECKS`), whatever suites its manifest names; a test that settles one of them
for a profile carries the ``gate_judges(check)`` mark and takes the profile as its ``profile`` argument. Each such
test case leaves one :class:`Judgement` (its outcome, or why it did not run: a skip's reason, the nightly tier, a
change that does not touch it) and :func:`profile_rows` folds them into one :class:`ProfileRow` per profile with one
:class:`Cell` per check. A cell that no case decided is "not judged" with the reason; never empty, never a silent
pass. A case whose engine never executed the profile's changed lines (Note [diff ran] in
:mod:`vramgate.engine.diff_lines`) skips with "not judged here" and that reason, so it lands here as not judged.

How a cell folds its cases: one failure fails it; else one pass passes it (the cases that did not judge are
counted beside it); else, when every case waits for the nightly tier, it is "nightly"; else "not judged" with
each distinct reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

#: The standard checks every profile is judged on, in the order the report's columns take.
CHECKS: tuple[str, ...] = ("applies", "answers", "capacity", "latency", "leaks")
#: The report's last column: whether the profile's changed lines ran in a run that watched them (Note [diff ran]
#: in vramgate.engine.diff_lines); not a check a test is marked with, but what the judging cases saw.
DIFF_RAN = "diff ran"
#: Every column of a profile's row.
COLUMNS: tuple[str, ...] = (*CHECKS, DIFF_RAN)
#: What each check asks, for the report's legend and the docs.
CHECK_HELP: dict[str, str] = {
    "applies": "its diff applies to the pinned vLLM and a broken one is refused",
    "answers": "its outputs on the recall models through vLLM against the unpatched engine's",
    "capacity": "the KV cache vLLM sizes with it, and the engine's peak memory under a load that fills it",
    "latency": "its engine step against the unpatched engine's, paired",
    "leaks": "its server's memory slope under load against the unpatched server's, paired",
    DIFF_RAN: "which of its changed lines ran, in the runs that watched them (untimed runs)",
}

#: Why a check has no case at all for a profile, where the gate knows (the check is not built or not trusted yet);
#: every other check with no case reads "no test of this check ran for it".
UNCOVERED: dict[str, str] = {}

State = Literal["passed", "failed", "not judged", "nightly", "left out"]
#: The states of a judgement and of a cell.
STATES: tuple[str, ...] = get_args(State)


@dataclass(frozen=True)
class Judgement:
    """What one test case found of one profile on one check."""

    profile: str
    check: str
    test: str
    """The case's node id."""
    state: State
    reason: str = ""
    """Why it did not judge (a skip's reason, the nightly mark's, ...), or what failed; empty for a pass."""
    lines_ran: int | None = None
    """In a run that watched the profile's diff (Note [diff ran]): how many of its changed lines ran; else None."""
    lines_changed: int | None = None
    """... and how many changed lines with code the diff has."""

    def to_json(self) -> dict[str, Any]:
        """The judgement as JSON data (what :meth:`from_json` reads)."""
        return {"profile": self.profile, "check": self.check, "test": self.test, "state": self.state,
                "reason": self.reason, "lines_ran": self.lines_ran, "lines_changed": self.lines_changed}

    @classmethod
    def from_json(cls, data: Any) -> Judgement:
        """The judgement in *data*; ``ValueError`` naming the field that is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"a judgement must be an object, got {data!r}")
        for key in ("profile", "check", "test", "state"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise ValueError(f"a judgement needs a non-empty {key!r}, got {data.get(key)!r}")
        if data["state"] not in STATES:
            raise ValueError(f"judgement state {data['state']!r} is not one of {', '.join(STATES)}")
        lines = [data.get("lines_ran"), data.get("lines_changed")]
        if any(n is not None and (not isinstance(n, int) or n < 0) for n in lines):
            raise ValueError(f"a judgement's lines_ran and lines_changed are counts or null, got {lines}")
        return cls(data["profile"], data["check"], data["test"], data["state"], str(data.get("reason") or ""),
                   *lines)


@dataclass(frozen=True)
class Cell:
    """One profile's verdict on one check, folded from its cases (Note [profile verdict])."""

    state: State
    reasons: tuple[str, ...] = ()
    """The distinct reasons of the cases that did not judge (or that failed), in the order first seen."""
    tests: tuple[str, ...] = ()
    """The cases that decided the cell: the failing ones for a failure, the passing ones for a pass, else all."""
    not_judged: int = 0
    """Beside a pass or a failure: how many cases did not judge (skipped, nightly, left out)."""

    @property
    def text(self) -> str:
        """The cell as a person reads it: ``passed``, ``failed``, ``not judged: <why>``, ``nightly: <why>``."""
        if self.state in ("passed", "failed"):
            extra = f" ({len(self.tests)} of {len(self.tests) + self.not_judged})" if self.not_judged else ""
            return f"{self.state}{extra}"
        why = "; ".join(self.reasons)
        return f"{self.state}: {why}" if why else self.state

    def to_json(self) -> dict[str, Any]:
        """The cell as JSON data (what :meth:`from_json` reads)."""
        return {"state": self.state, "reasons": list(self.reasons), "tests": list(self.tests),
                "not_judged": self.not_judged}

    @classmethod
    def from_json(cls, data: Any) -> Cell:
        """The cell in *data*; ``ValueError`` naming the field that is not one."""
        if not isinstance(data, dict) or data.get("state") not in STATES:
            raise ValueError(f"a cell needs a state, one of {', '.join(STATES)}; got {data!r}")
        return cls(data["state"], tuple(str(r) for r in data.get("reasons") or ()),
                   tuple(str(t) for t in data.get("tests") or ()), int(data.get("not_judged") or 0))


@dataclass(frozen=True)
class ProfileRow:
    """One profile's row of the report: a cell per check of :data:`CHECKS`."""

    profile: str
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """Whether any check failed the profile."""
        return any(c.state == "failed" for c in self.cells.values())

    @property
    def verdict(self) -> str:
        """``regression`` (a check failed), ``safe on what ran`` (every check passed and its diff ran, or it has
        none), ``safe pre-merge`` (so, but some checks wait for the nightly tier), or ``partly judged``."""
        if self.failed:
            return "regression"
        diff = self.cells.get(DIFF_RAN)
        diff_ok = diff is None or diff.state == "passed" or diff.reasons[:1] == (NO_WATCH,)
        states = {c.state for k, c in self.cells.items() if k != DIFF_RAN}
        if diff_ok and states <= {"passed"}:
            return "safe on what ran"
        if diff_ok and states <= {"passed", "nightly"}:
            return "safe pre-merge"
        return "partly judged"

    def to_json(self) -> dict[str, Any]:
        """The row as JSON data (what :meth:`from_json` reads)."""
        return {"profile": self.profile, "cells": {k: c.to_json() for k, c in self.cells.items()}}

    @classmethod
    def from_json(cls, data: Any) -> ProfileRow:
        """The row in *data*; ``ValueError`` naming what is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("profile"), str) or \
                not isinstance(data.get("cells"), dict):
            raise ValueError(f"a profile row needs a profile name and its cells, got {data!r}")
        return cls(data["profile"], {str(k): Cell.from_json(v) for k, v in data["cells"].items()})


#: Which state wins when one test case left two judgements (a pass at call, a failure at teardown): the worst.
_RANK = {"failed": 4, "passed": 3, "not judged": 2, "nightly": 1, "left out": 0}


def merge_case(old: Judgement | None, new: Judgement) -> Judgement:
    """One case's judgement from two of its phases (or two workers' views of a deselected case): a failure or a pass
    over a skip or a deselection."""
    if old is None or _RANK[new.state] >= _RANK[old.state]:
        return new
    return old


def fold(cases: list[Judgement], check: str = "") -> Cell:
    """One cell from the cases of one profile and one check (Note [profile verdict])."""
    def reasons(js: Iterable[Judgement]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(j.reason for j in js if j.reason))

    def others(js: list[Judgement]) -> tuple[str, ...]:
        nightly = sum(1 for j in js if j.state == "nightly")
        return reasons(j for j in js if j.state != "nightly") + (
            (f"{nightly} more case(s) judged nightly (tox -e cpu-full)",) if nightly else ())

    failed = [j for j in cases if j.state == "failed"]
    passed = [j for j in cases if j.state == "passed"]
    if failed:
        return Cell("failed", reasons(failed), tuple(j.test for j in failed), len(cases) - len(failed) - len(passed))
    if passed:
        return Cell("passed", others([j for j in cases if j.state != "passed"]), tuple(j.test for j in passed),
                    len(cases) - len(passed))
    if not cases:
        return Cell("not judged", (UNCOVERED.get(check, "no test of this check ran for it"),))
    if all(j.state == "nightly" for j in cases):
        return Cell("nightly", reasons(cases), tuple(j.test for j in cases))
    return Cell("not judged", others(cases), tuple(j.test for j in cases))


#: The "diff ran" cell's reason where no run watched the profile's diff.
NO_WATCH = ("no run watched a diff of its (a profile of engine arguments only has none; the timed runs never "
            "watch)")


def diff_cell(cases: list[Judgement]) -> Cell:
    """The "diff ran" cell: passed where a watching run executed some of the diff's lines, not judged where every
    watching run executed none (or no run watched)."""
    watched = [j for j in cases if j.lines_changed is not None]
    ran = [j for j in watched if j.lines_ran]
    if ran:
        best = max(ran, key=lambda j: j.lines_ran or 0)
        return Cell("passed", (f"{best.lines_ran} of {best.lines_changed} changed line(s) ran",),
                    tuple(j.test for j in ran))
    if watched:
        return Cell("not judged", (f"none of its {watched[0].lines_changed} changed line(s) with code ran in the "
                                   "runs that watched them: what passed here did not run its code",),
                    tuple(j.test for j in watched))
    return Cell("not judged", (NO_WATCH,))


def profile_rows(profiles: Iterable[str], judgements: Iterable[Judgement]) -> list[ProfileRow]:
    """One row per profile (*profiles*, and any other a judgement names), sorted by name, a cell per check."""
    cases: dict[tuple[str, str, str], Judgement] = {}
    for j in judgements:
        key = (j.profile, j.check, j.test)
        cases[key] = merge_case(cases.get(key), j)
    names = sorted(set(profiles) | {p for p, _, _ in cases})
    rows = []
    for name in names:
        cells = {}
        for check in CHECKS:
            cells[check] = fold([j for (p, c, _), j in sorted(cases.items()) if p == name and c == check], check)
        cells[DIFF_RAN] = diff_cell([j for (p, _, _), j in sorted(cases.items()) if p == name])
        rows.append(ProfileRow(name, cells))
    return rows
