"""The precision campaign's pure parts and the paired engines' failure path (no vLLM needed)."""

from __future__ import annotations

import math
import os
import random
import signal
from pathlib import Path

import pytest

from vramgate.engine import EngineError, EngineSpec
from vramgate.engine.paired import EngineServer, Round, paired_defaults, round_ratios, round_stat
from vramgate.tools.calibration.engine_latency import (
    PLANTED_EXACT,
    PLANTS,
    Rate,
    Trial,
    analyze,
    compare_exact,
    make_trials,
    render,
    run_exact,
    sweep,
)

ROOT = Path(__file__).resolve().parents[1]


def _trials(condition: str, pairs: int, per_pair: int, shift: float, cv: float, seed: int) -> list[Trial]:
    rng = random.Random(seed)
    out = []
    for pair in range(pairs):
        offset = rng.gauss(0, cv / 2)  # a per-process offset: what makes history comparisons harder
        for _ in range(per_pair):
            a = [rng.lognormvariate(0, cv) for _ in range(10)]
            b = [x * (1 + shift) * (1 + offset) * rng.lognormvariate(0, cv) for x in a]
            out.append(Trial(condition, pair, a, b))
    return out


def test_rate_bounds() -> None:
    zero = Rate(0, 300)
    assert zero.rate == 0 and zero.bounds()[0] == 0 and 0.005 < zero.bounds()[1] < 0.02
    half = Rate(50, 100)
    lo, hi = half.bounds()
    assert lo < 0.5 < hi and hi - lo < 0.21
    assert "0/300" in zero.show()


def test_analyze_separates_a_planted_shift_from_noise() -> None:
    trials = (_trials("unchanged", 4, 5, 0.0, 0.02, 1) + _trials("delay-5%", 4, 5, 0.05, 0.02, 2)
              + _trials("delay-10%", 4, 5, 0.10, 0.02, 3))
    fig = analyze(trials, tolerance=0.05, alpha=0.01)
    # Every unchanged trial against every unchanged trial of another pair: 20 * 15.
    assert fig.history_false_alarms.trials == 20 * 15
    assert fig.history_false_alarms.rate <= 0.01
    assert fig.history_detection["delay-10%"].trials == 20 * 20
    assert fig.history_detection["delay-10%"].rate >= 0.95
    assert fig.ab_detection["delay-10%"].rate >= 0.95 and fig.ab_false_alarms.hits == 0
    assert fig.meets()


def test_analyze_reports_a_machine_too_noisy_for_the_tolerance() -> None:
    trials = _trials("unchanged", 4, 5, 0.0, 0.15, 4) + _trials("delay-10%", 4, 5, 0.10, 0.15, 5)
    figures = sweep(trials, tolerances=(0.02,), alphas=(0.05,))
    assert len(figures) == 1
    assert not figures[0].meets()  # 15% noise: a 10% shift is not reliably seen at 2% tolerance


def test_make_trials_cuts_rounds_per_pair() -> None:
    raw = {"unchanged": [{"a_tpot": [1.0] * 25, "b_tpot": [1.1] * 25}, {"a_tpot": [2.0] * 10, "b_tpot": [2.0] * 10}]}
    trials = make_trials(raw, "tpot", 10)
    assert [(t.pair, len(t.a)) for t in trials] == [(0, 10), (0, 10), (1, 10)]  # 5 leftover rounds dropped
    assert trials[0].ratios == pytest.approx([1.1] * 10)


def _result(**changes: float) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {
        "kv": {"capacity_tokens": 8192, "num_gpu_blocks": 257, "page_bytes": 32768},
        "memory": {"kv_tensor_bytes": 2**23, "weights_bytes": 1_000_000},
        "scheduler": {"peak_blocks_in_use": 96, "preemptions": 0, "recomputed_tokens": 0, "steps": 70},
    }
    for key, value in changes.items():
        for section in out.values():
            if key in section:
                section[key] = value
    return out


def test_compare_exact_catches_planted_regressions_and_nothing_else() -> None:
    assert compare_exact(_result(), _result()) == []
    assert compare_exact(_result(), _result(peak_blocks_in_use=112)) == ["peak_blocks_in_use"]
    assert compare_exact(_result(), _result(weights_bytes=1_010_000)) == ["weights_bytes"]
    assert compare_exact(_result(), _result(capacity_tokens=8191)) == ["capacity_tokens"]
    assert compare_exact(_result(), _result(capacity_tokens=8193)) == []  # better is not a regression


def test_the_calibrations_plants_apply_to_the_pinned_vllm() -> None:
    """The campaign's plants ship with the gate, outside every project's ``patches/`` (no suite judges them, so no
    suite checks that they apply): each applies as it stands to the pinned vLLM's source (``tox -e unit`` fetches
    it and names it in ``VRAMGATE_REHEARSAL_VLLM``)."""
    from vramgate.profiles import check_applicability, load_profile

    given = os.environ.get("VRAMGATE_REHEARSAL_VLLM")
    if not given:
        pytest.skip("VRAMGATE_REHEARSAL_VLLM names no vLLM source (tox -e unit sets it)")
    plants = sorted(c["plant"] for c, _ in PLANTED_EXACT.values() if "plant" in c)
    assert plants == ["calibrate-extra-kv-block"]
    for name in plants:
        profile = load_profile(PLANTS / name)
        result = check_applicability(profile, Path(given), "0.32.0")
        assert (result.status, result.in_target, result.conflicts) == ("applies", True, ()), result.summary()


def test_run_exact_counts_false_alarms_and_detections() -> None:
    calls = []

    def run(label: str, changes: dict[str, object]) -> dict[str, dict[str, float | None]]:
        calls.append(label)
        if changes.get("plant") == "calibrate-extra-kv-block":
            return _result(peak_blocks_in_use=112)
        if changes.get("env"):
            return _result(weights_bytes=1_010_000)
        return _result()

    figures = run_exact(run, reruns=2)
    data = figures.to_json()
    assert calls[:3] == ["unchanged-0", "unchanged-1", "unchanged-2"] and len(calls) == 3 + len(PLANTED_EXACT)
    assert data["false_alarms"] == [] and data["comparisons"] == 2 * 9
    assert all(p["detected"] for p in data["planted"].values())
    text = render({"campaign": {"model": "m", "pairs": 1, "rounds": 1, "trial_rounds": 1}, "seconds": 1.0,
                   "exact": data, "figures": {}})
    assert "detected" in text and "MISSED" not in text


def test_round_ratios_and_stats() -> None:
    assert round_ratios([1.0, 2.0], [1.1, 1.0]) == pytest.approx([1.1, 0.5])
    with pytest.raises(ValueError, match="differ in number"):
        round_ratios([1.0], [1.0, 2.0])
    r = Round(ttft_s=[0.1, 0.3], tpot_s=[0.01, 0.02, 0.03], e2e_s=[1.0], steps_s=[0.005], wall_s=2.0)
    assert round_stat(r, "tpot") == 0.02 and round_stat(r, "wall") == 2.0
    with pytest.raises(ValueError, match="unknown round statistic"):
        round_stat(r, "p99")
    with pytest.raises(ValueError, match="unknown engine tier"):
        paired_defaults("tpu")


def test_the_step_floor_sums_each_steps_shortest_duration_per_group_of_rounds() -> None:
    # Note [step floor]: a step slowed in one round (a stall of 4x) does not move its group's value; the work does
    from vramgate.tools.calibration.gate_paired import FLOOR_GROUP, floor_sums

    clean = [[0.010, 0.004, 0.004]] * FLOOR_GROUP
    stalled = [[0.010, 0.016, 0.004], *clean[1:]]
    slower = [[x * 1.1 for x in s] for s in stalled]
    ref, cand = floor_sums(stalled + clean), floor_sums(slower + clean)
    assert ref == pytest.approx([0.018, 0.018]) and cand == pytest.approx([0.0198, 0.018])
    assert round_ratios(ref, cand) == pytest.approx([1.1, 1.0])
    # a step only some rounds have counts with those; groups must be whole
    assert floor_sums([[1.0, 2.0], [3.0]], 2) == [3.0]
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        floor_sums(clean[:3])
    with pytest.raises(ValueError, match="has no samples"):
        floor_sums([[1.0], []], 2)


def _descendants() -> set[int]:
    from vramgate.machine.probes.cpu import children

    return set(children(os.getpid()))


def test_engine_server_that_dies_at_start_fails_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    spec = EngineSpec(model="tiny-llama", env={"VRAMGATE_PLANT_DELAY": "not-a-number"}, timeout_s=120)
    before = _descendants()
    server = EngineServer(spec, ROOT, tmp_path / "server")
    with pytest.raises(EngineError, match=r"exited with status 1 before writing ready\.json") as info:
        server.ready()
    assert info.value.log_tail.strip(), "the error must carry the server's log tail"
    assert _descendants() - before == set()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)  # the process group is gone


def test_record_paired_fails_a_candidate_slower_than_its_reference_in_the_same_run() -> None:
    from vramgate.core.checks import check_budget
    from vramgate.pytest_plugin.fixture import Gate

    rng = random.Random(7)
    reference = [rng.lognormvariate(0, 0.02) for _ in range(10)]
    gate = Gate("t::x", "latency")
    same = gate.record_paired("same", reference, [x * rng.lognormvariate(0, 0.01) for x in reference], tolerance=0.05)
    slow = gate.record_paired("slow", reference, [x * 1.12 for x in reference], tolerance=0.05,
                              history_tolerance=0.1)
    assert check_budget(same) is None
    message = check_budget(slow)
    assert message is not None and "worse than its reference" in message and "+12" in message
    assert slow.value == pytest.approx(1.12) and slow.tolerance == 0.1 and slow.kind == "measured"
    assert "paired" not in slow.to_json()  # baselines keep the ratios, not both sides
    with pytest.raises(ValueError, match="2 pairs"):
        gate.record_paired("bad", [1.0], [1.0], tolerance=0.05)


def test_kernel_campaign_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import json

    from vramgate.tools.calibration.kernel_latency import main

    assert main([str(tmp_path), "--device", "cpu", "--processes", "2", "--calls", "40", "--trial-samples", "20"]) == 0
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert set(data["raw"]) == {"unchanged", "delay-5%", "delay-10%"}
    assert all(len(p["a_latency"]) == 40 for pairs in data["raw"].values() for p in pairs)
    (rows,) = data["figures"].values()
    assert rows and all(r["history_false_alarms"]["trials"] == 2 * 2 for r in rows)  # 2 trials x 1 other pair each
    assert "| tolerance |" in (tmp_path / "calibration.md").read_text()


def test_merge_campaigns_pools_pairs_and_refuses_mismatches() -> None:
    from vramgate.tools.calibration.engine_latency import merge_campaigns

    def campaign(pairs: int, spec: str = "s") -> dict[str, object]:
        raw = {"unchanged": [{"a_tpot": [1.0], "b_tpot": [1.0]}] * pairs}
        return {"spec": spec, "campaign": {"pairs": pairs, "rounds": 10, "stats": ["tpot"]}, "raw": raw,
                "seconds": 5.0}

    merged = merge_campaigns([campaign(2), campaign(3)])
    assert len(merged["raw"]["unchanged"]) == 5 and merged["campaign"]["pairs"] == 5 and merged["seconds"] == 10
    with pytest.raises(ValueError, match="cannot be pooled"):
        merge_campaigns([campaign(1), campaign(1, spec="other")])


def test_exact_bounds_of_a_rate() -> None:
    from vramgate.tools.calibration.gate_paired import lower_bound, show_rate, upper_bound

    assert upper_bound(0, 300) == pytest.approx(1 - 0.05 ** (1 / 300), rel=1e-6)  # the rule of three: about 1%
    assert upper_bound(0, 300) < 0.01 < upper_bound(0, 298)
    assert lower_bound(20, 20) == pytest.approx(0.05 ** (1 / 20), rel=1e-6)
    assert 0.0 < lower_bound(3, 10) < 0.3 < upper_bound(3, 10) < 1.0
    assert upper_bound(5, 5) == 1.0 and lower_bound(0, 5) == 0.0
    assert show_rate(0, 300) == "0/300 (0.0%; 95% upper bound 1.0%)"


def test_the_per_gate_run_analysis_applies_the_gates_rules_and_its_second_look() -> None:
    """Unchanged trials stay green after the second look, a planted +15% is caught, a noisy first look is only
    untrusted when the pooled rounds are too; a trial that fails alone is cleared by the pooled rounds."""
    from vramgate.tools.calibration.gate_paired import Rules, TrialData, analyze, render

    rng = random.Random(11)

    def trial(profile: str, condition: str, index: int, shift: float, sigma: float = 0.02) -> TrialData:
        ref = [0.01 * rng.lognormvariate(0, sigma) for _ in range(30)]
        cand = [0.01 * (1 + shift) * rng.lognormvariate(0, sigma) for _ in range(30)]
        return TrialData(profile, condition, index, ref, cand, True)

    trials = [trial("p", "unchanged", i, 0.0) for i in range(6)]
    trials += [trial("p", "delay-10%", 10 + i, 0.15) for i in range(6)]
    trials.append(trial("p", "unchanged", 20, 0.09))  # one unchanged trial whose engine was slow all its life
    result = analyze(trials, rules=Rules(0.075, 0.05, 0.10))
    unchanged, delayed = result["profiles"]["p"]["unchanged"], result["profiles"]["p"]["delay-10%"]
    assert unchanged["trials"] == 7 and unchanged["first_look_fails"] == 1
    assert unchanged["first_look_by_check"] == {"in-run": 1, "noise": 0, "history": 0}
    assert unchanged["fails"] < 0.5  # pooled with any other unchanged trial, the slow one is cleared
    assert delayed["first_look_fails"] == 6 and delayed["fails"] == pytest.approx(6.0)
    assert result["gate_runs"] == 7 and result["gate_runs_first_look_failed"] == 1
    assert result["gate_run_false_alarm_estimate"] == pytest.approx(unchanged["fails"] / 7)
    # Against a stored baseline of ratio 0.9 the unchanged trials fail history, and the second look agrees.
    stored = analyze(trials, {"p": [0.9 * rng.lognormvariate(0, 0.01) for _ in range(30)]}, Rules(0.075, 0.05, 0.10))
    assert stored["profiles"]["p"]["unchanged"]["first_look_by_check"]["history"] == 7
    text = render(result)
    assert "| p | unchanged | 7 |" in text and "first looks failed in 1/7" in text
    # Noise too high for the tolerance: every look is untrusted, and so is the verdict.
    noisy = analyze([trial("q", "unchanged", i, 0.0, sigma=0.6) for i in range(4)], rules=Rules(0.075, 0.05, 0.1))
    assert noisy["profiles"]["q"]["unchanged"]["first_look_by_check"]["noise"] == 4
    assert noisy["profiles"]["q"]["unchanged"]["fails"] == pytest.approx(4.0)


def test_the_campaigns_own_unchanged_trials_serve_as_recorded_baselines() -> None:
    """Without stored baselines, ``own_history`` takes each other unchanged trial of the profile as the baseline in
    turn (a baseline recorded on this machine is one engine pair's unchanged look): a change of +15% fails history
    against every one of them, and one unchanged engine pair that ran 12% fast its whole life, as the baseline, makes
    the others' first looks fail history, which their second looks (fresh engines, against the same baseline) do too."""
    from vramgate.tools.calibration.gate_paired import Rules, TrialData, analyze

    rng = random.Random(5)

    def trial(condition: str, index: int, ratio: float) -> TrialData:
        ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
        return TrialData("p", condition, index, ref, [r * ratio * rng.lognormvariate(0, 0.01) for r in ref], True)

    rules = Rules(0.5, 0.05, 0.10)  # an in-run tolerance no trial reaches: history alone decides
    plain = [trial("unchanged", i, 1.0) for i in range(5)] + [trial("delay-10%", 10 + i, 1.15) for i in range(4)]
    result = analyze(plain, rules=rules, own_history=True)
    assert result["own_history"] == ["p"]
    unchanged, delayed = result["profiles"]["p"]["unchanged"], result["profiles"]["p"]["delay-10%"]
    assert unchanged["first_look_fails"] == 0 and unchanged["fails"] == 0
    assert delayed["first_look_by_check"]["history"] == pytest.approx(4.0) and delayed["fails"] == pytest.approx(4.0)
    assert analyze(plain, rules=rules)["profiles"]["p"]["delay-10%"]["fails"] == 0  # no baselines: in-run only
    with_fast = [*plain, trial("unchanged", 9, 0.88)]
    fast = analyze(with_fast, rules=rules, own_history=True, baseline_pairs=1)["profiles"]["p"]["unchanged"]
    # each of the 5 plain trials fails against the fast one (1 of its 5 baselines); the fast one, 12% faster than
    # every other, is never worse (history is one-sided)
    assert fast["first_look_by_check"]["history"] == pytest.approx(5 * (1 / 5))
    assert 0 < fast["fails"] <= fast["first_look_fails"]
    # Note [baselines of two engine pairs]: pooled with another engine pair, the fast one moves no baseline by 10%
    pooled = analyze(with_fast, rules=rules, own_history=True)["profiles"]["p"]["unchanged"]
    assert pooled["baseline_pairs"] == 2 and pooled["first_look_fails"] == 0 and pooled["fails"] == 0


def test_the_noise_model_fits_the_trials_and_predicts_the_rules_outcomes() -> None:
    from vramgate.tools.calibration.gate_paired import NoiseModel, Rules, TrialData, simulate

    rng = random.Random(3)
    trials = [TrialData("p", "unchanged", i, [0.01 * rng.lognormvariate(0, 0.03) for _ in range(30)],
                        [0.0102 * rng.lognormvariate(0, 0.03) for _ in range(30)], True) for i in range(8)]
    model = NoiseModel.fit(trials)
    assert model.effect == pytest.approx(0.02, abs=0.02) and model.between < 0.03
    assert all(0.005 < s < 0.08 for s in model.spreads) and len(model.spreads) == 8
    rules = Rules(0.075, 0.05, 0.10)
    assert simulate(model, rules, runs=200) < 0.02
    assert simulate(model, rules, runs=100, shift=0.2) > 0.95
    noisy = NoiseModel(0.0, 0.0, (0.6,))
    assert simulate(noisy, rules, runs=50, history=False) > 0.95  # untrusted, every time
    # a look has as many pairs as the trials had (6 step floors of 5 rounds): fewer pairs, less power
    assert model.samples == 30 and NoiseModel.fit([TrialData("p", "unchanged", i, t.ref[:6], t.cand[:6], True)
                                                   for i, t in enumerate(trials)]).samples == 6
    spread = NoiseModel(0.0, 0.0, (0.08,))
    assert simulate(spread, rules, runs=300, shift=0.1, history=False) > simulate(
        NoiseModel(0.0, 0.0, (0.08,), samples=6), rules, runs=300, shift=0.1, history=False) + 0.1


def test_an_ab_campaign_of_both_ways_is_analyzed_one_way_at_a_time(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``run --both-ways`` labels each trial with the way its rounds ran; ``analyze --together yes|no`` reads one way
    only (a trial that does not say is in neither), and says which it read."""
    import json

    from vramgate.tools.calibration.gate_paired import TrialData, load_trials, main

    rng = random.Random(7)
    lines = []
    for i in range(8):
        together = [True, False, None][i % 3]
        slow = 1.2 if together is False else 1.0  # the one-after-the-other trials carry a +20% candidate
        ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
        line = {"profile": "p", "condition": "unchanged", "index": i, "ref": ref,
                "cand": [r * slow * rng.lognormvariate(0, 0.02) for r in ref], "stat": "step"}
        if together is not None:
            line["together"] = together
        lines.append(json.dumps(line))
    (tmp_path / "trials.jsonl").write_text("\n".join(lines) + "\n")
    assert [t.together for t in load_trials([tmp_path])][:3] == [True, False, None]
    assert TrialData.from_json(json.loads(lines[2])).together is None
    assert main(["analyze", str(tmp_path), "--together", "yes"]) == 0
    text = capsys.readouterr().out
    assert "Rounds together." in text and "| p | unchanged | 3 |" in text and "0.00 of 3" in text
    assert main(["analyze", str(tmp_path), "--together", "no"]) == 0
    text = capsys.readouterr().out
    assert "Rounds one after the other." in text and "| p | unchanged | 3 |" in text and "3.00 of 3" in text
    assert main(["analyze", str(tmp_path)]) == 0
    assert "| p | unchanged | 8 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="with rounds together"):
        main(["analyze", str(tmp_path), "--together", "yes", "--stat", "step_floor"])
    # the same campaign through the gate's own command line: vramgate calibrate paired
    from vramgate.tools import cli

    assert cli.main(["calibrate", "--root", str(ROOT), "paired", "analyze", str(tmp_path), "--together",
                     "no"]) == 0
    assert "| p | unchanged | 3 |" in capsys.readouterr().out


def test_a_campaign_taken_both_ways_takes_no_together_setting(tmp_path: Path) -> None:
    from vramgate.tools.calibration.gate_paired import run

    with pytest.raises(ValueError, match="both ways"):
        run(ROOT, tmp_path, 0.01, [], busy=False, rounds=1, together=True, both_ways=True)
    assert not (tmp_path / "trials.jsonl").exists()


def test_the_noise_models_rates_are_bounded_by_refits_to_resampled_trials() -> None:
    """Note [bootstrap bound]: trials whose engine pairs differ widely (one unchanged pair 9% slow) give a higher
    false-alarm bound and a lower detection bound than trials of pairs alike, though the median trial is the same;
    the per-gate-run bound takes every profile's replicate together."""
    from vramgate.tools.calibration.gate_paired import (
        Rules,
        TrialData,
        analyze,
        bootstrap_model,
        percentile,
        render,
    )

    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.95) == 2.0
    with pytest.raises(ValueError):
        percentile([], 0.5)
    rng = random.Random(2)

    def trials(profile: str, offsets: list[float]) -> list[TrialData]:
        out = []
        for i, off in enumerate(offsets):
            ref = [0.01 * rng.lognormvariate(0, 0.03) for _ in range(30)]
            out.append(TrialData(profile, "unchanged", i, ref, [r * (1 + off) * rng.lognormvariate(0, 0.03)
                                                                for r in ref], True))
        return out

    rules = Rules(0.075, 0.05, 0.10)
    alike = trials("a", [0.0, 0.005, -0.005, 0.01, -0.01, 0.0])
    apart = trials("b", [0.0, 0.005, -0.005, 0.09, -0.05, 0.0])
    tight = bootstrap_model(alike, rules, replicates=15, runs=80, history=False)
    wide = bootstrap_model(apart, rules, replicates=15, runs=80, history=False)
    assert tight["replicates"] == 15 and len(tight["false_alarms_replicates"]) == 15
    assert tight["false_alarms_upper"] <= 0.02 < wide["false_alarms_upper"]
    assert wide["detection_lower"] < tight["detection_lower"]  # engine pairs apart hide a +10% more often too
    result = analyze(alike + [TrialData("b", t.condition, t.index + 100, t.ref, t.cand, True) for t in apart],
                     rules=rules, model_runs=80, bootstrap=15)
    fa = [result["models"][p]["false_alarms_replicates"] for p in ("a", "b")]
    assert result["gate_run_false_alarm_model_upper"] == pytest.approx(
        percentile([1 - (1 - x) * (1 - y) for x, y in zip(*fa, strict=True)], 0.95))
    assert "95% upper" in render(result) and "refits to resampled trials" in render(result)
    with pytest.raises(ValueError, match="model_runs"):
        analyze(alike, rules=rules, bootstrap=5)


def test_three_looks_in_the_analysis_pool_each_pair_of_other_trials_with_a_screened_first_look() -> None:
    """Note [three looks] as the analysis applies it: a first look past the screen (and not the tolerance) is
    followed by each pair of other trials, and the pooled rounds of the three decide; one unchanged trial whose
    engine ran slow all its life cannot fail the test, where two looks that both fail would have caught only
    part of a regression the first look saw past the screen."""
    from vramgate.tools.calibration.gate_paired import Rules, TrialData, analyze, further_looks, render

    rng = random.Random(5)

    def trial(condition: str, index: int, shift: float) -> TrialData:
        ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
        return TrialData("p", condition, index, ref, [r * (1 + shift) * rng.lognormvariate(0, 0.02) for r in ref],
                         True)

    unchanged = [trial("unchanged", i, 0.0) for i in range(5)] + [trial("unchanged", 5, 0.16)]  # one slow pair
    planted = [trial("delay-10%", 10 + i, shift) for i, shift in enumerate((0.06, 0.085, 0.09, 0.095, 0.10, 0.11))]
    three, two = Rules(0.075, 0.05, 0.10, 3, 0.05), Rules(0.075, 0.05, 0.10)
    assert three.further == 2 and two.further == 1 and "three looks; first look screened at 5.0%" in three.describe()
    assert len(further_looks(unchanged[1:], three)) == 10 and len(further_looks(unchanged[1:], two)) == 5
    with pytest.raises(ValueError, match="takes 2 further looks"):
        three.confirms(unchanged[0], unchanged[1], base=None)
    # the first look screened at 5%: 1.06 is past the screen, not past the tolerance
    assert three.first_fails(planted[0], None) == ["in-run"] and two.first_fails(planted[0], None) == []
    new, old = analyze(unchanged + planted, rules=three), analyze(unchanged + planted, rules=two)
    for result in (new, old):
        assert result["profiles"]["p"]["unchanged"]["first_look_fails"] == 1  # the slow pair
        assert result["profiles"]["p"]["unchanged"]["fails"] == 0  # ... which the further looks clear
    caught_new, caught_old = (r["profiles"]["p"]["delay-10%"]["fails"] for r in (new, old))
    assert caught_new == 6 and caught_old < 5, (caught_new, caught_old)
    assert new["rules"]["screen"] == 0.05 and "Rule: three looks; first look screened at 5.0%" in render(new)


def test_three_looks_catch_more_of_a_regression_near_the_tolerance_in_the_noise_model() -> None:
    """Where one look catches +10% about 80% of the time (engine pairs 2.5% apart, the tolerance 7.5%), two looks
    that must both fail catch about its square (two thirds); three, the first screened, catch far more (seven
    in eight); an unchanged tree fails neither."""
    from vramgate.tools.calibration.gate_paired import NoiseModel, Rules, simulate

    model = NoiseModel(0.0, 0.025, (0.05,))
    three, two = Rules(0.075, 0.05, 0.10, 3, 0.05), Rules(0.075, 0.05, 0.10)
    caught_three = simulate(model, three, runs=300, shift=0.1, history=False, seed=1)
    caught_two = simulate(model, two, runs=300, shift=0.1, history=False, seed=1)
    assert caught_three > 0.82 and caught_two < 0.75 and caught_three > caught_two + 0.15, (caught_three, caught_two)
    assert simulate(model, three, runs=300, history=False, seed=2) <= 0.01


def test_the_analysis_command_applies_either_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``analyze`` takes the CPU tier's rule (three looks, screened) unless told ``--looks 2 --screen 0``."""
    import json

    from vramgate.engine import paired_defaults
    from vramgate.tools.calibration.gate_paired import main

    rng = random.Random(9)
    with (tmp_path / "trials.jsonl").open("w") as f:
        for i in range(4):
            ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
            f.write(json.dumps({"profile": "p", "condition": "unchanged", "index": i, "ref": ref,
                                "cand": [r * rng.lognormvariate(0, 0.02) for r in ref], "stat": "step"}) + "\n")
    cpu = paired_defaults("cpu")
    assert main(["analyze", str(tmp_path)]) == 0
    assert f"Rule: three looks; first look screened at {cpu.screen:.1%}" in capsys.readouterr().out
    assert main(["analyze", str(tmp_path), "--looks", "2", "--screen", "0"]) == 0
    assert "Rule: two looks, the second deciding by 'both'" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a screen above the tolerance: refused as the tier's settings refuse it
        main(["analyze", str(tmp_path), "--tolerance", "0.04"])
    assert "screen 0.05 must be above 0 and at most the tolerance 0.04" in capsys.readouterr().err


def test_analyze_reads_each_trials_first_rounds_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``analyze --rounds N`` judges each trial's first N round pairs, what a test of N rounds would have seen; it
    says so, and refuses a count below 1 or above a trial's own."""
    import json

    from vramgate.tools.calibration.gate_paired import main

    rng = random.Random(11)
    lines = []
    for i in range(6):  # the candidate is +20% from the 11th round pair on
        ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
        cand = [r * (1.2 if k >= 10 else 1.0) * rng.lognormvariate(0, 0.02) for k, r in enumerate(ref)]
        lines.append(json.dumps({"profile": "p", "condition": "unchanged", "index": i, "ref": ref, "cand": cand,
                                 "stat": "step", "together": False}))
    (tmp_path / "trials.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["analyze", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "6.00 of 6" in text and "round pairs only" not in text
    assert main(["analyze", str(tmp_path), "--rounds", "10"]) == 0
    text = capsys.readouterr().out
    assert "0.00 of 6" in text and "Each trial's first 10 round pairs only." in text
    for bad, why in (("0", "at least 1"), ("31", "trials 0, 1, 2, 3, 4 have fewer round pairs")):
        with pytest.raises(SystemExit):
            main(["analyze", str(tmp_path), "--rounds", bad])
        assert why in capsys.readouterr().err


def test_analyze_reads_the_trials_a_page_names_by_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``analyze --indices 0-3,8`` judges only those trials: a page's command keeps reproducing its tables when its
    campaign's trials file grows; a malformed list is refused."""
    import json

    from vramgate.tools.calibration.gate_paired import main
    from vramgate.tools.calibration.gate_paired.cli import index_ranges

    assert index_ranges("0-3,8") == {0, 1, 2, 3, 8}
    rng = random.Random(5)
    lines = []
    for i in range(10):  # trials 4-9 (a later campaign's) are +30% slower
        ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
        cand = [r * (1.3 if i >= 4 else 1.0) * rng.lognormvariate(0, 0.02) for r in ref]
        lines.append(json.dumps({"profile": "p", "condition": "unchanged", "index": i, "ref": ref, "cand": cand,
                                 "stat": "step", "together": False}))
    (tmp_path / "trials.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["analyze", str(tmp_path)]) == 0
    assert "| p | unchanged | 10 |" in capsys.readouterr().out
    assert main(["analyze", str(tmp_path), "--indices", "0-3"]) == 0
    text = capsys.readouterr().out
    assert "| p | unchanged | 4 |" in text and "0.00 of 4" in text
    assert main(["analyze", str(tmp_path), "--indices", "0-3,8"]) == 0
    assert "| p | unchanged | 5 |" in capsys.readouterr().out  # trial 8's first look fails: 1/5
    for bad in ("3-1", "a", "-2"):
        with pytest.raises(SystemExit):
            main(["analyze", str(tmp_path), "--indices", bad])
        assert "indices and ranges such as 0-43,60-77" in capsys.readouterr().err


def test_analyze_judges_history_against_the_baseline_file_a_campaign_keeps(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``analyze --baselines FILE`` takes the stored ratios from a copy of a ``latency.json`` (those a campaign was
    judged against), not from the key's current baselines; with ``--key`` too, or an unreadable file, it says so."""
    import json

    from vramgate.tools.calibration.gate_paired import main

    rng = random.Random(3)
    lines = []
    for i in range(4):
        ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(30)]
        lines.append(json.dumps({"profile": "p", "condition": "unchanged", "index": i, "ref": ref,
                                 "cand": [r * rng.lognormvariate(0, 0.02) for r in ref], "stat": "step"}))
    (tmp_path / "trials.jsonl").write_text("\n".join(lines) + "\n")
    kept = tmp_path / "baselines-kept-latency.json"
    kept.write_text(json.dumps({"tests": {"suites/latency/test_paired_latency.py::test_profile_latency_ratio[p]": {
        "metrics": {"step_ratio": {"samples": [0.8 * rng.lognormvariate(0, 0.01) for _ in range(30)]}}}}}))
    assert main(["analyze", str(tmp_path)]) == 0
    assert "stored baselines for: none" in capsys.readouterr().out
    assert main(["analyze", str(tmp_path), "--baselines", str(kept)]) == 0
    text = capsys.readouterr().out
    assert "stored baselines for: p" in text and "(0 / 0 / 4)" in text  # 25% slower than the kept ratios
    with pytest.raises(SystemExit):
        main(["analyze", str(tmp_path), "--baselines", str(kept), "--key", "k"])
    assert "--key and --baselines" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"not-there\.json: not a baseline file"):
        main(["analyze", str(tmp_path), "--baselines", str(tmp_path / "not-there.json")])


@pytest.mark.parametrize("tier", ["cpu", "gpu"])
def test_the_campaign_and_the_gate_reach_the_same_verdict_on_the_same_looks(tier: str) -> None:
    """The campaign's rules (``gate_paired.rules.Rules``, built from the tier's settings) and the gate's looks
    (``vramgate.engine.looks.confirmed_rounds``), both deciding by ``vramgate.engine.looks.LookRule``, decide
    alike: on the same looks of stand-in engines, unchanged and with a candidate up to 15% slower, against a stored
    baseline or none, the test fails under one exactly when it fails under the other. The further checks of a look
    (the noise guard, the stored baseline) are the rules' own here, as the gate's ``paired_checks`` gives them;
    what is compared is when further looks are taken, which rounds are pooled and which decide."""
    from vramgate.engine.looks import confirmed_rounds
    from vramgate.engine.paired import PAIRED_DEFAULTS
    from vramgate.tools.calibration.gate_paired import Rules, TrialData

    settings = PAIRED_DEFAULTS[tier]
    rules = Rules.of(settings)
    rng = random.Random(11)
    disagree, failed, cases = [], 0, 0
    for case in range(160):
        shift = rng.choice([0.0, 0.05, 0.08, 0.10, 0.15])
        offsets = [rng.gauss(0.0, 0.03) for _ in range(3)]  # each engine pair's own speed for its whole life
        noise = rng.choice([0.02, 0.05, 0.10])

        def one(n: int, shift: float = shift, offsets: list[float] = offsets, noise: float = noise
                ) -> tuple[list[float], list[float]]:
            ref = [0.005 * math.exp(rng.gauss(0.0, 0.05)) for _ in range(settings.rounds)]
            return ref, [r * (1 + shift) * math.exp(offsets[n] + rng.gauss(0.0, noise)) for r in ref]

        looks = [one(n) for n in range(3)]
        base = None
        if case % 2:
            r, c = one(0, 0.0, [rng.gauss(0.0, 0.03)] * 3)
            base = [y / x for x, y in zip(r, c, strict=True)]

        def also(key: str, r: list[float], c: list[float], base: list[float] | None = base
                 ) -> list[tuple[str, bool]]:
            found = rules.fails(r, c, base)
            return [("noise", "noise" in found), ("history", "history" in found)]

        ref, cand, _ = confirmed_rounds(lambda n, looks=looks: looks[n], settings, also=also)
        gate_fails = bool(rules.fails(ref, cand, base))
        trials = [TrialData("p", "c", n, *looks[n], True) for n in range(3)]
        campaign_fails = bool(rules.first_fails(trials[0], base)) and rules.confirms(
            trials[0], *trials[1:1 + rules.further], base=base)
        cases += 1
        failed += gate_fails
        if gate_fails != campaign_fails:
            disagree.append((case, shift, gate_fails, campaign_fails))
    assert not disagree, disagree
    assert 0 < failed < cases  # both ways of the rule were met
