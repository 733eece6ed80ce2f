"""Children forked from a preloaded interpreter (vramgate.runtime.preload), with a stand-in module for the engine
worker: what the child is (environment, folder, arguments, stdin, log, exit status), what is refused and
started fresh instead, and what happens when the preloaded interpreter dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramgate.pytest_plugin.hygiene import hygiene_state
from vramgate.runtime import preload, process
from vramgate.runtime.exits import describe_exit

pytestmark = pytest.mark.skipif(not preload.enabled(), reason="needs os.fork and os.pidfd_open (Linux)")

STAND_IN = '''
import json, os, sys, threading, time

PRELOADED_IN = None


def preload():
    global PRELOADED_IN
    PRELOADED_IN = os.getpid()
    if os.environ.get("STAND_IN_THREAD"):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def main(argv):
    out, mode = argv[0], argv[1]
    print("hello from the child", flush=True)
    report = {"pid": os.getpid(), "preloaded_in": PRELOADED_IN, "env": dict(os.environ), "cwd": os.getcwd(),
              "argv": sys.argv[1:], "sid": os.getsid(0)}
    if mode == "lines":
        report["lines"] = [line.strip() for line in sys.stdin if line.strip() != "quit"]
    with open(out, "w") as f:
        json.dump(report, f)
    if mode == "sleep":
        time.sleep(120)
    if mode == "kill":
        os.kill(os.getpid(), 9)
    return int(argv[2]) if len(argv) > 2 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[list[str], dict[str, str]]]:
    """A module ``stand_in`` on the path: the command prefix and the environment that run it."""
    (tmp_path / "stand_in.py").write_text(textwrap.dedent(STAND_IN), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("STAND_IN_THREAD", preload.DISABLE_VAR)}
    env["PYTHONPATH"] = process.pythonpath(env, first=[tmp_path])
    env.update({"HF_HOME": str(tmp_path / "hf"), "TMPDIR": str(tmp_path), "VLLM_CONFIG_ROOT": str(tmp_path)})
    yield [sys.executable, "-m", "stand_in"], env
    preload.close_all()


def spawn(command: list[str], env: dict[str, str], run: Path, stdin: int | None = None) -> process.Child:
    run.mkdir(parents=True, exist_ok=True)
    return process.launch(command, run / "child.log", env=env, cwd=run, stdin=stdin, preload=run.parent / "pre")


def test_a_child_is_forked_with_the_request_environment_folder_arguments_and_status(
        stand_in: tuple[list[str], dict[str, str]], tmp_path: Path) -> None:
    command, env = stand_in
    runs = []
    for i in range(2):
        run = tmp_path / f"run{i}"
        child = spawn([*command, str(run / "out.json"), "exit", str(3 + i)], {**env, "TMPDIR": str(run)}, run)
        assert isinstance(child, preload.PreloadedProcess)
        assert process.wait_or_kill(child, 60) == 3 + i
        runs.append(json.loads((run / "out.json").read_text()))
        assert (run / "child.log").read_text().strip() == "hello from the child"
        assert runs[-1]["env"] == {**env, "TMPDIR": str(run)}
        assert runs[-1]["cwd"] == str(run)
        assert runs[-1]["argv"] == [str(run / "out.json"), "exit", str(3 + i)]
    # Both were forked from one interpreter that had run preload(); each leads its own session.
    assert runs[0]["preloaded_in"] == runs[1]["preloaded_in"] not in (runs[0]["pid"], runs[1]["pid"], os.getpid())
    assert all(r["sid"] == r["pid"] for r in runs)


def test_stdin_is_a_pipe_that_ends_with_the_writer(stand_in: tuple[list[str], dict[str, str]],
                                                   tmp_path: Path) -> None:
    command, env = stand_in
    run = tmp_path / "run"
    child = spawn([*command, str(run / "out.json"), "lines"], env, run, stdin=subprocess.PIPE)
    assert child.stdin is not None
    child.stdin.write(b"round 1\nround 2\nquit\n")
    child.stdin.close()
    assert process.wait_or_kill(child, 60) == 0
    assert json.loads((run / "out.json").read_text())["lines"] == ["round 1", "round 2"]


def test_a_timeout_kills_the_child_and_a_signal_is_its_status(stand_in: tuple[list[str], dict[str, str]],
                                                              tmp_path: Path) -> None:
    command, env = stand_in
    run = tmp_path / "slow"
    child = spawn([*command, str(run / "out.json"), "sleep"], env, run)
    deadline = time.monotonic() + 30
    while not (run / "out.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.wait_or_kill(child, 0.5, grace_s=1) is None
    pid = json.loads((run / "out.json").read_text())["pid"]
    assert child.wait(10) == -signal.SIGTERM
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    run = tmp_path / "killed"
    child = spawn([*command, str(run / "out.json"), "kill"], env, run)
    status = process.wait_or_kill(child, 60)
    assert status == -signal.SIGKILL
    assert describe_exit(status) == "was killed by SIGKILL (out of memory?)"


def test_another_import_environment_starts_fresh(stand_in: tuple[list[str], dict[str, str]], tmp_path: Path) -> None:
    command, env = stand_in
    first = spawn([*command, str(tmp_path / "a.json"), "exit"], env, tmp_path / "a")
    assert isinstance(first, preload.PreloadedProcess)
    other = spawn([*command, str(tmp_path / "b.json"), "exit"], {**env, "SOMETHING_ELSE": "1"}, tmp_path / "b")
    assert isinstance(other, subprocess.Popen)
    assert process.wait_or_kill(first, 60) == process.wait_or_kill(other, 60) == 0
    assert json.loads((tmp_path / "b.json").read_text())["preloaded_in"] is None  # a fresh interpreter
    assert preload.same_imports(command, env, command, {**env, "TMPDIR": "/elsewhere"})
    assert not preload.same_imports(command, env, command, {**env, "PYTHONPATH": "/overlay"})
    assert not preload.same_imports(command, env, [sys.executable, "-m", "other"], env)
    assert not preload.same_imports([sys.executable, "script.py"], env, [sys.executable, "script.py"], env)


def test_a_refusal_starts_fresh_for_the_rest_of_the_process(stand_in: tuple[list[str], dict[str, str]], tmp_path: Path,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    command, env = stand_in
    threaded = {**env, "STAND_IN_THREAD": "1"}
    for name in ("t1", "t2"):
        child = spawn([*command, str(tmp_path / f"{name}.json"), "exit"], threaded, tmp_path / name)
        assert isinstance(child, subprocess.Popen)
        assert process.wait_or_kill(child, 60) == 0
    err = capfd.readouterr().err
    assert err.count("start fresh interpreters") == 1
    assert "2 threads are running after the imports" in err


def test_turned_off_by_the_variable(stand_in: tuple[list[str], dict[str, str]], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    command, env = stand_in
    monkeypatch.setenv(preload.DISABLE_VAR, "0")
    assert not preload.enabled()
    child = spawn([*command, str(tmp_path / "x.json"), "exit"], env, tmp_path / "x")
    assert isinstance(child, subprocess.Popen)
    assert process.wait_or_kill(child, 60) == 0


def test_a_dead_preloaded_interpreter_kills_its_children_and_says_so(stand_in: tuple[list[str], dict[str, str]],
                                                                     tmp_path: Path) -> None:
    command, env = stand_in
    run = tmp_path / "run"
    child = spawn([*command, str(run / "out.json"), "sleep"], env, run)
    (interpreter,) = preload.interpreter_pids()
    os.kill(interpreter, signal.SIGKILL)
    with pytest.raises(preload.PreloadError, match="went away before it ended: it was killed by SIGKILL"):
        child.wait(30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once killed
    assert not Path(f"/proc/{child.pid}").exists()
    with pytest.raises(preload.PreloadError):
        process.wait_or_kill(child, 5)


def test_hygiene_leaves_out_the_preloaded_interpreter_but_not_its_children(
        stand_in: tuple[list[str], dict[str, str]], tmp_path: Path) -> None:
    command, env = stand_in
    run = tmp_path / "run"
    child = spawn([*command, str(run / "out.json"), "sleep"], env, run)
    try:
        kids = hygiene_state().children
        assert child.pid in kids
        assert not kids & preload.interpreter_pids()
    finally:
        process.kill_group(child, grace_s=1)
