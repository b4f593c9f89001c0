"""What the router keeps per stream: what it relayed to the client (so that a stream whose decode worker dies
can continue on another as one), and its place on a worker's count of calls in flight."""

from __future__ import annotations

import time
from collections import Counter

from engine.continuation import Continuation
from protos.kvserve.v1 import kvserve_pb2 as pb


class Relayed:
    """What a stream has relayed to its client so far: the tokens and the characters of their text, so that a
    stream whose decode worker dies (or drains) can continue on another as one uninterrupted stream."""

    def __init__(self, resumed: Continuation | None = None) -> None:
        """``resumed``: what the client had from another router already (``GenerateRequest.resume``)."""
        self.tokens: list[int] = list(resumed.output_token_ids) if resumed else []
        self.num_chars = resumed.num_emitted_chars if resumed else 0
        self.first_at: float | None = None
        self.moved = False  # the stream continues on another worker than the one that began it

    def resume(self, request: pb.DecodeRequest) -> None:
        """Make ``request`` continue after what was relayed (nothing yet: the plain request)."""
        request.resumed_output_token_ids[:] = self.tokens
        request.num_resumed_chars = self.num_chars
        self.moved = bool(self.tokens)

    def add(self, msg: pb.GenerateResponse, received: float) -> None:
        now = time.perf_counter()
        self.first_at = self.first_at or now
        self.tokens.extend(msg.token_ids)
        self.num_chars += len(msg.text)
        if msg.finish_reason:  # TTFT as this client saw it (the worker that ends a moved stream did not send it)
            if self.moved:
                msg.timings.ttft_ms = (self.first_at - received) * 1000
            msg.timings.total_ms = (now - received) * 1000


class Slot:
    """One in-flight call on a router's counter; releasing it twice is harmless. An empty key counts nothing."""

    def __init__(self, in_flight: Counter[str], key: str) -> None:
        self.in_flight, self.key, self.held = in_flight, key, bool(key)
        if self.held:
            in_flight[key] += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.in_flight[self.key] -= 1

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
