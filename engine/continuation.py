"""A request that continues a stream another worker began: the router moves a stream off a decode worker
that died or drained, with the output the client already has, and the new worker goes on from there."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams, check_token_ids
from engine.sequence import Sequence


@dataclass(frozen=True)
class Continuation:
    """Output a request already streamed from another worker: the engine goes on after it as if it had
    produced those tokens itself. Their KV is recomputed like a preempted sequence's; ``max_tokens``, stop
    strings, the seeded random stream (keyed by position) and usage all count them; only text past
    ``num_emitted_chars`` (what the client already has) is emitted."""

    output_token_ids: tuple[int, ...]
    num_emitted_chars: int


def check_continuation(continuation: Continuation, num_prompt_tokens: int, params: SamplingParams,
                       vocab_size: int, max_model_len: int) -> None:  # fmt: skip
    """``ValueError`` unless ``continuation`` can go on after a prompt of ``num_prompt_tokens`` tokens."""
    outputs = continuation.output_token_ids
    check_token_ids(outputs, vocab_size, "resumed output token ids")
    if not 0 < len(outputs) < params.max_tokens:
        raise ValueError(f"a continuation resumes 1 to max_tokens - 1 = {params.max_tokens - 1} output tokens, "
                         f"got {len(outputs)}")  # fmt: skip
    if num_prompt_tokens + len(outputs) >= max_model_len:
        raise ValueError(f"prompt ({num_prompt_tokens}) + resumed output ({len(outputs)}) tokens leave no room "
                         f"in the context of {max_model_len} tokens")  # fmt: skip
    if continuation.num_emitted_chars < 0:
        raise ValueError(f"num_resumed_chars must be >= 0, got {continuation.num_emitted_chars}")


def resume(seq: Sequence, continuation: Continuation) -> None:
    """Give a new ``seq`` the output another worker streamed, fed to the detokenizer token by token as it was
    there, so the text, and the point up to which the client has it, match that worker's."""
    for token in continuation.output_token_ids:
        seq.detokenizer.add([token])
    seq.token_ids.extend(continuation.output_token_ids)
    seq.logprobs.extend([None] * len(continuation.output_token_ids))  # the client has those already
    seq.num_emitted_chars = min(continuation.num_emitted_chars, seq.detokenizer.num_chars)
