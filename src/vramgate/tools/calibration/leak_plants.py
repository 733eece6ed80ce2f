"""Planted leaks of a chosen size, for measuring the smallest leak the serving suite's memory check catches.

:func:`write_leak_plant` writes a profile (a manifest and one patch of vLLM 0.32.0's scheduler) whose server
keeps a chosen number of bytes alive, and touched, per request it admits (``per="request"``: a per-request log
that is never trimmed) or per output token it generates (``per="token"``: a per-step cache that grows with the
tokens). The leak campaign (:mod:`vramgate.tools.calibration.leak_floor`) writes plants of several sizes this way
and the serving tests use it for their end-to-end checks; ``tests/data/profiles/plant-request-leak`` is one of
them, kept in the tree.
"""

from __future__ import annotations

from pathlib import Path

#: The leak's unit: per request admitted, per output token generated.
PER = ("request", "token")

_REQUEST_PATCH = '''\
--- a/vllm/v1/core/sched/scheduler.py
+++ b/vllm/v1/core/sched/scheduler.py
@@ -2615,5 +2615,7 @@
{blank}
     def add_request(self, request: Request) -> None:
+        # Profile {name}: a planted regression, {size} bytes kept alive (and touched) per request.
+        self.__dict__.setdefault("_vramgate_leak", []).append(b"\\x5a" * {size})
         existing = self.requests.get(request.request_id)
         if existing is not None:
             update = StreamingUpdate.from_request(request)
'''

_TOKEN_PATCH = '''\
--- a/vllm/v1/core/sched/scheduler.py
+++ b/vllm/v1/core/sched/scheduler.py
@@ -2164,6 +2164,9 @@
{blank}
             # Check for stop and update request status.
             if new_token_ids:
+                # Profile {name}: a planted regression, {size} bytes kept alive (and touched) per output token.
+                self.__dict__.setdefault("_vramgate_leak", []).append(
+                    b"\\x5a" * ({size} * len(new_token_ids)))
                 new_token_ids, stopped = self._update_request_with_output(
                     request, new_token_ids, is_stale=output_is_stale
                 )
'''


def plant_name(size: int, per: str = "request") -> str:
    """The profile name of a plant keeping *size* bytes per *per* (``plant-request-leak-64k``)."""
    return f"plant-{per}-leak-{size // 1024}k" if size % 1024 == 0 else f"plant-{per}-leak-{size}b"


def write_leak_plant(patches: Path, size: int, per: str = "request", name: str | None = None) -> Path:
    """Write a planted-leak profile under *patches* (a project's ``patches`` folder) keeping *size* bytes alive
    per *per* (one of :data:`PER`); the profile's folder. ValueError for a size under one byte or an unknown
    unit."""
    if per not in PER:
        raise ValueError(f"a leak is per {' or per '.join(PER)}, not per {per!r}")
    if size < 1:
        raise ValueError(f"a planted leak keeps at least one byte, not {size}")
    name = name or plant_name(size, per)
    folder = patches / name
    folder.mkdir(parents=True, exist_ok=True)
    patch = f"0001-scheduler-keeps-{size}-bytes-per-{per}.patch"
    text = (_REQUEST_PATCH if per == "request" else _TOKEN_PATCH).format(name=name, size=size, blank=" ")
    (folder / patch).write_text(text, encoding="utf-8")
    (folder / "manifest.toml").write_text(f'''name = "{name}"
description = """
A planted regression, not an optimization: vLLM 0.32.0's scheduler keeps {size} bytes alive (and touched) per
{per} it {"admits" if per == "request" else "generates"}. The serving suite's memory check must catch it when it is
above the run's floor (docs/online-serving.md)."""
hypothesis = "The server's resident memory grows by {size} bytes per {per}."
suites = []

[target]
distribution = "vllm"
package = "vllm"
version = "==0.32.0"

[patches]
series = ["{patch}"]
''', encoding="utf-8")
    return folder
