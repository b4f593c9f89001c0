"""The engine's options, validated at the edge: which model (``ModelSettings``), every knob of the shared
runtime (``EngineConfig``) and speculative decoding's (``SpeculativeConfig``).

The model's own shape, read from its config.json, is ``engine.model_config``; the KV pool's byte budget that
these options ask for is worked out in ``engine.memory``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvstore.ring import check_streaming

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_SPECULATIVE_TOKENS = 16
_SPEC_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}


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
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks the model is split across by heads, MLP width and vocabulary, each a process of its "
        "own (on CUDA one GPU each; on a CPU sharing the cores); at most the model's KV heads; 1: none",
    )
    tensor_parallel_timeout_s: float = Field(
        60.0, gt=0, description="seconds a rank may take to join, and a collective may wait, before the engine fails"
    )
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
    compile_decode: bool | None = Field(
        None,
        description="on the CPU, run the layers of a one-sequence decode step through torch.compile (compiled at "
        "start, about 10 s, cached on disk); not for models with experts or sliding windows; unset: off in the "
        "engine, and on for the decode workers kvserve up starts on a CPU host",
    )
    host_kv_cache_gb: float | None = Field(
        None,
        ge=0,
        description="GiB of host memory (pinned on a GPU) for the L2 tier below the KV pool: blocks the pool "
        "evicts are kept there and loaded back on a prefix hit, and preempted sequences are swapped there; 0: off; "
        "unset: twice the KV pool, at most 4 GiB and a quarter of the host memory available at start",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="waiting requests are always taken by priority (lower first), then arrival; priority also "
        "preempts a running request of a lower priority for a waiting one that finds no room",
    )
    priority_chunk_tokens: int = Field(
        32,
        ge=0,
        description="under the priority policy, for a minute after a request of the best priority arrived, the "
        "most prompt tokens a lower priority's prompt takes a step, so that an urgent request waits for at most "
        "one short step (32: kvserve bench priority's high-priority TTFT p99 1.26-1.41x unloaded against 1.50-1.61x at "
        "64, for 5% fewer low-priority requests done); 0: uncapped",
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
    step_diagnosis: bool = Field(
        True,
        description="count each step's bytes moved, FLOPs and host time against the device's peaks "
        "(kvserve_step_utilization; engine.step_diagnosis); false: no probes at start, nothing counted per step",
    )
    peak_memory_bandwidth_gbs: float | None = Field(
        None,
        gt=0,
        description="the device's peak memory bandwidth in GB/s, for the step diagnosis; none: the GPU table, "
        "else the measured copy bandwidth (engine.device_peaks)",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="the device's peak dense TFLOP/s in the model's dtype, for the step diagnosis; none: the GPU "
        "table, else a GEMM probe",
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


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's options (``engine.speculative``), spelled as vLLM spells them::

        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        {"method": "draft", "model": DIR, "num_speculative_tokens": 4}
    """

    method: Literal["ngram", "draft"]
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model's directory (method "draft")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the worker flag's form); None or {} is off. ``ValueError`` naming the
        field for an unknown key, method or bound."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')  # fmt: skip
        if not value:
            return None
        unknown = sorted(set(value) - _SPEC_FIELDS)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a field; the fields are {sorted(_SPEC_FIELDS)}")
        method = value.get("method")
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative_config.method={method!r} is not a method; use 'ngram' or 'draft'")
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}")  # fmt: skip
        config = cls(method, k, **{name: value[name] for name in ("prompt_lookup_min", "prompt_lookup_max", "model")
                                   if name in value})  # fmt: skip
        if method == "ngram":
            lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(n) or n < 1:
                    raise ValueError(f"speculative_config.{name}={n!r} must be an integer of at least 1")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}")
            if config.model is not None:
                raise ValueError("speculative_config.model names a draft model: set method 'draft' to use one")
        elif not isinstance(config.model, str) or not config.model:
            raise ValueError("speculative_config.model: method 'draft' needs the draft model's directory")
        return config

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        else:
            out["model"] = self.model
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
