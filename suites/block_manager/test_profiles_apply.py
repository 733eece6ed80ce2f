"""Every profile applies to the installed vLLM, and a broken one is refused without touching it; every profile
that names an attention backend passes that backend's own checks (vLLM's classes, importable without a GPU)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from vramgate.testing.engines import EngineSpec, backend_problem
from vramgate.testing.profiles import (
    PatchError,
    Profile,
    build_overlay,
    check,
    installed_target,
    load_profile,
    version_problem,
)


def digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.gate_judges("applies")
@pytest.mark.gate_profiles()
def test_profile_applies(vllm_in_process: Path, profile: Profile) -> None:
    assert check(profile) is None


@pytest.mark.gate_profiles(where=lambda p: "attention_backend" in p.engine_args)
def test_backend_profiles_fit_their_backend(vllm_in_process: Path, profile: Profile) -> None:
    """On a GPU its [requires] admits, the profile's engine arguments pass vLLM 0.32.0's backend checks; on one
    it does not admit, vLLM's class says why (the gate skips with that reason instead of crashing at start)."""
    spec = EngineSpec(model="deepseek-v2-lite", workload="fixed", requests=1, block_size=16,
                      engine_args=dict(profile.engine_args))
    admitted = profile.requires.capability or (8, 0)
    assert backend_problem(spec, admitted) is None
    if profile.requires.capability:
        found = backend_problem(spec, (8, 0))  # an A100
        assert found is not None and found[1], found
        assert "compute capability 8.0" in found[0]


def test_backend_block_size_is_checked(vllm_in_process: Path) -> None:
    spec = EngineSpec(model="deepseek-v2-lite", workload="fixed", requests=1, block_size=16,
                      attention_backend="FLASHMLA")
    found = backend_problem(spec, (9, 0))
    assert found == ("attention_backend 'FLASHMLA' runs kernel block sizes 64, not block_size 16", False)
    unknown = backend_problem(spec.replace(attention_backend="FLASHEST"), (9, 0))
    assert unknown is not None and "is not one of vLLM's backends" in unknown[0]


def test_refused_profiles_leave_vllm_byte_identical(vllm_in_process: Path, project_root: Path, tmp_path: Path) -> None:
    good = load_profile(project_root / "patches" / "block-manager-min-recompute")
    problem = version_problem(good)
    if problem:
        pytest.skip(problem)
    _, _, package_dir = installed_target(good)
    touched = [package_dir / "v1" / "core" / "sched" / "scheduler.py"]
    before = digest(touched)
    diff_text = good.series[0].read_text()
    cases = {
        "corrupt": diff_text.replace("preempted_req = self.running[-1]", "preempted_req = self.running[0]"),
        "escape": diff_text.replace("a/vllm/v1/core/sched/scheduler.py", "a/../outside.py")
        .replace("b/vllm/v1/core/sched/scheduler.py", "b/../outside.py"),
    }
    for case, text in cases.items():
        d = tmp_path / "patches" / case
        shutil.copytree(good.path, d)
        (d / good.series[0].name).write_text(text)
        (d / "manifest.toml").write_text((good.path / "manifest.toml").read_text().replace(good.name, case))
        with pytest.raises(PatchError):
            build_overlay(load_profile(d), tmp_path / "overlays")
    wrong = tmp_path / "patches" / "wrong-version"
    shutil.copytree(good.path, wrong)
    (wrong / "manifest.toml").write_text((good.path / "manifest.toml").read_text()
                                         .replace(good.name, "wrong-version").replace("==0.32.0", "==0.31.0"))
    with pytest.raises(PatchError, match=r"outside the profile's target '==0\.31\.0'"):
        build_overlay(load_profile(wrong), tmp_path / "overlays")
    assert digest(touched) == before
    assert not (tmp_path / "overlays").exists() or list((tmp_path / "overlays").iterdir()) == []
    overlay = build_overlay(good, tmp_path / "overlays")
    assert digest(touched) == before
    assert (overlay / "vllm" / "v1" / "core" / "sched" / "scheduler.py").read_text() != touched[0].read_text()
