"""The serving capacity suite catches a planted regression of vLLM's own KV sizing, end to end on the CPU engine.

A project with the real suite, the tiny-llama config and one serving entry records its baselines unpatched, then
runs again with ``--gate-profile plant-warmup-buffer`` (tests/data/profiles: vLLM's CPU warm-up keeps 128 MiB):
the automatic KV cache is 128 MiB smaller and the test fails naming the worker's own non-KV memory (the KV cache's
size is held to the matrix's budgets only on CPU: Note [file-backed RSS] in vramgate.engine.memory_decision).
Needs vLLM (the cpu-full env runs it); about two minutes, the engine's compiled warm-up twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANT = 128 << 20
#: How far an unchanged fresh engine's non-KV memory moves between runs (761-782 MiB in 11 runs: docs/serving.md),
#: with a margin: the KV cache must shrink by the buffer's size within this.
SPREAD = 32 << 20

MATRIX = """
[models.tiny-llama]

[[entries]]
suites = ["serving_capacity"]
model = "tiny-llama"
tier = "cpu"
block_size = 32
[entries.serving]
cpu_memory = "2 GiB"
max_model_len = 2048
max_num_seqs = 32
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytest.importorskip("vllm")
    shutil.copytree(ROOT / "suites" / "serving_capacity", pytester.path / "suites" / "serving_capacity")
    shutil.copytree(ROOT / "fixtures" / "models" / "tiny-llama", pytester.path / "fixtures" / "models" / "tiny-llama")
    shutil.copytree(ROOT / "tests" / "data" / "profiles" / "plant-warmup-buffer",
                    pytester.path / "patches" / "plant-warmup-buffer")
    shutil.copy(ROOT / "conftest.py", pytester.path / "conftest.py")
    (pytester.path / "vramgate.toml").write_text(MATRIX)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
        os.environ.setdefault(key, value)
    return pytester


def _metric(report: Path, name: str) -> dict[str, object]:
    data = json.loads(report.read_text())
    found = [m for t in data["tests"] for m in t["metrics"] if m["name"] == name]
    assert len(found) == 1, found
    return found[0]


def test_a_kept_warm_up_buffer_fails_the_serving_capacity_test(project: pytest.Pytester) -> None:
    args = ("-p", "no:cacheprovider", "suites")
    project.runpytest_subprocess(*args, "--gate-update", "--gate-report", "before").assert_outcomes(passed=1)
    result = project.runpytest_subprocess(*args, "--gate-profile", "plant-warmup-buffer", "--gate-report", "out")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert re.search(r"non_kv_own_bytes: now .*, baseline .*: \+\d+\.\d+% \(\+1\d\d\.\d\d MiB\), regressed", out), out
    values = [_metric(project.path / run / "report.json", "kv_cache_bytes")["now"] for run in ("before", "out")]
    drop = values[0]["value"] - values[1]["value"]  # type: ignore[index, operator]
    assert abs(drop - PLANT) <= SPREAD, f"the KV cache shrank by {drop:.0f} B, the plant keeps {PLANT} B"
