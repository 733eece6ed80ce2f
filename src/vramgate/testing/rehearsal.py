"""A GPU session rehearsed on CPU: the GPU plan's tests, fixtures and teardown order run against a fake device.

Note [rehearsal]: what a GPU session asks of its devices as a whole (how many engines and servers are up at once,
at which utilization, for how long) is invisible to tests that fake one engine at a time. A rehearsal runs the
GPU plan itself (``pytest suites`` as ``tox -e gpu``, a shard of ``gpu-gate.yml``, the baselines job) on CPU with
this plugin (``-p vramgate.testing.rehearsal --gate-rehearse BOX``):

* **A fake box** (:data:`BOXES`): ``pynvml`` is replaced by :class:`FakeNVML`, whose devices are one
  :class:`Ledger` each. The gate's hardware key, ``requires_gpus``, the GPU-state guard and hygiene read it as
  they read a real driver. A box in a container (``container``) reports host pids, none of them in the gate's
  namespace, as NVML does there. The gate's own process holds :data:`GATE_CONTEXT_BYTES` on device 0 (the
  kernel suites' CUDA context) from the start.
* **Stand-ins**: every engine and server the gate starts (``python -m vramgate.engine.worker``, ``... --serve``,
  ``python -m vramgate.engine.api_server``) is started as a stand-in process (:mod:`vramgate.testing.standin`)
  instead. At its start it claims on the ledger what vLLM would hold at that point, per rank on the devices the
  engine uses (:func:`claim_of`): ``gpu_memory_utilization`` x total without a KV budget, the KV budget plus the
  rank's share of the weights and :data:`RANK_OVERHEAD_BYTES` with one; and it is refused exactly where vLLM's
  ``request_memory`` (``v1/worker/utils.py``) refuses: free memory after its own CUDA context below total x
  utilization. A refused stand-in exits as vLLM does, with vLLM's message. A claim is released when the stand-in's
  process ends. A one-shot engine run ends at once (it has no results: the test fails there, and is not judged);
  a paired engine serves empty rounds until it is told to quit; a server answers ``/health`` until it is stopped.
  vLLM's benchmark client is stood in by a process that fails (no traffic is sent in a rehearsal).
* **The engine environment** is taken to hold the pinned vLLM, from the source folder given with
  ``--gate-rehearse-vllm`` (a CUDA wheel's ``.py`` files, ``scripts/vllm_sources.py``): the profiles' overlays
  are built from it as they would be from the installed package.

The rehearsal fails (:data:`FINDINGS`, written to ``--gate-rehearse-out`` and printed at the end) on

* a refused start (the test, what it started, free and requested memory, who held the device);
* memory still held by a process the gate thinks ended (a stand-in alive after the gate stopped it, or at the
  end of the session);
* a test marked untrusted by the GPU-state guard because of the gate's own processes (a server or engine the
  gate keeps, seen as "another process").

What the tests themselves conclude is not judged: their engines measured nothing. What only a GPU shows (the
figures, vLLM's own start-up, CUDA in the gate's process): docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import types
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from vramgate.machine.gpu_processes import alive
from vramgate.runtime import process
from vramgate.testing.fake_device import BOXES, Box, FakeNVML, Ledger, gib

#: The CUDA context (and the kernel suites' caches) the gate's own process holds on device 0 in a GPU session.
GATE_CONTEXT_BYTES = 768 << 20
#: The CUDA context of each engine process (a rank), outside vLLM's budget (its ``init_snapshot`` is taken after).
ENGINE_CONTEXT_BYTES = 512 << 20
#: What a rank with a KV budget holds beside the KV cache and its weights: activations, CUDA graphs, NCCL.
RANK_OVERHEAD_BYTES = 2 << 30
#: vLLM's default ``gpu_memory_utilization`` (``CacheConfig``).
VLLM_DEFAULT_UTILIZATION = 0.9


@dataclass
class Finding:
    """One thing the rehearsal fails on."""

    kind: str
    """``refused``, ``held`` or ``untrusted``."""
    test: str
    message: str


def _stub_vllm(source: Path | None) -> Any:
    """The engine environment the rehearsal pretends: the pinned vLLM (its package folder *source*), a CUDA build."""
    from vramgate import TORCH_CPU_VERSION, VLLM_VERSION
    from vramgate.runtime.engine_env import EngineEnv

    return EngineEnv(python=sys.executable, python_version=".".join(map(str, sys.version_info[:3])),
                     vllm=VLLM_VERSION, vllm_distribution="vllm",
                     vllm_package=None if source is None else str(source),
                     torch=TORCH_CPU_VERSION.split("+")[0])  # the CUDA build of the same release


def engine_kind(command: Sequence[str]) -> str | None:
    """What a command the gate launches starts: ``engine`` (one run), ``serve`` (a paired engine), ``server`` (an
    API server), ``client`` (vLLM's benchmark client), or None (anything else)."""
    args = list(command)
    if "-m" not in args:
        return None
    module = args[args.index("-m") + 1] if args.index("-m") + 1 < len(args) else ""
    if module == "vramgate.engine.worker":
        return "serve" if "--serve" in args else "engine"
    if module == "vramgate.engine.api_server":
        return "server"
    if module in ("vramgate.engine.load_client", "vllm.benchmarks.serve"):
        return "client"
    return None


def _spec_of(kind: str, command: Sequence[str]) -> tuple[Any, Path]:
    """The engine spec and project root a launched engine or server command runs."""
    from vramgate.engine.spec import EngineSpec

    args = list(command)
    path = Path(args[args.index("--serve") + 1] if kind == "serve" else args[args.index("-m") + 2])
    data = json.loads(path.read_text(encoding="utf-8"))
    return EngineSpec.from_json(data["spec"]), Path(data["root"])


def claim_of(spec: Any, root: Path, total_bytes: int) -> tuple[float, int]:
    """(``gpu_memory_utilization``, bytes each rank holds once up) for an engine of *spec* on a device of
    *total_bytes* (Note [rehearsal]): the utilization the gate passes vLLM (its engine arguments, as
    :func:`vramgate.engine.arguments.llm_kwargs` builds them) and what vLLM then holds per rank."""
    from vramgate.engine.arguments import llm_kwargs, rank_weights_bytes
    from vramgate.engine.spec import kv_budget_bytes
    from vramgate.models.config import load_model

    model_dir = load_model(root, spec.model).path.parent
    kwargs = llm_kwargs(spec, model_dir, total_bytes)
    utilization = float(kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    budget = kv_budget_bytes(spec)
    if budget is None:
        return utilization, math.ceil(total_bytes * utilization)
    kv = int(kwargs.get("kv_cache_memory_bytes", budget))
    return utilization, kv + rank_weights_bytes(spec, model_dir) + RANK_OVERHEAD_BYTES


class Rehearsal:
    """The plugin's state: the box, its ledgers, the stand-ins started and what was found."""

    def __init__(self, box: Box, vllm_source: Path | None) -> None:
        self.box, self.vllm_source = box, vllm_source
        self.ledgers = [Ledger(i, box.memory_bytes) for i in range(box.gpus)]
        self.ledgers[0].claim(os.getpid(), GATE_CONTEXT_BYTES)
        self.nvml = FakeNVML(box, self.ledgers)
        self.findings: list[Finding] = []
        self.standins: dict[int, str] = {}
        """Every stand-in started: pid -> what it stood in for."""
        self.starts: list[dict[str, Any]] = []
        self.test = "(session setup)"
        self._saved: dict[str, Any] = {}

    # -- wiring

    def install(self, mp: pytest.MonkeyPatch) -> None:
        """Replace NVML, the engine environment and the gate's process launcher."""
        from vramgate.runtime import engine_env

        mp.setitem(sys.modules, "pynvml", self.nvml)
        env = _stub_vllm(self.vllm_source)
        mp.setattr(engine_env, "current", lambda: env)
        mp.setattr(engine_env, "probe", lambda python: env)
        if "vllm" not in sys.modules:
            stub = types.ModuleType("vllm")
            stub.__version__ = env.vllm  # type: ignore[attr-defined]
            mp.setitem(sys.modules, "vllm", stub)
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        real_launch, real_kill = process.launch, process.kill_group
        mp.setattr(process, "launch", self._launcher(real_launch))
        mp.setattr(process, "kill_group", self._killer(real_kill))

    def _launcher(self, real: Callable[..., process.Child]) -> Callable[..., process.Child]:
        def launch(command: Sequence[str], log_path: Path, *, env: Mapping[str, str], cwd: Path,
                   stdin: int | None = None, preload: Path | None = None) -> process.Child:
            kind = engine_kind(command)
            if kind is None:
                return real(command, log_path, env=env, cwd=cwd, stdin=stdin, preload=preload)
            return self.stand_in(kind, command, log_path, env=env, cwd=cwd, stdin=stdin, real=real)
        return launch

    def _killer(self, real: Callable[..., None]) -> Callable[..., None]:
        def kill_group(proc: process.Child, grace_s: float | None = None) -> None:
            real(proc, grace_s)
            what = self.standins.get(proc.pid)
            if what is not None and alive(proc.pid):
                self.findings.append(Finding("held", self.test, f"{what} (pid {proc.pid}) still runs, and holds "
                                             "its memory, after the gate ended it"))
        return kill_group

    # -- stand-ins

    def stand_in(self, kind: str, command: Sequence[str], log_path: Path, *, env: Mapping[str, str], cwd: Path,
                 stdin: int | None, real: Callable[..., process.Child]) -> process.Child:
        """Start a stand-in for *command* (Note [rehearsal]); claim what it would hold, or refuse it."""
        base = [sys.executable, "-m", "vramgate.testing.standin"]
        if kind == "client":
            return real([*base, "client"], log_path, env=env, cwd=cwd, stdin=stdin)
        spec, root = _spec_of(kind, command)
        what = f"{'vLLM server' if kind == 'server' else 'engine'} for {spec.model} ({spec.profile or 'unpatched'})"
        ranks = max(1, int(spec.tensor_parallel_size))
        utilization, per_rank = claim_of(spec, root, self.box.memory_bytes)
        refused = ""
        for ledger in self.ledgers[:ranks]:
            requested = math.ceil(ledger.total_bytes * utilization)
            free = ledger.free() - ENGINE_CONTEXT_BYTES
            if free < requested:  # vLLM's request_memory, on the snapshot taken after the rank's own context
                holders = ", ".join(f"pid {pid} {gib(n)} GiB{' (the gate)' if pid == os.getpid() else ''}"
                                    f"{' (' + self.standins[pid] + ')' if pid in self.standins else ''}"
                                    for pid, n in sorted(ledger.live().items()))
                refused = (f"ValueError: Free memory on device cuda:{ledger.index} ({gib(free)}/"
                           f"{gib(ledger.total_bytes)} GiB) on startup is less than desired GPU memory utilization "
                           f"({utilization}, {gib(requested)} GiB). Decrease GPU memory utilization or reduce GPU "
                           "memory used by other processes.")
                self.findings.append(Finding("refused", self.test, f"{what}: vLLM would refuse to start on GPU "
                                             f"{ledger.index}: {gib(free)} GiB free, {gib(requested)} GiB requested "
                                             f"(utilization {utilization}); held: {holders}"))
                break
        args = [*base, kind if not refused else "refused"]
        if kind == "serve":
            args += [str(Path(list(command)[list(command).index("--serve") + 2]))]
        if kind == "server":
            args += [str(Path(list(command)[list(command).index("-m") + 2]))]
        child_env = dict(env)
        if refused:
            child_env["VRAMGATE_STANDIN_MESSAGE"] = refused
        proc = real(args, log_path, env=child_env, cwd=cwd, stdin=stdin)
        self.standins[proc.pid] = what
        self.starts.append({"test": self.test, "what": what, "utilization": utilization, "ranks": ranks,
                            "bytes_per_rank": per_rank, "refused": bool(refused)})
        if not refused:
            for ledger in self.ledgers[:ranks]:
                ledger.claim(proc.pid, per_rank + ENGINE_CONTEXT_BYTES)
        return proc

    # -- judging

    def untrusted_by_own(self, item: pytest.Item) -> None:
        """A finding when the GPU-state guard distrusted *item* while every process on the box was the gate's (its
        own and its stand-ins): the fake box never throttles, so processes are all that can distrust a test."""
        from vramgate.pytest_plugin.plugin import GATE_KEY

        recorder = item.stash.get(GATE_KEY, None)
        reasons = list(getattr(recorder, "untrusted", None) or [])
        foreign = [pid for ledger in self.ledgers for pid in ledger.live()
                   if pid != os.getpid() and pid not in self.standins]
        if reasons and not foreign:
            self.findings.append(Finding("untrusted", item.nodeid, "the GPU-state guard distrusted the test because "
                                         f"of the gate's own processes: {'; '.join(reasons)}"))

    def still_held(self) -> None:
        """Findings for every stand-in that still runs (and holds its memory) at the end of the session."""
        for pid, what in sorted(self.standins.items()):
            if alive(pid):
                self.findings.append(Finding("held", "(session end)", f"{what} (pid {pid}) still runs and holds "
                                             "its memory after the session's teardown"))
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)  # every stand-in leads its process group

    def to_json(self) -> dict[str, Any]:
        """The box, the findings and every start, as JSON data (``--gate-rehearse-out``)."""
        return {"box": asdict(self.box), "findings": [asdict(f) for f in self.findings], "starts": self.starts}


REHEARSAL_KEY = pytest.StashKey[Rehearsal]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """The rehearsal's options."""
    group = parser.getgroup("vramgate rehearsal")
    group.addoption("--gate-rehearse", metavar="BOX", choices=sorted(BOXES),
                    help=f"rehearse the GPU session on a fake box ({', '.join(sorted(BOXES))}): Note [rehearsal]")
    group.addoption("--gate-rehearse-vllm", metavar="DIR", default=None,
                    help="the vLLM package folder the rehearsal takes as installed (a CUDA wheel's source)")
    group.addoption("--gate-rehearse-out", metavar="FILE", default=None,
                    help="write the rehearsal's findings and starts there (JSON)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """With ``--gate-rehearse BOX``: the fake box, the stand-ins and the engine environment, for the session."""
    name = config.getoption("--gate-rehearse", None)
    if not name:
        return
    source = config.getoption("--gate-rehearse-vllm", None)
    rehearsal = Rehearsal(BOXES[name], Path(source).resolve() if source else None)
    mp = pytest.MonkeyPatch()
    rehearsal.install(mp)
    config.stash[REHEARSAL_KEY] = rehearsal
    config.add_cleanup(mp.undo)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Which test the starts and findings from now on belong to."""
    rehearsal = item.config.stash.get(REHEARSAL_KEY, None)
    if rehearsal is not None:
        rehearsal.test = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """A finding when the GPU-state guard distrusted the test because of the gate's own processes."""
    report = yield
    rehearsal = item.config.stash.get(REHEARSAL_KEY, None)
    if rehearsal is not None and call.when == "call":
        rehearsal.untrusted_by_own(item)
    return report


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Findings for what still runs; the findings written out; the session fails on any."""
    rehearsal = session.config.stash.get(REHEARSAL_KEY, None)
    if rehearsal is None:
        return
    rehearsal.still_held()
    out = session.config.getoption("--gate-rehearse-out", None)
    if out:
        Path(out).write_text(json.dumps(rehearsal.to_json(), indent=2, sort_keys=True), encoding="utf-8")
    if rehearsal.findings:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The rehearsal's findings, one line each."""
    rehearsal = terminalreporter.config.stash.get(REHEARSAL_KEY, None)
    if rehearsal is None:
        return
    tr = terminalreporter
    tr.section(f"vramgate rehearsal on {rehearsal.box.name}")
    tr.write_line(f"{len(rehearsal.starts)} engine/server start(s) stood in; {len(rehearsal.findings)} finding(s)")
    for f in rehearsal.findings:
        tr.write_line(f"REHEARSAL {f.kind.upper()}: {f.test}: {f.message}")
