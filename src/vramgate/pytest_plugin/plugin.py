"""The vramgate pytest plugin: options, markers, the ``gate`` fixture, checks, summary.

Registered through the ``pytest11`` entry point ``vramgate``; disable with
``-p no:vramgate``. Session state lives in one :class:`GateSession` object
registered with the plugin manager under :data:`SESSION_NAME`.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vramgate.core.checks import Finding, Verdict, check_baseline, check_budget
from vramgate.core.claims import ClaimVerdict
from vramgate.core.metrics import format_change, format_value
from vramgate.core.provenance import Provenance
from vramgate.machine import hardware, isa
from vramgate.machine.gpu_processes import alive
from vramgate.machine.probes.cpu import children, rss_bytes
from vramgate.machine.software import git_commit, now_utc, software_versions, version_mismatches
from vramgate.pytest_plugin.fixture import Gate
from vramgate.pytest_plugin.marks import HARDWARE_MARKERS, MARKERS, HardwareNeed, marker_help, marker_value
from vramgate.store.baselines import BaselineError, DirectoryStorage, NodeBaseline

SESSION_NAME = "vramgate-session"
#: Helper processes started once and kept for the life of the process: not leaks. Python's multiprocessing
#: helpers, and the symbolizers torch keeps to resolve C++ frames (allocator snapshots with C++ stacks).
PROCESS_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "addr2line -C -f -e ")
#: CUDA memory a test may leave allocated (caches of cuBLAS and friends) before hygiene fails it.
CUDA_LEAK_TOLERANCE = 8 << 20
#: Growth of the resident memory of this process's child processes (summed) that hygiene tolerates.
PROCESS_TREE_TOLERANCE = 64 << 20
#: Growth of device memory used by other processes than this one (NVML) that hygiene tolerates: lazily
#: loaded CUDA modules of this process are not attributed to it where NVML cannot name its pid.
NVML_LEAK_TOLERANCE = 256 << 20
#: Tests that use one of these fixtures (or carry a ``requires_*`` mark) get the memory checks of hygiene.
ENGINE_FIXTURES = ("engine",)
MISSING_POLICIES = ("fail", "record", "skip")
UPDATE_SCOPES = ("all", "portable", "machine")
MISSING_VERDICTS: dict[str, Verdict] = {"fail": "missing", "record": "new", "skip": "not compared"}
GATE_KEY = pytest.StashKey[Gate]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vramgate", "vramgate: GPU memory and latency gate")
    options: list[tuple[str, str, dict[str, Any], str]] = [
        ("--gate-baselines", "gate_baselines", {"metavar": "DIR"},
         "folder of baselines, <DIR>/<hardware key>/<suite>.json (default: baselines/)"),
        ("--gate-hardware", "gate_hardware", {"metavar": "KEY"},
         "hardware key to compare against, instead of the detected one"),
        ("--gate-missing", "gate_missing", {"choices": MISSING_POLICIES},
         "what a metric without a baseline does: fail (default), record it, or skip the comparison"),
        ("--gate-report", "gate_report", {"metavar": "DIR"},
         "write report.md, report.json and changes.png into DIR"),
        ("--gate-shard", "gate_shard", {"metavar": "I/N"},
         "run shard I of N (1-based) of the collected tests; merge shard reports with 'vramgate report merge'"),
        ("--gate-hygiene", "gate_hygiene", {"choices": ("on", "off")},
         "fail a test that leaves child processes or CUDA memory behind (default: on)"),
    ]
    for flag, dest, extra, help_text in options:
        group.addoption(flag, dest=dest, default=None, help=help_text, **extra)
        parser.addini(dest, help=f"default of {flag}: {help_text}", default=None)
    group.addoption(
        "--gate-require-hardware", dest="gate_require_hardware", action="store_true", default=None,
        help="fail machine-bound metrics whose hardware key has no baselines at all, instead of reporting them "
             "as not compared (self-hosted runners of a known GPU or CPU class set it)",
    )
    parser.addini("gate_require_hardware", type="bool", default=False, help="default of --gate-require-hardware")
    group.addoption(
        "--gate-baselines-ref", dest="gate_baselines_ref", default=None, metavar="REF",
        help="list first every stored baseline that differs between git REF (a PR's base) and the tree",
    )
    parser.addini("gate_baselines_ref", default=None, help="default of --gate-baselines-ref")
    group.addoption(
        "--gate-plan", dest="gate_plan", action="store_true", default=False,
        help="after collection, say which tests this machine's GPUs would run and why the others would skip "
             "(with --collect-only: a dry run of a GPU runner)",
    )
    group.addoption(
        "--gate-update-scope", dest="gate_update_scope", default=None, choices=UPDATE_SCOPES,
        help="which metrics --gate-update and --gate-missing=record write: all (default), portable (the tier's "
             "baselines only, e.g. on hosted runners whose CPU varies) or machine (this hardware key's only)",
    )
    parser.addini("gate_update_scope", default=None, help="default of --gate-update-scope")
    group.addoption(
        "--gate-update", dest="gate_update", action="store_true", default=None,
        help="write or refresh the baselines of the tests that ran (review and commit the diff)",
    )
    parser.addini("gate_update", type="bool", default=False, help="default of --gate-update")


def pytest_configure(config: pytest.Config) -> None:
    for name in MARKERS:
        config.addinivalue_line("markers", marker_help(name))
    try:
        # Note [ISA cap]: in force in this process (kernels a test runs in-process) and, through the
        # environment, in every engine it starts. Without VRAMGATE_CPU_ISA nothing is imported.
        if isa.cap() is not None:
            isa.apply_cap()
    except isa.ISAError as exc:
        raise pytest.UsageError(str(exc)) from None
    session = GateSession(config)
    config.pluginmanager.register(session, SESSION_NAME)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:200]
    except OSError:
        return "?"


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)``; a :class:`pytest.UsageError` for anything else."""
    try:
        index, count = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise pytest.UsageError(f"--gate-shard {text!r}: expected I/N, e.g. 1/2") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--gate-shard {text!r}: I must be between 1 and N")
    return index, count


@pytest.fixture
def gate(request: pytest.FixtureRequest) -> Gate:
    """Record metrics of this test: ``gate.record(...)`` and ``gate.record_samples(...)``.

    Every recorded metric is checked when the test ends, against its ceiling or
    floor and against the baseline stored for this machine's hardware key; the
    test fails with one message listing every metric that falls short.
    """
    session = request.config.pluginmanager.get_plugin(SESSION_NAME)
    assert isinstance(session, GateSession), "the vramgate plugin is not configured"
    item = request.node
    recorder = Gate(item.nodeid, session.suite_for(item))
    item.stash[GATE_KEY] = recorder
    return recorder


@dataclass
class DeviceReading:
    """NVML's view of one device, for hygiene: memory used in all, and by this process where NVML names it."""

    used_bytes: int
    own_bytes: int | None
    """This process's device memory; None where NVML lists other pids only while this process holds a context."""
    processes: dict[int, int]


@dataclass
class HygieneState:
    """What hygiene reads before and after a test (see Note [hygiene])."""

    children: set[int]
    cuda_allocated: int | None
    tree: dict[int, int] | None = None
    """Resident bytes per live child process (helpers left out); None when memory is not checked."""
    devices: dict[int, DeviceReading] | None = None
    """NVML readings per device index; None when memory is not checked or NVML is unavailable."""
    cuda_context: bool = False
    """Whether this process held a CUDA context at the reading."""


def tree_rss(pids: set[int]) -> dict[int, int]:
    """Resident bytes of each running process in *pids*, leaving out zombies and Python's helpers."""
    out = {}
    for pid in pids:
        if not alive(pid) or any(helper in _cmdline(pid) for helper in PROCESS_HELPERS):
            continue
        try:
            out[pid] = rss_bytes(pid)
        except (OSError, ValueError):
            continue  # ended meanwhile
    return out


def device_readings() -> dict[int, DeviceReading] | None:
    """NVML's used memory of every device this process sees (by CUDA index), and this process's share where NVML
    names it; None without NVML."""
    from vramgate.machine.probes.nvml import NVMLUnavailable, _nvml

    try:
        nvml = _nvml()
    except NVMLUnavailable:
        return None
    torch = sys.modules.get("torch")
    context = torch is not None and torch.cuda.is_initialized()
    me = os.getpid()
    from vramgate.machine.devices import device_handle, visible_devices

    try:
        out = {}
        for device in visible_devices(nvml):  # this process's GPUs only: another tenant's are not its leaks
            index = device.cuda_index
            handle = device_handle(nvml, device)
            procs: dict[int, int] = {}
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                procs[int(proc.pid)] = procs.get(int(proc.pid), 0) + int(proc.usedGpuMemory or 0)
            own = procs.get(me, 0) if me in procs or not context else None
            out[index] = DeviceReading(int(nvml.nvmlDeviceGetMemoryInfo(handle).used), own, procs)
        return out
    except Exception:  # NVML lost mid-reading: no device check rather than a false one
        return None
    finally:
        nvml.nvmlShutdown()


def tree_leak(before: HygieneState, after: HygieneState) -> list[str]:
    """The hygiene line when the child processes' resident memory grew by more than the tolerance."""
    if before.tree is None or after.tree is None:
        return []
    start, end = sum(before.tree.values()), sum(after.tree.values())
    if end - start <= PROCESS_TREE_TOLERANCE:
        return []
    grown = sorted(((rss - before.tree.get(pid, 0), pid) for pid, rss in after.tree.items()), reverse=True)
    worst = ", ".join(f"pid {pid} +{format_value(d, 'B')} (now {format_value(after.tree[pid], 'B')}): "
                      f"{_cmdline(pid)[:80]}" for d, pid in grown[:3] if d > 0)
    return [f"child processes' memory did not return to its starting level: resident "
            f"{format_value(start, 'B')} before the test, {format_value(end, 'B')} after "
            f"(+{format_value(end - start, 'B')}, tolerance {format_value(PROCESS_TREE_TOLERANCE, 'B')}); {worst}"]


def device_leaks(before: HygieneState, after: HygieneState) -> list[str]:
    """Hygiene lines for devices whose memory used by other processes than this one grew past the tolerance.

    Where NVML does not name this process (host pids in a container) while it
    holds a CUDA context, its own share is taken as unchanged; a context this
    process created during the test then makes the reading unattributable and
    the device is not judged.
    """
    if before.devices is None or after.devices is None:
        return []
    out = []
    for index, b in sorted(before.devices.items()):
        a = after.devices.get(index)
        if a is None:
            continue
        if a.own_bytes is not None and b.own_bytes is not None:
            own_growth = a.own_bytes - b.own_bytes
        elif before.cuda_context:
            own_growth = 0
        else:
            continue  # this process's context appeared during the test and NVML cannot tell its share
        grown = a.used_bytes - b.used_bytes - own_growth
        if grown <= NVML_LEAK_TOLERANCE:
            continue
        me = os.getpid()
        holders = sorted(((used - b.processes.get(pid, 0), pid) for pid, used in a.processes.items()
                          if pid != me), reverse=True)
        named = ", ".join(f"pid {pid} +{format_value(d, 'B')}" for d, pid in holders[:3] if d > 0)
        out.append(f"GPU {index} memory used by other processes did not return to its starting level: "
                   f"+{format_value(grown, 'B')} (device used {format_value(b.used_bytes, 'B')} before the "
                   f"test, {format_value(a.used_bytes, 'B')} after; tolerance "
                   f"{format_value(NVML_LEAK_TOLERANCE, 'B')})" + (f"; {named}" if named else ""))
    return out


def junit_properties(result: NodeResult) -> list[tuple[str, str]]:
    """One junit ``<property>`` per metric: ``vramgate.<metric>`` = value, baseline, verdict and how it is judged."""
    def num(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else f"{v:.6g}"

    out = []
    for f in result.findings:
        m = f.metric
        base = f"{num(f.baseline.value)} {m.unit}" if f.baseline is not None else "none"
        verdict = f.verdict + (", outside budget" if f.budget else "")
        out.append((f"vramgate.{m.name}", f"{num(m.value)} {m.unit}; baseline {base}; verdict {verdict}; "
                    f"{m.kind}, {m.better} is better, {m.effective_scope}, tolerance {m.effective_tolerance:g}"))
    return out


@dataclass
class NodeResult:
    """The findings of one test, kept for the summary and the report."""

    nodeid: str
    suite: str
    findings: list[Finding]
    test_passed: bool
    baseline_path: Path | None = None
    """The machine-bound metrics' baseline file (hardware key)."""
    mismatches: list[str] = field(default_factory=list)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    """GPU-state readings taken around the test's measurements."""

    portable_path: Path | None = None
    """The portable metrics' baseline file (tier key)."""

    @property
    def failed(self) -> bool:
        return any(f.failed for f in self.findings)

    def path_of(self, finding: Finding) -> Path | None:
        """The baseline file that holds (or would hold) *finding*'s metric."""
        return self.portable_path if finding.metric.effective_scope == "portable" else self.baseline_path

    def paths_of(self, findings: list[Finding]) -> list[Path]:
        """The baseline files of *findings*, each once, portable first."""
        out: list[Path] = []
        for f in sorted(findings, key=lambda f: f.metric.effective_scope != "portable"):
            path = self.path_of(f)
            if path is not None and path not in out:
                out.append(path)
        return out


class GateSession:
    """Session state of the gate: options, hardware, baselines, findings."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        root = config.rootpath
        cwd = config.invocation_params.dir

        asked: list[str] = []

        def opt(dest: str) -> tuple[Any, Path]:
            value = config.getoption(dest)
            if value is not None:
                asked.append(dest)
                return value, cwd
            value = config.getini(dest)
            if value not in (None, False, ""):
                asked.append(dest)
            return value, (config.inipath.parent if config.inipath else root)

        baselines, base_dir = opt("gate_baselines")
        self.baselines_dir = (base_dir / (baselines or "baselines")).resolve()
        self.storage = DirectoryStorage(self.baselines_dir)
        hardware_key, _ = opt("gate_hardware")
        self.hardware_override: str | None = hardware_key or None
        missing, _ = opt("gate_missing")
        missing = missing or "fail"
        if missing not in MISSING_POLICIES:
            raise pytest.UsageError(f"gate_missing = {missing!r}: must be one of {', '.join(MISSING_POLICIES)}")
        self.missing: str = missing
        report, report_dir = opt("gate_report")
        self.report_dir: Path | None = (report_dir / report).resolve() if report else None
        update, _ = opt("gate_update")
        self.update = bool(update)
        update_scope, _ = opt("gate_update_scope")
        self.update_scope: str = update_scope or "all"
        if self.update_scope not in UPDATE_SCOPES:
            raise pytest.UsageError(f"gate_update_scope = {self.update_scope!r}: must be one of "
                                    f"{', '.join(UPDATE_SCOPES)}")
        ref, _ = opt("gate_baselines_ref")
        self.baselines_ref: str | None = ref or None
        self.moves: list[Any] | None = None
        """Baseline metrics that differ between ``baselines_ref`` and the tree (:mod:`vramgate.store.moves`)."""
        require, _ = opt("gate_require_hardware")
        self.require_hardware = bool(require)
        self._has_baselines: dict[str, bool] = {}
        shard, _ = opt("gate_shard")
        self.shard: tuple[int, int] | None = parse_shard(shard) if shard else None
        hygiene, _ = opt("gate_hygiene")
        self.hygiene = (hygiene or "on") != "off"
        if config.getoption("gate_plan"):
            asked.append("gate_plan")
        self.active = bool(asked)
        """Note [inert until asked]: the gate reads baselines, probes hardware, checks hygiene and writes a
        summary or report only in a session that sets a ``--gate-*`` option or ini value, or whose tests use the
        ``gate`` or ``engine`` fixture or a vramgate marker. Installed, it does nothing to other projects."""
        self._before: dict[str, HygieneState] = {}
        self._call_failed: set[str] = set()
        self.results: list[NodeResult] = []
        self.claims: list[tuple[str, ClaimVerdict]] = []
        self.pending: dict[tuple[str, str], dict[str, NodeBaseline]] = {}
        """Baselines to write at the end: per (key, suite), the node ids' entries."""
        self.written: list[Path] = []
        self.report_written = False
        self.errors: list[str] = []
        self._fingerprint: hardware.Fingerprint | None = None
        self._gpus: tuple[hardware.GPUInfo, ...] | None = None
        self._software: dict[str, str] | None = None
        self._commit: str | bool | None = False

    # -- lazily probed facts -------------------------------------------------

    @property
    def fingerprint(self) -> hardware.Fingerprint:
        """This machine's fingerprint (probed on first use; ``--gate-hardware`` overrides the key)."""
        if self._fingerprint is None:
            try:
                fp = hardware.detect()
            except ValueError as exc:  # a bad VRAMGATE_CPU_ISA
                raise pytest.UsageError(f"hardware: {exc}") from None
            if self.hardware_override:
                try:
                    fp = hardware.with_key(fp, self.hardware_override)
                except ValueError as exc:
                    raise pytest.UsageError(f"--gate-hardware: {exc}") from None
            self._fingerprint = fp
        return self._fingerprint

    @property
    def gpus(self) -> tuple[hardware.GPUInfo, ...]:
        if self._gpus is None:
            self._gpus = hardware.visible_gpus()
        return self._gpus

    @property
    def software(self) -> dict[str, str]:
        if self._software is None:
            self._software = software_versions()
        return self._software

    def provenance(self) -> Provenance:
        if self._commit is False:
            self._commit = git_commit(self.config.rootpath)
        commit = self._commit if isinstance(self._commit, str) else None
        return Provenance(commit=commit, date=now_utc(), software=self.software)

    # -- collection ------------------------------------------------------------

    def suite_for(self, item: pytest.Item) -> str:
        """The suite (baseline file) of *item*: its ``gate_suite`` mark, else its folder under ``suites/``."""
        mark = item.get_closest_marker("gate_suite")
        if mark is not None:
            return str(marker_value(mark, item.nodeid))
        path = Path(item.nodeid.split("::", 1)[0])
        parts = path.parts
        if "suites" in parts[:-1]:
            i = parts.index("suites")
            if i + 2 < len(parts):
                return parts[i + 1]
        if len(parts) > 1:
            return parts[-2]
        stem = path.stem
        return stem[5:] if stem.startswith("test_") else stem

    def uses_gate(self, item: pytest.Item) -> bool:
        """Whether *item* uses the gate: its fixtures or a vramgate marker (Note [inert until asked])."""
        names = getattr(item, "fixturenames", ())
        return any(f in names for f in ("gate", *ENGINE_FIXTURES)) or any(
            mark.name in MARKERS for mark in item.iter_markers())

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """With ``--gate-plan``: what the collected tests need of the hardware, and what this machine does."""
        if not self.config.getoption("gate_plan"):
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        from vramgate.report.render import plan_lines

        for line in plan_lines(self.plan(session.items), self.fingerprint, self.gpus,
                               verbose=self.config.option.verbose > 0):
            reporter.write_line(line)

    def plan(self, items: list[pytest.Item]) -> list[tuple[str, str, str | None]]:
        """(node id, what it needs, why it would skip here or None) for each test with a ``requires_*`` mark."""
        out = []
        for item in items:
            needs = [HardwareNeed(m.name, marker_value(m, item.nodeid)) for m in item.iter_markers()
                     if m.name in HARDWARE_MARKERS]
            if not needs:
                continue
            reasons = [r for r in (n.unmet(self.gpus) for n in needs) if r]
            out.append((item.nodeid, ", ".join(n.describe() for n in needs), reasons[0] if reasons else None))
        return out

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for item in items:
            for mark in item.iter_markers():
                if mark.name in MARKERS:
                    marker_value(mark, item.nodeid)
        self.active = self.active or any(self.uses_gate(item) for item in items)
        if self.active:  # a corrupt baseline or a bad ref stops the run before any test, never half-way
            try:
                self.storage.validate_all()
            except BaselineError as exc:
                raise pytest.UsageError(f"unusable baseline file {exc}") from None
            if self.baselines_ref:
                from vramgate.store.moves import RefError, resolve

                try:
                    resolve(self.config.rootpath, self.baselines_ref, self.baselines_dir)
                except RefError as exc:
                    raise pytest.UsageError(str(exc)) from None
        if self.shard is None:
            return
        # Note [shards]: round-robin over the sorted node ids: every shard of one run
        # collects the same tests, so the shards partition them exactly.
        index, count = self.shard
        order = {nodeid: i for i, nodeid in enumerate(sorted(item.nodeid for item in items))}
        keep = [item for item in items if order[item.nodeid] % count == index - 1]
        dropped = [item for item in items if order[item.nodeid] % count != index - 1]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep

    # -- hygiene ---------------------------------------------------------------------

    # Note [hygiene]: at setup the plugin takes the state of the process tree (child processes; for
    # tests that use the engine or a GPU also their resident memory and, through NVML, the device
    # memory of other processes) and of this process's CUDA allocator; at teardown, after the
    # fixtures are finalized, it takes it again. What is still there and was not before fails the
    # test that left it, named, with the numbers. A broader-scoped fixture (a session's server, say)
    # that is set up for this test is part of the starting state: the reading is retaken after setup.

    @staticmethod
    def _cuda_allocated() -> int | None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return None  # nothing on a GPU in this process; never initialize CUDA for a check
        # cuBLAS keeps a workspace per (handle, stream) in the caching allocator: a cache, not a leak.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        torch.cuda.synchronize()
        if clear is not None:
            clear()
        return int(torch.cuda.memory_allocated())

    @staticmethod
    def memory_checked(item: pytest.Item) -> bool:
        """Whether hygiene checks *item*'s process-tree and device memory: it uses the engine or a GPU."""
        names = getattr(item, "fixturenames", ())
        return any(f in names for f in ENGINE_FIXTURES) or any(
            mark.name in HARDWARE_MARKERS for mark in item.iter_markers())

    def _hygiene_state(self, memory: bool = False) -> HygieneState:
        kids = set(children(os.getpid()))
        allocated = self._cuda_allocated()
        if not memory:
            return HygieneState(kids, allocated)
        torch = sys.modules.get("torch")
        context = False
        if torch is not None and torch.cuda.is_initialized():
            context = True
            torch.cuda.empty_cache()  # cached free blocks are this process's, not a leak of anyone's
        return HygieneState(kids, allocated, tree_rss(kids), device_readings(), context)

    def leaks(self, nodeid: str, cuda: bool = True) -> list[str]:
        """What the test *nodeid* left behind: child processes still running, CUDA memory still allocated;
        for tests that use the engine or a GPU also child-process and device memory not returned."""
        before = self._before.pop(nodeid, HygieneState(set(), None))
        memory = before.tree is not None
        if cuda and "torch" in sys.modules:
            gc.collect()  # reference cycles the test left are garbage, not leaks
        after = self._hygiene_state(memory)
        after_cuda = after.cuda_allocated if cuda else None
        out = []
        for pid in sorted(after.children - before.children):
            cmd = _cmdline(pid)
            if alive(pid) and not any(helper in cmd for helper in PROCESS_HELPERS):
                out.append(f"child process {pid} still running: {cmd}")
        if after_cuda is not None and after_cuda - (before.cuda_allocated or 0) > CUDA_LEAK_TOLERANCE:
            grown = after_cuda - (before.cuda_allocated or 0)
            out.append(f"CUDA memory still allocated: {format_value(grown, 'B')} more "
                       f"than before the test (tolerance {format_value(CUDA_LEAK_TOLERANCE, 'B')})")
        if memory:
            out += tree_leak(before, after)
            out += device_leaks(before, after)
        return out

    def _pending_broad_fixtures(self, item: pytest.Item) -> list[Any]:
        """Broader-scoped fixture definitions of *item* not set up yet (see Note [hygiene])."""
        info = getattr(item, "_fixtureinfo", None)
        defs = getattr(info, "name2fixturedefs", None) or {}
        return [d for ds in defs.values() for d in ds
                if getattr(d, "scope", "function") != "function" and getattr(d, "cached_result", 0) is None]

    @pytest.hookimpl(wrapper=True, specname="pytest_runtest_setup")
    def pytest_runtest_setup_hygiene(self, item: pytest.Item) -> Generator[None, None, None]:
        """Take hygiene's starting reading around the setup of *item* (see Note [hygiene])."""
        if not (self.hygiene and self.active):
            return (yield)
        memory = self.memory_checked(item)
        pending = self._pending_broad_fixtures(item)
        self._before[item.nodeid] = self._hygiene_state(memory)
        result = yield
        if any(getattr(d, "cached_result", None) is not None for d in pending):
            self._before[item.nodeid] = self._hygiene_state(memory)
        return result

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        needs = [
            HardwareNeed(mark.name, marker_value(mark, item.nodeid))
            for mark in item.iter_markers()
            if mark.name in HARDWARE_MARKERS
        ]
        if not needs:
            return
        gpus = self.gpus
        for need in needs:
            reason = need.unmet(gpus)
            if reason:
                pytest.skip(reason)

    # -- checking ----------------------------------------------------------------

    def key_for(self, scope: str) -> str:
        """The key a metric of *scope* is stored under: the tier's for portable, the hardware key otherwise."""
        fp = self.fingerprint
        return fp.tier if scope == "portable" else fp.key

    def has_baselines(self, key: str) -> bool:
        """Whether *key* has any baseline file at all (a machine the gate has seen before)."""
        if key not in self._has_baselines:
            folder = self.baselines_dir / key
            self._has_baselines[key] = folder.is_dir() and any(folder.glob("*.json"))
        return self._has_baselines[key]

    def _entry(self, key: str, suite: str, nodeid: str) -> NodeBaseline | None:
        try:
            stored = self.storage.load(key, suite)
        except BaselineError as exc:
            raise pytest.UsageError(f"unusable baseline file {exc}") from None
        return stored.tests.get(nodeid) if stored else None

    def evaluate(self, recorder: Gate, test_passed: bool) -> NodeResult:
        """Check every metric of *recorder* against budget and baseline.

        Note [metric scope]: a portable metric is looked up under the tier's
        key, a machine-bound one under the hardware key. Where the hardware key
        has no baselines at all (a machine of a kind the gate has not seen),
        its machine-bound metrics are "no baselines": reported, not compared,
        not failing, unless ``--gate-require-hardware``. Any other missing
        metric (a portable one; a machine-bound one on a key that has
        baselines) follows ``--gate-missing`` (fail by default).
        """
        entries = {scope: self._entry(self.key_for(scope), recorder.suite, recorder.nodeid)
                   for scope in ("portable", "machine")}
        findings: list[Finding] = []
        mismatches: list[str] = []
        for entry in entries.values():
            for line in version_mismatches(entry.recorded.software, self.software) if entry else []:
                if line not in mismatches:
                    mismatches.append(line)
        # Only a passing test whose measurements can be trusted records anything (see _queue_update).
        untrusted = bool(recorder.untrusted) and any(m.kind == "measured" for m in recorder.metrics.values())
        recordable = test_passed and not untrusted
        for metric in recorder.metrics.values():
            budget = check_budget(metric)
            key = self.key_for(metric.effective_scope)
            entry = entries[metric.effective_scope]
            base = entry.metrics.get(metric.name) if entry else None
            if metric.kind == "measured" and recorder.untrusted:
                findings.append(Finding(metric, "untrusted", base, entry.recorded if entry else None, None,
                                        budget, "; ".join(recorder.untrusted)))
                continue
            writes = self.update_scope in ("all", metric.effective_scope)
            if base is None:
                missing: Verdict = "new" if self.update and recordable and writes else MISSING_VERDICTS[self.missing]
                if missing == "new" and not (recordable and writes):
                    missing = "not compared"  # nothing will be recorded for this test
                elif (missing == "missing" and metric.effective_scope == "machine" and not self.has_baselines(key)
                      and not self.require_hardware):
                    missing = "no baselines"
                findings.append(Finding(metric, missing, budget=budget,
                                        detail=f"{key} has no baselines" if missing == "no baselines" else ""))
                continue
            verdict, change, how = check_baseline(metric, base)
            if self.update and recordable and writes and verdict != "ok":
                verdict = "updated"
            findings.append(
                Finding(metric, verdict, base, entry.recorded if entry else None, change, budget, how)
            )
        result = NodeResult(recorder.nodeid, recorder.suite, findings, test_passed,
                            self.storage.path_for(self.key_for("machine"), recorder.suite), mismatches,
                            conditions=list(recorder.conditions),
                            portable_path=self.storage.path_for(self.key_for("portable"), recorder.suite))
        self.results.append(result)
        for scope, entry in entries.items():
            self._queue_update(result, scope, entry)
        return result

    def _queue_update(self, result: NodeResult, scope: str, entry: NodeBaseline | None) -> None:
        """Queue the metrics of *scope* of *result* for its baseline file, under ``--gate-update`` or
        ``--gate-missing record``."""
        if not result.test_passed or any(f.budget or f.verdict == "untrusted" for f in result.findings):
            return  # a failing test's (or an untrusted measurement's) figures never become a baseline
        if self.update_scope not in ("all", scope):
            return
        findings = [f for f in result.findings if f.metric.effective_scope == scope]
        if self.update:
            metrics = {f.metric.name: f.metric for f in findings}
            if not metrics and entry is None:
                return
        elif self.missing == "record" and any(f.verdict == "new" for f in findings):
            metrics = dict(entry.metrics) if entry else {}
            metrics.update({f.metric.name: f.metric for f in findings if f.verdict == "new"})
        else:
            return
        key = self.key_for(scope)
        self.pending.setdefault((key, result.suite), {})[result.nodeid] = NodeBaseline(metrics, self.provenance())

    def accept_args(self) -> list[str]:
        """The options after the node ids in the command that re-records baselines on this hardware."""
        args = ["--gate-update"]
        if self.update_scope != "all":
            args += ["--gate-update-scope", self.update_scope]
        if self.hardware_override:
            args += ["--gate-hardware", self.hardware_override]
        default = (self.config.rootpath / "baselines").resolve()
        if self.baselines_dir != default:
            args += ["--gate-baselines", str(self.baselines_dir)]
        return args

    def accept_command(self, nodeids: list[str]) -> str:
        """The command that re-records the baselines of *nodeids* on this hardware."""
        return shlex.join(["python", "-m", "pytest", *nodeids, *self.accept_args()])

    def failure_message(self, result: NodeResult) -> str:
        failed = [f for f in result.findings if f.failed]
        heads = []
        for f in failed:
            if f.budget:
                heads.append(f"{f.metric.name} outside budget")
            if f.verdict == "regressed":
                heads.append(f"{f.metric.name} {format_change(f.change or 0.0)} vs baseline")
            elif f.verdict in ("missing", "incompatible"):
                heads.append(f"{f.metric.name} {f.verdict} baseline")
            elif f.verdict == "untrusted":
                heads.append(f"{f.metric.name} measured on a GPU in an untrustworthy state")
        lines = [
            f"vramgate: {'; '.join(heads)} "
            f"({len(failed)} of {len(result.findings)} metric(s) fall short on hardware {self.fingerprint.key}, "
            f"tier {self.fingerprint.tier})",
        ]
        for f in failed:
            m = f.metric
            if f.budget:
                lines.append(f"- {m.name}: {f.budget} [budget set in the test]")
            if f.verdict == "missing":
                path = result.path_of(f)
                why = ("a gate that compares nothing passes nothing: record one, or run with --gate-missing=record"
                       if path is None or self.has_baselines(path.parent.name) else
                       f"--gate-require-hardware is set and {path.parent.name} has no baselines: record them")
                lines.append(f"- {m.name}: now {m.show(precise=True)}; no baseline in {self._rel(path)} "
                             f"({m.effective_scope} metric; {why})")
            elif f.verdict == "untrusted":
                lines.append(f"- {m.name}: now {m.show(precise=True)}, not compared: {f.detail} "
                             f"(rerun on an idle GPU at full clocks)")
            elif f.verdict in ("regressed", "incompatible") and f.baseline is not None:
                change = format_change(f.change or 0.0)
                lines.append(
                    f"- {m.name}: now {m.show(precise=True)}, baseline {m.show(f.baseline.value, precise=True)}: "
                    f"{change}, {f.verdict} ({f.detail})"
                )
        provenance = next(((f.provenance, f) for f in failed if f.provenance), None)
        if provenance:
            lines.append(f"Baseline: {self._rel(result.path_of(provenance[1]))}, {provenance[0].describe()}")
        if result.mismatches:
            lines.append("! software differs from the baseline's: " + "; ".join(result.mismatches))
        acceptable = [f for f in failed if f.verdict in ("regressed", "missing", "incompatible")]
        if acceptable:
            lines.append("To accept this on purpose, re-record the baseline and commit it for review:")
            lines.append(f"    {self.accept_command([result.nodeid])}")
            lines.append(f"    git add {' '.join(self._rel(p) for p in result.paths_of(acceptable))}")
        return "\n".join(lines)

    def _rel(self, path: Path | None) -> str:
        if path is None:
            return "?"
        try:
            return str(path.relative_to(self.config.rootpath))
        except ValueError:
            return str(path)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, None]:
        """Guard every GPU test's measurements by default.

        Note [default GPU guard]: a test that carries ``requires_gpus`` and uses
        the ``gate`` fixture runs inside :meth:`Gate.gpu_guard`: NVML's clocks,
        clock-event reasons and processes are read before and after its call,
        and its measured metrics become ``untrusted`` (failing, never recorded)
        when the GPU throttled or another process used it. A test may guard
        narrower regions itself as well; every reading goes into the report.
        """
        recorder = getattr(item, "funcargs", {}).get("gate")
        if not isinstance(recorder, Gate) or item.get_closest_marker("requires_gpus") is None:
            yield
            return
        with recorder.gpu_guard():
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if report.when == "call" and not report.passed:
            self._call_failed.add(item.nodeid)
        if report.when == "teardown" and self.hygiene and item.nodeid in self._before:
            # Fixtures are finalized by now; drop the item's stale references to their values so
            # that only what the test really leaked is still allocated.
            funcargs = getattr(item, "funcargs", None)
            if isinstance(funcargs, dict):
                funcargs.clear()
            # A failed or skipped test's traceback keeps its locals alive: check its processes only.
            leaked = self.leaks(item.nodeid, cuda=item.nodeid not in self._call_failed)
            self._call_failed.discard(item.nodeid)
            if leaked and not report.failed:
                report.outcome = "failed"
                report.longrepr = f"vramgate hygiene: {item.nodeid} left behind:\n" + "\n".join(
                    f"- {line}" for line in leaked)
            return
        if report.when != "call":
            return
        recorder = item.stash.get(GATE_KEY, None)
        if recorder is None:
            return
        self.claims.extend((recorder.nodeid, c) for c in recorder.claims)
        if not recorder.metrics:
            return
        result = self.evaluate(recorder, test_passed=report.passed)
        report.sections.append(("vramgate", self.result_table(result)))
        for prop in junit_properties(result):  # GitLab, Jenkins and Buildkite read junit, not our report
            item.user_properties.append(prop)
            report.user_properties.append(prop)
        if result.failed and report.passed:
            report.outcome = "failed"
            report.longrepr = self.failure_message(result)
        elif result.failed:
            report.sections.append(("vramgate failures", self.failure_message(result)))

    def result_table(self, result: NodeResult) -> str:
        from vramgate.report.render import rows_of, text_table

        return text_table(rows_of([result]))

    # -- session end -------------------------------------------------------------

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.pending:
            fp = self.fingerprint
            for (key, suite), tests in sorted(self.pending.items()):
                try:
                    self.written.append(self.storage.update(key, suite, fp.to_json(), tests))
                except BaselineError as exc:
                    self.errors.append(f"could not update the baseline of suite {suite!r}: {exc} "
                                       "(left as it is: repair or delete it, then rerun with --gate-update)")
                except OSError as exc:
                    path = self._rel(self.storage.path_for(key, suite))
                    self.errors.append(f"could not write the baseline of suite {suite!r} to {path}: {exc} "
                                       "(the previous file, if any, is unchanged)")
        workeroutput = getattr(self.config, "workeroutput", None)
        # An xdist worker: the controller reports (Note [xdist] in vramgate.pytest_plugin.transport).
        if workeroutput is not None:
            from vramgate.pytest_plugin.transport import results_json

            workeroutput["vramgate"] = json.dumps(results_json(self.results, self.claims, self.written,
                                                               self.errors))
            return
        if self.baselines_ref and self.active:
            from vramgate.store.moves import RefError, moved

            try:
                self.moves = moved(self.config.rootpath, self.baselines_ref, self.baselines_dir)
            except RefError as exc:
                self.errors.append(str(exc))
        if self.report_dir is not None and (self.results or self.claims or self.moves):
            from vramgate.report.render import write_report

            try:
                write_report(self, self.report_dir)
                self.report_written = True
            except OSError as exc:
                self.errors.append(f"could not write the report into {self.report_dir}: {exc} "
                                   "(the previous report there, if any, is unchanged)")
        if self.errors and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def moved_json(self) -> dict[str, Any] | None:
        """The baselines this change moves, with this run's figure of each where it ran; None without a ref."""
        if self.moves is None:
            return None
        findings = {(self._rel(r.path_of(f)), r.nodeid, f.metric.name): f for r in self.results for f in r.findings}
        out = []
        for move in self.moves:
            f = findings.get((move.file, move.nodeid, move.metric))  # only a figure compared against that file
            matches = None
            if f is not None and move.new is not None:
                matches = (f.metric.value == move.new.value if f.metric.kind == "exact"
                           else f.verdict not in ("regressed", "missing", "incompatible"))
            out.append(move.to_json(f.metric if f else None, matches))
        return {"ref": self.baselines_ref, "metrics": out}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: take a finished worker's findings.

        Note [xdist] in :mod:`vramgate.pytest_plugin.transport`.
        """
        text = getattr(node, "workeroutput", {}).get("vramgate")
        if not text:
            return
        from vramgate.pytest_plugin.transport import results_from

        results, claims, written, errors = results_from(json.loads(text), NodeResult)
        self.results += results
        self.claims += claims
        self.written += written
        self.errors += errors
        self.active = self.active or bool(results or claims)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.results and not self.errors and not self.claims and not self.moves:
            return
        from vramgate.report.render import terminal_summary

        terminal_summary(self, terminalreporter)
