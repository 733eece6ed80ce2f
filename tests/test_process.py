"""Ending a child's process group: the gate returns only when the group's last member is gone (Note [a group is
gone when its last member is] in :mod:`vramgate.runtime.process`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vramgate.machine.probes import cpu
from vramgate.runtime import process


def _launch(tmp_path: Path, script: str) -> process.Child:
    return process.launch(["sh", "-c", script], tmp_path / "child.log", env={"PATH": "/usr/bin:/bin"},
                          cwd=tmp_path)


def test_a_leader_that_exits_leaves_no_member_of_its_group(tmp_path: Path) -> None:
    # as vLLM's engine process leaves its tensor-parallel workers: the leader is gone, a member runs on
    child = _launch(tmp_path, "sleep 30 & echo started; exit 0")
    assert process.wait_or_kill(child, 60) == 0
    assert cpu.group_members(child.pid) == []


def test_a_timed_out_child_leaves_no_member_of_its_group(tmp_path: Path) -> None:
    child = _launch(tmp_path, "trap '' TERM; sleep 30 & sleep 30")
    assert process.wait_or_kill(child, 0.5, grace_s=0.5) is None
    assert cpu.group_members(child.pid) == []


def test_the_gate_waits_for_a_member_that_is_slow_to_die(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a killed process that holds GPU memory lives on until the driver has torn down its context: the group
    # reports a member for a while after SIGKILL
    child = _launch(tmp_path, "exit 0")
    dies_at = time.monotonic() + 0.6
    real = cpu.group_members
    monkeypatch.setattr(cpu, "group_members",
                        lambda pgid: [pgid + 1] if time.monotonic() < dies_at else real(pgid))
    assert process.wait_or_kill(child, 60) == 0
    assert time.monotonic() >= dies_at


def test_a_member_that_never_dies_is_waited_for_only_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "group_members", lambda pgid: [pgid + 1])
    started = time.monotonic()
    assert process.await_groups_gone([12345], bound_s=0.3) == [12346]
    assert 0.3 <= time.monotonic() - started < 5
