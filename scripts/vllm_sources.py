"""Fetch the Python source of vLLM releases' CUDA wheels, for the contract tests of the GPU memory figures.

    python scripts/vllm_sources.py DEST 0.31.0 0.32.0 0.33.0

Each release's wheel is downloaded from the package index (``pip download vllm==V --no-deps``, nothing installed)
and its ``.py`` files are unpacked into ``DEST/V/vllm/``. A release already unpacked there is left as it is.
Prints the folders, joined with the path separator, for ``VRAMGATE_VLLM_SOURCES``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def fetch(dest: Path, version: str) -> Path:
    """``DEST/VERSION``, holding vLLM VERSION's ``.py`` files (downloaded and unpacked unless already there)."""
    target = dest / version
    done = target / ".complete"
    if done.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:", "-d", tmp,
               f"vllm=={version}"]
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"vllm_sources: cannot download vllm=={version} ({' '.join(cmd)})")
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"vllm_sources: expected one vllm {version} wheel, got {[w.name for w in wheels]}")
        unpacked = Path(tmp) / "src"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            wheel.extractall(unpacked, members)
        if target.exists():
            subprocess.run(["rm", "-rf", str(target)], check=True)
        unpacked.rename(target)
    done.write_text(f"vllm {version}: {len(members)} .py files\n")
    return target


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    print(os.pathsep.join(str(fetch(dest, v)) for v in argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
