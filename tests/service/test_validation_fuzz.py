"""Hostile requests against the router in front of a real decode worker: whatever a client sends, the answer
is a served stream or INVALID_ARGUMENT with a message, never INTERNAL or UNKNOWN, and the router keeps serving.

About two thirds of the generated requests are invalid and end at the router's validation; the valid ones
ask for at most two tokens and run on the decode worker, so every rule's accepting side is exercised too.
``make test`` sends 300 requests; ``KVSERVE_FUZZ_EXAMPLES=2000 pytest tests/service/test_validation_fuzz.py`` sends
more.
"""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from router_utils import RouterStack

from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.validation import MAX_PROMPT_BYTES

VOCAB = 49152
CONTEXT = 8192
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` nine times in ten, else ``hostile``: with a dozen fields, about a third of the requests are
    valid, and every rule is reached (a request is refused at its first bad field)."""
    return st.integers(0, 9).flatmap(lambda i: hostile if i == 0 else valid)


# every kind of bad float: negative, zero, tiny, huge, NaN and infinities
BAD_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.0, -0.0, -1.0, 1e-38, 0.0099, 3.4e38]))  # fmt: skip
SHORT_TEXT = st.text(max_size=40)
TOKEN_ID = mostly(st.integers(0, VOCAB - 1), INT32)
TEXT = mostly(st.text(min_size=1, max_size=40),
              st.sampled_from(["", "a " * 20_000, "a" * (MAX_PROMPT_BYTES + 1)]))  # fmt: skip
ROLE = mostly(st.sampled_from(["system", "user", "assistant"]), SHORT_TEXT)
REQUEST_ID = mostly(SHORT_TEXT, st.sampled_from([257, 5 << 20]).map(lambda n: "r" * n))
# unset would mean 16 tokens, too slow here: valid ones ask for one or two
MAX_TOKENS = mostly(st.integers(1, 2), st.one_of(st.integers(-(2**31), 0), st.integers(CONTEXT, 2**31 - 1)))
STOP = mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3),
              st.one_of(st.lists(SHORT_TEXT, max_size=20), st.just(["s" * 257])))  # fmt: skip
STOP_TOKEN_IDS = mostly(st.lists(st.integers(0, VOCAB - 1), max_size=4),
                        st.one_of(st.lists(INT32, min_size=1, max_size=4), st.just([1] * 257)))  # fmt: skip


@st.composite
def requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(REQUEST_ID))
    kind = draw(mostly(st.sampled_from(["text", "token_ids", "chat"]), st.just("none")))
    if kind == "text":
        request.text = draw(TEXT)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(mostly(st.lists(TOKEN_ID, min_size=1, max_size=64),
                                                 st.sampled_from([[], [1] * CONTEXT]))))  # fmt: skip
        request.token_ids.SetInParent()
    elif kind == "chat":
        messages = draw(mostly(st.lists(st.tuples(ROLE, SHORT_TEXT), min_size=1, max_size=4), st.just([])))
        request.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
        request.chat.SetInParent()
    sampling = request.sampling
    for name, valid in (("temperature", st.one_of(st.just(0.0), st.floats(0.01, 2.0))),
                        ("top_p", st.floats(0.01, 1.0)), ("repetition_penalty", st.floats(0.5, 2.0))):  # fmt: skip
        if draw(st.booleans()):
            setattr(sampling, name, draw(mostly(valid, BAD_FLOATS)))
    if draw(st.booleans()):
        sampling.top_k = draw(mostly(st.integers(0, 100), INT32))
    if draw(st.booleans()):
        sampling.seed = draw(INT64)
    sampling.max_tokens = draw(MAX_TOKENS)
    sampling.stop.extend(draw(STOP))
    sampling.stop_token_ids.extend(draw(STOP_TOKEN_IDS))
    sampling.ignore_eos = draw(st.booleans())
    return request


@pytest.fixture(scope="module")
def channel(model_dir):
    stack = RouterStack(model_dir)
    with grpc.insecure_channel(stack.address) as channel:
        yield channel
    stack.stop()


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "150")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(request=requests())
def test_fuzzed_requests_are_served_or_refused_with_a_reason(channel, request):
    try:
        replies = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert err.details()
        event(f"refused: {err.details()[:24]}")
        return
    event("served")
    assert replies[-1].finish_reason in ("stop", "length")
    assert 1 <= sum(len(r.token_ids) for r in replies) <= request.sampling.max_tokens <= 2
    assert all(r.request_id == (request.request_id or replies[0].request_id) for r in replies)


@settings(max_examples=200, deadline=None, database=None)
@given(payload=st.binary(max_size=200))
def test_fuzzed_bytes_never_get_internal(channel, payload):
    generate = channel.unary_stream("/kvserve.v1.Inference/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
    try:
        list(generate(payload, timeout=60))
    except grpc.RpcError as err:
        assert err.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (err.code(), err.details())
