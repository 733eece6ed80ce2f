"""What an engine computed, and whether another engine computed the same: generated tokens, their top-k logprobs and
the task's expected answers, compared request by request.

Note [the same answer]: an optimization profile must compute what the unpatched vLLM computes; what it costs is
gated elsewhere. An engine run on a recall model (Note [recall task] in :mod:`vramgate.models.recall`) keeps per
request the tokens it generated (greedy), per position the top-:data:`TOP_K` logprobs (token id -> logprob, the
generated token included) and the task's expected answer (:class:`Outputs`); :func:`compare` holds a candidate's
outputs against a reference's of the same prompts, and an :class:`Expectation` (a profile's ``[outputs]`` table)
says which comparison must hold:

``identical``  every generated token equal: ``tokens_equal == tokens_compared``, where a request's tokens are
               compared position by position over the longer of its two outputs (a position only one side has counts
               as unequal), before and after its first divergence, so ``tokens_equal_fraction`` =
               tokens equal / tokens compared, over all requests (1.0 when nothing was generated); and every
               logprob both sides recorded for a token at a position within :data:`IDENTICAL_LOGPROB_BOUND` of the
               other side's (Note [identical logprobs]).
``close``      vLLM's own closeness of two runs (``check_logprobs_close`` in vLLM's ``tests/models/utils.py``): walk
               each request's tokens; at its first differing token each side's token must be in the other side's
               top-k logprobs, and after it the request is not compared (the texts have parted, and what follows
               depends on which way each went). Requests that never differ are close.
``accuracy``   the task's exact-match accuracy (over the requests whose answer the task determines) of the candidate
               no lower than the reference's minus ``max_accuracy_drop``.

Note [identical logprobs]: the recall models answer with margins of many logits (each ``recall.json`` has its
smallest), so a numerics change that moves every logit by whole units leaves every token as it was; tokens alone
cannot see it. So ``identical`` holds
the logprobs too: at every position where both sides have generated the same tokens so far (up to each request's first
divergence, where ``identical`` fails on the tokens already), each token in both sides' top-k has logprobs within
:data:`IDENTICAL_LOGPROB_BOUND` of each other. The bound is set from the spread of runs that compute the same thing
(the same run repeated, other batches, two engines at once, the block-manager profiles that must not change an
output, on both ISA classes: docs/campaigns/identical-logprobs.md, made with
``scripts/calibrate_logprobs.py``), with room to spare under the one-logit change the check is there to see.

Longer than 400 lines: the outputs' record, their comparison and the expectation that judges it change together
(a field of the comparison is a clause of a verdict and a key of its JSON); split, each part would reach into the
others' fields.

Everything here is plain data and JSON-able; the engine records :class:`Outputs`
(:class:`vramgate.engine.runner.EngineResult` ``outputs``), a profile's manifest states its :class:`Expectation`
(:mod:`vramgate.profiles.manifest`), and the suites judge with ``vramgate.testing.answers.check_answers``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vramgate.core.records import record_fields

#: The logprobs an engine run on a recall model records per generated position.
TOP_K = 5
#: What a profile may expect of its outputs against the unpatched run's (Note [the same answer]).
EXPECTATIONS = ("identical", "close", "accuracy")
#: The task accuracy an ``accuracy`` expectation may lose when its table does not say (5 points of exact match).
DEFAULT_MAX_ACCURACY_DROP = 0.05
#: The most an ``identical`` expectation lets a logprob move where the tokens agree (Note [identical logprobs]):
#: docs/campaigns/identical-logprobs.md has the spread of unchanged runs it is set from.
IDENTICAL_LOGPROB_BOUND = 0.5


class AnswersError(ValueError):
    """Outputs that cannot be read or compared (other prompts, too few logprobs recorded); says which and why."""


def _top(entries: dict[int, float], k: int) -> dict[int, float]:
    """The *k* most likely of *entries* (ties: the smaller token id first)."""
    ranked = sorted(entries.items(), key=lambda kv: (-kv[1], kv[0]))
    return dict(ranked[:k])


@dataclass(frozen=True)
class RequestOutput:
    """One request's generated tokens, their top-k logprobs per position and the task's expected answer."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    """Per generated position: token id -> logprob of the most likely tokens there, the generated one included."""
    expected: list[int] | None = None
    """The answer the task expects (as many tokens as were generated); None where the prompt does not determine
    it."""

    def top(self, position: int, k: int) -> dict[int, float]:
        """The *k* most likely tokens at *position* (empty where no logprobs were recorded)."""
        return _top(self.logprobs[position], k) if position < len(self.logprobs) else {}

    def to_json(self) -> dict[str, Any]:
        """The output as JSON data (logprobs' token ids as strings, as JSON object keys are)."""
        return {"token_ids": list(self.token_ids),
                "logprobs": [{str(t): lp for t, lp in pos.items()} for pos in self.logprobs],
                "expected": None if self.expected is None else list(self.expected)}

    @classmethod
    def from_json(cls, data: object, where: str = "request") -> RequestOutput:
        """The output in *data* (:meth:`to_json`'s); ``TypeError`` naming *where* and the field when malformed."""
        fields = record_fields(cls, data, where, TypeError, ignore_unknown=True)
        try:
            tokens = [_token(t) for t in fields["token_ids"]]
            logprobs = [{_token(t): float(lp) for t, lp in (pos or {}).items()}
                        for pos in fields.get("logprobs", [])]
            expected = fields.get("expected")
            return cls(tokens, logprobs, None if expected is None else [_token(t) for t in expected])
        except (TypeError, ValueError, AttributeError) as exc:
            raise TypeError(f"{where}: malformed outputs ({exc})") from None


def _token(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"token id {value!r} is not an integer")
    return int(value)


@dataclass(frozen=True)
class Outputs:
    """What an engine run on a recall model generated (Note [the same answer])."""

    requests: list[RequestOutput]
    top_k: int = TOP_K
    """How many logprobs were asked for per position."""
    prompts_sha256: str = ""
    """The prompts' digest (:func:`prompts_digest`): two runs' outputs compare only for the same prompts."""
    task: str = ""
    """The task the model answers (``recall``)."""

    def accuracy(self) -> tuple[float, int]:
        """Exact-match accuracy over the requests whose answer is determined, and how many those are (what
        :func:`vramgate.models.recall.accuracy` computes of these prompts)."""
        judged = [r for r in self.requests if r.expected is not None]
        right = sum(r.token_ids == r.expected for r in judged)
        return (right / len(judged) if judged else 0.0), len(judged)

    def min_margin(self) -> float | None:
        """The smallest lead, in logits, of the generated token's logprob over the runner-up's, over every
        position of the requests whose answer is determined (a logprob difference is a logit difference); None
        where no position has two logprobs recorded. How far the engine's numbers are from changing an answer."""
        leads = [top[0] - top[1]
                 for r in self.requests if r.expected is not None
                 for top in (sorted(pos.values(), reverse=True) for pos in r.logprobs) if len(top) > 1]
        return min(leads) if leads else None

    def to_json(self) -> dict[str, Any]:
        """The outputs as JSON data (what :meth:`from_json` reads)."""
        return {"requests": [r.to_json() for r in self.requests], "top_k": self.top_k,
                "prompts_sha256": self.prompts_sha256, "task": self.task}

    @classmethod
    def from_json(cls, data: object, where: str = "outputs") -> Outputs:
        """The outputs in *data*; ``TypeError`` naming *where* and the field when malformed."""
        fields = record_fields(cls, data, where, TypeError, ignore_unknown=True)
        requests = fields["requests"]
        if not isinstance(requests, list):
            raise TypeError(f"{where}: requests must be a list, got {type(requests).__name__}")
        top_k = fields.get("top_k", TOP_K)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise TypeError(f"{where}: top_k must be an integer >= 0, got {top_k!r}")
        return cls([RequestOutput.from_json(r, f"{where}: requests[{i}]") for i, r in enumerate(requests)], top_k,
                   str(fields.get("prompts_sha256", "")), str(fields.get("task", "")))


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short digest of token-id *prompts*: equal for the same prompts in the same order."""
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Divergence:
    """Where a request's two outputs first differ: the tokens and each side's top-k logprobs there."""

    request: int
    position: int
    reference_token: int | None
    """None where the reference's output ended before this position."""
    candidate_token: int | None
    reference_top: dict[int, float]
    candidate_top: dict[int, float]
    top_k: int = TOP_K
    """The k of :attr:`reference_top` and :attr:`candidate_top` (each side's k most likely tokens here)."""

    @property
    def close(self) -> bool:
        """Whether each side's token is among the other side's top-k here (vLLM's ``check_logprobs_close``; a
        position only one side generated, as vLLM's walk stops at the shorter output, is close)."""
        if self.reference_token is None or self.candidate_token is None:
            return True
        return self.candidate_token in self.reference_top and self.reference_token in self.candidate_top

    def describe(self, labels: tuple[str, str] = ("candidate", "reference")) -> str:
        """The divergence in words: request, position, both tokens and their logprobs, both top-k lists.

        *labels*: the names of the candidate and of the reference (in that order, as ``check_answers`` takes
        them)."""
        cand, ref = labels

        def side(name: str, token: int | None, top: dict[int, float]) -> str:
            if token is None:
                return f"{name} ended"
            lp = top.get(token)
            return f"{name} {token} (logprob {lp:.4g})" if lp is not None else f"{name} {token} (logprob not recorded)"

        def tops(name: str, top: dict[int, float], other: int | None) -> str:
            if other is None:
                return ""
            shown = ", ".join(f"{t}: {lp:.4g}" for t, lp in top.items()) or "none recorded"
            where = "in" if other in top else "NOT in"
            return f"; {name}'s top-{self.top_k} {{{shown}}} ({other} {where} it)"

        return (f"request {self.request}, position {self.position}: "
                f"{side(ref, self.reference_token, self.reference_top)}, "
                f"{side(cand, self.candidate_token, self.candidate_top)}"
                f"{tops(ref, self.reference_top, self.candidate_token)}"
                f"{tops(cand, self.candidate_top, self.reference_token)}")

    def to_json(self) -> dict[str, Any]:
        """The divergence as JSON data."""
        return {"request": self.request, "position": self.position, "reference_token": self.reference_token,
                "candidate_token": self.candidate_token,
                "reference_top": {str(t): lp for t, lp in self.reference_top.items()},
                "candidate_top": {str(t): lp for t, lp in self.candidate_top.items()}, "top_k": self.top_k,
                "close": self.close}


@dataclass(frozen=True)
class LogprobDelta:
    """The largest logprob difference of a comparison: where, of which token, each side's value."""

    request: int
    position: int
    token: int
    reference: float
    candidate: float

    @property
    def size(self) -> float:
        """The difference's absolute value."""
        return abs(self.candidate - self.reference)

    def describe(self, labels: tuple[str, str] = ("candidate", "reference")) -> str:
        """The difference in words (*labels*: candidate's, reference's)."""
        return (f"request {self.request}, position {self.position}, token {self.token}: {labels[1]} "
                f"{self.reference:.4g}, {labels[0]} {self.candidate:.4g} ({self.candidate - self.reference:+.4g})")

    def to_json(self) -> dict[str, Any]:
        """The difference as JSON data."""
        return {"request": self.request, "position": self.position, "token": self.token,
                "reference": self.reference, "candidate": self.candidate}


def _largest_delta(i: int, ref: RequestOutput, cand: RequestOutput, upto: int) -> LogprobDelta | None:
    """The largest difference between the logprobs both sides recorded for one token at one position, over the
    first *upto* positions of request *i* (where the tokens agree)."""
    best: LogprobDelta | None = None
    for pos in range(min(upto, len(ref.logprobs), len(cand.logprobs))):
        a, b = ref.logprobs[pos], cand.logprobs[pos]
        for token in a.keys() & b.keys():
            if best is None or abs(b[token] - a[token]) > best.size:
                best = LogprobDelta(i, pos, token, a[token], b[token])
    return best


@dataclass(frozen=True)
class Comparison:
    """A candidate's outputs against a reference's of the same prompts (Note [the same answer])."""

    requests: int
    tokens_compared: int
    """Per request the longer of its two outputs' lengths, summed."""
    tokens_equal: int
    """Positions, over all requests, where both sides generated the same token."""
    requests_identical: int
    top_k: int
    """The k of the closeness check."""
    requests_diverged: int
    requests_not_close: int
    first_divergence: Divergence | None
    first_not_close: Divergence | None
    reference_accuracy: float
    candidate_accuracy: float
    judged_requests: int
    """Requests whose answer the task determines (0: accuracy means nothing here)."""
    largest_logprob_delta: LogprobDelta | None = None
    """The largest difference of one token's logprob at one position where both sides generated the same tokens
    so far (Note [identical logprobs]); None where no token's logprob was recorded on both sides."""

    @property
    def max_logprob_delta(self) -> float:
        """:attr:`largest_logprob_delta`'s size (0.0 where none was recorded)."""
        return self.largest_logprob_delta.size if self.largest_logprob_delta else 0.0

    @property
    def tokens_equal_fraction(self) -> float:
        """Tokens equal / tokens compared (1.0 when nothing was generated)."""
        return self.tokens_equal / self.tokens_compared if self.tokens_compared else 1.0

    @property
    def identical(self) -> bool:
        """Whether every generated token is equal."""
        return self.tokens_equal == self.tokens_compared

    @property
    def close(self) -> bool:
        """Whether every request is close (:attr:`Divergence.close` at its first divergence)."""
        return self.requests_not_close == 0

    @property
    def accuracy_drop(self) -> float:
        """The reference's task accuracy minus the candidate's (positive: the candidate answers worse)."""
        return self.reference_accuracy - self.candidate_accuracy

    def tokens_line(self) -> str:
        """Tokens and requests equal, in words."""
        return (f"tokens equal: {self.tokens_equal:,} of {self.tokens_compared:,} ({self.tokens_equal_fraction:.2%}); "
                f"requests identical: {self.requests_identical} of {self.requests}")

    def accuracy_line(self, labels: tuple[str, str] = ("candidate", "reference")) -> str:
        """Both sides' task accuracy, in words (*labels*: candidate's, reference's)."""
        if not self.judged_requests:
            return "task accuracy: no request's answer is determined by the task"
        return (f"task accuracy: {labels[0]} {self.candidate_accuracy:.4f}, {labels[1]} {self.reference_accuracy:.4f} "
                f"(exact match over {self.judged_requests} request(s) whose answer the task determines)")

    def to_json(self) -> dict[str, Any]:
        """The comparison's figures as JSON data."""
        return {"requests": self.requests, "tokens_compared": self.tokens_compared, "tokens_equal": self.tokens_equal,
                "tokens_equal_fraction": self.tokens_equal_fraction, "requests_identical": self.requests_identical,
                "top_k": self.top_k, "requests_diverged": self.requests_diverged,
                "requests_not_close": self.requests_not_close,
                "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
                "first_not_close": self.first_not_close.to_json() if self.first_not_close else None,
                "reference_accuracy": self.reference_accuracy, "candidate_accuracy": self.candidate_accuracy,
                "judged_requests": self.judged_requests, "max_logprob_delta": self.max_logprob_delta,
                "largest_logprob_delta": self.largest_logprob_delta.to_json() if self.largest_logprob_delta else None}


def compare(reference: Outputs, candidate: Outputs, *, top_k: int = TOP_K) -> Comparison:
    """*candidate*'s outputs against *reference*'s (Note [the same answer]), closeness judged on each side's *top_k*
    most likely tokens; :class:`AnswersError` when they are not outputs of the same prompts, or a side recorded
    fewer than *top_k* logprobs per position."""
    if len(reference.requests) != len(candidate.requests):
        raise AnswersError(f"the reference has {len(reference.requests)} request(s), the candidate "
                           f"{len(candidate.requests)}: not outputs of the same prompts")
    if reference.prompts_sha256 and candidate.prompts_sha256 and reference.prompts_sha256 != candidate.prompts_sha256:
        raise AnswersError(f"the prompts differ (digest {reference.prompts_sha256} vs {candidate.prompts_sha256}): "
                           "not outputs of the same prompts (another seed, workload or task?)")
    if top_k < 1:
        raise AnswersError(f"top_k must be >= 1, got {top_k}")
    for side, outputs in (("reference", reference), ("candidate", candidate)):
        if outputs.top_k < top_k:
            raise AnswersError(f"the {side} recorded {outputs.top_k} logprob(s) per position; closeness needs "
                               f"top-{top_k}")
    compared = equal = identical = diverged = not_close = 0
    first: Divergence | None = None
    first_bad: Divergence | None = None
    largest: LogprobDelta | None = None
    for i, (ref, cand) in enumerate(zip(reference.requests, candidate.requests, strict=True)):
        a, b = ref.token_ids, cand.token_ids
        compared += max(len(a), len(b))
        same = sum(x == y for x, y in zip(a, b, strict=False))
        equal += same
        at = next((p for p, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        delta = _largest_delta(i, ref, cand, at)  # Note [identical logprobs]: where the tokens agree

        if delta is not None and (largest is None or delta.size > largest.size):
            largest = delta
        if same == len(a) == len(b):
            identical += 1
            continue
        diverged += 1
        div = Divergence(i, at, a[at] if at < len(a) else None, b[at] if at < len(b) else None,
                         ref.top(at, top_k), cand.top(at, top_k), top_k)
        first = first or div
        if not div.close:
            not_close += 1
            first_bad = first_bad or div
    (ref_acc, judged), (cand_acc, _) = reference.accuracy(), candidate.accuracy()
    return Comparison(requests=len(reference.requests), tokens_compared=compared, tokens_equal=equal,
                      requests_identical=identical, top_k=top_k, requests_diverged=diverged,
                      requests_not_close=not_close, first_divergence=first, first_not_close=first_bad,
                      reference_accuracy=ref_acc, candidate_accuracy=cand_acc, judged_requests=judged,
                      largest_logprob_delta=largest)


@dataclass(frozen=True)
class Expectation:
    """What a profile's outputs must be against the unpatched run's (a manifest's ``[outputs]`` table)."""

    expect: str = "identical"
    """One of :data:`EXPECTATIONS`."""
    top_k: int = TOP_K
    """``close``: each side's token must be in the other's *top_k* at the first divergence."""
    max_accuracy_drop: float = DEFAULT_MAX_ACCURACY_DROP
    """``accuracy``: the task accuracy the candidate may lose against the reference."""
    origin: str = ""
    """Where it comes from, as a person reads it (``[outputs] in the manifest``, ``default for ...``)."""

    def __post_init__(self) -> None:
        if self.expect not in EXPECTATIONS:
            raise ValueError(f"expect {self.expect!r} is not one of {', '.join(EXPECTATIONS)}")

    def describe(self) -> str:
        """The expectation as its table writes it: ``expect = "close", top_k = 5``."""
        extra = {"close": f", top_k = {self.top_k}",
                 "accuracy": f", max_accuracy_drop = {self.max_accuracy_drop:g}"}.get(self.expect, "")
        return f'expect = "{self.expect}"{extra}'

    def statement(self, reference: str = "reference") -> str:
        """What the expectation claims, in words, of the *reference* run's outputs."""
        if self.expect == "identical":
            return f"outputs identical to the {reference} run's"
        if self.expect == "close":
            return f"outputs close to the {reference} run's (top-{self.top_k} logprobs at the first divergence)"
        return f"task accuracy within {self.max_accuracy_drop:g} of the {reference} run's"

    def judge(self, comparison: Comparison, labels: tuple[str, str] = ("candidate", "reference")) -> tuple[bool, str]:
        """Whether *comparison* meets the expectation, and the check that decided, in words (*labels*: candidate's,
        reference's)."""
        cand, ref = labels
        if self.expect == "identical":  # Note [identical logprobs]
            bound, delta = IDENTICAL_LOGPROB_BOUND, comparison.largest_logprob_delta
            within = comparison.max_logprob_delta <= bound
            why = (f"identical tokens: {comparison.tokens_line()}; logprobs where the tokens agree: largest "
                   f"difference {comparison.max_logprob_delta:.3g}, bound {bound:g}")
            if not within and delta is not None:
                why += f", beyond it at {delta.describe(labels)}"
            return comparison.identical and within, why
        if self.expect == "close":
            why = (f"top-{comparison.top_k} closeness (vLLM's check_logprobs_close): {comparison.requests_diverged} of "
                   f"{comparison.requests} request(s) diverged, {comparison.requests_not_close} not close")
            if comparison.first_not_close is not None:
                d = comparison.first_not_close
                missing = []
                if d.reference_token not in d.candidate_top:
                    missing.append(f"{ref}'s {d.reference_token} is not in {cand}'s top-{comparison.top_k}")
                if d.candidate_token not in d.reference_top:
                    missing.append(f"{cand}'s {d.candidate_token} is not in {ref}'s top-{comparison.top_k}")
                why += f"; first not close: request {d.request}, position {d.position}: {'; '.join(missing)}"
            return comparison.close, why
        if not comparison.judged_requests:
            return False, "task accuracy: no request's answer is determined by the task"
        held = comparison.candidate_accuracy >= comparison.reference_accuracy - self.max_accuracy_drop - 1e-12
        return held, (f"task accuracy: {cand} {comparison.candidate_accuracy:.4f} vs {ref} "
                      f"{comparison.reference_accuracy:.4f}: a drop of {comparison.accuracy_drop:.4f}, "
                      f"{'within' if held else 'beyond'} the budget of {self.max_accuracy_drop:g}")
