"""A request's state as it moves through the engine: waiting [-> waiting for remote KV] -> running -> finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer
from kvstore.ring import RingSpec

if TYPE_CHECKING:
    from engine.logprobs import TokenLogprob
    from engine.speculative import AcceptanceTracker
    from engine.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, its KV arriving from outside
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output) and how many of them already have KV in the pool.

    Invariant: ``num_computed_tokens <= num_tokens``; a running sequence holds
    blocks for at least its first ``num_computed_tokens`` tokens. Admission
    starts ``num_computed_tokens`` after the cached prefix it found plus the
    tokens the KV connector loads from outside (``num_external_tokens``, counted
    at the first admission). Preemption resets it to 0 and keeps the tokens, so
    the sequence is recomputed (from whatever is still cached or loadable) from
    its prompt and the output it already has.
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    request_id: str = ""  # the request it is a choice of (``engine.parallel_sampling``); "": ``seq_id``
    index: int = 0  # which choice of that request it is
    sampling_seed: int = 0  # the int64 seed of its random stream (engine.sampler: drawn when it brought none)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # its blocks' ids, int32 (``BlockManager.block_table_array``: a view the scheduler replaces as it grows)
    block_table: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_emitted_chars: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    num_external_tokens: int = 0  # tokens the KV connector loaded from outside at the first admission
    kv_params: Any = None  # the KV connector's own data about this request; the engine never reads it
    ring: RingSpec | None = None  # attends over sinks + a window through a ring of blocks (``kvstore.ring``)
    # speculative decoding (``engine.speculative``): this step's proposals, computed after its last token and
    # verified in the same step; and its recent acceptance (None: it does not speculate)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_tracker: AcceptanceTracker | None = None
    # ``params.logprobs``: one per output token (None for tokens another worker streamed before a
    # continuation); ``params.prompt_logprobs``: one per prompt token scored so far, None for the first
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    grammar: GrammarState | None = None  # its structured output's matcher (``engine.structured_output``)
    priority: int = 0  # lower first (vLLM's spelling), an int32; its request's, every choice's
    num_overtaken: int = 0  # later arrivals of a higher priority queued ahead of it (``priorities.MAX_OVERTAKEN``)

    def __post_init__(self) -> None:
        self.request_id = self.request_id or self.seq_id
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether it asked for prompt log-probabilities and some are still to be computed: its prompt must
        then be computed here, from its first unscored position, not read from a cache or loaded."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy, O(length): not for per-step use."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_tokens_to_compute(self, start: int, budget: int) -> int:
        """Tokens to compute from position ``start`` in a step with ``budget`` tokens left: the rest of the
        sequence and its proposals within the budget, and within what its ring holds at once
        (``RingSpec.max_chunk``). Proposals that do not fit the budget are dropped."""
        n = min(self.num_tokens + len(self.spec_token_ids) - start, budget)
        if self.spec_token_ids:
            del self.spec_token_ids[max(0, start + n - self.num_tokens) :]
        return n if self.ring is None else min(n, self.ring.max_chunk(start))
