"""Quiet sections: a measurement that needs the machine to itself, with the other workers of the session waiting.

Note [quiet sections]: on a 2-core runner the pre-merge gate's two xdist workers share the cores, and a timing
taken while the other worker starts an engine or runs a simulation carries that load. Every test of a gate
session runs holding a *shared* lock on one file the session's workers share (``fcntl.flock``, taken by the
plugin around each test); a measurement that needs quiet takes it *exclusively*: it waits until the other
workers have finished the test each is running (their shared locks go), and their next tests wait until it is
done. Only a second look takes one (Note [second look] in :mod:`vramgate.engine.looks`), so quiet costs time
only when a timing check has failed once: at most the other worker's current test (tens of seconds) plus the
look itself. A test holding its own shared lock lets it go before it asks for the exclusive one (``flock``
converts a lock by releasing it first), so two workers that both ask cannot deadlock: one gets it, then the
other. Waiting is bounded (:data:`QUIET_WAIT_S`): past it the look proceeds without quiet and says so.

A waiting quiet section first takes a second lock (the file's name with ``.want``) that every test passes through
before it takes its shared lock: the other workers' next tests wait from the moment a quiet section asks, so it
cannot be kept out by tests that follow each other without a gap.

The file is named by :data:`QUIET_LOCK_ENV`, which the session's controller sets for its workers; two gate
sessions on one runner that are given the same file share their quiet too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: The environment variable naming the session's lock file.
QUIET_LOCK_ENV = "VRAMGATE_QUIET_LOCK"
#: The longest a quiet section waits for the other workers' tests to finish, in seconds.
QUIET_WAIT_S = 300.0

_held: dict[str, int] = {}
"""Lock file -> the descriptor this process holds its shared lock on (a test in progress)."""


def start_session() -> Callable[[], None]:
    """Give this process's session (and the xdist workers it starts, through the environment) a lock file of its
    own, unless one is given already; the function that removes it at the session's end."""
    if os.environ.get(QUIET_LOCK_ENV):
        return lambda: None
    fd, name = tempfile.mkstemp(prefix="vramgate-quiet-", suffix=".lock")
    os.close(fd)
    os.environ[QUIET_LOCK_ENV] = name

    def end() -> None:
        if os.environ.get(QUIET_LOCK_ENV) == name:
            del os.environ[QUIET_LOCK_ENV]
        Path(name).unlink(missing_ok=True)
        _want(Path(name)).unlink(missing_ok=True)

    return end


def lock_path() -> Path | None:
    """The session's lock file, or None where no session set one (the measurement runs as it comes)."""
    raw = os.environ.get(QUIET_LOCK_ENV, "").strip()
    return Path(raw) if raw else None


def _want(path: Path) -> Path:
    """The lock a quiet section takes first, so that the other workers' next tests wait for it (Note [quiet
    sections]: without it, a worker that lets its shared lock go between two tests and takes it again at once
    would keep a waiting quiet section out for ever)."""
    return path.with_name(path.name + ".want")


@contextlib.contextmanager
def shared(path: Path | None = None) -> Iterator[None]:
    """Hold the shared lock for as long as the block runs: what every test of the session does (Note [quiet
    sections]); it waits first for a quiet section that is waiting or running. Nothing without a lock file."""
    path = path or lock_path()
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    outer = _held.get(str(path))  # a gate session run inside a test of another (pytester) shares its file
    try:
        want = os.open(_want(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(want, fcntl.LOCK_SH)  # a quiet section that wants the machine goes first
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(want)
        _held[str(path)] = fd
        yield
    finally:
        if outer is None:
            _held.pop(str(path), None)
        else:
            _held[str(path)] = outer
        os.close(fd)  # closing the descriptor lets the lock go


def _lock_within(fd: int, deadline: float) -> bool:
    """Take an exclusive lock on *fd* by the monotonic *deadline*; whether it was taken."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


@dataclass(frozen=True)
class Quiet:
    """How a quiet section began: how long it waited for the other workers, and whether it got the machine."""

    waited_s: float
    quiet: bool
    line: str
    """The same in words, for a test's report."""

    def __str__(self) -> str:
        return self.line


@contextlib.contextmanager
def quiet(path: Path | None = None, wait_s: float = QUIET_WAIT_S) -> Iterator[Quiet]:
    """Run the block with the machine to this worker alone (Note [quiet sections]); yields how long it waited for
    the other workers, or that it ran without quiet (no lock file, or *wait_s* passed)."""
    path = path or lock_path()
    if path is None:
        yield Quiet(0.0, False, "quiet: no other worker to wait for (no session lock)")
        return
    own = _held.get(str(path))
    fd = own if own is not None else os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    want = os.open(_want(path), os.O_RDWR | os.O_CREAT, 0o600)
    start = time.monotonic()
    got = False
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)  # this test's own shared lock must not keep its quiet section out
        deadline = start + wait_s
        got = _lock_within(want, deadline) and _lock_within(fd, deadline)
        if not got:
            fcntl.flock(want, fcntl.LOCK_UN)  # running beside them, it holds nobody back
        waited = time.monotonic() - start
        yield Quiet(waited, got, f"quiet: waited {waited:.1f} s for the other workers' tests" if got else
                    f"quiet: the other workers were still busy after {wait_s:g} s; this look ran beside them")
    finally:
        os.close(want)  # the other workers' next tests may start
        if own is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)  # back to the test's own shared lock (released first if exclusive)
        else:
            os.close(fd)
