"""Child processes of the gate: the PYTHONPATH that finds this package, and how a child is started, waited
for, ended and read.

Note [process groups]: every child the gate starts (an engine, an engine server, a tensor-parallel rank)
runs in its own session, so it leads a process group that holds whatever it starts in turn (vLLM's engine
core, a rank's helpers). Ending a child means ending its group: SIGTERM, a grace period, then SIGKILL, so
nothing a child started outlives it. The child's stdout and stderr go to one log file, whose last
:data:`LOG_TAIL_LINES` lines are what an error shows.

A child may also be forked from a preloaded interpreter (``launch(..., preload=FOLDER)``, Note [preloaded
engines] in :mod:`vramgate.runtime.preload`); it is handled here exactly as a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

from vramgate.runtime import preload as preloading

#: The folder that holds this ``vramgate`` package (``src/`` in a source tree, ``site-packages`` when installed).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
#: Lines of a child's log that an error about it shows.
LOG_TAIL_LINES = 60
#: Seconds a child gets to end after SIGTERM (a timeout, an interrupt) before its process group is killed.
KILL_GRACE_S = 10.0
#: Seconds to wait for a child to be reaped after SIGKILL.
REAP_S = 10.0
#: Seconds to wait, after SIGKILL, for the last member of a child's process group to be gone (Note [a group
#: is gone when its last member is]).
GROUP_GONE_S = 30.0


def pythonpath(env: Mapping[str, str], first: Iterable[Path] = ()) -> str:
    """A PYTHONPATH for a child that imports this same ``vramgate``: *first* (overlays, stand-ins), then
    this package's folder, then whatever *env* already had."""
    paths = [str(p) for p in first]
    paths.append(str(PACKAGE_PARENT))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    return os.pathsep.join(paths)


class Child(Protocol):
    """A child the gate started: a ``subprocess.Popen``, or a child of a preloaded interpreter."""

    pid: int
    returncode: int | None
    stdin: IO[bytes] | None

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; ``subprocess.TimeoutExpired`` after *timeout* seconds."""


def launch(command: Sequence[str], log_path: Path, *, env: Mapping[str, str], cwd: Path,
           stdin: int | None = None, preload: Path | None = None) -> Child:
    """Start *command* in its own session (Note [process groups]) with stdout and stderr in *log_path*.

    With *preload* (a folder for its files), a ``python -m MODULE ...`` command is forked from the preloaded
    interpreter of that python and module where it can serve it (Note [preloaded engines]), else started
    fresh.
    """
    if preload is not None:
        child = preloading.spawn(command, log_path, env=env, cwd=cwd, stdin=stdin, folder=preload)
        if child is not None:
            return child
    with open(log_path, "wb") as log:  # the child holds its own copy of the file
        return subprocess.Popen(list(command), stdin=stdin, stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                                cwd=cwd, start_new_session=True)


#: Children that live as long as the session on purpose (the serving suite's servers), by pid.
_SESSION_CHILDREN: set[int] = set()


def keep_for_session(proc: Child) -> None:
    """Mark *proc* as a child that outlives the test that started it on purpose (a server reused by later
    tests): hygiene (Note [hygiene] in :mod:`vramgate.pytest_plugin.hygiene`) leaves it and its descendants out
    until :func:`release` or its exit."""
    _SESSION_CHILDREN.add(proc.pid)


def release(proc: Child) -> None:
    """*proc* is no longer kept for the session (it was stopped)."""
    _SESSION_CHILDREN.discard(proc.pid)


def session_pids() -> set[int]:
    """The children kept for the session that still run, and all their descendants."""
    from vramgate.machine.probes.cpu import children, proc_stat

    alive = {pid for pid in _SESSION_CHILDREN if (stat := proc_stat(pid)) is not None and stat.state != "Z"}
    return alive | {kid for pid in alive for kid in children(pid)}


def end_with_parent() -> None:
    """In a child of the gate: end this process, and its process group where it leads one, when the process that
    started it is gone (a thread polls the parent's pid every 0.5 s).

    Note [no child outlives its gate]: the gate ends its children's groups itself (Note [process groups]), but a
    gate that is killed outright (SIGKILL, an out-of-memory kill, a CI timeout's SIGTERM) runs no finalizer. A
    child that serves (an engine kept up for paired rounds, vLLM's API server with its engine core) would then run
    on; so it watches its parent and, when the parent is gone, kills its own group (every child the gate starts
    leads one), taking what it started with it."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                if os.getpgid(0) == os.getpid():
                    os.killpg(os.getpid(), signal.SIGKILL)
                os._exit(3)

    threading.Thread(target=watch, name="vramgate-parent-watch", daemon=True).start()


def signal_group(proc: Child, sig: signal.Signals) -> None:
    """Send *sig* to *proc*'s process group; nothing when the group is gone."""
    if proc.pid <= 0:  # never this process's own group
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def await_groups_gone(pgids: Iterable[int], bound_s: float = GROUP_GONE_S) -> list[int]:
    """Wait, up to *bound_s*, until no live process (zombies do not count) is left in any of the process groups
    *pgids*; the pids still there at the bound (none when every group is gone).

    Note [a group is gone when its last member is]: a group's leader exiting, and SIGKILL sent to the group, do
    not mean its other members are gone. vLLM's tensor-parallel workers sit in the engine's group and notice
    their parent's death through a pipe; a process killed while it holds GPU memory is alive until the driver
    has torn its context down. A caller that reads the GPU or the memory next (the GPU-state guard's "after"
    reading, hygiene) would see them, so every way of ending a child waits for its whole group."""
    from vramgate.machine.probes.cpu import group_members

    groups = [pgid for pgid in pgids if pgid > 0]
    deadline = time.monotonic() + bound_s
    delay = 0.005
    while True:
        left = [pid for pgid in groups for pid in group_members(pgid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def kill_groups(procs: Iterable[Child], grace_s: float | None = None) -> None:
    """End every one of *procs*' process groups: SIGTERM, up to *grace_s* (default :data:`KILL_GRACE_S`) for
    them all to exit, then SIGKILL (a group may hold children even when its leader is gone); reap them, and
    wait until no member of any of the groups is left (Note [a group is gone when its last member is])."""
    procs = list(procs)
    grace = KILL_GRACE_S if grace_s is None else grace_s
    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired, preloading.PreloadError):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired, preloading.PreloadError):
            proc.wait(timeout=REAP_S)
    await_groups_gone(proc.pid for proc in procs)


def kill_group(proc: Child, grace_s: float | None = None) -> None:
    """End *proc*'s process group (see :func:`kill_groups`)."""
    kill_groups([proc], grace_s)


def wait_or_kill(proc: Child, timeout_s: float | None,
                 grace_s: float | None = None) -> int | None:
    """*proc*'s exit status, or None when it ran past *timeout_s* (None: no limit) and its group was killed.

    Whatever happens (an exit, a timeout, an interrupt of this process) the group is ended on the way out:
    the child's own children go with it, and this returns only when the last of them is gone (Note [a group is
    gone when its last member is]).
    """
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace_s)
        return None
    except BaseException:
        kill_group(proc, grace_s)
        raise
    finally:
        signal_group(proc, signal.SIGKILL)
        await_groups_gone([proc.pid])


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last *lines* lines of the log *path* (empty when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
