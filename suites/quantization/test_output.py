"""Output sanity of vLLM's 4-bit linear layers: kernel output against a dequantized fp32 reference.

For every linear layer of each generated tiny-llama checkpoint, vLLM's own
linear method for the format (``AutoAWQMarlinLinearMethod``,
``AutoGPTQLinearMethod``, ``CompressedTensorsWNA16``) creates the layer's
parameters, takes the checkpoint's tensors as vLLM's loader would, repacks
them (``process_weights_after_loading``) and runs its kernel
(``CPUWNA16LinearKernel`` on CPU) on a seeded bf16 input. The reference is the
same input times the weight dequantized from the stored tensors in fp32
(:func:`vramgate.models.checkpoints.dequantize`, written from the formats, not from
vLLM).

Tolerance: relative error (Frobenius norm of the difference over the
reference's) at most 1%. The kernel's bf16 output alone rounds each value by
up to 2^-9 relative, and vLLM stores AWQ/GPTQ's fp16 scales in the model dtype
(bf16), which moves each scale by up to 2^-9 too: about 0.3% measured. A
wrong nibble order or group mapping gives errors near 100%. The error against
the original bf16 weights (round-to-nearest 4-bit on Gaussian weights, about
10%) is recorded for information.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vramgate import Gate
from vramgate.testing import Checkpoints
from vramgate.testing.profiles import Profile
from vramgate.testing.quantization import checkpoint_of, layout, linear_kernel_problem

DEVICE = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.requires_gpus(1))]
#: Relative error (Frobenius) of the kernel's output against the dequantized fp32 reference.
OUTPUT_TOLERANCE = 1e-2
BATCH = 16


@pytest.fixture(scope="module")
def vllm_layers(vllm_in_process: Path) -> Iterator[None]:
    """vLLM's tensor-parallel state for one process, which its layer parameters need; torn down after."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with tempfile.TemporaryDirectory(prefix="vramgate-dist-") as tmp, set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp}/init")
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def vllm_method(scheme: str, group: int) -> Any:
    """vLLM 0.32.0's linear method for a checkpoint format, configured as its config loader would."""
    if scheme == "awq":
        from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMarlinLinearMethod

        return AutoAWQMarlinLinearMethod(AutoAWQConfig.from_config({"bits": 4, "group_size": group,
                                                                    "zero_point": True}))
    if scheme == "gptq":
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig, AutoGPTQLinearMethod

        return AutoGPTQLinearMethod(AutoGPTQConfig.from_config({"bits": 4, "group_size": group, "desc_act": False,
                                                                "sym": True}))
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16

    return CompressedTensorsWNA16(strategy="group", num_bits=4, group_size=group, symmetric=True, layer_name="layer")


def run_layer(scheme: str, group: int, stored: dict[str, Any], k: int, n: int, x: Any, device: str) -> Any:
    """One linear layer through vLLM's method: create parameters, load *stored*, repack, apply to *x*."""
    import torch

    method = vllm_method(scheme, group)
    layer = torch.nn.Module()

    def loader(param: Any, value: Any) -> None:
        param.data.copy_(value)

    with torch.device(device):
        if scheme == "w4a16":
            method.create_weights(layer, output_size=n, input_size=k, output_partition_sizes=[n],
                                  input_size_per_partition=k, params_dtype=torch.bfloat16, weight_loader=loader)
        else:
            method.create_weights(layer, k, [n], k, n, torch.bfloat16, weight_loader=loader)
    layer.bias = None
    params = dict(layer.named_parameters())
    for key, value in stored.items():
        if key in params:
            loader(params[key], value.to(device))
        elif key != "g_idx":  # vLLM 0.32.0 has no g_idx parameter (see Note [CPU resident weights])
            pytest.fail(f"vLLM's {type(method).__name__} has no parameter for checkpoint tensor {key!r}")
    method.process_weights_after_loading(layer)
    apply = method.apply if hasattr(method, "apply") else method.apply_weights
    return apply(layer, x, None)


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.gate_profiles("quantization")
def test_quantized_linear_output(gate: Gate, checkpoints: Checkpoints, vllm_layers: None, profile: Profile,
                                 device: str) -> None:
    """Every linear layer's kernel output within 1% (relative) of the dequantized fp32 reference."""
    import torch
    from safetensors.torch import load_file

    from vramgate.testing.quantization import dequantize, reference_weights

    problem = linear_kernel_problem(device)
    if problem:
        pytest.skip(f"not on this machine: {problem}")
    ck_format = checkpoint_of(profile)
    ck = checkpoints.get(ck_format.format, ck_format.group_size)
    stored = load_file(str(ck.path / "model.safetensors"))
    original = reference_weights(checkpoints.config, seed=0)
    gen = torch.Generator().manual_seed(1)
    worst = worst_quant = 0.0
    for lin in layout(checkpoints.config).linears:
        tensors = {key[len(lin.name) + 1:]: t for key, t in stored.items() if key.rsplit(".", 1)[0] == lin.name}
        x = torch.randn(BATCH, lin.in_features, generator=gen).to(torch.bfloat16)
        y = run_layer(ck_format.format, ck_format.group_size, tensors, lin.in_features, lin.out_features,
                      x.to(device), device).float().cpu()
        reference = x.float() @ dequantize(ck_format.format, tensors, ck_format.group_size).t()
        exact = x.float() @ original[f"{lin.name}.weight"].float().t()
        error = float((y - reference).norm() / reference.norm())
        worst = max(worst, error)
        worst_quant = max(worst_quant, float((y - exact).norm() / exact.norm()))
        assert error <= OUTPUT_TOLERANCE, (
            f"{lin.name} ({lin.in_features} -> {lin.out_features}): vLLM's output differs from the dequantized "
            f"reference by {error:.2%} (tolerance {OUTPUT_TOLERANCE:.0%})")
    # The ceiling (1%) is the real gate; against the baseline (0.22-0.28% measured) 0.5 flags an error that grew by
    # half, where bf16 rounding of the scales alone moves it by tenths of a percent between kernel paths.
    gate.record("max_output_error", round(worst, 5), unit="ratio", tolerance=0.5, ceiling=OUTPUT_TOLERANCE,
                scope="machine")
    gate.record("max_quantization_error", round(worst_quant, 4), unit="ratio", tolerance=0.1, scope="machine")
