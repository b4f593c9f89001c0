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

import grpc

from engine.tokenizer import Tokenizer
from kvserve.serving import GRPC_OPTIONS, sampling_from_proto
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
        self._lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        received = time.perf_counter()
        try:
            prompt = self._prompt_ids(request)
            sampling_from_proto(request.sampling)  # validation only; the decode worker builds its own
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        request_id = request.request_id or uuid.uuid4().hex
        call_request = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=request.sampling,
                                        preferred_prefill_worker=self._prefill_choice())  # fmt: skip
        targets = self._decode_targets()
        if not targets:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is available; is the cluster up?")
        errors = []
        for address in targets[: self.max_attempts]:
            remaining = context.time_remaining()  # effectively infinite when the client set no deadline
            timeout = remaining if remaining is not None and remaining < 1e6 else None
            call = pb_grpc.DecodeStub(self._channel(address)).Generate(call_request, timeout=timeout)
            context.add_callback(call.cancel)
            sent = False
            try:
                for msg in call:
                    sent = True
                    if msg.finish_reason:  # TTFT is the decode worker's; the total includes the router's part
                        msg.timings.total_ms = (time.perf_counter() - received) * 1000
                    yield msg
                return
            except grpc.RpcError as err:
                if not context.is_active():
                    return
                if sent or err.code() not in _RETRYABLE:
                    context.abort(err.code(), err.details() or "decode worker failed")
                errors.append(f"{address}: {err.code().name} {err.details()}")
                log.warning("decode worker %s failed before its first token (%s); trying another", address, err.code())
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

    def _prefill_choice(self) -> str:
        """The least-loaded live prefill worker (the decode worker falls back to its own choice)."""
        live = self.registry.workers("prefill") if self.registry is not None else []
        if not live:
            return ""
        return min(live, key=lambda w: (w.num_running + w.num_waiting, w.worker_id)).worker_id

    def _decode_targets(self) -> list[str]:
        if self.registry is not None:
            live = self.registry.workers("decode")
            if live:
                ranked = sorted(
                    live,
                    key=lambda w: (w.num_running + w.num_waiting - w.free_blocks / max(1, w.total_blocks), w.worker_id),
                )
                return [w.address for w in ranked]
        return list(self.decode_addresses)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
            return self._channels[address]
