"""The serving memory check's leak floor on this machine: its false alarms on an unchanged server and its
detections of planted leaks, in the gate's configuration (docs/online-serving.md, "The leak floor").

``python -m vramgate.tools.calibration.leak_floor OUT [--soak N] [--plants request:65536,...]`` starts the
unchanged server of the serving suite's CPU entry (tiny-llama, 2 GiB, eager) and one server per planted leak
(:mod:`vramgate.tools.calibration.leak_plants`: bytes kept per request, or per output token), warms each up as
the gate does (until its memory settles: Note [settled warm-up] in :mod:`vramgate.engine.leak`), then runs one
sustained load of *N* requests on each (the gate's concurrency and lengths), one server after the other, in one
client process. ``--from DATA.json`` analyses a saved campaign instead. It writes ``leak-floor.json`` (the
samples and the figures) and ``leak-floor.md``.

Each load is cut into windows of the pre-merge load's length (400 requests), each judged as
``test_serving_memory`` judges its load (:func:`vramgate.core.leak.fit_leak`, the pre-merge allowance); the whole
load is judged as the nightly soak is, at the soak's allowance. Beyond the real plants, each unchanged window (and
soak) is judged again with a leak of each size added to its samples (the bytes a plant keeps, at each sample's
completed requests): the detection of a size is the share of windows whose bound clears the allowance, and the
floor is the smallest size caught in at least 95% of them. The real plants check that an added leak reads as a
planted one does. The windows after the first follow a longer warm-up than the gate's first (the windows before
them): the first window of each load is the gate's own case, and the report shows it apart.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramgate.core.leak import ALPHA, fit_leak

#: The planted leaks a campaign runs by default: per request 16 and 64 KiB, per output token 512 B (16 KiB per
#: request of 32 tokens).
DEFAULT_PLANTS = ("request:16384", "request:65536", "token:512")
#: The leaks (bytes per request) added to the unchanged windows.
ADDED_KIB = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: The detection a floor needs.
FLOOR_DETECTION = 0.95


def _fit(points: Sequence[tuple[float, float]], per: str = "request") -> Any:
    return fit_leak(points, per=per)


def window_points(server: dict[str, Any], window: tuple[float, float], per: str = "request",
                  added: float = 0.0) -> list[tuple[float, float]]:
    """The samples of *server* (a campaign's record) within *window* (its moments), placed at the requests (tokens)
    completed by then, with *added* bytes per request (token) more."""
    done = sorted((float(t), int(n)) for t, n in server["completions"])
    counts, total = [], 0.0
    for _, n in done:
        total += 1 if per == "request" else n
        counts.append(total)
    moments = [t for t, _ in done]
    import bisect

    out = []
    for t, b in server["samples"]:
        if window[0] <= t <= window[1]:
            k = bisect.bisect_right(moments, t)
            x = counts[k - 1] if k else 0.0
            out.append((x, float(b) + added * x))
    return out


def _rate(hits: int, n: int) -> str:
    return f"{hits}/{n}" if n else "-"


def upper_95(hits: int, n: int) -> float:
    """The one-sided 95% upper bound of a rate seen *hits* times in *n* trials (Clopper-Pearson; 3/n at zero)."""
    if n == 0:
        return 1.0
    if hits == n:
        return 1.0
    lo, hi = hits / n, 1.0
    for _ in range(60):  # bisection on the binomial tail P(X <= hits; p) = 0.05
        mid = (lo + hi) / 2
        tail = sum(math.comb(n, k) * mid ** k * (1 - mid) ** (n - k) for k in range(hits + 1))
        lo, hi = (mid, hi) if tail > 0.05 else (lo, mid)
    return hi


def windows_of(server: dict[str, Any], requests: int) -> list[tuple[float, float]]:
    """Consecutive windows of *requests* completions of *server*'s measured load (its ``loads``, after the warm-up),
    as (first, last) moments."""
    loads = [(float(a), float(b)) for a, b in server["loads"]]
    done = sorted(float(t) for t, _ in server["completions"] if any(a <= t <= b for a, b in loads))
    return [(done[k], done[k + requests - 1]) for k in range(0, len(done) - requests + 1, requests)]


def analyze(data: dict[str, Any], allowance: float, soak_allowance: float, requests: int) -> dict[str, Any]:
    """The campaign's figures: per server, the fit of each window of *requests* at the pre-merge *allowance*
    (bytes per request) and the whole load's at *soak_allowance*; the added leaks' detections on the unchanged
    windows and soaks; the floors."""
    servers = []
    unchanged: list[list[tuple[float, float]]] = []
    unchanged_soaks: list[list[tuple[float, float]]] = []
    for name, server in zip(data["names"], data["servers"], strict=True):
        windows, fits = [], []
        for w in windows_of(server, requests):
            try:
                fits.append(_fit(window_points(server, w)))
            except ValueError:  # too few samples to fit (a fast machine, a sampler slowed by many servers): left out
                continue
            windows.append(w)
        whole = [(float(a), float(b)) for a, b in server["loads"]]
        soaks = [_fit(window_points(server, w)) for w in whole]
        per_token = [_fit(window_points(server, w, "token"), "token") for w in windows]
        servers.append({
            "name": name,
            "windows": [{"slope": f.slope, "stderr": f.stderr, "lower": f.lower, "alarm": f.shows_leak(allowance),
                         "floor": f.floor(allowance)} for f in fits],
            "per_token": [{"slope": f.slope, "lower": f.lower} for f in per_token],
            "soaks": [{"slope": f.slope, "stderr": f.stderr, "lower": f.lower, "alarm": f.shows_leak(soak_allowance),
                       "floor": f.floor(soak_allowance)} for f in soaks],
        })
        if name == "unchanged":
            unchanged += [window_points(server, w) for w in windows]
            unchanged_soaks += [window_points(server, w) for w in whole]
    added = []
    for kib in ADDED_KIB:
        b = kib * 1024.0
        caught = sum(_fit([(x, y + b * x) for x, y in pts]).shows_leak(allowance) for pts in unchanged)
        soak_caught = sum(_fit([(x, y + b * x) for x, y in pts]).shows_leak(soak_allowance)
                          for pts in unchanged_soaks)
        added.append({"kib_per_request": kib, "caught": caught, "windows": len(unchanged),
                      "soak_caught": soak_caught, "soaks": len(unchanged_soaks)})

    def floor(key: str, total: str) -> float | None:
        ok = [a["kib_per_request"] for a in added if a[total] and a[key] / a[total] >= FLOOR_DETECTION]
        return min(ok) if ok else None

    return {"allowance": allowance, "soak_allowance": soak_allowance, "requests": requests, "alpha": ALPHA,
            "servers": servers, "added": added, "floor_kib": floor("caught", "windows"),
            "soak_floor_kib": floor("soak_caught", "soaks")}


def render(figures: dict[str, Any], about: str = "") -> str:
    """The figures as Markdown."""
    kib = 1024.0
    lines = ["# The serving memory check's leak floor", ""]
    if about:
        lines += [about, ""]
    lines += [f"Allowance {figures['allowance'] / kib:g} KiB per request pre-merge, "
              f"{figures['soak_allowance'] / kib:g} KiB per request for the soak (the whole load); a verdict fails "
              f"when the slope's {1 - figures['alpha']:.1%} lower bound is above it. Windows of "
              f"{figures['requests']} requests; slopes in KiB per request, the first window's first.", "",
              "| server | windows | slopes | standard errors | alarms | soak: slope ± standard error | soak alarm |",
              "|---|---|---|---|---|---|---|"]
    for s in figures["servers"]:
        w, so = s["windows"], s["soaks"]
        slopes = " ".join(f"{x['slope'] / kib:.1f}" for x in w)
        soak = " ".join(f"{x['slope'] / kib:.2f} ± {x['stderr'] / kib:.2f}" for x in so)
        spread = f"{statistics.median(x['stderr'] for x in w) / kib:.2f} (median)" if w else "-"
        lines.append(f"| {s['name']} | {len(w)} | {slopes} | {spread} | {_rate(sum(x['alarm'] for x in w), len(w))} | "
                     f"{soak} | {_rate(sum(x['alarm'] for x in so), len(so))} |")
    lines += ["", "Leaks added to the unchanged server's windows:", "",
              "| added (KiB/request) | caught pre-merge | caught by the soak |", "|---|---|---|"]
    for a in figures["added"]:
        lines.append(f"| {a['kib_per_request']} | {_rate(a['caught'], a['windows'])} | "
                     f"{_rate(a['soak_caught'], a['soaks'])} |")
    unchanged = next((s for s in figures["servers"] if s["name"] == "unchanged"), None)
    if unchanged:
        n = len(unchanged["windows"])
        hits = sum(x["alarm"] for x in unchanged["windows"])
        lines += ["", f"Floor (smallest added leak caught in at least {FLOOR_DETECTION:.0%} of windows): pre-merge "
                      f"{figures['floor_kib']} KiB per request, soak {figures['soak_floor_kib']} KiB per request. "
                      f"False alarms: {hits} of {n} unchanged windows (one-sided 95% upper bound "
                      f"{upper_95(hits, n):.1%}); the fit's own rate at a true slope at the allowance is "
                      f"{figures['alpha']:.1%} per verdict."]
    return "\n".join(lines) + "\n"


def run_campaign(root: Path, out: Path, plants: Sequence[str], soak: int, concurrency: int) -> dict[str, Any]:
    """Start the unchanged server and one per plant, warm each up as the gate does, and run one sustained load of
    *soak* requests on each, one after the other; the samples, completions and load of each server."""
    from vramgate.engine.leak import WarmUp
    from vramgate.engine.load import Load, run_plan
    from vramgate.engine.server import ApiServer
    from vramgate.engine.spec import EngineSpec
    from vramgate.tools.calibration.leak_plants import write_leak_plant

    project = out / "project"
    (project / "patches").mkdir(parents=True, exist_ok=True)
    for name in ("fixtures", "vramgate.toml"):  # the project's matrix file, where it has one
        if (root / name).exists() and not (project / name).exists():
            (project / name).symlink_to((root / name).resolve())
    names: list[str] = ["unchanged"]
    profiles: list[str | None] = [None]
    for plant in plants:
        per, _, size = plant.partition(":")
        folder = write_leak_plant(project / "patches", int(size), per)
        names.append(folder.name)
        profiles.append(folder.name)
    servers = [ApiServer(EngineSpec(model="tiny-llama", kv_budget_gib=None, block_size=32, cpu_memory_bytes=2 << 30,
                                    enforce_eager=True, max_model_len=1024, max_num_seqs=32, profile=p),
                         project, out / f"server-{n}") for n, p in enumerate(profiles)]
    try:
        for server in servers:
            server.start()
        items = [(i, Load(num_prompts=soak, request_rate=math.inf, max_concurrency=concurrency, seed=1 + i),
                  f"soak-{i}") for i in range(len(servers))]
        run = run_plan(items, servers, out / "load", warmup=WarmUp(chunk=max(5 * concurrency, 8)))
    finally:
        for server in servers:
            server.stop()
    return {"names": names, "concurrency": concurrency,
            "servers": [{"samples": [[s.t, s.rss_bytes] for s in run.memory[i]],
                         "completions": [list(c) for r in run.results[i] for c in r.completions],
                         "loads": [[r.t_start, r.t_end] for r in run.results[i]],
                         "warmup_levels": run.warmup_levels[i]} for i in range(len(servers))]}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m vramgate.tools.calibration.leak_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the project (default: here)")
    parser.add_argument("--soak", type=int, default=3000, help="requests of each server's load (default 3000)")
    parser.add_argument("--requests", type=int, default=400, help="requests per window (the pre-merge load's: 400)")
    parser.add_argument("--concurrency", type=int, default=8, help="the sustained concurrency (the gate's: 8)")
    parser.add_argument("--plants", default=",".join(DEFAULT_PLANTS),
                        help="planted leaks, PER:BYTES, comma-separated (default %(default)s)")
    parser.add_argument("--allowance-kib", type=float, default=24.0,
                        help="pre-merge allowance, KiB per request (the serving suite's: 24)")
    parser.add_argument("--soak-allowance-kib", type=float, default=8.0,
                        help="the soak's allowance, KiB per request (the serving suite's: 8)")
    parser.add_argument("--from", dest="from_json", type=Path, help="analyse a saved leak-floor.json instead")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(args.from_json.read_text(encoding="utf-8"))["data"]
    else:
        t0 = time.monotonic()
        data = run_campaign(args.root, args.out, [p for p in args.plants.split(",") if p], args.soak,
                            args.concurrency)
        data["seconds"] = round(time.monotonic() - t0)
        # the samples first: an analysis that fails leaves them for --from
        (args.out / "leak-floor.json").write_text(json.dumps({"data": data}), encoding="utf-8")
    figures = analyze(data, args.allowance_kib * 1024, args.soak_allowance_kib * 1024, args.requests)
    (args.out / "leak-floor.json").write_text(json.dumps({"data": data, "figures": figures}), encoding="utf-8")
    text = render(figures, f"One sustained load per server ({len(data['servers'][0]['completions'])} requests of the "
                           f"unchanged one) at concurrency {data.get('concurrency', 8)}, after the gate's warm-up.")
    (args.out / "leak-floor.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
