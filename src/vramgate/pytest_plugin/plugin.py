"""The vramgate pytest plugin: its hooks and the ``gate`` fixture.

Registered through the ``pytest11`` entry point ``vramgate``; disable with ``-p no:vramgate``. Session state lives
in one :class:`~vramgate.pytest_plugin.session.GateSession` registered with the plugin manager under
:data:`SESSION_NAME`; the gate's hooks are :class:`GatePlugin`, hygiene's are
:class:`~vramgate.pytest_plugin.hygiene.HygienePlugin`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Generator
from typing import Any

import pytest

from vramgate.machine import hardware, isa
from vramgate.machine.probes.memory_history import MEMORY_HISTORY_ENV
from vramgate.pytest_plugin import hookspecs
from vramgate.pytest_plugin.affected import keep_affected
from vramgate.pytest_plugin.allocator_snapshots import HISTORY_FOLDER, CallHistory, MemoryHistory, apply_engine_switch
from vramgate.pytest_plugin.fixture import Gate
from vramgate.pytest_plugin.hygiene import HygienePlugin
from vramgate.pytest_plugin.marks import HARDWARE_MARKERS, MARKERS, HardwareNeed, marker_help, marker_value
from vramgate.pytest_plugin.options import add_options
from vramgate.pytest_plugin.session import GateSession, NodeResult
from vramgate.pytest_plugin.verdicts import VerdictPlugin
from vramgate.pytest_plugin.worker_order import WorkerOrder
from vramgate.runtime import engine_env, quiet
from vramgate.store.baselines import BaselineError

SESSION_NAME = "vramgate-session"
GATE_KEY = pytest.StashKey[Gate]()
HISTORY_KEY = pytest.StashKey[CallHistory]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Declare the gate's own hooks (:mod:`vramgate.pytest_plugin.hookspecs`)."""
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ``--gate-*`` options and their ini twins (:mod:`vramgate.pytest_plugin.options`)."""
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marks, cap the ISA, and register the session, hygiene and the gate's hooks."""
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
    for flag, python in (("--gate-engine-python", session.options.engine_python),
                         ("--gate-upgrade-from", session.options.upgrade_from)):
        try:
            if python and flag == "--gate-engine-python":
                before = os.environ.get(engine_env.ENGINE_PYTHON_VAR)
                engine_env.use(python)  # in this process's environment: xdist's workers and every child see it
                config.add_cleanup(functools.partial(restore_env, engine_env.ENGINE_PYTHON_VAR, before))
            elif python:
                engine_env.probe(python).require_vllm()
        except engine_env.EngineEnvError as exc:
            raise pytest.UsageError(f"{flag}: {exc}") from None
    if session.options.compute_tier:  # Note [a tier's portable figures computed on CPU]: xdist's workers see it too
        if session.gpus:
            raise pytest.UsageError(f"--gate-compute-tier {session.options.compute_tier}: this machine has GPUs; "
                                    "run the gate on them instead of computing their tier's figures")
        before = os.environ.get(hardware.COMPUTE_TIER_ENV)
        os.environ[hardware.COMPUTE_TIER_ENV] = session.options.compute_tier
        config.add_cleanup(functools.partial(restore_env, hardware.COMPUTE_TIER_ENV, before))
    if session.options.memory_history != "off":  # Note [memory history]: every engine records in its worker
        before = apply_engine_switch(session.options.memory_history)
        config.add_cleanup(functools.partial(restore_env, MEMORY_HISTORY_ENV, before))
    if not hasattr(config, "workerinput"):  # Note [quiet sections]: one lock file for this session's workers
        config.add_cleanup(quiet.start_session())
    config.pluginmanager.register(session, SESSION_NAME)
    if session.options.hygiene:
        # Registered before the gate's hooks, so that its report wrapper sees a test's own outcome, before
        # the gate fails it for its metrics.
        hygiene = HygienePlugin(lambda: session.active, session.options.engine_fixtures)
        config.pluginmanager.register(hygiene, f"{SESSION_NAME}-hygiene")
    for name, plugin in (("hooks", GatePlugin(session)), ("verdicts", VerdictPlugin(session))):
        config.pluginmanager.register(plugin, f"{SESSION_NAME}-{name}")
    if session.options.durations is not None and hasattr(config, "workerinput"):
        config.pluginmanager.register(WorkerOrder(session.options.durations), f"{SESSION_NAME}-order")


def restore_env(name: str, value: str | None) -> None:
    """Set the variable *name* back to *value* (unset it for None)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def gate_session(config: pytest.Config) -> GateSession:
    """The gate's session of this pytest run (its :attr:`~GateSession.fingerprint`, :attr:`~GateSession.gpus`,
    :attr:`~GateSession.report_dir`, its options): the one place the layers above read the run's machine and
    options from."""
    session = config.pluginmanager.get_plugin(SESSION_NAME)
    if not isinstance(session, GateSession):
        raise RuntimeError("the vramgate plugin is not configured in this pytest run")
    return session


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Every test runs holding the session's shared lock, so that a quiet section waits for it (Note [quiet
    sections] in :mod:`vramgate.runtime.quiet`)."""
    with quiet.shared():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """An engine this machine cannot run (:class:`~vramgate.engine.UnsupportedHere`, raised before it starts: a
    paired engine, a server, an engine while another tier's figures are computed here) skips the test with the
    reason, as the ``engine`` fixture's runs do."""
    try:
        return (yield)
    except Exception as exc:
        from vramgate.engine.spec import UnsupportedHere  # only on a failure: a plain pytest run imports no engine

        if isinstance(exc, UnsupportedHere):
            pytest.skip(f"not on this machine: {exc}")
        raise


@pytest.fixture
def gate(request: pytest.FixtureRequest) -> Gate:
    """Record metrics of this test: ``gate.record(...)`` and ``gate.record_samples(...)``.

    Every recorded metric is checked when the test ends, against its ceiling or
    floor and against the baseline stored for this machine's hardware key; the
    test fails with one message listing every metric that falls short.
    """
    session = gate_session(request.config)
    item = request.node
    recorder = Gate(item.nodeid, session.suite_for(item), session.gpus_used(item))
    recorder.previewer = lambda metric: session.preview(recorder, metric)
    recorder.baseline_writer = lambda metric: session.writes_baseline(recorder, metric)
    item.stash[GATE_KEY] = recorder
    return recorder


class GatePlugin:
    """The gate's hooks: collection, hardware marks, checking each test's metrics, and the session's end."""

    def __init__(self, session: GateSession) -> None:
        self.session = session
        self.config = session.config
        options = session.options
        self.history = (MemoryHistory(options.memory_history, options.report_dir / HISTORY_FOLDER,
                                      options.engine_fixtures)
                        if options.memory_history != "off" and options.report_dir is not None else None)
        """``--gate-memory-history`` (Note [memory history]), None when off."""

    # -- collection ------------------------------------------------------------

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """With ``--gate-plan``: what the collected tests need of the hardware, and what this machine does."""
        if not self.session.options.plan:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        verbose = self.config.option.verbose > 0
        from vramgate.report import plan_baseline_lines, plan_lines

        lines = plan_lines(self.session.plan(session.items), self.session.fingerprint, self.session.gpus,
                           verbose=verbose)
        lines += plan_baseline_lines(self.session.plan_baselines(session.items), self.session.fingerprint.key,
                                     verbose=verbose)
        for line in lines:
            reporter.write_line(line)

    @pytest.hookimpl(trylast=True)  # after -m and -k: what they deselect is neither affected nor sharded
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Check marks, and baselines (and the ref) where the gate is in use; keep what a change touches, a shard."""
        gs = self.session
        for item in items:
            for mark in item.iter_markers():
                if mark.name in MARKERS:
                    marker_value(mark, item.nodeid)
        gs.active = gs.active or any(gs.uses_gate(item) for item in items)
        if gs.active:  # a corrupt baseline or a bad ref stops the run before any test, never half-way
            try:
                gs.storage.validate_all()
            except BaselineError as exc:
                raise pytest.UsageError(f"unusable baseline file {exc}") from None
            if gs.baselines_ref:
                from vramgate.store.moves import RefError, resolve

                try:
                    resolve(config.rootpath, gs.baselines_ref, gs.baselines_dir)
                except RefError as exc:
                    raise pytest.UsageError(str(exc)) from None
        if gs.options.affected:  # Note [each test's inputs]
            keep_affected(config, items, gs)
        if gs.options.shard is None:
            return
        # Note [shards]: round-robin over the sorted node ids: every shard of one run
        # collects the same tests, so the shards partition them exactly.
        index, count = gs.options.shard
        order = {nodeid: i for i, nodeid in enumerate(sorted(item.nodeid for item in items))}
        keep = [item for item in items if order[item.nodeid] % count == index - 1]
        dropped = [item for item in items if order[item.nodeid] % count != index - 1]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep

    # -- running -------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Skip a test whose ``requires_*`` marks this machine does not meet, saying why."""
        needs = [
            HardwareNeed(mark.name, marker_value(mark, item.nodeid))
            for mark in item.iter_markers()
            if mark.name in HARDWARE_MARKERS
        ]
        if not needs:
            return
        gpus = self.session.gpus
        for need in needs:
            reason = need.unmet(gpus)
            if reason:
                pytest.skip(reason)

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
        history = self.history.begin(item) if self.history is not None and self.session.uses_gate(item) else None
        try:
            if not isinstance(recorder, Gate) or item.get_closest_marker("requires_gpus") is None:
                yield
            else:
                with recorder.gpu_guard():
                    yield
        finally:
            if history is not None and self.history is not None:
                problem = self.history.end(history)
                if problem:
                    self.session.errors.append(problem)
                item.stash[HISTORY_KEY] = history

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        """Check the metrics a test recorded once its call ends; fail it with one message when any falls short."""
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if report.when != "call":
            return
        recorder = item.stash.get(GATE_KEY, None)
        history = item.stash.get(HISTORY_KEY, None)
        if recorder is None or not recorder.metrics:
            if recorder is not None:
                self.session.claims.extend((recorder.nodeid, c) for c in recorder.claims)
            self._keep_history(item, report, history, report.failed)
            return
        from vramgate.report import failure_message, junit_properties, rows_of, text_table  # a test that recorded

        gs = self.session
        gs.claims.extend((recorder.nodeid, c) for c in recorder.claims)
        result = gs.evaluate(recorder, test_passed=report.passed)
        node = gs.node_summary(result)
        report.sections.append(("vramgate", text_table(rows_of([node]))))
        for prop in junit_properties(result.findings):  # GitLab, Jenkins and Buildkite read junit, not our report
            item.user_properties.append(prop)
            report.user_properties.append(prop)
        kept = self._keep_history(item, report, history, result.failed or report.failed, section=not result.failed)
        if result.failed:
            message = failure_message(node, gs.hardware(), gs.accept_args())
            if kept:
                message += "\n" + kept
            if report.passed:
                report.outcome = "failed"
                report.longrepr = message
            else:
                report.sections.append(("vramgate failures", message))

    def _keep_history(self, item: pytest.Item, report: pytest.TestReport, history: CallHistory | None,
                      failed: bool, section: bool = True) -> str:
        """Keep or drop *history*'s snapshots (Note [memory history]); the lines naming the kept ones, also added
        to the report as a section when *section*."""
        if history is None or self.history is None:
            return ""
        del item.stash[HISTORY_KEY]
        kept = self.history.settle(history, failed)
        if not kept:
            return ""
        lines = self.history.lines(kept, self.config.rootpath)
        if section:
            report.sections.append(("vramgate memory history", lines))
        return lines

    # -- session end -------------------------------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Add up each test's setup, call and teardown time for report.json (Note [longest first])."""
        durations = self.session.durations
        durations[report.nodeid] = durations.get(report.nodeid, 0.0) + float(report.duration or 0.0)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write the queued baselines and the report (an xdist worker hands its findings over instead)."""
        gs = self.session
        if gs.pending:
            gs.write_baselines()
        workeroutput = getattr(self.config, "workeroutput", None)
        # An xdist worker: the controller reports (Note [xdist] in vramgate.pytest_plugin.transport).
        if workeroutput is not None:
            from vramgate.pytest_plugin.transport import results_json

            workeroutput["vramgate"] = json.dumps({**results_json(gs.results, gs.claims, gs.written, gs.errors),
                                                   "affected": gs.affected})
            return
        if gs.baselines_ref and gs.active:
            from vramgate.store.moves import RefError, moved

            try:
                gs.moves = moved(self.config.rootpath, gs.baselines_ref, gs.baselines_dir)
            except RefError as exc:
                gs.errors.append(str(exc))
        problem = gs.version_problem()
        if problem:
            gs.errors.append(problem)
        if gs.report_dir is not None and (gs.results or gs.claims or gs.moves or gs.affected or gs.judgements):
            from vramgate.report import write_report

            try:
                write_report(gs.summary(), gs.report_dir)
                gs.report_written = True
            except OSError as exc:
                gs.errors.append(f"could not write the report into {gs.report_dir}: {exc} "
                                 "(the previous report there, if any, is unchanged)")
        if gs.options.exports and gs.results:
            self._write_exports()
        if gs.affected and gs.affected["left_out"] and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK  # the change touches no test's input: nothing to run is a pass
        if gs.errors and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write_exports(self) -> None:
        """Write the ``--gate-export`` files from the report's data; what cannot be written is a session error."""
        from vramgate.report import export_text, report_data
        from vramgate.store.files import atomic_write_text

        gs = self.session
        data = report_data(gs.summary())
        for fmt, path in gs.options.exports:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, export_text(data, fmt))
            except OSError as exc:
                gs.errors.append(f"could not write the {fmt} export to {path}: {exc}")

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: take a finished worker's findings (Note [xdist] in vramgate.pytest_plugin.transport)."""
        text = getattr(node, "workeroutput", {}).get("vramgate")
        if not text:
            return
        from vramgate.pytest_plugin.transport import results_from

        gs = self.session
        data = json.loads(text)
        results, claims, written, errors = results_from(data, NodeResult)
        gs.results, gs.claims, gs.written, gs.errors = gs.results + results, gs.claims + claims, \
            gs.written + written, gs.errors + errors
        gs.affected = gs.affected or data.get("affected")
        gs.active = gs.active or bool(results or claims)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The gate's section of the terminal summary."""
        gs = self.session
        if not (gs.results or gs.errors or gs.claims or gs.moves or gs.affected or gs.judgements):
            return
        from vramgate.report import terminal_summary

        terminal_summary(gs.summary(), terminalreporter, verbose=terminalreporter.config.option.verbose > 0)
