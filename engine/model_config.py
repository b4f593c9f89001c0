"""The model's shape as read from its Hugging Face config.json (and generation_config.json beside it).

The supported families (``engine.bundled.SUPPORTED_ARCHITECTURES``) name the same things differently, or leave
them out for a default of their own; ``ModelConfig.from_dir`` reads them all into one frozen shape that
``engine.models`` builds the decoder from, and refuses by name an option the decoder does not run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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
            eos_token_ids=_eos_token_ids(raw, generation),
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


def _eos_token_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    """The end-of-sequence ids of config.json, then those generation_config.json adds, each once (either may
    give one id or a list)."""
    eos: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token in source if isinstance(source, list) else [source]:
            if token is not None and token not in eos:
                eos.append(int(token))
    return tuple(eos)
