"""A claim a test settles by measurement: the statement, the verdict and the numbers behind it.

Not to be confused with :class:`vramgate.profiles.manifest.ProfileClaim`, the bound a profile promises
(which a test turns into a :class:`ClaimVerdict`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClaimVerdict:
    """A claim a test settles by measurement, with its verdict and the numbers behind it."""

    statement: str
    held: bool
    evidence: str
    source: str = ""
