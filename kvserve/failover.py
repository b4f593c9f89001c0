"""A client's calls across several routers (``kvserve.Client``, ``AsyncClient``): which router a call goes to,
and what it does when that router fails.

Routers are replicas: any of them serves any request (``kvserve up --routers N``, two in docker-compose and the
Kubernetes manifests). A client given several (a list, ``"a:50051,b:50051"``, or one name whose DNS records
name several addresses) starts each call on the next one in turn (its first on a random one), passing over
for ``BENCH_S`` one that was just unreachable. With failover on (the default):

* a call that fails UNAVAILABLE before its first token (the router is down, restarting or draining, or found
  no decode worker) is sent again to the next router;
* a stream broken mid-way the same way is resumed through the next router: the same request with the tokens
  already received and the characters of their text (``GenerateRequest.resume``). That router's decode worker
  computes their KV and goes on as the first would have (the decode side's continuation, as when a router
  moves a stream off a dead decode worker), so the caller reads one uninterrupted stream, with the same tokens
  for greedy and seeded requests. A stream of ``n > 1`` choices, or one that asked for prompt logprobs, is not
  resumed: the caller gets the error.

Each router is tried at most once a call; when all failed the last error is raised. Any other status
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED, ...) is the request's answer and is raised at once.
``failover=False`` raises every error as it comes, on the first router tried.
"""

from __future__ import annotations

import ipaddress
import itertools
import random
import socket
import time
from collections.abc import Iterator, Sequence

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb

BENCH_S = 5.0  # a router that was unreachable is not a call's first choice for this long
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


def router_addresses(address: str | Sequence[str]) -> tuple[list[str], str | None]:
    """(the routers' ``host:port`` addresses, the name TLS must verify when a DNS name became addresses, else
    None). ``address``: a list, a comma-separated string, or one ``host:port`` whose name has several DNS
    records of one family (IPv4 preferred), each a router; a name with one record stays a name."""
    addresses = [a.strip() for a in address.split(",")] if isinstance(address, str) else [a.strip() for a in address]
    addresses = [a for a in addresses if a]
    if not addresses:
        raise ValueError("no router address given")
    if len(addresses) > 1:
        return addresses, None
    host, _, port = addresses[0].rpartition(":")
    if not host or not port.isdigit() or _is_ip(host.strip("[]")):
        return addresses, None
    try:
        records = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:  # unresolvable now: gRPC reports it at the first call, as for any bad name
        return addresses, None
    by_family = {socket.AF_INET: [], socket.AF_INET6: []}
    for family, *_, sockaddr in records:
        if family in by_family and sockaddr[0] not in by_family[family]:
            by_family[family].append(sockaddr[0])
    ips = by_family[socket.AF_INET] or by_family[socket.AF_INET6]
    if len(ips) < 2:
        return addresses, None
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips], host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Routers:
    """The routers of one client: the order each call tries them in, and which were just unreachable."""

    def __init__(self, count: int, failover: bool) -> None:
        self.count, self.failover = count, failover
        self._next = itertools.count(random.randrange(count))  # many clients' first calls spread
        self._benched: dict[int, float] = {}  # router index -> until when it is not a first choice

    def order(self) -> list[int]:
        """This call's routers: from the next in turn, those benched last (only one without failover)."""
        start = next(self._next) % self.count
        ring = [(start + i) % self.count for i in range(self.count)]
        now = time.monotonic()
        ring.sort(key=lambda i: self._benched.get(i, 0.0) > now)  # stable: the turn order otherwise
        return ring if self.failover else ring[:1]

    def bench(self, index: int) -> None:
        self._benched[index] = time.monotonic() + BENCH_S


class Call:
    """One call's tries: the request each router gets, and whether an error ends the call or moves it on."""

    def __init__(self, request: pb.GenerateRequest, routers: Routers) -> None:
        self.request, self.routers = request, routers
        self.tokens: list[int] = []
        self.num_chars = 0

    def tries(self) -> Iterator[tuple[int, pb.GenerateRequest, bool]]:
        """(router index, what to send it, whether it is the last router left) for each try, in order; the
        caller stops after a try that went through, and ``failed`` raises when none may follow."""
        order = self.routers.order()
        for i, index in enumerate(order):
            yield index, self._request(), i == len(order) - 1

    def _request(self) -> pb.GenerateRequest:
        if not self.tokens:
            return self.request
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.resume.output_token_ids[:] = self.tokens
        resumed.resume.num_chars = self.num_chars
        return resumed

    def received(self, msg: pb.GenerateResponse) -> None:
        self.tokens.extend(msg.token_ids)
        self.num_chars += len(msg.text)

    def failed(self, index: int, err: grpc.RpcError, last: bool) -> None:
        """Raise ``err`` unless the call may go on through another router (``last``: none is left)."""
        if err.code() in _RETRYABLE:
            self.routers.bench(index)
        sampling = self.request.sampling
        resumable = not self.tokens or (sampling.n <= 1 and not sampling.HasField("prompt_logprobs"))
        if last or not self.routers.failover or err.code() not in _RETRYABLE or not resumable:
            raise err
