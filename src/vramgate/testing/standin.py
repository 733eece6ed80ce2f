"""The processes a rehearsal starts in place of engines and servers (Note [rehearsal] in
:mod:`vramgate.testing.rehearsal`): they hold no memory themselves (the rehearsal's ledger holds their claim while
they run) and behave, towards the gate, as the process they stand in for does, without running vLLM.

    python -m vramgate.testing.standin engine           a one-shot engine run: exits 3, having measured nothing
    python -m vramgate.testing.standin refused          an engine vLLM refused to start: its message, exit 1
    python -m vramgate.testing.standin serve CONTROL    a paired engine: ready.json, empty rounds, until "quit"
    python -m vramgate.testing.standin server JSON      an API server: /health answers until SIGINT or SIGTERM
    python -m vramgate.testing.standin client           vLLM's benchmark client: exits 3, no traffic sent
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

from vramgate.runtime.process import end_with_parent

#: The exit status of a stand-in that measured nothing.
STOOD_IN = 3


def _serve(control: Path) -> int:
    control.mkdir(parents=True, exist_ok=True)
    (control / "ready.json").write_text(json.dumps({"init_s": 0.0, "versions": {}}), encoding="utf-8")
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["round"] and len(words) == 2:
            rnd = {"ttft_s": [0.01], "tpot_s": [0.001], "e2e_s": [0.02], "steps_s": [0.001], "wall_s": 0.02}
            tmp = control / f".round-{words[1]}.json"
            tmp.write_text(json.dumps(rnd), encoding="utf-8")
            os.replace(tmp, control / f"round-{words[1]}.json")
        elif words[:1] == ["quit"]:
            break
    return 0


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return None


def _server(server_json: Path) -> int:
    config = json.loads(server_json.read_text(encoding="utf-8"))
    httpd = ThreadingHTTPServer((config["host"], int(config["port"])), _Health)
    done = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"vramgate rehearsal: a vLLM server stood in at {config['host']}:{config['port']}", flush=True)
    done.wait()
    httpd.shutdown()
    return 0


def main(argv: list[str]) -> int:
    """Stand in as *argv* says (the module's docstring); the exit status."""
    end_with_parent()
    mode = argv[0] if argv else ""
    if mode == "engine":
        print("vramgate rehearsal: an engine stood in here and measured nothing", flush=True)
        return STOOD_IN
    if mode == "refused":
        print(os.environ.get("VRAMGATE_STANDIN_MESSAGE", "vLLM refused to start"), flush=True)
        return 1
    if mode == "serve" and len(argv) == 2:
        return _serve(Path(argv[1]))
    if mode == "server" and len(argv) == 2:
        return _server(Path(argv[1]))
    if mode == "client":
        print("vramgate rehearsal: no traffic is sent in a rehearsal", flush=True)
        return STOOD_IN
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
