"""The router's options (``python -m router --help``): the shared groups (``rpc.options``), the model's
(``engine.config.ModelSettings``) and its own. ``ServedModelSettings``, ``StreamSettings`` and ``ApiKeySettings``
are ``kvserve up``'s too, which passes them on to the router it starts (and its ``--max-model-len``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import ModelSettings
from router.limits import DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_REQUEST_BYTES
from router.routing import RoutingWeights
from router.validation_queue import DEFAULT_MAX_BACKLOG
from rpc.options import RegistrySettings, SecuritySettings, ServeSettings, TracingSettings
from rpc.settings import Settings


class StreamSettings(Settings):
    """streams"""

    migrate_streams: bool = Field(
        True, description="continue a stream on another decode worker when its own dies or drains mid-stream"
    )
    stream_idle_timeout: float = Field(
        30.0,
        ge=0,
        description="seconds a streaming client may read nothing before its stream is cancelled (and its KV "
        "blocks freed); 0: no limit",
    )


class ServedModelSettings(Settings):
    """served model: how the OpenAI-compatible API names it"""

    served_model_name: list[str] = Field(
        [],
        description="the names clients may send as 'model' (as vLLM's flag: one or more; the first is the one "
        "answers carry when a request names none); none: the model directory's name",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="the format in which the model writes tool calls, read into the chat API's tool_calls "
        "(router/openai_tools.py): hermes (<tool_call> JSON: Qwen2.5, Qwen3) or llama3_json; auto: from the chat "
        "template (hermes for a template without tools, which is then asked for that format)",
    )


class ApiKeySettings(Settings):
    """API key"""

    api_key: str | None = Field(
        None,
        description="clients must send 'Authorization: Bearer <key>' (HTTP and gRPC); better set in the "
        "environment variable, which ps does not show; none: no key",
    )
    api_keys_file: str | None = Field(
        None,
        description="tenants: a TOML file of hashed API keys, each tenant's bounds and weight (see router/tenants.py), "
        "read again on SIGHUP; --api-key is one more tenant beside them",
    )
    fair_queue_slots: int = Field(
        0,
        ge=0,
        description="with --api-keys-file: requests the router sends on to decode workers at once, past which they "
        "wait in its fair queue, shared by tenant weight (kvserve up sets the decode workers' max_num_seqs in "
        "all); 0: none held back",
    )


class RoutingSettings(Settings):
    """cache-aware routing: see router/routing.py"""

    route_block_weight: float = Field(
        RoutingWeights.block_weight, ge=0, description="cost of one prompt block a worker would compute or receive"
    )
    route_host_block_weight: float = Field(
        RoutingWeights.host_block_weight,
        ge=0,
        description="cost of one leading prompt block a worker holds only in its host tier (a copy back)",
    )
    route_disk_block_weight: float = Field(
        RoutingWeights.disk_block_weight,
        ge=0,
        description="cost of one leading prompt block a worker holds only in its disk tier (a read and a copy back)",
    )
    route_load_weight: float = Field(
        RoutingWeights.load_weight, ge=0, description="cost of one request a worker runs or queues"
    )
    route_balance_threshold: int = Field(
        RoutingWeights.balance_threshold, ge=0, description="requests of imbalance past which load alone decides"
    )


class FrontDoorSettings(ApiKeySettings):
    """front door: see router/limits.py"""

    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1, description="largest HTTP body (413) and gRPC message (RESOURCE_EXHAUSTED)"
    )
    max_concurrent_requests: int = Field(
        DEFAULT_MAX_CONCURRENT_REQUESTS,
        ge=0,
        description="generation requests in flight over both doors, past which new ones get 429 / "
        "RESOURCE_EXHAUSTED; 0: no limit",
    )
    max_validation_backlog: int = Field(
        DEFAULT_MAX_BACKLOG,
        ge=1,
        description="prompt characters that may wait for the validation thread, past which new requests get "
        "RESOURCE_EXHAUSTED / 429 (see router/validation_queue.py)",
    )


class RouterSettings(ServeSettings, ModelSettings, ServedModelSettings, RegistrySettings, SecuritySettings,
                     StreamSettings, RoutingSettings, FrontDoorSettings, TracingSettings):  # fmt: skip
    """router: its public doors"""

    max_model_len: int | None = Field(
        None,
        ge=1,
        description="the workers' --max-model-len: the longest sequence a request may grow to, which bounds "
        "max_tokens and a chat's default (kvserve up passes its own); none: the model's context",
    )

    port: int = Field(50051, ge=0, le=65535, description="the public gRPC port (kvserve.v1.Inference)")
    http_port: int = Field(8000, ge=0, le=65535, description="the OpenAI-compatible HTTP API's port; 0: none")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="serve Prometheus /metrics on this port instead of the HTTP API's (0: there)"
    )
    decode_address: list[str] = Field([], description="a static decode worker, without Redis (repeat for more)")
