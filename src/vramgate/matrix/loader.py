"""The declared matrix: which suites run which model, how, on which machines, under which budgets.

A matrix is a TOML file (the project's ``vramgate.toml``; see ``docs/matrix.md``)::

    [models.llama-3-1-8b]             # config: a folder under fixtures/models (default: the name)
    config = "llama-3.1-8b"
    checkpoint = "/models/llama-3.1-8b"  # optional: real weights, loaded on the GPU tier

    [workloads.team]
    trace = "sharegpt-team"           # a saved trace under fixtures/workloads, or builtin = "sharegpt"

    [[entries]]
    suites = ["capacity", "latency"]
    model = "llama-3-1-8b"
    tier = "gpu"
    gpu = "h100"
    tp = 1
    block_size = [16]
    workload = "team"
    [entries.budgets]
    capacity_tokens = ">= 400000"

:func:`load_matrix` reads and validates one; every error is a :class:`MatrixError` that names the file and
the field (``vramgate.toml: entries[2].blok_size: unknown field; did you mean block_size?``).

Longer than 400 lines: one reader (:class:`_Reader`) checks every table of the file, models, workloads, entries,
their budgets and serving configurations, so that each error names the file and the field the same way.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.machine.isa import ISAError, class_selector
from vramgate.matrix.suites import suite_rules
from vramgate.models.config import available_models
from vramgate.workloads import GENERATORS

#: The entry fields only an engine run uses (an entry of KV-only suites alone that set one would have it ignored).
ENGINE_FIELDS = ("tp", "dtype", "quantization", "workload")
#: vLLM 0.32.0's ``CUDAGraphMode`` names a serving configuration may give.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: The engine tiers an entry may name.
TIERS = ("cpu", "gpu")
#: The file a project's matrix lives in, at its root.
MATRIX_FILE = "vramgate.toml"

_BYTE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER_AND_UNIT = r"([0-9][0-9_,]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$"
_BUDGET = re.compile(r"^\s*(<=|>=)\s*" + _NUMBER_AND_UNIT)
#: What a memory slope's budget may say after its amount: per 1,000 requests, or per 1,000 output tokens.
_PER_1K = re.compile(r"\s+per\s+1[,_]?000\s+(requests|tokens)\s*$")
#: The slope metrics a budget may name, and what they are per.
_SLOPES = {"memory_slope": "requests", "device_memory_slope": "requests", "memory_slope_difference": "requests",
           "memory_slope_per_token": "tokens"}
_AMOUNT = re.compile(r"^\s*" + _NUMBER_AND_UNIT)


class MatrixError(ValueError):
    """A matrix file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Model:
    """A model of the matrix: a config folder under ``fixtures/models`` and, optionally, real weights."""

    name: str
    config: str
    checkpoint: str | None = None
    """A local folder of real weights (loaded offline on the GPU tier); None: dummy weights."""


@dataclass(frozen=True)
class Workload:
    """A workload of the matrix: a built-in generator with its parameters, or a saved trace by name."""

    name: str
    builtin: str | None = None
    trace: str | None = None
    """A saved workload under ``fixtures/workloads`` (``vramgate trace import`` writes them), by name."""
    params: dict[str, Any] = field(default_factory=dict)
    requests: int | None = None
    seed: int | None = None
    arrival_rate: float | None = None

    @property
    def engine_name(self) -> str:
        """The name an engine spec's ``workload`` takes: the generator's or the trace's."""
        return self.builtin or self.trace or ""


@dataclass(frozen=True)
class Budget:
    """An entry's bound on one recorded metric: ``<= value`` (a ceiling) or ``>= value`` (a floor)."""

    metric: str
    op: str
    value: float
    """In the metric's base unit (bytes, seconds) when :attr:`unit` is set, else as written."""
    unit: str | None = None
    """``B`` or ``s`` when the budget was written with a byte or time unit; None for a plain number."""
    text: str = ""

    def describe(self) -> str:
        """The budget as written: ``peak_gpu_bytes <= 74 GiB``."""
        return f"{self.metric} {self.text}"


@dataclass(frozen=True)
class Serving:
    """An entry's serving configuration: how the team starts vLLM, so that vLLM sizes the KV cache itself (no
    ``kv_cache_memory_bytes``; Note [automatic KV] in :mod:`vramgate.engine.memory_decision`)."""

    gpu_memory_utilization: float | None = None
    """vLLM's ``gpu_memory_utilization`` on the GPU tier (e.g. 0.90)."""
    cpu_memory: int | None = None
    """Bytes the CPU worker requests (the CPU tier's reading of the same knob, made portable across machines)."""
    enforce_eager: bool = False
    """False (vLLM's default): CUDA graphs are captured (on CPU: the model is compiled)."""
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def describe(self) -> str:
        """One line: the serving configuration."""
        parts = []
        if self.gpu_memory_utilization is not None:
            parts.append(f"gpu_memory_utilization {self.gpu_memory_utilization:g}")
        if self.cpu_memory is not None:
            parts.append(f"cpu_memory {self.cpu_memory / 2**30:g} GiB")
        parts.append("eager" if self.enforce_eager else "cuda graphs" + (f" {self.cudagraph_mode}"
                                                                         if self.cudagraph_mode else ""))
        parts.append(f"max_model_len {self.max_model_len}")
        return ", ".join(parts)


@dataclass(frozen=True)
class ServingLoad:
    """An entry's load on vLLM's server (``[entries.load]``): what vLLM's benchmark client sends, and the SLOs its
    goodput counts (docs/online-serving.md)."""

    request_rates: tuple[float, ...]
    """Requests per second, a case each (``inf``: all at once)."""
    num_prompts: int = 40
    input_len: int = 64
    output_len: int = 32
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: tuple[tuple[str, float], ...] = ()
    """SLOs by the client's names (``ttft``, ``tpot``, ``e2el``), in seconds."""
    sustained_requests: int = 400
    """Requests of the sustained load whose memory slope is gated."""
    sustained_concurrency: int = 8
    paired_rounds: int = 20
    paired_requests: int = 32
    paired_concurrency: int = 8
    soak_requests: int = 3000
    """Requests of the nightly soak: the sustained load, longer, which sets the lower leak floor."""

    def describe(self) -> str:
        """One line: the load."""
        rates = ", ".join("all at once" if r == float("inf") else f"{r:g}" for r in self.request_rates)
        slo = "; SLO " + ", ".join(f"{k} {v * 1e3:g} ms" for k, v in self.slo) if self.slo else ""
        return f"{self.num_prompts} requests of {self.input_len}+{self.output_len} tokens at {rates} req/s{slo}"


@dataclass(frozen=True)
class Entry:
    """One ``[[entries]]`` table: the suites that run one model, where, how, and the budgets they meet."""

    index: int
    suites: tuple[str, ...]
    model: Model
    tier: str | None = None
    """``cpu`` or ``gpu``; None: every tier."""
    gpu: str | None = None
    """A GPU class (``h100``) that the hardware key must contain; None: any machine of the tier."""
    tp: int = 1
    dtype: str = "bfloat16"
    kv_cache_dtype: tuple[str, ...] = ("auto",)
    block_size: tuple[int, ...] = (16,)
    quantization: str | None = None
    workload: Workload | None = None
    nightly: str | None = None
    """Why this entry runs in the full gate only (the ``gate_nightly`` mark's reason); None: every run."""
    budgets: tuple[Budget, ...] = ()
    serving: Serving | None = None
    load: ServingLoad | None = None
    cpu_isa: str | None = None
    """``amx``: CPUs whose ISA class in force has at least that class's features; ``not amx``: those below it
    (another architecture is below every x86 class); None: any CPU (Note [matrix selection])."""

    def describe(self) -> str:
        """One line: what the entry runs."""
        parts = [f"{self.model.name}", f"suites {','.join(self.suites)}", f"tier {self.tier or 'any'}"]
        if self.gpu:
            parts.append(f"gpu {self.gpu}")
        if self.cpu_isa:
            parts.append(f"cpu_isa {self.cpu_isa}")
        parts += [f"tp {self.tp}", f"bs {','.join(map(str, self.block_size))}",
                  f"kv {','.join(self.kv_cache_dtype)}"]
        if self.quantization:
            parts.append(f"quant {self.quantization}")
        if self.workload:
            parts.append(f"workload {self.workload.name}")
        if self.serving:
            parts.append(f"serving ({self.serving.describe()})")
        if self.load:
            parts.append(f"load ({self.load.describe()})")
        if self.budgets:
            parts.append("budgets " + "; ".join(b.describe() for b in self.budgets))
        return ", ".join(parts)


@dataclass(frozen=True)
class Matrix:
    """A whole matrix: its models, workloads and entries (in the file's order), and where it came from."""

    source: str
    models: dict[str, Model]
    workloads: dict[str, Workload]
    entries: tuple[Entry, ...]

    def for_suite(self, suite: str) -> list[Entry]:
        """The entries that name *suite*, in order."""
        return [e for e in self.entries if suite in e.suites]


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else f"; accepted: {', '.join(choices)}"


class _Reader:
    """Checks the fields of one table, each error naming the file and the field."""

    def __init__(self, source: str, where: str, table: object, fields: tuple[str, ...]) -> None:
        self.source, self.where = source, where
        self.prefix = f"{where}." if where else ""
        if not isinstance(table, dict):
            raise MatrixError(f"{source}: {where}: must be a table, got {type(table).__name__}")
        self.table: dict[str, Any] = table
        for key in table:
            if key not in fields:
                raise MatrixError(f"{source}: {self.prefix}{key}: unknown field{_suggest(key, fields)}")

    def fail(self, key: str, message: str) -> MatrixError:
        """The error for field *key*."""
        return MatrixError(f"{self.source}: {self.prefix}{key}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False) -> Any:
        """Field *key*, checked to be a *kind* (bools are not numbers)."""
        if key not in self.table:
            if required:
                raise MatrixError(f"{self.source}: {self.prefix}{key}: missing field")
            return default
        value = self.table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(key, f"must be {names}, got {type(value).__name__} {value!r}")
        return value

    def items(self, key: str, kind: type, default: tuple[Any, ...]) -> tuple[Any, ...]:
        """Field *key* as a tuple: one *kind* or a non-empty list of them."""
        value = self.get(key, (kind, list), None)
        if value is None:
            return default
        values = value if isinstance(value, list) else [value]
        if not values:
            raise self.fail(key, "must not be empty")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, kind):
                raise self.fail(key, f"must be {kind.__name__} or a list of them, got {type(v).__name__} {v!r}")
        if len(set(values)) != len(values):
            raise self.fail(key, f"lists a value twice: {values}")
        return tuple(values)


def parse_budget(source: str, where: str, metric: str, text: object) -> Budget:
    """The budget ``<= 74 GiB`` / ``>= 400000`` / ``<= 250 ms`` on *metric*; :class:`MatrixError` naming
    *where* when it is not one."""
    if not isinstance(text, str):
        raise MatrixError(f"{source}: {where}.{metric}: must be a string like \"<= 74 GiB\" or \">= 400000\", "
                          f"got {type(text).__name__} {text!r}")
    per = _PER_1K.search(text) if metric in _SLOPES else None
    if per is not None and per.group(1) != _SLOPES[metric]:
        raise MatrixError(f"{source}: {where}.{metric}: {text!r}: this slope is per 1000 {_SLOPES[metric]}, not "
                          f"per 1000 {per.group(1)}")
    m = _BUDGET.match(_PER_1K.sub("", text) if metric in _SLOPES else text)
    if m is None:
        raise MatrixError(f"{source}: {where}.{metric}: {text!r} is not a budget; write \"<= NUMBER [UNIT]\" or "
                          f"\">= NUMBER [UNIT]\"")
    value, base = _amount(source, f"{where}.{metric}", m.group(2), m.group(3))
    if metric in _SLOPES and base == "B":
        base = f"B/1k {_SLOPES[metric]}"  # the slope's unit: bytes per 1,000 requests (tokens)
    return Budget(metric, m.group(1), value, base, text.strip())


def _amount(source: str, where: str, number: str, unit: str) -> tuple[float, str | None]:
    """*number* *unit* in its base unit (bytes, seconds) and that unit (None for a plain number)."""
    value = float(number.replace("_", "").replace(",", ""))
    if not unit:
        return value, None
    if unit in _BYTE_UNITS:
        return value * _BYTE_UNITS[unit], "B"
    if unit in _TIME_UNITS:
        return value * _TIME_UNITS[unit], "s"
    units = (*_BYTE_UNITS, *_TIME_UNITS)
    raise MatrixError(f"{source}: {where}: unknown unit {unit!r}{_suggest(unit, units)}")


def _model(source: str, name: str, table: object, configs: list[str] | None) -> Model:
    r = _Reader(source, f"models.{name}", table, ("config", "checkpoint"))
    config = r.get("config", str, name)
    if configs is not None and config not in configs:
        raise r.fail("config", f"no folder {config!r} under fixtures/models{_suggest(config, configs)}")
    return Model(name, config, r.get("checkpoint", str))


def _workload(source: str, name: str, table: object) -> Workload:
    r = _Reader(source, f"workloads.{name}", table,
                ("builtin", "trace", "params", "requests", "seed", "arrival_rate"))
    builtin, trace = r.get("builtin", str), r.get("trace", str)
    if (builtin is None) == (trace is None):
        raise MatrixError(f"{source}: workloads.{name}: give one of builtin (a generator: "
                          f"{', '.join(GENERATORS)}) or trace (a saved trace's name)")
    if builtin is not None and builtin not in GENERATORS:
        raise r.fail("builtin", f"unknown generator {builtin!r}{_suggest(builtin, tuple(GENERATORS))}")
    if trace is not None and r.table.get("params"):
        raise r.fail("params", "a trace takes no generator parameters")
    requests = r.get("requests", int)
    if requests is not None and requests < 1:
        raise r.fail("requests", f"must be >= 1, got {requests}")
    rate = r.get("arrival_rate", (int, float))
    if rate is not None and not rate > 0:
        raise r.fail("arrival_rate", f"must be a positive number of requests per second, got {rate}")
    return Workload(name, builtin, trace, dict(r.get("params", dict, {})), requests, r.get("seed", int),
                    None if rate is None else float(rate))


ENTRY_FIELDS = ("suites", "model", "tier", "gpu", "cpu_isa", "tp", "dtype", "kv_cache_dtype", "block_size",
                "quantization", "workload", "nightly", "budgets", "serving", "load")
SERVING_FIELDS = ("gpu_memory_utilization", "cpu_memory", "enforce_eager", "cudagraph_mode", "cudagraph_capture_sizes",
                  "max_model_len", "max_num_seqs", "max_num_batched_tokens")


def _serving(source: str, where: str, table: object, tier: str | None) -> Serving:
    r = _Reader(source, f"{where}.serving", table, SERVING_FIELDS)
    util = r.get("gpu_memory_utilization", (int, float))
    if util is not None and not 0 < util <= 1:
        raise r.fail("gpu_memory_utilization", f"must be a fraction in (0, 1], got {util}")
    cpu_text = r.get("cpu_memory", str)
    cpu_memory = None
    if cpu_text is not None:
        m = _AMOUNT.match(cpu_text)
        value, unit = _amount(source, f"{where}.serving.cpu_memory", *m.groups()) if m else (0.0, None)
        if unit != "B" or not value >= 1 << 20:
            raise r.fail("cpu_memory", f"must be an amount of memory of at least 1 MiB, like \"4 GiB\", got "
                                       f"{cpu_text!r}")
        cpu_memory = int(value)
    if tier in (None, "gpu") and util is None:
        raise r.fail("gpu_memory_utilization", f"missing field: the {tier or 'gpu (and every)'} tier sizes the KV "
                                               "cache at the team's utilization, e.g. 0.90")
    if tier in (None, "cpu") and cpu_memory is None:
        raise r.fail("cpu_memory", f"missing field: the {tier or 'cpu (and every)'} tier requests this much memory "
                                   "for vLLM's CPU worker, e.g. \"2 GiB\"")
    mode = r.get("cudagraph_mode", str)
    if mode is not None and mode not in CUDAGRAPH_MODES:
        raise r.fail("cudagraph_mode", f"unknown mode {mode!r}{_suggest(mode, CUDAGRAPH_MODES)}")
    sizes = r.items("cudagraph_capture_sizes", int, ()) or None
    if sizes is not None and any(n < 1 for n in sizes):
        raise r.fail("cudagraph_capture_sizes", f"must be positive batch sizes, got {list(sizes)}")
    ints = {}
    for name, default in (("max_model_len", 2048), ("max_num_seqs", 64), ("max_num_batched_tokens", 2048)):
        ints[name] = r.get(name, int, default)
        if ints[name] < 1:
            raise r.fail(name, f"must be >= 1, got {ints[name]}")
    return Serving(None if util is None else float(util), cpu_memory, r.get("enforce_eager", bool, False), mode,
                   sizes, **ints)


LOAD_FIELDS = ("request_rates", "num_prompts", "input_len", "output_len", "burstiness", "max_concurrency", "slo",
               "sustained_requests", "sustained_concurrency", "paired_rounds", "paired_requests", "paired_concurrency",
               "soak_requests")
#: The SLOs vLLM's benchmark client counts goodput by (its ``--goodput`` names).
SLO_NAMES = ("ttft", "tpot", "e2el")


def _load(source: str, where: str, table: object) -> ServingLoad:
    r = _Reader(source, f"{where}.load", table, LOAD_FIELDS)
    raw = r.table.get("request_rates")
    if not isinstance(raw, list) or not raw:
        raise r.fail("request_rates", "missing field: a list of request rates in requests per second, like "
                                      "[4, 16] (\"inf\": all at once)")
    rates = []
    for value in raw:
        rate = float("inf") if value == "inf" else value
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
            raise r.fail("request_rates", f"must be positive numbers of requests per second or \"inf\", got "
                                          f"{value!r}")
        rates.append(float(rate))
    ints = {}
    for name, default, least in (("num_prompts", 40, 8), ("input_len", 64, 1), ("output_len", 32, 2),
                                 ("sustained_requests", 400, 40), ("sustained_concurrency", 8, 1),
                                 ("paired_rounds", 20, 4), ("paired_requests", 32, 8), ("paired_concurrency", 8, 1),
                                 ("soak_requests", 3000, 400)):
        ints[name] = r.get(name, int, default)
        if ints[name] < least:
            raise r.fail(name, f"must be >= {least}, got {ints[name]}")
    burstiness = r.get("burstiness", (int, float), 1.0)
    if not burstiness > 0:
        raise r.fail("burstiness", f"must be positive (1: Poisson arrivals), got {burstiness}")
    concurrency = r.get("max_concurrency", int)
    if concurrency is not None and concurrency < 1:
        raise r.fail("max_concurrency", f"must be >= 1, got {concurrency}")
    slo = []
    for name, text in sorted(r.get("slo", dict, {}).items()):
        if name not in SLO_NAMES:
            raise r.fail("slo", f"unknown SLO {name!r}{_suggest(name, SLO_NAMES)}")
        m = _AMOUNT.match(text) if isinstance(text, str) else None
        value, unit = _amount(source, f"{where}.load.slo.{name}", *m.groups()) if m else (0.0, None)
        if unit != "s" or not value > 0:
            raise r.fail("slo", f"{name} must be a positive time like \"250 ms\", got {text!r}")
        slo.append((name, value))
    return ServingLoad(tuple(rates), ints["num_prompts"], ints["input_len"], ints["output_len"], float(burstiness),
                       concurrency, tuple(slo), ints["sustained_requests"], ints["sustained_concurrency"],
                       ints["paired_rounds"], ints["paired_requests"], ints["paired_concurrency"],
                       soak_requests=ints["soak_requests"])


def _table_for_suites(r: _Reader, key: str, given: bool, suites: tuple[str, ...], needing: frozenset[str],
                      needs: str, does: str) -> None:
    """A table (``[entries.KEY]``) is there exactly when a suite of the entry (one of *needing*) uses it."""
    which = sorted(set(suites) & needing)
    if which and not given:
        raise r.fail(key, f"missing table: the {', '.join(which)} suite {needs}")
    if given and not which:
        raise r.fail(key, f"no suite of this entry {does} (those that do: {', '.join(sorted(needing))})")


def _entry(source: str, index: int, table: object, models: dict[str, Model],
           workloads: dict[str, Workload], undeclared: bool) -> Entry | None:
    where = f"entries[{index}]"
    r = _Reader(source, where, table, ENTRY_FIELDS)
    suites = r.items("suites", str, ())
    if not suites:
        raise MatrixError(f"{source}: {where}.suites: missing field")
    known = suite_rules()  # Note [matrix suites]
    if undeclared and not set(suites) <= set(known):
        return None
    names = tuple(known) or ("(none registered)",)
    for s in suites:
        if s not in known:
            raise r.fail("suites", f"unknown suite {s!r}{_suggest(s, names)}")
    rules = [known[s] for s in suites]
    if all(rule.kv_only for rule in rules):
        for key in ENGINE_FIELDS:
            if key in r.table:
                raise r.fail(key, f"the {', '.join(suites)} suite does not use it (vLLM's KV accounting starts no "
                                  "engine): leave it out, or add an engine suite (capacity, latency) to the entry")
    model = r.get("model", str, required=True)
    if model not in models:
        raise r.fail("model", f"no [models.{model}] in this file{_suggest(model, tuple(models) or ('(none)',))}")
    tier = r.get("tier", str)
    if tier is not None and tier not in TIERS:
        raise r.fail("tier", f"unknown tier {tier!r}; accepted: {', '.join(TIERS)}")
    gpu = r.get("gpu", str)
    if gpu is not None and tier == "cpu":
        raise r.fail("gpu", f"a GPU class ({gpu!r}) on the cpu tier")
    cpu_isa = r.get("cpu_isa", str)
    if cpu_isa is not None:
        if tier != "cpu":
            raise r.fail("cpu_isa", f"an ISA class ({cpu_isa!r}) needs tier = \"cpu\"")
        try:
            class_selector(cpu_isa)
        except ISAError as exc:
            raise r.fail("cpu_isa", str(exc)) from None
    tp = r.get("tp", int, 1)
    if tp < 1:
        raise r.fail("tp", f"must be >= 1, got {tp}")
    block_size = r.items("block_size", int, (16,))
    if any(b < 1 for b in block_size):
        raise r.fail("block_size", f"must be positive, got {list(block_size)}")
    for rule in rules:
        if rule.one_block_size and len(block_size) > 1:
            raise r.fail("block_size", f"the {rule.name} suite runs one block size per entry (its cases are named "
                                       f"by the model), got {list(block_size)}: give one, or an entry of its own "
                                       "for the others")
    workload = r.get("workload", str)
    if workload is not None and workload not in workloads:
        raise r.fail("workload",
                     f"no [workloads.{workload}] in this file{_suggest(workload, tuple(workloads) or ('(none)',))}")
    serving_table = r.get("serving", dict)
    serving = None if serving_table is None else _serving(source, where, serving_table, tier)
    _table_for_suites(r, "serving", serving is not None, suites, frozenset(n for n, q in known.items() if q.serving),
                      "runs the team's serving "
                      "configuration ([entries.serving] with gpu_memory_utilization / cpu_memory)",
                      "runs a serving configuration")
    load_table = r.get("load", dict)
    load = None if load_table is None else _load(source, where, load_table)
    _table_for_suites(r, "load", load is not None, suites, frozenset(n for n, q in known.items() if q.load),
                      "puts the team's load on vLLM's server "
                      "([entries.load] with request_rates)", "puts a load on a server")
    budgets_table = r.get("budgets", dict, {})
    budgets = tuple(parse_budget(source, f"{where}.budgets", k, v) for k, v in budgets_table.items())
    recorded = sorted({m for rule in rules for m in rule.metrics})
    for budget in budgets:
        if budget.metric not in recorded:
            raise MatrixError(f"{source}: {where}.budgets.{budget.metric}: no suite of this entry records a metric of "
                              f"that name{_suggest(budget.metric, recorded)} (they record: {', '.join(recorded)})")
    return Entry(index, suites, models[model], tier, gpu, tp, r.get("dtype", str, "bfloat16"),
                 r.items("kv_cache_dtype", str, ("auto",)), block_size, r.get("quantization", str),
                 None if workload is None else workloads[workload], r.get("nightly", str), budgets, serving, load,
                 cpu_isa)


def parse_matrix(text: str, source: str, root: Path | None = None, *, undeclared: bool = False) -> Matrix:
    """The matrix in TOML *text* (from *source*, named in errors); model configs are checked against
    ``<root>/fixtures/models`` when *root* is given. A suite no one declared (Note [matrix suites]) is an error,
    or with *undeclared* leaves its entries out of the matrix (the others keep their index): the built-in default
    names the repository's suites, which a project may not have."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{source}: not valid TOML: {exc}") from None
    top = _Reader(source, "", data, ("models", "workloads", "entries"))
    configs = available_models(root) if root is not None else None
    models_table = top.get("models", dict, {})
    models = {name: _model(source, name, t, configs) for name, t in models_table.items()}
    workloads = {name: _workload(source, name, t) for name, t in top.get("workloads", dict, {}).items()}
    entries = top.get("entries", list, [])
    read = (_entry(source, i, t, models, workloads, undeclared) for i, t in enumerate(entries))
    return Matrix(source, models, workloads, tuple(e for e in read if e is not None))


def load_matrix(path: Path, root: Path | None = None) -> Matrix:
    """The matrix in the file *path* (see :func:`parse_matrix`); errors name it relative to *root* when under it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"{path}: cannot read the matrix: {exc.strerror or exc}") from None
    source = str(path)
    if root is not None and path.resolve().is_relative_to(root.resolve()):
        source = str(path.resolve().relative_to(root.resolve()))
    return parse_matrix(text, source, root)
