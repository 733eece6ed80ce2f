"""What the patch tests share: a stand-in installed package and a digest of a file tree."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: The stand-in package's ``sched.py`` before any diff.
ORIGINAL = "def policy():\n    return 'last'\n\n\ndef other():\n    return 1\n"


def tree_digest(path: Path) -> str:
    """Hash of every path and file content under *path* (links by their target)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()
