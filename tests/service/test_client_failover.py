"""``kvserve.AsyncClient`` and ``Client`` across two routers over one decode worker (real gRPC, in this process):
a call whose first router does not answer goes to the other, and an async stream whose router stops mid-way is
resumed through the other, giving the same greedy tokens as one unbroken stream. (SIGKILLed router processes
under load, through ``Client``: tests/cluster/test_router_failover.py.)"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from router_utils import RouterStack, new_router
from service_utils import InProcessServer

from kvserve.client import AsyncClient, Client

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def routers(model_dir):
    """Router A (the stack's) and router B, both over the stack's one decode worker; B is stopped by the test
    that needs it stopped, so each test gets its own B."""
    stack = RouterStack(model_dir, num_blocks=128)
    with Client(stack.address, timeout_s=60) as client:
        expected = client.generate(PROMPT, **GREEDY)
    yield stack, expected
    stack.stop()


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once it is closed


def test_a_call_whose_router_does_not_answer_goes_to_the_other(routers):
    stack, expected = routers
    dead = _dead_address()
    with Client([dead, stack.address], timeout_s=60) as client:
        assert [client.generate(PROMPT, **GREEDY).token_ids for _ in range(2)] == [expected.token_ids] * 2

    async def async_calls() -> list[list[int]]:
        async with AsyncClient([dead, stack.address], timeout_s=60) as client:
            return [(await client.generate(PROMPT, **GREEDY)).token_ids for _ in range(2)]

    assert asyncio.run(async_calls()) == [expected.token_ids] * 2
    with Client([dead, stack.address], timeout_s=60, failover=False) as client, \
            pytest.raises(grpc.RpcError) as err:  # fmt: skip
        for _ in range(2):  # (the calls take the routers in turn: one of two starts on the dead one)
            client.generate(PROMPT, **GREEDY)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_async_stream_whose_router_stops_is_resumed_through_the_other(routers, model_dir):
    stack, expected = routers
    second = InProcessServer({"Inference": new_router(model_dir, [stack.decode.address])}, aio=stack.aio)

    async def stream() -> tuple[list[int], str]:
        tokens, text = [], ""
        async with AsyncClient([second.address, stack.address], timeout_s=60) as client:
            client._routers.bench(1)  # (the stack's router last: the stream starts on the one stopped below)
            async for chunk in client.stream(PROMPT, **GREEDY):
                tokens += chunk.token_ids
                text += chunk.text
                if len(tokens) >= 4 and not second._stopped:
                    second.stop()  # mid-way: the stream goes on through the stack's router
        return tokens, text

    tokens, text = asyncio.run(stream())
    assert second._stopped and tokens == expected.token_ids and text == expected.text
