"""Engine runs for the suites: the session's engine, and the specs several suites share.

Suites that ask for the same :class:`~vramgate.engine.EngineSpec` share one
engine run per session (:class:`~vramgate.engine.EngineCache`). The specs and
block sizes here are the ones kept in step on purpose: the pressure and
block_manager suites run :data:`PRESSURE_SPEC`; the capacity, latency and
quantization suites run :func:`small_run_spec` at the block size of
:func:`small_run_block_size`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from vramgate.core.answers import Expectation
from vramgate.engine import (
    KV_TOO_SMALL,
    EngineCache,
    EngineError,
    EngineResult,
    EngineSpec,
    PairedEngines,
    SpecError,
    UnsupportedHere,
    backend_problem,
    confirmed_rounds,
    cpu_backend_problem,
    engine_tier,
    fusion_problem,
    kv_need,
    latency_spec,
    paired_defaults,
    run_engine,
    validate,
    with_session_profile,
)
from vramgate.engine.diff_lines import TRACE_ENV
from vramgate.engine.measure import PLANT_CANDIDATE_DELAY_ENV, PLANT_DELAY_ENV, planted_fraction
from vramgate.engine.paired import RoundAnswers
from vramgate.machine.probes import memory_history
from vramgate.pytest_plugin.fixture import Gate
from vramgate.runtime import quiet
from vramgate.runtime.engine_env import EngineEnv
from vramgate.testing.answers import check_round_answers

__all__ = [
    "CAPACITY_KV_TOKENS",
    "FIRST_TOKEN_TOLERANCE",
    "KV_TOO_SMALL",
    "PRESSURE_SPEC",
    "PROFILE_OPTION",
    "RECALL_JUDGING_REQUESTS",
    "RECALL_MODELS",
    "SMALL_RUN_BLOCK_SIZE",
    "SMALL_RUN_BLOCK_SIZE_AMX",
    "SMALL_RUN_BUDGET_GIB",
    "TRACE_ENV",
    "UNPAIRED_LATENCY_TOLERANCE",
    "Engine",
    "EngineEnv",
    "EngineError",
    "EngineResult",
    "EngineSpec",
    "PairedEngines",
    "SpecError",
    "backend_problem",
    "capacity_probe_spec",
    "capacity_spec",
    "confirmed_rounds",
    "cpu_backend_problem",
    "engine_tier",
    "fusion_problem",
    "kv_need",
    "latency_spec",
    "paired_defaults",
    "recall_judging_spec",
    "record_paired_step",
    "run_engine",
    "small_run_block_size",
    "small_run_spec",
    "tensor_parallel_spec",
    "unpaired_latency_tolerance",
    "validate",
]

#: The option (``--gate-profile``) that applies a profile to every engine run of a session.
PROFILE_OPTION = "gate_profile"


class Engine:
    """Runs engine specs once per session (per pytest-xdist worker); a crash or timeout fails the test with the
    log tail, and a spec that this machine's vLLM kernels cannot run (fp8 KV, 4-bit linear layers without
    AVX-512) skips it with the reason, decided before the engine starts."""

    def __init__(self, cache: EngineCache, profile: str | None = None) -> None:
        self.cache = cache
        self.profile = profile
        """``--gate-profile``: the profile every spec that names none runs with."""

    def run(self, spec: EngineSpec) -> EngineResult:
        """The result of *spec*'s engine run (the session's earlier one when it already ran)."""
        spec = with_session_profile(spec, self.profile)
        try:
            result = self.cache.run(spec)
        except UnsupportedHere as exc:
            pytest.skip(f"not on this machine: {exc}")
        except EngineError as exc:
            pytest.fail(str(exc), pytrace=False)
        memory_history.note(result.memory.memory_history)  # the test's snapshots (Note [memory history])
        return result


#: The tolerance of an engine's latency samples judged against a stored baseline from another process (unpaired),
#: per engine tier: wide enough that whole processes' drift (on 2 shared CPU cores, beside the other xdist worker,
#: an unchanged tree's latency moved past 100%) passes, so only a fourfold latency fails on CPU; the GPU's from the
#: H200 kernel campaign. The measurements: docs/calibration.md, "Results". The fine checks are the paired ones (both
#: engines up, taking turns).
UNPAIRED_LATENCY_TOLERANCE = {"cpu": 3.0, "gpu": 0.3}
#: The same for the TTFT of a run whose requests all arrive at once (the shared small runs): every request's first
#: token comes from the engine's first steps after start-up, so its samples are one measurement, not one per
#: request, and unchanged trees' figures moved past a 100% tolerance (docs/calibration.md, "TTFT of the shared
#: small runs (unpaired, CPU)"). 3.0 fails a fourfold TTFT only; the paired tests carry the fine check. Thinly
#: calibrated.
FIRST_TOKEN_TOLERANCE = {"cpu": 3.0, "gpu": 0.3}


def unpaired_latency_tolerance(*, first_token: bool = False) -> float:
    """:data:`UNPAIRED_LATENCY_TOLERANCE` (*first_token*: :data:`FIRST_TOKEN_TOLERANCE`) of this machine's engine
    tier."""
    return (FIRST_TOKEN_TOLERANCE if first_token else UNPAIRED_LATENCY_TOLERANCE)[engine_tier()]


#: The KV-pressure engine run shared by the pressure and block_manager suites (one run per session):
#: recall-llama (the KV shape of tiny-llama, 1 KiB per token, with weights that answer the recall task: Note [recall
#: task] in vramgate.models.recall), 8 MiB of KV (about 8k tokens) for 48 ShareGPT-like requests. The prompts are the
#: task's at the workload's lengths, so the scheduler's figures are what tiny-llama's random prompts gave.
PRESSURE_SPEC = EngineSpec(
    model="recall-llama", workload="sharegpt", requests=48, seed=1, block_size=32, max_model_len=2048,
    max_num_seqs=32, max_num_batched_tokens=2048, kv_budget_gib=8 / 1024,
)

#: KV budget of the small engine runs that the capacity, latency and quantization suites share.
SMALL_RUN_BUDGET_GIB = 0.25

#: Block size of each model's shared small run, per tier: vLLM's CPU attention needs a multiple of 32 and its
#: CPU MLA runs 16 only. The capacity suite runs these (and more), the latency and quantization suites these.
SMALL_RUN_BLOCK_SIZE = {
    "cpu": {"tiny-llama": 32, "tiny-deepseek-v2": 16},
    "gpu": {"tiny-llama": 16, "tiny-deepseek-v2": 16},
}
#: The same on a CPU with AMX, where vLLM runs MLA with AMX_MLA, which takes multiples of 32 (Note [CPU MLA
#: backends] in :mod:`vramgate.machine.isa`; the matrix's entries with ``cpu_isa = "amx"``).
SMALL_RUN_BLOCK_SIZE_AMX = {"tiny-llama": 32, "tiny-deepseek-v2": 32}


def small_run_block_size(model: str) -> int:
    """The block size of *model*'s shared small run on this machine's tier (:data:`SMALL_RUN_BLOCK_SIZE`; on a
    CPU whose MLA backend is AMX_MLA, :data:`SMALL_RUN_BLOCK_SIZE_AMX`)."""
    tier = engine_tier()
    if tier == "cpu":
        from vramgate.machine import isa

        if isa.mla_backend(isa.effective_isa()) == "AMX_MLA":
            return SMALL_RUN_BLOCK_SIZE_AMX[model]
    return SMALL_RUN_BLOCK_SIZE[tier][model]


#: The recall models (Note [recall task] in :mod:`vramgate.models.recall`) by their shape in
#: :data:`vramgate.models.recall_weights.ARCHS`: a Llama, a Llama with grouped-query attention, a DeepSeek-V2 (MLA).
RECALL_MODELS = {"llama": "recall-llama", "llama-gqa": "recall-llama-gqa", "deepseek-v2": "recall-deepseek-v2"}
#: How many of a recall model's judging prompts (:func:`vramgate.workloads.recall_judging`) a judging run asks:
#: all of them.
RECALL_JUDGING_REQUESTS = 61


def recall_judging_spec(arch: str) -> EngineSpec:
    """The recall model of shape *arch* answering its judging prompts (3 to 1,984 tokens, 64 answered each) at the
    small runs' KV budget and this tier's block size for its attention (MLA's or the Llama's)."""
    like = "tiny-deepseek-v2" if arch.startswith("deepseek") else "tiny-llama"
    return EngineSpec(model=RECALL_MODELS[arch], workload="recall-judging", requests=RECALL_JUDGING_REQUESTS,
                      block_size=small_run_block_size(like), max_model_len=2048, kv_budget_gib=SMALL_RUN_BUDGET_GIB)


#: The capacity check's serving configuration (Note [full KV cache]): the memory of the grouped-query recall Llama's
#: engine after its warm-up plus this many tokens of KV cache, about half of what its judging prompts need with their
#: answers (56,743 tokens), so that they fill it and preempt.
CAPACITY_KV_TOKENS = 24_576
#: The probe that finds that memory: vLLM sizes the KV cache itself at this much (CPU) ...
CAPACITY_PROBE_CPU_MEMORY = 3 << 29
#: ... or this utilization of the device (GPU).
CAPACITY_PROBE_GPU_UTILIZATION = 0.5


def capacity_probe_spec(arch: str) -> EngineSpec:
    """The recall model *arch* answering its judging prompts with the KV cache left to vLLM (no budget), at a
    memory where it is far from full: the run whose non-KV memory :func:`capacity_spec` builds on."""
    base = recall_judging_spec(arch).replace(kv_budget_gib=None)
    if engine_tier() == "cpu":
        return base.replace(cpu_memory_bytes=CAPACITY_PROBE_CPU_MEMORY)
    return base.replace(gpu_memory_utilization=CAPACITY_PROBE_GPU_UTILIZATION)


def capacity_spec(arch: str, probe: EngineResult) -> EngineSpec:
    """Note [full KV cache]: the serving configuration whose KV cache vLLM sizes at about
    :data:`CAPACITY_KV_TOKENS` (the *probe*'s non-KV memory plus that many tokens' bytes), so that the judging prompts
    fill it: the KV cache a profile makes vLLM give itself, and the engine's peak with that cache full."""
    decision = probe.decision
    if decision is None:
        raise SpecError(f"the capacity probe of {arch} ran with a KV budget: it has no memory decision of vLLM's")
    kv = CAPACITY_KV_TOKENS * probe.kv.bytes_per_token
    base = recall_judging_spec(arch).replace(kv_budget_gib=None)
    if engine_tier() == "cpu":
        return base.replace(cpu_memory_bytes=decision.non_kv_bytes + kv)
    return base.replace(gpu_memory_utilization=round(decision.utilization_for(kv), 6))


def tensor_parallel_spec(spec: EngineSpec, tp: int) -> tuple[EngineSpec, str | None]:
    """*spec* at a tensor parallelism of *tp*, and why this machine cannot run it (None where it can). On the CPU
    tier vLLM binds each rank's threads to cores of its own (``VLLM_CPU_OMP_THREADS_BIND``, one core per rank of
    those this process may use: without it vLLM's CPU worker asks for a NUMA node per rank and fails); on a GPU it
    needs *tp* GPUs."""
    parallel = spec.replace(tensor_parallel_size=tp)
    if engine_tier() != "cpu":
        from vramgate.machine import hardware

        gpus = len(hardware.visible_gpus())
        return parallel, None if gpus >= tp else f"tensor parallelism {tp} needs {tp} GPUs; {gpus} visible"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        return parallel, f"tensor parallelism {tp} on CPU needs {tp} cores, one per rank; this process has {len(cores)}"
    bind = "|".join(str(c) for c in cores[:tp])
    return parallel.replace(env={**parallel.env, "VLLM_CPU_OMP_THREADS_BIND": bind}), None


def small_run_spec(model: str, block_size: int | None = None) -> EngineSpec:
    """16 requests of 128 + 64 tokens at a 0.25 GiB KV budget (*block_size* default: the shared one).

    The capacity, latency and quantization suites ask for the same specs, so each runs once per session (once
    per pytest-xdist worker that runs one of those tests).
    """
    return EngineSpec(model=model, workload="fixed", requests=16,
                      block_size=small_run_block_size(model) if block_size is None else block_size,
                      max_model_len=1024, kv_budget_gib=SMALL_RUN_BUDGET_GIB)


def record_paired_step(gate: Gate, reference: EngineSpec, candidate: EngineSpec, request: pytest.FixtureRequest, *,
                       project_root: Path, run_dir: Path, cache_root: Path, who: str = "",
                       expectation: Expectation | None = None) -> None:
    """Run *reference* and *candidate* as paired engines (Note [paired latency] in :mod:`vramgate.engine.paired`)
    at this tier's settings and record the per-round ratio of the median engine step (``step_ratio``) on *gate*.

    Each look is judged as the end of the test will judge it (in-run, the noise guard, the stored baseline:
    :meth:`~vramgate.pytest_plugin.fixture.Gate.paired_checks`); a first look that fails any is followed by a
    second with fresh engines in a quiet section (Note [second look]), which must fail on its own and pooled; where
    the tier takes three looks, a first look past the screen is followed by two, and their pooled rounds with the
    first's are the verdict (Note [three looks]).
    The looks go into the test's report and into a failing test's message. ``VRAMGATE_PLANT_CANDIDATE_DELAY``
    plants a delay in the candidate's engine steps only (Note [planted delay] in :mod:`vramgate.engine.measure`),
    how the gate's detection in its own configuration is measured (docs/calibration.md).

    Every round's answers are held too (Note [round answers] in :mod:`vramgate.engine.paired`), after the step:
    *who* names the candidate in the row, *expectation* is its profile's (``check_round_answers``)."""
    settings = paired_defaults(engine_tier())
    name = f"{settings.stat}_ratio"
    delay = planted_fraction(PLANT_CANDIDATE_DELAY_ENV)
    if delay:
        candidate = candidate.replace(env={**candidate.env, PLANT_DELAY_ENV: str(delay)})
    quiet_lines: list[str] = []
    answers: list[RoundAnswers] = []
    further = contextlib.ExitStack()  # one quiet section for every further look, held until the last is taken

    def take(n: int) -> tuple[list[float], list[float]]:
        if n == 1:  # Note [second look]: fresh engines, the other workers waiting
            quiet_lines.append(f"further looks, {further.enter_context(quiet.quiet())}")
        with PairedEngines(reference, candidate, project_root, run_dir / f"look-{n}", cache_root=cache_root) as engines:
            result = engines.run(settings.rounds, seed=n, together=settings.together)
        answers.append(result.answers())
        return result.stats(settings.stat)

    def also(_: str, ref: Sequence[float], cand: Sequence[float]) -> list[tuple[str, bool]]:
        return gate.paired_checks(name, ref, cand, tolerance=settings.tolerance, alpha=settings.alpha,
                                  history_tolerance=settings.history_tolerance)

    def records(_: str, ref: Sequence[float], cand: Sequence[float]) -> bool:
        return gate.writes_paired_baseline(name, ref, cand, tolerance=settings.tolerance, alpha=settings.alpha,
                                           history_tolerance=settings.history_tolerance)

    with further:
        reference_rounds, candidate_rounds, looks = confirmed_rounds(take, settings, also=also, records=records)
    looks += quiet_lines
    request.node.add_report_section("call", "vramgate paired looks", "\n".join(looks))
    assert len(reference_rounds) == len(candidate_rounds) in {k * settings.rounds for k in range(1, settings.looks + 1)}
    gate.record_paired(name, reference_rounds, candidate_rounds, tolerance=settings.tolerance, alpha=settings.alpha,
                       history_tolerance=settings.history_tolerance, looks=looks,
                       noise_in_looks=True)  # every look was judged with gate.paired_checks (also, above)
    merged = functools.reduce(RoundAnswers.merge, answers)
    check_round_answers(gate, merged, who=who or candidate.profile or "the candidate", model=reference.model,
                        expectation=expectation)
