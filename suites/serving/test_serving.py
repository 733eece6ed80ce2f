"""Online serving: vLLM's OpenAI-compatible server under the team's load, measured by vLLM's own benchmark client.

Each matrix entry of the suite is a serving configuration (``[entries.serving]``) and a load (``[entries.load]``:
request rates, prompts, SLOs). The server is started as ``vllm serve`` starts it, on 127.0.0.1 and a free port,
once per configuration and session (:mod:`vramgate.testing.serving`); vLLM's ``vllm bench serve`` client drives
it over HTTP (:mod:`vramgate.engine.load`), so the figures are the ones a team's own benchmark prints:

- ``test_serving_load``, a case per request rate: TTFT, TPOT and E2E latency per request (their medians compared
  with the stored baseline at the tier's unpaired tolerance), the client's p90/p99 of TTFT, TPOT, ITL and E2E,
  request and output throughput, goodput at the entry's SLOs. Any failed request fails the test with the server's
  log tail. The tails and the goodput are held to the entry's budgets only (Note [budget-only figures] in
  :mod:`vramgate.core.metrics`): the p99 of one load on shared cores moves by multiples between unchanged runs.
- ``test_serving_memory``: the server's resident memory (the whole process tree) sampled during a sustained load
  at a fixed concurrency, after a warm-up until it settled, and its slopes in bytes per 1,000 requests and per
  1,000 output tokens (Note [memory slope] in :mod:`vramgate.engine.leak`), whose lower bounds are held to
  :data:`MEMORY_SLOPE_CEILING` (or the entry's budget: Note [leak fit] in :mod:`vramgate.core.leak`); on the GPU
  tier the slope of its device memory too (Note [device memory slope] there), held to
  :data:`DEVICE_MEMORY_SLOPE_CEILING`. Nightly, ``test_serving_memory_soak`` runs the same over the entry's
  ``soak_requests``, held to :data:`SOAK_SLOPE_CEILING`, and ``test_serving_memory_paired`` judges, per profile
  (every one: its row's leaks cell), the slope of the difference between its server's memory and the unpatched
  one's under the same load (Note [paired slopes] there).
- ``test_serving_paired``, a case per profile that names the suite: the profile's server and the unpatched one up
  together, the same bursts in alternating order (Note [paired bursts]), the per-burst ratios of median TPOT and
  TTFT judged in-run, with a second look before a failure (as the paired engine tests do).

Calibration on the 2-core CPU: docs/online-serving.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing import MatrixCase, ModelLoader, Servers
from vramgate.testing.engines import EngineSpec, engine_tier, unpaired_latency_tolerance
from vramgate.testing.profiles import Profile, runnable_candidate, skip_unmet, unpatched
from vramgate.testing.serving import (
    ONE_PIECE,
    LoadRun,
    ServingLoad,
    device_memory_slope,
    memory_slope,
    paired_burst,
    paired_settings,
    paired_slope,
    rate_load,
    sustained_loads,
    workload_trace,
)

#: The engine spec the matrix's serving configuration is applied to (the model, block size and dtype are the
#: entry's; no KV budget: vLLM sizes the KV cache at the team's memory).
BASE = EngineSpec(model="tiny-llama", kv_budget_gib=None)
#: The allowance of the sustained load's memory slope, per 1,000 requests (the entry's budget may lower it): the
#: test fails when the slope's 99.9% lower bound is above it (Note [leak fit] in vramgate.core.leak). The campaign
#: that chose it: docs/online-serving.md, "The leak floor" (docs/calibration.md's table has its rates).
MEMORY_SLOPE_CEILING = 24 << 20
#: The nightly soak's allowance: its longer load narrows the bound and outlasts a small leak's hidden start (the
#: freed heap it fills first), so that it catches 16 KiB per request, per request or per token.
SOAK_SLOPE_CEILING = 8 << 20
#: The allowance of the device memory's slope per 1,000 requests of the sustained load (the entry's budget may lower
#: it), judged by its bound as the resident slope is. Not measured on a GPU yet: the resident allowance before the
#: leak floor was measured, well above one new segment of the caching allocator during the measured part (a 20 MiB
#: segment in the middle of 300 requests fits as about 100 MiB per 1,000) and below a device leak of 0.4 MiB per
#: request.
DEVICE_MEMORY_SLOPE_CEILING = 384 << 20


#: The share of a load's requests that may reach the client in one piece before its TTFT and TPOT are not judged
#: (Note [streams in one piece] in vramgate.engine.load).
ONE_PIECE_SHARE = 0.1


@pytest.mark.gate_together("serving servers")
@pytest.mark.gate_matrix("serving", id="{model}-{request_rate}rps")
def test_serving_load(gate: Gate, servers: Servers, model: str, request_rate: float, matrix_case: MatrixCase,
                      project_root: Path, tmp_path: Path) -> None:
    """The client's figures at one request rate of the entry's load (of its workload's requests, if it names
    one)."""
    assert matrix_case.entry.load is not None
    server = servers.get(matrix_case.engine_spec(BASE.replace(model=model)))
    trace = workload_trace(matrix_case.entry, project_root, tmp_path)
    load = rate_load(matrix_case.entry.load, request_rate, trace)
    result = servers.loads(server, [load], tmp_path / "load").results[0][0]
    assert result.completed == load.num_prompts and result.failed == 0, result
    tolerance = unpaired_latency_tolerance()
    # Note [streams in one piece] in vramgate.engine.load: where the client read many streams whole, TTFT and TPOT
    # time the client, not the server; they are kept, not held to the baseline, and the end-to-end latency is
    whole = result.in_one_piece()
    streamed = whole <= ONE_PIECE_SHARE * len(result.ttft_s)
    if not streamed:
        gate.conditions.append({"ttft_tpot_not_judged": (
            f"{whole} of {len(result.ttft_s)} requests' tokens reached the client in one piece (their first token "
            f"after {ONE_PIECE:.0%} of their whole latency): the client's TTFT and TPOT time its own reading, "
            "not the server; the end-to-end latency is judged")})
    gate.record_samples("ttft", result.ttft_s, unit="s", tolerance=unpaired_latency_tolerance(first_token=True),
                        history=streamed)
    gate.record_samples("tpot", result.tpot_s, unit="s", tolerance=tolerance, history=streamed)
    gate.record_samples("e2el", result.e2el_s, unit="s", tolerance=tolerance)
    pct = result.percentiles
    gate.record("ttft_p90", pct["ttft"][90], unit="s", scope="machine", history=False)
    gate.record("ttft_p99", pct["ttft"][99], unit="s", scope="machine", history=False)
    gate.record("tpot_p90", pct["tpot"][90], unit="s", scope="machine", history=False)
    gate.record("tpot_p99", pct["tpot"][99], unit="s", scope="machine", history=False)
    gate.record("itl_p50", pct["itl"][50], unit="s", scope="machine", history=False)
    gate.record("itl_p90", pct["itl"][90], unit="s", scope="machine", history=False)
    gate.record("itl_p99", pct["itl"][99], unit="s", scope="machine", history=False)
    gate.record("e2el_p90", pct["e2el"][90], unit="s", scope="machine", history=False)
    gate.record("e2el_p99", pct["e2el"][99], unit="s", scope="machine", history=False)
    gate.record("request_throughput", result.request_throughput, unit="requests/s", better="higher",
                scope="machine", history=False)
    gate.record("output_throughput", result.output_throughput, unit="tokens/s", better="higher", scope="machine",
                history=False)
    if result.goodput is not None:
        gate.record("goodput", result.goodput, unit="ratio", better="higher", scope="machine", history=False)
    # Note [the same answer] in vramgate.core.answers: vLLM's benchmark client keeps no outputs to judge
    gate.claim(f"{model} served at {request_rate:g} req/s: the server's answers", held=False, judged=False,
               source="serving", evidence="outputs not judged: vLLM's benchmark client keeps no outputs (and the "
               "default serving entry runs dummy weights); answers are judged on the recall models (suites/answers, "
               "suites/pressure/test_recall_models.py)")


def _memory(gate: Gate, run: LoadRun, ceiling: float, output_len: int, *, rss_history: bool = True) -> None:
    """Record the memory figures of *run*'s last load on its first server: the slopes per request and per output
    token over the measured part (after the settled warm-up), with their fits, and the resident size (held to its
    baseline with *rss_history*). The allowance per token is the allowance per request spread over the load's
    *output_len* tokens."""
    last = run.results[0][-1]
    start = run.measured_from(0)
    # the warm-up's completions too, so that the picture places its samples before the measured part's
    done = [c for chunk in run.warmups[0] for c in chunk.completions] + last.completions
    try:
        slope = memory_slope(run.memory[0], done, start)
        per_token = memory_slope(run.memory[0], done, start, per="token")
    except ValueError as exc:
        pytest.fail(f"the memory slope of {last.load.describe()} could not be fitted: {exc}", pytrace=False)
    gate.record("memory_slope", round(slope.per_1k), unit="B/1k requests", ceiling=ceiling, scope="machine",
                history=False, fit=slope.fit)
    gate.record("memory_slope_per_token", round(per_token.per_1k), unit="B/1k tokens", ceiling=ceiling / output_len,
                scope="machine", history=False, fit=per_token.fit)
    gate.record("server_rss_bytes", slope.end_bytes, unit="B", tolerance=0.10, scope="machine", history=rss_history)
    gate.conditions.append(run.warmup_note(0))
    if run.device_memory and run.device_memory[0]:
        device = device_memory_slope(run.device_memory[0], done, start)
        gate.record("device_memory_slope", round(device.per_1k), unit="B/1k requests",
                    ceiling=DEVICE_MEMORY_SLOPE_CEILING, scope="machine", history=False, fit=device.fit)
        gate.conditions.append({"device_memory_slope": device.source})


@pytest.mark.gate_together("serving servers")
@pytest.mark.gate_matrix("serving", id="{model}")
def test_serving_memory(gate: Gate, servers: Servers, model: str, matrix_case: MatrixCase, tmp_path: Path) -> None:
    """The server's memory over a sustained load, after a warm-up until it settled: its slopes per 1,000 requests
    and per 1,000 output tokens with their bounds (the report draws them), and its resident size; on the GPU tier
    its device memory's slope too, and which figure of NVML that slope was fitted to (the report's
    ``gpu_conditions``)."""
    assert matrix_case.entry.load is not None
    server = servers.get(matrix_case.engine_spec(BASE.replace(model=model)))
    warmup, sustained = sustained_loads(matrix_case.entry.load)
    run = servers.loads(server, [sustained], tmp_path / "load", warmup=warmup)
    assert run.results[0][-1].completed == sustained.num_prompts, run.results[0][-1]
    _memory(gate, run, MEMORY_SLOPE_CEILING, sustained.output_len)


@pytest.mark.gate_nightly("the soak: a sustained load of thousands of requests (about 5 minutes on 2 cores), which "
                          "sets the lower leak floor; pre-merge runs the short one (test_serving_memory)")
@pytest.mark.gate_together("serving servers")
@pytest.mark.gate_matrix("serving", id="{model}")
def test_serving_memory_soak(gate: Gate, servers: Servers, model: str, matrix_case: MatrixCase,
                             tmp_path: Path) -> None:
    """The memory test's figures over the entry's soak (``soak_requests``), held to the soak's lower ceilings."""
    assert matrix_case.entry.load is not None
    server = servers.get(matrix_case.engine_spec(BASE.replace(model=model)))
    warmup, soak = sustained_loads(matrix_case.entry.load, soak=True)
    run = servers.loads(server, [soak], tmp_path / "load", warmup=warmup)
    assert run.results[0][-1].completed == soak.num_prompts, run.results[0][-1]
    # the short memory test holds the same server's resident size to its baseline; the soak judges the slopes
    _memory(gate, run, SOAK_SLOPE_CEILING, soak.output_len, rss_history=False)


#: The serving configuration of the paired test: the default matrix's CPU serving entry (tiny-llama, 2 GiB, eager,
#: so the session's server for that entry is the reference), with :data:`PAIRED_GPU_UTILIZATION` of the device on a
#: GPU.
PAIRED_SPEC = EngineSpec(model="tiny-llama", block_size=32, max_model_len=1024, max_num_seqs=32, kv_budget_gib=None,
                         cpu_memory_bytes=2 << 30)
#: Each paired server's ``gpu_memory_utilization`` on a GPU: both are up at once, and vLLM starts the second only
#: when total x utilization is free (Note [servers hold the device] in vramgate.testing.serving), so each takes
#: under half of the device, leaving room for both CUDA contexts and the gate's own.
PAIRED_GPU_UTILIZATION = 0.44


@pytest.mark.gate_nightly("two servers and 40 bursts (about 3 minutes on 2 cores); the pre-merge latency of each "
                          "profile is gated by the paired engine tests")
@pytest.mark.gate_together("serving servers")
@pytest.mark.gate_profiles("serving")
def test_serving_paired(gate: Gate, servers: Servers, model_shape: ModelLoader, profile: Profile, tmp_path: Path,
                        request: pytest.FixtureRequest) -> None:
    """Median TPOT and TTFT per burst of the profile's server over the unpatched one's, both up at once."""
    skip_unmet(profile)
    tier = engine_tier()
    reference = (PAIRED_SPEC if tier == "cpu" else
                 PAIRED_SPEC.replace(gpu_memory_utilization=PAIRED_GPU_UTILIZATION, block_size=16))
    candidate = runnable_candidate(reference, profile, model_shape(reference.model).use_mla)
    settings = paired_settings(tier)
    load = ServingLoad(request_rates=(float("inf"),), paired_rounds=settings.rounds)
    a, b = servers.get(unpatched(reference)), servers.get(candidate)  # Note [the unpatched reference]

    def also(latency: str, r: Sequence[float], c: Sequence[float]) -> list[tuple[str, bool]]:
        return gate.paired_checks(f"{latency}_ratio", r, c, tolerance=settings.tolerance[latency],
                                  alpha=settings.alpha, history_tolerance=settings.history_tolerance[latency])

    looks, ref, cand = settings.judge(lambda rounds, seed: servers.paired(a, b, paired_burst(load), rounds,
                                                                          tmp_path / f"look-{seed}", seed=seed,
                                                                          quiet_section=seed > 0), also=also)
    request.node.add_report_section("call", "vramgate paired looks", "\n".join(looks))
    for latency in ("tpot", "ttft"):
        gate.record_paired(f"{latency}_ratio", ref[latency], cand[latency], tolerance=settings.tolerance[latency],
                           alpha=settings.alpha, history_tolerance=settings.history_tolerance[latency], looks=looks,
                           noise_in_looks=True)  # every look was judged with gate.paired_checks (also, above)


#: The allowance of the paired memory slope (the difference of the two servers), per 1,000 requests: the soak's, as
#: its 1,000 requests per server after both warm-ups are a soak's length and what both servers do alike cancels. The
#: runs that chose it (an unchanged pair, planted leaks of 16 and 64 KiB per request): docs/online-serving.md, "The
#: paired slope".
PAIRED_SLOPE_CEILING = SOAK_SLOPE_CEILING
#: Rounds of the paired memory test: each round, each server takes one chunk of the load, in turn.
PAIRED_MEMORY_ROUNDS = 10
#: Requests per chunk of the paired memory test (so each server serves ROUNDS x this, after its warm-up).
PAIRED_MEMORY_CHUNK = 100


@pytest.mark.gate_nightly("two servers under 1,000 requests each, in turn (about 3 minutes per profile on 2 "
                          "cores); the pre-merge memory slope of the unpatched server is test_serving_memory's")
@pytest.mark.gate_together("serving servers")
@pytest.mark.gate_judges("leaks")
@pytest.mark.gate_profiles()
def test_serving_memory_paired(gate: Gate, servers: Servers, model_shape: ModelLoader, profile: Profile,
                               tmp_path: Path) -> None:
    """The profile's server and the unpatched one under the same load, chunk by chunk in turn, after each warmed up
    until its memory settled: the slope of the difference of their resident memory, per 1,000 requests (Note
    [paired slopes] in vramgate.engine.leak), held to :data:`PAIRED_SLOPE_CEILING`. Every profile's, whatever suites it
    names: its row's leaks cell (Note [profile verdict] in vramgate.core.verdicts)."""
    skip_unmet(profile)
    if profile.checkpoint is not None:
        pytest.skip(f"not judged here: profile {profile.name} serves a quantized checkpoint, and the serving suite's "
                    "servers run the unquantized tiny-llama (the quantization suite judges its memory at a fixed "
                    "budget, not under a sustained load)")
    tier = engine_tier()
    reference = (PAIRED_SPEC if tier == "cpu" else
                 PAIRED_SPEC.replace(gpu_memory_utilization=PAIRED_GPU_UTILIZATION, block_size=16))
    candidate = runnable_candidate(reference, profile, model_shape(reference.model).use_mla)
    a, b = servers.get(unpatched(reference)), servers.get(candidate)  # Note [the unpatched reference]
    warmup, sustained = sustained_loads(ServingLoad(request_rates=(float("inf"),)))
    chunk = dataclasses.replace(sustained, num_prompts=PAIRED_MEMORY_CHUNK)
    items = [(i, dataclasses.replace(chunk, seed=chunk.seed + r), f"round-{r}-{i}")
             for r in range(PAIRED_MEMORY_ROUNDS) for i in (0, 1)]
    run = servers.plan(items, [a, b], tmp_path / "load", warmup=warmup)
    done = [[c for result in run.results[i] for c in result.completions] for i in (0, 1)]
    slope = paired_slope(run.memory[0], run.memory[1], done[0], done[1], run.measured_from(0),
                         run.measured_from(1))
    gate.record("memory_slope_difference", round(slope.per_1k), unit="B/1k requests", ceiling=PAIRED_SLOPE_CEILING,
                scope="machine", history=False, fit=slope.fit)
    gate.conditions += [{"server": "reference", **run.warmup_note(0)}, {"server": "candidate", **run.warmup_note(1)}]
