"""Metrics: what a test records, in which unit, and which way is better.

A :class:`Metric` is one named number (or a set of samples) recorded by a test
through the ``gate`` fixture. Its *kind* decides how it is compared:

``exact``
    A deterministic figure from accounting (page bytes, KV capacity, blocks in
    use, preemptions on a seeded trace). Compared one-sided with a tolerance
    that defaults to zero: worse fails, better passes and is reported as a
    ratchet opportunity.
``measured``
    A noisy figure (latency, device memory of nondeterministic kernels). Stored
    with its samples; a regression needs both a change beyond the tolerance and
    a statistically clear shift (see :mod:`vramgate.core.stats`).

Its *scope* decides which machines it is compared on (Note [metric scope]):

``portable``
    A function of software and configuration only (vLLM's KV accounting, the
    deterministic simulator and scheduler counts, analytic sizes, checkpoint
    bytes). Stored under the tier's key (``cpu``, ``cuda``) and compared on
    every machine of that tier.
``machine``
    Anything an ISA, a kernel choice or a device changes (timings, RSS,
    allocator and NVML figures, bytes of weights that a kernel repacks).
    Stored under the hardware key and compared only on machines of that key.

Note [budget-only figures]: a test may record a metric with ``history=False``: it is held to its budgets and
shown in the report, but never compared with a stored baseline (its verdict is "not compared") and never
written into one. For figures whose change from one run to the next is noise, not regression: the tail
percentiles of one load, a memory slope whose unchanged value is close to zero.

The default follows the kind: ``exact`` metrics are portable, ``measured``
ones (and paired ratios) machine-bound. A test overrides it with
``scope="machine"`` for an exact figure that the machine decides, e.g. a
peak resident size, or ``scope="portable"`` for a measured one that no
machine changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramgate.core.kinds import Scope as Scope
from vramgate.core.kinds import kind_names, kind_rule
from vramgate.core.leak import LeakFit

# Re-exported (their home is vramgate.core.numbers): every layer has read them from here.
from vramgate.core.numbers import Better as Better
from vramgate.core.numbers import format_change as format_change
from vramgate.core.numbers import median as median
from vramgate.core.numbers import relative_change as relative_change
from vramgate.core.numbers import worse_change as worse_change

#: A metric's kind: the name of its rule (:mod:`vramgate.core.kinds`: ``exact``, ``measured``, or one a project
#: registers).
Kind = str

BETTER: tuple[Better, ...] = ("lower", "higher")
SCOPES: tuple[Scope, ...] = ("portable", "machine")


def default_scope(kind: Kind) -> Scope:
    """The scope a metric of *kind* has unless its test says otherwise (see Note [metric scope]): its rule's."""
    return kind_rule(kind).default_scope



def _fmt_number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    if abs(value) >= 1:
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return f"{value:.4g}"


def _fmt_bytes(value: float) -> str:
    sign = "-" if value < 0 else ""
    v = abs(value)
    if v < 1024:
        return f"{sign}{int(v) if v == int(v) else round(v, 1)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024.0
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.2f} {unit}"
    raise AssertionError("unreachable")


def _fmt_seconds(value: float) -> str:
    sign = "-" if value < 0 else ""
    v = abs(value)
    if v == 0:
        return "0 s"
    for scale, unit in ((1e-6, "ns"), (1e-3, "µs"), (1.0, "ms")):
        if v < scale:
            return f"{sign}{v / scale * 1e3:.3g} {unit}"
    return f"{sign}{v:.3g} s"


def _fmt_ratio(value: float) -> str:
    return f"{value:.4g} ({value * 100:.2f}%)"


def _fmt_plain(suffix: str) -> Callable[[float], str]:
    def fmt(value: float) -> str:
        return f"{_fmt_number(value)} {suffix}".rstrip()

    return fmt


@dataclass(frozen=True)
class Unit:
    """A unit a metric can carry, with its human formatting."""

    name: str
    description: str
    format: Callable[[float], str]


UNITS: dict[str, Unit] = {
    u.name: u
    for u in (
        Unit("B", "bytes (shown as B, KiB, MiB, GiB)", _fmt_bytes),
        Unit("s", "seconds (shown as ns, µs, ms, s)", _fmt_seconds),
        Unit("ratio", "a dimensionless fraction (shown also as %)", _fmt_ratio),
        Unit("count", "a count of things", _fmt_plain("")),
        Unit("logits", "a difference of logits (an answer's margin over the runner-up)", _fmt_plain("logits")),
        Unit("tokens", "tokens", _fmt_plain("tokens")),
        Unit("blocks", "KV cache blocks", _fmt_plain("blocks")),
        Unit("requests", "requests", _fmt_plain("requests")),
        Unit("tokens/s", "throughput in tokens per second", _fmt_plain("tokens/s")),
        Unit("requests/s", "throughput in requests per second", _fmt_plain("requests/s")),
        Unit("B/s", "bandwidth in bytes per second", lambda v: _fmt_bytes(v) + "/s"),
        Unit("tokens/GiB", "KV capacity: tokens per GiB of KV budget", _fmt_plain("tokens/GiB")),
        Unit("B/token", "bytes per token", lambda v: _fmt_bytes(v) + "/token"),
        Unit("B/1k requests", "memory growth: bytes per 1,000 requests served",
             lambda v: _fmt_bytes(v) + " per 1k requests"),
        Unit("B/1k tokens", "memory growth: bytes per 1,000 output tokens generated",
             lambda v: _fmt_bytes(v) + " per 1k tokens"),
    )
}


def unit_of(name: str) -> Unit:
    """The :class:`Unit` called *name*; a clear error for an unknown one."""
    try:
        return UNITS[name]
    except KeyError:
        raise ValueError(f"unknown unit {name!r}; accepted: {', '.join(sorted(UNITS))}") from None


def format_value(value: float, unit: str, *, precise: bool = False) -> str:
    """Format *value* for a human, in *unit* (``B`` becomes KiB/MiB/GiB, ...).

    With ``precise``, byte counts of 1 KiB and more also show the exact count.
    """
    text = unit_of(unit).format(value)
    if precise and unit == "B" and abs(value) >= 1024 and value == int(value):
        return f"{int(value):,} B ({text})"
    return text


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Mean, median, p90, p99 and maximum of *values* (linear interpolation); empty for no values."""
    if not values:
        return {}
    ordered = sorted(values)

    def q(p: float) -> float:
        k = (len(ordered) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": sum(ordered) / len(ordered), "p50": median(ordered), "p90": q(0.9), "p99": q(0.99),
            "max": ordered[-1]}


@dataclass(frozen=True)
class Paired:
    """The two sides of a paired measurement (reference and candidate, same session, same machine state).

    The metric regresses within the session when the candidate is worse than
    the reference by more than ``tolerance`` and a one-sided signed-rank test
    of the pairs' ratios is clear (:func:`vramgate.core.stats.compare_pairs`).
    """

    reference: tuple[float, ...]
    candidate: tuple[float, ...]
    tolerance: float
    alpha: float = 0.01
    looks: tuple[str, ...] = ()
    """What each look of the measurement found (Note [second look] in :mod:`vramgate.engine.looks`), as lines a
    failing test's message shows; empty when the samples are one look."""
    noise_in_looks: bool = False
    """Whether :attr:`looks` hold the noise guard's line of each look (the recorder says so: they were judged with
    the fixture's ``paired_checks``); the message adds the final samples' line otherwise."""


@dataclass
class Metric:
    """One metric recorded by a test.

    ``value`` is the figure compared against budgets and baselines; for a
    measured metric it is the median of ``samples``. ``tolerance`` is relative
    (0.02 = 2%); ``ceiling`` and ``floor`` are absolute budgets in ``unit``.
    """

    name: str
    value: float
    unit: str
    kind: Kind = "exact"
    better: Better = "lower"
    ceiling: float | None = None
    floor: float | None = None
    tolerance: float | None = None
    samples: list[float] = field(default_factory=list)
    paired: Paired | None = None
    """For a ratio from paired runs: both sides' samples, checked against each other in the same session."""
    fit: LeakFit | None = None
    """For a memory slope (per 1,000 requests or tokens): the fit behind it, whose lower confidence bound, not the
    slope itself, is held to the ceiling (Note [leak fit] in :mod:`vramgate.core.leak`)."""
    scope: Scope | None = None
    """``portable`` or ``machine``; None takes the kind's default (see Note [metric scope])."""
    history: bool = True
    """False: held to its budgets (``ceiling``/``floor``) only, never against a baseline, and never stored in
    one: a figure of one run whose relative change means nothing, e.g. a memory slope near zero or the p99 of
    one load (Note [budget-only figures])."""

    def __post_init__(self) -> None:
        where = f"metric {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"{where}: name must be a non-empty string")
        unit_of(self.unit)
        if self.kind not in kind_names():
            raise ValueError(f"{where}: kind {self.kind!r} is not one of {', '.join(kind_names())}")
        if self.better not in BETTER:
            raise ValueError(f"{where}: better {self.better!r} is not one of {', '.join(BETTER)}")
        if isinstance(self.value, bool) or not isinstance(self.value, int | float):
            raise TypeError(f"{where}: value must be a number, got {type(self.value).__name__}")
        if not math.isfinite(self.value):
            raise ValueError(f"{where}: value must be finite, got {self.value}")
        if self.tolerance is not None and (self.tolerance < 0 or not math.isfinite(self.tolerance)):
            raise ValueError(f"{where}: tolerance must be a finite number >= 0, got {self.tolerance}")
        if self.scope is not None and self.scope not in SCOPES:
            raise ValueError(f"{where}: scope {self.scope!r} is not one of {', '.join(SCOPES)}")
        if kind_rule(self.kind).needs_samples and not self.samples:
            raise ValueError(f"{where}: a {self.kind} metric needs samples (use gate.record_samples)")
        if self.ceiling is not None and self.floor is not None and self.floor > self.ceiling:
            raise ValueError(f"{where}: floor {self.floor} is above ceiling {self.ceiling}")
        self.value = float(self.value) if isinstance(self.value, float) else self.value

    @property
    def effective_tolerance(self) -> float:
        """The relative tolerance in force: the given one, else its kind's (0 exact, 5% measured)."""
        if self.tolerance is not None:
            return self.tolerance
        return kind_rule(self.kind).default_tolerance

    @property
    def effective_scope(self) -> Scope:
        """The scope in force: the given one, else the kind's default."""
        return self.scope or default_scope(self.kind)

    def show(self, value: float | None = None, *, precise: bool = False) -> str:
        """Format *value* (default: this metric's value) in this metric's unit."""
        return format_value(self.value if value is None else value, self.unit, precise=precise)

    def to_json(self) -> dict[str, Any]:
        """This metric as a baseline file stores it (without its name): tolerance and scope in force included."""
        out: dict[str, Any] = {
            "value": self.value,
            "unit": self.unit,
            "kind": self.kind,
            "better": self.better,
            "tolerance": self.effective_tolerance,
            "scope": self.effective_scope,
        }
        if self.ceiling is not None:
            out["ceiling"] = self.ceiling
        if self.floor is not None:
            out["floor"] = self.floor
        if self.samples:
            out["samples"] = list(self.samples)
        if self.fit is not None:
            out["fit"] = self.fit.to_json()
        if not self.history:  # a report's figure only: a baseline never holds one (Note [budget-only figures])
            out["history"] = False
        return out
