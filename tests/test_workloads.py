"""Seeded workloads: determinism, the ShareGPT-like means, prefixes, arrivals, bad input."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from vramgate.workloads import SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT, Workload, WorkloadError, build


def test_same_seed_same_workload() -> None:
    a = build("sharegpt", requests=500, seed=3)
    b = build("sharegpt", requests=500, seed=3)
    assert a.requests == b.requests
    assert a.prompt_token_ids(32000) == b.prompt_token_ids(32000)
    assert build("sharegpt", requests=500, seed=4).requests != a.requests


def test_sharegpt_means_match_the_paper() -> None:
    w = build("sharegpt", requests=20000, seed=0, max_model_len=8192)
    assert statistics.mean(r.prompt_len for r in w.requests) == pytest.approx(SHAREGPT_MEAN_INPUT, rel=0.03)
    assert statistics.mean(r.output_len for r in w.requests) == pytest.approx(SHAREGPT_MEAN_OUTPUT, rel=0.03)


@pytest.mark.parametrize("name", ["fixed", "uniform", "sharegpt", "shared-prefix", "long-context"])
def test_every_request_fits_the_model(name: str) -> None:
    w = build(name, requests=300, seed=1, max_model_len=1024)
    assert w.max_len <= 1024
    ids = w.prompt_token_ids(1000)
    assert [len(t) for t in ids] == [r.prompt_len for r in w.requests]
    assert all(100 <= tok < 1000 for t in ids for tok in t)


def test_shared_prefix_tokens_are_shared() -> None:
    w = build("shared-prefix", requests=4, seed=0, prefix_len=64)
    ids = w.prompt_token_ids(32000)
    assert all(t[:64] == ids[0][:64] for t in ids)
    assert len({tuple(t[64:70]) for t in ids}) == 4


def test_poisson_arrivals() -> None:
    w = build("fixed", requests=2000, seed=0, arrival_rate=10.0)
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    assert w.arrivals == "poisson 10/s"


def test_saved_trace_round_trip(tmp_path: Path) -> None:
    w = build("uniform", requests=5, seed=2)
    (tmp_path / "fixtures" / "workloads").mkdir(parents=True)
    (tmp_path / "fixtures" / "workloads" / "mine.json").write_text(json.dumps(w.to_json()))
    assert build("mine", requests=5, root=tmp_path).requests == w.requests


def test_bad_input_names_what_and_where(tmp_path: Path) -> None:
    accepted = "accepted: fixed, long-context, recall-judging, shared-prefix, sharegpt, uniform"
    with pytest.raises(WorkloadError, match=f"unknown workload 'sharegtp'; {accepted}"):
        build("sharegtp", requests=1)
    with pytest.raises(WorkloadError, match=r"workload 'fixed': .*unexpected keyword argument 'promt_len'"):
        build("fixed", requests=1, promt_len=3)
    with pytest.raises(WorkloadError, match="requests must be >= 1"):
        build("fixed", requests=0)
    (tmp_path / "fixtures" / "workloads").mkdir(parents=True)
    bad = tmp_path / "fixtures" / "workloads" / "bad.json"
    bad.write_text('{"requests": [{"prompt_len": 0, "output_len": 3}]}')
    with pytest.raises(WorkloadError, match=r"bad.json: request lengths must be >= 1"):
        build("bad", requests=1, root=tmp_path)
    with pytest.raises(WorkloadError, match="must be an object"):
        Workload.from_json([], "x.json")


def test_the_recall_judging_workload_is_the_judging_prompts_lengths_cut_to_fit() -> None:
    from vramgate.models.recall_weights import eval_lengths

    whole = build("recall-judging", requests=61, seed=0, max_model_len=2048)
    assert [r.prompt_len for r in whole.requests] == eval_lengths(0)
    assert {r.output_len for r in whole.requests} == {64}
    short = build("recall-judging", requests=13, seed=0, max_model_len=1024)
    assert max(r.total_len for r in short.requests) == 1024  # the 1,500 and 1,984-token prompts cut to fit
    with pytest.raises(WorkloadError, match="leaves no room for 64 output tokens"):
        build("recall-judging", requests=3, seed=0, max_model_len=32)
