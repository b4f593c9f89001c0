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
            freqs = torch.outer(positions, rope_inv_freq(config))  # (positions, head_dim / 2)
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions (tokens,)`` -> ``cos_sin (tokens, head_dim)``, the layout ``kernels.rotary_embedding`` takes."""
        return self.cos_sin[positions]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Strided views into the one projection output; the kernels take row strides, so nothing is copied.
        q = q.view(tokens, self.num_heads, self.head_dim)  # (tokens, q_heads, head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = kernels.rotary_embedding(q, k, cos_sin)
        out = paged_attention(q, k, v, kv, meta, self.scale)
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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings); ``residual``: the stream before it.

        Returns this layer's MLP output and the residual stream before it; the
        caller's next norm adds the two (``residual`` is None for layer 0).
        """
        hidden, residual = self.input_layernorm(x, residual)
        hidden = self.self_attn(hidden, cos_sin, kv, meta)
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
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
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
        cos_sin = self.rope(positions)  # one lookup per step, shared by every layer
        residual = None
        for layer, kv in zip(self.model.layers, kv_layers, strict=True):
            x, residual = layer(x, residual, cos_sin, kv, meta)
        hidden, _ = self.model.norm(x, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
