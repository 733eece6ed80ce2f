"""The ``gate_profiles`` mark: a test parametrized by the optimization profiles under ``patches/``.

``@pytest.mark.gate_profiles("block_manager", reference="baseline")`` gives the
test a ``profile`` argument: ``None`` first (the unpatched run, id
``baseline``), then each profile that names the suite (a
:class:`~vramgate.profiles.Profile`, id its name). The profiles are read from
the project's root at collection.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vramgate.engine import UNPATCHED, EngineSpec
from vramgate.profiles import (
    PatchError,
    Profile,
    build_overlay,
    check,
    installed_target,
    load_profile,
    load_profiles,
    profiles_for_suite,
    requirement_problem,
)
from vramgate.pytest_plugin.affected import TestInput
from vramgate.pytest_plugin.verdicts import DIFF_LINES_PROPERTY

__all__ = [
    "ARGNAME",
    "DIFF_LINES_PROPERTY",
    "MARKER_HELP",
    "PatchError",
    "Profile",
    "build_overlay",
    "check",
    "installed_target",
    "load_profile",
    "mark_arguments",
    "parametrize_profiles",
    "profile_inputs",
    "profile_params",
    "runnable_candidate",
    "skip_unmet",
    "unpatched",
    "version_problem",
]

#: The argument the mark parametrizes.
ARGNAME = "profile"


#: The mark's line in ``pytest --markers``.
MARKER_HELP = ("gate_profiles(suite=None, *, reference=None, where=None, nightly=None): parametrize argument "
               "'profile' by the optimization profiles of SUITE (default: all), each with its name as id; REFERENCE "
               "adds a first case, None (the unpatched run), with that id; WHERE keeps the profiles it accepts; "
               "NIGHTLY(profile) gives the reason a profile's case runs in the full gate only (gate_nightly), or None")


def mark_arguments(suite: str | None = None, *, reference: str | None = None,
                   where: Callable[[Profile], bool] | None = None,
                   nightly: Callable[[Profile], str | None] | None = None
                   ) -> tuple[str | None, str | None, Callable[[Profile], bool] | None,
                              Callable[[Profile], str | None] | None]:
    """The ``gate_profiles`` mark's signature: its arguments, defaults filled in."""
    return suite, reference, where, nightly


def profile_params(root: Path, mark: pytest.Mark, nodeid: str) -> list[Any]:
    """The parameters of a test marked ``gate_profiles``, read from the profiles under *root*."""
    try:
        suite, reference, where, nightly = mark_arguments(*mark.args, **mark.kwargs)
    except TypeError as exc:
        raise pytest.UsageError(f"{nodeid}: bad arguments to marker gate_profiles: {exc}") from None
    profiles = load_profiles(root) if suite is None else profiles_for_suite(root, suite)
    # The reference run is what every profile's test compares with (Note [longest first] in vramgate.store.durations).
    params = [pytest.param(None, id=reference, marks=pytest.mark.gate_reference)] if reference is not None else []
    for p in profiles:
        if where is None or where(p):
            reason = nightly(p) if nightly is not None else None
            params.append(pytest.param(p, id=p.name, marks=[pytest.mark.gate_nightly(reason)] if reason else []))
    return params


def parametrize_profiles(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``profile`` of a test marked ``gate_profiles`` (called from ``pytest_generate_tests``)."""
    mark = metafunc.definition.get_closest_marker("gate_profiles")
    if mark is None:
        return
    nodeid = metafunc.definition.nodeid
    if ARGNAME not in metafunc.fixturenames:
        raise pytest.UsageError(f"{nodeid}: marked gate_profiles but takes no argument {ARGNAME!r}")
    metafunc.parametrize(ARGNAME, profile_params(metafunc.config.rootpath, mark, nodeid))


def profile_inputs(item: pytest.Item, session_profile: str | None) -> list[TestInput]:
    """The profile folders a case runs (Note [each test's inputs]): its ``profile`` argument's, and the one
    ``--gate-profile`` applies to every engine (*session_profile*)."""
    root = item.config.rootpath.resolve()
    callspec = getattr(item, "callspec", None)
    profile = callspec.params.get(ARGNAME) if callspec is not None else None
    out: list[TestInput] = []
    if isinstance(profile, Profile):
        try:
            folder = profile.path.resolve().relative_to(root).as_posix()
        except ValueError:
            folder = None
        if folder:
            out.append(TestInput(f"profile {profile.name}", (folder + "/",)))
    if session_profile:
        out.append(TestInput(f"profile {session_profile} (--gate-profile)", (f"patches/{session_profile}/",)))
    return out


def skip_unmet(profile: Profile | None) -> None:
    """Skip the running test when this machine's engine tier does not meet *profile*'s requirements (its
    device, compute capability, GPU count), with the reason; nothing for the unpatched run (None)."""
    if profile is None:
        return
    from vramgate.engine import engine_tier

    problem = requirement_problem(profile, "cpu" if engine_tier() == "cpu" else "cuda")
    if problem:
        pytest.skip(f"profile {profile.name} on this tier: {problem}")


def version_problem(profile: Profile) -> str | None:
    """Why *profile* is not for the engine environment's vLLM (its version is outside the profile's target
    specifier), or None; None too when the environment has no vLLM (the engine says so then)."""
    from vramgate.profiles import target_covers
    from vramgate.runtime import engine_env

    env = engine_env.current()
    if env.vllm is None or target_covers(profile, env.vllm):
        return None
    return (f"profile {profile.name} targets {profile.distribution} {profile.version}; the engine environment has "
            f"{env.vllm_distribution} {env.vllm} (what it would do there: vramgate upgrade, or the profile check)")


def unpatched(spec: EngineSpec) -> EngineSpec:
    """*spec* as a paired check's reference: unpatched, even in a session that applies a profile to every spec naming
    none (``--gate-profile``; Note [the unpatched reference] in :mod:`vramgate.engine.spec`)."""
    return spec.replace(profile=UNPATCHED)


def runnable_candidate(reference: EngineSpec, profile: Profile, use_mla: bool) -> EngineSpec:
    """*reference* with *profile* applied: the candidate of a paired test. Skips the test, before any engine
    starts, where this tier's attention backends (a CPU backend and the profile's KV dtype) or this machine's
    kernels (an ISA without them) cannot run the profile."""
    from vramgate.engine import cpu_backend_problem, engine_tier, kernel_problem

    candidate = reference.replace(profile=profile.name)
    if engine_tier() == "cpu":
        dtype = str(profile.engine_args.get("kv_cache_dtype", reference.kv_cache_dtype))
        problem = cpu_backend_problem(reference.replace(kv_cache_dtype=dtype), use_mla)
        if problem:
            pytest.skip(f"profile {profile.name} on this tier: {problem}")
    problem = kernel_problem(candidate.replace(engine_args={**profile.engine_args, **candidate.engine_args}),
                             use_mla=use_mla)
    if problem:
        pytest.skip(f"not on this machine: profile {profile.name}: {problem}")
    return candidate
