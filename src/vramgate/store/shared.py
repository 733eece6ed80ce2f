"""Results computed once per gate session and read by every pytest-xdist worker of it.

Note [shared results]: a simulation or an engine run that several tests ask for
runs once per session, not once per worker. The first worker to ask computes it
while holding the key's lock; a worker asking meanwhile waits for the result
(rather than computing the same thing beside it on a busy core) and reads it
from the session's folder. A simulation is deterministic, so its shared result
is the result; an engine run's result is one measured run, exactly as it already
was for the tests of one worker. A computation that raises stores nothing. The
folder belongs to one session (pytest's temporary folder), so no result outlives
the code and the vLLM that computed it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from vramgate.core.records import read_json
from vramgate.store.files import atomic_write_text, locked

T = TypeVar("T")


class SharedResults:
    """A folder of results by key, shared by the processes of one session (Note [shared results]); with no
    folder, every :meth:`get` computes."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def get(self, key: str, compute: Callable[[], T], to_json: Callable[[T], Any],
            from_json: Callable[[Any, str], T]) -> T:
        """The result stored under *key*, else ``compute()``'s, stored (as ``to_json``) for the others."""
        if self.folder is None:
            return compute()
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        path = self.folder / f"{digest}.json"
        with locked(self.folder / f".{digest}.lock"):
            if path.is_file():
                try:
                    data = read_json(path, ValueError)
                    if isinstance(data, dict) and data.get("key") == key:
                        return from_json(data["value"], str(path))
                except (ValueError, TypeError, KeyError):
                    pass  # unreadable: computed again and written over
            value = compute()
            atomic_write_text(path, json.dumps({"key": key, "value": to_json(value)}))
            return value
