"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV pool, in one file.

Differences between the three are config switches: Qwen2 adds biases to
q/k/v, embeddings may be tied, RoPE may be scaled (``linear`` or ``llama3``).
Every forward pass works on a flat, unpadded batch of tokens from many
sequences; ``AttentionMetadata`` tells attention which rows belong together.

The element-wise work goes through ``kernels`` (fused Triton kernels on CUDA,
the PyTorch references elsewhere), so that a decode step launches per layer:
the QKV GEMM, rotary (q and k together), the KV store, decode attention (plus
its reduction when split), o_proj, residual-add + RMSNorm, the gate/up GEMM,
SiLU-and-mul, down_proj and the next residual-add + RMSNorm: 10 or 11 kernels.
Like vLLM, layers pass the residual stream along beside their output, so the
add happens inside the next norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from kvstore import LayerKV


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``residual`` ``(tokens, hidden)`` -> (normalized ``x + residual``, ``x + residual``)."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``(head_dim / 2,)``, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE: a float32 table of every position's cosines and sines, looked up once per step."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        with torch.device("cpu"):  # also inside the loader's meta device, where arange would import torch._dynamo
            positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
            inv_freq = rope_inv_freq(config)
            freqs = torch.outer(positions, inv_freq)  # (positions, head_dim / 2)
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions (tokens,)`` -> ``cos_sin (tokens, head_dim)``, the layout ``kernels.rotary_embedding`` takes."""
        return self.cos_sin[positions]

    def at(self, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """``forward`` for positions that may lie past the table (a streaming sequence outlives the model's
        context), ``max_position`` their largest: those rows are computed here, their angles in float64 so
        that a key rotated far out still scores by its distance alone. The table stays as it is (a captured
        decode graph reads it)."""
        if max_position < self.cos_sin.shape[0]:
            return self.cos_sin[positions]
        last = self.cos_sin.shape[0] - 1
        angles = positions.double()[:, None] * self.inv_freq.double()[None, :]  # (tokens, head_dim / 2)
        computed = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
        return torch.where((positions > last)[:, None], computed, self.cos_sin[positions.clamp(max=last)])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        # which layers attend over a batch's windows (``AttentionMetadata.ring``): all of them, except in a
        # model that slides in some layers only (the others see every key)
        self.windowed = config.sliding_window is None or layer in config.sliding_window_layers
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                sink_cos_sin: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``sink_cos_sin``: with ``meta.ring``, the rotation of each query's sink-facing copy."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Strided views into the one projection output; the kernels take row strides, so nothing is copied.
        q = q.view(tokens, self.num_heads, self.head_dim)  # (tokens, q_heads, head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q_sink = None
        if meta.ring is not None and self.windowed and meta.ring.has_sinks:
            # (k[:, :1]: the kernel rotates q and k together, and only this q is wanted)
            q_sink = kernels.rotary_embedding(q, k[:, :1], sink_cos_sin)[0]
        q, k = kernels.rotary_embedding(q, k, cos_sin)
        if meta.ring is not None and self.windowed and q_sink is None:
            q_sink = q  # no sinks in this batch: the kernels score none with it
        out = paged_attention(q, k, v, kv, meta, self.scale, q_sink)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        sink_cos_sin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings); ``residual``: the stream before it.

        Returns this layer's MLP output and the residual stream before it; the
        caller's next norm adds the two (``residual`` is None for layer 0).
        """
        hidden, residual = self.input_layernorm(x, residual)
        hidden = self.self_attn(hidden, cos_sin, kv, meta, sink_cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Parameter names follow Hugging Face's (``model.layers.N...``) so checkpoints load by name."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # uninitialised: the loader fills every parameter from the checkpoint. Initialising it (``normal_``) on
        # the meta device the loader builds on would import torch._dynamo: ~2 s of CPU at every process start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.rope = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers: list[LayerKV], meta: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``(tokens,)`` -> final hidden states ``(tokens, hidden)``."""
        x = self.model.embed_tokens(input_ids)
        ring, sink_cos_sin = meta.ring, None
        if ring is None:
            cos_sin = self.rope(positions)  # one lookup per step, shared by every layer
        else:
            cos_sin = self.rope.at(positions, ring.max_position)
            sink_cos_sin = self.rope.at(ring.sink_positions, ring.max_position) if ring.has_sinks else None
        residual = None
        for layer, kv in zip(self.model.layers, kv_layers, strict=True):
            x, residual = layer(x, residual, cos_sin, kv, meta, sink_cos_sin)
        hidden, _ = self.model.norm(x, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
