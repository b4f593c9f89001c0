"""A request's life in the router:

1. ``Generate`` validates the prompt (text, token ids or chat messages) and the
   sampling options; anything wrong ends the call with INVALID_ARGUMENT and a
   message saying what to change.
2. It tokenizes (rendering chat messages with the model's chat template),
   ranks the live decode workers from the Redis registry by load and names
   the least-loaded prefill worker for the decode worker to use.
3. It calls the first one and relays its stream; the decode worker's text
   deltas come from an incremental detokenizer and never end inside a
   multi-byte character. A worker that fails before its first token is
   replaced by the next one; after that the error goes to the client.
   A client that cancels cancels the decode call, which frees its blocks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter

import grpc

from engine.tokenizer import Tokenizer
from rpc.auth import GRPC_OPTIONS
from rpc.convert import sampling_from_proto
from kvstore.registry import Registry
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}
_ROLES = {"system", "user", "assistant"}


class Router(pb_grpc.InferenceServicer):
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_context: int,
        registry: Registry | None = None,
        decode_addresses: list[str] | None = None,
        max_attempts: int = 3,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.registry = registry
        self.decode_addresses = decode_addresses or []
        self.max_attempts = max_attempts
        self._channels: dict[str, grpc.Channel] = {}
        self._in_flight: Counter[str] = Counter()  # calls this router has open, per decode address / prefill id
        self._lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        received = time.perf_counter()
        try:
            prompt = self._prompt_ids(request)
            sampling_from_proto(request.sampling)  # validation only; the decode worker builds its own
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        request_id = request.request_id or uuid.uuid4().hex
        targets, first_slot = self._decode_targets()
        if not targets:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is available; is the cluster up?")
        errors = []
        with first_slot, self._claim_prefill() as prefill_slot:  # (the outer release is a no-op once done)
            call_request = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=request.sampling,
                                            preferred_prefill_worker=prefill_slot.key)  # fmt: skip
            for attempt, address in enumerate(targets[: self.max_attempts]):
                remaining = context.time_remaining()  # effectively infinite when the client set no deadline
                timeout = remaining if remaining is not None and remaining < 1e6 else None
                call = pb_grpc.DecodeStub(self._channel(address)).Generate(call_request, timeout=timeout)
                context.add_callback(call.cancel)
                sent = False
                with first_slot if attempt == 0 else self._claim(address):
                    try:
                        for msg in call:
                            if not sent:
                                sent = True
                                prefill_slot.release()  # the prompt is prefilled once the first token exists
                            if msg.finish_reason:  # TTFT is the decode worker's; total includes the router's part
                                msg.timings.total_ms = (time.perf_counter() - received) * 1000
                            yield msg
                        return
                    except grpc.RpcError as err:
                        if not context.is_active():
                            return
                        if sent or err.code() not in _RETRYABLE:
                            context.abort(err.code(), err.details() or "decode worker failed")
                        errors.append(f"{address}: {err.code().name} {err.details()}")
                        log.warning("decode worker %s failed before its first token (%s); trying another",
                                    address, err.code())  # fmt: skip
        context.abort(grpc.StatusCode.UNAVAILABLE, "every decode worker tried failed: " + "; ".join(errors))

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("the request has no prompt: set text, token_ids or chat")
        if kind == "text":
            if not request.text:
                raise ValueError("prompt text is empty")
            ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise ValueError("prompt token_ids is empty")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        else:
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise ValueError("chat has no messages")
            for i, m in enumerate(messages):
                if m["role"] not in _ROLES:
                    raise ValueError(f"chat message {i} has role {m['role']!r}; use one of {sorted(_ROLES)}")
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        return ids

    def _load(self, key: str, reported: int) -> int:
        """A worker's load: what it last reported, or what this router has sent it since, whichever is more.

        Heartbeats are seconds apart; without counting its own calls the router would send a whole
        burst to the worker that looked idle at the last heartbeat.
        """
        return max(reported, self._in_flight[key])

    def _claim_prefill(self) -> _Slot:
        """The least-loaded live prefill worker (the decode worker falls back to its own choice), counted as
        in flight in the same locked step, so that concurrent requests see each other's choices."""
        live = self.registry.workers("prefill") if self.registry is not None else []
        with self._lock:
            if not live:
                return _Slot(self, "")
            best = min(live, key=lambda w: (self._load(w.worker_id, w.num_running + w.num_waiting), w.worker_id))
            return _Slot(self, best.worker_id)

    def _decode_targets(self) -> tuple[list[str], _Slot]:
        """Decode worker addresses, least loaded first, and the first one already counted as in flight
        (ranked and counted in one locked step, like ``_claim_prefill``)."""
        live = self.registry.workers("decode") if self.registry is not None else []
        with self._lock:
            if live:
                ranked = sorted(live, key=lambda w: (self._load(w.address, w.num_running + w.num_waiting),
                                                     -w.free_blocks / max(1, w.total_blocks), w.worker_id))  # fmt: skip
                targets = [w.address for w in ranked]
            else:
                targets = list(self.decode_addresses)
            return targets, _Slot(self, targets[0] if targets else "")

    def _claim(self, key: str) -> _Slot:
        """Count a call to ``key`` as in flight until the slot is released (``with`` releases it at the end)."""
        with self._lock:
            return _Slot(self, key)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
            return self._channels[address]


class _Slot:
    """One in-flight call on a router's counter; releasing it twice is harmless. Made under the router's lock."""

    def __init__(self, router: Router, key: str) -> None:
        self.router, self.key, self.held = router, key, bool(key)
        if self.held:
            router._in_flight[key] += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            with self.router._lock:
                self.router._in_flight[self.key] -= 1

    def __enter__(self) -> _Slot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
