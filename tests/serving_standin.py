"""What the serving tests that run without vLLM share: the stand-in server's ``/health`` (the tail of each stand-in
server's script), the benchmark client's result for a load of stand-in requests, and the ``servers`` fixture's
stand-in that runs the gate's real loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vramgate.engine.leak import WarmUp
from vramgate.engine.load import Load, LoadRun, run_loads
from vramgate.engine.server import ApiServer

#: The end of a stand-in server's script: answers ``/health`` on the host and port of its ``server.json`` (``cfg``).
HEALTH = """

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer((cfg["host"], cfg["port"]), Health).serve_forever()
"""

#: ``result_of(n, t0, starts, latencies, output_len)``: what vLLM's benchmark client's ``main`` returns for *n*
#: requests that all succeeded, for the stand-in clients' scripts.
RESULT = """

def result_of(n, t0, starts, latencies, output_len):
    result = {"completed": n, "failed": 0, "duration": time.perf_counter() - t0, "request_throughput": 1.0,
              "output_throughput": 1.0, "ttfts": [0.001] * n, "latencies": latencies, "start_times": starts,
              "output_lens": [output_len] * n, "errors": [""] * n}
    for lat in ("ttft", "tpot", "itl", "e2el"):
        for p in (50, 90, 99):
            result[f"p{p}_{lat}_ms"] = 1.0
    return result
"""


@dataclass
class Pool:
    """The ``servers`` fixture's stand-in: one started server, loads run as the real fixture runs them."""

    server: ApiServer
    runs: list[LoadRun] = field(default_factory=list)

    def get(self, spec: object) -> ApiServer:
        return self.server

    def loads(self, server: ApiServer, loads: list[Load], run_dir: Path, *, warmup: WarmUp | None = None) -> LoadRun:
        self.runs.append(run_loads(server, loads, run_dir, warmup=warmup))
        return self.runs[-1]
