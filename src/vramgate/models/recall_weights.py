"""The recall models' weights: a tiny Llama and a tiny DeepSeek-V2 (MLA) whose answers mean something.

``python -m vramgate.models.recall_weights OUT_DIR --arch llama|llama-gqa|deepseek-v2`` makes one (seeded, on CPU, torch
only, seconds) and writes what vLLM loads (``config.json``; ``model.safetensors`` in bf16 with vLLM's and Hugging
Face's weight names) and ``recall.json`` (:class:`~vramgate.models.recall.RecallModel`: the command, the seed, the
weights' SHA-256, the accuracy and the smallest answer margin they were made with). The task: Note [recall task]
in :mod:`vramgate.models.recall`.

Note [recall weights]: the weights are set, not learned by training on the task. Training these shapes from
scratch by gradient descent did not get past the induction plateau (3,000 steps on a GPU left every prompt
unanswered), which on 2 cores would be hours. So the script writes the circuit that answers the task, the one
trained models are known to learn (an induction head), into the architecture's own weights:

- every token has a code: a unit vector of :data:`CODE_DIMS` dimensions, the 2,048 codes spread apart by gradient
  descent on their largest pairwise similarity (seeded); BOS and SEP share one;
- layer 0, head 0 attends to the previous position by position alone (its query and key read a constant
  dimension and differ only in the rotary dimensions; the weights over the rotary frequencies are chosen by
  gradient descent to widen the gap between offset 1 and every other offset up to 4,200) and writes that
  position's code into a "previous token" subspace;
- layer 1, head 0 matches the current token's code against every position's "previous token" (in dimensions the
  rotary embedding does not turn: a huge ``rope_theta`` in the Llama, the non-rotary ``qk_nope`` dimensions in MLA),
  so it attends to the positions after the current token's earlier occurrences, and writes their codes into an
  "answer" subspace that the LM head reads; BOS's own position is pushed out by a flag only BOS carries (its key
  there cancels BOS's code and meets a constant in every query with a score of ``-MATCH_SCORE``);
- every token's embedding has the same norm (BOS carries a flag, every other token its complement), so the norms
  scale every position alike;
- the MLPs hold small random weights that write only to dimensions nothing reads (so quantizing them is not a
  no-op, and they change no answer).

What vLLM computes with them is everything a real model's attention computes: rotary embeddings, the paged KV
cache, the attention kernel's softmax over every position and the LM head; an attention scale 4x off (the script
refuses weights that still answer :data:`MAX_QUARTER_SCALE_ACCURACY` of their prompts with their scores quartered:
the scores are sized for it, not as large as they could be), one KV block handed to another request or a dropped
old block change the answers, and the margins (the answer's logit over the
runner-up's, at least :data:`MIN_MARGIN` in bf16 over prompts up to 1,984 tokens) are wide enough that batch order
and kernel rounding do not. The modules in :func:`build` compute what vLLM 0.32.0's ``LlamaForCausalLM`` and
``DeepseekV2ForCausalLM`` compute (RMSNorm, SiLU MLP, NeoX rotary in the Llama, interleaved rotary on MLA's rope
part as vLLM builds it with ``is_neox_style=False``, MLA's latent of ``kv_lora_rank`` 512 and rope dimensions 64,
the only sizes vLLM's CPU MLA kernel runs); they check the weights before they are written. Every layer of the
DeepSeek model is dense (``first_k_dense_replace`` = the layer count).

Determinism: the same seed and torch release give the same weights (one thread); the committed files' hashes are
in their ``recall.json``, and a test holds the files to them.

Longer than 400 lines: the weights of two architectures are written here beside the reference modules that check
them, which must compute what vLLM's do; split, each half would depend on the other's layout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.models import recall

#: Dimensions of a token's code (the content part of an attention head; one more still dimension of the head
#: carries the push that keeps the induction head off BOS).
CODE_DIMS = 46
#: Residual-stream layout: the current token's code, the previous token's, the answer, a constant, BOS's flag and
#: its complement (every other token's), so that every token's embedding has the same norm.
E, P, A = (range(i * CODE_DIMS, (i + 1) * CODE_DIMS) for i in range(3))
CONST, FLAG, NOT_FLAG = 3 * CODE_DIMS, 3 * CODE_DIMS + 1, 3 * CODE_DIMS + 2
#: Attention logits: the previous-token head's lead of offset 1 over every other offset, and the induction head's
#: score of a match; the LM head's logit of the answer.
POSITION_GAP, MATCH_SCORE, ANSWER_LOGIT = 12.0, 16.0, 40.0
#: The smallest answer margin (logits, bf16) a made model must have.
MIN_MARGIN = 8.0
#: The most a made model may still answer with its attention scores quartered (Note [recall weights]).
MAX_QUARTER_SCALE_ACCURACY = 0.8
#: The longest offset the previous-token head is designed for (max_position_embeddings 4096 and some).
MAX_OFFSET = 4200


@dataclass(frozen=True)
class Arch:
    """One recall model's shape."""

    name: str
    rope_theta: float
    hidden: int = 256
    layers: int = 2
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 256
    kv_lora_rank: int = 512
    qk_nope: int = 64
    qk_rope: int = 64
    v_head: int = 64
    eps: float = 1e-6

    @property
    def family(self) -> str:
        """The architecture vLLM runs: ``llama`` (with or without grouped-query attention) or ``deepseek-v2``."""
        return "llama" if self.name.startswith("llama") else self.name

    def circuit_heads(self, layer: int) -> tuple[int, int]:
        """The query head and the KV head that carry *layer*'s part of the circuit (Note [recall weights]): head 0
        of each where every query head has its own KV head; with grouped-query attention, a query head that is
        not the first of its group and a different KV head per layer (layer 0: query head 1 over KV head 0,
        layer 1: query head ``group`` over KV head 1), so that a kernel or patch that pairs query heads with the
        wrong KV heads (``i % kv_heads`` for ``i // group``) changes the answers. In MLA every head has its own
        keys and values from the shared latent: layer 0 uses the first head, layer 1 the last, so that at a tensor
        parallelism of 2 each rank computes a part of the circuit."""
        if self.family == "deepseek-v2":
            head = 0 if layer % 2 == 0 else self.heads - 1
            return head, head
        if self.kv_heads == self.heads:
            return 0, 0
        group = self.heads // self.kv_heads
        kv_head = layer % self.kv_heads
        return kv_head * group + (1 if layer % 2 == 0 else 0), kv_head

    def config(self) -> dict[str, Any]:
        """vLLM's (and Hugging Face's) ``config.json`` for this shape."""
        common = {"bos_token_id": recall.BOS, "eos_token_id": recall.EOS, "hidden_act": "silu",
                  "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                  "max_position_embeddings": 4096, "num_attention_heads": self.heads,
                  "num_hidden_layers": self.layers, "rms_norm_eps": self.eps, "rope_theta": self.rope_theta,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": recall.VOCAB}
        if self.family == "llama":
            return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": self.head_dim,
                    "num_key_value_heads": self.kv_heads, **common}
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "first_k_dense_replace": self.layers, "kv_lora_rank": self.kv_lora_rank,
                "moe_intermediate_size": self.intermediate, "moe_layer_freq": 1, "n_group": 1,
                "n_routed_experts": 4, "n_shared_experts": 1, "norm_topk_prob": False, "num_experts_per_tok": 2,
                "num_key_value_heads": self.heads, "q_lora_rank": None, "qk_nope_head_dim": self.qk_nope,
                "qk_rope_head_dim": self.qk_rope, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
                "topk_group": 1, "topk_method": "greedy", "v_head_dim": self.v_head, **common}


#: The Llama's rotary base leaves 24 of its 32 frequency pairs still over 4,096 positions (the code dimensions).
#: ``llama-gqa``: 4 query heads over 2 KV heads (grouped-query attention), the KV bytes per token of ``llama``.
#: ``deepseek-v2``: 4 heads, so that each rank of a tensor parallelism of 2 runs 2 (vLLM's CPU MLA computes wrong
#: attention with one head per rank: docs/findings.md); MLA's KV bytes per token do not depend on the heads.
ARCHS = {"llama": Arch("llama", rope_theta=1e20), "llama-gqa": Arch("llama-gqa", rope_theta=1e20, heads=4),
         "deepseek-v2": Arch("deepseek-v2", rope_theta=10000.0, heads=4, kv_heads=4)}


def frequencies(arch: Arch) -> list[float]:
    """The rotary frequencies of a head (one per dimension pair), as vLLM computes them."""
    dim = arch.head_dim if arch.family == "llama" else arch.qk_rope
    return [arch.rope_theta ** (-(2 * i) / dim) for i in range(dim // 2)]


def position_pairs(arch: Arch) -> int:
    """How many of the fastest rotary pairs the previous-token head uses (the others turn less than 0.15 rad over
    :data:`MAX_OFFSET` positions: in the Llama they carry the codes)."""
    if arch.family != "llama":
        return arch.qk_rope // 2
    return sum(1 for f in frequencies(arch) if f * MAX_OFFSET > 0.15)


def offset_weights(thetas: list[float], steps: int = 600) -> tuple[list[float], float]:
    """Weights over rotary frequencies *thetas* whose cosine sum peaks at offset 1, and the smallest lead of that
    peak over any other offset in [0, MAX_OFFSET] (the weights sum to 1)."""
    import torch

    d = torch.arange(0, MAX_OFFSET + 1, dtype=torch.float64) - 1.0
    c = torch.cos(d[:, None] * torch.tensor(thetas, dtype=torch.float64)[None])
    gaps = c[1][None] - torch.cat([c[:1], c[2:]])
    z = torch.zeros(len(thetas), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.1)
    for _ in range(steps):
        loss = torch.logsumexp(-(gaps @ torch.softmax(z, 0)) * 200, 0) / 200
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = torch.softmax(z, 0).detach()
    return [float(x) for x in w], float((gaps @ w).min())


def codes(seed: int, steps: int = 60) -> Any:
    """One unit code per token (``VOCAB x CODE_DIMS``), spread apart; SEP's is BOS's."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(recall.VOCAB, CODE_DIMS, generator=gen).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.02)
    keep = torch.ones(recall.VOCAB, dtype=torch.bool)
    keep[recall.SEP] = False
    off = ~torch.eye(int(keep.sum()), dtype=torch.bool)
    for _ in range(steps):
        u = torch.nn.functional.normalize(x[keep], dim=1)
        sim = (u @ u.t())[off]
        loss = torch.logsumexp(sim * 40, 0) / 40
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = torch.nn.functional.normalize(x.detach(), dim=1)
    out[recall.SEP] = out[recall.BOS]
    return out


def largest_similarity(code: Any) -> float:
    """The largest similarity between two different tokens' codes (BOS and SEP share theirs on purpose)."""
    import torch

    keep = torch.ones(code.shape[0], dtype=torch.bool)
    keep[recall.SEP] = False
    u = code[keep]
    sim = u @ u.t()
    sim.fill_diagonal_(-1.0)
    return float(sim.max())


def weights(arch: Arch, seed: int) -> dict[str, Any]:
    """The state dict (fp32) of *arch*'s recall model (Note [recall weights])."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    code = codes(seed).float()
    h, hd = arch.hidden, arch.head_dim
    sd: dict[str, Any] = {}
    emb = torch.zeros(recall.VOCAB, h)
    emb[:, E.start:E.stop] = code
    emb[:, CONST] = 1.0
    emb[:, NOT_FLAG] = 1.0
    emb[recall.BOS, NOT_FLAG] = 0.0
    emb[recall.BOS, FLAG] = 1.0
    sd["model.embed_tokens.weight"] = emb
    # The inverse RMS of a residual of n unit parts over `hidden` dimensions: what a norm multiplies them by.
    def inv_rms(n: int, dims: int = h) -> float:
        return math.sqrt(dims / n)

    n0, n1, nf = inv_rms(3), inv_rms(4), inv_rms(5)  # layer 0: E, C and a flag; layer 1: and P; final: and A
    pairs = position_pairs(arch)
    thetas = frequencies(arch)[:pairs]
    w, gap = offset_weights(thetas)
    scale = (arch.head_dim if arch.family == "llama" else arch.qk_nope + arch.qk_rope) ** -0.5
    kappa = math.sqrt(POSITION_GAP / (scale * gap))
    match = math.sqrt(MATCH_SCORE / scale)
    bos = code[recall.BOS]
    for layer in range(arch.layers):
        pre = f"model.layers.{layer}."
        sd[pre + "input_layernorm.weight"] = torch.ones(h)
        sd[pre + "post_attention_layernorm.weight"] = torch.ones(h)
        gate = torch.randn(arch.intermediate, h, generator=gen) * 0.02
        down = torch.zeros(h, arch.intermediate)
        down[NOT_FLAG + 1:] = torch.randn(h - NOT_FLAG - 1, arch.intermediate, generator=gen) * 2e-4
        sd[pre + "mlp.gate_proj.weight"] = gate
        sd[pre + "mlp.up_proj.weight"] = torch.randn(arch.intermediate, h, generator=gen) * 0.02
        sd[pre + "mlp.down_proj.weight"] = down
        o = torch.zeros(h, arch.heads * (hd if arch.family == "llama" else arch.v_head))
        target = P if layer == 0 else A
        column = arch.circuit_heads(layer)[0] * (hd if arch.family == "llama" else arch.v_head)
        for c in range(CODE_DIMS):
            o[target.start + c, column + c] = 1.0
        sd[pre + "self_attn.o_proj.weight"] = o
        if arch.family == "llama":
            sd.update(_llama_attention(arch, pre, layer, thetas, w, kappa, match, n0, n1, bos))
        else:
            sd.update(_mla_attention(arch, pre, layer, thetas, w, kappa, match, n0, n1, bos))
    sd["model.norm.weight"] = torch.ones(h)
    head = torch.zeros(recall.VOCAB, h)
    head[:, A.start:A.stop] = code * (ANSWER_LOGIT / nf)
    head[[recall.PAD, recall.BOS, recall.EOS]] = 0.0
    sd["lm_head.weight"] = head
    return sd


def _code_dims(arch: Arch) -> list[int]:
    """The head dimensions that carry codes: the Llama's slowest rotary pairs, MLA's non-rotary dimensions."""
    if arch.family != "llama":
        return list(range(CODE_DIMS + 1))
    pairs = position_pairs(arch)
    half = arch.head_dim // 2
    slow = list(range(pairs, half)) + list(range(half + pairs, arch.head_dim))
    if len(slow) < CODE_DIMS + 1:
        raise ValueError(f"rope_theta {arch.rope_theta} leaves {len(slow)} still dimensions, {CODE_DIMS + 1} needed")
    return slow[:CODE_DIMS + 1]


def _llama_attention(arch: Arch, pre: str, layer: int, thetas: list[float], w: list[float], kappa: float,
                     match: float, n0: float, n1: float, bos: Any) -> dict[str, Any]:
    import torch

    h, hd, half = arch.hidden, arch.head_dim, arch.head_dim // 2
    q_all = torch.zeros(arch.heads * hd, h)
    k_all = torch.zeros(arch.kv_heads * hd, h)
    v_all = torch.zeros(arch.kv_heads * hd, h)
    q_head, kv_head = arch.circuit_heads(layer)
    q = q_all[q_head * hd:(q_head + 1) * hd]  # views: the circuit's rows of its heads
    k, v = k_all[kv_head * hd:(kv_head + 1) * hd], v_all[kv_head * hd:(kv_head + 1) * hd]
    dims = _code_dims(arch)
    if layer == 0:  # previous token: NeoX pairs (f, f + half), query = w e^{-i theta}, key = 1
        for f, (theta, wf) in enumerate(zip(thetas, w, strict=True)):
            q[f, CONST] = kappa * wf * math.cos(theta) / n0
            q[f + half, CONST] = -kappa * wf * math.sin(theta) / n0
            k[f, CONST] = kappa / n0
        for c in range(CODE_DIMS):
            v[c, E.start + c] = 1.0 / n0
    else:  # induction: the current code against the previous-token code; BOS's key pushed out
        for c, d in enumerate(dims[:CODE_DIMS]):
            q[d, E.start + c] = match / n1
            k[d, P.start + c] = match / n1
            k[d, FLAG] = -match * float(bos[c]) / n1  # BOS's own previous-token code cancelled
            v[c, E.start + c] = 1.0 / n1
        q[dims[CODE_DIMS], CONST] = match / n1  # every query against BOS's flag: -MATCH_SCORE
        k[dims[CODE_DIMS], FLAG] = -match / n1
    return {pre + "self_attn.q_proj.weight": q_all, pre + "self_attn.k_proj.weight": k_all,
            pre + "self_attn.v_proj.weight": v_all}


def _mla_attention(arch: Arch, pre: str, layer: int, thetas: list[float], w: list[float], kappa: float,
                   match: float, n0: float, n1: float, bos: Any) -> dict[str, Any]:
    import torch

    h, r, nope, rope_dims, vd = arch.hidden, arch.kv_lora_rank, arch.qk_nope, arch.qk_rope, arch.v_head
    q_all = torch.zeros(arch.heads * (nope + rope_dims), h)
    kv_a = torch.zeros(r + rope_dims, h)
    kv_b_all = torch.zeros(arch.heads * (nope + vd), r)
    head = arch.circuit_heads(layer)[0]
    q = q_all[head * (nope + rope_dims):(head + 1) * (nope + rope_dims)]  # views: the circuit's head's rows
    kv_b = kv_b_all[head * (nope + vd):(head + 1) * (nope + vd)]
    if layer == 0:  # previous token in the rope part (interleaved pairs (2f, 2f + 1)); the latent carries E
        for f, (theta, wf) in enumerate(zip(thetas, w, strict=True)):
            q[nope + 2 * f, CONST] = kappa * wf * math.cos(theta) / n0
            q[nope + 2 * f + 1, CONST] = -kappa * wf * math.sin(theta) / n0
            kv_a[r + 2 * f, CONST] = kappa / n0
        for c in range(CODE_DIMS):
            kv_a[c, E.start + c] = 1.0 / n0
        lat = math.sqrt(r / 1)  # the normed latent: one unit part over r dimensions
        for c in range(CODE_DIMS):
            kv_b[nope + c, c] = 1.0 / lat
    else:  # induction in the non-rotary dimensions; the latent carries E, P and BOS's flag
        for c in range(CODE_DIMS):
            kv_a[c, E.start + c] = 1.0 / n1
            kv_a[CODE_DIMS + c, P.start + c] = 1.0 / n1
        kv_a[2 * CODE_DIMS, FLAG] = 1.0 / n1
        lat = math.sqrt(r / 2)  # E and P
        for c in range(CODE_DIMS):
            q[c, E.start + c] = match / n1
            kv_b[c, CODE_DIMS + c] = match / lat
            kv_b[c, 2 * CODE_DIMS] = -match * float(bos[c]) / lat  # BOS's own previous-token code cancelled
            kv_b[nope + c, c] = 1.0 / lat
        q[CODE_DIMS, CONST] = match / n1  # every query against BOS's flag: -MATCH_SCORE
        kv_b[CODE_DIMS, 2 * CODE_DIMS] = -match / lat
    return {pre + "self_attn.q_proj.weight": q_all, pre + "self_attn.kv_a_proj_with_mqa.weight": kv_a,
            pre + "self_attn.kv_a_layernorm.weight": torch.ones(r), pre + "self_attn.kv_b_proj.weight": kv_b_all}


def build(arch: Arch) -> Any:
    """The torch module of *arch* (parameters named as in the checkpoint)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    def rms(x: Any, w: Any, eps: float) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x: Any, positions: Any, neox: bool) -> Any:
        dim = x.shape[-1]
        inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = positions[:, None].float() * inv.to(positions.device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        dtype, x = x.dtype, x.float()
        if neox:
            x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(dtype)

    class Norm(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: Any) -> Any:
            return rms(x, self.weight, arch.eps)

    class LlamaAttention(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self) -> None:
            super().__init__()
            a = arch
            self.q_proj = nn.Linear(a.hidden, a.heads * a.head_dim, bias=False)
            self.k_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=False)
            self.v_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=False)
            self.o_proj = nn.Linear(a.heads * a.head_dim, a.hidden, bias=False)

        def forward(self, x: Any, pos: Any) -> Any:
            a = arch
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, a.heads, a.head_dim)
            k = self.k_proj(x).view(b, t, a.kv_heads, a.head_dim)
            v = self.v_proj(x).view(b, t, a.kv_heads, a.head_dim)
            q, k = rope(q.transpose(1, 2), pos, True), rope(k.transpose(1, 2), pos, True)
            v = v.transpose(1, 2)
            if a.kv_heads != a.heads:
                k = k.repeat_interleave(a.heads // a.kv_heads, 1)
                v = v.repeat_interleave(a.heads // a.kv_heads, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.head_dim ** -0.5)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    class MLAttention(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self) -> None:
            super().__init__()
            a = arch
            self.q_proj = nn.Linear(a.hidden, a.heads * (a.qk_nope + a.qk_rope), bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(a.hidden, a.kv_lora_rank + a.qk_rope, bias=False)
            self.kv_a_layernorm = Norm(a.kv_lora_rank)
            self.kv_b_proj = nn.Linear(a.kv_lora_rank, a.heads * (a.qk_nope + a.v_head), bias=False)
            self.o_proj = nn.Linear(a.heads * a.v_head, a.hidden, bias=False)

        def forward(self, x: Any, pos: Any) -> Any:
            a = arch
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, a.heads, a.qk_nope + a.qk_rope).transpose(1, 2)
            q_nope, q_pe = q[..., : a.qk_nope], rope(q[..., a.qk_nope:], pos, False)
            kv_a = self.kv_a_proj_with_mqa(x)
            latent, k_pe = kv_a[..., : a.kv_lora_rank], kv_a[..., a.kv_lora_rank:]
            k_pe = rope(k_pe[:, None], pos, False)  # one rope key shared by the heads
            kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, a.heads, a.qk_nope + a.v_head)
            kv = kv.transpose(1, 2)
            k_nope, v = kv[..., : a.qk_nope], kv[..., a.qk_nope:]
            q_full = torch.cat([q_nope, q_pe], -1)
            k_full = torch.cat([k_nope, k_pe.expand(b, a.heads, t, a.qk_rope)], -1)
            out = F.scaled_dot_product_attention(q_full, k_full, v, is_causal=True,
                                                 scale=(a.qk_nope + a.qk_rope) ** -0.5)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    class MLP(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(arch.hidden, arch.intermediate, bias=False)
            self.up_proj = nn.Linear(arch.hidden, arch.intermediate, bias=False)
            self.down_proj = nn.Linear(arch.intermediate, arch.hidden, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = Norm(arch.hidden)
            self.self_attn = LlamaAttention() if arch.family == "llama" else MLAttention()
            self.post_attention_layernorm = Norm(arch.hidden)
            self.mlp = MLP()

        def forward(self, x: Any, pos: Any) -> Any:
            x = x + self.self_attn(self.input_layernorm(x), pos)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(recall.VOCAB, arch.hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(arch.layers))
            self.norm = Norm(arch.hidden)

    class Model(nn.Module):  # type: ignore[misc]  # torch is not typed where the gate is checked
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(arch.hidden, recall.VOCAB, bias=False)

        def forward(self, ids: Any) -> Any:
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.model.embed_tokens(ids)
            for layer in self.model.layers:
                x = layer(x, pos)
            return self.lm_head(self.model.norm(x))

    model = Model()
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02 if "embed" not in name else 0.05)
    return model


def evaluate(model: Any, lengths: list[int], seed: int = 1000, device: str = "cpu") -> tuple[float, float]:
    """Exact-match accuracy and the smallest answer margin (logits) of *model* in bf16, teacher-forced over
    prompts of *lengths* answered with 64 tokens each."""
    import torch

    m = model.to(torch.bfloat16)
    right, margin = 0, math.inf
    prompts = recall.prompts(seed, lengths)
    with torch.no_grad():
        for prompt in prompts:
            want = recall.expected(prompt, 64)
            if want is None:
                continue
            ids = torch.tensor([prompt + want[:-1]], device=device)
            logits = m(ids)[0, len(prompt) - 1:].float()
            answer = torch.tensor(want, device=device)
            right += bool((logits.argmax(-1) == answer).all())
            gold = logits.gather(1, answer[:, None])[:, 0]
            other = logits.scatter(1, answer[:, None], -math.inf).max(-1).values
            margin = min(margin, float((gold - other).min()))
    model.float()
    return right / len(prompts), margin




def make(arch: Arch, seed: int) -> tuple[Any, float, float]:
    """The reference module of *arch* with its recall weights, its accuracy and smallest margin in bf16."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = build(arch)
    model.load_state_dict(weights(arch, seed))
    accuracy, margin = evaluate(model, eval_lengths(seed))
    return model, accuracy, margin


def quarter_scale_accuracy(model: Any, arch: Arch, seed: int) -> float:
    """The accuracy of *model* with every attention score a quarter of what it should be (its queries scaled), over
    a third of its judging prompts: what a softmax scale 4x off leaves of its answers. The scores are sized so that
    it is low (:data:`MAX_QUARTER_SCALE_ACCURACY`): the gate must see such a patch."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bent = dict(state)
    for layer in range(arch.layers):
        key = f"model.layers.{layer}.self_attn.q_proj.weight"
        bent[key] = state[key] * 0.25
    model.load_state_dict(bent)
    try:
        return evaluate(model, eval_lengths(seed)[::3])[0]
    finally:
        model.load_state_dict(state)


def save(model: Any, arch: Arch, out: Path, command: str, seed: int, accuracy: float, margin: float,
         quarter_scale: float | None = None) -> Path:
    """Write *model*'s checkpoint, config and ``recall.json`` into *out*."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(arch.config(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    description = {
        "task": "recall", "weights": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "command": command, "seed": seed, "accuracy": accuracy,
        "details": {"min_margin_logits": round(margin, 2), "torch": torch.__version__,
                    "quarter_scale_accuracy": None if quarter_scale is None else round(quarter_scale, 3),
                    "eval_prompts": len(eval_lengths(seed)), "max_period": recall.MAX_PERIOD, "vocab": recall.VOCAB,
                    "made": "set by construction (Note [recall weights] in vramgate.models.recall_weights)"},
    }
    (out / recall.MODEL_FILE).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


EVAL_LENGTHS = [3, 4, 8, 17, 40, 100, 160, 300, 520, 700, 1026, 1500, 1984]


def eval_lengths(seed: int) -> list[int]:
    """The prompt lengths a made model is judged on: :data:`EVAL_LENGTHS` and 48 drawn from 3 to 1,984."""
    import random

    rng = random.Random(f"recall-eval-{seed}")
    return EVAL_LENGTHS + [rng.randint(3, 1984) for _ in range(48)]


def main(argv: list[str]) -> int:
    """``python -m vramgate.models.recall_weights OUT_DIR --arch llama|llama-gqa|deepseek-v2 [--seed N]``."""
    parser = argparse.ArgumentParser(prog="python -m vramgate.models.recall_weights",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    arch = ARCHS[args.arch]
    t0 = time.perf_counter()
    model, accuracy, margin = make(arch, args.seed)
    print(f"accuracy {accuracy:.3f}, smallest margin {margin:.2f} logits (bf16), {time.perf_counter() - t0:.0f} s")
    quarter = quarter_scale_accuracy(model, arch, args.seed)
    print(f"with its attention scores quartered: accuracy {quarter:.3f}")
    if accuracy < 1.0 or margin < MIN_MARGIN or quarter > MAX_QUARTER_SCALE_ACCURACY:
        print(f"error: the made model answers {accuracy:.1%} with a smallest margin of {margin:.2f} logits, and "
              f"{quarter:.1%} with its attention scores quartered; it must answer all with at least {MIN_MARGIN} "
              f"and at most {MAX_QUARTER_SCALE_ACCURACY:.0%} quartered", file=sys.stderr)
        return 1
    command = f"python -m vramgate.models.recall_weights fixtures/models/recall-{args.arch} --arch {args.arch} " \
              f"--seed {args.seed}"
    save(model, arch, args.out, command, args.seed, accuracy, margin, quarter)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
