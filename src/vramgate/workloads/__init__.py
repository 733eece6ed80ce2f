"""Seeded workloads: request lengths, arrival times and prompt tokens.

Every workload is a pure function of its name, size and seed, so two runs
(and the engine and the simulator) see the same requests. Generators:

``fixed``         every request the same prompt and output length.
``uniform``       lengths uniform in a range.
``sharegpt``      ShareGPT-like: lognormal lengths with the means the vLLM paper
                  reports for ShareGPT (161 input, 338 output tokens); sigma 1.0
                  (input) and 0.8 (output), clamped to the model length.
``shared-prefix`` one system prompt (prefix) shared by every request, then a short
                  unique suffix: the case prefix caching exists for.
``long-context``  long prompts, lengths spread up to the model length.

Arrivals are ``offline`` (all at t=0, as ``LLM.generate`` sees them), Poisson
with a given rate, or a trace's own times (``trace``: each request's ``arrival_s``).
Saved traces live in ``fixtures/workloads/<name>.json``; :mod:`vramgate.workloads.traces`
imports one from a ShareGPT conversations file, a vLLM benchmark JSONL or a CSV of lengths.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SHAREGPT_MEAN_INPUT = 161
SHAREGPT_MEAN_OUTPUT = 338


class WorkloadError(ValueError):
    """An unknown workload, a bad parameter, or an unreadable trace; names what and where."""


@dataclass(frozen=True)
class RequestSpec:
    """One request: lengths in tokens, arrival time, and its shared prefix (0 = none)."""

    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise WorkloadError(
                f"request lengths must be >= 1, got prompt {self.prompt_len}, output {self.output_len}"
            )
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise WorkloadError(f"prefix_len {self.prefix_len} must be within the prompt ({self.prompt_len})")
        if self.arrival_s < 0 or not math.isfinite(self.arrival_s):
            raise WorkloadError(f"arrival time must be finite and >= 0, got {self.arrival_s}")

    @property
    def total_len(self) -> int:
        """Prompt plus output tokens."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    """A named, seeded list of requests."""

    name: str
    seed: int
    requests: tuple[RequestSpec, ...]
    arrivals: str = "offline"
    params: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all requests."""
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """Output tokens of all requests."""
        return sum(r.output_len for r in self.requests)

    @property
    def max_len(self) -> int:
        """The longest request's prompt plus output tokens (0 without requests)."""
        return max((r.total_len for r in self.requests), default=0)

    def prompt_token_ids(self, vocab_size: int) -> list[list[int]]:
        """Deterministic prompt tokens; requests with a prefix share its first ``prefix_len`` tokens.

        Token ids avoid the first 100 ids of the vocabulary (special tokens).
        """
        if vocab_size <= 200:
            raise WorkloadError(f"vocab_size {vocab_size} is too small for synthetic prompts (need > 200)")
        longest_prefix = max((r.prefix_len for r in self.requests), default=0)
        prefix_rng = random.Random(f"{self.seed}-prefix")
        prefix = [prefix_rng.randrange(100, vocab_size) for _ in range(longest_prefix)]
        out = []
        for i, r in enumerate(self.requests):
            rng = random.Random(f"{self.seed}-{i}")
            unique = [rng.randrange(100, vocab_size) for _ in range(r.prompt_len - r.prefix_len)]
            out.append(prefix[: r.prefix_len] + unique)
        return out

    def to_json(self) -> dict[str, Any]:
        """The workload as JSON data, as a saved workload file holds it."""
        return {
            "name": self.name, "seed": self.seed, "arrivals": self.arrivals, "params": self.params,
            "requests": [asdict(r) for r in self.requests],
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Workload:
        """The workload in *data* (as :meth:`to_json` writes it); :class:`WorkloadError` naming *where* if malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise WorkloadError(f"{where}: must be an object with a list 'requests'")
        try:
            requests = tuple(RequestSpec(**r) for r in data["requests"])
        except TypeError as exc:
            raise WorkloadError(f"{where}: bad request entry: {exc}") from None
        except WorkloadError as exc:
            raise WorkloadError(f"{where}: {exc}") from None
        return cls(
            name=str(data.get("name", Path(where).stem)), seed=int(data.get("seed", 0)), requests=requests,
            arrivals=str(data.get("arrivals", "offline")), params=dict(data.get("params", {})),
        )


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)


def _clamp(value: float, low: int, high: int) -> int:
    return max(low, min(high, round(value)))


def fixed(n: int, seed: int, max_model_len: int, *, prompt_len: int = 128, output_len: int = 64) -> list[RequestSpec]:
    """*n* requests of *prompt_len* prompt and *output_len* output tokens (*seed* and *max_model_len* unused)."""
    return [RequestSpec(prompt_len, output_len) for _ in range(n)]


def uniform(
    n: int, seed: int, max_model_len: int, *, prompt: tuple[int, int] = (16, 512), output: tuple[int, int] = (16, 256)
) -> list[RequestSpec]:
    """*n* requests with prompt and output lengths drawn uniformly from *prompt* and *output*, cut to fit
    *max_model_len*; seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(rng.randint(*prompt), max_model_len - 1)
        out.append(RequestSpec(p, min(rng.randint(*output), max_model_len - p)))
    return out


def sharegpt(
    n: int,
    seed: int,
    max_model_len: int,
    *,
    mean_input: float = SHAREGPT_MEAN_INPUT,
    mean_output: float = SHAREGPT_MEAN_OUTPUT,
    sigma_input: float = 1.0,
    sigma_output: float = 0.8,
) -> list[RequestSpec]:
    """*n* requests with log-normal prompt and output lengths around ShareGPT's means, clamped to fit
    *max_model_len* (prompts to half of it); seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = _clamp(_lognormal(rng, mean_input, sigma_input), 4, max_model_len // 2)
        o = _clamp(_lognormal(rng, mean_output, sigma_output), 4, max_model_len - p)
        out.append(RequestSpec(p, o))
    return out


def shared_prefix(
    n: int, seed: int, max_model_len: int, *, prefix_len: int = 512, suffix: tuple[int, int] = (16, 128),
    output_len: int = 64,
) -> list[RequestSpec]:
    """*n* requests sharing a prefix of *prefix_len* tokens (at most half of *max_model_len*), each with a
    seeded uniform suffix from *suffix* and *output_len* output tokens."""
    rng = random.Random(seed)
    prefix_len = min(prefix_len, max_model_len // 2)
    out = []
    for _ in range(n):
        s = rng.randint(*suffix)
        p = min(prefix_len + s, max_model_len - output_len)
        out.append(RequestSpec(p, output_len, prefix_len=min(prefix_len, p)))
    return out


def long_context(n: int, seed: int, max_model_len: int, *, output_len: int = 32) -> list[RequestSpec]:
    """*n* requests with prompts drawn uniformly from a quarter of *max_model_len* up to what leaves room for
    *output_len* output tokens; seeded."""
    rng = random.Random(seed)
    low = max(1, max_model_len // 4)
    return [RequestSpec(rng.randint(low, max_model_len - output_len), output_len) for _ in range(n)]


def recall_judging(n: int, seed: int, max_model_len: int, *, output_len: int = 64) -> list[RequestSpec]:
    """The first *n* of the prompt lengths a recall model is judged on when it is made
    (:func:`vramgate.models.recall_weights.eval_lengths` of *seed*: 3 tokens to 1,984), each answered with
    *output_len* tokens, cut to fit *max_model_len*."""
    from vramgate.models.recall_weights import eval_lengths

    out = []
    for length in eval_lengths(seed)[:n]:
        p = min(length, max_model_len - output_len)
        if p < 1:
            raise WorkloadError(f"max_model_len {max_model_len} leaves no room for {output_len} output tokens")
        out.append(RequestSpec(p, output_len))
    return out


GENERATORS: dict[str, Callable[..., list[RequestSpec]]] = {
    "fixed": fixed,
    "uniform": uniform,
    "sharegpt": sharegpt,
    "shared-prefix": shared_prefix,
    "long-context": long_context,
    "recall-judging": recall_judging,
}


def poisson_arrivals(requests: list[RequestSpec], rate_per_s: float, seed: int) -> list[RequestSpec]:
    """Give *requests* Poisson arrival times at *rate_per_s* (exponential gaps, seeded)."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise WorkloadError(f"arrival rate must be a positive number of requests per second, got {rate_per_s}")
    rng = random.Random(f"{seed}-arrivals")
    t = 0.0
    out = []
    for r in requests:
        out.append(replace(r, arrival_s=t))
        t += rng.expovariate(rate_per_s)
    return out


def workloads_dir(root: Path) -> Path:
    """The folder of saved workload files under *root*: ``<root>/fixtures/workloads``."""
    return root / "fixtures" / "workloads"


def available_workloads(root: Path | None = None) -> list[str]:
    """Names of the generated workloads, then those saved under *root* that are not generator names."""
    saved = sorted(p.stem for p in workloads_dir(root).glob("*.json")) if root else []
    return sorted(GENERATORS) + [s for s in saved if s not in GENERATORS]


def build(
    name: str,
    *,
    requests: int,
    seed: int = 0,
    max_model_len: int = 4096,
    arrival_rate: float | None = None,
    root: Path | None = None,
    **params: Any,
) -> Workload:
    """The workload *name*: a generator (see the module docs) or a saved trace under ``fixtures/workloads``."""
    if requests < 1:
        raise WorkloadError(f"requests must be >= 1, got {requests}")
    if max_model_len < 16:
        raise WorkloadError(f"max_model_len must be >= 16, got {max_model_len}")
    arrivals = "offline"
    if name in GENERATORS:
        try:
            reqs = GENERATORS[name](requests, seed, max_model_len, **params)
        except TypeError as exc:
            raise WorkloadError(f"workload {name!r}: {exc}") from None
    elif root is not None and (workloads_dir(root) / f"{name}.json").is_file():
        path = workloads_dir(root) / f"{name}.json"
        try:
            saved = Workload.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}: not valid JSON ({exc})") from None
        reqs = list(saved.requests[:requests])
        too_long = [i for i, r in enumerate(reqs) if r.total_len > max_model_len]
        if too_long:
            raise WorkloadError(f"{path}: request {too_long[0]} is longer than max_model_len {max_model_len}")
        arrivals = saved.arrivals
    else:
        raise WorkloadError(f"unknown workload {name!r}; accepted: {', '.join(available_workloads(root))}")
    if arrival_rate is not None:
        reqs = poisson_arrivals(reqs, arrival_rate, seed)
        arrivals = f"poisson {arrival_rate:g}/s"
    return Workload(name=name, seed=seed, requests=tuple(reqs), arrivals=arrivals, params=dict(params))
