"""Online serving without an engine: the server's command line, the client's, the client's result, the memory
slope, the matrix's ``[entries.load]``, budget-only figures, and a server that never comes up or whose gate dies.

The real server and client run in ``tests/test_serving_online.py`` (cpu-full).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vramgate.engine import EngineSpec
from vramgate.engine.api_server import serve_argv
from vramgate.engine.leak import MemorySample, WarmUp, chunk_level, memory_slope, paired_slope
from vramgate.engine.load import Load, LoadResult, client_argv, write_timed_trace
from vramgate.engine.paired_load import PairedBursts, PairedLoadSettings
from vramgate.engine.server import ApiServer, ServerError
from vramgate.machine.probes.cpu import group_members
from vramgate.matrix import MatrixError, parse_matrix
from vramgate.runtime import process

ROOT = Path(__file__).resolve().parents[1]

OPTIONS = {"--model", "--host", "--port", "--served-model-name", "--tokenizer", "--block-size", "--enforce-eager",
           "--no-enforce-eager", "--enable-prefix-caching", "--no-enable-prefix-caching", "--disable-log-stats",
           "--compilation-config", "--gpu-memory-utilization"}


def test_the_server_command_line_spells_each_engine_argument_as_vllm_parses_it(tmp_path: Path) -> None:
    argv = serve_argv({"model": "x", "skip_tokenizer_init": True, "block_size": 32, "enforce_eager": False,
                       "enable_prefix_caching": True, "disable_log_stats": False, "gpu_memory_utilization": 0.25,
                       "compilation_config": {"cudagraph_mode": "FULL"}, "attention_backend": None},
                      tmp_path, host="127.0.0.1", port=8123, served_name="tiny-llama", options=OPTIONS)
    assert argv[:10] == ["--model", str(tmp_path), "--host", "127.0.0.1", "--port", "8123", "--served-model-name",
                         "tiny-llama", "--tokenizer", str(tmp_path)]
    rest = argv[10:]
    assert "--no-enforce-eager" in rest and "--enable-prefix-caching" in rest
    assert "--disable-log-stats" not in rest  # a switch that only turns on: False is its default
    assert rest[rest.index("--block-size") + 1] == "32"
    assert json.loads(rest[rest.index("--compilation-config") + 1]) == {"cudagraph_mode": "FULL"}
    assert "--skip-tokenizer-init" not in rest  # the server loads the tokenizer the client uses
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=.*no option --kv-cache-memory-bytes"):
        serve_argv({"kv_cache_memory_bytes": 1}, tmp_path, host="h", port=1, served_name="m", options=OPTIONS)


class _FakeServer:
    port = 8123
    served_name = "tiny-llama"
    model_dir = Path("/m")


def test_the_client_command_line_is_vllm_bench_serve() -> None:
    load = Load(num_prompts=40, request_rate=4.0, max_concurrency=8, goodput={"ttft": 250.0, "tpot": 50.0})
    argv = client_argv(load, _FakeServer(), label="x")  # type: ignore[arg-type]
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--port"] == "8123" and pairs["--model"] == "tiny-llama" and pairs["--tokenizer"] == "/m"
    assert pairs["--request-rate"] == "4.0" and pairs["--num-prompts"] == "40" and pairs["--max-concurrency"] == "8"
    assert pairs["--dataset-name"] == "random" and pairs["--random-input-len"] == "64"
    assert argv[argv.index("--goodput") + 1:argv.index("--goodput") + 3] == ["tpot:50", "ttft:250"]
    assert "--save-detailed" in argv and "--ignore-eos" in argv
    trace = client_argv(Load(trace="/t.jsonl"), _FakeServer(), label="y")  # type: ignore[arg-type]
    assert trace[trace.index("--dataset-name") + 1] == "timed_trace" and "--random-input-len" not in trace
    assert "inf" in client_argv(Load(), _FakeServer(), label="z")  # type: ignore[arg-type]
    assert pairs["--random-range-ratio"] == "0"  # every prompt of a load as long as the others
    spread = dict(itertools.pairwise(client_argv(Load(input_spread=0.95), _FakeServer(), label="s")))  # type: ignore[arg-type]
    assert spread["--random-range-ratio"] == "0.95"  # the shape sweep's (Note [settled warm-up])


def test_a_timed_trace_gives_each_request_its_own_prompt_after_a_shared_prefix(tmp_path: Path) -> None:
    path = write_timed_trace([(0.0, 40, 8), (0.5, 16, 4), (0.7, 48, 4)], tmp_path / "t.jsonl", prefix_lens=[0, 0, 32])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0.0, 0.5, 0.7] and rows[0]["input_length"] == 40
    own = 1 << 20
    assert rows[0]["hash_ids"] == [own, own + 1, own + 2] and rows[1]["hash_ids"] == [own + 3]  # 16-token chunks
    assert rows[2]["hash_ids"] == [0, 1, own + 4]  # two chunks of the shared prefix, then its own


def test_an_entrys_workload_becomes_the_clients_trace(tmp_path: Path) -> None:
    from vramgate.testing.serving import rate_load, workload_trace

    m = parse_matrix(LOAD_MATRIX.format(load="request_rates = [4]\nnum_prompts = 12", budgets="").replace(
        '[[entries]]', '[workloads.chat]\nbuiltin = "shared-prefix"\n\n[[entries]]').replace(
        'tier = "cpu"', 'tier = "cpu"\nworkload = "chat"'), "m")
    entry = m.entries[0]
    trace = workload_trace(entry, ROOT, tmp_path)
    assert trace is not None
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == 12 and all(r["input_length"] + r["output_length"] <= 2048 for r in rows)
    assert len({r["hash_ids"][0] for r in rows}) == 1  # the generator's shared prefix, shared by the client too
    assert entry.load is not None
    load = rate_load(entry.load, 4.0, trace)
    argv = client_argv(load, _FakeServer(), label="w")  # type: ignore[arg-type]
    assert argv[argv.index("--dataset-path") + 1] == str(trace) and "--no-self-timed" in argv
    assert workload_trace(parse_matrix(LOAD_MATRIX.format(load="request_rates = [4]", budgets=""), "m").entries[0],
                          ROOT, tmp_path) is None


def _client_result(n: int = 4, *, failed: int = 0) -> dict[str, object]:
    data: dict[str, object] = {
        "completed": n - failed, "failed": failed, "duration": 2.0, "request_throughput": 2.0,
        "output_throughput": 64.0, "request_goodput": 1.5,
        "ttfts": [0.01 * (i + 1) for i in range(n)], "latencies": [0.5 + 0.01 * i for i in range(n)],
        "start_times": [100.0 + i for i in range(n)], "output_lens": [32] * n,
        "errors": ["boom" if i < failed else "" for i in range(n)],
        "vramgate_t_start": 99.0, "vramgate_t_end": 105.0,
    }
    for lat in ("ttft", "tpot", "itl", "e2el"):
        for p in (50, 90, 99):
            data[f"p{p}_{lat}_ms"] = float(p)
    return data


def test_a_request_whose_tokens_came_together_is_counted_in_one_piece() -> None:
    """Note [streams in one piece]: a first token after 90% of the request's whole latency is a stream the client
    read whole; a one-token answer (first token = whole latency by nature) and a failed request are not counted."""
    data = _client_result(5, failed=1)
    data["ttfts"] = [0.9, 0.45, 0.449, 0.05, 0.5]  # the first is the failed one's
    data["latencies"] = [1.0, 0.5, 0.5, 0.5, 0.5]
    data["output_lens"] = [32, 32, 32, 32, 1]
    assert LoadResult.from_client(Load(num_prompts=5), data, "x").in_one_piece() == 1


def test_the_clients_result_is_read_into_seconds_and_per_request_figures() -> None:
    r = LoadResult.from_client(Load(num_prompts=4), _client_result(), "load-000.json")
    assert r.percentiles["ttft"][99] == pytest.approx(0.099) and r.median("tpot") == pytest.approx(0.05)
    assert r.goodput == pytest.approx(0.75) and r.completed == 4 and not r.errors
    assert r.tpot_s[0] == pytest.approx((0.5 - 0.01) / 31)
    assert r.completions_s == pytest.approx([100.5, 101.51, 102.52, 103.53])
    partial = LoadResult.from_client(Load(num_prompts=4), _client_result(failed=1), "x")
    assert partial.failed == 1 and partial.errors == ["boom"] and len(partial.ttft_s) == 3
    with pytest.raises(ServerError, match=r"load-001\.json: vLLM's benchmark client failed: ValueError: no"):
        LoadResult.from_client(Load(), {"error": "ValueError: no"}, "load-001.json")
    with pytest.raises(ServerError, match="not a result of vLLM's benchmark client"):
        LoadResult.from_client(Load(), {"completed": 1}, "x")


def _samples(rss: list[float]) -> list[MemorySample]:
    return [MemorySample(float(t), int(b)) for t, b in enumerate(rss)]


def test_the_memory_slope_is_bytes_per_thousand_requests_or_tokens_over_the_measured_part() -> None:
    """A request of 32 tokens completes every second; the warm-up (before the measured part starts at 10 s) is
    kept for the picture and not fitted."""
    done = [(float(t) + 0.5, 32) for t in range(100)]
    leak = _samples([3e9 + (t ** 0.5 * 1e8 if t < 10 else 0) + 1e6 * t for t in range(100)])
    slope = memory_slope(leak, done, 10.0)
    assert slope.per_1k == pytest.approx(1e9, rel=1e-6)  # 1 MB per request, after the warm-up
    assert slope.requests == 89 and slope.samples == 90 and len(slope.fit.warmup) == 10
    assert memory_slope(leak, done, 10.0, per="token").per_1k == pytest.approx(1e9 / 32, rel=1e-6)
    flat = _samples([3e9 + (4096 if t % 2 else 0) for t in range(100)])
    assert abs(memory_slope(flat, done, 10.0).per_1k) < 1e6
    with pytest.raises(ValueError, match="at least 8 completed requests"):
        memory_slope(flat, done[:5], 0.0)
    with pytest.raises(ValueError, match="at least 24 samples"):
        memory_slope(flat[:3], done, 0.0)


def test_the_warm_up_settles_when_a_chunk_rises_by_little() -> None:
    warmup = WarmUp(chunk=40, least=2, most=6, growth_per_request=16 * 1024)
    mib = float(1 << 20)
    assert not warmup.settled([100 * mib])  # fewer than least
    assert not warmup.settled([100 * mib, 140 * mib])  # 1 MiB per request
    assert warmup.settled([100 * mib, 100.5 * mib])  # 12.8 KiB per request
    assert warmup.settled([100 * mib, 140 * mib, 140.2 * mib, 140 * mib][:3])
    assert "settled after 3 chunks of 40 requests" in warmup.describe([100 * mib, 140 * mib, 140.2 * mib])
    assert "had not settled after 2" in warmup.describe([100 * mib, 140 * mib])
    with pytest.raises(ValueError, match="not a warm-up"):
        WarmUp(least=3, most=2)
    samples = _samples([1e9, 2e9, 3e9, 5e9, 4e9])
    assert chunk_level(samples, 0.0, 4.0) == 4e9  # the median of the second half: 3, 5 and 4 GB
    assert chunk_level(samples, 10.0, 12.0) is None


def _bursts(ref: list[float], cand: list[float], *, one_piece: int = 0) -> PairedBursts:
    """Bursts of four requests of 32 tokens whose TPOT is each value; the first *one_piece* requests of every
    candidate burst reached the client in one piece (their tokens together, at the end)."""
    def result(v: float, whole: int = 0) -> LoadResult:
        data = _client_result()
        ttfts = [0.01 * (i + 1) for i in range(4)]
        latencies = [t + 31 * v for t in ttfts]
        ttfts = [lat - 1e-5 if i < whole else t for i, (t, lat) in enumerate(zip(ttfts, latencies, strict=True))]
        data.update({"p50_tpot_ms": v * 1e3, "p50_ttft_ms": v * 1e3, "latencies": latencies, "ttfts": ttfts})
        return LoadResult.from_client(Load(), data, "x")

    return PairedBursts([result(v) for v in ref], [result(v, one_piece) for v in cand], ["ab"] * len(ref))


def test_a_bursts_tpot_is_the_median_of_the_requests_that_streamed() -> None:
    """Note [streams in one piece]: requests the client read whole leave the burst's TPOT; a round where every
    request of either side came in one piece leaves both sides' lists."""
    three = _bursts([0.010, 0.012], [0.011, 0.013], one_piece=3)
    assert three.medians("tpot") == (pytest.approx([0.010, 0.012]), pytest.approx([0.011, 0.013]))
    assert _bursts([0.010, 0.012], [0.011, 0.013], one_piece=4).medians("tpot") == ([], [])
    assert _bursts([0.010], [0.011], one_piece=4).medians("ttft") == ([0.010], [0.011])


def test_the_paired_check_under_load_looks_twice_before_it_fails() -> None:
    settings = PairedLoadSettings(rounds=8, tolerance={"tpot": 0.05, "ttft": 0.5}, alpha=0.05,
                                  history_tolerance={"tpot": 0.1, "ttft": 0.5})
    base = [0.010, 0.011, 0.0105, 0.0102, 0.0108, 0.0099, 0.0103, 0.0107]
    calls = []

    def same(rounds: int, seed: int) -> PairedBursts:
        calls.append(seed)
        return _bursts(base, base)

    lines, ref, _ = settings.judge(same)
    assert calls == [0] and len(ref["tpot"]) == 8 and all("not worse" in line for line in lines)
    calls.clear()

    def slower(rounds: int, seed: int) -> PairedBursts:
        calls.append(seed)
        return _bursts(base, [v * 1.2 for v in base])

    lines, ref, _ = settings.judge(slower)
    assert calls == [0, 1] and len(ref["tpot"]) == 16
    assert lines[-2].startswith("pooled (the verdict), tpot") and "worse" in lines[-2]


LOAD_MATRIX = """
[models.tiny-llama]
[[entries]]
suites = ["serving"]
model = "tiny-llama"
tier = "cpu"
[entries.serving]
cpu_memory = "2 GiB"
[entries.load]
{load}
[entries.budgets]
{budgets}
"""


def test_a_load_entry_reads_every_field() -> None:
    m = parse_matrix(LOAD_MATRIX.format(
        load='request_rates = [4, "inf"]\nnum_prompts = 20\nburstiness = 0.5\nmax_concurrency = 4\n'
             'slo = { ttft = "250 ms", tpot = "50 ms" }\nsustained_requests = 100\npaired_rounds = 10',
        budgets='memory_slope = "<= 1 MiB per 1000 requests"\nttft_p99 = "<= 250 ms"\ngoodput = ">= 0.95"'), "m")
    load = m.entries[0].load
    assert load is not None
    assert load.request_rates == (4.0, math.inf) and load.num_prompts == 20 and load.burstiness == 0.5
    assert load.max_concurrency == 4 and dict(load.slo) == {"ttft": 0.25, "tpot": 0.05}
    assert load.sustained_requests == 100 and load.paired_rounds == 10
    budgets = {b.metric: b for b in m.entries[0].budgets}
    assert budgets["memory_slope"].value == 1 << 20 and budgets["memory_slope"].unit == "B/1k requests"
    assert budgets["ttft_p99"].value == pytest.approx(0.25) and budgets["goodput"].op == ">="


@pytest.mark.parametrize(("load", "message"), [
    ("num_prompts = 10", r"entries\[0\]\.load\.request_rates: missing field"),
    ("request_rates = [0]", r"request_rates: must be positive"),
    ("request_rates = [4]\nslo = { ttft = \"250\" }", r"load\.slo: ttft must be a positive time"),
    ("request_rates = [4]\nslo = { itl = \"5 ms\" }", r"load\.slo: unknown SLO 'itl'"),
    ("request_rates = [4]\nnum_prompts = 2", r"load\.num_prompts: must be >= 8"),
    ("request_rates = [4]\nrate = 4", r"entries\[0\]\.load\.rate: unknown field"),
])
def test_load_errors_name_the_field(load: str, message: str) -> None:
    with pytest.raises(MatrixError, match=message):
        parse_matrix(LOAD_MATRIX.format(load=load, budgets=""), "m")


def test_a_serving_entry_needs_a_load_and_a_load_needs_the_serving_suite() -> None:
    without = LOAD_MATRIX.format(load="", budgets="").replace("[entries.load]\n", "")
    with pytest.raises(MatrixError, match=r"entries\[0\]\.load: missing table: the serving suite"):
        parse_matrix(without, "m")
    other = LOAD_MATRIX.format(load="request_rates = [4]", budgets="").replace('suites = ["serving"]',
                                                                              'suites = ["serving_capacity"]')
    with pytest.raises(MatrixError, match=r"entries\[0\]\.load: no suite of this entry puts a load"):
        parse_matrix(other, "m")


def test_a_budget_only_figure_is_held_to_its_budget_and_never_to_a_baseline(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fig="""
        import os

        def test_fig(gate):
            value = float(os.environ.get("FIG", "1"))
            gate.record("slope", value, unit="B", ceiling=10, scope="machine", history=False)
            gate.record("kept", 5, unit="B")
    """)
    pytester.runpytest_subprocess("--gate-update", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    stored = [json.loads(p.read_text()) for p in pytester.path.rglob("baselines/**/*.json")]
    names = {name for data in stored for test in data["tests"].values() for name in test["metrics"]}
    assert names == {"kept"}, stored  # the budget-only figure is never written into a baseline
    os.environ["FIG"] = "8"
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gate-report", "out")
        result.assert_outcomes(passed=1)
        os.environ["FIG"] = "11"
        failed = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        failed.assert_outcomes(failed=1)
        assert "slope" in failed.stdout.str() and "ceiling" in failed.stdout.str()
    finally:
        del os.environ["FIG"]
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    slope = next(m for t in report["tests"] for m in t["metrics"] if m["name"] == "slope")
    assert slope["verdict"] == "not compared", slope


def _stand_in(tmp_path: Path, script: str) -> EngineSpec:
    """A serving spec whose interpreter is a shell script standing in for vLLM's server (no vLLM here)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    return EngineSpec(model="tiny-llama", block_size=32, kv_budget_gib=None, cpu_memory_bytes=1 << 30,
                      gpu_memory_utilization=0.5, python=str(fake))


def test_a_server_that_exits_before_it_is_up_fails_with_its_log(tmp_path: Path) -> None:
    """No vLLM here: the serving subprocess fails at its first import, and the error says so with the log."""
    spec = _stand_in(tmp_path, "echo 'ValueError: the engine refused its arguments' >&2\nexit 3\n")
    server = ApiServer(spec, ROOT, tmp_path / "run", start_timeout_s=30)
    with pytest.raises(ServerError) as info:
        server.start()
    text = str(info.value)
    assert "exited with status 3 before it was up" in text and "the engine refused its arguments" in text
    assert server.proc is None  # stopped: nothing left


def test_a_server_that_never_answers_is_stopped_after_its_timeout(tmp_path: Path) -> None:
    spec = _stand_in(tmp_path, "echo listening nowhere\nexec sleep 60\n")
    server = ApiServer(spec, ROOT, tmp_path / "run", start_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(ServerError, match="was not healthy after 2 s"):
        server.start()
    assert time.monotonic() - started < 30
    assert server.proc is None


GUARDED = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from vramgate.runtime.process import end_with_parent
    end_with_parent()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the engine core, in the group
    print("up", flush=True)
    time.sleep(120)
""")


def test_a_server_whose_gate_is_killed_takes_its_process_group_with_it(tmp_path: Path) -> None:
    """Note [no child outlives its gate]: the gate (here a stand-in) is killed with SIGKILL; the server's group goes."""
    script = tmp_path / "server.py"
    script.write_text(GUARDED)
    gate = textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(process.PACKAGE_PARENT)!r})
        from pathlib import Path
        from vramgate.runtime import process
        child = process.launch([sys.executable, {str(script)!r}, {str(process.PACKAGE_PARENT)!r}],
                               Path({str(tmp_path / 'server.log')!r}), env=dict(__import__('os').environ),
                               cwd=Path({str(tmp_path)!r}))
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", gate], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pgid = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while len(group_members(pgid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(group_members(pgid)) == 2, "the stand-in server and its child did not start"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(pgid) == [], "the server's group outlived its gate"
    finally:
        proc.kill()


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(tmp_path: Path) -> None:
    """The first start fails with "Address already in use" (a stand-in server); the second, on a new port, too:
    two starts, and the error is the second's. A port the test gave is never changed."""
    count = tmp_path / "starts"
    spec = _stand_in(tmp_path, f"echo x >> {count}\necho 'OSError: [Errno 98] Address already in use' >&2\nexit 1\n")
    chosen = ApiServer(spec, ROOT, tmp_path / "chosen", start_timeout_s=30)
    with pytest.raises(ServerError, match="Address already in use"):
        chosen.start()
    assert count.read_text().count("x") == 2
    count.unlink()
    given = ApiServer(spec, ROOT, tmp_path / "given", port=chosen.port, start_timeout_s=30)
    with pytest.raises(ServerError, match="Address already in use"):
        given.start()
    assert count.read_text().count("x") == 1 and given.port == chosen.port


def test_the_paired_slope_is_the_candidates_growth_over_the_references_at_matched_requests() -> None:
    """Both servers drift alike over their requests (2 MiB per 100: the machine's), the candidate keeps 32 KiB per
    request more: the difference's slope is 32 MiB per 1,000 requests and the drift cancels. The servers take their
    chunks in turn, so their samples of the same request count come at different moments."""
    ref_done = [(t + 0.5, 32) for t in range(0, 400, 2)]  # the reference completes a request on even seconds,
    cand_done = [(t + 1.5, 32) for t in range(0, 400, 2)]  # the candidate on odd ones
    ref = [MemorySample(float(t), int(1e9 + 2e4 * (t // 2))) for t in range(400)]
    cand = [MemorySample(float(t), int(2e9 + (2e4 + 32 * 1024) * (t // 2))) for t in range(400)]
    slope = paired_slope(ref, cand, ref_done, cand_done, 20.0, 20.0)
    assert slope.per_1k == pytest.approx(32 * 1024 * 1000, rel=0.02) and slope.source == "candidate - reference"
    alone = memory_slope(cand, cand_done, 20.0)
    assert alone.per_1k == pytest.approx((2e4 + 32 * 1024) * 1000, rel=0.02)  # the drift is in the candidate's own
    with pytest.raises(ValueError, match="not sampled over its measured part"):
        paired_slope(ref[:10], cand, ref_done, cand_done, 20.0, 20.0)
