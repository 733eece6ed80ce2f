"""The gate's command-line options and ini values, and what a session reads of them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vramgate.runtime.engine_env import ENGINE_PYTHON_VAR

MISSING_POLICIES = ("fail", "record", "skip")
UPDATE_SCOPES = ("all", "portable", "machine")
#: When ``--gate-memory-history`` keeps a test's allocator history (Note [memory history]).
MEMORY_HISTORY = ("off", "on-failure", "always")
#: Fixtures that start engine processes, unless the ini value ``gate_engine_fixtures`` names others.
DEFAULT_ENGINE_FIXTURES = ("engine",)


def add_options(parser: pytest.Parser) -> None:
    """Add the ``--gate-*`` options, each with its ini twin, and the ini value ``gate_engine_fixtures``."""
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
        ("--gate-engine-python", "gate_engine_python", {"metavar": "PY"},
         "the interpreter of the engine environment (a virtual environment with its own vLLM) that runs the "
         "engines and simulations (default: the one running pytest)"),
        ("--gate-upgrade-from", "gate_upgrade_from", {"metavar": "PY"},
         "an upgrade run: PY is the engine environment of the vLLM being upgraded from; baselines recorded with "
         "another vLLM are expected, and the upgrade tests pair the two environments' engines"),
        ("--gate-durations", "gate_durations", {"metavar": "FILE"},
         "under pytest-xdist (with --dist worksteal), give each worker equally long runs of tests, longest first, "
         "by the seconds in FILE (a {node id: seconds} JSON that 'vramgate report durations' writes from a "
         "report.json), so that no worker is left with the long tests at the end"),
        ("--gate-memory-history", "gate_memory_history", {"choices": MEMORY_HISTORY},
         "record the CUDA allocator's memory history of each gated test (in the test's process and in its engines) "
         "and save it next to the report: for failing tests only (on-failure), for every test (always), or not at "
         "all (off, the default); needs --gate-report"),
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
        "--gate-export", dest="gate_export", action="append", default=None, metavar="FORMAT[:PATH]",
        help="after the run, also write its metrics for a dashboard: bmf (Bencher Metric Format) or pytorch (the "
             "PyTorch benchmark database's records), to PATH or into the --gate-report folder (repeatable)",
    )
    parser.addini("gate_export", type="linelist", default=[], help="default of --gate-export: one FORMAT[:PATH] a line")
    group.addoption(
        "--gate-baselines-ref", dest="gate_baselines_ref", default=None, metavar="REF",
        help="list first every stored baseline that differs between git REF (a PR's base) and the tree",
    )
    parser.addini("gate_baselines_ref", default=None, help="default of --gate-baselines-ref")
    group.addoption(
        "--gate-affected", dest="gate_affected", default=None, metavar="REF",
        help="run only the tests whose inputs differ between git REF's merge base with HEAD (a PR's base) and the "
             "working tree, and the references their profiles pair with; every test where a file every test "
             "reads changed, or where the gate cannot tell (docs/running.md, 'What a change touches')",
    )
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
        "--gate-compute-tier", dest="gate_compute_tier", default=None, choices=("cuda",),
        help="compute the cuda tier's portable figures on this CPU machine from vLLM's own classes (KV accounting, "
             "the scheduler, checkpoint sizes) and compare them with, or with --gate-update write them to, the "
             "cuda tier's baselines; engines are skipped, machine-bound figures not compared (docs/gpu.md)",
    )
    group.addoption(
        "--gate-update", dest="gate_update", action="store_true", default=None,
        help="write or refresh the baselines of the tests that ran (review and commit the diff)",
    )
    parser.addini("gate_update", type="bool", default=False, help="default of --gate-update")
    parser.addini(
        "gate_engine_fixtures", type="linelist", default=list(DEFAULT_ENGINE_FIXTURES),
        help="fixtures that start engine processes (default: engine): a test that uses one is in the gate's "
             "use, and hygiene checks its child processes' and devices' memory as well",
    )


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)``; a :class:`pytest.UsageError` for anything else."""
    try:
        index, count = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise pytest.UsageError(f"--gate-shard {text!r}: expected I/N, e.g. 1/2") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--gate-shard {text!r}: I must be between 1 and N")
    return index, count


def interpreter(value: str | None, base: Path) -> str | None:
    """An interpreter named by an option: absolute, from *base* when relative; not resolved (a virtual
    environment's ``bin/python`` is a link its environment is known by)."""
    if not value:
        return None
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).absolute())


@dataclass(frozen=True)
class GateOptions:
    """What a session was asked to do: each ``--gate-*`` option, else its ini value, else its default."""

    baselines_dir: Path
    hardware_override: str | None
    missing: str
    report_dir: Path | None
    update: bool
    update_scope: str
    compute_tier: str | None
    """``--gate-compute-tier``: the tier whose portable figures are computed here (Note [a tier's portable figures
    computed on CPU]), or None."""
    baselines_ref: str | None
    affected: str | None
    """``--gate-affected``: the ref whose changes select the tests, or None (every test)."""
    require_hardware: bool
    shard: tuple[int, int] | None
    hygiene: bool
    plan: bool
    engine_fixtures: tuple[str, ...]
    engine_python: str | None = None
    """``--gate-engine-python``: the engine environment's interpreter (absolute), None for pytest's own."""
    upgrade_from: str | None = None
    """``--gate-upgrade-from``: the interpreter of the vLLM an upgrade run upgrades from (absolute)."""
    exports: tuple[tuple[str, Path], ...] = ()
    """``--gate-export``: (format, file) of each export to write at the end (absolute)."""
    memory_history: str = "off"
    durations: dict[str, float] | None = None
    """``--gate-durations``: the seconds per test that order the tests under pytest-xdist (Note [longest
    first]), read when the session starts."""
    """``--gate-memory-history``: off, on-failure or always (Note [memory history])."""
    asked: list[str] = field(default_factory=list)
    """The options and ini values set (Note [inert until asked])."""


def read_options(config: pytest.Config) -> GateOptions:
    """The session's :class:`GateOptions`; a :class:`pytest.UsageError` for a value out of range.

    A relative folder given on the command line is taken from the directory pytest was started in; one given in
    the ini file, from the ini file's folder.
    """
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
    hardware_key, _ = opt("gate_hardware")
    missing, _ = opt("gate_missing")
    missing = missing or "fail"
    if missing not in MISSING_POLICIES:
        raise pytest.UsageError(f"gate_missing = {missing!r}: must be one of {', '.join(MISSING_POLICIES)}")
    report, report_dir = opt("gate_report")
    update, _ = opt("gate_update")
    update_scope, _ = opt("gate_update_scope")
    update_scope = update_scope or "all"
    if update_scope not in UPDATE_SCOPES:
        raise pytest.UsageError(f"gate_update_scope = {update_scope!r}: must be one of {', '.join(UPDATE_SCOPES)}")
    compute_tier = config.getoption("gate_compute_tier")
    if compute_tier:
        asked.append("gate_compute_tier")
        if config.getoption("gate_update_scope") not in (None, "portable"):
            raise pytest.UsageError(f"--gate-compute-tier {compute_tier}: writes portable baselines only "
                                    "(--gate-update-scope portable)")
        update_scope = "portable"
    ref, _ = opt("gate_baselines_ref")
    require, _ = opt("gate_require_hardware")
    shard, _ = opt("gate_shard")
    hygiene, _ = opt("gate_hygiene")
    engine_python, python_dir = opt("gate_engine_python")
    if not engine_python and os.environ.get(ENGINE_PYTHON_VAR):
        # The variable alone names it too (a parent run, a CI job): checked and recorded as the option would be.
        engine_python, python_dir = os.environ[ENGINE_PYTHON_VAR], config.invocation_params.dir
    upgrade_from, from_dir = opt("gate_upgrade_from")
    affected = config.getoption("gate_affected") or None
    if affected:
        asked.append("gate_affected")
    plan = bool(config.getoption("gate_plan"))
    if plan:
        asked.append("gate_plan")
    report_path = (report_dir / report).resolve() if report else None
    durations, durations_dir = opt("gate_durations")
    memory_history, _ = opt("gate_memory_history")
    memory_history = memory_history or "off"
    if memory_history not in MEMORY_HISTORY:
        raise pytest.UsageError(f"gate_memory_history = {memory_history!r}: must be one of {', '.join(MEMORY_HISTORY)}")
    if memory_history != "off" and report_path is None:
        raise pytest.UsageError(f"--gate-memory-history {memory_history}: needs --gate-report DIR (the allocator "
                                "histories are saved next to the report)")
    return GateOptions(
        baselines_dir=(base_dir / (baselines or "baselines")).resolve(),
        hardware_override=hardware_key or None,
        missing=missing,
        report_dir=report_path,
        update=bool(update),
        update_scope=update_scope,
        compute_tier=compute_tier or None,
        baselines_ref=ref or None,
        affected=affected,
        require_hardware=bool(require),
        shard=parse_shard(shard) if shard else None,
        hygiene=(hygiene or "on") != "off",
        plan=plan,
        engine_fixtures=tuple(config.getini("gate_engine_fixtures")),
        engine_python=interpreter(engine_python, python_dir),
        upgrade_from=interpreter(upgrade_from, from_dir),
        exports=read_exports(config, report_path, asked),
        memory_history=memory_history,
        durations=read_durations_option((durations_dir / durations).resolve()) if durations else None,
        asked=asked,
    )


def read_durations_option(path: Path) -> dict[str, float]:
    """The seconds per test of ``--gate-durations`` *path*; a usage error naming the file and entry."""
    from vramgate.store.durations import DurationsError, read_durations

    try:
        return read_durations(path)
    except DurationsError as exc:
        raise pytest.UsageError(f"--gate-durations: {exc}") from None


def read_exports(config: pytest.Config, report_dir: Path | None, asked: list[str]) -> tuple[tuple[str, Path], ...]:
    """(format, absolute file) of each ``--gate-export`` (else of the ini value ``gate_export``); a relative PATH
    from the directory pytest was started in (the ini file's folder for the ini value), none into *report_dir*."""
    values = config.getoption("gate_export")
    if not values and not config.getini("gate_export"):
        return ()
    from vramgate.report.export import EXPORT_FILES, parse_export  # only when an export is asked for
    base = config.invocation_params.dir
    flag = "--gate-export"
    if not values:
        values = config.getini("gate_export")
        base = config.inipath.parent if config.inipath else config.rootpath
        flag = "gate_export"
    if not values:
        return ()
    asked.append("gate_export")
    out: list[tuple[str, Path]] = []
    for value in values:
        try:
            fmt, path = parse_export(value)
        except ValueError as exc:
            raise pytest.UsageError(f"{flag}: {exc}") from None
        if path is not None:
            file = (base / path).resolve()
        elif report_dir is not None:
            file = report_dir / EXPORT_FILES[fmt]
        else:
            raise pytest.UsageError(f"{flag} {value}: give a file ({value}:PATH) or --gate-report DIR to write "
                                    f"{EXPORT_FILES[fmt]} into")
        if any(f == file for _, f in out):
            raise pytest.UsageError(f"{flag} {value}: {file} is named by another export too")
        out.append((fmt, file))
    return tuple(out)
