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
    judged: bool = True
    """False: the claim could not be settled in this run (the evidence says why); it is then neither held nor not
    held, and ``held`` is False."""

    @property
    def verdict(self) -> str:
        """``held``, ``not held`` or ``not judged``."""
        return "not judged" if not self.judged else "held" if self.held else "not held"
