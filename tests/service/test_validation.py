"""Every rule of ``rpc.validation`` as a client meets it: through the router over real gRPC, with the status
code and a message naming the fix, while valid requests at the edges of the limits are served."""

from __future__ import annotations

import math
import re

import grpc
import pytest
from router_utils import RouterStack

from kvserve.client import build_request
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.validation import MAX_PROMPT_BYTES, validate_sampling

VOCAB = 49152
CONTEXT = 8192


@pytest.fixture(scope="module")
def stack(model_dir):
    s = RouterStack(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield pb_grpc.InferenceStub(channel)


def _resuming(tokens: list[int], num_chars: int = 0, **options) -> pb.GenerateRequest:
    """A request resuming a stream another router carried (``kvserve.failover``) after ``tokens``."""
    request = build_request([1, 2, 3], **options)
    request.resume.output_token_ids[:] = tokens
    request.resume.num_chars = num_chars
    return request


def _chat_without_messages() -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.chat.SetInParent()
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "the request has no prompt: set text, token_ids or chat"),
        (build_request(""), "prompt text is empty"),
        (build_request([]), "prompt token_ids is empty"),
        (_chat_without_messages(), "chat has no messages"),
        (build_request([{"role": "robot", "content": "hi"}]), r"chat message 0 has role 'robot'; use one of"),
        (build_request([{"role": "user", "content": ""}] * CONTEXT), "chat has 8192 messages"),
        (build_request([1, 2, 10**6]), r"prompt token ids must be integers in \[0, 49152\); got \[1000000\]"),
        (build_request([1, 2], priority=2**31), r"priority must be an integer in \[-2147483648, 2147483647\], got "),
        (build_request([5, -1]), r"prompt token ids must be integers in \[0, 49152\); got \[-1\]"),
        (build_request([1] * CONTEXT), "prompt has 8192 tokens; the model's context is 8192"),
        (build_request("word " * 9000), "the model's context is 8192"),
        # past the context's characters (router.validation_queue), refused untokenized
        (build_request("a" * (MAX_PROMPT_BYTES + 1)), f"prompt text is {MAX_PROMPT_BYTES + 1} characters long; no "),
        (build_request("é" * (MAX_PROMPT_BYTES // 2 + 1)), f"prompt text is {MAX_PROMPT_BYTES + 2} bytes long"),
        (
            build_request([{"role": "user", "content": "a" * MAX_PROMPT_BYTES}, {"role": "user", "content": "b"}]),
            f"chat messages' contents are {MAX_PROMPT_BYTES + 1} characters long; no text longer than",
        ),
        (build_request("hi", request_id="r" * 257), "request_id has 257 characters; at most 256"),
        (build_request("hi", request_id="r" * (5 << 20)), "request_id has 5242880 characters"),
        (build_request("hi", temperature=-1.0), r"temperature must be a finite number >= 0 \(0 means greedy\)"),
        (build_request("hi", temperature=math.nan), "temperature must be a finite number >= 0.*got nan"),
        (build_request("hi", temperature=math.inf), "temperature must be a finite number >= 0.*got inf"),
        (build_request("hi", temperature=1e-38), r"temperature must be 0 \(greedy\) or at least 0.01"),
        (build_request("hi", temperature=0.005), r"temperature must be 0 \(greedy\) or at least 0.01"),
        (build_request("hi", top_p=2.0), r"top_p must be in \(0, 1\], got 2.0"),
        (build_request("hi", top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (build_request("hi", top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
        (build_request("hi", top_k=-1), "top_k must be >= 0"),
        (build_request("hi", repetition_penalty=math.nan), "repetition_penalty must be a finite number > 0"),
        (build_request("hi", repetition_penalty=math.inf), "repetition_penalty must be a finite number > 0"),
        (build_request("hi", repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (build_request("hi", max_tokens=0), "max_tokens must be a positive integer, got 0"),
        (build_request("hi", max_tokens=-5), "max_tokens must be a positive integer, got -5"),
        (
            build_request([7] * 100, max_tokens=8093),
            r"prompt \(100 tokens\) \+ max_tokens \(8093\) exceed the model's context of 8192 tokens; "
            "ask for at most 8092 new tokens",
        ),
        (build_request("hi", max_tokens=2**31 - 1), "exceed the model's context of 8192 tokens"),
        (build_request("hi", stop_token_ids=[10**9]), r"stop_token_ids must be integers in \[0, 49152\)"),
        (build_request("hi", stop_token_ids=[VOCAB]), r"stop_token_ids must be integers in \[0, 49152\)"),
        (build_request("hi", stop_token_ids=[-3]), "stop_token_ids must be non-negative integers"),
        (build_request("hi", stop_token_ids=[1] * 257), "257 stop_token_ids; at most 256"),
        (build_request("hi", stop=[""]), "stop strings must be non-empty"),
        (build_request("hi", stop=["x"] * 17), "17 stop strings; at most 16"),
        (build_request("hi", stop=["ok", "x" * 257]), "stop string 1 has 257 characters; at most 256"),
        # a resumed stream, as a continuation (kvserve.failover; engine.continuation)
        (_resuming([5, VOCAB], max_tokens=8), r"resumed output token ids must be integers in \[0, 49152\); got \[4915"),
        (_resuming([5, -2], max_tokens=8), r"resumed output token ids must be integers in \[0, 49152\); got \[-2\]"),
        (_resuming([5] * 8, max_tokens=8), "a continuation resumes 1 to max_tokens - 1 = 7 output tokens, got 8"),
        (_resuming([], max_tokens=8), "a continuation resumes 1 to max_tokens - 1 = 7 output tokens, got 0"),
        (_resuming([5], num_chars=-1, max_tokens=8), "resume.num_chars must be >= 0, got -1"),
        (_resuming([5], max_tokens=8, n=2, temperature=1.0), "resume continues one stream; it cannot have n=2"),
    ],
)
def test_bad_request_gets_invalid_argument(stub, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert re.search(message, err.value.details()), err.value.details()


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xff\xff\xff", b"\x12\x03\xff\xfe\xfd", b"\x0a\x80\x80\x80\x80\x10", b"\x2a\x05\x08\x01"],
    ids=["corrupt", "bad-utf8", "truncated-varint", "truncated-submessage"],
)
def test_undeserializable_bytes_get_invalid_argument(stack, payload):
    with grpc.insecure_channel(stack.address) as channel:
        generate = channel.unary_stream("/kvserve.v1.Inference/Generate", request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(generate(payload, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request is not a valid kvserve.v1.GenerateRequest message" in err.value.details()


def test_requests_at_the_limits_are_served(stub):
    edges = [
        build_request("Hello", temperature=0.01, seed=1, max_tokens=2, ignore_eos=True, request_id="r" * 256),
        build_request(
            [1, 2, 3],
            temperature=1e30,
            top_p=1e-30,
            repetition_penalty=1e30,
            max_tokens=2,
            stop_token_ids=[VOCAB - 1] * 256,
            stop=["x" * 256] * 16,
            ignore_eos=True,
        ),
        build_request([{"role": "user", "content": "Hi"}] * 8, max_tokens=1, seed=-(2**63)),
    ]
    for request in edges:
        replies = list(stub.Generate(request, timeout=120))
        assert replies[-1].finish_reason == "length"
        assert all(r.request_id == (request.request_id or replies[0].request_id) for r in replies)
        assert sum(len(r.token_ids) for r in replies) == request.sampling.max_tokens


def test_unset_max_tokens_is_lowered_to_the_room_left_in_the_context():
    opts = pb.SamplingOptions()
    assert validate_sampling(opts, VOCAB, num_prompt_tokens=100, max_context=CONTEXT).max_tokens == 16
    assert validate_sampling(opts, VOCAB, num_prompt_tokens=CONTEXT - 3, max_context=CONTEXT).max_tokens == 3
    # without a context (a worker that only re-checks the settings) nothing is lowered
    assert validate_sampling(pb.SamplingOptions(max_tokens=10**6), VOCAB).max_tokens == 10**6
