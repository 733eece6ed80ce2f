"""The per-gate-run campaign's trials: what one trial of a profile's paired test recorded, how trials are read,
and the exact bounds of a rate counted in them (Note [per-gate-run campaign] in
:mod:`vramgate.tools.calibration.gate_paired`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The planted delay a detection trial gives the candidate's engine steps.
PLANTED = 0.10
#: A trial's conditions: its name and the delay planted in the candidate.
CONDITIONS = (("unchanged", 0.0), ("delay-10%", PLANTED))
#: Round pairs per value of the step floor (Note [step floor]).
FLOOR_GROUP = 5


def floor_sums(series: Sequence[Sequence[float]], group: int = FLOOR_GROUP) -> list[float]:
    """Per *group* consecutive *series* (each a round's step durations, position by position the same work), the
    sum over the positions of the shortest duration at each; a position some series lack counts with those that
    have it. ``ValueError`` when the series do not split into groups of *group* or one is empty.

    Note [step floor]: an engine runs the same steps in the same order every round (the offline scheduler does
    not depend on time), and a step's duration is its work plus what the machine took from it meanwhile: on a
    2-core CPU single steps run several times their usual time now and then. The step floor of 5 rounds is the
    workload's engine time with the least taken. Its look is sharper than each round's median step, but gives
    fewer pairs, and with the gate's rules it caught no more and alarmed no less: no tier gates it, and a campaign
    takes it with ``run --stat step_floor``. The measurements: docs/calibration.md and
    calibration/cpu-x86_64-avx512-bf16-amd-epyc-gate-runs-step-floor.md."""
    if group < 1 or len(series) % group:
        raise ValueError(f"{len(series)} series do not split into groups of {group}")
    if not all(series):
        raise ValueError("a series has no samples")
    out = []
    for start in range(0, len(series), group):
        block = series[start:start + group]
        out.append(sum(min(s[k] for s in block if len(s) > k) for k in range(max(len(s) for s in block))))
    return out


def _binomial_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f: Any) -> float:
    """The p in [0, 1] where the increasing-then-false predicate *f* turns false (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) else (lo, mid)
    return (lo + hi) / 2


def upper_bound(hits: int, trials: int, confidence: float = 0.95) -> float:
    """The exact (Clopper-Pearson) one-sided upper *confidence* bound of a rate seen *hits* times in *trials*: 3/n
    for no hit at 95% (the rule of three)."""
    if trials <= 0:
        return math.nan
    if hits >= trials:
        return 1.0
    return _solve(lambda p: _binomial_cdf(hits, trials, p) > 1 - confidence)


def lower_bound(hits: int, trials: int, confidence: float = 0.95) -> float:
    """The exact one-sided lower *confidence* bound of a rate seen *hits* times in *trials*."""
    if trials <= 0:
        return math.nan
    if hits <= 0:
        return 0.0
    return _solve(lambda p: 1 - _binomial_cdf(hits - 1, trials, p) < 1 - confidence)


def show_rate(hits: int, trials: int, *, bound: str = "upper") -> str:
    """``hits/trials (rate; 95% upper bound B)`` (or lower bound, for a detection)."""
    if not trials:
        return "no trials"
    b = upper_bound(hits, trials) if bound == "upper" else lower_bound(hits, trials)
    return f"{hits}/{trials} ({hits / trials:.1%}; 95% {bound} bound {b:.1%})"


@dataclass(frozen=True)
class TrialData:
    """One trial of one profile's paired test: a statistic's samples (``step``: each round's median engine step, the
    gate's; ``step_floor``: Note [step floor]), reference and candidate."""

    profile: str
    condition: str
    """``unchanged`` or ``delay-10%``."""
    index: int
    ref: list[float]
    cand: list[float]
    busy: bool
    stat: str = "step"
    """The statistic of ``ref`` and ``cand`` (trials before it was recorded took ``step``)."""
    together: bool | None = None
    """Whether both engines ran each pair's rounds at once (Note [rounds together]); ``None``: not recorded."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialData:
        """A trial from a line of ``trials.jsonl``."""
        together = data.get("together")
        return cls(str(data["profile"]), str(data["condition"]), int(data["index"]),
                   [float(v) for v in data["ref"]], [float(v) for v in data["cand"]], bool(data.get("busy", True)),
                   str(data.get("stat", "step")), None if together is None else bool(together))


def load_trials(paths: Sequence[Path]) -> list[TrialData]:
    """Every trial in the ``trials.jsonl`` of each campaign folder in *paths*."""
    out = []
    for folder in paths:
        for n, line in enumerate((folder / "trials.jsonl").read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    out.append(TrialData.from_json(json.loads(line)))
                except (KeyError, TypeError, ValueError) as exc:
                    raise SystemExit(f"{folder / 'trials.jsonl'}:{n}: not a trial ({exc!r})") from None
    return out
