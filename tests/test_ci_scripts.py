"""What the CI workflows call: the hardware check, stray GPU process cleanup, the workflows themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vramgate.machine import hardware
from vramgate.machine.gpu_processes import GpuProcess, ancestors, end, stray
from vramgate.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def test_hardware_expect(capsys: pytest.CaptureFixture[str]) -> None:
    key = hardware.detect().key
    assert cli_main(["hardware", "--expect", key.split("-")[0]]) == 0
    assert cli_main(["hardware", "--expect", "H100"]) == (0 if "h100" in key else 1)
    if "h100" not in key:
        assert "does not match the expected 'H100'" in capsys.readouterr().err


def test_stray_keeps_protected_and_reports_foreign() -> None:
    procs = [GpuProcess(10, 1000, 5 << 30, 0), GpuProcess(11, 1000, 1 << 30, 1), GpuProcess(10, 1000, 1, 1),
             GpuProcess(12, 0, 1 << 30, 0), GpuProcess(13, 1000, 1, 0)]
    ours, foreign = stray(procs, own_uid=1000, protected={13})
    assert ours == [10, 11]
    assert [p.pid for p in foreign] == [12]


def test_ancestors_include_this_process() -> None:
    mine = ancestors(os.getpid())
    assert os.getpid() in mine and os.getppid() in mine


def test_end_terminates_then_kills() -> None:
    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"up\n"
    assert end([stubborn.pid], grace_s=0.5) == []
    assert stubborn.wait(timeout=5) == -9


def test_gpu_cleanup_without_processes(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vramgate.machine.gpu_processes.gpu_processes", lambda: [])
    assert cli_main(["gpu-cleanup"]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_gpu_cleanup_without_nvml_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner whose tools lack nvidia-ml-py (or whose driver is gone) fails the step, not "nothing to do"."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert cli_main(["gpu-cleanup"]) == 2
    assert "cannot see the GPUs' processes: nvidia-ml-py is not installed" in capsys.readouterr().err


def test_workflows_never_check_out_pr_code_with_write_tokens() -> None:
    """No pull_request_target, least-privilege tokens, fork PRs gated, self-hosted only behind approval."""
    import yaml  # type: ignore[import-untyped]

    flows = {p.name: yaml.safe_load(p.read_text()) for p in (ROOT / ".github" / "workflows").glob("*.yml")}
    assert {"cpu.yml", "gpu-gate.yml", "baselines.yml", "pr-report.yml"} <= set(flows)
    for name, flow in flows.items():
        on = flow.get(True) or flow.get("on")  # YAML 1.1 reads the key 'on' as True
        assert "pull_request_target" not in on, name
        assert flow.get("permissions") is not None, f"{name}: top-level permissions must be set"
        for job_name, job in flow["jobs"].items():
            runs_on = job.get("runs-on")
            text = str(runs_on)
            if "self-hosted" in text and "pull_request" in on:
                assert job.get("environment"), f"{name}/{job_name}: self-hosted job on PRs needs an environment"
                assert "needs" in job, f"{name}/{job_name}: self-hosted job on PRs must wait for authorization"
            for step in job.get("steps", []):
                if str(step.get("uses", "")).startswith("actions/checkout"):
                    assert step.get("with", {}).get("persist-credentials") is False, f"{name}/{job_name}"
    report = flows["pr-report.yml"]
    on = report.get(True) or report.get("on")
    assert "workflow_run" in on
    for job in report["jobs"].values():
        assert not any(str(s.get("uses", "")).startswith("actions/checkout") for s in job.get("steps", []))


def test_self_hosted_jobs_use_the_jobs_own_tools() -> None:
    """No `pip install --user` (it outlives the job, and PEP 668 refuses it); every vramgate call on a GPU runner
    uses the job's venv, which has nvidia-ml-py; runs-on is a list of labels."""
    import yaml

    for path in (ROOT / ".github" / "workflows").glob("*.yml"):
        text = path.read_text()
        assert "--user" not in text, path.name
        flow = yaml.safe_load(text)
        for job in flow["jobs"].values():
            if "self-hosted" not in str(job.get("runs-on")):
                continue
            runs = [str(s.get("run", "")) for s in job.get("steps", [])]
            calls = [r for r in runs if "-m vramgate" in r or "-m tox" in r]
            assert calls and all("$TOOLS/bin/python" in r or "ci-tools.sh" in r for r in calls), path.name
    tools = (ROOT / "scripts" / "ci-tools.sh").read_text()
    assert "nvidia-ml-py" in tools and "sys.version_info < (3, 11)" in tools


def test_ci_tools_refuses_an_old_python(tmp_path: Path) -> None:
    fake = tmp_path / "python-old"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Python 3.10.12'; exit 0; fi\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "ci-tools.sh"), str(tmp_path / "venv")],
                         env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True)
    assert out.returncode == 1
    assert "Python 3.10.12 is too old: vramgate needs Python >= 3.11" in out.stderr
    assert not (tmp_path / "venv").exists()


def test_suite_test_files_have_unique_basenames() -> None:
    """Suites have no ``__init__.py``: two test files with one basename cannot be collected in one run."""
    root = Path(__file__).resolve().parents[1] / "suites"
    names: dict[str, list[str]] = {}
    for path in root.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_doctor_lists_the_facts_and_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["doctor", "--root", str(ROOT)])
    out = capsys.readouterr().out
    assert "hardware:" in out and "engine:" in out and "NVML:" in out
    assert "vramgate plan: hardware" in out and "test(s) need a GPU" in out
    assert rc in (0, 1)  # 1 where something a run needs is missing (here: no vLLM in the harness's env)


def test_every_action_is_pinned_by_commit_and_updated_by_dependabot() -> None:
    import re

    import yaml

    for path in (ROOT / ".github" / "workflows").glob("*.yml"):
        for line in path.read_text().splitlines():
            if "uses:" in line:
                assert re.search(r"uses: [\w.-]+/[\w.-]+@[0-9a-f]{40}\s+# v\d+\.\d+\.\d+$", line), (path.name, line)
    bot = yaml.safe_load((ROOT / ".github" / "dependabot.yml").read_text())
    assert {u["package-ecosystem"] for u in bot["updates"]} >= {"github-actions", "pip"}
    owners = (ROOT / ".github" / "CODEOWNERS").read_text()
    assert "/baselines/" in owners and "/patches/" in owners


def test_no_job_output_goes_unread() -> None:
    import yaml

    for path in (ROOT / ".github" / "workflows").glob("*.yml"):
        text = path.read_text()
        for name, job in yaml.safe_load(text)["jobs"].items():
            for output in job.get("outputs", {}):
                assert f"needs.{name}.outputs.{output}" in text, f"{path.name}: {name}.outputs.{output} is unread"


def test_a_reused_pid_is_not_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the listing and the signal the process ended and its pid went to another: left alone."""
    from vramgate.machine import gpu_processes as gpuclean
    from vramgate.machine.probes.cpu import ProcStat

    starts = iter([100, 999, 999])  # seen at 100, then the pid names a process started at 999
    monkeypatch.setattr(gpuclean, "proc_stat", lambda pid: ProcStat(pid, 1, "S", next(starts, 999)))
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(gpuclean.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert gpuclean.end([4242], grace_s=0.1) == []
    assert sent == []


def test_children_are_found_through_parents() -> None:
    from vramgate.machine.probes.cpu import children, proc_stat

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(5)']); time.sleep(5)"])
    try:
        deadline = time.monotonic() + 5
        while len(children(child.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = children(os.getpid())
        assert child.pid in kids and len(children(child.pid)) == 1
        grandchild = children(child.pid)[0]
        assert grandchild in kids
        stat = proc_stat(grandchild)
        assert stat is not None and stat.ppid == child.pid and stat.start_ticks > 0
    finally:
        for pid in children(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()


def test_every_gpu_gate_job_has_the_time_the_gpu_gate_workflow_gives_it() -> None:
    """A job that runs the GPU gate (``tox -e gpu``, named or through an env variable that can be ``gpu``) either
    splits it over a matrix of shards (``--gate-shard``) or has, alone, the total time the gpu-gate workflow gives
    its shards: the shards' timeouts together are at least gpu-gate's."""
    import re

    import yaml

    def gpu_gate_runs(job: dict[str, Any]) -> list[str]:
        runs = []
        for step in job.get("steps", []):
            run, env = str(step.get("run", "")), {**job.get("env", {}), **step.get("env", {})}
            for target in re.findall(r"-m tox -e (\S+)", run):
                variable = target.strip('"{}$')
                if target == "gpu" or (target.startswith(('"$', "$")) and "'gpu'" in str(env.get(variable, ""))):
                    runs.append(run)
        return runs

    def shards(job: dict[str, Any], runs: list[str]) -> int:
        sharded = all("--gate-shard" in r for r in runs)
        return len(job.get("strategy", {}).get("matrix", {}).get("shard", [])) if sharded else 1

    flows = {p.name: yaml.safe_load(p.read_text()) for p in (ROOT / ".github" / "workflows").glob("*.yml")}
    gate = flows["gpu-gate.yml"]["jobs"]["gate"]
    total = gate["timeout-minutes"] * shards(gate, gpu_gate_runs(gate))
    assert total >= 240
    found = []
    for name, flow in flows.items():
        for job_name, job in flow["jobs"].items():
            runs = gpu_gate_runs(job)
            if not runs:
                continue
            found.append(f"{name}/{job_name}")
            given = int(job.get("timeout-minutes", 360)) * shards(job, runs)  # GitHub's default: 360 minutes
            assert given >= total, f"{name}/{job_name}: {given} minutes for the GPU gate, gpu-gate gives {total}"
    assert {"gpu-gate.yml/gate", "baselines.yml/record"} <= set(found)


def _combine_command() -> str:
    """The command of baselines.yml's step that combines the shards' copies of baselines/."""
    import yaml

    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "baselines.yml").read_text())
    steps = [s for job in flow["jobs"].values() for s in job.get("steps", [])
             if s.get("name") == "Combine the shards' baselines"]
    assert len(steps) == 1
    return str(steps[0]["run"]).strip()


def test_the_shards_baselines_are_combined_test_by_test(tmp_path: Path) -> None:
    """Two shards re-record tests of one suite file each: the combined file has every shard's tests (none
    undone by the other shard's unchanged copy), the tests a shard dropped are gone, a new file is taken whole,
    and a test two shards both changed stops the step."""
    import shutil

    import vramgate
    from vramgate.core.metrics import Metric
    from vramgate.core.provenance import Provenance
    from vramgate.store.baselines import BaselineFile, NodeBaseline, dump_baseline, parse_baseline

    def write(folder: Path, values: dict[str, float], suite: str = "kv_cache") -> None:
        path = folder / "h100" / f"{suite}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = {n: NodeBaseline({"m": Metric("m", v, "B")}, Provenance("abc", "2026-01-01T00:00:00Z", {}))
                 for n, v in values.items()}
        path.write_text(dump_baseline(BaselineFile(path, suite, {"gpu": "h100"}, tests)))

    def values(folder: Path, suite: str = "kv_cache") -> dict[str, float]:
        path = folder / "h100" / f"{suite}.json"
        return {n: t.metrics["m"].value for n, t in parse_baseline(path, path.read_text()).tests.items()}

    def combine(work: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(Path(vramgate.__file__).parents[1])}
        command = _combine_command().replace("python ", f"{sys.executable} ", 1)  # the step's own command line
        return subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True)

    base = {"t::a": 1.0, "t::b": 2.0, "t::c": 3.0, "t::d": 4.0}
    write(tmp_path / "baselines", base)
    write(tmp_path / "shards" / "s-1", {**base, "t::a": 10.0, "t::c": 30.0})
    write(tmp_path / "shards" / "s-2", {"t::a": 1.0, "t::b": 20.0, "t::c": 3.0, "t::e": 50.0})  # drops t::d
    write(tmp_path / "shards" / "s-2", {"t::new": 7.0}, suite="latency")
    out = combine(tmp_path)
    assert out.returncode == 0, out.stderr
    assert values(tmp_path / "baselines") == {"t::a": 10.0, "t::b": 20.0, "t::c": 30.0, "t::e": 50.0}
    assert values(tmp_path / "baselines", "latency") == {"t::new": 7.0}
    assert not list((tmp_path / "baselines").rglob(".*.lock"))

    shutil.rmtree(tmp_path / "baselines")
    write(tmp_path / "baselines", base)
    write(tmp_path / "shards" / "s-2", {**base, "t::a": 11.0})
    out = combine(tmp_path)
    assert out.returncode != 0 and "t::a re-recorded by both s-1 and s-2" in out.stderr
    assert values(tmp_path / "baselines") == base, "a conflict writes nothing"
