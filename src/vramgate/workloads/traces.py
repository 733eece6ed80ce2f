"""Request traces from local files, imported into seeded workloads.

Three formats, each read from a local file (nothing is downloaded):

``sharegpt``  A JSON list of conversations, as ShareGPT dumps hold them:
              ``[{"id": ..., "conversations": [{"from": "human", "value": "..."},
              {"from": "gpt", "value": "..."}, ...]}, ...]``. Every prompt turn (``from``
              ``human`` or ``user``) that the next turn answers (``gpt``, ``assistant`` or
              ``chatgpt``) is one request: the prompt turn's length in, the answer's out. Each pair
              stands alone (the earlier turns of the conversation are not added to the prompt);
              vLLM's own ShareGPT sampler takes only the first pair of each conversation. Other
              turns (``system``, an unanswered prompt) make no request.
``jsonl``     The JSONL file vLLM's benchmarks read as a custom dataset (``CustomDataset`` in
              ``vllm/benchmarks/datasets/datasets.py`` of vLLM 0.32; ``benchmarks/benchmark_dataset.py``
              in older releases): one JSON object per line with ``"prompt"`` (text) and optionally
              ``"output_tokens"`` (vLLM's name) or ``"output_len"``. Blank lines are skipped.
``csv``       A CSV file with a header line naming the columns ``input_len`` and ``output_len``
              (tokens) and optionally ``arrival_s`` (seconds); other columns are ignored, header
              names are matched without case or surrounding spaces.

Token counts. Nothing here has a tokenizer (the engines run dummy weights offline), so a text's
length is estimated: its whitespace-separated words times ``tokens_per_word`` (default 1.3, about
what BPE tokenizers of English give), rounded to the nearest integer, at least 1
(:func:`estimate_tokens`). Exact counts in the file win over the estimate: a turn's ``"num_tokens"``
(ShareGPT), a record's ``"prompt_len"`` (JSONL; then ``"prompt"`` may be absent), and the lengths
of a CSV, which are counts already. A JSONL record without an output length takes ``output_len``
from the caller, or is an error.

Arrivals. A CSV with an ``arrival_s`` column keeps its times as the requests' ``arrival_s``
(the workload's ``arrivals`` is ``trace``), shifted so that the earliest request arrives at 0;
the other formats give offline arrivals (all at 0).

Options, applied in this order: requests longer than ``max_model_len`` (prompt plus output) are
dropped (``too_long="drop"``, the default, as vLLM's benchmark samplers skip them) or clipped
(``"clip"``: the prompt keeps at most ``max_model_len - 1`` tokens, the output what is left);
then ``requests=N`` keeps a seeded sample of N of them (``random.Random(seed)``), in file order
(a sample of a trace with arrival times keeps their times, so it thins the traffic). The
workload's seed is ``seed`` too, so its prompt tokens are the same on every run.

Errors are :class:`~vramgate.workloads.WorkloadError` naming the file, the line (JSONL, CSV) or
the record and turn (ShareGPT, as 0-based list indexes) and the field.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vramgate.core.metrics import percentiles
from vramgate.core.records import parse_json
from vramgate.store.files import atomic_write_text
from vramgate.workloads import GENERATORS, RequestSpec, Workload, WorkloadError, workloads_dir

#: The trace formats :func:`import_trace` reads.
FORMATS = ("sharegpt", "jsonl", "csv")
#: What a trace does with a request longer than ``max_model_len``.
TOO_LONG = ("drop", "clip")
#: Tokens per whitespace-separated word of text when the file has no token counts.
DEFAULT_TOKENS_PER_WORD = 1.3
#: The format a file's extension names (:func:`guess_format`).
EXTENSIONS = {".json": "sharegpt", ".jsonl": "jsonl", ".csv": "csv"}
#: ShareGPT turn roles: a prompt, and an answer to the prompt before it.
PROMPT_ROLES = ("human", "user")
ANSWER_ROLES = ("gpt", "assistant", "chatgpt")
#: CSV columns: the two lengths (required) and the arrival time (optional).
CSV_COLUMNS = ("input_len", "output_len")
CSV_ARRIVAL = "arrival_s"
#: A saved workload's name: a file name without folders.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class LengthStats:
    """Mean, median, p90, p99 and maximum of request lengths in tokens (percentiles interpolated)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, lengths: Sequence[int]) -> LengthStats:
        """The statistics of *lengths* (at least one)."""
        p = percentiles([float(n) for n in lengths])
        return cls(mean=p["mean"], p50=p["p50"], p90=p["p90"], p99=p["p99"], max=max(lengths))


@dataclass(frozen=True)
class TraceSummary:
    """What an import read and kept: counts, length statistics and the span of the arrival times."""

    source: str
    format: str
    read: int
    dropped: int
    clipped: int
    count: int
    prompt: LengthStats
    output: LengthStats
    arrivals: str
    arrivals_span_s: float

    def lines(self) -> list[str]:
        """The summary as the ``trace import`` command prints it."""
        changed = []
        if self.dropped:
            changed.append(f"{self.dropped} dropped as too long")
        if self.clipped:
            changed.append(f"{self.clipped} clipped to fit")
        if self.count < self.read - self.dropped:
            changed.append(f"{self.count} sampled")
        note = f"; {', '.join(changed)}" if changed else ""
        out = [f"{self.count} requests from {self.source} ({self.format}: {self.read} read{note})",
               f"{'tokens':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>8}"]
        for label, s in (("prompt", self.prompt), ("output", self.output)):
            out.append(f"{label:<8}{s.mean:>10.1f}{s.p50:>10.1f}{s.p90:>10.1f}{s.p99:>10.1f}{s.max:>8}")
        if self.arrivals == "trace":
            out.append(f"arrivals: the trace's times, spanning {self.arrivals_span_s:g} s")
        else:
            out.append("arrivals: offline (all at t=0)")
        return out


def estimate_tokens(text: str, tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> int:
    """The estimated token count of *text*: whitespace-separated words times *tokens_per_word*, rounded to the
    nearest integer (halves up), at least 1."""
    return max(1, math.floor(len(text.split()) * tokens_per_word + 0.5))


def guess_format(path: Path) -> str:
    """The format *path*'s extension names (``.json`` ShareGPT, ``.jsonl``, ``.csv``); :class:`WorkloadError`
    for another extension."""
    fmt = EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise WorkloadError(f"{path}: cannot tell the trace format from the extension {path.suffix!r}; "
                            f"name it ({', '.join(FORMATS)}) or use one of {', '.join(EXTENSIONS)}")
    return fmt


def _count(value: Any, where: str, field: str) -> int:
    """A token count from a JSON or CSV field: an integer >= 1 (a string of digits too, as vLLM reads it)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise WorkloadError(f"{where}: field {field!r}: expected a whole number of tokens, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise WorkloadError(f"{where}: field {field!r}: expected a whole number of tokens, got {value!r}") from None
    if n < 1:
        raise WorkloadError(f"{where}: field {field!r}: must be >= 1 token, got {n}")
    return n


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise WorkloadError(f"{where}: field {field!r}: expected text, got {type(value).__name__}")
    return value


def _read_sharegpt(path: Path, text: str, tokens_per_word: float) -> list[RequestSpec]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:  # the file's line first: a ShareGPT file is one long JSON document
        raise WorkloadError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    out = []
    for i, record in enumerate(data):
        where = f"{path} record [{i}]"
        if not isinstance(record, dict):
            raise WorkloadError(f"{where}: expected an object with 'conversations', got {type(record).__name__}")
        if "id" in record:
            where += f" (id {record['id']!r})"
        turns = record.get("conversations")
        if not isinstance(turns, list):
            what = "missing" if turns is None else f"expected a list of turns, got {type(turns).__name__}"
            raise WorkloadError(f"{where}: field 'conversations': {what}")
        lengths: list[tuple[str, int]] = []
        for j, turn in enumerate(turns):
            at = f"{where} turn [{j}]"
            if not isinstance(turn, dict):
                raise WorkloadError(f"{at}: expected an object with 'from' and 'value', got {type(turn).__name__}")
            role = _text(turn.get("from"), at, "from")
            if "num_tokens" in turn:
                n = _count(turn["num_tokens"], at, "num_tokens")
            else:
                n = estimate_tokens(_text(turn.get("value"), at, "value"), tokens_per_word)
            lengths.append((role, n))
        for (role, n), (next_role, m) in itertools.pairwise(lengths):
            if role in PROMPT_ROLES and next_role in ANSWER_ROLES:
                out.append(RequestSpec(n, m))
    return out


def _read_jsonl(path: Path, text: str, tokens_per_word: float, output_len: int | None) -> list[RequestSpec]:
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        record = parse_json(line, WorkloadError, where)
        if not isinstance(record, dict):
            raise WorkloadError(f"{where}: expected a JSON object with 'prompt', got {type(record).__name__}")
        if "prompt_len" in record:
            prompt = _count(record["prompt_len"], where, "prompt_len")
        elif "prompt" in record:
            prompt = estimate_tokens(_text(record["prompt"], where, "prompt"), tokens_per_word)
        else:
            raise WorkloadError(f"{where}: field 'prompt': missing (need the prompt text, or 'prompt_len')")
        for field in ("output_tokens", "output_len"):
            if field in record:
                output = _count(record[field], where, field)
                break
        else:
            if output_len is None:
                raise WorkloadError(f"{where}: field 'output_tokens': missing (or 'output_len'; or pass an output "
                                    "length for records without one)")
            output = output_len
        out.append(RequestSpec(prompt, output))
    return out


def _arrival(value: str, where: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise WorkloadError(f"{where}: field {CSV_ARRIVAL!r}: expected seconds, got {value!r}") from None
    if not math.isfinite(t) or t < 0:
        raise WorkloadError(f"{where}: field {CSV_ARRIVAL!r}: must be finite and >= 0, got {value!r}")
    return t


def _read_csv(path: Path, text: str) -> tuple[list[RequestSpec], bool]:
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [h.strip().lower() for h in next(reader)]
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise WorkloadError(f"{path} line 1: the header has no column {missing[0]!r} (need {', '.join(CSV_COLUMNS)}"
                            f", optional {CSV_ARRIVAL}; found {', '.join(header) or 'nothing'})")
    columns = {name: header.index(name) for name in (*CSV_COLUMNS, CSV_ARRIVAL) if name in header}
    timed = CSV_ARRIVAL in columns
    out = []
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        where = f"{path} line {reader.line_num}"
        cells: dict[str, str] = {}
        for name, index in columns.items():
            if index >= len(row) or not row[index].strip():
                raise WorkloadError(f"{where}: field {name!r}: missing")
            cells[name] = row[index].strip()
        out.append(RequestSpec(_count(cells["input_len"], where, "input_len"),
                               _count(cells["output_len"], where, "output_len"),
                               arrival_s=_arrival(cells[CSV_ARRIVAL], where) if timed else 0.0))
    return out, timed


def read_trace(
    path: Path, fmt: str | None = None, *, tokens_per_word: float = DEFAULT_TOKENS_PER_WORD,
    output_len: int | None = None,
) -> tuple[list[RequestSpec], bool]:
    """Every request of the trace file *path* in format *fmt* (guessed from the extension when None), and whether
    they carry the trace's arrival times; see the module docs for the formats and the token counts."""
    fmt = fmt or guess_format(path)
    if fmt not in FORMATS:
        raise WorkloadError(f"unknown trace format {fmt!r}; accepted: {', '.join(FORMATS)}")
    if not (tokens_per_word > 0 and math.isfinite(tokens_per_word)):
        raise WorkloadError(f"tokens per word must be a positive number, got {tokens_per_word}")
    if output_len is not None and output_len < 1:
        raise WorkloadError(f"output length must be >= 1 token, got {output_len}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise WorkloadError(f"{path}: empty file: no requests")
    if fmt == "sharegpt":
        requests, timed = _read_sharegpt(path, text, tokens_per_word), False
    elif fmt == "jsonl":
        requests, timed = _read_jsonl(path, text, tokens_per_word, output_len), False
    else:
        requests, timed = _read_csv(path, text)
    if not requests:
        raise WorkloadError(f"{path}: no requests in the file ({fmt})")
    return requests, timed


def _fit(request: RequestSpec, max_model_len: int) -> RequestSpec:
    prompt = min(request.prompt_len, max_model_len - 1)
    return replace(request, prompt_len=prompt, output_len=min(request.output_len, max_model_len - prompt))


def import_trace(
    path: Path,
    fmt: str | None = None,
    *,
    name: str | None = None,
    max_model_len: int | None = None,
    too_long: str = "drop",
    requests: int | None = None,
    seed: int = 0,
    tokens_per_word: float = DEFAULT_TOKENS_PER_WORD,
    output_len: int | None = None,
) -> tuple[Workload, TraceSummary]:
    """The trace file *path* as a seeded workload named *name* (default: the file's stem), and its summary.

    Requests longer than *max_model_len* are dropped or clipped (*too_long*), then a seeded sample of
    *requests* of them is kept; see the module docs.
    """
    name = name or path.stem
    if not NAME_PATTERN.fullmatch(name):
        raise WorkloadError(f"workload name {name!r}: use letters, digits, '.', '_' and '-' (a file name)")
    if name in GENERATORS:
        raise WorkloadError(f"workload name {name!r} is a built-in generator's; a saved trace of that name would "
                            "never be loaded")
    if too_long not in TOO_LONG:
        raise WorkloadError(f"too long: {too_long!r}; accepted: {', '.join(TOO_LONG)}")
    if max_model_len is not None and max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2 tokens, got {max_model_len}")
    if requests is not None and requests < 1:
        raise WorkloadError(f"requests must be >= 1, got {requests}")
    fmt = fmt or guess_format(path)
    found, timed = read_trace(path, fmt, tokens_per_word=tokens_per_word, output_len=output_len)
    kept, dropped, clipped = found, 0, 0
    if max_model_len is not None:
        limit = max_model_len
        over = sum(r.total_len > limit for r in found)
        if too_long == "drop":
            kept, dropped = [r for r in found if r.total_len <= limit], over
        else:
            kept, clipped = [_fit(r, limit) if r.total_len > limit else r for r in found], over
        if not kept:
            raise WorkloadError(f"{path}: none of its {len(found)} requests fits max_model_len {limit}")
    if requests is not None and requests < len(kept):
        chosen = sorted(random.Random(seed).sample(range(len(kept)), requests))
        kept = [kept[i] for i in chosen]
    if timed:
        start = min(r.arrival_s for r in kept)
        kept = [replace(r, arrival_s=round(r.arrival_s - start, 6)) for r in kept]
    arrivals = "trace" if timed else "offline"
    options = {"source": path.name, "format": fmt, "tokens_per_word": None if fmt == "csv" else tokens_per_word,
               "max_model_len": max_model_len, "too_long": too_long if max_model_len is not None else None,
               "requests": requests, "output_len": output_len}
    params = {k: v for k, v in options.items() if v is not None}
    workload = Workload(name=name, seed=seed, requests=tuple(kept), arrivals=arrivals, params=params)
    times = [r.arrival_s for r in kept]
    summary = TraceSummary(
        source=path.name, format=fmt, read=len(found), dropped=dropped, clipped=clipped, count=len(kept),
        prompt=LengthStats.of([r.prompt_len for r in kept]), output=LengthStats.of([r.output_len for r in kept]),
        arrivals=arrivals, arrivals_span_s=max(times) - min(times),
    )
    return workload, summary


def save_workload(workload: Workload, root: Path) -> Path:
    """Write *workload* to ``<root>/fixtures/workloads/<name>.json`` (atomically), where ``build(name, root=root)``
    finds it; the path written."""
    data = workload.to_json()
    requests = data.pop("requests")
    head = json.dumps(data, indent=1).removesuffix("\n}")  # one request a line: a long trace stays readable
    rows = ",\n".join(f"  {json.dumps(r)}" for r in requests)
    path = workloads_dir(root) / f"{workload.name}.json"
    atomic_write_text(path, f'{head},\n "requests": [\n{rows}\n ]\n}}\n')
    return path

