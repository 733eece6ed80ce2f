"""Fault injection without vLLM: every fault ends in a clear failure and leaves nothing half done.

Corrupt baselines and manifests, a diff series that half applies, two gate runs
updating one baseline file, a full disk under the baseline and the report, an
engine killed mid-run or hung past its timeout, and what hygiene does about a
test that leaves memory behind. Each test checks the message a user sees, that
no stray process, temporary or lock file stays, and that earlier files and the
installed package are unchanged.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from patch_support import tree_digest
from vramgate.core.metrics import Metric
from vramgate.core.provenance import Provenance
from vramgate.engine import KV_TOO_SMALL, EngineError, EngineResult, EngineSpec, run_engine
from vramgate.engine import runner as engine
from vramgate.machine.gpu_processes import alive
from vramgate.profiles import PatchError, ProfileError, build_overlay, load_profile
from vramgate.pytest_plugin.hygiene import (
    NVML_LEAK_TOLERANCE,
    PROCESS_TREE_TOLERANCE,
    DeviceReading,
    HygieneState,
    device_leaks,
    tree_leak,
)
from vramgate.report import data as report_data
from vramgate.report.chart import Bar
from vramgate.runtime import process
from vramgate.store import files
from vramgate.store.baselines import DirectoryStorage, NodeBaseline

try:  # An in-process pytester run unloads what it imported, and numpy cannot be loaded twice: load it first.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
except ImportError:
    matplotlib = None

ROOT = Path(__file__).resolve().parents[1]
HW = ("--gate-hardware", "test-hw")
MiB = 1 << 20
GiB = 1 << 30

# -- helpers -------------------------------------------------------------------------------


def leftovers(folder: Path) -> list[str]:
    """Temporary and lock files the gate's writers would leave in *folder*."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp"))


class DiskFull:
    """Stands in for the ``os`` module of one gate module: files it opens for writing take *room* bytes, then
    fail with ENOSPC, as a full disk does partway through a write."""

    def __init__(self, room: int = 100) -> None:
        self.room = room
        self.failures = 0

    def module(self) -> ModuleType:
        fake = ModuleType("os")
        fake.__dict__.update(os.__dict__)
        fake.fdopen = self.fdopen  # type: ignore[attr-defined]
        return fake

    def fdopen(self, fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = os.fdopen(fd, mode, *args, **kwargs)
        if "w" not in mode:
            return handle
        room, outer = [self.room], self
        real_write = handle.write

        def write(data: str) -> int:
            if len(data) > room[0]:
                real_write(data[: room[0]])
                handle.flush()  # the part that fit is on disk
                room[0] = 0
                outer.failures += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            room[0] -= len(data)
            return int(real_write(data))

        handle.write = write
        return handle


def metric(name: str, value: float) -> Metric:
    return Metric(name=name, value=value, unit="B", kind="exact", better="lower", tolerance=0.0)


def node(value: float) -> NodeBaseline:
    return NodeBaseline({"bytes": metric("bytes", value)}, Provenance("abc", "2026-01-01T00:00:00Z", {"python": "3"}))


# -- baselines ----------------------------------------------------------------------------------

TEST_KV = """
import os
def test_kv(gate):
    gate.record("page_bytes", int(os.environ.get("PAGE", "65536")), unit="B")
"""


def baseline_file(pytester: pytest.Pytester, suite: str = "kv") -> Path:
    return pytester.path / "baselines" / "cpu" / f"{suite}.json"  # exact metrics are portable: the tier's key


@pytest.fixture
def recorded(pytester: pytest.Pytester) -> Path:
    """A pytester project whose ``kv`` suite has a recorded baseline; returns the baseline file."""
    pytester.makepyfile(test_kv=TEST_KV)
    pytester.runpytest(*HW, "--gate-update").assert_outcomes(passed=1)
    return baseline_file(pytester)


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "not-utf8": lambda good: b"\xff\xfe" + good,
    "wrong-schema": lambda good: good.replace(b'"schema": 1', b'"schema": 2'),
    "not-an-object": lambda good: b"[1, 2, 3]\n",
    "metric-without-unit": lambda good: good.replace(b'"unit": "B",', b""),
}
EXPECTED = {
    "truncated": "not valid JSON (line ",
    "empty": "not valid JSON (line 1, column 1: Expecting value)",
    "not-utf8": "cannot be read: 'utf-8' codec can't decode byte 0xff",
    "wrong-schema": "baseline file of schema 2, newer than this vramgate reads (schema 1): upgrade vramgate",
    "not-an-object": "not a vramgate baseline file: the top level must be a JSON object",
    "metric-without-unit": "tests['test_kv.py::test_kv'].metrics['page_bytes']: missing field 'unit'",
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_update_refuses_a_corrupt_baseline_and_keeps_it(
    recorded: Path, pytester: pytest.Pytester, corruption: str
) -> None:
    """--gate-update never overwrites a baseline it cannot read: the file may hold reviewed figures."""
    bad = CORRUPTIONS[corruption](recorded.read_bytes())
    recorded.write_bytes(bad)
    result = pytester.runpytest(*HW, "--gate-update")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert f"ERROR: unusable baseline file {recorded}: " in err
    assert EXPECTED[corruption] in err
    assert recorded.read_bytes() == bad
    assert leftovers(recorded.parent) == []


def test_baseline_corrupted_during_the_run_is_not_overwritten(recorded: Path, pytester: pytest.Pytester) -> None:
    """A file that turns unreadable after the start-up check (another writer) stops the update at the end."""
    pytester.makepyfile(test_kv=TEST_KV + textwrap.dedent(f"""
        def test_corrupt_it():
            open({str(recorded)!r}, "w").write('{{"schema": 1, "suite": "kv", "tests": ')
        """))
    result = pytester.runpytest(*HW, "--gate-update", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert f"ERROR: could not update the baseline of suite 'kv': {recorded}: not valid JSON" in out
    assert "repair or delete it, then rerun with --gate-update" in out
    assert recorded.read_text() == '{"schema": 1, "suite": "kv", "tests": '
    assert "baseline written" not in out
    assert leftovers(recorded.parent) == []


def test_disk_full_while_writing_the_baseline(
    recorded: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = recorded.read_bytes()
    full = DiskFull(room=100)
    monkeypatch.setattr(files, "os", full.module())
    monkeypatch.setenv("PAGE", "4096")
    result = pytester.runpytest(*HW, "--gate-update")
    assert full.failures == 1
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*ERROR: could not write the baseline of suite 'kv' to baselines/cpu/kv.json: "
        "[[]Errno 28[]] No space left on device (the previous file, if any, is unchanged)*"])
    assert "baseline written" not in result.stdout.str()
    assert recorded.read_bytes() == before
    assert leftovers(recorded.parent) == []


def test_baseline_files_keep_readable_permissions(recorded: Path) -> None:
    """Atomic writes go through a private temporary file; the published file must not stay private."""
    umask = os.umask(0)
    os.umask(umask)
    assert recorded.stat().st_mode & 0o777 == 0o666 & ~umask
    os.chmod(recorded, 0o640)
    DirectoryStorage(recorded.parent.parent).update("cpu", "kv", {}, {"t": node(1)})
    assert recorded.stat().st_mode & 0o777 == 0o640


def _update_many(root: str, worker: int, count: int, start: Any) -> None:
    start.wait()
    storage = DirectoryStorage(Path(root))
    for i in range(count):
        storage.update("hw", "kv", {"key": "hw"}, {f"test_{worker}_{i}": node(worker * 100 + i)})


def test_concurrent_updates_lose_nothing_and_leave_no_lock(tmp_path: Path) -> None:
    """Four processes updating one baseline file twenty times each: every entry lands, the lock file goes."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_update_many, args=(str(tmp_path), w, 20, start)) for w in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    loaded = DirectoryStorage(tmp_path).load("hw", "kv")
    assert loaded is not None
    assert sorted(loaded.tests) == sorted(f"test_{w}_{i}" for w in range(4) for i in range(20))
    assert loaded.tests["test_3_19"].metrics["bytes"].value == 319
    assert leftovers(tmp_path / "hw") == []


def test_two_gate_runs_update_the_same_baselines_at_once(pytester: pytest.Pytester) -> None:
    """Two ``pytest --gate-update`` sessions reach the baseline write together; both tests end up in the file."""
    (pytester.path / "kv").mkdir()
    for name in ("a", "b"):
        (pytester.path / "kv" / f"test_{name}.py").write_text(
            f"def test_{name}(gate):\n    gate.record('bytes_{name}', {len(name) * 1000}, unit='B')\n")
    # Each session waits at session end until both are there, so that their updates meet.
    (pytester.path / "conftest.py").write_text(textwrap.dedent("""
        import os, time, pytest
        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionfinish(session):
            open(os.environ["ARRIVED"], "w").close()
            deadline = time.monotonic() + 30
            while not all(os.path.exists(p) for p in os.environ["BOTH"].split(",")):
                assert time.monotonic() < deadline, "the other session never arrived"
                time.sleep(0.01)
        """))
    flags = [str(pytester.path / f"arrived-{n}") for n in "ab"]
    procs = []
    for name, flag in zip("ab", flags, strict=True):
        env = {**os.environ, "ARRIVED": flag, "BOTH": ",".join(flags)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pytest", f"kv/test_{name}.py", *HW, "--gate-update", "-p", "no:cacheprovider"],
            cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    path = baseline_file(pytester)
    data = json.loads(path.read_text())
    assert sorted(data["tests"]) == ["kv/test_a.py::test_a", "kv/test_b.py::test_b"]
    assert data["tests"]["kv/test_b.py::test_b"]["metrics"]["bytes_b"]["value"] == 1000
    assert leftovers(path.parent) == []


# -- the report ------------------------------------------------------------------------------------


def _report_run(pytester: pytest.Pytester) -> pytest.RunResult:
    return pytester.runpytest(*HW, "--gate-missing=record", "--gate-report", "out")


@pytest.mark.parametrize("stage", ["report.json", "report.md"])
def test_disk_full_while_writing_the_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    pytester.makepyfile(test_kv=TEST_KV)
    _report_run(pytester).assert_outcomes(passed=1)
    out = pytester.path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"report.json", "report.md"} <= set(before)
    # report.json is staged first; give it room to fail report.md instead.
    room = 0 if stage == "report.json" else 10**7
    full = DiskFull(room)
    monkeypatch.setattr(files, "os", full.module())
    if stage == "report.md":
        original = files.stage_text

        def stage_text(path: Path, text: str) -> Path:
            full.room = 10**7 if path.name == "report.json" else 50
            return original(path, text)

        monkeypatch.setattr(report_data, "stage_text", stage_text)
    monkeypatch.setenv("PAGE", "70000")
    result = _report_run(pytester)
    assert full.failures == 1
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    text = result.stdout.str()
    assert f"ERROR: could not write the report into {out}: [Errno 28] No space left on device" in text
    assert "the previous report there, if any, is unchanged" in text
    assert not [line for line in text.splitlines() if line.startswith("report: ")]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing new, nothing half written


def test_disk_full_while_drawing_the_plot(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    if matplotlib is None:
        pytest.skip("needs matplotlib (the report extra)")
    pytester.makepyfile(test_kv=TEST_KV)
    _report_run(pytester).assert_outcomes(passed=1)
    monkeypatch.setenv("PAGE", "69632")  # a regression: changes.png draws changed metrics only
    _report_run(pytester).assert_outcomes(failed=1)
    out = pytester.path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "changes.png" in before
    original = report_data.plot_changes

    def plot_then_fail(data: dict[str, Any], path: Path) -> list[Bar] | None:
        original(data, path)
        with open(path, "r+b") as f:
            f.truncate(64)  # what was on disk when the device filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report_data, "plot_changes", plot_then_fail)
    result = _report_run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "No space left on device" in result.stdout.str()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# -- manifests and diffs ---------------------------------------------------------------------------------

DIFF_1 = """--- a/fakepkg/sched.py
+++ b/fakepkg/sched.py
@@ -1,3 +1,3 @@
 def policy():
-    return 'last'
+    return 'fewest'
""" + " \n"  # a blank context line: git anchors a hunk with less context after it than before to the file's end
DIFF_NEW_FILE = """--- /dev/null
+++ b/fakepkg/extra.py
@@ -0,0 +1 @@
+EXTRA = 1
"""
DIFF_STALE = """--- a/fakepkg/sub/__init__.py
+++ b/fakepkg/sub/__init__.py
@@ -1 +1 @@
-VALUE = 8
+VALUE = 9
"""
MANIFEST = """name = "{name}"
description = "fault test profile"
suites = ["block_manager"]

[target]
distribution = "vllm"
package = "fakepkg"
version = "==0.32.0"

[patches]
series = {series}
"""


def make_profile(root: Path, name: str, diffs: dict[str, str]) -> Path:
    d = root / "patches" / name
    d.mkdir(parents=True)
    for fname, text in diffs.items():
        (d / fname).write_text(text)
    series = "[" + ", ".join(f'"{n}"' for n in diffs) + "]"
    (d / "manifest.toml").write_text(MANIFEST.format(name=name, series=series))
    return d


MANIFEST_FAULTS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (lambda good: good[: good.index(b"[target]") + 12], "not valid TOML"),
    "cut-mid-table": (lambda good: good[: good.index(b"[patches]") + 4], "not valid TOML"),
    "empty": (lambda good: b"", "missing field 'name'"),
    "not-utf8": (lambda good: b"\xff" + good, "not valid TOML ('utf-8' codec can't decode byte 0xff"),
    "no-target": (lambda good: good[: good.index(b"[target]")], "missing field 'target'"),
}


@pytest.mark.parametrize("fault", list(MANIFEST_FAULTS))
def test_damaged_manifest_names_the_file(tmp_path: Path, fault: str) -> None:
    d = make_profile(tmp_path, "p", {"0001.patch": DIFF_1})
    damage, message = MANIFEST_FAULTS[fault]
    (d / "manifest.toml").write_bytes(damage((d / "manifest.toml").read_bytes()))
    with pytest.raises(ProfileError) as info:
        load_profile(d)
    assert str(info.value).startswith(f"{d / 'manifest.toml'}: ")
    assert message in str(info.value)


def test_half_applying_series_changes_nothing(installed: Path, tmp_path: Path) -> None:
    """Diffs 1 and 2 apply, diff 3 does not: no overlay, no temporary folder, the installed files as they were."""
    before = tree_digest(installed)
    profile = load_profile(make_profile(tmp_path, "half", {
        "0001-policy.patch": DIFF_1, "0002-new-file.patch": DIFF_NEW_FILE, "0003-stale.patch": DIFF_STALE}))
    with pytest.raises(PatchError) as info:
        build_overlay(profile, tmp_path / "overlays")
    assert str(info.value).startswith(
        "half/0003-stale.patch: fakepkg/sub/__init__.py: hunk 1 '@@ -1 +1 @@' does not apply at line 1: "
        "expected 'VALUE = 8', found 'VALUE = 7' (git apply: ")
    assert not (tmp_path / "overlays").exists()
    assert tree_digest(installed) == before
    assert not (installed / "extra.py").exists()


def test_overlay_build_failing_midway_leaves_nothing(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the symlink farm is built: the partial overlay is removed, nothing else changes."""
    before = tree_digest(installed)
    profile = load_profile(make_profile(tmp_path, "full", {"0001.patch": DIFF_1}))
    calls = []
    real_symlink = os.symlink

    def symlink(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        real_symlink(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "symlink", symlink)
    with pytest.raises(OSError, match="No space left on device"):
        build_overlay(profile, tmp_path / "overlays")
    assert len(calls) == 2
    assert list((tmp_path / "overlays").iterdir()) == []
    assert tree_digest(installed) == before


def test_two_runs_building_the_same_overlay(installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another run finishes the same overlay between this run's check and its rename: both use it, no error."""
    profile = load_profile(make_profile(tmp_path, "race", {"0001.patch": DIFF_1}))
    real_replace = os.replace
    built: list[Path] = []

    def replace(src: Any, dst: Any) -> None:
        if not built and Path(dst).name.startswith("race-"):
            monkeypatch.setattr(os, "replace", real_replace)
            built.append(build_overlay(profile, tmp_path / "overlays"))  # the other run, all the way
            assert built[0] == Path(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    overlay = build_overlay(profile, tmp_path / "overlays")
    assert built == [overlay]
    assert [p.name for p in (tmp_path / "overlays").iterdir()] == [overlay.name]  # no temporary folder left
    assert "'fewest'" in (overlay / "fakepkg" / "sched.py").read_text()


# -- the engine, with a stand-in worker ------------------------------------------------------------

@pytest.fixture
def fake_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``vramgate.engine.worker`` first on the engine's PYTHONPATH; the test writes its code."""
    pkg = tmp_path / "fake-worker" / "vramgate" / "engine"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr(engine, "validate", lambda spec, root, tier=None: None)
    monkeypatch.setattr(process, "KILL_GRACE_S", 1.0)
    return pkg


def run_fake(fake: Path, tmp_path: Path, code: str, **spec: Any) -> EngineResult:
    (fake / "worker.py").write_text(textwrap.dedent(code))
    return run_engine(EngineSpec(model="tiny-llama", block_size=32, **spec), ROOT, tmp_path / "run",
                      extra_pythonpath=[fake.parent.parent])


#: A worker that starts an "engine core" child, records both pids, says it is up, then waits.
ENGINE_WITH_CORE = """
    import os, signal, subprocess, sys, time
    print("loading model (fake)", flush=True)
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core = subprocess.Popen([sys.executable, "-c",
                             "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(os.path.join(os.path.dirname(sys.argv[1]), "pids.tmp"), "w") as f:
        f.write(f"{os.getpid()} {core.pid}")
    os.replace(os.path.join(os.path.dirname(sys.argv[1]), "pids.tmp"),
               os.path.join(os.path.dirname(sys.argv[1]), "pids"))
    print("KV cache allocated (fake)", flush=True)
    time.sleep(600)
"""


def wait_for(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


@pytest.fixture
def sigkill_when_up(tmp_path: Path) -> Iterator[list[int]]:
    """SIGKILLs the worker (not its group) once it reports its pids, as an out-of-memory kill does."""
    pids: list[int] = []

    def kill() -> None:
        worker, core = (int(x) for x in wait_for(tmp_path / "run" / "pids").split())
        pids.extend([worker, core])
        os.kill(worker, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    yield pids
    thread.join(30)


def test_engine_killed_mid_run(fake_worker: Path, tmp_path: Path, sigkill_when_up: list[int]) -> None:
    with pytest.raises(EngineError) as info:
        run_fake(fake_worker, tmp_path, ENGINE_WITH_CORE, timeout_s=60)
    head, _, tail = str(info.value).partition("\n")
    assert head == "engine for tiny-llama was killed by SIGKILL (out of memory?)"
    assert "loading model (fake)" in tail and "KV cache allocated (fake)" in tail
    assert gone(sigkill_when_up), "the engine core outlived its worker"
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("ignore_term", [False, True], ids=["stops-on-sigterm", "ignores-sigterm"])
def test_engine_hung_past_its_timeout(
    fake_worker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ignore_term: bool
) -> None:
    if ignore_term:
        monkeypatch.setenv("IGNORE_TERM", "1")
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        run_fake(fake_worker, tmp_path, ENGINE_WITH_CORE, timeout_s=5)
    took = time.monotonic() - start
    assert str(info.value).startswith("engine for tiny-llama timed out after 5 s and was killed\n")
    assert "loading model (fake)" in info.value.log_tail
    pids = [int(x) for x in (tmp_path / "run" / "pids").read_text().split()]
    assert gone(pids, timeout=1.0), "a process of the hung engine survived"
    assert took < 5 + process.KILL_GRACE_S + 5


KV_TOO_SMALL_LOG = """
    import sys
    print("INFO [cpu_worker.py:260] Explicitly set (0.0/12.21) GiB for KV cache on node 0.")
    print("Traceback (most recent call last):")
    print('  File "vllm/v1/core/kv_cache_utils.py", line 1030, in _check_enough_kv_cache_memory')
    print("ValueError: To serve at least one request with the model's max seq len (2048), (0.0 GiB KV cache is "
          "needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, "
          "the estimated maximum model length is 480.")
    sys.exit(1)
"""
CUDA_OOM_LOG = """
    import sys
    print("Traceback (most recent call last):")
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 147.00 GiB. GPU 0 has a total capacity "
          "of 139.80 GiB of which 139.00 GiB is free.")
    sys.exit(1)
"""


def test_engine_error_names_the_cause_and_the_gate_figures(fake_worker: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError) as info:
        run_fake(fake_worker, tmp_path, KV_TOO_SMALL_LOG, max_model_len=2048,
                 engine_args={"kv_cache_memory_bytes": 512 * 1024})
    head = str(info.value).splitlines()[0]
    assert head.startswith(
        "engine for tiny-llama exited with status 1: KV cache budget too small for one request of max_model_len "
        "(KV budget 524,288 B (512.00 KiB); one request of max_model_len 2048 tokens needs 2,129,920 B (2.03 MiB) "
        "at 1024 B/token) (ValueError: To serve at least one request with the model's max seq len (2048)")
    assert info.value.cause == KV_TOO_SMALL
    with pytest.raises(EngineError) as info:
        run_fake(fake_worker, tmp_path, CUDA_OOM_LOG)
    assert info.value.cause == "device out of memory"
    assert str(info.value).splitlines()[0].startswith(
        "engine for tiny-llama exited with status 1: device out of memory (torch.OutOfMemoryError: CUDA out of")


@pytest.mark.parametrize(
    ("content", "message"),
    [("[1, 2]", "that is not an engine result (result: not a vramgate engine result: the top level must be a JSON "
                "object)"),
     ('{"schema": 1, "spec": {}, "device": "cpu"}', "that is not an engine result (missing field(s) kv, latency, "
                                                    "memory, scheduler, timing, versions)"),
     ('{"schema": 7, "spec": {}}', "that is not an engine result (result: engine result of schema 7, newer than "
                                   "this vramgate reads (schema 1)"),
     ('{"spec": {', "left no readable result (Expecting property name")],
    ids=["list", "missing-fields", "newer-schema", "truncated"],
)
def test_unusable_result_file_is_an_engine_error(fake_worker: Path, tmp_path: Path, content: str,
                                                 message: str) -> None:
    code = f"import sys; print('done'); open(sys.argv[2], 'w').write({content!r})"
    with pytest.raises(EngineError) as info:
        run_fake(fake_worker, tmp_path, code)
    assert message in str(info.value).splitlines()[0]


# -- hygiene: memory that does not come back -----------------------------------------------------------------

SERVER_SUITE = '''
import subprocess, sys
import pytest

SERVER = """
import sys
held = []
for line in sys.stdin:
    cmd, _, n = line.strip().partition(" ")
    if cmd == "grow":
        block = bytearray(int(n) << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        held.append(block)
    elif cmd == "free":
        held.clear()
    print("ok", flush=True)
"""


class Server:
    """A long-lived child process that holds memory on request (an engine server's stand-in)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, line):
        self.proc.stdin.write(line.encode() + b"\\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == b"ok\\n"


@pytest.fixture(scope="session")
def engine():
    server = Server()
    yield server
    server.proc.stdin.close()
    server.proc.wait()


def test_first_use(engine):
    engine.ask("grow 1")
    engine.ask("free")


def test_leaves_memory_in_the_server(engine):
    engine.ask("grow 200")


def test_returns_its_memory(engine):
    engine.ask("free")
    engine.ask("grow 200")
    engine.ask("free")


KEEP = []


def test_leaves_a_child_holding_memory(engine):
    code = "import sys; b = bytearray(150 << 20); b[::4096] = b'x' * len(b[::4096]); print('up', flush=True); " \\
           "sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\\n"
    KEEP.append(p)


def test_plain_test_is_not_memory_checked():
    engine_like = Server()
    engine_like.ask("grow 200")
    KEEP.append(engine_like.proc)


def test_zz_cleanup():
    for p in KEEP:
        p.kill()
        p.wait()
'''


def test_hygiene_fails_the_test_that_leaves_memory_in_the_process_tree(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_server=SERVER_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=6, errors=3)
    out = result.stdout.str()
    # The server the session fixture starts is the starting state of its first test, not a leak of it.
    assert "test_server.py::test_first_use left behind" not in out
    assert "test_server.py::test_returns_its_memory left behind" not in out
    grown = re.compile(r"- child processes' memory did not return to its starting level: resident [\d.]+ MiB before "
                       r"the test, [\d.]+ MiB after \(\+([\d.]+) MiB, tolerance (\d+)\.00 MiB\); "
                       r"pid \d+ \+([\d.]+) MiB \(now [\d.]+ MiB\): \S*python\S* -c ")
    blamed = {}
    for name, lines in re.findall(r"vramgate hygiene: (\S+) left behind:\n((?:- .*\n)+)", out):
        found = grown.search(lines)
        blamed[name] = (float(found.group(1)), int(found.group(2)), float(found.group(3))) if found else None
    assert set(blamed) == {"test_server.py::test_leaves_memory_in_the_server",
                           "test_server.py::test_leaves_a_child_holding_memory",
                           "test_server.py::test_plain_test_is_not_memory_checked"}
    total, tolerance, worst = blamed["test_server.py::test_leaves_memory_in_the_server"] or (0, 0, 0)
    assert 190 <= total <= 215 and 190 <= worst <= 215 and tolerance == PROCESS_TREE_TOLERANCE >> 20
    total, _, worst = blamed["test_server.py::test_leaves_a_child_holding_memory"] or (0, 0, 0)
    assert 145 <= total <= 170 and 145 <= worst <= 170
    result.stdout.fnmatch_lines(["*- child process * still running: *bytearray(150 << 20)*"])
    # A test that uses neither the engine nor a GPU gets the process check only.
    result.stdout.fnmatch_lines([
        "*vramgate hygiene: test_server.py::test_plain_test_is_not_memory_checked left behind:*",
        "*- child process * still running: *",
    ])
    assert blamed["test_server.py::test_plain_test_is_not_memory_checked"] is None  # no memory line
    off = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "--gate-hygiene=off")
    off.assert_outcomes(passed=6)


def _state(used: int, own: int | None, procs: dict[int, int], context: bool = True) -> HygieneState:
    return HygieneState(set(), None, tree={}, devices={0: DeviceReading(used, own, procs)}, cuda_context=context)


def test_device_leaks_attribute_this_process_and_name_the_others() -> None:
    me = os.getpid()
    # This process's own growth (its context, lazily loaded modules) is not a leak.
    assert device_leaks(_state(2 * GiB, 1 * GiB, {me: GiB}), _state(3 * GiB, 2 * GiB, {me: 2 * GiB})) == []
    # Another process that kept 2 GiB is, with its pid and the numbers.
    (line,) = device_leaks(_state(2 * GiB, 1 * GiB, {me: GiB}),
                           _state(4 * GiB, 1 * GiB, {me: GiB, 4242: 2 * GiB}))
    assert line == ("GPU 0 memory used by other processes did not return to its starting level: +2.00 GiB "
                    "(device used 2.00 GiB before the test, 4.00 GiB after; tolerance 256.00 MiB); pid 4242 +2.00 GiB")
    # Within the tolerance: nothing.
    assert device_leaks(_state(GiB, 0, {}, False), _state(GiB + NVML_LEAK_TOLERANCE, 0, {}, False)) == []
    # NVML lists host pids only (a container): this process's share is taken as unchanged...
    assert device_leaks(_state(2 * GiB, None, {77: GiB}), _state(2 * GiB + 100 * MiB, None, {77: GiB})) == []
    (line,) = device_leaks(_state(2 * GiB, None, {77: GiB}), _state(3 * GiB, None, {77: GiB, 78: GiB}))
    assert "+1.00 GiB" in line and "pid 78 +1.00 GiB" in line
    # ...unless its context appeared during the test: then the device cannot be judged.
    assert device_leaks(_state(GiB, 0, {}, False), _state(3 * GiB, None, {77: 2 * GiB})) == []


def test_tree_leak_names_the_process_that_grew() -> None:
    before = HygieneState({10, 11}, None, tree={10: 100 * MiB, 11: 50 * MiB})
    assert tree_leak(before, HygieneState({10, 11}, None, tree={10: 150 * MiB, 11: 50 * MiB})) == []
    (line,) = tree_leak(before, HygieneState({10, 11}, None, tree={10: 100 * MiB, 11: 350 * MiB}))
    assert line.startswith("child processes' memory did not return to its starting level: resident 150.00 MiB "
                           "before the test, 450.00 MiB after (+300.00 MiB, tolerance 64.00 MiB); "
                           "pid 11 +300.00 MiB (now 350.00 MiB)")


FAKE_NVML_SUITE = '''
import os
import pytest
from vramgate.pytest_plugin import hygiene

HELD = {}


def fake_readings():
    me = os.getpid()
    procs = {me: 600 << 20, **HELD}
    return {0: hygiene.DeviceReading((600 << 20) + sum(procs.values()), procs[me], procs)}


hygiene.device_readings = fake_readings  # this session runs in its own process


@pytest.fixture
def engine():
    return None


def test_engine_left_running_elsewhere(engine):
    HELD[31337] = 3 << 30  # an engine in its own session, no longer a child of this process


def test_clean(engine):
    HELD.clear()
'''


def test_hygiene_fails_the_test_that_leaves_device_memory(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nvml=FAKE_NVML_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*vramgate hygiene: test_nvml.py::test_engine_left_running_elsewhere left behind:*",
        "*- GPU 0 memory used by other processes did not return to its starting level: +3.00 GiB (device used * "
        "before the test, * after; tolerance 256.00 MiB); pid 31337 +3.00 GiB*",
    ])
    assert "test_nvml.py::test_clean left behind" not in result.stdout.str()


DAEMON_GPU_SUITE = '''
import os, subprocess, sys, time
import pytest

HOLD = ("import torch, time, sys; x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); "
        "torch.cuda.synchronize(); open(sys.argv[1], 'w').write('up'); time.sleep(120)")


@pytest.mark.requires_gpus(1)
def test_starts_an_engine_that_escapes():
    ready = os.path.join(os.environ["DAEMON_DIR"], "ready")
    # Double fork into a new session: the holder is no child of this process, only NVML sees it.
    launcher = ("import os, subprocess, sys; os.setsid(); "
                "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
                "open(sys.argv[3], 'w').write(str(p.pid)); os._exit(0)")
    subprocess.run([sys.executable, "-c", launcher, HOLD, ready, os.environ["DAEMON_PID"]], check=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.requires_gpus(1)
def test_clean_gpu_test():
    pass
'''


@pytest.mark.requires_gpus(1)
def test_hygiene_sees_device_memory_of_an_escaped_process(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU: a process that left this process's tree still holds 1 GiB; NVML shows it, hygiene names the test."""
    pytest.importorskip("pynvml")
    pytest.importorskip("torch")
    pid_file = tmp_path / "daemon.pid"
    monkeypatch.setenv("DAEMON_DIR", str(tmp_path))
    monkeypatch.setenv("DAEMON_PID", str(pid_file))
    pytester.makepyfile(test_daemon=DAEMON_GPU_SUITE)
    pytester.makeconftest((ROOT / "conftest.py").read_text())  # the plugin, where it is not installed
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    finally:
        if pid_file.exists():
            daemon = int(pid_file.read_text())
            os.kill(daemon, signal.SIGKILL)
            assert gone([daemon])
            _wait_until_nvml_drops(daemon)  # the driver frees a dead process's memory shortly after
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*vramgate hygiene: test_daemon.py::test_starts_an_engine_that_escapes left behind:*",
        "*- GPU * memory used by other processes did not return to its starting level: +1.* GiB*pid * +1.* GiB*",
    ])
    assert "test_daemon.py::test_clean_gpu_test left behind" not in result.stdout.str()


def _wait_until_nvml_drops(pid: int, timeout: float = 20.0) -> None:
    from vramgate.machine.probes.nvml import read_device

    deadline = time.monotonic() + timeout
    while pid in read_device(0).processes and time.monotonic() < deadline:
        time.sleep(0.1)
