"""The ``gate_matrix`` mark: a suite's test parametrized by the project's matrix (``vramgate.toml``).

``@pytest.mark.gate_matrix("kv_cache", id="{model}-bs{block_size}-{kv_cache_dtype}")`` gives the test one case
per entry of the matrix that names the suite and runs on this machine (Note [matrix selection] in
:mod:`vramgate.matrix.select`), times the entry's block sizes and KV dtypes when the test takes
``block_size``/``kv_cache_dtype``. The arguments a test may take:

* ``model``: the entry's config folder under ``fixtures/models`` (the id's ``{model}`` is the matrix's name);
* ``block_size``, ``kv_cache_dtype``: one of the entry's (each a case); ``block_sizes``, ``kv_cache_dtypes``:
  all of them, as a tuple;
* ``dtype``, ``tp``, ``quantization``;
* ``request_rate``: one of the entry's ``[entries.load]`` request rates (each a case; the id's ``{request_rate}``);
* ``matrix_case``: a :class:`MatrixCase`, whose :meth:`~MatrixCase.engine_spec` applies the entry to an
  engine spec (dtype, TP, KV dtype, quantization, workload, and real weights where the tier allows).

Cases with the same id are one case. Each case carries its entry: after the test's call the entry's budgets
become ceilings and floors of the metrics the test recorded under the same names, and a test that takes
``matrix_case`` gets a report section saying which weights it ran.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vramgate.engine import EngineSpec, engine_tier
from vramgate.matrix import (
    DEFAULT_SOURCE,
    Budget,
    Entry,
    Machine,
    Matrix,
    MatrixError,
    collection_problem,
    gpu_count_problem,
    missing_trace,
    parse_matrix,
    project_matrix,
)
from vramgate.pytest_plugin.affected import TestInput
from vramgate.pytest_plugin.fixture import Gate
from vramgate.store.changes import DEFAULT_MATRIX, ChangeSet

__all__ = [
    "ARGUMENTS",
    "ENTRY_MARKER_HELP",
    "MARKER_HELP",
    "MATRIX_OPTION",
    "MatrixCase",
    "budgets_hook",
    "case_entry",
    "entry_inputs",
    "give_budgets",
    "mark_arguments",
    "matrix_params",
    "parametrize_matrix",
    "session_machine",
    "session_matrix",
]

#: The mark's line in ``pytest --markers``.
MARKER_HELP = ("gate_matrix(suite, *, id): parametrize the test's model, block_size, kv_cache_dtype, ... by the "
               "entries of the project's matrix (vramgate.toml) that name SUITE and run on this machine; ID is "
               "the case id, a format string of those names")
#: The mark each case carries: its entry.
ENTRY_MARKER_HELP = "gate_matrix_entry(entry): the matrix entry of a case of a gate_matrix test (set by the mark)"
#: The ini setting and option that name the matrix file.
MATRIX_OPTION = "gate_matrix"

#: The arguments the mark fills, and what each takes from an entry.
ARGUMENTS = ("model", "block_size", "kv_cache_dtype", "block_sizes", "kv_cache_dtypes", "dtype", "tp",
             "quantization", "request_rate", "matrix_case")
_STASH = pytest.StashKey[Matrix]()


@dataclass(frozen=True)
class MatrixCase:
    """One case of a ``gate_matrix`` test: its entry, block size and KV dtype, on this engine tier."""

    entry: Entry
    block_size: int
    kv_cache_dtype: str
    tier: str
    request_rate: float | None = None
    """One of the entry's ``[entries.load]`` request rates, for a test that takes ``request_rate``."""

    @property
    def real_weights(self) -> bool:
        """Whether the engine loads the entry's checkpoint (the GPU tier, a checkpoint declared)."""
        return self.tier == "gpu" and self.entry.model.checkpoint is not None

    def engine_spec(self, base: EngineSpec) -> EngineSpec:
        """*base* with the entry's model config, dtype, TP size, KV dtype, block size, quantization, workload and
        weights (the default entries change nothing: a spec's key stays what it was)."""
        entry = self.entry
        changes: dict[str, Any] = dict(
            model=entry.model.config, dtype=entry.dtype, tensor_parallel_size=entry.tp, block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype, quantization=entry.quantization,
        )
        if entry.workload is not None:
            wl = entry.workload
            changes.update(workload=wl.engine_name, workload_params=dict(wl.params))
            if wl.requests is not None:
                changes["requests"] = wl.requests
            if wl.seed is not None:
                changes["seed"] = wl.seed
            if wl.arrival_rate is not None:
                changes["arrival_rate"] = wl.arrival_rate
        engine_args = dict(base.engine_args)
        if self.real_weights:
            engine_args.update(model=entry.model.checkpoint, load_format="auto")
        serving = entry.serving
        if serving is not None:  # vLLM sizes the KV cache itself (Note [automatic KV] in vramgate.engine)
            changes.update(kv_budget_gib=None, gpu_memory_utilization=serving.gpu_memory_utilization,
                           cpu_memory_bytes=serving.cpu_memory, enforce_eager=serving.enforce_eager,
                           max_model_len=serving.max_model_len, max_num_seqs=serving.max_num_seqs,
                           max_num_batched_tokens=serving.max_num_batched_tokens)
            compilation: dict[str, Any] = {}
            if serving.cudagraph_mode is not None:
                compilation["cudagraph_mode"] = serving.cudagraph_mode
            if serving.cudagraph_capture_sizes is not None:
                compilation["cudagraph_capture_sizes"] = list(serving.cudagraph_capture_sizes)
            if compilation:
                engine_args["compilation_config"] = compilation
        if engine_args != base.engine_args:
            changes["engine_args"] = engine_args
        return base.replace(**changes)

    def weights_note(self) -> str:
        """The line the report carries: which weights the engine ran."""
        model = self.entry.model
        if self.real_weights:
            return f"weights: {model.name} from the checkpoint {model.checkpoint}"
        if model.checkpoint is not None:
            return f"weights: dummy (the {model.name} checkpoint loads on the GPU tier only; this is {self.tier})"
        return f"weights: dummy (the matrix names no checkpoint for {model.name})"


def mark_arguments(suite: str, *, id: str) -> tuple[str, str]:
    """The ``gate_matrix`` mark's signature."""
    return suite, id


def session_matrix(config: pytest.Config) -> Matrix:
    """The session's matrix (read once): ``--gate-matrix``/ini ``gate_matrix``, else the project's
    ``vramgate.toml``, else the built-in default; a bad file stops the run naming the file and field."""
    matrix = config.stash.get(_STASH, None)
    if matrix is None:
        file = config.getoption(MATRIX_OPTION, None) or config.getini(MATRIX_OPTION) or None
        try:
            matrix = project_matrix(config.rootpath, file)
        except MatrixError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[_STASH] = matrix
    return matrix


def session_machine(config: pytest.Config, tier: str) -> Callable[[], Machine]:
    """What the matrix's selection reads of this run's machine: the session's fingerprint (``--gate-hardware``
    applied, probed once per session, Note [GPUs a test uses] aside), read only when an entry needs it."""

    @functools.cache
    def machine() -> Machine:
        from vramgate.pytest_plugin.plugin import gate_session

        fp = gate_session(config).fingerprint
        return Machine(tier, fp.key, len(fp.gpus), fp.isa or "")

    return machine


def _values(case: MatrixCase, argnames: list[str]) -> dict[str, Any]:
    entry = case.entry
    every: dict[str, Any] = dict(
        model=entry.model.config, block_size=case.block_size, kv_cache_dtype=case.kv_cache_dtype,
        block_sizes=entry.block_size, kv_cache_dtypes=entry.kv_cache_dtype, dtype=entry.dtype, tp=entry.tp,
        quantization=entry.quantization, request_rate=case.request_rate, matrix_case=case,
    )
    return {name: every[name] for name in argnames}


def matrix_params(matrix: Matrix, suite: str, argnames: list[str], id_format: str, nodeid: str,
                  tier: str, root: Path, machine: Callable[[], Machine]) -> list[Any]:
    """The parameters (``pytest.param``) of a test that takes *argnames*, from *matrix*'s entries for *suite* on
    *machine* (its tier, hardware key and GPU count, read only when an entry needs them)."""
    params: list[Any] = []
    seen: dict[str, dict[str, Any]] = {}
    for entry in matrix.for_suite(suite):
        if collection_problem(entry, tier, machine) is not None:
            continue
        block_sizes = entry.block_size if "block_size" in argnames else entry.block_size[:1]
        kv_dtypes = entry.kv_cache_dtype if "kv_cache_dtype" in argnames else entry.kv_cache_dtype[:1]
        marks: list[Any] = [pytest.mark.gate_matrix_entry(entry)]
        if entry.nightly is not None:
            marks.append(pytest.mark.gate_nightly(entry.nightly))
        skip = gpu_count_problem(entry, machine()) if tier == "gpu" and entry.tp > 1 else None
        skip = skip or missing_trace(entry, root)
        if skip is not None:
            marks.append(pytest.mark.skip(reason=f"matrix entries[{entry.index}]: {skip}"))
        rates: tuple[float | None, ...] = (None,)
        if "request_rate" in argnames:
            if entry.load is None:
                raise pytest.UsageError(f"{nodeid} takes request_rate, but {matrix.source}: entries[{entry.index}] "
                                        "has no [entries.load]")
            rates = entry.load.request_rates
        for block_size, kv_dtype, rate in itertools.product(block_sizes, kv_dtypes, rates):
            case = MatrixCase(entry, block_size, kv_dtype, tier, rate)
            fields = dict(model=entry.model.name, block_size=block_size, kv_cache_dtype=kv_dtype, dtype=entry.dtype,
                          tp=entry.tp, quantization=entry.quantization or "none",
                          request_rate="none" if rate is None else "inf" if rate == float("inf") else f"{rate:g}")
            try:
                case_id = id_format.format(**fields)
            except (KeyError, IndexError, ValueError) as exc:
                raise pytest.UsageError(f"{nodeid}: gate_matrix id {id_format!r}: {exc!r}; names: "
                                        f"{', '.join(fields)}") from None
            values = _values(case, argnames)
            comparable = {k: v for k, v in values.items() if k != "matrix_case"}
            if case_id in seen:
                if seen[case_id] != comparable:
                    raise pytest.UsageError(f"{matrix.source}: entries[{entry.index}] gives {nodeid} a second case "
                                            f"with id {case_id!r} but other arguments ({comparable} vs "
                                            f"{seen[case_id]})")
                continue
            seen[case_id] = comparable
            params.append(pytest.param(*values.values(), id=case_id, marks=marks))
    return params


def parametrize_matrix(metafunc: pytest.Metafunc) -> None:
    """Parametrize a test marked ``gate_matrix`` (called from ``pytest_generate_tests``)."""
    mark = metafunc.definition.get_closest_marker("gate_matrix")
    if mark is None:
        return
    nodeid = metafunc.definition.nodeid
    try:
        suite, id_format = mark_arguments(*mark.args, **mark.kwargs)
    except TypeError as exc:
        raise pytest.UsageError(f"{nodeid}: bad arguments to marker gate_matrix: {exc}") from None
    argnames = [name for name in ARGUMENTS if name in metafunc.fixturenames]
    if "model" not in argnames:
        raise pytest.UsageError(f"{nodeid}: marked gate_matrix but takes no argument 'model'")
    tier = engine_tier()
    params = matrix_params(session_matrix(metafunc.config), suite, argnames, id_format, nodeid, tier,
                           metafunc.config.rootpath, session_machine(metafunc.config, tier))
    metafunc.parametrize(argnames, params)


def case_entry(item: pytest.Item) -> Entry | None:
    """The matrix entry of a ``gate_matrix`` case, or None."""
    mark = item.get_closest_marker("gate_matrix_entry")
    return mark.args[0] if mark is not None else None


def entry_inputs(item: pytest.Item) -> list[TestInput]:
    """A matrix case's input (Note [each test's inputs]): its entry, which a change keeps it for only when no
    entry of the matrix at the change's base is the same (its place in the file aside)."""
    entry = case_entry(item)
    if entry is None:
        return []
    matrix = session_matrix(item.config)
    root = item.config.rootpath
    default = matrix.source == DEFAULT_SOURCE
    if default:  # the built-in default: an input of the project only where the project is vramgate's source
        if not (root / DEFAULT_MATRIX).is_file():
            return []  # an installed vramgate's default: no change to the project can touch it
        path = root / DEFAULT_MATRIX
    else:
        path = Path(matrix.source)
    try:
        rel = (path if path.is_absolute() else root / path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return []  # a matrix outside the project: an installed vramgate's default, or a file the change cannot touch

    def same(entry: Entry) -> str:
        return repr(dataclasses.replace(entry, index=0))

    def unchanged(changes: ChangeSet) -> bool:
        text = changes.at_base(rel)
        if text is None:
            return False
        return same(entry) in {same(e) for e in parse_matrix(text, rel, root, undeclared=default).entries}

    return [TestInput(f"its matrix entry ({rel}: entries[{entry.index}])", (rel,), unchanged)]


def give_budgets(gate: Gate, budgets: tuple[Budget, ...], where: str) -> None:
    """Give *gate* the matrix entry's *budgets* before its test records (:meth:`Gate.budget`): each holds the
    metric of its name, when recorded, to its ceiling or floor; *where* names the entry in messages."""
    for budget in budgets:
        gate.budget(budget.metric, budget.op, budget.value, unit=budget.unit, text=budget.text, source=where)


def budgets_hook(item: pytest.Item) -> Generator[None, Any, Any]:
    """The body of the ``pytest_runtest_call`` wrapper: before the call, the weights note and the entry's budgets
    given to the test's gate (:func:`give_budgets`), which its metrics take as they are recorded; after it, the
    report section naming the budgets that applied."""
    entry = case_entry(item)
    if entry is None:
        return (yield)
    funcargs: dict[str, Any] = getattr(item, "funcargs", {})
    case = funcargs.get("matrix_case")
    where = f"{session_matrix(item.config).source}: entries[{entry.index}]"
    if isinstance(case, MatrixCase):
        item.add_report_section("call", "vramgate matrix", case.weights_note())
    recorder = funcargs.get("gate")
    if isinstance(recorder, Gate) and entry.budgets:
        give_budgets(recorder, entry.budgets, where)
    result = yield
    if isinstance(recorder, Gate) and recorder.budgets_applied:
        item.add_report_section("call", "vramgate matrix budgets", "\n".join(recorder.budgets_applied))
    return result

