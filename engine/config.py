"""Engine settings (validated at the edge) and the model's shape as read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DEFAULT_CPU_KV_BYTES = 1 << 30


class EngineConfig(BaseSettings):
    """Every engine knob; also read from ``KVSERVE_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="KVSERVE_", extra="forbid", protected_namespaces=())

    model: str = "default"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV pool byte budget (when num_blocks unset)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_dtype: Literal["auto", "int8_v", "int8"] = "auto"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of full blocks earlier requests computed for the same leading tokens"
    )
    seed: int = 0
    shared_kv_name: str | None = Field(None, description="put the KV pool in a shared-memory file with this name")
    skip_tokenizer_init: bool = Field(
        False, description="load no tokenizer: prompts must be token ids and outputs carry no text"
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
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        return _DEFAULT_CPU_KV_BYTES


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config.json."""

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

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        generation = {}
        if (path / "generation_config.json").is_file():
            generation = json.loads((path / "generation_config.json").read_text())
        architecture = (raw.get("architectures") or ["?"])[0]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = raw["num_attention_heads"]
        eos: list[int] = []
        for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
            for token in source if isinstance(source, list) else [source]:
                if token is not None and token not in eos:
                    eos.append(int(token))
        sliding = raw.get("sliding_window")
        if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            mlp_bias=raw.get("mlp_bias", False),
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=sliding,
        )

    @property
    def max_context(self) -> int:
        """Longest sequence the model attends over exactly (a sliding window, when set, caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
