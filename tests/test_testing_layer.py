"""The suites' layer (:mod:`vramgate.testing`): the ``gate_profiles`` mark and the simulator's JSON hand-back."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from vramgate.sim import SimResult, SimulationError

MANIFEST = """\
name = "{name}"
description = "d"
hypothesis = "h"
suites = {suites}

[target]
distribution = "vllm"
package = "vllm"
version = "==0.32.0"

[engine_args]
{engine_args}
"""


def write_profile(root: pytest.Pytester, name: str, suites: list[str], engine_args: str) -> None:
    folder = root.path / "patches" / name
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(MANIFEST.format(name=name, suites=json.dumps(suites),
                                                          engine_args=engine_args))


def test_gate_profiles_parametrizes_by_the_projects_profiles(pytester: pytest.Pytester) -> None:
    write_profile(pytester, "b-second", ["block_manager"], 'kv_cache_dtype = "fp8"')
    write_profile(pytester, "a-first", ["block_manager", "other"], 'attention_backend = "TRITON_MLA"')
    write_profile(pytester, "c-elsewhere", ["other"], 'kv_cache_dtype = "fp8"')
    pytester.makeconftest('pytest_plugins = ["vramgate.testing.fixtures"]')
    pytester.makepyfile(test_marked=textwrap.dedent("""
        import pytest

        @pytest.mark.gate_profiles("block_manager", reference="baseline")
        def test_suite(profile):
            assert profile is None or "block_manager" in profile.suites

        @pytest.mark.parametrize("device", ["cpu", "cuda"])
        @pytest.mark.gate_profiles(where=lambda p: "attention_backend" in p.engine_args)
        def test_where(profile, device):
            assert profile.name == "a-first"
    """))
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:vramgate")
    result.stdout.fnmatch_lines([
        "test_marked.py::test_suite[baseline]",
        "test_marked.py::test_suite[a-first]",
        "test_marked.py::test_suite[b-second]",
        "test_marked.py::test_where[a-first-cpu]",
        "test_marked.py::test_where[a-first-cuda]",
    ])
    assert "c-elsewhere" not in result.stdout.str()


def test_gate_profiles_marks_the_cases_its_nightly_argument_names(pytester: pytest.Pytester) -> None:
    """``nightly=`` gives a profile's case the gate_nightly mark with its reason: the pre-merge set (``-m "not
    gate_nightly"``) leaves that case out and keeps the others; the full gate runs them all."""
    write_profile(pytester, "a-first", ["block_manager"], 'attention_backend = "TRITON_MLA"')
    write_profile(pytester, "b-second", ["block_manager"], 'kv_cache_dtype = "fp8"')
    pytester.makeconftest('pytest_plugins = ["vramgate.testing.fixtures"]')
    pytester.makepyfile(test_nightly=textwrap.dedent("""
        import pytest

        @pytest.mark.gate_profiles(reference="unpatched",
                                   nightly=lambda p: "its backend" if "attention_backend" in p.engine_args else None)
        def test_one(profile, request):
            mark = request.node.get_closest_marker("gate_nightly")
            wanted = ("its backend",) if profile and profile.name == "a-first" else None
            assert (mark.args if mark else None) == wanted
    """))
    full = pytester.runpytest("-q", "-p", "no:cacheprovider", "-p", "no:vramgate")
    full.assert_outcomes(passed=3)
    pre_merge = pytester.runpytest("-q", "-p", "no:cacheprovider", "-p", "no:vramgate", "-m", "not gate_nightly",
                                   "-W", "ignore::pytest.PytestUnknownMarkWarning")
    pre_merge.assert_outcomes(passed=2, deselected=1)


def test_gate_profiles_rejects_bad_arguments(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["vramgate.testing.fixtures"]')
    pytester.makepyfile(test_misspelt="""
        import pytest

        @pytest.mark.gate_profiles("block_manager", refrence="baseline")
        def test_one(profile):
            pass
    """, test_no_argument="""
        import pytest

        @pytest.mark.gate_profiles("block_manager")
        def test_two():
            pass
    """)
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:vramgate")
    result.stdout.fnmatch_lines(["*test_one: bad arguments to marker gate_profiles:*refrence*",
                                 "*test_two: marked gate_profiles but takes no argument 'profile'*"])


def test_a_simulation_result_survives_its_json_form() -> None:
    """What a child simulation writes is what the parent reads back (the per-step trace is not in it)."""
    result = SimResult(
        model="tiny-llama", workload="sharegpt", requests=3, seed=0, block_size=16, num_gpu_blocks=64,
        usable_blocks=63, settings={"async_scheduling": True, "step_cost": [0.005, 5e-05, 0.0]},
        config_overrides={"SchedulerConfig.async_scheduling": [False, True]}, steps=7, peak_blocks_used=12,
        preemptions=1, preempted_requests=1, recomputed_tokens=40, prefix_cache_queries=9, prefix_cache_hits=3,
        internal_waste_mean=0.1234567891, internal_waste_max=0.5, waste_bound_violations=0, output_tokens=30,
        scheduled_tokens=300, virtual_makespan_s=0.75, throughput_tokens_per_s=40.0, mean_latency_s=0.5,
        peak_blocks_by_step=[1, 2], timing={"total_s": 1.5},
    )
    back = SimResult.from_json(json.loads(json.dumps(result.to_json())), "result.json")
    assert back == dataclasses.replace(result, peak_blocks_by_step=[])
    assert back.figures() == result.figures()
    with pytest.raises(SimulationError, match=r"result.json: missing field\(s\) model"):
        SimResult.from_json({k: v for k, v in result.to_json().items() if k != "model"}, "result.json")


@pytest.mark.parametrize(("tier", "expected"), [("cpu", 3.0), ("gpu", 0.3)])
def test_unpaired_latency_takes_the_calibrated_tolerance_on_each_tier(monkeypatch: pytest.MonkeyPatch, tier: str,
                                                                       expected: float) -> None:
    """Every suite that judges an engine's latency samples against a stored baseline takes the tier's calibrated
    tolerance (docs/calibration.md: 28.4% false alarms at the 5% default on an H200, none of 22,400 at 30%), read
    with the engine tier faked: the suites' own modules, imported fresh."""
    import importlib.util

    from vramgate.testing import engines

    monkeypatch.setattr(engines, "engine_tier", lambda: tier)
    root = Path(__file__).resolve().parents[1]
    for path in ("suites/latency/test_latency.py", "suites/block_manager/test_block_manager.py",
                 "suites/quantization/test_quant_latency.py"):
        spec = importlib.util.spec_from_file_location(f"suite_{tier}_{Path(path).stem}", root / path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.TOLERANCE == expected, path
        if hasattr(module, "TTFT_TOLERANCE"):
            assert module.TTFT_TOLERANCE == {"cpu": 3.0, "gpu": 0.3}[tier], path


@pytest.mark.parametrize(("tier", "device", "runs"), [("cpu", "cpu", True), ("gpu", "cpu", False),
                                                       ("gpu", "cuda", True), ("cpu", "cuda", False)])
def test_a_linear_kernel_case_runs_only_on_the_tier_whose_kernels_it_needs(
        monkeypatch: pytest.MonkeyPatch, tier: str, device: str, runs: bool) -> None:
    """Note [linear kernels by platform]: the quantization suite's CPU case would call the CUDA build's Marlin
    repacking on CPU tensors; on the GPU tier it is skipped with the reason."""
    from vramgate.machine import isa
    from vramgate.testing import quantization
    from vramgate.testing.quantization import linear_kernel_problem

    monkeypatch.setattr(quantization, "engine_tier", lambda: tier)
    monkeypatch.setattr(isa, "kernel_problem", lambda kernel, found: None)
    problem = linear_kernel_problem(device)
    assert (problem is None) == runs, problem
    if tier == "gpu" and device == "cpu":
        assert problem is not None and "picks its linear kernels by platform" in problem


def test_writing_tests_says_where_each_name_lives() -> None:
    """docs/writing-tests.md, "What to import": every name it lists is where it says (a module's ``__all__``)."""
    import importlib
    import re

    import vramgate.testing

    text = (Path(__file__).resolve().parents[1] / "docs" / "writing-tests.md").read_text(encoding="utf-8")
    section = text[text.index("## What to import"):text.index("## Units")]
    rows = re.findall(r"^\| `(vramgate\.testing\.[a-z]+)`((?:, `\.[a-z]+`)*) \| (.*) \|$", section, re.M)
    assert len(rows) == 9
    for first, more, names in rows:
        modules = [first] + [f"vramgate.testing{m}" for m in re.findall(r"`(\.[a-z]+)`", more)]
        listed = {n for m in modules for n in importlib.import_module(m).__all__}
        assert set(re.findall(r"`([A-Za-z_]+)`", names)) <= listed, first
    facade = section.split("|", 1)[0]
    assert set(re.findall(r"`([A-Za-z_]+)`", facade)) == set(vramgate.testing.__all__)
