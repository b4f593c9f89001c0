"""The decoder of every supported family over a paged KV pool, in one file.

Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3 and Phi-3 are one pre-norm decoder (attention, then a
gated MLP, each behind an RMSNorm with a residual around it); what sets them apart is a handful of small
pieces, each a config switch here rather than a file per family, so that the one forward pass the kernels,
the KV pool and the CUDA graphs are written for stays in one place:

* q/k/v biases (Qwen2), tied embeddings, scaled RoPE (``engine.models.rotary``);
* an RMSNorm over each head of q and k before rotary (Qwen3, Qwen3-MoE, Gemma 3);
* Gemma 3: embeddings times sqrt(hidden), norms of weight ``1 + w`` (the loader adds the 1), "sandwich"
  norms on the attention and MLP outputs, a GELU-tanh MLP, its own attention scale, and local layers
  that attend over a sliding window with their own RoPE base, five for every global one;
* partial rotary and LongRoPE (Phi-3, Phi-4-mini), whose checkpoints hold q/k/v and gate/up fused already;
* a mixture of experts in place of the MLP (Qwen3-MoE: ``engine.models.moe``).

Every forward pass works on a flat, unpadded batch of tokens from many
sequences; ``AttentionMetadata`` tells attention which rows belong together.
Sliding windows (Mistral, Phi-3, Gemma 3's local layers) are the ring of blocks of ``kvstore.ring``: the
layers in ``sliding_window_layers`` attend over ``meta.ring``'s windows, the others over every key.

The element-wise work goes through ``kvkernels`` (fused Triton kernels on CUDA,
the PyTorch references elsewhere), so that a Llama decode step launches per layer:
the QKV GEMM, rotary (q and k together), the KV store, decode attention (plus
its reduction when split), o_proj, residual-add + RMSNorm, the gate/up GEMM,
SiLU-and-mul, down_proj and the next residual-add + RMSNorm: 10 or 11 kernels.
Like vLLM, layers pass the residual stream along beside their output, so the
add happens inside the next norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kvkernels
from engine.model_config import ModelConfig
from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.compiled_decode import CompiledDecode, dense, head_logits
from engine.models.linear import Linear
from engine.models.moe import SparseMoE
from engine.models.rotary import rotary_embeddings
from engine.models.tensor_parallel import Group, all_reduce, vocab_embedding
from kvstore import LayerKV


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``residual`` ``(tokens, hidden)`` -> (normalized ``x + residual``, ``x + residual``)."""
        return kvkernels.add_rms_norm(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim of ``x (..., dim)``, without a residual."""
        return kvkernels.add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)[0].view(x.shape)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, group: Group | None = None) -> None:
        super().__init__()
        self.group = group  # tensor parallel: this rank's heads (``config``'s), o_proj's sums all-reduced
        # which layers attend over a batch's windows (``AttentionMetadata.ring``): all of them, except in a
        # model that slides in some layers only (the others see every key)
        self.windowed = config.sliding_window is None or layer in config.sliding_window_layers
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = config.attention_scale or self.head_dim**-0.5
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                sink_cos_sin: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``sink_cos_sin``: with ``meta.ring``, the rotation of each query's sink-facing copy."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Strided views into the one projection output; the kernels take row strides, so nothing is copied.
        q = q.view(tokens, self.num_heads, self.head_dim)  # (tokens, q_heads, head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        q_sink = None
        if meta.ring is not None and self.windowed and meta.ring.has_sinks:
            # (k[:, :1]: the kernel rotates q and k together, and only this q is wanted)
            q_sink = self._rotate(q, k[:, :1], sink_cos_sin)[0]
        q, k = self._rotate(q, k, cos_sin)
        if meta.ring is not None and self.windowed and q_sink is None:
            q_sink = q  # no sinks in this batch: the kernels score none with it
        out = paged_attention(q, k, v, kv, meta, self.scale, q_sink)
        return all_reduce(self.group, self.o_proj(out.reshape(tokens, self.q_size)))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q and k, of each head's leading ``rotary_dim`` dims only under partial rotary."""
        if self.rotary_dim == self.head_dim:
            return kvkernels.rotary_embedding(q, k, cos_sin)
        d = self.rotary_dim
        q_rot, k_rot = kvkernels.rotary_embedding(q[..., :d], k[..., :d], cos_sin)  # (tokens, heads, d)
        return torch.cat([q_rot, q[..., d:]], dim=-1), torch.cat([k_rot, k[..., d:]], dim=-1)


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), with gate and up fused into one matmul; act is SiLU
    (SwiGLU) or, for Gemma, GELU with the tanh approximation."""

    def __init__(self, config: ModelConfig, group: Group | None = None) -> None:
        super().__init__()
        self.group = group  # tensor parallel: this rank's slice of the intermediate, down's sums all-reduced
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (tokens, 2 * intermediate)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return all_reduce(self.group, self.down_proj(F.gelu(gate, approximate="tanh") * up))
        return all_reduce(self.group, self.down_proj(kvkernels.silu_and_mul(gate_up)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, group: Group | None = None) -> None:
        super().__init__()
        self.rope = "local" if layer in config.local_rope_layers else "global"  # which table turns q and k
        self.self_attn = Attention(config, layer, group)
        self.mlp = SparseMoE(config, group) if layer in config.moe_layers else MLP(config, group)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if config.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output instead
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)

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
        if hasattr(self, "pre_feedforward_layernorm"):
            hidden = self.post_attention_layernorm.norm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm.norm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Parameter names follow Hugging Face's (``model.layers.N...``) so checkpoints load by name."""

    def __init__(self, config: ModelConfig, group: Group | None = None) -> None:
        super().__init__()
        # uninitialised: the loader fills every parameter from the checkpoint. Initialising it (``normal_``) on
        # the meta device the loader builds on would import torch._dynamo: ~2 s of CPU at every process start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(config, i, group) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``config``: the shape of what this process holds (under tensor parallelism a rank's part, from
    ``tensor_parallel.Shard.config``, with ``group`` its ranks and ``vocab_start`` its vocabulary slice's
    first token; its logits are then that slice's)."""

    def __init__(self, config: ModelConfig, group: Group | None = None, vocab_start: int = 0) -> None:
        super().__init__()
        self.config = config
        self.group, self.vocab_start = group, vocab_start
        self.model = DecoderModel(config, group)
        self.ropes = rotary_embeddings(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled: CompiledDecode | None = None  # ``compile_decode``

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers: list[LayerKV], meta: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``(tokens,)`` -> final hidden states ``(tokens, hidden)``."""
        x = vocab_embedding(self.group, self.model.embed_tokens.weight, input_ids, self.vocab_start)  # (tokens, hidden)
        if self.config.embed_scale is not None:  # the scale rounded to the dtype first, as transformers does
            x = x * torch.tensor(self.config.embed_scale).to(x.dtype).item()
        rotations = {kind: self._rotation(rope, positions, meta) for kind, rope in self.ropes.items()}
        residual = None
        if self.compiled is not None and self.compiled.native is not None and self.compiled.applies(meta, kv_layers[0]):
            return self.compiled.native(x, rotations["global"][0], kv_layers, meta)  # every layer in one C call
        compiled = self.compiled.meta_for(meta, kv_layers[0]) if self.compiled is not None else None
        if compiled is not None:  # the tables once per step, not per layer
            rotations = {kind: (dense(cos_sin), sink) for kind, (cos_sin, sink) in rotations.items()}
        for layer, kv in zip(self.model.layers, kv_layers, strict=True):
            cos_sin, sink_cos_sin = rotations[layer.rope]
            if compiled is not None:
                x, residual = self.compiled.layer(layer, dense(x), dense(residual), cos_sin, kv, compiled)
            else:
                x, residual = layer(x, residual, cos_sin, kv, meta, sink_cos_sin)
        hidden, _ = self.model.norm(x, residual)
        return hidden

    @staticmethod
    def _rotation(rope: nn.Module, positions: torch.Tensor, meta: AttentionMetadata):
        """(cos_sin of the step's queries, of their sink-facing copies or None): one lookup per step and table,
        shared by the layers that use the table."""
        ring = meta.ring
        if ring is None:
            return rope(positions), None
        sink_cos_sin = rope.at(ring.sink_positions, ring.max_position) if ring.has_sinks else None
        return rope.at(positions, ring.max_position), sink_cos_sin

    def compile_decode(self, kv_layers: list[LayerKV]) -> None:
        """From now on run the layers of a one-sequence decode step compiled (``CompiledDecode``); compiles now."""
        CompiledDecode(self, kv_layers)  # (it sets ``self.compiled`` before its warm-up steps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None and hidden.shape[0] == 1 and hidden.device.type == "cpu":
            return self.compiled.logits(self, dense(hidden))
        return head_logits(self, hidden)

    def greedy_token(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(-1)`` for one row of a compiled decode (``compiled_decode.GreedyHead``:
        half the LM head's bytes); None where that does not apply, or decides nothing (the caller takes logits)."""
        if (self.compiled is None or self.compiled.greedy is None or hidden.shape[0] != 1
                or hidden.device.type != "cpu"):  # fmt: skip
            return None
        return self.compiled.greedy(dense(hidden))
