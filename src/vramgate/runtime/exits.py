"""How a child process ended, in words: below both the child mechanisms (:mod:`vramgate.runtime.process`, the
preloaded interpreter of :mod:`vramgate.runtime.preload`), which both say it."""

from __future__ import annotations

import signal


def describe_exit(status: int) -> str:
    """How a child ended, from its exit status: ``exited with status 1``, ``was killed by SIGKILL (out of
    memory?)`` (the kernel's out-of-memory killer sends SIGKILL; so may a person or a runner)."""
    if status == -signal.SIGKILL:
        return "was killed by SIGKILL (out of memory?)"
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"
