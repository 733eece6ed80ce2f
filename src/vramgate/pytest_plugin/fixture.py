"""The ``gate`` fixture's object: what a test uses to record its metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vramgate.core.checks import Finding
from vramgate.core.claims import ClaimVerdict
from vramgate.core.kinds import kind_rule
from vramgate.core.leak import LeakFit
from vramgate.core.metrics import Better, Kind, Metric, Paired, Scope, median
from vramgate.core.paired import TOO_NOISY, paired_rule

if TYPE_CHECKING:
    from vramgate.profiles.manifest import Profile


class Gate:
    """Records the metrics of one test.

    At the end of the test the plugin checks each recorded metric against its
    budget (``ceiling``/``floor``) and its stored baseline, and fails the test
    with one message that lists every metric that falls short.
    """

    def __init__(self, nodeid: str, suite: str, gpus: int = 1) -> None:
        self.nodeid = nodeid
        self.suite = suite
        self.gpus = gpus
        """How many GPUs the test uses (its ``requires_gpus``, else 1): its machine-bound baselines' key counts
        them (Note [GPUs a test uses] in :mod:`vramgate.machine.hardware`)."""
        self.metrics: dict[str, Metric] = {}
        self.claims: list[ClaimVerdict] = []
        self.conditions: list[dict[str, Any]] = []
        """GPU-state readings taken around this test's measurements (see :meth:`gpu_guard`)."""
        self.untrusted: list[str] = []
        """Why this test's measured metrics cannot be trusted (throttling, foreign load)."""
        self._budgets: dict[str, list[tuple[str, float, str | None, str, str]]] = {}
        self.budgets_applied: list[str] = []
        """The budgets given with :meth:`budget` that a recorded metric took, as a person reads them."""
        self.previewer: Callable[[Metric], Finding] | None = None
        """What the end of the test would find of a metric now, against its stored baseline (set by the plugin:
        ``GateSession.preview``); None outside a gate session."""
        self.baseline_writer: Callable[[Metric], bool] | None = None
        """Whether the session writes a metric as a baseline when this test passes (set by the plugin:
        ``GateSession.writes_baseline``); None outside a gate session."""

    def budget(self, metric: str, op: str, value: float, *, unit: str | None = None, text: str = "",
               source: str = "") -> None:
        """Hold *metric*, when the test records it, to ``op value`` (``<=``: a ceiling, ``>=``: a floor), the
        stricter of it and a bound the test sets itself: how a team's budgets (a matrix entry's) reach a test
        before it records, not after. *unit* (``B``, ``s``): the budget's unit, which the metric must have (a
        :class:`ValueError` naming *source* when it does not); *text*: the budget as written."""
        if op not in ("<=", ">="):
            raise ValueError(f"{source or 'budget'}: budget {metric} {op} {value}: the operator is <= or >=")
        self._budgets.setdefault(metric, []).append((op, float(value), unit, text or f"{op} {value:g}", source))

    def _add(self, metric: Metric) -> Metric:
        if metric.name in self.metrics:
            raise ValueError(f"metric {metric.name!r} was already recorded in {self.nodeid}")
        for op, value, unit, text, source in self._budgets.get(metric.name, ()):
            if unit is not None and metric.unit != unit:
                raise ValueError(f"{source}.budgets.{metric.name}: {text!r} is in {unit}, but the test records "
                                 f"{metric.name} in {metric.unit}")
            if op == "<=":
                metric.ceiling = value if metric.ceiling is None else min(metric.ceiling, value)
            else:
                metric.floor = value if metric.floor is None else max(metric.floor, value)
            self.budgets_applied.append(f"budget {metric.name} {text} ({source})" if source else
                                        f"budget {metric.name} {text}")
        self.metrics[metric.name] = metric
        return metric

    def record(
        self,
        name: str,
        value: float,
        *,
        unit: str,
        kind: Kind = "exact",
        better: Better = "lower",
        ceiling: float | None = None,
        floor: float | None = None,
        tolerance: float | None = None,
        scope: Scope | None = None,
        history: bool = True,
        fit: LeakFit | None = None,
    ) -> Metric:
        """Record one metric of the running test.

        ``unit`` is one of :data:`vramgate.core.metrics.UNITS` (``B``, ``s``,
        ``ratio``, ``tokens``, ...); ``kind`` is ``exact`` (deterministic
        accounting; compared with tolerance 0 unless given) or ``measured``
        (use :meth:`record_samples` for those); ``better`` says which way is an
        improvement; ``ceiling``/``floor`` are absolute budgets in ``unit``;
        ``tolerance`` is relative (0.02 = 2%), the same in both directions in
        ratio terms (for ``better="higher"``, half the value is 100% worse);
        ``scope`` is ``portable`` (compared on every machine of the tier; the
        default for ``exact``) or ``machine`` (compared only on this hardware
        key: anything an ISA, kernel or device changes). See Note [metric
        scope] in :mod:`vramgate.core.metrics`. ``history=False`` holds it to its budgets only, never to a
        baseline (Note [budget-only figures] there). ``fit``: a memory slope's fit, whose lower bound is held to
        the ceiling and whose samples the report draws (Note [leak fit] in :mod:`vramgate.core.leak`).
        """
        if kind_rule(kind).needs_samples:
            raise ValueError(
                f"metric {name!r}: a {kind} metric needs samples; use gate.record_samples(name, samples, ...)"
            )
        return self._add(
            Metric(name, value, unit, kind, better, ceiling=ceiling, floor=floor, tolerance=tolerance, scope=scope,
                   history=history, fit=fit)
        )

    def record_samples(
        self,
        name: str,
        samples: Iterable[float],
        *,
        unit: str,
        better: Better = "lower",
        ceiling: float | None = None,
        floor: float | None = None,
        tolerance: float | None = None,
        scope: Scope | None = None,
        history: bool = True,
    ) -> Metric:
        """Record a measured metric from repeated samples (its value is their median).

        Budgets apply to the median. Against the baseline the samples are
        compared by the rule in :mod:`vramgate.core.stats` (default tolerance 5%).
        Measured metrics are machine-bound unless ``scope="portable"``. ``history=False`` holds them to their
        budgets only, as :meth:`record`.
        """
        values = [float(s) for s in samples]
        if len(values) < 2:
            raise ValueError(f"metric {name!r}: need at least 2 samples, got {len(values)}")
        return self._add(
            Metric(
                name, median(values), unit, "measured", better,
                ceiling=ceiling, floor=floor, tolerance=tolerance, samples=values, scope=scope, history=history,
            )
        )

    def record_paired(
        self,
        name: str,
        reference: Iterable[float],
        candidate: Iterable[float],
        *,
        better: Better = "lower",
        tolerance: float,
        alpha: float = 0.01,
        history_tolerance: float | None = None,
        ceiling: float | None = None,
        looks: Sequence[str] = (),
        noise_in_looks: bool = False,
    ) -> Metric:
        """Record a candidate against a reference measured in the same session, pair by pair (paired A/B).

        The metric's samples are the per-pair ratios candidate / reference and
        its value their median. It fails when the candidate is worse than the
        reference by more than *tolerance* with a one-sided signed-rank test of
        the pairs clear at *alpha* (Note [paired comparison] in
        :mod:`vramgate.core.stats`), and, against the stored baseline,
        when the ratios move by more than *history_tolerance* (default:
        *tolerance*). Samples too noisy for the in-run check to detect a shift of
        *tolerance* make it ``untrusted`` (Note [noise guard] in
        :mod:`vramgate.core.stats`): it fails, saying why, and never becomes a
        baseline. *looks*: what each look found (:meth:`paired_checks`), shown
        when it fails; *noise_in_looks*: they hold each look's noise guard line (the looks were judged with
        :meth:`paired_checks`), so the message adds no line of its own.
        """
        return self._add(self._paired(name, reference, candidate, better=better, tolerance=tolerance, alpha=alpha,
                                      history_tolerance=history_tolerance, ceiling=ceiling, looks=looks,
                                      noise_in_looks=noise_in_looks))

    def paired_checks(self, name: str, reference: Iterable[float], candidate: Iterable[float], *,
                      better: Better = "lower", tolerance: float, alpha: float = 0.01,
                      history_tolerance: float | None = None) -> list[tuple[str, bool]]:
        """What the end of the test would find of these samples, recorded as :meth:`record_paired` would record
        them, beside the in-run check: the noise guard, and the stored baseline where a gate session runs the
        test. A line per check and whether it fails; nothing is recorded (a second look decides, Note [second
        look] in :mod:`vramgate.engine.paired`)."""
        metric = self._paired(name, reference, candidate, better=better, tolerance=tolerance, alpha=alpha,
                              history_tolerance=history_tolerance, ceiling=None, looks=())
        rule = paired_rule(metric)
        assert rule is not None
        noisy = rule.too_noisy()
        out = [(rule.noise()[1] + (f": {TOO_NOISY}" if noisy else ""), noisy is not None)]
        if self.previewer is not None:
            found = self.previewer(metric)
            if found.verdict not in ("untrusted",):
                change = "" if found.change is None else f"{found.change:+.2%}, "
                base = "" if found.baseline is None else f" vs baseline {found.baseline.value:.4g}"
                out.append((f"against the baseline: {name} {metric.value:.4g}{base} ({change}{found.detail or '-'}):"
                            f" {found.verdict}", found.verdict == "regressed"))
        return out

    def writes_paired_baseline(self, name: str, reference: Iterable[float], candidate: Iterable[float], *,
                               better: Better = "lower", tolerance: float, alpha: float = 0.01,
                               history_tolerance: float | None = None) -> bool:
        """Whether :meth:`record_paired` of these samples would become a stored baseline when the test passes
        (``--gate-update``, or ``--gate-missing record`` with none stored): a paired test then takes both looks
        (Note [baselines of two engine pairs] in :mod:`vramgate.engine.looks`)."""
        if self.baseline_writer is None:
            return False
        metric = self._paired(name, reference, candidate, better=better, tolerance=tolerance, alpha=alpha,
                              history_tolerance=history_tolerance, ceiling=None, looks=())
        return self.baseline_writer(metric)

    def _paired(self, name: str, reference: Iterable[float], candidate: Iterable[float], *, better: Better,
                tolerance: float, alpha: float, history_tolerance: float | None, ceiling: float | None,
                looks: Sequence[str], noise_in_looks: bool = False) -> Metric:
        ref, cand = [float(v) for v in reference], [float(v) for v in candidate]
        if len(ref) != len(cand) or len(ref) < 2:
            raise ValueError(f"metric {name!r}: need at least 2 pairs of samples, got {len(ref)} and {len(cand)}")
        if any(v <= 0 for v in ref):
            raise ValueError(f"metric {name!r}: reference samples must be positive")
        ratios = [c / r for r, c in zip(ref, cand, strict=True)]
        return Metric(
            name, median(ratios), "ratio", "measured", better, ceiling=ceiling,
            tolerance=tolerance if history_tolerance is None else history_tolerance, samples=ratios,
            paired=Paired(tuple(ref), tuple(cand), tolerance, alpha, tuple(looks),
                          noise_in_looks=noise_in_looks),
        )

    def claim(self, statement: str, *, held: bool, evidence: str, source: str = "",
              judged: bool = True) -> ClaimVerdict:
        """Record the verdict on a claim (held or not held) with the measured evidence.

        Verdicts appear in the terminal summary and the report. A claim that
        does not hold is a finding, not a test failure: gate the numbers behind
        it with :meth:`record` when they must not move. ``judged=False``: the
        run could not settle it (*evidence* says why); the report shows it as
        ``not judged``.
        """
        verdict = ClaimVerdict(statement, bool(held) and judged, evidence, source, judged)
        self.claims.append(verdict)
        return verdict

    def profile_claims(
        self,
        profile: Profile,
        workload: str,
        patched: dict[str, float],
        reference: dict[str, float],
        *,
        labels: tuple[str, str] = ("patched", "unpatched"),
        context: str = "",
    ) -> list[ClaimVerdict]:
        """Record the verdict of each of *profile*'s claims on *workload*: *patched* figures against *reference*.

        A claim on a metric the test did not measure is an error in the
        profile's manifest: it raises :class:`ValueError` naming the metric
        and the ones measured.
        """
        out = []
        for claim in profile.claims:
            if claim.workload != workload:
                continue
            if claim.metric not in patched or claim.metric not in reference:
                raise ValueError(f"profile {profile.name}: claim on unknown metric {claim.metric!r}; "
                                 f"measured here: {', '.join(sorted(patched))}")
            held, value = claim.holds(patched[claim.metric], reference[claim.metric])
            out.append(self.claim(
                f"{profile.name}: {claim.describe()}", held=held, source=f"patches/{profile.name}/manifest.toml",
                evidence=(f"{claim.metric}: {patched[claim.metric]:g} {labels[0]} vs {reference[claim.metric]:g} "
                          f"{labels[1]} ({claim.compare} {value:.4g}; bound {claim.op} {claim.bound:g}) on "
                          f"{context + ', ' if context else ''}{workload}"),
            ))
        return out

    @contextmanager
    def gpu_guard(self, index: int = 0) -> Iterator[None]:
        """Read the GPU's state (clocks, throttle reasons, other processes) around a measurement.

        The readings go into the report with the test. When they show
        throttling or another process on the device (see
        :mod:`vramgate.machine.probes.gpu_state`), this test's measured metrics are
        flagged ``untrusted``: the test fails with the reason instead of being
        compared, and its figures never become a baseline. Without NVML the
        measurement proceeds and the report says it was not guarded.
        """
        from vramgate.machine.probes.gpu_state import own_pids, problems, read_state
        from vramgate.machine.probes.nvml import NVMLUnavailable

        try:
            before = read_state(index)
        except NVMLUnavailable as exc:
            self.conditions.append({"guarded": False, "why": str(exc)})
            yield
            return
        yield
        try:
            after = read_state(index)
        except NVMLUnavailable as exc:
            self.conditions.append({"guarded": False, "why": f"NVML was lost during the measurement: {exc}",
                                    "before": before.to_json()})
            return
        self.conditions.append({"guarded": True, "before": before.to_json(), "after": after.to_json()})
        for problem in problems([before, after], own_pids()):
            if problem not in self.untrusted:
                self.untrusted.append(problem)
