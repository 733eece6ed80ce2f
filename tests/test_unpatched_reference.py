"""A paired check's reference runs unpatched even where ``--gate-profile`` applies a profile to every spec naming none
(Note [the unpatched reference] in vramgate.engine.spec): without it, the paired memory slope compared a server
keeping 128 KiB per request with itself and read -2 MiB per 1,000 requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate.engine import UNPATCHED, EngineSpec, with_session_profile
from vramgate.engine.load import Load, run_plan
from vramgate.engine.server import ApiServer, ServerError
from vramgate.testing.engines import Engine
from vramgate.testing.profiles import unpatched

SPEC = EngineSpec(model="tiny-llama", kv_budget_gib=None, cpu_memory_bytes=2 << 30, gpu_memory_utilization=0.9)


def test_the_unpatched_reference_is_the_plain_run_and_no_session_profile_reaches_it() -> None:
    reference = unpatched(SPEC)
    assert reference.profile == UNPATCHED and reference.key() == SPEC.key()  # one run serves both
    assert with_session_profile(SPEC, "opt").profile == "opt"
    assert with_session_profile(reference, "opt") == reference
    assert with_session_profile(SPEC.replace(profile="other"), "opt").profile == "other"
    assert with_session_profile(SPEC, None) == SPEC
    assert SPEC.replace(profile="opt").key() != reference.key()


class _Cache:
    def __init__(self) -> None:
        self.specs: list[EngineSpec] = []

    def run(self, spec: EngineSpec) -> object:
        self.specs.append(spec)
        raise RuntimeError("stop here")


def test_a_session_profile_patches_the_plain_spec_but_not_the_reference() -> None:
    cache = _Cache()
    engine = Engine(cache, profile="opt")  # type: ignore[arg-type]
    for spec in (SPEC, unpatched(SPEC)):
        with pytest.raises(RuntimeError):
            engine.run(spec)
    assert [s.profile for s in cache.specs] == ["opt", UNPATCHED]


def test_a_plan_refuses_one_server_given_twice(tmp_path: Path) -> None:
    server = ApiServer(SPEC, Path(__file__).resolve().parents[1], tmp_path / "server")
    with pytest.raises(ServerError, match="one server was given twice"):
        run_plan([(0, Load(), "a"), (1, Load(), "b")], [server, server], tmp_path / "load")
    assert not (tmp_path / "load").exists()
