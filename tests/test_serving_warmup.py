"""The settled warm-up and the memory verdict end to end without vLLM: the gate's own load client
(:mod:`vramgate.engine.load_client`) drives a stand-in of vLLM's benchmark client against a stand-in server whose
resident memory follows a chosen law, and ``test_serving_memory`` itself judges it (Note [settled warm-up] in
:mod:`vramgate.engine.leak`, Note [leak fit] in :mod:`vramgate.core.leak`).

The stand-in server keeps, and touches, memory as requests complete: a fresh server's growth over its first
requests that then stops (a warm-up), or a leak per request or per output token that never stops.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from serving_standin import HEALTH, RESULT, Pool
from vramgate.core.checks import check_budget
from vramgate.engine import EngineSpec, leak, load
from vramgate.engine.load import Load, LoadRun
from vramgate.engine.server import ApiServer
from vramgate.matrix import ServingLoad
from vramgate.pytest_plugin.fixture import Gate

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
#: The shape sweep's requests before the warm-up chunks (Note [settled warm-up] in vramgate.engine.leak).
SHAPES = leak.WarmUp().shapes

SERVER = """
import http.server, json, os, sys, threading, time
cfg = json.load(open(sys.argv[1]))
law = json.loads(os.environ["STAND_IN_LAW"])
count = os.environ["STAND_IN_COUNT"] + "-" + str(cfg["port"])
kept = []


def grow():
    held = 0
    while True:
        try:
            requests, tokens = (int(v) for v in open(count).read().split())
        except (OSError, ValueError):
            requests, tokens = 0, 0
        want = (min(requests, law["warm_requests"]) * law["warm_bytes"] + requests * law["per_request"]
                + tokens * law["per_token"])
        if want > held:
            kept.append(b"\\x5a" * (want - held))
            held = want
        time.sleep(0.01)


threading.Thread(target=grow, daemon=True).start()
""" + HEALTH

#: vLLM's benchmark client, as the gate's load client imports it: each request "completes" every few
#: milliseconds and counts itself (and its output tokens) where the stand-in server reads it.
SERVE = """
import argparse, os, time
""" + RESULT + """
COUNT = os.environ["STAND_IN_COUNT"]
done = {}


def add_cli_args(parser):
    for name in ("--backend", "--host", "--port", "--endpoint", "--model", "--tokenizer", "--num-prompts",
                 "--request-rate", "--burstiness", "--seed", "--percentile-metrics", "--metric-percentiles",
                 "--label", "--temperature", "--dataset-name", "--random-input-len", "--random-output-len",
                 "--random-range-ratio", "--max-concurrency"):
        parser.add_argument(name)
    for flag in ("--ignore-eos", "--disable-tqdm", "--save-detailed"):
        parser.add_argument(flag, action="store_true")


def main(args):
    n, out = int(args.num_prompts), int(args.random_output_len)
    count = COUNT + "-" + args.port  # each server counts its own requests
    mine = done.setdefault(count, [0, 0])
    t0 = time.perf_counter()
    starts, latencies = [], []
    for _ in range(n):
        s = time.perf_counter()
        time.sleep(0.006)
        mine[0] += 1
        mine[1] += out
        with open(count + ".tmp", "w") as f:
            f.write(f"{mine[0]} {mine[1]}")
        os.replace(count + ".tmp", count)
        starts.append(s)
        latencies.append(time.perf_counter() - s)
    return result_of(n, t0, starts, latencies, out)
"""


def _stand_in(tmp_path: Path, *, warm_bytes: int = 0, warm_requests: int = 0, per_request: int = 0,
              per_token: int = 0, count: Path | None = None) -> EngineSpec:
    """A serving spec whose interpreter runs the stand-in server, and the gate's real load client over the
    stand-in benchmark client; the server's memory follows the law given. *count*: where the client counts each
    server's requests (servers of one plan share it; default in *tmp_path*)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    fake_vllm = tmp_path / "fake-vllm"
    (fake_vllm / "vllm" / "benchmarks").mkdir(parents=True)
    (fake_vllm / "vllm" / "utils").mkdir(parents=True)
    for pkg in ("vllm", "vllm/benchmarks", "vllm/utils"):
        (fake_vllm / pkg / "__init__.py").write_text("")
    (fake_vllm / "vllm" / "benchmarks" / "serve.py").write_text(SERVE)
    (fake_vllm / "vllm" / "utils" / "argparse_utils.py").write_text(
        "import argparse\nFlexibleArgumentParser = argparse.ArgumentParser\n")
    (tmp_path / "server.py").write_text(SERVER)
    law = json.dumps({"warm_bytes": warm_bytes, "warm_requests": warm_requests, "per_request": per_request,
                      "per_token": per_token})
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        export STAND_IN_COUNT={count or tmp_path / 'completed'} STAND_IN_LAW='{law}'
        export PYTHONPATH={fake_vllm}:{ROOT / 'src'}
        case "$2" in
          vramgate.engine.api_server) exec {sys.executable} {tmp_path / 'server.py'} "$3" ;;
          vramgate.engine.load_client) exec {sys.executable} -m vramgate.engine.load_client "$3" ;;
        esac
        exit 2
    """))
    fake.chmod(0o755)
    return EngineSpec(model="tiny-llama", block_size=32, kv_budget_gib=None, cpu_memory_bytes=1 << 30,
                      gpu_memory_utilization=0.5, python=str(fake))


@pytest.fixture
def suite() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("suite_serving_warmup", ROOT / "suites/serving/test_serving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _memory_test(suite: types.ModuleType, spec: EngineSpec, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[Gate, LoadRun]:
    """``test_serving_memory`` on the stand-in: 600 sustained requests of 32 output tokens at concurrency 8 (warm-up
    chunks of 40), sampled every 20 ms."""
    monkeypatch.setattr(load, "SAMPLE_EVERY_S", 0.02)
    gate = Gate("suites/serving/test_serving.py::test_serving_memory[tiny-llama]", "serving")
    case = types.SimpleNamespace(entry=types.SimpleNamespace(load=ServingLoad(
        request_rates=(4.0,), sustained_requests=600, sustained_concurrency=8)), engine_spec=lambda base: base)
    with ApiServer(spec, ROOT, tmp_path / "server", start_timeout_s=30) as server:
        pool = Pool(server)
        suite.test_serving_memory(gate, pool, "tiny-llama", case, tmp_path / "test")
    (run,) = pool.runs
    return gate, run


def test_the_warm_up_stops_once_the_memory_settles_and_its_growth_is_not_read_as_a_leak(
        suite: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server grows 1 MiB per request over its first 100 requests after the shape sweep (100 MiB: a fresh
    server's arenas), then nothing: the warm-up runs until two chunks after that, the client skips the rest, and
    the slope passes. The sweep ran first, one request at a time, its prompt lengths spread."""
    spec = _stand_in(tmp_path, warm_bytes=MIB, warm_requests=100 + SHAPES)
    gate, run = _memory_test(suite, spec, tmp_path, monkeypatch)
    chunks = len(run.warmups[0])
    assert 4 <= chunks < run.warmup.most if run.warmup else False
    plan_dir = tmp_path / "test" / "load"
    skipped = [p for p in sorted(plan_dir.glob("load-*.json")) if json.loads(p.read_text()).get("skipped")]
    assert len(skipped) == run.warmup.most - chunks  # the client was told, and skipped them
    assert run.warmup.settled(run.warmup_levels[0])
    assert run.warmup_note(0)["warm_up"].startswith(f"a shape sweep of {SHAPES} requests, then warm-up settled after "
                                                    f"{chunks} chunks of 40 requests")
    assert run.warmup_note(0)["warm_up_requests"] == SHAPES + 40 * chunks
    (sweep,) = run.sweeps[0]
    assert sweep.completed == SHAPES and sweep.load.max_concurrency == 1 and sweep.load.input_spread > 0.5
    slope = gate.metrics["memory_slope"]
    assert slope.fit is not None and slope.fit.warmup and check_budget(slope) is None, slope
    assert abs(slope.value) < 4 * MIB  # the 100 MiB of the warm-up is not in it


def test_a_leak_per_request_never_settles_and_fails_with_its_bound_and_floor(
        suite: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB kept per request: the warm-up runs all its chunks, and the slope's bound is above the allowance."""
    spec = _stand_in(tmp_path, per_request=64 * 1024)
    gate, run = _memory_test(suite, spec, tmp_path, monkeypatch)
    assert run.warmup is not None and len(run.warmups[0]) == run.warmup.most
    assert "had not settled" in run.warmup_note(0)["warm_up"]
    slope = gate.metrics["memory_slope"]
    assert slope.value == pytest.approx(64 * MIB, rel=0.1)
    problem = check_budget(slope)
    assert problem is not None and "lower bound" in problem and "with 95% detection" in problem, problem


def test_a_leak_per_output_token_shows_in_the_slope_per_token(
        suite: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 KiB kept per output token (128 KiB per request of 32 tokens): the slope per 1,000 tokens reads 4 MiB and
    fails too."""
    spec = _stand_in(tmp_path, per_token=4 * 1024)
    gate, _ = _memory_test(suite, spec, tmp_path, monkeypatch)
    per_token = gate.metrics["memory_slope_per_token"]
    assert per_token.unit == "B/1k tokens" and per_token.value == pytest.approx(4 * MIB, rel=0.1)
    assert check_budget(per_token) is not None


@dataclass
class _Pair:
    """The ``servers`` fixture's stand-in for a paired test: a server per profile (None: the unpatched one)."""

    by_profile: dict[str | None, ApiServer]
    runs: list[LoadRun] = field(default_factory=list)

    def get(self, spec: EngineSpec) -> ApiServer:
        return self.by_profile[spec.profile or None]  # the reference is UNPATCHED (Note [the unpatched reference])

    def plan(self, items: list[tuple[int, Load, str]], servers: list[ApiServer], run_dir: Path, *,
             warmup: leak.WarmUp | None = None) -> LoadRun:
        self.runs.append(load.run_plan(items, servers, run_dir, warmup=warmup))
        return self.runs[-1]


@pytest.mark.parametrize("candidate_leak", [0, 64 * 1024], ids=["same", "leaks-64k"])
def test_the_paired_slope_judges_the_profiles_server_over_the_unpatched_one(
        suite: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, candidate_leak: int) -> None:
    """``test_serving_memory_paired``: both servers warm up until settled (100 MiB over their first 100 requests),
    then take chunks in turn; a candidate keeping 64 KiB per request more fails on the difference's bound, one that
    grows alike passes."""
    monkeypatch.setattr(load, "SAMPLE_EVERY_S", 0.02)
    monkeypatch.setattr(suite, "PAIRED_MEMORY_ROUNDS", 6)
    monkeypatch.setattr(suite, "skip_unmet", lambda profile: None)
    monkeypatch.setattr(suite, "engine_tier", lambda: "cpu")
    monkeypatch.setattr(suite, "runnable_candidate", lambda ref, profile, mla: ref.replace(profile=profile.name))
    count = tmp_path / "completed"
    ref_spec = _stand_in(tmp_path / "ref", warm_bytes=MIB, warm_requests=100 + SHAPES, count=count)
    cand_spec = _stand_in(tmp_path / "cand", warm_bytes=MIB, warm_requests=100 + SHAPES, per_request=candidate_leak,
                          count=count)
    gate = Gate("suites/serving/test_serving.py::test_serving_memory_paired[plant]", "serving")
    with ApiServer(ref_spec.replace(profile=None), ROOT, tmp_path / "a", start_timeout_s=30) as a, \
            ApiServer(cand_spec.replace(profile=None), ROOT, tmp_path / "b", start_timeout_s=30) as b:
        pool = _Pair({None: a, "plant": b})
        suite.test_serving_memory_paired(gate, pool, lambda model: types.SimpleNamespace(use_mla=False),
                                         types.SimpleNamespace(name="plant", checkpoint=None), tmp_path / "test")
    (run,) = pool.runs
    assert all(3 <= len(w) <= 8 for w in run.warmups), run.warmup_levels  # 100 MiB over 100 requests, then flat
    assert all(len(r) == 6 for r in run.results)
    metric = gate.metrics["memory_slope_difference"]
    assert metric.fit is not None and [c["server"] for c in gate.conditions] == ["reference", "candidate"]
    if candidate_leak:
        assert metric.value == pytest.approx(64 * MIB, rel=0.15)
        assert "lower bound" in (check_budget(metric) or ""), metric
    else:
        assert abs(metric.value) < 8 * MIB and check_budget(metric) is None, metric
