"""The kinds of metric, each one rule object: how a figure of its kind is judged against its baseline, the rule said
in words, whether a change between two runs is a change, its defaults, and how its samples are stored.

Note [metric kinds]: a metric names its kind (``exact``, ``measured``); every layer that decides something by kind
asks the kind's rule here (:func:`kind_rule`) instead of testing the name: the checks (:mod:`vramgate.core.checks`),
the stored baselines' validation, the session (which figures are timings), ``report compare`` and the charts (what
changed), the upgrade report. A new kind is one class with these methods and one :func:`register_kind` call.

- ``exact``: a figure the code decides (bytes, blocks, counts): any move beyond its tolerance (default 0) is a
  regression; portable by default.
- ``measured``: a timing with its samples (Note [measured comparison] in :mod:`vramgate.core.stats`): worse by
  more than its tolerance (default 5%) *and* a clear one-sided U test; machine-bound by default; judged against
  history only on a host of the same speed, and untrusted when the GPU-state guard says so (or, paired, when the
  noise guard does: Note [noise guard] in :mod:`vramgate.core.stats`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from vramgate.core.numbers import Better, relative_change, worse_change
from vramgate.core.stats import compare_samples

Scope = Literal["portable", "machine"]
#: What a kind's rule says of a figure against its baseline (the checks' verdicts include these).
Judgement = Literal["ok", "regressed", "improved"]
#: Default relative tolerance of a measured metric (a 5% shift is noise).
MEASURED_DEFAULT_TOLERANCE = 0.05


class MetricKind:
    """The rule of one kind of metric. Subclasses set the class attributes and implement :meth:`judge`."""

    name: str = ""
    default_scope: Scope = "portable"
    """Where a metric of this kind is stored unless its test says otherwise (Note [metric scope])."""
    default_tolerance: float = 0.0
    needs_samples: bool = False
    """Whether a metric of this kind carries the samples it was judged on (and a baseline of it must)."""
    timed: bool = False
    """Whether its figures are timings of the host: compared with history only on a host of the same speed (Note
    [machine speed]), untrusted when the GPU-state guard finds throttling, counted apart in the upgrade report."""

    def judge(self, value: float, samples: Sequence[float], base_value: float, base_samples: Sequence[float],
              *, better: Better, tolerance: float, alpha: float) -> tuple[Judgement, float, str]:
        """(verdict ``ok``/``regressed``/``improved``, relative change, how it was decided) of a figure against
        its baseline."""
        raise NotImplementedError

    def changed(self, verdict: str, change: float | None) -> bool:
        """Whether a comparison of two runs is worth showing: any verdict but ``ok``; this base rule counts a
        figure judged ``ok`` as unchanged (it moved within its noise)."""
        return verdict != "ok"

    def confirms(self, now: float, stored: float, *, judged_acceptable: bool) -> bool:
        """Whether this run's figure *now* bears out a *stored* one (a baseline a change moved): for this base
        rule, the run's own verdict against it was acceptable (a figure with noise is never equal)."""
        return judged_acceptable


class ExactKind(MetricKind):
    """``exact``: figures the code decides; any move past the tolerance (default 0) regresses."""

    name = "exact"
    default_scope: Scope = "portable"
    default_tolerance = 0.0

    def judge(self, value: float, samples: Sequence[float], base_value: float, base_samples: Sequence[float],
              *, better: Better, tolerance: float, alpha: float) -> tuple[Judgement, float, str]:
        """One-sided against the tolerance, in ratio terms the same both ways (:func:`worse_change`)."""
        change = relative_change(value, base_value)
        how = f"exact, {better} is better, tolerance {tolerance:.2%}"
        if value == base_value:
            return "ok", 0.0, how
        worse = worse_change(value, base_value, better)
        if worse > tolerance:
            return "regressed", change, how
        if worse < 0:
            return "improved", change, how
        return "ok", change, how

    def changed(self, verdict: str, change: float | None) -> bool:
        """An exact figure that moved at all is a change, even within its tolerance."""
        return verdict != "ok" or (change is not None and change != 0 and not math.isnan(change))

    def confirms(self, now: float, stored: float, *, judged_acceptable: bool) -> bool:
        """An exact figure bears out a stored one when it is that figure."""
        return now == stored


class MeasuredKind(MetricKind):
    """``measured``: timings with their samples (Note [measured comparison] in :mod:`vramgate.core.stats`)."""

    name = "measured"
    default_scope: Scope = "machine"
    default_tolerance = MEASURED_DEFAULT_TOLERANCE
    needs_samples = True
    timed = True

    def judge(self, value: float, samples: Sequence[float], base_value: float, base_samples: Sequence[float],
              *, better: Better, tolerance: float, alpha: float) -> tuple[Judgement, float, str]:
        """The medians' change beyond the tolerance, with a clear one-sided Mann-Whitney U test."""
        result = compare_samples(base_samples, samples, better=better, tolerance=tolerance, alpha=alpha)
        how = (f"measured, median of {len(samples)} vs {len(base_samples)} samples, {better} is better, tolerance "
               f"{tolerance:.2%}, Mann-Whitney p(worse)={result.p_worse:.2g}, alpha {alpha:g}")
        if result.regressed:
            return "regressed", result.change, how
        if result.improved:
            return "improved", result.change, how
        return "ok", result.change, how


_KINDS: dict[str, MetricKind] = {}
_BASE = MetricKind()
"""The base rule: what a record of a kind this vramgate does not know is read by."""


def register_kind(kind: MetricKind) -> MetricKind:
    """Make *kind* known by its name (Note [metric kinds]); a :class:`ValueError` for a name already taken."""
    if not kind.name or (kind.name in _KINDS and _KINDS[kind.name] is not kind):
        raise ValueError(f"metric kind {kind.name!r}: the name is empty or already registered")
    _KINDS[kind.name] = kind
    return kind


def kind_rule(name: str) -> MetricKind:
    """The rule of the kind *name*; a :class:`ValueError` naming the known kinds for another."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"kind {name!r} is not one of {', '.join(kind_names())}") from None


def changed_by_kind(kind: str, verdict: str, change: float | None) -> bool:
    """Whether a comparison with *verdict* and *change* is a change, by *kind*'s rule (:meth:`MetricKind.changed`);
    a kind this vramgate does not know (a record of another one) by the base rule."""
    return _KINDS.get(kind, _BASE).changed(verdict, change)


def is_timed(kind: str) -> bool:
    """Whether figures of *kind* are timings of the host (:attr:`MetricKind.timed`); False for a kind this vramgate
    does not know (a record of another one)."""
    return _KINDS.get(kind, _BASE).timed


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_KINDS)


EXACT = register_kind(ExactKind())
MEASURED = register_kind(MeasuredKind())
