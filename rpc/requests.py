"""Building a public ``pb.GenerateRequest`` from plain Python values: the client library and the router's
OpenAI-compatible HTTP API both use it, so that a request means the same whichever door it came through; and
the API key a client sends with it (``router.limits`` checks it).

Only protobuf is imported here (no engine, no torch): the client library stays light. Nothing is validated
here; ``rpc.validation`` does that for every request the router receives.
"""

from __future__ import annotations

import os

from protos.kvserve.v1 import kvserve_pb2 as pb

API_KEY_ENV = "KVSERVE_API_KEY"  # the router's API key, and the one its clients send by default
Prompt = str | list[int] | list[dict[str, str]]
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "streaming_window",
             "streaming_sinks", "speculative", "presence_penalty", "frequency_penalty", "min_tokens", "min_p",
             "logprobs", "prompt_logprobs", "n")  # fmt: skip


def build_request(
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    repetition_penalty: float | None = None,
    streaming_window: int | None = None,
    streaming_sinks: int | None = None,
    speculative: bool | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int | None = None,
    min_p: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int | None = None,
    request_id: str = "",
) -> pb.GenerateRequest:
    """``prompt`` is text, token ids or chat messages (``{"role", "content"}`` dicts); ``None`` options stay
    unset, so the server applies its defaults (``engine.sampling_params.SamplingParams`` says what each does;
    ``n``: that many choices, their messages told apart by ``GenerateResponse.index``)."""
    values = locals()
    sampling = pb.SamplingOptions(
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        logit_bias=logit_bias or {},
        **{name: values[name] for name in _OPTIONAL if values[name] is not None},
    )
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        request.token_ids.ids.extend(prompt)
        request.token_ids.SetInParent()  # an empty list is still "token_ids", so the server can say it is empty
    return request


def resolve_api_key(given: str | None = None) -> str | None:
    """The API key: ``given``, else ``$KVSERVE_API_KEY``; None when neither is set (or only blanks)."""
    return (given if given is not None else os.environ.get(API_KEY_ENV, "")).strip() or None


def api_key_metadata(given: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the API key (``resolve_api_key``) as the router expects it, if there is one."""
    key = resolve_api_key(given)
    return (("authorization", f"Bearer {key}"),) if key else ()
