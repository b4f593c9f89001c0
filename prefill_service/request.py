"""A ``Prefill`` call checked before any work, as ``decode_service.request`` checks a ``Generate`` call: the
destination's layout and lease, the sampling and the prompt (the router's rules, ``rpc.validation``, and the
engine's), and the cached prefix and blocks the lease offers. ``Refused`` carries the status and a message a
person can act on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cluster_state import lease
from engine import LLMEngine, SamplingParams
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.validation import validate_sampling
from transfer.backend import Backend


class Refused(Exception):
    """A prefill this worker will not run: the call's status and why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class CheckedPrefill:
    prompt: list[int]
    params: SamplingParams
    num_cached_tokens: int  # what the destination holds already: whole blocks, read or left in place
    num_blocks: int  # the destination blocks this prefill writes


def validate_prefill_request(request: pb.PrefillRequest, engine: LLMEngine, layout_fingerprint: str,
                             lease_refusal: Callable[[], str | None]) -> CheckedPrefill:  # fmt: skip
    """The checked request, or ``Refused``. ``lease_refusal()`` checks the destination's lease (signature, this
    worker, its nonce, where its pool lives): why it is refused, or None."""
    dest = request.destination
    if dest.fingerprint != layout_fingerprint:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      f"KV layout fingerprint {dest.fingerprint!r} differs from this prefill worker's "
                      f"{layout_fingerprint!r}: the workers run different models, dtypes or block sizes")  # fmt: skip
    try:
        refusal = lease_refusal()
    except RuntimeError as err:  # our pool directory is not private to us: map nothing there
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
    if refusal:
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, refusal)
    try:
        params = validate_sampling(request.sampling, engine.model_config.vocab_size)
        prompt = engine.validate(list(request.prompt_token_ids), params)
    except ValueError as err:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
    held, block_size = request.num_cached_tokens, engine.config.block_size
    if held % block_size or not 0 <= held < len(prompt):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"num_cached_tokens={held} must be whole blocks of "
                      f"{block_size} tokens, fewer than the prompt's {len(prompt)}")  # fmt: skip
    if dest.cached_block_ids and (len(dest.cached_block_ids) != held // block_size or dest.backend == Backend.GRPC):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{len(dest.cached_block_ids)} cached block ids must name the {held // block_size} blocks of "
                      f"the {held} cached tokens, in a pool this worker maps")  # fmt: skip
    if dest.cached_block_ids and not lease.confirms_prefix(dest, prompt[:held]):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the lease's cached prefix hash does not name this "
                      f"prompt's first {held} tokens: its cached block ids are not read")  # fmt: skip
    num_blocks = engine.block_manager.num_blocks_for(len(prompt)) - held // block_size
    if len(dest.block_ids) < num_blocks:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{len(dest.block_ids)} blocks cannot hold {len(prompt) - held} tokens")  # fmt: skip
    return CheckedPrefill(prompt, params, held, num_blocks)
