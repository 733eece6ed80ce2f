"""Children forked from a preloaded interpreter: torch and vLLM imported once per gate process, not once per run.

Note [preloaded engines]: an engine subprocess on CPU spends about 5.5 s of its
8 importing torch and vLLM, and the gate starts a dozen or more of them. So the
engine runner (and a pair of engine servers) may ask :func:`spawn` instead of
starting a fresh interpreter. The first request starts one *preloaded
interpreter* (``python -m vramgate.runtime.preload MODULE``) per gate process,
engine interpreter and module: it calls ``MODULE.preload()`` (which imports
what every run needs) and then forks one child per request. The child becomes
what a fresh ``python -m MODULE ARGS`` would have been: its own session (so its
process group is killed as a fresh child's would be), its own working folder,
stdin and log, exactly the request's environment, fresh random seeds, and then
``MODULE.main(ARGS)``. Only the import is shared; the engine, its weights, its
KV cache and every figure are the child's own.

A request is served only where the fork cannot change what the child computes:

- its environment equals the preloaded interpreter's, but for
  :data:`PER_RUN` (variables read after import: vLLM's config folder, the
  temporary folder, the Hugging Face home, which nothing writes offline). A
  profile's overlay changes ``PYTHONPATH``, a spec's own variables change
  the environment: such a run starts a fresh interpreter;
- the preloaded interpreter is still one thread after its imports (forking a
  threaded process can leave a lock held) and, when torch is loaded, CUDA is
  not initialized (a forked child cannot use it). Otherwise it refuses and
  every request starts fresh. The engine runner preloads on the CPU tier only;
- the platform can fork and wait on a process descriptor (``os.fork``,
  ``os.pidfd_open``: Linux), and ``VRAMGATE_PRELOAD`` is not ``0``.

What differs: the timing of the import (about 0 s in a child), and the RSS
the child reports (its parent's library pages it never touches are not
mapped into it). Neither is a gated figure of a forked run: an engine whose
KV cache vLLM sizes from its RSS (a serving configuration) starts fresh.

The preloaded interpreter reports each child's pid and exit status to the gate
process over its stdout; it exits when the gate process closes its stdin (or
dies). If it dies first, the children it had started are killed and waiting on
them raises :class:`PreloadError`.

Its server side imports nothing of the gate's: it runs before anything else
is imported. Longer than 400 lines: both sides of one protocol,
the gate's and the preloaded interpreter's, are kept together so that a change
to one is made next to the other.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: Variables a preloaded child takes from its request although they may differ from the preloaded
#: interpreter's: nothing reads them during the imports ``preload()`` does, or nothing depends on them offline
#: (pytest's ``PYTEST_CURRENT_TEST`` names the test that started the run).
PER_RUN = frozenset({"HF_HOME", "VLLM_CONFIG_ROOT", "TMPDIR", "PYTEST_CURRENT_TEST"})
#: ``0`` turns preloading off: every child is a fresh interpreter.
DISABLE_VAR = "VRAMGATE_PRELOAD"
#: Seconds the preloaded interpreter may take to import before it is given up (and runs start fresh).
READY_TIMEOUT_S = 300.0


class PreloadError(ChildProcessError):
    """A preloaded child whose parent, the preloaded interpreter, went away before reporting its exit."""


def enabled() -> bool:
    """Whether this platform and environment allow preloaded children."""
    return os.environ.get(DISABLE_VAR, "1") != "0" and hasattr(os, "fork") and hasattr(os, "pidfd_open")


def import_environment(env: Mapping[str, str]) -> dict[str, str]:
    """*env* without :data:`PER_RUN`: what must be equal for a preloaded interpreter to serve a request."""
    return {k: v for k, v in env.items() if k not in PER_RUN}


def module_command(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``(python, module, args)`` of a ``python -m MODULE ARGS`` command, else None."""
    if len(command) >= 3 and command[1] == "-m":
        return str(command[0]), str(command[2]), [str(a) for a in command[3:]]
    return None


def same_imports(command_a: Sequence[str], env_a: Mapping[str, str], command_b: Sequence[str],
                 env_b: Mapping[str, str]) -> bool:
    """Whether two commands would be served by the same preloaded interpreter (same python, module and
    imports): what a paired measurement checks so that both of its sides start the same way."""
    a, b = module_command(command_a), module_command(command_b)
    return (a is not None and b is not None and a[:2] == b[:2]
            and import_environment(env_a) == import_environment(env_b))


class PreloadedProcess:
    """A child of a preloaded interpreter, with the part of ``subprocess.Popen``'s interface the gate uses."""

    def __init__(self, owner: Preloader, request_id: int, args: list[str], stdin: IO[bytes] | None) -> None:
        self._owner = owner
        self.request_id = request_id
        self.args = args
        self.stdin = stdin
        self.pid = 0
        self.returncode: int | None = None
        self.lost = ""
        """Why the exit status is unknown (the preloaded interpreter went away), else ""."""

    def poll(self) -> int | None:
        """The exit status, or None while it runs; :class:`PreloadError` when it cannot be known."""
        with self._owner.cond:
            return self._status()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status (``subprocess.TimeoutExpired`` after *timeout* seconds)."""
        with self._owner.cond:
            if not self._owner.cond.wait_for(lambda: self.returncode is not None or bool(self.lost), timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            status = self._status()
            assert status is not None
            return status

    def _status(self) -> int | None:
        if self.returncode is None and self.lost:
            raise PreloadError(self.lost)
        return self.returncode


class Preloader:
    """The gate process's side of one preloaded interpreter (Note [preloaded engines])."""

    def __init__(self, python: str, module: str, env: Mapping[str, str], folder: Path) -> None:
        self.python, self.module = python, module
        self.imports = import_environment(env)
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.log_path = folder / "preload.log"
        own = dict(env)
        own.update({"HF_HOME": str(folder / "hf"), "VLLM_CONFIG_ROOT": str(folder / "config"),
                    "TMPDIR": str(folder / "tmp")})
        (folder / "tmp").mkdir(exist_ok=True)
        self.cond = threading.Condition()
        self.state = "starting"
        """``starting``, ``ready``, ``refused`` (it would not fork safely; :attr:`why` says why) or ``gone``."""
        self.why = ""
        self.children: dict[int, PreloadedProcess] = {}
        self._next_id = 0
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([python, "-m", __name__, module], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=own, cwd=folder,
                                         start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="vramgate-preload", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                if "ready" in event:
                    self.state = "ready"
                elif "refused" in event:
                    self.state, self.why = "refused", str(event["refused"])
                elif "id" in event and int(event["id"]) in self.children:
                    child = self.children[int(event["id"])]
                    if "pid" in event:
                        child.pid = int(event["pid"])
                    if "exit" in event:
                        child.returncode = int(event["exit"])
                    if "error" in event:
                        child.lost = f"the preloaded interpreter could not start it: {event['error']}"
                self.cond.notify_all()
        self.proc.wait()
        with self.cond:
            if self.state in ("starting", "ready"):
                from vramgate.runtime.exits import describe_exit  # the gate's side only (see above)

                self.why = f"it {describe_exit(self.proc.returncode or 0)} (log: {self.log_path})"
            self.state = "gone" if self.state != "refused" else self.state
            for child in self.children.values():
                if child.returncode is None and not child.lost:
                    if child.pid:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(child.pid, signal.SIGKILL)
                    child.lost = (f"the preloaded interpreter that started process {child.pid or '?'} went away "
                                  f"before it ended: {self.why}; the process was killed")
            self.cond.notify_all()

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Wait until it has imported; False when it refused, died or took longer than *timeout_s*."""
        with self.cond:
            self.cond.wait_for(lambda: self.state != "starting", timeout_s)
            if self.state == "starting":
                self.why = f"it did not finish importing within {timeout_s:g} s (log: {self.log_path})"
            ok = self.state == "ready"
        if not ok:
            self.close()
        return ok

    def spawn(self, args: Sequence[str], log_path: Path, *, env: Mapping[str, str], cwd: Path,
              stdin: int | None) -> PreloadedProcess:
        """Fork a child running ``MODULE.main(args)``; with ``stdin=subprocess.PIPE`` its stdin is a pipe whose
        writing end is the returned process's ``stdin``."""
        writer: IO[bytes] | None = None
        fifo = None
        if stdin == subprocess.PIPE:
            fifo = cwd / "stdin.fifo"
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo, 0o600)
            # Read-write, so that opening it waits for no reader; the preloaded interpreter opens the reading end
            # for the child before it reports the pid, and the child sees EOF when this end closes.
            writer = os.fdopen(os.open(fifo, os.O_RDWR), "wb", buffering=0)
        elif stdin is not None:
            raise ValueError("a preloaded child's stdin is a pipe (subprocess.PIPE) or nothing")
        with self.cond:
            self._next_id += 1
            child = PreloadedProcess(self, self._next_id, [self.python, "-m", self.module, *args], writer)
            self.children[child.request_id] = child
        request = {"id": child.request_id, "args": list(args), "env": dict(env), "cwd": str(cwd),
                   "log": str(log_path), "stdin": str(fifo) if fifo else None}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            with self.cond:
                child.lost = f"the preloaded interpreter took no request ({exc}; log: {self.log_path})"
        with self.cond:
            self.cond.wait_for(lambda: child.pid != 0 or bool(child.lost))
        if child.lost and writer is not None:
            writer.close()
        return child

    def close(self) -> None:
        """End the preloaded interpreter (its running children are not touched)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_preloaders: dict[tuple[str, str], Preloader] = {}
_refused: set[tuple[str, str]] = set()
_lock = threading.Lock()


def spawn(command: Sequence[str], log_path: Path, *, env: Mapping[str, str], cwd: Path, stdin: int | None,
          folder: Path) -> PreloadedProcess | None:
    """*command* (``python -m MODULE ARGS``) as a child of this process's preloaded interpreter for that python
    and module, started on first use with its files in *folder*; None when it cannot serve it (Note
    [preloaded engines]): the caller starts a fresh interpreter."""
    parsed = module_command(command)
    if parsed is None or not enabled() or stdin not in (None, subprocess.PIPE):
        return None
    python, module, args = parsed
    key = (python, module)
    with _lock:
        if key in _refused:
            return None
        preloader = _preloaders.get(key)
        if preloader is None:
            preloader = _preloaders[key] = Preloader(python, module, env, folder)
    imports = import_environment(env)
    if preloader.imports != imports:
        differ = sorted(k for k in imports.keys() | preloader.imports.keys()
                        if imports.get(k) != preloader.imports.get(k))
        with contextlib.suppress(OSError), open(preloader.log_path, "a", encoding="utf-8") as log:
            log.write(f"vramgate: {log_path.parent} starts a fresh interpreter: its environment differs in "
                      f"{', '.join(differ)}\n")
        return None
    if not preloader.ready():
        with _lock:
            _refused.add(key)
            _preloaders.pop(key, None)
        print(f"vramgate: runs of {module} start fresh interpreters: the preloaded one is unusable: "
              f"{preloader.why}", file=sys.stderr)
        return None
    child = preloader.spawn(args, log_path, env=env, cwd=cwd, stdin=stdin)
    if not child.pid:  # it took no request: this one starts fresh
        if child.stdin is not None:
            child.stdin.close()
        return None
    return child


def interpreter_pids() -> set[int]:
    """The pids of this process's preloaded interpreters (long-lived helpers, not children a test left)."""
    with _lock:
        return {p.proc.pid for p in _preloaders.values() if p.proc.poll() is None}


@atexit.register
def close_all() -> None:
    """End every preloaded interpreter of this process (and forget refusals: the next request tries again)."""
    with _lock:
        preloaders = list(_preloaders.values())
        _preloaders.clear()
        _refused.clear()
    for preloader in preloaders:
        preloader.close()


# The preloaded interpreter's side.


def fork_problem() -> str | None:
    """Why this process must not fork children that go on to run torch and vLLM, or None."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads > 1:
        return f"{threads} threads are running after the imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized by the imports"
    return None


def _child(module: Any, request: dict[str, Any], stdin: int | None, keep: set[int]) -> None:
    """In the forked child: become the request's process and run ``module.main``; never returns."""
    code = 1
    try:
        os.setsid()
        for fd in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
        source = os.open(os.devnull, os.O_RDONLY) if stdin is None else stdin
        os.dup2(source, 0)
        os.set_blocking(0, True)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (source, log):
            if fd > 2:
                os.close(fd)
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None
        random.seed()
        sys.argv = [str(getattr(module, "__file__", module.__name__)), *request["args"]]
        code = int(module.main(list(request["args"])) or 0)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(module_name: str) -> int:
    """``python -m vramgate.runtime.preload MODULE``: import MODULE and call its ``preload()``, then fork a
    child per request line on stdin, reporting pids and exit statuses on stdout."""
    events = os.dup(1)
    os.dup2(2, 1)  # anything printed goes to the log, not into the events

    def emit(event: dict[str, Any]) -> None:
        os.write(events, json.dumps(event).encode() + b"\n")

    try:
        module = importlib.import_module(module_name)
        if not callable(getattr(module, "main", None)):
            raise AttributeError(f"module {module_name} has no main(argv)")
        hook = getattr(module, "preload", None)
        if callable(hook):
            hook()
    except BaseException as exc:
        traceback.print_exc()
        emit({"refused": f"importing {module_name} failed: {type(exc).__name__}: {exc}"})
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    problem = fork_problem()
    if problem:
        emit({"refused": problem})
        return 1
    emit({"ready": os.getpid()})
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, None)
    pending = b""
    waiting: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)
    while True:
        for key, _ in selector.select():
            if key.data is not None:
                request_id, pid = key.data
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                waiting.pop(key.fd, None)
                emit({"id": request_id, "exit": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                stdin = None
                try:
                    # Opened here, before the pid is reported: once the gate process knows the pid, the child
                    # holds the reading end, and what the gate writes and closes at once is not lost.
                    stdin = os.open(request["stdin"], os.O_RDONLY | os.O_NONBLOCK) if request["stdin"] else None
                    pid = os.fork()
                except OSError as exc:
                    if stdin is not None:
                        os.close(stdin)
                    emit({"id": request["id"], "error": f"could not start it: {exc}"})
                    continue
                if pid == 0:
                    _child(module, request, stdin, {events, selector.fileno(), *waiting})
                if stdin is not None:
                    os.close(stdin)
                pidfd = os.pidfd_open(pid)
                waiting[pidfd] = (request["id"], pid)
                selector.register(pidfd, selectors.EVENT_READ, (request["id"], pid))
                emit({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m vramgate.runtime.preload MODULE", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
