"""A GPU attention backend named by a spec, judged before an engine starts by the backend's own
``validate_configuration`` (:func:`vramgate.engine.spec.backend_problem`), with vLLM's classes faked: no vLLM or
torch is installed where these run. The names faked here are pinned against vLLM's source in
``tests/test_vllm_memory_contracts.py``."""

from __future__ import annotations

import enum
import types
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import pytest

from module_fakes import fake_modules
from vramgate.engine import EngineSpec, SpecError, backend_problem, validate
from vramgate.engine.spec import UnsupportedHere
from vramgate.machine import hardware
from vramgate.models.config import load_model
from vramgate.runtime import engine_env

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
HOPPER_ONLY = "FlashMLA Dense is only supported on Hopper devices."


class DeviceCapability(NamedTuple):
    major: int
    minor: int


class AttentionType(enum.Enum):  # a str Enum in vLLM; plain here, so that only the member itself matches
    DECODER = "decoder"


class FakeBackend:
    """vLLM 0.32.0's ``AttentionBackend`` classmethods that ``validate_configuration`` consults, reduced; the
    signature is vLLM's, so an argument the gate names wrongly fails the call."""

    block_sizes: tuple[int, ...] = ()
    mla = False
    calls: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int]:
        return list(cls.block_sizes)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or not cls.block_sizes or block_size in cls.block_sizes

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return True

    @classmethod
    def supports_combination(cls, head_size: int, dtype: Any, kv_cache_dtype: str | None, block_size: int | None,
                             use_mla: bool, has_sink: bool, use_sparse: bool, use_mm_prefix: bool,
                             device_capability: DeviceCapability) -> str | None:
        return None

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: Any, kv_cache_dtype: str | None, block_size: int | None,
                               use_mla: bool, has_sink: bool, use_sparse: bool, use_mm_prefix: bool,
                               use_per_head_quant_scales: bool, device_capability: DeviceCapability, attn_type: str,
                               has_sliding_window: bool = False, use_non_causal: bool = False,
                               use_batch_invariant: bool = False, use_kv_connector: bool = False,
                               use_pcp: bool = False, use_adaptive_verification: bool = False,
                               use_dcp: bool = False, use_rswa: bool = False) -> list[str]:
        cls.calls.append(dict(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                              use_mla=use_mla, use_sparse=use_sparse, device_capability=device_capability,
                              attn_type=attn_type, use_dcp=use_dcp))
        reasons = []
        if not cls.supports_block_size(block_size):
            reasons.append("block_size not supported")
        if use_mla != cls.mla:
            reasons.append("MLA not supported" if use_mla else "non-MLA not supported")
        if not cls.supports_compute_capability(device_capability):
            reasons.append("compute capability not supported")
        combination = cls.supports_combination(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                               use_sparse, False, device_capability)
        if combination is not None:
            reasons.append(combination)
        return reasons


class FakeFlashMLA(FakeBackend):
    """FlashMLABackend: kernel block size 64, capability 9.x and 10.x by its class, but the dense kernel
    (``is_flashmla_dense_supported``, asked by ``supports_combination``) runs on Hopper only."""

    block_sizes = (64,)
    mla = True
    device = DeviceCapability(10, 0)  # what vLLM's current platform reads of this process's first GPU

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major in (9, 10)

    @classmethod
    def supports_combination(cls, *args: Any) -> str | None:
        return None if cls.device.major == 9 else HOPPER_ONLY


class FakeFlashAttn(FakeBackend):
    """FlashAttentionBackend: no MLA."""

    block_sizes = (16, 32, 64, 128)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[FakeBackend]:
    """vLLM's modules that backend_problem imports, and torch's dtypes, faked; this interpreter is the gate's."""

    class AttentionBackendEnum(enum.Enum):
        FLASHMLA = "FLASHMLA"
        FLASH_ATTN = "FLASH_ATTN"

        def get_class(self) -> type[FakeBackend]:
            return {"FLASHMLA": FakeFlashMLA, "FLASH_ATTN": FakeFlashAttn}[self.value]

    fake_modules(monkeypatch, {
        "vllm.platforms.interface": {"DeviceCapability": DeviceCapability},
        "vllm.v1.attention.backend": {"AttentionType": AttentionType},
        "vllm.v1.attention.backends.registry": {"AttentionBackendEnum": AttentionBackendEnum},
        "torch": {"bfloat16": "torch.bfloat16", "float16": "torch.float16", "float32": "torch.float32"},
    })
    gate = types.SimpleNamespace(is_gate_interpreter=True)
    monkeypatch.setattr(engine_env, "current", lambda: gate)
    monkeypatch.setattr(FakeBackend, "calls", [])
    return FakeBackend


def _flashmla(**changes: Any) -> EngineSpec:
    spec = EngineSpec(model="tiny-deepseek-v2", block_size=16, max_model_len=256,
                      engine_args={"attention_backend": "FLASHMLA", "block_size": 64})
    return spec.replace(**changes)


def test_flashmla_dense_on_blackwell_is_not_runnable(fake_vllm: type[FakeBackend],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SM100 passes FlashMLA's block size and capability checks, but its dense kernel is Hopper-only: vLLM's own
    validation says so, and that is the reason (the GPU's: a skip)."""
    monkeypatch.setattr(FakeFlashMLA, "device", DeviceCapability(10, 0))
    shape = load_model(ROOT, "tiny-deepseek-v2")
    found = backend_problem(_flashmla(), (10, 0), shape)
    assert found == (f"attention_backend 'FLASHMLA' is not valid for this configuration: {HOPPER_ONLY}", True)
    call = fake_vllm.calls[-1]
    assert call == dict(head_size=576, dtype="torch.bfloat16", kv_cache_dtype="auto", block_size=64, use_mla=True,
                        use_sparse=False, device_capability=DeviceCapability(10, 0), attn_type=AttentionType.DECODER,
                        use_dcp=False)
    monkeypatch.setattr(FakeFlashMLA, "device", DeviceCapability(9, 0))
    assert backend_problem(_flashmla(), (9, 0), shape) is None


def test_validate_skips_flashmla_on_a_blackwell_gpu(fake_vllm: type[FakeBackend],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeFlashMLA, "device", DeviceCapability(10, 0))
    monkeypatch.setattr(hardware, "visible_gpus", lambda: (hardware.GPUInfo("B200", 180 * GIB, (10, 0)),))
    with pytest.raises(UnsupportedHere, match="FlashMLA Dense is only supported on Hopper devices"):
        validate(_flashmla(), ROOT, tier="gpu")


def test_the_block_size_and_capability_reasons_stay(fake_vllm: type[FakeBackend]) -> None:
    shape = load_model(ROOT, "tiny-deepseek-v2")
    assert backend_problem(_flashmla(engine_args={"attention_backend": "FLASHMLA"}), (9, 0), shape) == (
        "attention_backend 'FLASHMLA' runs kernel block sizes 64, not block_size 16", False)
    assert backend_problem(_flashmla(), (8, 0), shape) == (
        "attention_backend 'FLASHMLA' does not run on compute capability 8.0", True)
    # without the GPU's capability or the model, only the block size is checked (as before)
    assert backend_problem(_flashmla(), None, shape) is None
    assert backend_problem(_flashmla(), (10, 0)) is None
    assert fake_vllm.calls == []


def test_a_reason_of_the_spec_is_an_error_not_a_skip(fake_vllm: type[FakeBackend],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLA model with a backend that has no MLA is the spec's mistake on every GPU."""
    spec = _flashmla(engine_args={"attention_backend": "FLASH_ATTN"})
    assert backend_problem(spec, (9, 0), load_model(ROOT, "tiny-deepseek-v2")) == (
        "attention_backend 'FLASH_ATTN' is not valid for this configuration: MLA not supported", False)
    monkeypatch.setattr(hardware, "visible_gpus", lambda: (hardware.GPUInfo("H100", 80 * GIB, (9, 0)),))
    with pytest.raises(SpecError, match="MLA not supported") as info:
        validate(spec, ROOT, tier="gpu")
    assert not isinstance(info.value, UnsupportedHere)
    llama = EngineSpec(model="tiny-llama", engine_args={"attention_backend": "FLASH_ATTN"})
    assert backend_problem(llama, (9, 0), load_model(ROOT, "tiny-llama")) is None
    assert fake_vllm.calls[-1]["head_size"] == 64 and fake_vllm.calls[-1]["use_mla"] is False
