"""Atomic, locked file writes: readers see the old file or the new one, never a part.

A write stages the text in a temporary file beside its target (same folder, synced, the permission bits a
plain ``open(path, "w")`` would give) and publishes it with ``os.replace``; a write that fails (a full disk)
leaves the previous file as it was and no temporary file behind. :func:`locked` serializes writers of one
file across processes with an advisory lock that leaves no lock file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on *lock_path*; the lock file is gone again when the block ends.

    Note [removable lock files]: the holder unlinks the lock file before it
    unlocks. A waiter that then gets the lock holds it on a file no longer in
    the folder; it notices (the path is missing or names another inode) and
    starts over on the path's current file. So at most one process holds the
    lock on the file the path names, and no ``.<suite>.lock`` stays behind.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(lock_path)
            except FileNotFoundError:
                current = None
            if current is not None and current.st_ino == os.fstat(fd).st_ino:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the previous holder removed this file: lock the path's new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)  # closing releases the lock


def new_file_mode(path: Path) -> int:
    """The permission bits a plain ``open(path, "w")`` would give: the old file's, else 0o666 less the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def stage_text(path: Path, text: str) -> Path:
    """Write *text* to a new temporary file beside *path* (same folder, synced) and return its path.

    ``os.replace(staged, path)`` then publishes it atomically. On any error
    (a full disk, say) the temporary file is removed before the error goes on.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), new_file_mode(path))  # mkstemp makes 0600 files; these are for reading
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    """Write *text* to *path* so that readers see the old file or the new one, never a part.

    On failure (a full disk, say) no temporary file stays behind and the
    previous *path* is unchanged.
    """
    tmp = stage_text(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
