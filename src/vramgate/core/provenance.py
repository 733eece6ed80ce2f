"""Provenance of one stored measurement: when, at which commit, with which software."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Provenance:
    """When, where and with what a test's baseline was recorded."""

    commit: str | None
    date: str
    software: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """This provenance as JSON data: commit, date and software versions."""
        return {"commit": self.commit, "date": self.date, "software": dict(self.software)}

    def describe(self) -> str:
        """One line saying when, at which commit and with which software versions the figure was recorded."""
        soft = ", ".join(
            f"{k} {v}" for k, v in sorted(self.software.items()) if k not in ("vllm_distribution",)
        )
        if self.commit:
            commit = self.commit[:12] + (" (dirty tree)" if self.commit.endswith("+dirty") else "")
        else:
            commit = "an unknown commit"
        return f"recorded {self.date} at {commit} ({soft})"
