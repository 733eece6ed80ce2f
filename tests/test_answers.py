"""The same answer (Note [the same answer] in vramgate.core.answers): outputs recorded, compared, expected by a
profile's manifest, judged in the suites and shown in the report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_engine import FAKE_RESULT
from vramgate.core.answers import (
    DEFAULT_MAX_ACCURACY_DROP,
    TOP_K,
    AnswersError,
    Expectation,
    Outputs,
    RequestOutput,
    compare,
    prompts_digest,
)
from vramgate.engine import EngineResult
from vramgate.models import recall
from vramgate.profiles import ProfileError, default_expectation, load_profile
from vramgate.pytest_plugin.fixture import Gate
from vramgate.testing.answers import check_answers

ROOT = Path(__file__).resolve().parents[1]
HW = ("--gate-hardware", "test-hw")


def request(tokens: list[int], tops: list[dict[int, float]] | None = None,
            expected: list[int] | None = None) -> RequestOutput:
    """A request's output; each position's logprobs default to the token alone, at -0.1."""
    return RequestOutput(tokens, tops if tops is not None else [{t: -0.1} for t in tokens], expected)


def outputs(*requests: RequestOutput, top_k: int = TOP_K, digest: str = "d1") -> Outputs:
    return Outputs(list(requests), top_k=top_k, prompts_sha256=digest, task="recall")


REFERENCE = outputs(request([10, 11, 12, 13], expected=[10, 11, 12, 13]),
                    request([20, 21, 22], expected=[20, 21, 22]),
                    request([30, 31], expected=None))


# -- the comparison ------------------------------------------------------------------------------------------------

def test_identical_outputs() -> None:
    c = compare(REFERENCE, REFERENCE)
    assert (c.tokens_equal, c.tokens_compared, c.tokens_equal_fraction) == (9, 9, 1.0)
    assert c.identical and c.close and c.first_divergence is None and c.requests_identical == 3
    assert (c.reference_accuracy, c.candidate_accuracy, c.judged_requests) == (1.0, 1.0, 2)
    assert json.loads(json.dumps(c.to_json()))["tokens_equal_fraction"] == 1.0


def test_a_divergence_is_found_at_its_first_position_and_tokens_after_it_still_count() -> None:
    cand = outputs(REFERENCE.requests[0],
                   request([20, 99, 22], [{20: -0.1}, {99: -0.5, 21: -0.9}, {22: -0.1}], expected=[20, 21, 22]),
                   REFERENCE.requests[2])
    ref = outputs(REFERENCE.requests[0],
                  request([20, 21, 22], [{20: -0.1}, {21: -0.2, 99: -2.5}, {22: -0.1}], expected=[20, 21, 22]),
                  REFERENCE.requests[2])
    c = compare(ref, cand)
    assert (c.tokens_equal, c.tokens_compared) == (8, 9)  # position 2 of request 1 is equal again: it counts
    assert c.tokens_equal_fraction == pytest.approx(8 / 9) and not c.identical
    d = c.first_divergence
    assert d is not None and (d.request, d.position, d.reference_token, d.candidate_token) == (1, 1, 21, 99)
    assert d.reference_top == {21: -0.2, 99: -2.5} and d.candidate_top == {99: -0.5, 21: -0.9}
    assert c.close and c.requests_diverged == 1 and c.requests_identical == 2
    text = d.describe(("patched", "unpatched"))
    assert "request 1, position 1: unpatched 21 (logprob -0.2), patched 99 (logprob -0.5)" in text
    assert "unpatched's top-5 {21: -0.2, 99: -2.5} (99 in it)" in text
    assert (c.reference_accuracy, c.candidate_accuracy) == (1.0, 0.5)
    assert c.accuracy_drop == 0.5


def test_outputs_of_different_lengths_count_the_missing_tokens_as_unequal() -> None:
    c = compare(outputs(request([1, 2, 3])), outputs(request([1, 2])))
    assert (c.tokens_equal, c.tokens_compared) == (2, 3)
    d = c.first_divergence
    assert d is not None and (d.position, d.reference_token, d.candidate_token) == (2, 3, None)
    assert d.close  # vLLM's walk stops at the shorter output
    assert "patched ended" in d.describe(("patched", "unpatched"))


def test_topk_closeness_as_vllm_checks_it() -> None:
    """At the first differing token each side's token must be in the other's top-k; after it the request is not
    compared (a later pair far apart does not matter)."""
    ref = outputs(request([5, 6, 7], [{5: -0.1}, {6: -0.3, 8: -0.4, 9: -3.0}, {7: -0.1}]))
    close = outputs(request([5, 8, 70], [{5: -0.1}, {8: -0.3, 6: -0.5}, {70: -0.1}]))
    c = compare(ref, close)
    assert c.close and not c.identical and c.first_not_close is None
    far = outputs(request([5, 9, 7], [{5: -0.1}, {9: -0.2, 8: -0.3}, {7: -0.1}]))  # 6 is not in far's top-k
    c = compare(ref, far)
    assert not c.close and c.requests_not_close == 1
    assert c.first_not_close is not None and c.first_not_close.position == 1
    held, why = Expectation("close").judge(c, ("patched", "unpatched"))
    assert not held and "unpatched's 6 is not in patched's top-5" in why and "patched's 9" not in why
    # top_k narrows each side's list: 9 is third in the reference's, so not in its top-2
    wide = outputs(request([5, 9, 7], [{5: -0.1}, {9: -0.2, 6: -0.3}, {7: -0.1}]))
    assert compare(ref, wide, top_k=3).close and not compare(ref, wide, top_k=2).close


def test_a_position_without_logprobs_is_not_close() -> None:
    ref = outputs(request([5, 6], [{5: -0.1}, {}]))
    assert not compare(ref, outputs(request([5, 7]))).close


def test_outputs_of_other_prompts_or_too_few_logprobs_are_refused() -> None:
    with pytest.raises(AnswersError, match="the reference has 3 request"):
        compare(REFERENCE, outputs(request([1])))
    with pytest.raises(AnswersError, match="the prompts differ"):
        compare(REFERENCE, outputs(*REFERENCE.requests, digest="d2"))
    with pytest.raises(AnswersError, match="the candidate recorded 2 logprob"):
        compare(REFERENCE, outputs(*REFERENCE.requests, top_k=2), top_k=5)


def test_accuracy_is_the_recall_tasks_and_its_budget() -> None:
    prompts = recall.prompts(3, [40, 2, 60])
    answers = [recall.expected(p, 6) for p in prompts]
    assert answers[1] is None  # too short to determine its answer
    right = [a or [0] * 6 for a in answers]
    wrong = [right[0], right[1], [4] * 6]
    for outs in (right, wrong):
        o = Outputs([request(t, expected=a) for t, a in zip(outs, answers, strict=True)])
        assert o.accuracy() == recall.accuracy(prompts, outs)
    c = compare(Outputs([request(t, expected=a) for t, a in zip(right, answers, strict=True)]),
                Outputs([request(t, expected=a) for t, a in zip(wrong, answers, strict=True)]))
    assert (c.reference_accuracy, c.candidate_accuracy, c.judged_requests) == (1.0, 0.5, 2)
    held, why = Expectation("accuracy", max_accuracy_drop=0.5).judge(c)
    assert held and "a drop of 0.5000, within the budget of 0.5" in why
    held, why = Expectation("accuracy", max_accuracy_drop=0.2).judge(c, ("patched", "unpatched"))
    assert not held and "patched 0.5000 vs unpatched 1.0000: a drop of 0.5000, beyond the budget of 0.2" in why
    undetermined = outputs(request([1]))
    held, why = Expectation("accuracy", max_accuracy_drop=0.0).judge(compare(undetermined, undetermined))
    assert not held and "no request's answer is determined" in why  # nothing shows the accuracy kept


def test_outputs_round_trip_through_json() -> None:
    data = json.loads(json.dumps(REFERENCE.to_json()))
    assert data["requests"][0]["logprobs"][0] == {"10": -0.1}
    assert Outputs.from_json(data) == REFERENCE
    with pytest.raises(TypeError, match=r"outputs: requests\[0\]: missing field\(s\) token_ids"):
        Outputs.from_json({"requests": [{"logprobs": []}]})
    with pytest.raises(TypeError, match=r"requests\[0\]: malformed outputs"):
        Outputs.from_json({"requests": [{"token_ids": [1.5]}]})
    assert prompts_digest([[1, 2], [3]]) == prompts_digest([[1, 2], [3]]) != prompts_digest([[1, 2], [4]])


# -- engine results ------------------------------------------------------------------------------------------------



def result(outs: Outputs | None = None) -> EngineResult:
    data = dict(FAKE_RESULT)
    if outs is not None:
        data["outputs"] = outs.to_json()
    return EngineResult.from_json(json.loads(json.dumps(data)))


def test_engine_result_round_trip_with_and_without_outputs() -> None:
    plain = result()
    assert plain.outputs is None and "outputs" not in plain.to_json()  # dummy weights: no outputs section at all
    assert EngineResult.from_json(json.loads(json.dumps(plain.to_json()))) == plain
    answering = result(REFERENCE)
    assert answering.outputs == REFERENCE
    data = json.loads(json.dumps(answering.to_json()))
    assert data["outputs"]["requests"][1]["token_ids"] == [20, 21, 22]
    assert EngineResult.from_json(data) == answering
    with pytest.raises(TypeError, match=r"result: outputs: missing field\(s\) requests"):
        EngineResult.from_json({**FAKE_RESULT, "outputs": {}})


def test_requests_of_a_recall_model_are_the_tasks_prompts_with_the_workloads_lengths() -> None:
    from vramgate.engine import EngineSpec
    from vramgate.engine.measure import outputs_of, requests_of
    from vramgate.workloads import build

    spec = EngineSpec(model="tiny-llama", workload="shared-prefix", requests=4, seed=7, max_model_len=512)
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len)
    sampling = lambda **kw: kw  # noqa: E731 - SamplingParams' stand-in: its keyword arguments
    plain_prompts, plain = requests_of(spec, workload, 32000, sampling)
    task_prompts, params = requests_of(spec, workload, 32000, sampling, task=True, logprobs=TOP_K)
    lengths = [r.prompt_len for r in workload.requests]
    assert [len(p["prompt_token_ids"]) for p in plain_prompts] == [len(p["prompt_token_ids"]) for p in task_prompts] \
        == lengths
    assert [p["prompt_token_ids"] for p in task_prompts] == recall.prompts(
        7, lengths, [r.prefix_len for r in workload.requests])
    assert "logprobs" not in plain[0] and params[0]["logprobs"] == TOP_K
    assert [{k: v for k, v in p.items() if k != "logprobs"} for p in params] == plain
    # vLLM's outputs (stand-ins): token ids, per position {token: Logprob}
    fake = [SimpleNamespace(outputs=[SimpleNamespace(
        token_ids=recall.expected(p["prompt_token_ids"], 3),
        logprobs=[{t: SimpleNamespace(logprob=-0.25), 9: SimpleNamespace(logprob=-3.0)}
                  for t in recall.expected(p["prompt_token_ids"], 3) or []])]) for p in task_prompts]
    outs = outputs_of(task_prompts, fake, TOP_K)
    assert outs.accuracy() == (1.0, 4) and outs.task == "recall" and outs.top_k == TOP_K
    assert outs.requests[0].logprobs[0][9] == -3.0
    assert outs.prompts_sha256 == prompts_digest([p["prompt_token_ids"] for p in task_prompts])


def test_only_a_recall_model_loaded_with_its_weights_answers(tmp_path: Path) -> None:
    from vramgate.engine.worker import answers_wanted

    assert not answers_wanted({"model": str(tmp_path), "load_format": "safetensors"})  # no recall.json
    (tmp_path / recall.MODEL_FILE).write_text(json.dumps({
        "task": "recall", "weights": "model.safetensors", "sha256": "0" * 64, "command": "x", "seed": 1,
        "accuracy": 1.0}))
    assert answers_wanted({"model": str(tmp_path), "load_format": "safetensors"})
    assert answers_wanted({"model": str(tmp_path)})  # vLLM's default load format reads the weights
    assert not answers_wanted({"model": str(tmp_path), "load_format": "dummy"})


# -- the manifest --------------------------------------------------------------------------------------------------

def test_each_profiles_default_expectation() -> None:
    expect = {name: load_profile(ROOT / "patches" / name).outputs for name in
              ("block-manager-watermark", "block-manager-min-recompute", "stream-priority-copies", "kv-fp8",
               "attention-flashmla", "quant-awq")}
    assert {n: e.expect for n, e in expect.items()} == {
        "block-manager-watermark": "identical", "block-manager-min-recompute": "identical",
        "stream-priority-copies": "identical", "kv-fp8": "close", "attention-flashmla": "close",
        "quant-awq": "accuracy"}
    assert expect["kv-fp8"].origin == 'default for kv_cache_dtype = "fp8"' and expect["kv-fp8"].top_k == TOP_K
    assert expect["quant-awq"].max_accuracy_drop == DEFAULT_MAX_ACCURACY_DROP
    assert default_expectation(("tp_overlap", "cuda_graphs"), {}, None).origin == \
        "default for suite(s) tp_overlap, cuda_graphs"
    assert default_expectation(("latency",), {"kv_cache_dtype": "auto"}, None).expect == "identical"
    assert default_expectation(("latency",), {"quantization": "awq", "kv_cache_dtype": "fp8"}, None).expect == \
        "accuracy"  # the loosest that applies


MANIFEST = """name = "p"
description = "test profile"
suites = ["latency"]

[target]
distribution = "vllm"
version = "==0.32.0"

[engine_args]
watermark = 0.05
"""


def profile_with(tmp_path: Path, table: str) -> Path:
    d = tmp_path / "p"
    d.mkdir(exist_ok=True)
    (d / "manifest.toml").write_text(MANIFEST + "\n[outputs]\n" + table)
    return d


@pytest.mark.parametrize(("table", "want"), [
    ('expect = "identical"\n', Expectation("identical", origin="[outputs] in the manifest")),
    ('expect = "close"\ntop_k = 3\n', Expectation("close", top_k=3, origin="[outputs] in the manifest")),
    ('expect = "accuracy"\nmax_accuracy_drop = 0.02\n',
     Expectation("accuracy", max_accuracy_drop=0.02, origin="[outputs] in the manifest")),
    ('expect = "accuracy"\n', Expectation("accuracy", origin="[outputs] in the manifest")),
])
def test_the_outputs_table(tmp_path: Path, table: str, want: Expectation) -> None:
    assert load_profile(profile_with(tmp_path, table)).outputs == want


@pytest.mark.parametrize(("table", "message"), [
    ('expect = "same"\n', "[outputs]: expect 'same' is not one of identical, close, accuracy"),
    ("top_k = 3\n", "[outputs]: missing field 'expect'"),
    ('expect = "close"\ntopk = 3\n', "[outputs]: unknown field(s) topk; accepted: expect, max_accuracy_drop, top_k"),
    ('expect = "identical"\ntop_k = 3\n', """[outputs]: field 'top_k' applies to expect = "close" only"""),
    ('expect = "close"\nmax_accuracy_drop = 0.1\n',
     """[outputs]: field 'max_accuracy_drop' applies to expect = "accuracy" only, not "close\""""),
    ('expect = "close"\ntop_k = 6\n', "[outputs]: top_k must be an integer from 1 to 5"),
    ('expect = "close"\ntop_k = 2.0\n', "[outputs]: field 'top_k' must be int, got float"),
    ('expect = "accuracy"\nmax_accuracy_drop = 1.5\n', "[outputs]: max_accuracy_drop must be a fraction from 0 to 1"),
    ('expect = "accuracy"\nmax_accuracy_drop = "2%"\n', "[outputs]: field 'max_accuracy_drop' must be int or float"),
])
def test_a_bad_outputs_table_names_the_file_and_field(tmp_path: Path, table: str, message: str) -> None:
    d = profile_with(tmp_path, table)
    with pytest.raises(ProfileError) as info:
        load_profile(d)
    assert str(d / "manifest.toml") in str(info.value) and message in str(info.value)


# -- judging in a test ---------------------------------------------------------------------------------------------

KV_FP8 = ROOT / "patches" / "kv-fp8"
WATERMARK = ROOT / "patches" / "block-manager-watermark"


def test_dummy_weights_are_not_judged() -> None:
    gate = Gate("t::x", "latency")
    profile = load_profile(WATERMARK)
    assert check_answers(gate, profile, result(), result(REFERENCE), context="tiny-llama") is None
    (claim,) = gate.claims
    assert not claim.judged and not claim.held and claim.verdict == "not judged" and not gate.metrics
    assert claim.evidence == ("outputs not judged: dummy weights (the patched run recorded no outputs) on "
                              "tiny-llama")
    assert claim.statement == "block-manager-watermark: outputs identical to the unpatched run's"
    assert claim.source == "patches/block-manager-watermark/manifest.toml"
    check_answers(gate, profile, result(), result())
    assert "the patched and the unpatched runs recorded no outputs" in gate.claims[1].evidence


def test_identical_outputs_hold_and_record_their_figures() -> None:
    gate = Gate("t::x", "latency")
    c = check_answers(gate, load_profile(WATERMARK), result(REFERENCE), result(REFERENCE), metric_prefix="a_")
    assert c is not None and c.identical
    assert {n: m.value for n, m in gate.metrics.items()} == {
        "a_tokens_equal_fraction": 1.0, "a_task_accuracy": 1.0, "a_reference_task_accuracy": 1.0}
    assert all(not m.history and m.better == "higher" and m.unit == "ratio" for m in gate.metrics.values())
    (claim,) = gate.claims
    assert claim.held and claim.judged and "identical tokens: tokens equal: 9 of 9 (100.00%)" in claim.evidence


DIVERGED = outputs(request([10, 11, 12, 13], expected=[10, 11, 12, 13]),
                   request([20, 77, 22], [{20: -0.1}, {77: -0.7, 21: -0.8}, {22: -0.1}], expected=[20, 21, 22]),
                   request([30, 31]))
DIVERGED_REFERENCE = outputs(REFERENCE.requests[0],
                             request([20, 21, 22], [{20: -0.1}, {21: -0.01, 77: -4.7}, {22: -0.1}],
                                     expected=[20, 21, 22]),
                             REFERENCE.requests[2])


def test_an_expectation_not_met_fails_with_the_divergence_the_accuracy_and_how_to_accept_it() -> None:
    gate = Gate("t::x", "latency")
    with pytest.raises(pytest.fail.Exception) as info:
        check_answers(gate, load_profile(WATERMARK), result(DIVERGED), result(DIVERGED_REFERENCE),
                      context="recall-llama")
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == ('vramgate: outputs of block-manager-watermark fail [outputs] expect = "identical" against the '
                        "unpatched run (recall-llama)")
    assert lines[1] == ("- check: identical tokens: tokens equal: 8 of 9 (88.89%); requests identical: 2 of 3; "
                        "logprobs where the tokens agree: largest difference 0, bound 0.5")
    assert lines[2].startswith("- first divergence: request 1, position 1: unpatched 21 (logprob -0.01), patched 77 "
                               "(logprob -0.7)")
    assert "- task accuracy: patched 0.5000, unpatched 1.0000 (exact match over 2 request(s)" in message
    assert 'Expectation: expect = "identical" (default for suite(s) block_manager, latency), ' \
           "patches/block-manager-watermark/manifest.toml" in message
    assert 'patches/block-manager-watermark/manifest.toml: [outputs] expect = "close" (top_k = 5' in message
    (claim,) = gate.claims
    assert not claim.held and claim.judged
    assert gate.metrics["task_accuracy"].value == 0.5 and gate.metrics["reference_task_accuracy"].value == 1.0


def test_close_outputs_meet_a_close_expectation() -> None:
    gate = Gate("t::x", "latency")
    c = check_answers(gate, load_profile(KV_FP8), result(DIVERGED), result(DIVERGED_REFERENCE))
    assert c is not None and c.close and not c.identical and gate.claims[0].held
    assert gate.claims[0].statement == ("kv-fp8: outputs close to the unpatched run's (top-5 logprobs at the first "
                                        "divergence)")


def test_accuracy_beyond_the_budget_proposes_the_drop_it_lost(tmp_path: Path) -> None:
    profile = load_profile(profile_with(tmp_path, 'expect = "accuracy"\nmax_accuracy_drop = 0.25\n'))
    with pytest.raises(pytest.fail.Exception) as info:
        check_answers(Gate("t::x", "latency"), profile, result(DIVERGED), result(DIVERGED_REFERENCE))
    assert "a drop of 0.5000, beyond the budget of 0.25" in str(info.value)
    assert '[outputs] expect = "accuracy", max_accuracy_drop = 0.50' in str(info.value)


def test_outputs_of_other_prompts_fail_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match="cannot be compared with the unpatched run's: the prompts differ"):
        check_answers(Gate("t::x", "latency"), load_profile(WATERMARK), result(outputs(*REFERENCE.requests,
                                                                                       digest="d2")),
                      result(REFERENCE))


# -- the report ----------------------------------------------------------------------------------------------------

SUITE_TEST = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_answers import result, REFERENCE, DIVERGED, DIVERGED_REFERENCE
from vramgate.profiles import load_profile
from vramgate.testing.answers import check_answers

WATERMARK = load_profile(Path({str(WATERMARK)!r}))

def test_dummy(gate):
    gate.record("page_bytes", 4096, unit="B")
    check_answers(gate, WATERMARK, result(), result(), context="tiny-llama")

def test_same(gate):
    check_answers(gate, WATERMARK, result(REFERENCE), result(REFERENCE))

def test_diverged(gate):
    check_answers(gate, WATERMARK, result(DIVERGED), result(DIVERGED_REFERENCE), context="recall-llama")
"""


def test_the_verdicts_are_rows_of_the_report_and_a_failure_reads_like_the_gate(pytester: pytest.Pytester) -> None:
    from vramgate.report import html_page

    pytester.makepyfile(test_suite=SUITE_TEST)
    result_ = pytester.runpytest(*HW, "--gate-missing=skip", "--gate-report", "out")
    result_.assert_outcomes(passed=2, failed=1)
    out = result_.stdout.str()
    assert 'vramgate: outputs of block-manager-watermark fail [outputs] expect = "identical"' in out
    assert "claim NOT JUDGED: block-manager-watermark: outputs identical to the unpatched run's" in out
    md = (pytester.path / "out" / "report.md").read_text()
    assert ("| ⚪ not judged | block-manager-watermark: outputs identical to the unpatched run's | outputs not "
            "judged: dummy weights (the patched and the unpatched runs recorded no outputs) on tiny-llama | "
            "`test_suite.py::test_dummy` |") in md
    assert "| ✅ held | block-manager-watermark: outputs identical to the unpatched run's | identical tokens" in md
    assert "| ❌ not held | block-manager-watermark: outputs identical" in md
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    claims = {c["test"].split("::")[1]: c for c in data["claims"]}
    assert claims["test_dummy"]["judged"] is False and "judged" not in claims["test_same"]
    page = html_page(data)
    assert "1 not held, 1 held, 1 not judged" in page and '<span class="note">not judged</span>' in page


def shifted(out: Outputs, by: float, request_index: int = 1, position: int = 2) -> Outputs:
    """*out* with one position's logprobs moved by *by* (its tokens unchanged)."""
    requests = list(out.requests)
    r = requests[request_index]
    logprobs = [dict(p) for p in r.logprobs]
    logprobs[position] = {t: lp + by for t, lp in logprobs[position].items()}
    requests[request_index] = RequestOutput(r.token_ids, logprobs, r.expected)
    return Outputs(requests, out.top_k, out.prompts_sha256, out.task)


def test_identical_holds_the_logprobs_where_the_tokens_agree_and_says_where_they_moved() -> None:
    """Note [identical logprobs]: the same tokens with a logprob moved by one unit fail ``identical`` (and the
    message names request, position, token and both values, and offers ``close``); a move within the bound holds."""
    from vramgate.core.answers import IDENTICAL_LOGPROB_BOUND, compare

    moved = shifted(REFERENCE, -1.0)
    c = compare(REFERENCE, moved)
    assert c.identical and c.max_logprob_delta == pytest.approx(1.0)
    d = c.largest_logprob_delta
    assert d is not None and (d.request, d.position) == (1, 2)
    held, why = load_profile(WATERMARK).outputs.judge(c, ("patched", "unpatched"))
    assert not held and "largest difference 1, bound 0.5, beyond it at request 1, position 2, token" in why
    gate = Gate("t::x", "latency")
    with pytest.raises(pytest.fail.Exception) as info:
        check_answers(gate, load_profile(WATERMARK), result(moved), result(REFERENCE), context="recall-llama")
    assert 'expect = "close" (top_k = 5: the tokens agree, and their logprobs move by 1' in str(info.value)
    small = compare(REFERENCE, shifted(REFERENCE, IDENTICAL_LOGPROB_BOUND * 0.9))
    assert load_profile(WATERMARK).outputs.judge(small)[0]
    assert compare(REFERENCE, REFERENCE).to_json()["max_logprob_delta"] == 0.0


def test_runs_that_must_compute_the_same_pass_or_say_what_changed_answers() -> None:
    """An upgrade or another tensor parallelism is held ``identical``: the same outputs hold (a row, figures), moved
    logprobs fail naming what changed answers and where, and a side on dummy weights is not judged."""
    from vramgate.testing.answers import check_same_answers

    gate = Gate("t::x", "tp_overlap")
    c = check_same_answers(gate, result(REFERENCE), result(REFERENCE), what="tensor parallelism 2",
                           labels=("TP=2", "TP=1"), context="recall-llama")
    assert c is not None and gate.claims[0].held and gate.metrics["max_logprob_delta"].value == 0.0
    assert gate.claims[0].statement == "tensor parallelism 2: outputs identical to the TP=1's"
    with pytest.raises(pytest.fail.Exception) as info:
        check_same_answers(Gate("t::y", "latency"), result(shifted(REFERENCE, -1.0)), result(REFERENCE),
                           what="this upgrade", labels=("new vLLM", "old vLLM"), accept="review it")
    lines = str(info.value).splitlines()
    assert lines[0] == "vramgate: this upgrade changes answers" and lines[-1] == "review it"
    assert "beyond it at request 1, position 2" in lines[1] and "none (every token equal)" in lines[2]
    blind = Gate("t::z", "latency")
    assert check_same_answers(blind, result(), result(REFERENCE), what="this upgrade",
                              labels=("new vLLM", "old vLLM")) is None
    assert not blind.claims[0].judged and "the new vLLM run recorded no outputs" in blind.claims[0].evidence
