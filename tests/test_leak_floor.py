"""The leak floor campaign's analysis (vramgate.tools.calibration.leak_floor) on a campaign's record made here: an
unchanged server whose memory wanders by steps, and a plant keeping 64 KiB per request."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from vramgate.tools.calibration import leak_floor
from vramgate.tools.calibration.leak_plants import plant_name, write_leak_plant

KIB = 1024


def _server(per_request: float, seed: int, requests: int = 1200) -> dict[str, Any]:
    """A server's record: a request of 32 tokens completes every 0.1 s after a warm-up of 10 s; memory sampled every
    0.02 s, 1 GiB plus *per_request* per completed request, plus steps of up to 256 KiB either way that stay, and
    200 KiB noise."""
    rng = random.Random(seed)
    completions = [[10.0 + 0.1 * (k + 1), 32] for k in range(requests)]
    samples, steps = [], 0.0
    for n in range(int((10.0 + 0.1 * requests) / 0.02)):
        t = 0.02 * n
        done = max(0, min(requests, int((t - 10.0) / 0.1))) if t > 10.0 else 0
        if rng.random() < 0.002:
            steps += rng.uniform(-1, 1) * (256 << 10)
        samples.append([t, int((1 << 30) + per_request * done + steps + rng.gauss(0, 200 * KIB))])
    return {"samples": samples, "completions": completions, "loads": [[10.0, 10.0 + 0.1 * requests + 0.05]],
            "warmup_levels": []}


@pytest.fixture(scope="module")
def campaign() -> dict[str, Any]:
    return {"names": ["unchanged", "plant-request-leak-64k"], "concurrency": 8,
            "servers": [_server(0.0, 1), _server(64 * KIB, 2)]}


def test_the_windows_the_soak_and_the_added_leaks_are_judged_as_the_gate_judges(campaign: dict[str, Any]) -> None:
    figures = leak_floor.analyze(campaign, 40 * KIB, 8 * KIB, 400)
    unchanged, plant = figures["servers"]
    assert len(unchanged["windows"]) == 3 and len(unchanged["soaks"]) == 1
    assert not any(w["alarm"] for w in unchanged["windows"]) and not unchanged["soaks"][0]["alarm"]
    assert all(w["alarm"] for w in plant["windows"]) and plant["soaks"][0]["alarm"]
    assert all(w["slope"] == pytest.approx(64 * KIB, rel=0.1) for w in plant["windows"])
    assert plant["per_token"][0]["slope"] == pytest.approx(2 * KIB, rel=0.1)  # 64 KiB over 32 tokens
    caught = {a["kib_per_request"]: a["caught"] for a in figures["added"]}
    assert caught[2] == 0 and caught[64] == 3 and list(caught.values()) == sorted(caught.values())
    assert figures["floor_kib"] is not None and 40 < figures["floor_kib"] <= 64
    assert figures["soak_floor_kib"] is not None and 8 < figures["soak_floor_kib"] <= 16
    text = leak_floor.render(figures, "about")
    assert "| unchanged | 3 |" in text and "False alarms: 0 of 3 unchanged windows" in text
    assert f"pre-merge {figures['floor_kib']} KiB per request" in text


def test_the_command_analyses_a_saved_campaign(campaign: dict[str, Any], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"data": campaign}))
    assert leak_floor.main([str(tmp_path / "out"), "--from", str(saved), "--allowance-kib", "40"]) == 0
    assert "# The serving memory check's leak floor" in capsys.readouterr().out
    again = json.loads((tmp_path / "out" / "leak-floor.json").read_text())
    assert again["figures"]["allowance"] == 40 * KIB and (tmp_path / "out" / "leak-floor.md").is_file()


def test_an_upper_bound_of_a_rate_seen_rarely() -> None:
    assert leak_floor.upper_95(0, 30) == pytest.approx(0.0950, abs=0.001)  # about 3/n
    assert leak_floor.upper_95(1, 100) == pytest.approx(0.0466, abs=0.001)
    assert leak_floor.upper_95(5, 5) == 1.0


def test_a_plant_is_a_profile_that_patches_the_pinned_scheduler(tmp_path: Path) -> None:
    folder = write_leak_plant(tmp_path, 16 * KIB)
    assert folder.name == plant_name(16 * KIB) == "plant-request-leak-16k"
    patch = (folder / "0001-scheduler-keeps-16384-bytes-per-request.patch").read_text()
    assert "b\"\\x5a\" * 16384" in patch and "\n \n" in patch  # the blank context line keeps its space
    token = write_leak_plant(tmp_path, 512, "token")
    assert token.name == "plant-token-leak-512b" and "len(new_token_ids)" in next(token.glob("*.patch")).read_text()
    with pytest.raises(ValueError, match="per request or per token, not per 'step'"):
        write_leak_plant(tmp_path, 1, "step")
    with pytest.raises(ValueError, match="at least one byte"):
        write_leak_plant(tmp_path, 0)
