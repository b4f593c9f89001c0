"""A stream whose decode worker fails mid-way continues on another one: the router sends it the prompt, the
tokens already relayed and how many characters of their text the client has, and relays the rest as one
stream. ``--migrate-streams false`` hands the error to the client instead. (The real workers' side, token for
token against the offline engine, is in test_continuation.py and test_faults.py.)"""

from __future__ import annotations

import grpc
import pytest
from router_utils import new_router
from service_utils import InProcessServer

from kvserve.client import Client
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.loop import AsyncioThread


class _DiesAfterTwoTokens(pb_grpc.DecodeServicer):
    """Streams two tokens of a new request, then fails as a dying or draining worker does; finishes a
    continuation with one more token."""

    def __init__(self) -> None:
        self.requests: list[pb.DecodeRequest] = []

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        if not request.resumed_output_token_ids:
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[11], text="Hel")
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[12], text="lo")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is shutting down; retry")
        done = pb.GenerateResponse(request_id=request.request_id, token_ids=[13], text=" you", finish_reason="length",
                                   decode_worker="second")  # fmt: skip
        done.usage.prompt_tokens, done.usage.completion_tokens = 3, 3
        yield done


@pytest.fixture
def two_flaky_workers(model_dir):
    aio = AsyncioThread()
    workers = [_DiesAfterTwoTokens(), _DiesAfterTwoTokens()]
    servers = [InProcessServer({"Decode": w}, aio=aio) for w in workers]
    router = new_router(model_dir, [s.address for s in servers])
    front = InProcessServer({"Inference": router}, aio=aio)
    yield router, front.address, workers
    front.stop()
    aio.run(router.close())
    for server in servers:
        server.stop()
    aio.stop()


def test_a_stream_continues_on_another_worker_with_what_was_relayed(two_flaky_workers):
    _, address, workers = two_flaky_workers
    with Client(address, timeout_s=30) as client:
        chunks = list(client.stream([1, 2, 3], max_tokens=3, temperature=0))
    assert [t for c in chunks for t in c.token_ids] == [11, 12, 13]
    assert "".join(c.text for c in chunks) == "Hello you"
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 3
    first, second = sorted(workers, key=lambda w: len(w.requests[0].resumed_output_token_ids) if w.requests else 9)
    assert len(first.requests) == 1 and len(second.requests) == 1
    continuation = second.requests[0]
    assert list(continuation.prompt_token_ids) == [1, 2, 3]
    assert list(continuation.resumed_output_token_ids) == [11, 12] and continuation.num_resumed_chars == 5
    assert continuation.request_id == first.requests[0].request_id
    assert continuation.sampling.max_tokens == 3  # the worker counts the resumed tokens against it


def test_with_migration_off_the_client_gets_the_error(two_flaky_workers):
    router, address, workers = two_flaky_workers
    router.migrate_streams = False
    tokens = []
    with Client(address, timeout_s=30) as client, pytest.raises(grpc.RpcError) as err:
        for chunk in client.stream([1, 2, 3], max_tokens=3, temperature=0):
            tokens += chunk.token_ids
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and tokens == [11, 12]
    assert sum(len(w.requests) for w in workers) == 1


def test_a_stream_of_several_choices_is_not_moved(two_flaky_workers):
    """Its choices' tokens interleave: resuming them as one stream would be wrong, so the client gets the error."""
    _, address, workers = two_flaky_workers
    tokens = []
    with Client(address, timeout_s=30) as client, pytest.raises(grpc.RpcError) as err:
        for chunk in client.stream([1, 2, 3], max_tokens=3, temperature=0, n=2):
            tokens += chunk.token_ids
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "several choices" in err.value.details()
    assert tokens == [11, 12] and sum(len(w.requests) for w in workers) == 1
