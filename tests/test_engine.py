"""The engine runner's host side without vLLM: spec validation, crash, timeout, no leftovers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vramgate.engine import EngineError, EngineSpec, SpecError, cpu_backend_problem, run_engine, validate
from vramgate.engine.paired import RoundAnswers, round_answers

if TYPE_CHECKING:
    from vramgate.engine.paired import PairedDefaults

ROOT = Path(__file__).resolve().parents[1]
#: An engine result as the worker writes it, with made-up figures (for stand-ins of the worker).
FAKE_RESULT = {
    "schema": 1, "spec": {}, "versions": {}, "device": "cpu", "timing": {},
    "kv": {"block_size": 16, "num_gpu_blocks": 9, "usable_blocks": 8, "capacity_tokens": 128, "num_layers": 2,
           "page_bytes": 8192, "bytes_per_token": 1024},
    "memory": {"peak_rss_bytes": 1, "weights_bytes": 2, "parameter_bytes": 2, "kv_tensor_bytes": 3},
    "scheduler": {"steps": 4, "peak_blocks_in_use": 5, "preemptions": 0, "recomputed_tokens": 0},
    "latency": {"ttft_s": [0.1], "tpot_s": [0.01], "e2e_s": [0.2], "output_lens": [8]},
}


def test_spec_round_trip_and_key() -> None:
    spec = EngineSpec(model="tiny-llama", block_size=32)
    assert EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.key() == spec.replace(timeout_s=5).key()
    assert spec.key() != spec.replace(block_size=64).key()


def test_unknown_spec_field() -> None:
    with pytest.raises(SpecError, match=r"spec\.json: unknown field\(s\) blok_size; accepted: arrival_rate, "):
        EngineSpec.from_json({"model": "tiny-llama", "blok_size": 16}, "spec.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "gpt-9"}, "spec field 'model': unknown model 'gpt-9'"),
        ({"workload": "nope"}, "spec field 'workload' = 'nope' is not accepted; accepted: fixed, "),
        ({"block_size": 24}, "spec field 'block_size' = 24 is not accepted; accepted: 16, 32, 64, 128"),
        ({"kv_cache_dtype": "int2"}, "spec field 'kv_cache_dtype' = 'int2' is not accepted"),
        ({"kv_budget_gib": 0.0001}, "spec field 'kv_budget_gib' = 0.0001 is too small: one request of max_model_len"),
        ({"workload_params": {"prompt": 3}}, "spec field 'workload': workload 'fixed': "),
    ],
)
def test_bad_specs_fail_before_an_engine_starts(changes: dict[str, object], message: str) -> None:
    spec = EngineSpec(model="tiny-llama", block_size=32).replace(**changes)
    with pytest.raises(SpecError) as info:
        validate(spec, ROOT, tier="gpu")
    assert message in str(info.value)


def test_cpu_backend_limits() -> None:
    assert cpu_backend_problem(EngineSpec(model="m", block_size=16), use_mla=False) == (
        "spec field 'block_size' = 16: vLLM's CPU attention backend needs a multiple of 32 (accepted here: 32, 64, 128)"
    )
    # An MLA block size some CPU runs is the machine's question (kernel_problem), not the spec's.
    assert cpu_backend_problem(EngineSpec(model="m", block_size=64), use_mla=True) is None
    assert "16 (CPU_MLA) or a multiple of 32" in (cpu_backend_problem(EngineSpec(model="m", block_size=24),
                                                                       use_mla=True) or "")
    assert "fp8" in (cpu_backend_problem(EngineSpec(model="m", kv_cache_dtype="fp8"), use_mla=True) or "")
    assert cpu_backend_problem(EngineSpec(model="m", block_size=32), use_mla=False) is None


def _workers() -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"vramgate.engine.worker" in cmd and b"fake-worker" in cmd:
                out.append(int(pid))
    return out


@pytest.fixture
def fake_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``vramgate.engine.worker`` on PYTHONPATH whose behaviour the test chooses."""
    pkg = tmp_path / "fake-worker" / "vramgate" / "engine"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr("vramgate.engine.runner.validate", lambda spec, root, tier=None: None)
    return pkg


def _run(fake: Path, tmp_path: Path, code: str, timeout: float = 30) -> None:
    (fake / "worker.py").write_text(code)
    spec = EngineSpec(model="tiny-llama", block_size=32, timeout_s=timeout)
    run_engine(spec, ROOT, tmp_path / "run", extra_pythonpath=[fake.parent.parent])


def test_crash_carries_the_log_tail(fake_worker: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError) as info:
        _run(fake_worker, tmp_path, "print('loading model'); raise SystemExit('CUDA out of memory (simulated)')")
    text = str(info.value)
    assert "engine for tiny-llama exited with status 1" in text
    assert "loading model" in text and "CUDA out of memory (simulated)" in text
    assert info.value.run_dir == tmp_path / "run"


def test_killed_engine_is_reported_as_possible_oom(fake_worker: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"was killed by SIGKILL \(out of memory\?\)"):
        _run(fake_worker, tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")


def test_timeout_kills_the_whole_process_group(fake_worker: Path, tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', 'vramgate.engine.worker', "
        "'fake-worker'])\n"
        "print('engine core started', flush=True); time.sleep(600)\n"
    )
    # 8 s: on a loaded 2-core machine starting Python and its child can take a few seconds.
    with pytest.raises(EngineError, match="timed out after 8 s and was killed") as info:
        _run(fake_worker, tmp_path, code, timeout=8)
    assert "engine core started" in str(info.value)
    # SIGKILL reached the whole group, and the runner returned only once its last member was gone.
    assert _workers() == []


def test_missing_result_is_an_error(fake_worker: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="left no readable result"):
        _run(fake_worker, tmp_path, "pass")


def test_caches_and_temp_files_stay_in_the_run_folder(
    fake_worker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # as an in-process simulator run leaves it
    code = (
        "import json, os, sys\n"
        "keys = ['VLLM_CACHE_ROOT', 'VLLM_CONFIG_ROOT', 'HF_HOME', 'TMPDIR', 'HF_HUB_OFFLINE', 'OMP_NUM_THREADS',"
        " 'VLLM_ENABLE_V1_MULTIPROCESSING', 'VLLM_LOGGING_LEVEL']\n"
        "env = {k: os.environ.get(k) for k in keys}\n"
        f"json.dump({{**{FAKE_RESULT!r}, 'notes': [env]}}, open(sys.argv[2], 'w'))\n"
    )
    (fake_worker / "worker.py").write_text(code)
    result = run_engine(EngineSpec(model="tiny-llama", block_size=32), ROOT, tmp_path / "run",
                        extra_pythonpath=[fake_worker.parent.parent])
    env = result.notes[0]
    run = str(tmp_path / "run")
    for key in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "HF_HOME", "TMPDIR"):
        assert env[key].startswith(run), (key, env[key])
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_LOGGING_LEVEL"] == "INFO", "the engine's log is evidence: it must keep vLLM's INFO lines"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def _two_looks() -> PairedDefaults:
    """The CPU tier's paired settings with two looks at most and no screen (the GPU tier's rule, Note [second look])."""
    import dataclasses

    from vramgate.engine import paired_defaults

    return dataclasses.replace(paired_defaults("cpu"), screen=None, looks=2)


class _FakeLooks:
    """Looks of paired engines whose candidate is *shifts[i]* slower than the reference in the i-th look."""

    def __init__(self, *shifts: float) -> None:
        import random

        self.shifts, self.calls, self.rng = list(shifts), [], random.Random(3)

    def take(self, n: int) -> tuple[list[float], list[float]]:
        shift = self.shifts[n]
        self.calls.append(n)
        ref = [0.01 * self.rng.lognormvariate(0, 0.02) for _ in range(30)]
        return ref, [0.01 * (1 + shift) * self.rng.lognormvariate(0, 0.02) for _ in range(30)]


@pytest.mark.parametrize(("shifts", "rounds", "worse"), [((0.0,), 30, False), ((0.11, 0.0), 30, False),
                                                          ((0.15, 0.15), 60, True)])
def test_a_failing_first_look_is_confirmed_by_a_second(shifts: tuple[float, ...], rounds: int, worse: bool) -> None:
    """Note [second look]: a passing first look is the verdict; after a failing one, a second look that passes is
    (its rounds), and one that fails too is judged again with the pooled rounds of both."""
    from vramgate.core.stats import compare_pairs
    from vramgate.engine import confirmed_rounds

    settings = _two_looks()
    fake = _FakeLooks(*shifts)
    ref, cand, lines = confirmed_rounds(fake.take, settings)
    assert fake.calls == list(range(len(shifts))) and len(ref) == len(cand) == rounds
    assert lines[0].startswith("first look: 30 pairs, median ratio") and ("worse" in lines[0])
    if len(shifts) > 1:
        assert lines[1].startswith("second look: 30 pairs") and len(lines) == 3
        assert lines[2].startswith("pooled (the verdict): 60 pairs" if worse else "the verdict: the second look")
    verdict = compare_pairs(ref, cand, better="lower", tolerance=settings.tolerance, alpha=settings.alpha)
    assert verdict.regressed is worse


def test_a_further_check_that_fails_takes_the_second_look() -> None:
    """The history check and the noise guard (``also``) can ask for the second look as the in-run check does; their
    lines follow each look's, and a second look where they pass is the verdict."""
    from vramgate.engine import confirmed_rounds

    seen: list[int] = []

    def also(stat: str, ref: Sequence[float], cand: Sequence[float]) -> list[tuple[str, bool]]:
        seen.append(len(ref))
        return [(f"against the baseline: {len(ref)} rounds", len(seen) == 1)]

    fake = _FakeLooks(0.0, 0.0)
    ref, _, lines = confirmed_rounds(fake.take, _two_looks(), also=also)
    assert fake.calls == [0, 1] and len(ref) == 30 and seen == [30, 30]
    assert lines[1] == "first look, against the baseline: 30 rounds"
    assert [line.split(":")[0] for line in lines] == [
        "first look", "first look, against the baseline", "second look", "second look, against the baseline",
        "the verdict"]


def test_a_run_that_records_the_baseline_pools_two_engine_pairs() -> None:
    """Note [baselines of two engine pairs]: where the first look's rounds would become the stored baseline, the
    second look is taken although the first passed, and the pooled rounds of both are the verdict (and so the
    baseline); where nothing is recorded a passing first look stays the verdict."""
    from vramgate.engine import confirmed_rounds, paired_defaults

    asked: list[int] = []

    def records(stat: str, ref: Sequence[float], cand: Sequence[float]) -> bool:
        asked.append(len(ref))
        return True

    fake = _FakeLooks(0.0, 0.0)
    ref, cand, lines = confirmed_rounds(fake.take, paired_defaults("cpu"), records=records)  # screened, three at most
    assert fake.calls == [0, 1] and len(ref) == len(cand) == 60 and asked == [30]  # asked of the first look only
    assert lines[1].startswith("recording a baseline: a second look (fresh engines) taken")
    assert lines[-1].startswith("pooled (the verdict): 60 pairs") and "not worse" in lines[-1]
    fake = _FakeLooks(0.0)
    ref, _, lines = confirmed_rounds(fake.take, paired_defaults("cpu"), records=lambda *_: False)
    assert fake.calls == [0] and len(ref) == 30 and len(lines) == 1
    fake = _FakeLooks(0.06, 0.0, 0.0)  # a first look past the CPU tier's screen: three engine pairs in the baseline
    ref, _, lines = confirmed_rounds(fake.take, paired_defaults("cpu"), records=records)
    assert fake.calls == [0, 1, 2] and len(ref) == 90
    assert lines[1].startswith("recording a baseline: two more looks (fresh engines) taken")


@pytest.mark.parametrize(("shifts", "rounds", "worse"), [
    ((0.04,), 30, False),                # under the screen: the first look is the verdict
    ((0.06, 0.0, 0.0), 90, False),       # past the screen, not the tolerance: three looks, pooled, pass
    ((0.16, 0.0, 0.0), 90, False),       # one engine pair slow for its whole life: the pooled median stands it
    ((0.06, 0.10, 0.10), 90, True),      # a regression the first look saw only past the screen: caught
    ((0.12, 0.10, 0.0), 90, True),       # two pairs of three past the tolerance: the pooled median is past it
])
def test_three_looks_pool_the_rounds_of_three_engine_pairs(shifts: tuple[float, ...], rounds: int,
                                                             worse: bool) -> None:
    """Note [three looks]: a first look that passes the screen (5% where the tolerance is 7.5%) is the verdict; one
    that does not is followed by two looks with fresh engines, and the pooled rounds of all three are the verdict,
    judged at the tolerance."""
    from vramgate.core.stats import compare_pairs
    from vramgate.engine import confirmed_rounds, paired_defaults

    settings = paired_defaults("cpu")
    assert settings.looks == 3 and settings.screen is not None and settings.screen < settings.tolerance
    fake = _FakeLooks(*shifts)
    ref, cand, lines = confirmed_rounds(fake.take, settings)
    assert fake.calls == list(range(len(shifts))) and len(ref) == len(cand) == rounds
    assert lines[0].startswith("first look (screened): 30 pairs") and f"tolerance {settings.screen:.1%}" in lines[0]
    if len(shifts) == 1:
        assert len(lines) == 1 and lines[0].endswith(": not worse")
    else:
        assert [line.split(":")[0] for line in lines] == ["first look (screened)", "second look", "third look",
                                                          "pooled (the verdict)"]
        assert lines[0].endswith(": worse") and f"tolerance {settings.tolerance:.1%}" in lines[3]
        assert lines[3].endswith(": worse" if worse else ": not worse")
    verdict = compare_pairs(ref, cand, better="lower", tolerance=settings.tolerance, alpha=settings.alpha)
    assert verdict.regressed is worse


def test_the_settings_refuse_a_screen_above_the_tolerance_and_other_numbers_of_looks() -> None:
    """A screen past the tolerance would let a failing first look stand as the verdict; one look is no confirmation,
    four are not a rule anything was calibrated for."""
    import dataclasses

    from vramgate.engine import paired_defaults
    from vramgate.engine.looks import looks_until_verdict

    settings = paired_defaults("cpu")
    with pytest.raises(ValueError, match="screen"):
        dataclasses.replace(settings, screen=settings.tolerance * 2)
    with pytest.raises(ValueError, match="2 or 3 looks"):
        dataclasses.replace(settings, looks=4)
    with pytest.raises(ValueError, match="2 or 3 looks"):
        looks_until_verdict(lambda n: {}, {"step": 0.1}, 0.05, looks=1)


def test_vllms_ipc_sockets_fit_a_unix_socket_path_under_a_deep_run_folder(tmp_path: Path) -> None:
    """Note [IPC socket path]: a tensor-parallel engine's message queues (and a server's engine core) bind
    ``ipc://{VLLM_RPC_BASE_PATH}/{uuid4}``; under the run's own temporary folder that is past 107 bytes."""
    import uuid

    from vramgate.engine import engine_process_env
    from vramgate.runtime.vllm_env import UNIX_SOCKET_PATH_MAX

    deep = tmp_path / "pytest-of-runner" / "pytest-123" / "engine0" / ("tiny-llama-" + "0" * 16)
    env = engine_process_env(EngineSpec(model="tiny-llama", tensor_parallel_size=2), deep)
    assert len(f"{env['VLLM_RPC_BASE_PATH']}/{uuid.uuid4()}") <= UNIX_SOCKET_PATH_MAX
    assert len(f"{env['TMPDIR']}/{uuid.uuid4()}") > UNIX_SOCKET_PATH_MAX  # vLLM's default would not fit
    assert Path(env["VLLM_RPC_BASE_PATH"]).is_dir()


def test_the_further_looks_of_a_paired_step_test_share_one_quiet_section(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """A first look past the CPU tier's screen is followed by two looks of fresh engines (a new pair each) inside one
    quiet section, entered once and left after the last look; the verdict's 90 rounds are recorded with the looks."""
    import contextlib
    import random
    from types import SimpleNamespace

    from vramgate.testing import engines as module

    rng = random.Random(4)
    started: list[str] = []
    events: list[str] = []

    class FakeEngines:
        def __init__(self, reference: object, candidate: object, root: Path, run_dir: Path, **_: object) -> None:
            started.append(run_dir.name)

        def __enter__(self) -> FakeEngines:
            events.append(f"start {started[-1]}")
            return self

        def __exit__(self, *exc: object) -> None:
            events.append(f"close {started[-1]}")

        def run(self, rounds: int, **_: object) -> SimpleNamespace:
            shift = 0.06 if len(started) == 1 else 0.0  # past the 5% screen, then unchanged
            ref = [0.01 * rng.lognormvariate(0, 0.02) for _ in range(rounds)]
            cand = [r * (1 + shift) * rng.lognormvariate(0, 0.02) for r in ref]
            return SimpleNamespace(stats=lambda stat: (ref, cand), answers=lambda: RoundAnswers(False, 2 * rounds))

    @contextlib.contextmanager
    def fake_quiet() -> Iterator[str]:
        events.append("quiet")
        yield "quiet: waited 0.0 s"
        events.append("loud")

    recorded: dict[str, object] = {}
    gate = SimpleNamespace(paired_checks=lambda *a, **k: [], writes_paired_baseline=lambda *a, **k: False,
                           record_paired=lambda name, ref, cand, **k: recorded.update(name=name, n=len(ref), **k),
                           claim=lambda statement, **k: recorded.update(claim=statement, **k))
    sections: list[tuple[str, str, str]] = []
    request = SimpleNamespace(node=SimpleNamespace(add_report_section=lambda *a: sections.append(a)))
    monkeypatch.setattr(module, "engine_tier", lambda: "cpu")
    monkeypatch.setattr(module, "PairedEngines", FakeEngines)
    monkeypatch.setattr(module.quiet, "quiet", fake_quiet)
    module.record_paired_step(gate, EngineSpec(model="tiny-llama"), EngineSpec(model="tiny-llama"), request,
                              project_root=ROOT, run_dir=tmp_path, cache_root=tmp_path / "cache")
    assert started == ["look-0", "look-1", "look-2"]
    assert events == ["start look-0", "close look-0", "quiet", "start look-1", "close look-1", "start look-2",
                      "close look-2", "loud"]
    assert recorded["n"] == 90 and recorded["name"] == "step_ratio"
    # Note [round answers]: on dummy weights the row says the rounds' answers were not judged, over every look
    assert recorded["judged"] is False and "outputs not judged: dummy weights (tiny-llama" in str(recorded["evidence"])
    lines = sections[0][2].splitlines()
    assert lines[0].startswith("first look (screened)") and lines[-1] == "further looks, quiet: waited 0.0 s"
    assert any(line.startswith("pooled (the verdict): 90 pairs") for line in lines)


def _round(tokens: list[list[int]] | None) -> object:
    from vramgate.engine.paired import Round

    return Round(ttft_s=[0.1], tpot_s=[0.01], e2e_s=[0.2], steps_s=[0.01], wall_s=0.3, token_ids=tokens)


def test_round_answers_hold_every_round_of_both_engines_to_the_references_first() -> None:
    """Note [round answers]: the same tokens everywhere hold; a candidate round that differs is named with request
    and position; a reference that changes from round to round is the reference's; a round without tokens (dummy
    weights) leaves the answers not judged."""
    same = [[5, 6, 7], [8, 9]]
    held = round_answers([_round(same)] * 3, [_round(same)] * 3)
    assert held.judged and held.first_difference is None and held.rounds == 6
    other = round_answers([_round(same)] * 3, [_round(same), _round([[5, 6, 7], [8, 4]])])
    assert other.candidate_differs and other.first_difference == (
        "candidate round 1: request 1, position 1: 4, the reference's first round 9")
    unstable = round_answers([_round(same), _round([[5, 1, 7], [8, 9]])], [_round(same)])
    assert not unstable.candidate_differs and unstable.first_difference.startswith("reference round 1: request 0")
    assert not round_answers([_round(None)], [_round(same)]).judged
    merged = held.merge(other)
    assert merged.rounds == 11 and merged.candidate_differs and merged.first_difference == other.first_difference
    from vramgate.engine.paired import Round

    assert Round.from_json({"ttft_s": [], "tpot_s": [], "e2e_s": [], "steps_s": [], "wall_s": 1.0,
                            "token_ids": [[1, 2]]}, "r").token_ids == [[1, 2]]


def test_tensor_parallel_on_cpu_binds_a_core_per_rank_or_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramgate.testing import engines

    monkeypatch.setattr(engines, "engine_tier", lambda: "cpu")
    spec = EngineSpec(model="recall-llama", env={"X": "1"})
    monkeypatch.setattr(engines.os, "sched_getaffinity", lambda pid: {3, 1}, raising=False)
    parallel, problem = engines.tensor_parallel_spec(spec, 2)
    assert problem is None and parallel.tensor_parallel_size == 2
    assert parallel.env == {"X": "1", "VLLM_CPU_OMP_THREADS_BIND": "1|3"}
    monkeypatch.setattr(engines.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    _, problem = engines.tensor_parallel_spec(spec, 2)
    assert problem == "tensor parallelism 2 on CPU needs 2 cores, one per rank; this process has 1"
