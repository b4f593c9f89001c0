"""Engine settings (validated at the edge) and the model's shape as read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstore.ring import check_streaming

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DEFAULT_CPU_KV_BYTES = 1 << 30


class ModelSettings(BaseSettings):
    """model: which one, and whether to load its tokenizer (the router reads both too)

    Each field is also read from ``KVSERVE_<NAME>``, as in every process's options (``rpc.settings.Settings``,
    which a process's command line overrides); unknown fields are refused.
    """

    model_config = SettingsConfigDict(env_prefix="KVSERVE_", extra="forbid", protected_namespaces=())

    model: str = Field("default", description="'default' (bundled SmolLM2-135M) or a model directory")
    skip_tokenizer_init: bool = Field(
        False,
        description="load no tokenizer (a model without one): prompts must be token ids and outputs carry no text",
    )


class EngineConfig(ModelSettings):
    """engine: every knob of the shared runtime"""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights' and activations' dtype; auto: float32 on CPU, bfloat16 on CUDA"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when torch sees one")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the pool; none: as many as the byte budget holds"
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="KV pool byte budget when num_blocks is unset; none: 1 GiB on a CPU, gpu_memory_utilization "
        "on a GPU",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="fraction of the GPU's total memory this process may use, weights included"
    )
    kv_cache_dtype: Literal["auto", "int8_v", "int8"] = Field(
        "auto", description="auto: the model's dtype; int8_v: V stored as INT8; int8: K and V as INT8"
    )
    max_num_seqs: int = Field(256, ge=1, description="sequences in one step")
    max_num_batched_tokens: int = Field(4096, ge=1, description="tokens in one step")
    max_model_len: int | None = Field(None, ge=1, description="longest sequence; none: the model's context")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of full blocks earlier requests computed for the same leading tokens"
    )
    streaming_window: int = Field(
        0,
        ge=0,
        description="StreamingLLM: each request attends over its first streaming_sinks tokens and its last "
        "streaming_window tokens only, in a ring of blocks that stays the same size however long it runs "
        "(max_model_len no longer bounds it); at least block_size; a request may set its own; 0: off",
    )
    streaming_sinks: int = Field(
        4, ge=0, description="StreamingLLM's attention sinks: leading tokens kept beside the window (< the window)"
    )

    speculative_config: dict[str, Any] | None = Field(
        None,
        description='speculative decoding, as vLLM spells it: JSON such as {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}; none: off',
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: object) -> dict[str, Any] | None:
        from engine.speculative import SpeculativeConfig

        config = SpeculativeConfig.parse(value)  # (a flag or variable brings JSON text)
        return None if config is None else config.as_dict()

    @model_validator(mode="after")
    def _check_streaming(self) -> EngineConfig:
        check_streaming(self.streaming_window, self.streaming_sinks, self.block_size)
        return self

    seed: int = Field(0, description="seed of the engine's RNG, which seeds the requests that bring none")
    shared_kv_name: str | None = Field(None, description="put the KV pool in a shared-memory file with this name")
    enforce_eager: bool = Field(
        False,
        description="run every step eagerly on its unpadded batch: no decode CUDA graphs, no padded decode path",
    )
    host_kv_cache_gb: float | None = Field(
        None,
        ge=0,
        description="GiB of host memory (pinned on a GPU) for the L2 tier below the KV pool: blocks the pool "
        "evicts are kept there and loaded back on a prefix hit, and preempted sequences are swapped there; 0: off; "
        "unset: twice the KV pool, at most 4 GiB and a quarter of the host memory available at start",
    )
    preemption_mode: Literal["auto", "swap", "recompute"] = Field(
        "auto",
        description="what a preempted sequence's KV becomes: swap copies it to the host tier and back; recompute "
        "frees it; auto swaps sequences of at least two full blocks while the host tier has room, recomputes the rest",
    )
    disk_kv_cache_dir: str | None = Field(
        None, description="directory of the L3 disk tier (below the host tier, kept across restarts); none: off"
    )
    disk_kv_cache_gb: float = Field(
        0.0, ge=0, description="GiB the disk tier may fill in disk_kv_cache_dir (needs the host tier)"
    )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """``auto`` is float32 on CPU and bfloat16 on CUDA."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def default_kv_bytes(self, device: torch.device) -> int:
        """The KV pool's byte budget, asked once the weights are loaded. On a GPU, ``gpu_memory_utilization``
        is vLLM's: the fraction of the GPU's *total* memory this process may use, weights and activations
        included, so that processes sharing a GPU each keep to their own share whichever starts first."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            headroom = CUDA_CONTEXT_BYTES + self.max_num_batched_tokens * ACTIVATION_BYTES_PER_TOKEN
            used = torch.cuda.memory_reserved(device)  # the weights (and load-time buffers the allocator kept)
            return kv_cache_budget(total, free, self.gpu_memory_utilization, used, headroom)
        return _DEFAULT_CPU_KV_BYTES


# What a GPU process needs besides its weights and KV pool, kept out of the pool's budget:
# * the CUDA context, cuBLAS workspaces and loaded kernels, which torch's allocator does not count (about
#   0.5 GiB on a Hopper GPU with lazy module loading);
# * one step's activations, allocated after the pool: a prefill of ``max_num_batched_tokens`` tokens needs
#   under 100 KiB per token for models up to 8B parameters (hidden states, fused QKV and gate/up outputs;
#   logits only for the sampled rows), and the decode CUDA graphs' shared pool is the largest decode batch's
#   activations, far less. 256 KiB per token leaves a 2.5x margin: 1 GiB at the default 4,096 tokens.
CUDA_CONTEXT_BYTES = 768 << 20
ACTIVATION_BYTES_PER_TOKEN = 256 << 10


def kv_cache_budget(total: int, free: int, utilization: float, used: int, headroom: int) -> int:
    """Bytes for the KV pool of a process that may use ``utilization`` of a GPU's ``total`` bytes, holds
    ``used`` bytes already (its weights) and needs ``headroom`` more besides the pool (see above).

    Raises ``ValueError`` when that leaves nothing, or when the pool would not fit in the ``free`` bytes the
    GPU has now (other processes on it use more than the rest of its memory).
    """
    allowed = int(total * utilization)
    budget = allowed - used - headroom
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: {_gib(allowed)} of the GPU's "
            f"{_gib(total)}, less {_gib(used)} this process holds (weights) and {_gib(headroom)} kept for "
            "activations and the CUDA context; raise gpu_memory_utilization or set kv_cache_memory_bytes"
        )
    if budget > free:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for a KV cache of {_gib(budget)} but the GPU has only "
            f"{_gib(free)} free ({_gib(total - free)} of {_gib(total)} in use, this process's {_gib(used)} "
            "included): lower gpu_memory_utilization here or in the other processes on this GPU"
        )
    return budget


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder ``engine.models.model`` runs, read from a Hugging Face config.json.

    The fields after ``sliding_window_layers`` are where the families differ; their defaults are Llama's.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None
    # the layers that attend over the sliding window only (all of them for Mistral and Phi-3; Qwen2/3's from
    # max_window_layers on, or its config's layer_types; Gemma 3's local layers); empty without a sliding window
    sliding_window_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP gate's activation: silu, or gelu_pytorch_tanh (Gemma 3)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before rotary (Qwen3, Qwen3-MoE, Gemma 3)
    sandwich_norms: bool = False  # attention and MLP outputs are normed before they join the residual (Gemma 3)
    norm_weight_offset: float = 0.0  # Gemma's norms scale by 1 + weight: the loader adds this to every norm weight
    embed_scale: float | None = None  # embeddings are multiplied by it (Gemma 3: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    partial_rotary_factor: float = 1.0  # the share of each head rotary turns, its leading dims (Phi-4-mini: 0.75)
    local_rope_theta: float | None = None  # Gemma 3's local layers: their own, unscaled rotary base
    local_rope_layers: tuple[int, ...] = ()  # the layers that use it (Gemma 3's sliding_attention layers)
    num_experts: int = 0  # a mixture of experts in moe_layers (Qwen3-MoE), a dense MLP in the others
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' probabilities are renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        generation = {}
        if (path / "generation_config.json").is_file():
            generation = json.loads((path / "generation_config.json").read_text())
        architecture = (raw.get("architectures") or ["?"])[0]
        rope_theta, rope_scaling, local_rope_theta, partial_rotary_factor = cls._rope(raw, architecture)
        num_heads, num_layers = raw["num_attention_heads"], raw["num_hidden_layers"]
        eos: list[int] = []
        for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
            for token in source if isinstance(source, list) else [source]:
                if token is not None and token not in eos:
                    eos.append(int(token))
        sliding, sliding_layers, local_layers = cls._layer_kinds(raw, architecture, num_layers)
        hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"activation {hidden_act!r} is not supported (supported: silu, gelu_pytorch_tanh)")
        for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(unsupported):
                raise ValueError(f"{unsupported}={raw[unsupported]!r} is not supported")
        gemma = architecture == "Gemma3ForCausalLM"
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        dense_layers, sparse_step = set(raw.get("mlp_only_layers") or ()), raw.get("decoder_sparse_step") or 1
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", gemma),
            attention_bias=raw.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            mlp_bias=raw.get("mlp_bias", False),
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=sliding,
            sliding_window_layers=sliding_layers,
            hidden_act=hidden_act,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sandwich_norms=gemma,
            norm_weight_offset=1.0 if gemma else 0.0,
            embed_scale=raw["hidden_size"] ** 0.5 if gemma else None,
            attention_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            partial_rotary_factor=partial_rotary_factor,
            local_rope_theta=local_rope_theta,
            local_rope_layers=local_layers,
            num_experts=num_experts,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=raw.get("moe_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            moe_layers=tuple(
                i for i in range(num_layers) if num_experts and i not in dense_layers and (i + 1) % sparse_step == 0
            ),
        )

    @staticmethod
    def _rope(raw: dict, architecture: str) -> tuple[float, dict | None, float | None, float]:
        """(rope_theta, rope_scaling or None, the local layers' theta or None, partial_rotary_factor) from either
        transformers 5's ``rope_parameters`` or the hub's older top-level fields."""
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        local_theta, default_theta = None, 10000.0
        if architecture == "Gemma3ForCausalLM":
            default_theta = 1e6
            if "full_attention" in rope:  # one set per layer kind (transformers 5)
                local, rope = rope.get("sliding_attention") or {}, dict(rope["full_attention"] or {})
                if local.get("rope_type", "default") != "default":
                    raise ValueError(f"Gemma 3's local layers take plain RoPE, not {local['rope_type']!r}")
                local_theta = float(local.get("rope_theta", 10000.0))
            else:  # the hub's configs: rope_scaling and rope_theta are the global layers', beside a local base
                local_theta = float(raw.get("rope_local_base_freq", 10000.0))
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", default_theta)))
        partial = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "longrope":  # Phi-3's long-context variants; the pre-training length often sits at the top level
            original = rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = original or raw["max_position_embeddings"]
        return theta, rope if kind != "default" else None, local_theta, partial

    @staticmethod
    def _layer_kinds(raw: dict, architecture: str, num_layers: int) -> tuple[int | None, tuple[int, ...], tuple]:
        """(sliding_window, the layers that slide, Gemma 3's local layers) as transformers reads them."""
        kinds = raw.get("layer_types")
        if architecture == "Gemma3ForCausalLM" and not kinds:  # the hub's configs: every sixth layer is global
            pattern = raw.get("sliding_window_pattern", 6)
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        local = tuple(i for i, kind in enumerate(kinds or ()) if kind == "sliding_attention")
        sliding = raw.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            if architecture == "Qwen3MoeForCausalLM" and raw.get("use_sliding_window"):
                raise ValueError("Qwen3-MoE with use_sliding_window is not supported")
            sliding = sliding if raw.get("use_sliding_window", False) else None  # (only read with the flag)
        elif architecture not in ("MistralForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM"):
            sliding = None  # (transformers' Llama ignores the field)
        if sliding and sliding >= raw.get("max_position_embeddings", 2048):
            sliding = None  # a window past the context (Phi-4-mini's) slides nowhere
        sliding_layers: tuple[int, ...] = ()
        if sliding and kinds:
            sliding_layers = local
        elif sliding:
            first = raw.get("max_window_layers", 28) if architecture.startswith("Qwen") else 0
            sliding_layers = tuple(range(first, num_layers))
        gemma_local = local if architecture == "Gemma3ForCausalLM" else ()
        return (sliding if sliding_layers else None), sliding_layers, gemma_local

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary turns (the rest pass through): all but in partial rotary."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        """Longest sequence the model attends over exactly: its positions (a sliding window attends exactly
        over any length, through a ring of blocks: ``kvstore.ring``)."""
        return self.max_position_embeddings

    @property
    def slides_every_layer(self) -> bool:
        """Whether every layer attends over the sliding window only, so a sequence needs no KV before it."""
        return len(self.sliding_window_layers) == self.num_layers
