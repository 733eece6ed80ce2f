"""``vramgate simulate``: the command line prints the simulator's figures as JSON and refuses unknown names.

These run vLLM's scheduler, so they need vLLM: the unit env (no vLLM) skips
them, saying so, and the full CPU gate runs them (``tox -e cpu-full``, after the gate;
``VRAMGATE_REQUIRE_VLLM=1`` there makes a missing vLLM an error).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_cli_simulate_json(vllm_env: Path, project_root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vramgate", "simulate", "--model", "tiny-llama", "--workload", "shared-prefix",
         "--requests", "50", "--seed", "2", "--block-size", "32", "--kv-blocks", "400", "--json"],
        cwd=project_root, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["requests"] == 50 and data["block_size"] == 32
    assert data["prefix_cache_hit_rate"] > 0.5  # 49 of 50 requests reuse the shared 512-token prompt
    assert data["settings"]["chunked_prefill"] and data["settings"]["prefix_caching"]
    timing = data["timing"]  # vLLM's own scheduler calls are timed inside the step loop
    assert 0 < timing["scheduler_s"] <= timing["loop_s"] <= timing["total_s"]


def test_cli_rejects_unknown_names(vllm_env: Path, project_root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vramgate", "simulate", "--model", "tiny-llama", "--workload", "sharegtp",
         "--requests", "5"],
        cwd=project_root, capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 2
    assert "unknown workload 'sharegtp'; accepted: fixed, long-context, shared-prefix, sharegpt, uniform" in out.stderr
