"""The tensor-parallel launcher and helpers without torch: specs, results, overlap math, failures, cleanup."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from vramgate.machine.gpu_processes import alive
from vramgate.tp import (
    Launcher,
    MLPShape,
    RankResult,
    TPError,
    TPSpec,
    TPSpecError,
    overlap_fraction,
    peak_change,
    read_results,
    run_tp,
)
from vramgate.tp import launch as tp
from vramgate.tp.launch import free_port, rank_env

SHAPE = MLPShape(tokens=64, hidden=32, intermediate=96)


def _fake(code: str) -> list[str]:
    """A rank command: Python running *code* with RANK, WORLD_SIZE etc. in its environment."""
    return [sys.executable, "-c", code]


# -- pure helpers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("comm", "compute", "step", "expected"),
    [
        (10.0, 100.0, 110.0, 0.0),   # back to back: nothing hidden
        (10.0, 100.0, 100.0, 1.0),   # all communication hidden behind compute
        (10.0, 100.0, 105.0, 0.5),
        (10.0, 100.0, 130.0, 0.0),   # slower than serial: clipped
        (10.0, 100.0, 90.0, 1.0),    # faster than the longer alone (noise): clipped
        (100.0, 10.0, 104.0, 0.6),   # compute is the shorter one
    ],
)
def test_overlap_fraction(comm: float, compute: float, step: float, expected: float) -> None:
    assert overlap_fraction(comm, compute, step) == pytest.approx(expected)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_overlap_fraction_rejects_non_positive_times(bad: float) -> None:
    with pytest.raises(ValueError, match=r"overlap_fraction: t_step must be a positive number of seconds"):
        overlap_fraction(1.0, 1.0, bad)


def test_peak_change() -> None:
    assert peak_change(4.7, 3.8) == pytest.approx(-0.1915, abs=1e-4)  # the article's 19%
    assert peak_change(100, 105) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="baseline peak must be positive"):
        peak_change(0, 1)


def test_tensor_bytes() -> None:
    t = MLPShape(tokens=512, hidden=2048, intermediate=2816).tensor_bytes(2, 4)
    assert t["gathered"] == 512 * 2048 * 4 == t["down"]
    assert t["gate_up"] == 512 * 2816 * 4
    assert t["act"] == 512 * 1408 * 4
    assert t["out"] == 256 * 2048 * 4
    assert t["step_peak"] == t["gathered"] + t["gate_up"]
    assert MLPShape(4, 2, 6).weight_bytes_per_rank(2, 2) == 3 * 2 * 3 * 2


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_rank_env() -> None:
    env = rank_env({"PATH": "/bin", "PYTHONPATH": "elsewhere"}, rank=1, world_size=2, port=1234, device="cpu")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].endswith(os.pathsep + "elsewhere")
    assert Path(env["PYTHONPATH"].split(os.pathsep)[0], "vramgate", "tp", "launch.py").is_file()
    assert "OMP_NUM_THREADS" not in rank_env({}, rank=0, world_size=2, port=1, device="cuda")


# -- specs --------------------------------------------------------------------------------


def test_spec_round_trip() -> None:
    spec = TPSpec(world_size=2, device="cpu", shape=SHAPE, hold_rank=1, hold_s=3)
    data = json.loads(json.dumps(spec.to_json()))
    assert TPSpec.from_json(data) == spec
    assert spec.backend == "gloo" and TPSpec(world_size=4, device="cuda", shape=SHAPE).backend == "nccl"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"world_size": 0}, "field 'world_size' = 0: need an integer >= 1"),
        ({"device": "tpu"}, "field 'device' = 'tpu': accepted: cpu, cuda"),
        ({"variants": ("sync", "ring")}, "field 'variants': 'ring' is not one of sync, overlap, fused"),
        ({"variants": ()}, "field 'variants': need at least one of"),
        ({"variants": ("sync", "sync")}, "names a variant twice"),
        ({"variants": ("fused",)}, "'fused' (torch's symmetric-memory fused all-gather matmul) runs on device 'cuda'"),
        ({"dtype": "int8"}, "field 'dtype' = 'int8': accepted: float32, bfloat16, float16"),
        ({"samples": 1}, "field 'samples' = 1: need an integer >= 2"),
        ({"chunks": 3}, "shape field 'tokens' = 64: must be a multiple of world_size x chunks = 2 x 3 = 6"),
        ({"shape": MLPShape(64, 32, 95)}, "shape field 'intermediate' = 95: must be a multiple of world_size 2"),
        ({"shape": MLPShape(64, 0, 96)}, "shape field 'hidden' = 0: need a positive integer"),
        ({"timeout_s": 0}, "field 'timeout_s' = 0: need a positive number of seconds"),
        ({"hold_rank": 2}, "field 'hold_rank' = 2: need a rank in 0..1 or None"),
        ({"hold_s": -1}, "field 'hold_s' = -1: need a number of seconds >= 0"),
    ],
)
def test_bad_spec_names_the_field(changes: dict[str, object], message: str) -> None:
    spec = TPSpec(world_size=2, device="cpu", shape=SHAPE, chunks=2)
    for name, value in changes.items():
        object.__setattr__(spec, name, value)
    with pytest.raises(TPSpecError) as info:
        spec.validate("spec.json")
    assert str(info.value).startswith("spec.json")
    assert message in str(info.value)


def test_spec_from_json_errors() -> None:
    good = TPSpec(world_size=2, device="cpu", shape=SHAPE).to_json()
    with pytest.raises(TPSpecError, match=r"spec\.json: unknown field\(s\) wrold_size; accepted: chunks, "):
        TPSpec.from_json({**good, "wrold_size": 2}, "spec.json")
    with pytest.raises(TPSpecError, match=r"spec\.json field 'shape': need an object with tokens, hidden, inter"):
        TPSpec.from_json({**good, "shape": [64, 32, 96]}, "spec.json")
    with pytest.raises(TPSpecError, match=r"spec\.json: must be a JSON object"):
        TPSpec.from_json([], "spec.json")


# -- results ------------------------------------------------------------------------------


def result_json(rank: int = 0, rounds: int = 3) -> dict[str, object]:
    variant = {"step_s": [0.11] * rounds, "peak_bytes": [100] * rounds, "comm_s": [0.02] * rounds,
               "comm_peak_bytes": [50] * rounds, "max_abs_err": 1e-6}
    return {"rank": rank, "world_size": 2, "backend": "gloo", "device": "cpu", "device_name": "cpu",
            "versions": {"torch": "x"}, "memory_probe": "peak_rss", "variants": {"sync": variant},
            "compute_s": [0.1] * rounds, "tolerance": 1e-4, "reference_max_abs": 3.0, "notes": []}


def test_result_parse_and_overlap() -> None:
    r = RankResult.from_json(result_json(), "rank0.json")
    assert r.variants["sync"].peak_bytes == [100, 100, 100]
    assert r.overlap("sync") == [pytest.approx(0.5)] * 3  # (0.02 + 0.1 - 0.11) / 0.02
    assert RankResult.from_json(json.loads(json.dumps(r.to_json())), "again") == r


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("compute_s"), "rank0.json: missing field(s) compute_s"),
        (lambda d: d.update(variants={}), "rank0.json field 'variants': need an object of variant results"),
        (lambda d: d["variants"]["sync"].pop("comm_s"), "field 'variants.sync': need step_s, peak_bytes, comm_s"),
        (lambda d: d["variants"]["sync"]["step_s"].pop(), "field 'variants.sync': 2 step times, 3 peaks"),
        (lambda d: d.update(compute_s=[1.0]), "field 'compute_s': need a list of at least 2 samples"),
    ],
)
def test_malformed_result_names_the_field(mutate, message: str) -> None:
    data = result_json()
    mutate(data)
    with pytest.raises(TPError) as info:
        RankResult.from_json(data, "rank0.json")
    assert message in str(info.value)


def test_missing_result_names_the_rank(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps(result_json(0)))
    (tmp_path / "rank1.log").write_text("finished without writing\n")
    with pytest.raises(TPError, match=r"rank 1 exited 0 but left no readable result") as info:
        read_results(tmp_path, 2)
    assert info.value.rank == 1 and "finished without writing" in str(info.value)


# -- the launcher -------------------------------------------------------------------------


def test_ranks_get_their_environment(tmp_path: Path) -> None:
    code = ("import os, json; keys = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS'); "
            "open(f\"rank{os.environ['RANK']}.env\", 'w').write(json.dumps({k: os.environ[k] for k in keys}))")
    with Launcher(_fake(code), 3, tmp_path, timeout_s=60, port=4321) as ranks:
        ranks.wait()
    envs = [json.loads((tmp_path / f"rank{r}.env").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["MASTER_PORT"] for e in envs} == {"4321"} and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and {e["OMP_NUM_THREADS"] for e in envs} == {"1"}


def test_a_failing_rank_stops_the_others_and_names_itself(tmp_path: Path) -> None:
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    print('loading shard 1', flush=True); time.sleep(0.3); sys.exit('collective failed (simulated)')\n"
            "print('waiting in a barrier', flush=True); time.sleep(600)\n")
    ranks = Launcher(_fake(code), 2, tmp_path, timeout_s=60)
    with ranks, pytest.raises(TPError) as info:
        ranks.wait()
    text = str(info.value)
    assert info.value.rank == 1 and info.value.run_dir == tmp_path
    assert "tensor-parallel rank 1 of 2 exited with status 1 after" in text
    assert "loading shard 1" in text and "collective failed (simulated)" in text
    assert "rank 0 was killed by SIGTERM; its last line: waiting in a barrier" in text
    assert not any(alive(pid) for pid in ranks.pids)


def test_a_killed_rank_is_blamed_before_the_peers_it_broke(tmp_path: Path) -> None:
    """Rank 1 is killed; rank 0 then fails on its own (a dead peer): the error names rank 1."""
    code = ("import os, sys, time\n"
            "rank = os.environ['RANK']\n"
            "open(f'rank{rank}.ready', 'w').close(); print(f'rank {rank} in its step', flush=True)\n"
            "if rank == '0':\n"
            "    while os.path.exists('peer-alive'): time.sleep(0.01)\n"
            "    sys.exit('connection closed by peer')\n"
            "time.sleep(600)\n")
    (tmp_path / "peer-alive").touch()
    ranks = Launcher(_fake(code), 2, tmp_path, timeout_s=60)
    with ranks:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"rank{r}.ready").exists() for r in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        (tmp_path / "peer-alive").unlink()
        time.sleep(0.5)  # rank 0 fails too, before the launcher looks
        with pytest.raises(TPError) as info:
            ranks.wait()
    assert info.value.rank == 1
    assert "rank 1 of 2 was killed by SIGKILL" in str(info.value)
    assert "rank 0 exited with status 1; its last line: connection closed by peer" in str(info.value)
    assert "rank 1 in its step" in info.value.log_tail


def test_timeout_stops_every_rank_and_its_children(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "open(f'child{child.pid}', 'w').close(); print('stuck in all_gather', flush=True); time.sleep(600)\n")
    ranks = Launcher(_fake(code), 2, tmp_path, timeout_s=2)
    with ranks, pytest.raises(TPError) as info:
        ranks.wait()
    text = str(info.value)
    assert "tensor-parallel run timed out after 2 s with rank(s) 0, 1 of 2 still running" in text
    assert text.count("stuck in all_gather") == 2 and info.value.rank is None
    children = [int(p.name[5:]) for p in tmp_path.glob("child*")]
    assert len(children) == 2
    time.sleep(0.2)
    assert not any(alive(pid) for pid in ranks.pids + children)


def test_run_tp_retries_a_taken_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 could not bind the rendezvous port the first time: run_tp starts again on a new port."""
    code = ("import json, os, sys\n"
            "rank = int(os.environ['RANK'])\n"
            "if rank == 0 and not os.path.exists('tried'):\n"
            "    open('tried', 'w').close(); sys.exit('EADDRINUSE: Address already in use')\n"
            f"data = json.loads({json.dumps(json.dumps(result_json()))}); data['rank'] = rank\n"
            "open(f'rank{rank}.json', 'w').write(json.dumps(data))\n")
    monkeypatch.setattr(tp, "worker_command", lambda spec_path, python=None: _fake(code))
    spec = TPSpec(world_size=2, device="cpu", shape=SHAPE, timeout_s=60)
    results = run_tp(spec, tmp_path)
    assert [r.rank for r in results] == [0, 1] and (tmp_path / "tried").exists()
    assert json.loads((tmp_path / "spec.json").read_text()) == spec.to_json()


def test_run_tp_does_not_retry_other_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = ("import os, sys, time\n"
            "open(f\"try{os.environ['RANK']}-{os.getpid()}\", 'w').close()\n"
            "if os.environ['RANK'] == '1': time.sleep(600)\n"
            "sys.exit(3)\n")
    monkeypatch.setattr(tp, "worker_command", lambda spec_path, python=None: _fake(code))
    with pytest.raises(TPError, match=r"rank 0 of 2 exited with status 3"):
        run_tp(TPSpec(world_size=2, device="cpu", shape=SHAPE, timeout_s=60), tmp_path)
    assert len(list(tmp_path.glob("try0-*"))) == 1
