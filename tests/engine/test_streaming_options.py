"""StreamingLLM's options at every door: the engine's start-up options and flags, a request's
``SamplingParams``, the gRPC wire, the OpenAI HTTP body and the router's and workers' validation; bad values
get a clear error (INVALID_ARGUMENT for a request), and a streaming request is not bounded by the context."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from decode_service.request import validate_decode_request
from decode_service.settings import DecodeSettings
from engine import SamplingParams
from engine.config import EngineConfig
from protos.kvserve.v1 import kvserve_pb2 as pb
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from rpc.convert import sampling_from_proto, sampling_to_proto
from rpc.settings import validate_settings
from rpc.validation import validate_generate

BAD_ENGINE_OPTIONS = [
    ({"streaming_window": 8}, "streaming_window=8 is smaller than one KV block (16 tokens)"),
    ({"streaming_window": 64, "streaming_sinks": 64}, "streaming_sinks=64 must be below streaming_window=64"),
    ({"streaming_window": 64, "streaming_sinks": 100}, "streaming_sinks=100 must be below streaming_window=64"),
    ({"streaming_window": -1}, "greater than or equal to 0"),
    ({"streaming_window": 64, "streaming_sinks": -4}, "greater than or equal to 0"),
]


@pytest.mark.parametrize("options,message", BAD_ENGINE_OPTIONS)
def test_bad_engine_options_fail_at_start_up(options, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=re.escape(message)):  # a worker's flags: one line, as argparse prints it
        validate_settings(DecodeSettings, {name: str(value) for name, value in options.items()})


def test_good_engine_options():
    config = EngineConfig(streaming_window=1020, block_size=16)
    assert (config.streaming_window, config.streaming_sinks) == (1020, 4)
    assert EngineConfig(streaming_window=16, streaming_sinks=0).streaming_sinks == 0
    assert EngineConfig().streaming_window == 0


def test_bad_request_options_are_refused_before_queueing(llm):
    engine = llm.engine
    cases = [
        (SamplingParams(streaming_window=8), "smaller than one KV block"),
        (SamplingParams(streaming_window=64, streaming_sinks=64), "must be below streaming_window=64"),
        (SamplingParams(streaming_window=64, streaming_sinks=70), "must be below streaming_window=64"),
        (SamplingParams(streaming_window=100_000), "needs 7815 KV blocks"),  # more than the pool of 512
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.validate([1, 2, 3], params)
    for field in ("streaming_window", "streaming_sinks"):
        with pytest.raises(ValueError, match=f"{field} must be an integer >= 0, got -1"):
            SamplingParams(**{field: -1})
    assert not engine.has_unfinished_requests()


def test_a_streaming_prompt_and_length_are_not_bounded_by_the_context(llm):
    engine = llm.engine
    long = [5] * (engine.max_model_len + 10)
    with pytest.raises(ValueError, match="fit"):
        engine.validate(long, SamplingParams())
    assert engine.validate(long, SamplingParams(streaming_window=64)) == long


def test_the_wire_carries_the_options_and_leaves_unset_ones_unset():
    params = SamplingParams(temperature=0, streaming_window=1020, streaming_sinks=4)
    opts = sampling_to_proto(params)
    assert (opts.streaming_window, opts.streaming_sinks) == (1020, 4)
    assert sampling_from_proto(opts) == params
    plain = sampling_to_proto(SamplingParams())
    assert not plain.HasField("streaming_window") and not plain.HasField("streaming_sinks")
    assert sampling_from_proto(plain).streaming_window is None  # the worker's default holds


def test_the_openai_body_takes_the_same_names():
    body = CompletionRequest(prompt=[1, 2, 3], max_tokens=5, streaming_window=64, streaming_sinks=2)
    sampling = body.to_protos("r")[0].sampling
    assert (sampling.streaming_window, sampling.streaming_sinks) == (64, 2)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], streaming_window=32)
    assert chat.to_proto("r").sampling.streaming_window == 32
    assert not CompletionRequest(prompt="hi").to_protos("r")[0].sampling.HasField("streaming_window")


def test_the_router_lifts_the_context_bound_for_a_streaming_request():
    context, vocab = 100, 1000
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 150), sampling=pb.SamplingOptions(max_tokens=500))
    with pytest.raises(ValueError, match="the model's context is 100"):
        validate_generate(long, None, vocab, context)
    long.sampling.streaming_window = 64
    ids, params = validate_generate(long, None, vocab, context)
    assert len(ids) == 150 and params.max_tokens == 500 and params.streaming_window == 64
    long.sampling.streaming_sinks = -2
    with pytest.raises(ValueError, match="streaming_sinks must be an integer >= 0"):
        validate_generate(long, None, vocab, context)


def test_the_decode_worker_refuses_a_bad_window_as_invalid_argument(llm):
    """The decode worker's ``Generate`` turns this ``ValueError`` into INVALID_ARGUMENT, before any block."""
    request = pb.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                               sampling=pb.SamplingOptions(streaming_window=8))  # fmt: skip
    with pytest.raises(ValueError, match="streaming_window=8 is smaller than one KV block"):
        validate_decode_request(request, llm.engine)
    request.sampling.streaming_window = 64
    prompt, params, _ = validate_decode_request(request, llm.engine)
    assert llm.engine.ring_for(params).window == 64
