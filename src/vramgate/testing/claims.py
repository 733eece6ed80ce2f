"""Profiles' claims in the suites: each claim's verdict, the patched run's figures against the unpatched run's."""

from __future__ import annotations

import pytest

from vramgate.core.claims import ClaimVerdict
from vramgate.profiles import Profile
from vramgate.pytest_plugin.fixture import Gate

__all__ = [
    "check_claims",
]


def check_claims(gate: Gate, profile: Profile, workload: str, patched: dict[str, float],
                 reference: dict[str, float], *, labels: tuple[str, str] = ("patched", "unpatched"),
                 context: str = "") -> list[ClaimVerdict]:
    """Record the verdict of each claim of *profile* on *workload* (held or not) in *gate*'s report.

    *patched* and *reference* are the figures of the profile's run and of the
    unpatched (or reference) run; *labels* name them in the evidence. A claim on a
    metric the test did not measure is an error in the profile's manifest: it
    fails the test.
    """
    try:
        return gate.profile_claims(profile, workload, patched, reference, labels=labels, context=context)
    except ValueError as exc:
        pytest.fail(str(exc), pytrace=False)
