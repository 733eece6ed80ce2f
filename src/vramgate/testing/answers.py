"""Profiles' outputs in the suites: a patched run's answers held against the unpatched run's (Note [the same answer]
in :mod:`vramgate.core.answers`)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from vramgate.core.answers import IDENTICAL_LOGPROB_BOUND, AnswersError, Comparison, Expectation, compare
from vramgate.engine import EngineResult
from vramgate.engine.paired import RoundAnswers
from vramgate.models.recall_weights import MIN_MARGIN as RECALL_MIN_MARGIN
from vramgate.profiles import Profile
from vramgate.pytest_plugin.fixture import Gate

__all__ = [
    "NOT_JUDGED",
    "RECALL_MIN_MARGIN",
    "RecallModelCheck",
    "check_answers",
    "check_recall_model",
    "check_round_answers",
    "check_same_answers",
    "check_task_accuracy",
    "check_upgrade_answers",
    "failure_message",
]

#: The evidence of a verdict no run could settle: one side generated on dummy weights.
NOT_JUDGED = "outputs not judged: dummy weights"


def check_answers(gate: Gate, profile: Profile, candidate: EngineResult, reference: EngineResult, *,
                  labels: tuple[str, str] = ("patched", "unpatched"), context: str = "",
                  metric_prefix: str = "") -> Comparison | None:
    """Hold *candidate*'s outputs (the profile's run) against *reference*'s (the unpatched run's, of the same
    prompts) to *profile*'s ``[outputs]`` expectation; the comparison, or None where nothing was judged.

    Records in *gate*'s report a verdict row (a claim whose source is the manifest) and, where both runs have
    outputs, the figures ``tokens_equal_fraction``, ``task_accuracy`` (the candidate's) and
    ``reference_task_accuracy`` (each after *metric_prefix*; held to no baseline: Note [budget-only figures] in
    :mod:`vramgate.core.metrics`). A run without outputs (dummy weights) is not judged: the row says so and the test
    goes on. An expectation not met fails the test (``pytest.fail``) with the check, the expectation, the first
    divergence, both sides' accuracy and how to accept it on purpose: call it after the test's other records.
    *labels* name the candidate and the reference; *context* (the model, say) goes into the evidence."""
    expectation = profile.outputs
    source = f"patches/{profile.name}/manifest.toml"
    statement = f"{profile.name}: {expectation.statement(labels[1])}"
    where = f" on {context}" if context else ""
    missing = [label for label, result in zip(labels, (candidate, reference), strict=True) if result.outputs is None]
    if missing:
        gate.claim(statement, held=False, judged=False, source=source,
                   evidence=f"{NOT_JUDGED} (the {' and the '.join(missing)} run{'s' if len(missing) > 1 else ''} "
                            f"recorded no outputs){where}")
        return None
    assert candidate.outputs is not None and reference.outputs is not None
    try:
        comparison = compare(reference.outputs, candidate.outputs, top_k=expectation.top_k)
    except AnswersError as exc:
        pytest.fail(f"vramgate: the outputs of {profile.name} cannot be compared with the {labels[1]} run's: {exc}",
                    pytrace=False)
    gate.record(f"{metric_prefix}tokens_equal_fraction", comparison.tokens_equal_fraction, unit="ratio",
                better="higher", history=False)
    if comparison.judged_requests:
        gate.record(f"{metric_prefix}task_accuracy", comparison.candidate_accuracy, unit="ratio", better="higher",
                    history=False)
        gate.record(f"{metric_prefix}reference_task_accuracy", comparison.reference_accuracy, unit="ratio",
                    better="higher", history=False)
    held, check = expectation.judge(comparison, labels)
    gate.claim(statement, held=held, source=source,
               evidence=f"{check}{'' if comparison.tokens_line() in check else '; ' + comparison.tokens_line()}; "
                        f"{comparison.accuracy_line(labels)} "
                        f"({expectation.describe()}, {expectation.origin or 'the manifest'}){where}")
    if not held:
        pytest.fail(failure_message(profile, comparison, check, labels, context), pytrace=False)
    return comparison


def check_round_answers(gate: Gate, answers: RoundAnswers, *, who: str, model: str,
                        expectation: Expectation | None = None, source: str = "paired run") -> bool | None:
    """Hold the answers of a paired run's rounds (Note [round answers] in :mod:`vramgate.engine.paired`): every
    round of both engines generated the reference's first round's tokens. Records a claim row; a reference that
    answers otherwise from round to round fails the test, and so does a candidate that answers otherwise than its
    reference where *expectation* is ``identical`` or none is given (an upgrade). Where the expectation allows other
    tokens (``close``, ``accuracy``: the rounds keep no logprobs) the row says the answers suite judges them. On
    dummy weights nothing is judged and the row says so. Whether the answers held, None where not judged.
    *who*: the paired test's subject (a profile's name, an upgrade); *model*: the model the rounds ran."""
    statement = f"{who}: the paired rounds' answers are the reference's, every round of both engines"
    if not answers.judged:
        gate.claim(statement, held=False, judged=False, source=source,
                   evidence=f"{NOT_JUDGED} ({model}: the rounds generate no answers to hold); answers are judged on "
                            "the recall models (suites/answers, suites/pressure/test_recall_models.py)")
        return None
    strict = expectation is None or expectation.expect == "identical"
    if answers.first_difference is not None and answers.candidate_differs and not strict:
        assert expectation is not None
        gate.claim(statement, held=False, judged=False, source=source,
                   evidence=f"the candidate's tokens differ ({answers.first_difference}), which "
                            f"{expectation.describe()} allows; the rounds keep no logprobs to judge them by: "
                            f"suites/answers judges them ({answers.rounds} rounds on {model})")
        return None
    held = answers.first_difference is None
    evidence = (f"{answers.rounds} rounds on {model}: every round generated the reference's first round's tokens"
                if held else f"{answers.rounds} rounds on {model}: {answers.first_difference}")
    gate.claim(statement, held=held, source=source, evidence=evidence)
    if not held:
        whose = ("the candidate answers otherwise than its reference" if answers.candidate_differs
                 else "the reference engine answers otherwise from round to round")
        pytest.fail(f"vramgate: {who}: {whose} in the paired rounds on {model}\n- first difference: "
                    f"{answers.first_difference}", pytrace=False)
    return True


def check_same_answers(gate: Gate, candidate: EngineResult, reference: EngineResult, *, what: str,
                       labels: tuple[str, str], context: str = "", accept: str = "") -> Comparison | None:
    """Hold *candidate*'s outputs to *reference*'s of the same prompts as an ``identical`` expectation holds a
    profile's (the same tokens, each logprob within the bound: Note [identical logprobs] in
    :mod:`vramgate.core.answers`), where the two runs must compute the same thing: another vLLM (an upgrade),
    another tensor parallelism. Records the comparison's figures and a claim row, and fails the test with the first
    divergence, saying that *what* changes answers (*accept*: how one accepts it on purpose). None, with a row that
    says why, where a side ran on dummy weights. *labels*: the candidate's and the reference's names."""
    expectation = Expectation("identical")
    statement = f"{what}: outputs identical to the {labels[1]}'s"
    where = f" on {context}" if context else ""
    missing = [label for label, result in zip(labels, (candidate, reference), strict=True) if result.outputs is None]
    if missing:
        gate.claim(statement, held=False, judged=False, source=what,
                   evidence=f"{NOT_JUDGED} (the {' and the '.join(missing)} run recorded no outputs){where}")
        return None
    assert candidate.outputs is not None and reference.outputs is not None
    try:
        comparison = compare(reference.outputs, candidate.outputs)
    except AnswersError as exc:
        pytest.fail(f"vramgate: the {labels[0]}'s outputs cannot be compared with the {labels[1]}'s: {exc}",
                    pytrace=False)
    gate.record("tokens_equal_fraction", comparison.tokens_equal_fraction, unit="ratio", better="higher",
                history=False)
    gate.record("max_logprob_delta", round(comparison.max_logprob_delta, 4), unit="logits", history=False)
    held, check = expectation.judge(comparison, labels)
    gate.claim(statement, held=held, source=what, evidence=f"{check}; {comparison.accuracy_line(labels)}{where}")
    if not held:
        first = comparison.first_divergence
        pytest.fail("\n".join([
            f"vramgate: {what} changes answers{where}",
            f"- check: {check}",
            "- first divergence: " + (first.describe(labels) if first else "none (every token equal)"),
            f"- {comparison.accuracy_line(labels)}", *([accept] if accept else [])]), pytrace=False)
    return comparison


def check_upgrade_answers(gate: Gate, new: EngineResult, old: EngineResult, *, context: str = "") -> Comparison | None:
    """The new vLLM's outputs (*new*) against the old one's (*old*) of the same prompts
    (:func:`check_same_answers`): "this upgrade changes answers", with its first divergence."""
    return check_same_answers(
        gate, new, old, what="this upgrade", labels=("new vLLM", "old vLLM"), context=context,
        accept="A release that fixes a kernel changes answers on purpose: read the divergence, and accept the upgrade "
               "by reviewing it (docs/upgrade.md); one that does not has changed what the model computes.")


def failure_message(profile: Profile, comparison: Comparison, check: str, labels: tuple[str, str],
                    context: str = "") -> str:
    """Why *profile*'s outputs fail its expectation, as the gate says it: the headline, the check that decided, the
    first divergence, the tokens and both sides' accuracy, the expectation and how to accept the change on
    purpose."""
    expectation = profile.outputs
    manifest = f"patches/{profile.name}/manifest.toml"
    first = comparison.first_divergence
    head = (f"vramgate: outputs of {profile.name} fail [outputs] {expectation.describe()} against the {labels[1]} run"
            + (f" ({context})" if context else ""))
    lines = [head, f"- check: {check}",
             "- first divergence: " + (first.describe(labels) if first else "none (every token equal)")]
    bad = comparison.first_not_close
    if bad is not None and bad != first:
        lines.append(f"- first not close: {bad.describe(labels)}")
    lines += [f"- {comparison.tokens_line()}", f"- {comparison.accuracy_line(labels)}",
              f"Expectation: {expectation.describe()} ({expectation.origin or 'the manifest'}), {manifest}",
              "To accept this on purpose, state what the profile computes in its manifest and commit it for review:",
              f"    {manifest}: [outputs] {_looser(expectation.expect, comparison)}"]
    return "\n".join(lines)


def _looser(expect: str, comparison: Comparison) -> str:
    """The ``[outputs]`` line that would accept *comparison*."""
    if expect == "identical" and comparison.identical:
        return (f'expect = "close" (top_k = {comparison.top_k}: the tokens agree, and their logprobs move by '
                f'{comparison.max_logprob_delta:.3g}; "identical" holds them within {IDENTICAL_LOGPROB_BOUND:g})')
    if expect == "identical" and comparison.close:
        return f'expect = "close" (top_k = {comparison.top_k}: the tokens differ, within the top-k)'
    drop = math.ceil(max(0.0, comparison.accuracy_drop) * 100 - 1e-9) / 100  # up to the next point, never below
    if comparison.judged_requests:
        return f'expect = "accuracy", max_accuracy_drop = {drop:.2f} (the task accuracy this run lost)'
    return 'expect = "accuracy", with a max_accuracy_drop the profile may lose'


def check_task_accuracy(gate: Gate, result: EngineResult, *, context: str = "") -> float | None:
    """Hold an unpatched run's answers to the task: every determined answer right, each ahead of the runner-up by the
    margin its model was made with (:data:`RECALL_MIN_MARGIN`, vLLM's own top-k logprobs), as the model was made to
    answer (:class:`vramgate.models.recall.RecallModel`); records ``task_accuracy`` and ``min_margin`` (held to no
    baseline) and fails the test when an answer is wrong or its margin short. None, recording nothing, for a run on
    dummy weights."""
    if result.outputs is None:
        return None
    accuracy, judged = result.outputs.accuracy()
    gate.record("task_accuracy", accuracy, unit="ratio", better="higher", history=False)
    margin = result.outputs.min_margin()
    if margin is not None:
        gate.record("min_margin", round(margin, 2), unit="logits", better="higher", history=False)
    wrong = [i for i, r in enumerate(result.outputs.requests) if r.expected is not None and r.token_ids != r.expected]
    if wrong:
        first = result.outputs.requests[wrong[0]]
        at = next(j for j, (a, b) in enumerate(zip(first.token_ids, first.expected or [], strict=False)) if a != b)
        where = f" on {context}" if context else ""
        pytest.fail(
            f"vramgate: the unpatched engine answers {accuracy:.1%} of {judged} recall requests{where}, the model was "
            f"made to answer them all: {len(wrong)} wrong, the first request {wrong[0]} at generated position {at} "
            f"(token {first.token_ids[at]}, expected {first.expected[at] if first.expected else None}). vLLM itself, "
            "its kernels on this machine, or the engine's arguments compute something else than the model's "
            "reference (Note [recall weights] in vramgate.models.recall_weights)", pytrace=False)
    if margin is not None and margin < RECALL_MIN_MARGIN:
        where = f" on {context}" if context else ""
        pytest.fail(
            f"vramgate: the unpatched engine's answers{where} lead the runner-up by {margin:.2f} logits at the least, "
            f"under the {RECALL_MIN_MARGIN} the model was made with: vLLM computes other numbers than the model's "
            "reference (Note [recall weights] in vramgate.models.recall_weights)", pytrace=False)
    return accuracy


@dataclass(frozen=True)
class RecallModelCheck:
    """A committed recall model judged by the reference modules, and the one its command makes now."""

    committed_accuracy: float
    committed_margin: float
    remade_accuracy: float
    remade_margin: float
    remade_identical: bool
    command: str
    min_margin: float


def check_recall_model(folder: Path, arch: str, out: Path) -> RecallModelCheck:
    """Judge the recall model in *folder* (``llama`` or ``deepseek-v2``) with the reference modules of
    :mod:`vramgate.models.recall_weights` on its judging prompts, and remake it into *out* with its seed (needs
    torch and safetensors). ``pytest.fail`` when the folder has no description."""
    from safetensors.torch import load_file

    from vramgate.models import recall, recall_weights

    described = recall.RecallModel.read(folder)
    if described is None:
        pytest.fail(f"{folder} has no {recall.MODEL_FILE}: not a recall model", pytrace=False)
    shape = recall_weights.ARCHS[arch]
    model = recall_weights.build(shape)
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / described.weights)).items()})
    accuracy, margin = recall_weights.evaluate(model, recall_weights.eval_lengths(described.seed))
    remade, remade_accuracy, remade_margin = recall_weights.make(shape, described.seed)
    path = recall_weights.save(remade, shape, out, described.command, described.seed, remade_accuracy, remade_margin)
    return RecallModelCheck(accuracy, margin, remade_accuracy, remade_margin,
                            hashlib.sha256(path.read_bytes()).hexdigest() == described.sha256, described.command,
                            recall_weights.MIN_MARGIN)
