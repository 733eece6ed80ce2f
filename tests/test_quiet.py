"""Note [quiet sections]: a quiet section waits for the other workers' tests and holds their next ones back; a test's
own shared lock never blocks it; a bounded wait says that it ran beside them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from vramgate.runtime import quiet

ROOT = Path(__file__).resolve().parents[1]

# Another worker: holds the shared lock (a test in progress) until RELEASE exists, then says so.
OTHER_TEST = """
import pathlib, sys, time
from vramgate.runtime import quiet
lock, folder = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with quiet.shared(lock):
    (folder / "held").write_text("")
    while not (folder / "release").exists():
        time.sleep(0.01)
    (folder / "released").write_text("")
"""

# Another worker's next test: writes ENTERED once it has the shared lock.
NEXT_TEST = """
import pathlib, sys
from vramgate.runtime import quiet
lock, folder = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with quiet.shared(lock):
    (folder / "entered").write_text("")
"""


def _start(script: str, lock: Path, folder: Path) -> subprocess.Popen[bytes]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, "-c", script, str(lock), str(folder)], env=env)


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_a_quiet_section_starts_only_after_the_other_workers_test_ends(tmp_path: Path) -> None:
    lock = tmp_path / "quiet.lock"
    other = _start(OTHER_TEST, lock, tmp_path)
    try:
        _wait_for(tmp_path / "held")
        (tmp_path / "release").write_text("")
        with quiet.quiet(lock) as line:
            assert (tmp_path / "released").exists(), "the quiet section began while the other test still ran"
            assert str(line).startswith("quiet: waited ") and line.quiet
    finally:
        other.wait(timeout=30)


# Another worker whose tests follow each other without a gap.
BACK_TO_BACK = """
import pathlib, sys, time
from vramgate.runtime import quiet
lock, folder = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for n in range(3000):
    if (folder / "stop").exists():
        break
    with quiet.shared(lock):
        if n == 0:
            (folder / "held").write_text("")
        time.sleep(0.005)
(folder / "done").write_text("")
"""


def test_tests_that_follow_each_other_without_a_gap_cannot_keep_a_quiet_section_out(tmp_path: Path) -> None:
    lock = tmp_path / "quiet.lock"
    other = _start(BACK_TO_BACK, lock, tmp_path)
    try:
        _wait_for(tmp_path / "held")
        with quiet.quiet(lock, wait_s=10) as got:
            assert got.quiet and not (tmp_path / "done").exists()
    finally:
        (tmp_path / "stop").write_text("")
        other.wait(timeout=120)


def test_the_other_workers_next_test_waits_until_the_quiet_section_ends(tmp_path: Path) -> None:
    lock = tmp_path / "quiet.lock"
    with quiet.quiet(lock):
        nxt = _start(NEXT_TEST, lock, tmp_path)
        time.sleep(0.5)  # time enough for it to start; it must still be waiting
        assert not (tmp_path / "entered").exists()
    try:
        _wait_for(tmp_path / "entered")
    finally:
        nxt.wait(timeout=30)


def test_a_tests_own_shared_lock_does_not_block_its_quiet_section_and_comes_back(tmp_path: Path) -> None:
    lock = tmp_path / "quiet.lock"
    with quiet.shared(lock):
        with quiet.quiet(lock, wait_s=5) as line:
            assert str(line).startswith("quiet: waited ") and line.quiet
        # The test holds its shared lock again: another worker's quiet section cannot start now.
        probe = subprocess.run(
            [sys.executable, "-c", "import pathlib, sys\nfrom vramgate.runtime import quiet\n"
             "with quiet.quiet(pathlib.Path(sys.argv[1]), wait_s=0.3) as line:\n    print(line)", str(lock)],
            env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
            check=True, timeout=60)
        assert "the other workers were still busy after 0.3 s; this look ran beside them" in probe.stdout


def test_without_a_session_lock_a_quiet_section_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(quiet.QUIET_LOCK_ENV, raising=False)
    with quiet.shared():
        with quiet.quiet() as line:
            assert str(line) == "quiet: no other worker to wait for (no session lock)" and not line.quiet


def test_the_plugin_gives_the_sessions_workers_one_lock_and_every_test_holds_it(pytester: pytest.Pytester,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(quiet.QUIET_LOCK_ENV, raising=False)
    pytester.makepyfile(test_lock="""
import fcntl, os
from vramgate.runtime import quiet

def test_held():
    path = quiet.lock_path()
    assert path is not None and path.exists()
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the test's own shared lock keeps an exclusive one out
        raise AssertionError("no shared lock is held while the test runs")
    finally:
        os.close(fd)
""")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2").assert_outcomes(passed=1)
