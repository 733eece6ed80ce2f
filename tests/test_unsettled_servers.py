"""Note [unsettled servers] in vramgate.testing.serving: the machines whose unchanged server does not settle skip
the memory slope tests with what was measured there; every other machine runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramgate.testing.serving import UNSETTLED_SERVERS, memory_slope_problem

ROOT = Path(__file__).resolve().parents[1]


def _write(root: Path, data: object) -> None:
    path = root / UNSETTLED_SERVERS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_a_listed_machine_skips_the_loads_it_was_measured_on(tmp_path: Path) -> None:
    _write(tmp_path, {"cpu-x": {"measured": "today", "pre-merge": "grew 8 to 58 KiB per request"}})
    problem = memory_slope_problem(tmp_path, "cpu-x", "pre-merge")
    assert problem is not None and "cpu-x" in problem and "grew 8 to 58 KiB per request" in problem
    assert "today" in problem and str(UNSETTLED_SERVERS) in problem
    assert memory_slope_problem(tmp_path, "cpu-x", "soak") is None  # not measured there: judged
    assert memory_slope_problem(tmp_path, "cpu-y", "pre-merge") is None  # another machine: judged


def test_no_record_judges_everywhere(tmp_path: Path) -> None:
    assert memory_slope_problem(tmp_path, "cpu-x", "pre-merge") is None


@pytest.mark.parametrize("data", [["cpu-x"], {"cpu-x": "grew"}, {"cpu-x": {"pre-merge": 58}}])
def test_a_malformed_record_names_the_file(tmp_path: Path, data: object) -> None:
    _write(tmp_path, data)
    with pytest.raises(ValueError, match=r"unsettled-servers\.json"):
        memory_slope_problem(tmp_path, "cpu-x", "pre-merge")


def test_the_repository_record_reads() -> None:
    data = json.loads((ROOT / UNSETTLED_SERVERS).read_text(encoding="utf-8"))
    for key, record in data.items():
        for load in ("pre-merge", "soak"):
            if load in record:
                assert key in str(memory_slope_problem(ROOT, key, load))


def test_the_memory_tests_name_the_record_as_their_input() -> None:
    """Under --gate-affected a change to the record keeps the tests it decides (Note [each test's inputs])."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_serving_inputs", ROOT / "suites/serving/test_serving.py")
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    for test in (suite.test_serving_memory, suite.test_serving_memory_soak):
        marks = [m for m in test.pytestmark if m.name == "gate_inputs"]
        assert [m.args for m in marks] == [(str(UNSETTLED_SERVERS),)], test.__name__
