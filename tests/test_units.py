"""Pure parts of the harness: units, metrics, hardware keys, model sizes, storage, pins."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from vramgate.core.checks import check_baseline, check_budget
from vramgate.core.metrics import Metric, format_value, relative_change
from vramgate.core.provenance import Provenance
from vramgate.machine import hardware
from vramgate.models.config import ModelConfigError, load_model, read_config
from vramgate.store.baselines import DirectoryStorage, NodeBaseline, parse_baseline
from vramgate.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (512, "B", "512 B"),
        (65536, "B", "64.00 KiB"),
        (3 * 2**30, "B", "3.00 GiB"),
        (2.5e-7, "s", "250 ns"),
        (0.0123, "s", "12.3 ms"),
        (4.2, "s", "4.2 s"),
        (0.25, "ratio", "0.25 (25.00%)"),
        (8192, "tokens", "8,192 tokens"),
    ],
)
def test_format_value(value: float, unit: str, text: str) -> None:
    assert format_value(value, unit) == text


def test_precise_bytes() -> None:
    assert format_value(69632, "B", precise=True) == "69,632 B (68.00 KiB)"


def test_relative_change_from_zero() -> None:
    assert relative_change(0, 0) == 0.0
    assert relative_change(5, 0) == float("inf")


def test_exact_comparison_is_one_sided_with_tolerance() -> None:
    base = Metric("m", 100, "B")
    assert check_baseline(Metric("m", 100, "B"), base)[0] == "ok"
    assert check_baseline(Metric("m", 101, "B"), base)[0] == "regressed"
    assert check_baseline(Metric("m", 99, "B"), base)[0] == "improved"
    assert check_baseline(Metric("m", 101, "B", tolerance=0.02), base)[0] == "ok"
    assert check_baseline(Metric("m", 99, "B", better="higher"), Metric("m", 100, "B", better="higher"))[0] == (
        "regressed"
    )


def test_changed_unit_is_incompatible() -> None:
    verdict, _, how = check_baseline(Metric("m", 1, "s"), Metric("m", 1, "B"))
    assert verdict == "incompatible" and "re-record" in how


def test_budget_messages() -> None:
    assert check_budget(Metric("peak", 5, "B", ceiling=5)) is None
    assert check_budget(Metric("peak", 6, "B", ceiling=5)) == "6 B is above its ceiling 5 B (+20.00%)"
    with pytest.raises(ValueError, match="floor 10 is above ceiling 5"):
        Metric("x", 1, "B", ceiling=5, floor=10)


def test_hardware_keys() -> None:
    assert hardware.normalize("Intel(R) Xeon(R) Platinum 8488C CPU @ 2.40GHz") == "intel-xeon-platinum-8488c"
    assert hardware.normalize("AMD EPYC 7763 64-Core Processor") == "amd-epyc-7763"
    gpus = (hardware.GPUInfo("NVIDIA H200", 150_754_820_096, (9, 0)),)
    assert hardware.gpu_key(gpus) == "nvidia-h200-140gb-x1"
    assert hardware.gpu_key(gpus * 8) == "nvidia-h200-140gb-x8"
    fp = hardware.detect()
    assert fp.key.startswith("cpu-") or fp.device == "cuda"
    with pytest.raises(ValueError, match="is not valid"):
        hardware.with_key(fp, "Bad Key/..")


def test_cli_hardware_prints_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["hardware", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fingerprint"]["key"] == hardware.detect().key
    assert data["software"]["python"]


def test_model_sizes_follow_the_architecture() -> None:
    llama = load_model(ROOT, "llama-3.1-8b")
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.use_mla) == (32, 8, 128, False)
    assert llama.bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131072
    assert llama.capacity_tokens(2**30, 16) == 8192
    v3 = load_model(ROOT, "deepseek-v3")
    assert v3.use_mla and v3.kv_head_size == 576
    assert v3.page_bytes(64) == 64 * 576 * 2
    assert v3.page_bytes(64, "fp8") == 64 * 576
    assert v3.bytes_per_token() == 61 * 1152


def test_unknown_model_names_the_available_ones() -> None:
    with pytest.raises(ModelConfigError, match=r"unknown model 'gpt-5'.*available: deepseek-v2, "):
        load_model(ROOT, "gpt-5")


@pytest.mark.parametrize(("content", "message"), [
    (None, r"config\.json: cannot be read: \[Errno 2\] No such file"),
    (b"\xff\xfe", r"config\.json: cannot be read: 'utf-8' codec can't decode"),
    (b'{"model_type": ', r"config\.json: not valid JSON \(line 1, column 16: Expecting value\)"),
    (b"[1, 2]", r"config\.json: must be a JSON object, not list"),
])
def test_one_config_reader_names_the_file_and_the_fault(tmp_path: Path, content: bytes | None, message: str) -> None:
    """load_model and the weight-size model read config.json through read_config: one reader, one set of errors."""
    path = tmp_path / "fixtures" / "models" / "broken" / "config.json"
    path.parent.mkdir(parents=True)
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelConfigError, match=message) as info:
        read_config(path)
    assert str(info.value).startswith(f"{path}: ")
    if content is not None:
        with pytest.raises(ModelConfigError, match=message):
            load_model(tmp_path, "broken")
    assert read_config(ROOT / "fixtures" / "models" / "tiny-llama" / "config.json")["model_type"] == "llama"


def test_unknown_kv_dtype() -> None:
    with pytest.raises(ValueError, match=r"KV cache dtype 'int3' .* accepted: auto, "):
        load_model(ROOT, "llama-3.1-8b").page_bytes(16, "int3")


def _entry(value: int) -> NodeBaseline:
    return NodeBaseline({"m": Metric("m", value, "B")}, Provenance("abc", "2026-01-01T00:00:00Z", {"python": "3"}))


def _update(args: tuple[str, int]) -> None:
    root, i = args
    DirectoryStorage(Path(root)).update("hw", "suite", {"key": "hw"}, {f"t{i}": _entry(i)})


def test_concurrent_updates_merge_and_leave_no_temporary_files(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_update, [(str(tmp_path), i) for i in range(16)])
    path = tmp_path / "hw" / "suite.json"
    data = parse_baseline(path, path.read_text())
    assert sorted(data.tests) == sorted(f"t{i}" for i in range(16))
    assert [p.name for p in path.parent.iterdir() if not p.name.startswith(".suite.lock")] == ["suite.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = DirectoryStorage(tmp_path)
    path = storage.update("hw", "suite", {}, {"t": _entry(1)})
    before = path.read_bytes()

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        DirectoryStorage(tmp_path).update("hw", "suite", {}, {"t": _entry(2)})
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []


def test_peak_rss_probe_sees_an_allocation() -> None:
    from vramgate.machine.probes.cpu import PeakRSS

    with PeakRSS() as probe:
        block = bytearray(200 * 2**20)
        block[:: 4096] = b"\x01" * len(block[:: 4096])  # touch every page
        del block
    if probe.reset_ok:
        assert probe.delta_bytes >= 190 * 2**20
    assert probe.peak_bytes >= probe.start_bytes


def test_allocator_stats_from_memory_stats() -> None:
    from vramgate.machine.probes.cuda import AllocatorStats

    stats = AllocatorStats.from_memory_stats({
        "allocated_bytes.all.current": 10, "allocated_bytes.all.peak": 30, "reserved_bytes.all.current": 40,
        "reserved_bytes.all.peak": 50, "inactive_split_bytes.all.current": 8, "num_alloc_retries": 1,
        "num_ooms": 0,
    })
    assert stats.fragmentation == 0.2 and stats.allocated_peak_bytes == 30 and stats.alloc_retries == 1
    assert AllocatorStats.from_memory_stats({}).fragmentation == 0.0


def test_cpu_timer_returns_seconds_per_call() -> None:
    from vramgate.machine.probes.timers import time_cpu

    calls = []
    samples = time_cpu(lambda: calls.append(1), samples=5, warmup=1, inner=3)
    assert len(samples) == 5 and all(s >= 0 for s in samples) and len(calls) == 18
