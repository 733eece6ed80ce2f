"""The load subprocess: ``python -m vramgate.engine.load_client PLAN.json``, vLLM's own benchmark client
(``vllm bench serve``: ``vllm.benchmarks.serve``) run once per load of a plan.

Each item of the plan is a ``vllm bench serve`` command line (built by :func:`vramgate.engine.load.client_argv`)
and the file its result goes to. The command line is parsed by the client's own ``add_cli_args`` and run by its
``main``, so the figures are the ones a team's ``vllm bench serve`` prints; only the result, which ``main``
returns, is written by this module (with the monotonic clock's readings at the start and the end of the load,
which the gate lines up with its memory samples). The client is imported once for the whole plan: the loads of
a plan (two request rates, or the bursts of a paired A/B) follow each other without the seconds an import takes.

A load that raises writes ``{"error": ...}`` and the plan goes on; the gate fails the test with it.

An item may name a ``wait`` file: the client runs it only once that file exists and says ``{"run": true}``, and
writes ``{"skipped": true}`` for it when it says false. That is how the gate stops a warm-up once the server's
memory has settled (Note [settled warm-up] in :mod:`vramgate.engine.leak`): it reads the memory between two
chunks and tells the client whether the next one runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

#: Seconds the client waits for the gate's word on an item with a ``wait`` file before it gives up on the item.
WAIT_S = 120.0


def _told_to_run(path: Path, wait_s: float) -> bool:
    """Whether the gate's *path* says the item runs: waits for it; an item with no word in *wait_s* is skipped."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            print(f"no word in {path.name} after {wait_s:g} s: the item is skipped", flush=True)
            return False
        time.sleep(0.05)
    return bool(json.loads(path.read_text(encoding="utf-8")).get("run"))


def _write(out: Path, result: dict[str, object]) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str), encoding="utf-8")
    os.replace(tmp, out)
    print(f"load {out.name} done", flush=True)


def main(argv: list[str]) -> int:
    """Entry point: ``python -m vramgate.engine.load_client PLAN.json``."""
    if len(argv) != 1:
        print("usage: python -m vramgate.engine.load_client PLAN.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for item in plan["loads"]:
        out = Path(item["result"])
        if item.get("wait") and not _told_to_run(Path(item["wait"]), float(item.get("wait_s", WAIT_S))):
            _write(out, {"skipped": True, "vramgate_t_start": time.perf_counter(),
                         "vramgate_t_end": time.perf_counter()})
            continue
        parser = FlexibleArgumentParser(description="vllm bench serve")
        add_cli_args(parser)
        t_start = time.perf_counter()
        try:
            args = parser.parse_args(item["argv"])
            result = dict(bench_serve(args))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            traceback.print_exc()
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            result = {"error": last}
        result["vramgate_t_start"] = t_start
        result["vramgate_t_end"] = time.perf_counter()
        _write(out, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the client's event loop may leave threads behind that would block a normal exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
