"""A matrix entry's serving configuration: read with errors that name the field, turned into an engine spec
without a KV budget, and into vLLM's engine arguments as a serving team passes them (no engine needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate.engine import EngineSpec, SpecError, validate
from vramgate.engine.arguments import llm_kwargs
from vramgate.matrix import MatrixError, parse_matrix
from vramgate.testing import MatrixCase

ROOT = Path(__file__).resolve().parents[1]
HEAD = '[models.tiny-llama]\n[[entries]]\nsuites = ["serving_capacity"]\nmodel = "tiny-llama"\n'


def entry(text: str):  # type: ignore[no-untyped-def]
    return parse_matrix(HEAD + text, "m.toml", ROOT).entries[0]


def test_a_serving_entry_reads_every_field() -> None:
    e = entry('tier = "gpu"\n[entries.serving]\ngpu_memory_utilization = 0.9\ncudagraph_mode = "FULL_AND_PIECEWISE"\n'
              'cudagraph_capture_sizes = [1, 2, 4, 8]\nmax_model_len = 8192\nmax_num_seqs = 128\n'
              '[entries.budgets]\ncudagraph_bytes = "<= 2 GiB"\nmax_concurrency = ">= 20"\n')
    assert e.serving is not None
    assert (e.serving.gpu_memory_utilization, e.serving.cudagraph_capture_sizes, e.serving.max_model_len) == \
        (0.9, (1, 2, 4, 8), 8192)
    assert "serving (gpu_memory_utilization 0.9, cuda graphs FULL_AND_PIECEWISE" in e.describe()
    cpu = entry('tier = "cpu"\n[entries.serving]\ncpu_memory = "3 GiB"\n')
    assert cpu.serving is not None and cpu.serving.cpu_memory == 3 << 30 and not cpu.serving.enforce_eager


@pytest.mark.parametrize(("text", "message"), [
    ('tier = "cpu"\n', r"entries\[0\].serving: missing table: the serving_capacity suite"),
    ('tier = "cpu"\n[entries.serving]\ngpu_memory_utilization = 0.9\n', r"entries\[0\].serving.cpu_memory: missing"),
    ('tier = "gpu"\n[entries.serving]\ncpu_memory = "2 GiB"\n',
     r"entries\[0\].serving.gpu_memory_utilization: missing"),
    ('[entries.serving]\ngpu_memory_utilization = 0.9\n', r"serving.cpu_memory: missing field: the cpu \(and every"),
    ('tier = "gpu"\n[entries.serving]\ngpu_memory_utilization = 1.5\n', r"must be a fraction in \(0, 1\]"),
    ('tier = "cpu"\n[entries.serving]\ncpu_memory = "2 parsecs"\n', r"serving.cpu_memory: unknown unit"),
    ('tier = "cpu"\n[entries.serving]\ncpu_memory = "10 ms"\n', r"must be an amount of memory"),
    ('tier = "gpu"\n[entries.serving]\ngpu_memory_utilization = 0.9\ncudagraph_mode = "FULL_PIECEWISE"\n',
     r"unknown mode 'FULL_PIECEWISE'; did you mean FULL_AND_PIECEWISE"),
    ('tier = "gpu"\n[entries.serving]\ngpu_memory_utilization = 0.9\nmax_modl_len = 4\n',
     r"serving.max_modl_len: unknown field; did you mean max_model_len"),
])
def test_serving_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(MatrixError, match=message):
        entry(text)


def test_a_serving_table_on_a_suite_that_does_not_serve_is_refused() -> None:
    text = ('[models.tiny-llama]\n[[entries]]\nsuites = ["capacity"]\nmodel = "tiny-llama"\n'
            '[entries.serving]\ncpu_memory = "2 GiB"\ngpu_memory_utilization = 0.9\n')
    with pytest.raises(MatrixError, match=r"entries\[0\].serving: no suite of this entry runs a serving"):
        parse_matrix(text, "m.toml", ROOT)


def test_the_case_leaves_the_kv_cache_to_vllm_and_asks_for_graphs() -> None:
    e = entry('[entries.serving]\ngpu_memory_utilization = 0.85\ncpu_memory = "2 GiB"\ncudagraph_mode = "PIECEWISE"\n'
              'max_model_len = 4096\n')
    spec = MatrixCase(e, 32, "auto", "gpu").engine_spec(EngineSpec(model="tiny-llama"))
    assert spec.kv_budget_gib is None and not spec.enforce_eager
    assert (spec.gpu_memory_utilization, spec.cpu_memory_bytes, spec.max_model_len) == (0.85, 2 << 30, 4096)
    assert spec.engine_args == {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    gpu = llm_kwargs(spec, ROOT / "fixtures/models/tiny-llama", device_total_bytes=80 << 30)
    assert "kv_cache_memory_bytes" not in gpu and gpu["gpu_memory_utilization"] == 0.85
    assert gpu["enforce_eager"] is False and gpu["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    cpu = llm_kwargs(spec, ROOT / "fixtures/models/tiny-llama", node_memory_bytes=16 << 30)
    assert "kv_cache_memory_bytes" not in cpu and cpu["gpu_memory_utilization"] == pytest.approx(2 / 16)
    with pytest.raises(ValueError, match="needs the NUMA node's memory"):
        llm_kwargs(spec, ROOT / "fixtures/models/tiny-llama")


def test_specs_with_a_budget_keep_their_key_and_arguments() -> None:
    spec = EngineSpec(model="tiny-llama")
    assert spec.key() == EngineSpec(model="tiny-llama", gpu_memory_utilization=None).key()
    assert llm_kwargs(spec, ROOT / "fixtures/models/tiny-llama")["kv_cache_memory_bytes"] == 1 << 28


def test_an_automatic_spec_needs_the_tiers_memory() -> None:
    spec = EngineSpec(model="tiny-llama", block_size=32, kv_budget_gib=None)
    with pytest.raises(SpecError, match="'gpu_memory_utilization' is needed on the GPU tier"):
        validate(spec, ROOT, tier="gpu")
    with pytest.raises(SpecError, match=r"'cpu_memory_bytes' .* is needed on the CPU tier"):
        validate(spec, ROOT, tier="cpu")
    validate(spec.replace(cpu_memory_bytes=2 << 30), ROOT, tier="cpu")
    with pytest.raises(SpecError, match="'gpu_memory_utilization' = 0 is not accepted"):
        validate(spec.replace(gpu_memory_utilization=0), ROOT, tier="gpu")


def test_the_project_matrix_serves_on_both_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving capacity cases a CPU box and a GPU runner (an H100, faked) get from the project's matrix, each spec
    without a KV budget and with the tier's memory: what --gate-plan lists on such a runner."""
    from vramgate.machine import isa
    from vramgate.matrix import Machine, project_matrix
    from vramgate.testing import matrix as testing_matrix

    matrix = project_matrix(ROOT)
    argnames = ["model", "block_size", "kv_cache_dtype", "matrix_case"]
    # a CPU without AMX and one with it (vLLM's MLA backends take other block sizes: Note [CPU MLA backends])
    boxes = (("cpu", "avx512-bf16", ["tiny-llama-bs32", "tiny-deepseek-v2-bs16"], "cpu_memory_bytes"),
             ("cpu", "amx", ["tiny-llama-bs32", "tiny-deepseek-v2-bs32"], "cpu_memory_bytes"),
             ("gpu", "", ["tiny-llama-bs16", "tiny-deepseek-v2-bs16"], "gpu_memory_utilization"))
    for tier, cls, ids, memory in boxes:
        monkeypatch.setattr(isa, "effective_isa", lambda cls=cls: cls)
        params = testing_matrix.matrix_params(matrix, "serving_capacity", argnames, "{model}-bs{block_size}", "t",
                                              tier, ROOT,
                                              lambda tier=tier, cls=cls: Machine(tier, "nvidia-h100-80gb-x1", 1, cls))
        assert [p.id for p in params] == ids
        for p in params:
            case = p.values[-1]
            spec = case.engine_spec(EngineSpec(model="x"))
            assert spec.kv_budget_gib is None and getattr(spec, memory) and not spec.enforce_eager
            validate(spec, ROOT, tier=tier)


def test_the_upgrade_report_says_what_utilization_keeps_the_old_kv_cache() -> None:
    from vramgate.core.metrics import Metric
    from vramgate.report.upgrade import upgrade_markdown
    from vramgate.tools.upgrade import serving_advice

    def report(kv: int, non_kv: int) -> dict[str, object]:
        figures = (("kv_cache_bytes", kv), ("non_kv_bytes", non_kv), ("requested_bytes", kv + non_kv))
        return {"schema": 1, "tests": [{"suite": "serving_capacity",
                                        "nodeid": "s.py::test_serving_kv_capacity[tiny-llama-bs32]",
                                        "metrics": [{"name": n, "now": Metric(n, v, "B", scope="machine").to_json()}
                                                    for n, v in figures]}]}

    gib, mib = 1 << 30, 1 << 20
    rows = serving_advice(report(gib + 400 * mib, 624 * mib), report(gib + 336 * mib, 688 * mib))
    assert len(rows) == 1 and rows[0].needed_bytes == gib + 400 * mib + 688 * mib
    assert rows[0].factor == pytest.approx((2 * gib + 64 * mib) / (2 * gib))
    data = {"schema": 1, "from": "0.31.0", "to": "0.32.0", "tier": "cpu", "regressions": 0, "runs": [],
            "serving": [r.to_json() for r in rows], "comparison_markdown": ""}
    text = upgrade_markdown(data)
    assert "### Serving capacity: the memory the new version needs for the old KV cache" in text
    assert "x1.0312 (+3.12%: e.g. 0.90 -> 0.9281; 2.06 GiB requested)" in text, text


def test_the_plan_lists_the_serving_cases_and_what_they_would_record(pytester: pytest.Pytester) -> None:
    """--gate-plan on a GPU runner's key with no baselines (a faked H100): the serving capacity cases, with the
    figures they would record there, and no figure compared."""
    import shutil

    shutil.copytree(ROOT / "suites" / "serving_capacity", pytester.path / "suites" / "serving_capacity")
    shutil.copytree(ROOT / "fixtures" / "models", pytester.path / "fixtures" / "models")
    shutil.copy(ROOT / "conftest.py", pytester.path / "conftest.py")
    result = pytester.runpytest_subprocess("suites", "--collect-only", "-q", "--gate-plan", "--gate-hardware",
                                           "nvidia-h100-80gb-x1", "-v", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert "baselines under nvidia-h100-80gb-x1" in out, out
    if "tiny-llama-bs16" in out:  # no vLLM here: the engine tier is gpu
        assert "serving_capacity: 2 test(s) under nvidia-h100-80gb-x1, 0 compare stored metrics, 2 have none; " \
               "would record capacity_tokens, " \
               "cudagraph_bytes, cudagraph_estimate_bytes, kv_cache_bytes" in out, out
    else:  # the CPU build of vLLM: the cpu entries
        assert "test_serving_kv_capacity[tiny-llama-bs32] [nvidia-h100-80gb-x1]: compares nothing" in out, out


def test_the_decision_record_round_trips() -> None:
    from vramgate.engine import MemoryDecision

    d = MemoryDecision("cpu", 0.2, 10 << 30, 2 << 30, (2 << 30) - (600 << 20), 100, 3200, 1.5, 2048, 600 << 20,
                       load_peak_bytes=(2 << 30) + 1)
    assert MemoryDecision.from_json(d.to_json()) == d
    assert d.utilization_for(d.available_kv_bytes + (64 << 20)) == pytest.approx(((2 << 30) + (64 << 20)) / (10 << 30))
    with pytest.raises(TypeError, match="missing field"):
        MemoryDecision.from_json({"tier": "cpu"})


def test_the_gpu_readers_catch_the_profile_the_pool_and_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path of vramgate.engine.memory_decision on stand-ins for torch and vLLM's modules, shaped as the
    contracts (tests/test_vllm_memory_contracts.py) pin them: the worker builds the V2 model runner
    (``vllm.v1.worker.gpu.model_runner``), whose ``capture_model`` runs once with ``profile_only=True`` for the
    estimate and once for real; the hooks keep the profiling result and the real pool, worker_memory_decision
    reads the worker, decide() the engine core and the cache config."""
    import contextlib
    from types import SimpleNamespace

    from module_fakes import fake_modules
    from vramgate.engine import memory_decision as md

    @contextlib.contextmanager
    def memory_profiling(snapshot: object, weights_memory: int = 0):  # type: ignore[no-untyped-def]
        result = SimpleNamespace(weights_memory=0, torch_peak_increase=0, non_torch_increase=0, total_consumed=0,
                                 transient_peak_headroom=0, non_kv_cache_memory=0)
        yield result
        result.weights_memory, result.torch_peak_increase = weights_memory, 300   # filled on exit, as vLLM does
        result.non_torch_increase, result.total_consumed, result.transient_peak_headroom = 50, 1100, 250
        result.non_kv_cache_memory = result.total_consumed + result.transient_peak_headroom

    class V1Runner:  # vllm.v1.worker.gpu_model_runner.GPUModelRunner: built only when V2 is off
        def capture_model(self) -> int:
            raise AssertionError("the worker built the V2 runner")

    class GPUModelRunner:  # vllm.v1.worker.gpu.model_runner.GPUModelRunner (V2)
        def capture_model(self, *, profile_only: bool = False) -> int:
            return (1 << 30) // 2 if profile_only else 1 << 30

    torch = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True))
    modules = fake_modules(monkeypatch, {
        "torch": vars(torch),
        "vllm": {"envs": SimpleNamespace(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=True)},
        "vllm.v1.worker.gpu_worker": {"memory_profiling": memory_profiling},
        "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": V1Runner},
        "vllm.v1.worker.gpu.model_runner": {"GPUModelRunner": GPUModelRunner},
    })
    gpu_worker = modules["vllm.v1.worker.gpu_worker"]

    md.install_hooks()
    md.install_hooks()  # idempotent
    with gpu_worker.memory_profiling(None, weights_memory=1000) as profile:  # as Worker.determine_available_memory
        pass
    runner = GPUModelRunner()
    assert runner.capture_model(profile_only=True) == (1 << 30) // 2  # profile_cudagraph_memory's estimate
    gib = 1 << 30
    worker = SimpleNamespace(requested_memory=72 * gib, init_snapshot=SimpleNamespace(total_memory=80 * gib),
                             cudagraph_memory_estimate=gib + gib // 10, model_runner=runner)
    assert md.worker_memory_decision(worker)["cudagraph_bytes"] is None  # the estimate's capture is no pool
    assert runner.capture_model() == 1 << 30  # what compile_or_warm_up_model does
    rank = md.worker_memory_decision(worker)
    assert gpu_worker._vramgate_last_profile is profile  # type: ignore[attr-defined]
    assert rank["cudagraph_bytes"] == gib, "the V2 runner's real capture was not recorded"
    expected = {"tier": "gpu", "requested_bytes": 72 * gib, "total_bytes": 80 * gib,
                "cudagraph_estimate_bytes": gib + gib // 10, "cudagraph_estimate_applied": True,
                "cudagraph_bytes": gib, "weights_memory": 1000, "torch_peak_increase": 300,
                "non_torch_increase": 50, "total_consumed": 1100, "transient_peak_headroom": 250,
                "non_kv_cache_memory": 1350}
    assert {name: rank.get(name) for name in expected} == expected
    core = SimpleNamespace(available_gpu_memory_for_kv_cache=60 * gib)
    cache = SimpleNamespace(gpu_memory_utilization=0.9, num_gpu_blocks=1000, kv_cache_size_tokens=16000,
                            kv_cache_max_concurrency=7.8125)
    d = md.decide(core, cache, SimpleNamespace(max_model_len=2048), [rank], 70 * gib)
    assert (d.non_kv_bytes, d.cudagraph_bytes, d.load_peak_fraction) == (12 * gib, gib, 70 / 72)
    assert (d.total_consumed_bytes, d.transient_peak_headroom_bytes) == (1100, 250)
    assert d.cudagraph_estimate_error == pytest.approx(0.1)
    assert d.utilization_for(60 * gib) == pytest.approx(0.9)


def test_a_cpu_decision_takes_the_node_memory_vllm_read() -> None:
    """On CPU the node's memory is what vLLM requested its fraction of (requested / utilization), not a second
    reading of the node, whose memory a virtual machine may change between the two."""
    from types import SimpleNamespace

    from vramgate.engine.memory_decision import decide

    gib = 1 << 30
    cache = SimpleNamespace(gpu_memory_utilization=2 / 11, num_gpu_blocks=40000, kv_cache_size_tokens=1280000,
                            kv_cache_max_concurrency=625.0)
    d = decide(SimpleNamespace(available_gpu_memory_for_kv_cache=gib + gib // 4), cache,
               SimpleNamespace(max_model_len=2048), [{"tier": "cpu", "requested_bytes": 2 * gib}], None)
    assert d.total_bytes == 11 * gib and d.non_kv_bytes == 3 * gib // 4 and d.load_peak_fraction is None
