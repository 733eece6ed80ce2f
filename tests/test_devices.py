"""CUDA_VISIBLE_DEVICES against a faked NVML: index, UUID and MIG forms give the same devices to the fingerprint,
the GPU-state guard, hygiene and cleanup, and invalid entries end the list as they do for CUDA."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from vramgate.machine import devices, hardware
from vramgate.machine import gpu_processes as gpuclean
from vramgate.machine.devices import Physical, resolve
from vramgate.machine.probes import gpu_state, nvml

GIB = 2**30


@dataclass
class FakeGPU:
    name: str
    uuid: str
    total: int
    used: int
    sm_clock: int
    migs: list[FakeGPU] = field(default_factory=list)
    procs: list[tuple[int, int]] = field(default_factory=list)


def fake_nvml(gpus: list[FakeGPU]) -> Any:
    """A pynvml stand-in with the calls the gate makes; handles are the FakeGPU objects."""
    by_uuid = {g.uuid: g for g in gpus} | {m.uuid: m for g in gpus for m in g.migs}
    mod = types.SimpleNamespace()
    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: len(gpus)
    mod.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    mod.nvmlDeviceGetHandleByUUID = lambda u: by_uuid[u.decode() if isinstance(u, bytes) else u]
    mod.nvmlDeviceGetUUID = lambda h: h.uuid
    mod.nvmlDeviceGetName = lambda h: h.name
    mod.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7 if h.migs else 0

    def mig_by_index(h: FakeGPU, slot: int) -> FakeGPU:
        if slot >= len(h.migs):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return h.migs[slot]

    mod.nvmlDeviceGetMigDeviceHandleByIndex = mig_by_index
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h.total, used=h.used)
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 0)
    mod.nvmlSystemGetDriverVersion = lambda: "580.1"
    mod.nvmlSystemGetCudaDriverVersion = lambda: 13000
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.procs]
    mod.nvmlDeviceGetClockInfo = lambda h, kind: h.sm_clock if kind == 1 else 1593
    mod.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1410 if kind == 1 else 1593
    mod.nvmlDeviceGetTemperature = lambda h, sensor: 40
    mod.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0
    mod.nvmlDeviceGetMemoryBusWidth = lambda h: 5120
    return mod


A100 = "NVIDIA A100-SXM4-40GB"
MIG = FakeGPU(f"{A100} MIG 3g.20gb", "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f", 20 * GIB, 1 * GIB, 0)
HOST = [
    FakeGPU(A100, "GPU-0b8f8e8a-1111-2222-3333-444455556666", 40 * GIB, 1 * GIB, 1410, procs=[(111, 5 * GIB)]),
    FakeGPU(A100, "GPU-1c9e9f9b-1111-2222-3333-444455556666", 40 * GIB, 2 * GIB, 1405),
    FakeGPU(A100, "GPU-2dafa0ac-1111-2222-3333-444455556666", 40 * GIB, 3 * GIB, 1100, migs=[MIG]),
    FakeGPU(A100, "GPU-3ebfb1bd-1111-2222-3333-444455556666", 40 * GIB, 4 * GIB, 1395, procs=[(444, 9 * GIB)]),
]
PHYSICAL = [Physical(i, g.uuid, tuple(m.uuid for m in g.migs)) for i, g in enumerate(HOST)]


@pytest.mark.parametrize(("value", "nvml_indices"), [
    (None, [0, 1, 2, 3]), ("", []), ("3", [3]), ("3,1", [3, 1]), (" 1 , 0 ", [1, 0]),
    ("0,,1", [0]), ("0,7,1", [0]), ("0,x,1", [0]), ("-1,0", []), ("1,1,2", [1]),
    ("GPU-3ebfb1bd-1111-2222-3333-444455556666", [3]), ("GPU-3eb", [3]), ("gpu-3EB,0", [3, 0]),
    ("GPU-", []),  # a prefix of every UUID names no one device
    ("GPU-ffff", []),
])
def test_resolve_like_cuda(value: str | None, nvml_indices: list[int]) -> None:
    seen = resolve(value, PHYSICAL)
    assert [d.nvml_index for d in seen] == nvml_indices
    assert [d.cuda_index for d in seen] == list(range(len(nvml_indices)))


def test_mig_instance_resolves_to_its_own_uuid_on_its_gpu() -> None:
    (device,) = resolve("MIG-5c89852c", PHYSICAL)
    assert device.mig and device.uuid == MIG.uuid and device.nvml_index == 2 and device.cuda_index == 0


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = fake_nvml(HOST)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.mark.parametrize("value", ["3", "GPU-3ebfb1bd-1111-2222-3333-444455556666", "GPU-3ebf"])
def test_index_and_uuid_forms_give_one_fingerprint_and_guard_device(
    host: Any, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    fp = hardware.detect()
    assert fp.key == "nvidia-a100-sxm4-40gb-40gb-x1" and fp.device == "cuda" and fp.portable_key == "cuda"
    state = gpu_state.read_state(0)  # CUDA's device 0 is NVML's 3
    assert state.sm_clock_mhz == 1395 and state.processes == {444: 9 * GIB}
    assert nvml.read_device(0).used_bytes == 4 * GIB


def test_mig_form_fingerprints_the_instance(host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG.uuid)
    fp = hardware.detect()
    assert fp.key == "nvidia-a100-sxm4-40gb-mig-3g.20gb-20gb-x1"
    assert gpu_state.read_state(0).sm_clock_mhz == 1100  # clocks are its GPU's
    assert nvml.read_device(0).total_bytes == 20 * GIB  # memory is the instance's


def test_invalid_entry_stops_the_list(host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,,1")
    assert len(hardware.detect().gpus) == 1
    with pytest.raises(nvml.NVMLUnavailable, match="CUDA device 1 is not visible"):
        gpu_state.read_state(1)


def test_hygiene_and_cleanup_see_only_this_jobs_gpus(host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vramgate.pytest_plugin.hygiene import device_readings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    readings = device_readings()
    assert readings is not None and set(readings) == {0} and readings[0].processes == {444: 9 * GIB}
    assert [(p.pid, p.device) for p in gpuclean.gpu_processes()] == [(444, 0)]  # not pid 111 on GPU 0


def test_handle_names_what_is_visible(host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(devices.NotVisible, match=r"CUDA_VISIBLE_DEVICES='': 0 device\(s\) visible"):
        devices.handle(host, 0)


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), ("3,1", "3,1"), (" 1 , 0 ", "1,0"), ("0,7,1", "0"),
    ("GPU-3eb", "GPU-3ebfb1bd-1111-2222-3333-444455556666"),
    ("gpu-3EB,0", "GPU-3ebfb1bd-1111-2222-3333-444455556666,0"),
    ("MIG-5c89852c", MIG.uuid),
    ("GPU-ffff", "GPU-ffff"),  # names no device: left as it is, the engine fails as CUDA would
])
def test_engines_get_the_devices_cuda_sees_with_full_uuids(value: str | None, expected: str | None) -> None:
    """Note [full UUIDs for vLLM]: vLLM looks a non-index entry up with nvmlDeviceGetHandleByUUID, which needs the
    full UUID, and splits the value past where CUDA stops."""
    assert devices.engine_value(value, PHYSICAL) == expected


def test_an_engines_environment_names_its_gpus_by_full_uuid(host: Any, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Any) -> None:
    from vramgate.engine import EngineSpec
    from vramgate.engine.runner import engine_process_env

    spec = EngineSpec(model="tiny-llama")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3eb,GPU-1c9")
    assert engine_process_env(spec, tmp_path)["CUDA_VISIBLE_DEVICES"] == f"{HOST[3].uuid},{HOST[1].uuid}"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert engine_process_env(spec, tmp_path)["CUDA_VISIBLE_DEVICES"] == "2,0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in engine_process_env(spec, tmp_path)
