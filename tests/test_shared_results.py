"""Results shared by the workers of one session (Note [shared results] in vramgate.store.shared)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vramgate.store.shared import SharedResults


def as_is(value: Any, where: str) -> Any:
    return value


def test_the_first_asker_computes_and_a_concurrent_one_waits_and_reads(tmp_path: Path) -> None:
    calls: list[str] = []
    results: dict[str, Any] = {}

    def slow(name: str) -> dict[str, Any]:
        calls.append(name)
        time.sleep(0.5)
        return {"figure": 42, "by": name}

    def ask(name: str) -> None:
        # Each worker has its own SharedResults on the same folder, as pytest-xdist's workers do.
        results[name] = SharedResults(tmp_path).get("simulation x", lambda: slow(name), dict, as_is)

    threads = [threading.Thread(target=ask, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(calls) == 1  # whichever got the lock first computed it; the others read its result
    assert results["w1"] == results["w2"] == results["w0"] == {"figure": 42, "by": calls[0]}
    assert SharedResults(tmp_path).get("simulation y", lambda: {"figure": 1}, dict, as_is) == {"figure": 1}
    assert not list(tmp_path.glob(".*.lock"))  # no lock file stays


def test_a_failure_stores_nothing_and_a_bad_file_is_computed_again(tmp_path: Path) -> None:
    shared = SharedResults(tmp_path)

    def fail() -> dict[str, Any]:
        raise RuntimeError("engine crashed")

    with pytest.raises(RuntimeError, match="engine crashed"):
        shared.get("engine k", fail, dict, as_is)
    assert not list(tmp_path.glob("*.json"))
    assert shared.get("engine k", lambda: {"v": 1}, dict, as_is) == {"v": 1}
    (stored,) = tmp_path.glob("*.json")
    stored.write_text("{not json", encoding="utf-8")
    assert shared.get("engine k", lambda: {"v": 2}, dict, as_is) == {"v": 2}
    assert shared.get("engine k", fail, dict, as_is) == {"v": 2}


def test_without_a_folder_every_call_computes() -> None:
    shared = SharedResults(None)
    values = iter([1, 2])
    assert shared.get("k", lambda: next(values), int, as_is) == 1
    assert shared.get("k", lambda: next(values), int, as_is) == 2
