"""``kvserve.failover``: the routers a client is given, the order a call tries them in, and which errors move a
call (or resume its stream) to the next router. The failover itself, through real routers one of which is
SIGKILLed, is tests/cluster/test_router_failover.py."""

from __future__ import annotations

import socket

import grpc
import pytest

from kvserve.failover import Call, Routers, router_addresses
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.requests import build_request


class Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def test_router_addresses_from_a_list_a_comma_separated_string_or_one_address():
    assert router_addresses(["a:1", " b:2 "]) == (["a:1", "b:2"], None)
    assert router_addresses("a:1, b:2") == (["a:1", "b:2"], None)
    assert router_addresses("127.0.0.1:50051") == (["127.0.0.1:50051"], None)
    assert router_addresses("[::1]:50051") == (["[::1]:50051"], None)
    assert router_addresses("localhost:50051") == (["localhost:50051"], None)  # one IPv4 record: a name
    with pytest.raises(ValueError, match="no router address given"):
        router_addresses(" , ")


def test_a_name_with_several_records_is_a_router_each(monkeypatch):
    records = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 7, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 7)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", 7)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 7))]  # fmt: skip
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: records)
    assert router_addresses("routers.example:7") == (["10.0.0.1:7", "10.0.0.2:7"], "routers.example")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: records[:1] + records[:1])
    assert router_addresses("routers.example:7") == (["routers.example:7"], None)


def test_calls_take_the_routers_in_turn_and_an_unreachable_one_last():
    routers = Routers(3, failover=True)
    orders = [routers.order() for _ in range(3)]
    assert sorted(order[0] for order in orders) == [0, 1, 2]  # each starts on the next
    assert all(sorted(order) == [0, 1, 2] for order in orders)
    routers.bench(orders[0][0])
    assert all(order[-1] == orders[0][0] for order in (routers.order() for _ in range(3)))
    assert [len(Routers(3, failover=False).order()) for _ in range(3)] == [1, 1, 1]


def test_an_unavailable_router_moves_the_call_on_and_a_broken_stream_resumes():
    routers = Routers(2, failover=True)
    call = Call(build_request([1, 2, 3], max_tokens=8, temperature=0), routers)
    tries = call.tries()
    index, first, last = next(tries)
    assert not first.HasField("resume") and not last
    call.received(pb.GenerateResponse(token_ids=[7, 8], text="ab"))
    call.failed(index, Failure(grpc.StatusCode.UNAVAILABLE), last)  # goes on
    index2, second, last = next(tries)
    assert index2 != index and last
    assert list(second.resume.output_token_ids) == [7, 8] and second.resume.num_chars == 2
    assert list(second.token_ids.ids) == [1, 2, 3] and second.sampling.max_tokens == 8  # the same request
    with pytest.raises(Failure):  # none left
        call.failed(index2, Failure(grpc.StatusCode.UNAVAILABLE), last)


@pytest.mark.parametrize(
    ("options", "code", "received"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, False),  # the request's answer, from any router
        ({}, grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        ({"n": 2, "temperature": 1.0}, grpc.StatusCode.UNAVAILABLE, True),  # several choices' streams
        ({"prompt_logprobs": 1}, grpc.StatusCode.UNAVAILABLE, True),
    ],
)
def test_errors_that_end_the_call(options, code, received):
    call = Call(build_request([1, 2, 3], max_tokens=8, **options), Routers(2, failover=True))
    index, _, last = next(call.tries())
    if received:
        call.received(pb.GenerateResponse(token_ids=[7], text="a"))
    with pytest.raises(Failure):
        call.failed(index, Failure(code), last)


def test_without_failover_the_first_error_is_raised():
    call = Call(build_request([1, 2, 3]), Routers(2, failover=False))
    index, _, last = next(call.tries())
    assert last
    with pytest.raises(Failure):
        call.failed(index, Failure(grpc.StatusCode.UNAVAILABLE), last)
