"""The engine's one seam: where KV comes from or goes to outside this engine's own pool.

The scheduler and the engine call a ``KVConnector`` at fixed points of a step, as vLLM v1 calls its
KVConnector; the engine core (scheduler, block manager, runner) names no worker, lease or transport.
Everything a connector needs to know about one request travels in ``Sequence.kv_params``, which the engine
never reads: whoever adds the request gives it, and only the connector interprets it.

Scheduler side, when a waiting sequence is considered for admission:

1. ``num_external_tokens(seq, num_cached_tokens)``: how many tokens after its cached prefix can be loaded
   from outside instead of computed, and whether they arrive later (``asynchronous``). Those tokens count
   as computed and cost no token budget. Synchronous ones are loaded by ``start_loads`` before the step runs
   (it must fill them before the model reads them). An asynchronous load takes the sequence to
   ``WAITING_FOR_REMOTE_KV``: its blocks are allocated, so they count in every later admission, but it is
   in no batch until the load finishes.
2. ``after_allocate(seq, num_external_tokens)``: its blocks are allocated (``seq.block_table``); an
   asynchronous load starts here.
3. ``finished_loads()``, at the start of every step: the asynchronous loads that ended. A load that
   succeeded brings the sequence's first sampled token (the loader ran the prompt); one that failed sends
   the sequence back to the front of the waiting queue, to be admitted again (the connector may then load
   it from elsewhere, or let it be computed here). Its blocks are freed first, except those the connector
   took out of the block manager's hands (``BlockManager.rename``) because a writer may still reach them.
4. ``request_finished(seq)``: the sequence ended (finished, aborted, or its save failed); True keeps its
   blocks until the caller's ``LLMEngine.release`` (a KV reader still needs them).
5. ``preempt(seq)``: the scheduler is about to free a running sequence's blocks and send it back to the
   waiting queue (its ``num_computed_tokens`` still counts the KV they hold): the last moment to copy that
   KV out (swap preemption), for ``num_external_tokens`` to offer when it is admitted again.

Runner side, around the model's step:

6. ``start_loads(admitted)``: fill the synchronous external tokens of the sequences admitted this step.
7. ``save(seqs, num_new_tokens)``: after the step, before its tokens count as computed: write out what must
   leave this pool. Returns the sequences whose KV could not be saved (or loaded) in time: the step ends
   them (finish reason ``"kv_transfer_expired"``) without caching its blocks.

The base class is the offline engine's: nothing comes from or goes outside. ``ConnectorChain`` composes
connectors (an engine's memory tiers first, then a worker's transfer connector).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.logprobs import TokenLogprob
from engine.sequence import Sequence

TRANSFER_EXPIRED = "kv_transfer_expired"  # the finish reason of a sequence whose save or load ran out of time


@dataclass(frozen=True)
class FinishedLoad:
    """An asynchronous load that ended: ``first_token`` is the loader's sampled token, or None when it failed;
    with it, when the request asked, its log-probability and the prompt's (tokens 1, 2, ...)."""

    seq_id: str
    first_token: int | None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class KVConnector:
    """No KV from or to outside this engine (the offline engine's connector); subclasses override.

    ``brings_logits``: its loads come with the prompt's log-probabilities (a remote prefill computes them), so
    a request that wants them (``Sequence.wants_prompt_logprobs``) may load from it; from any other it may not.
    """

    brings_logits = False

    # -- scheduler side ----------------------------------------------------------------------------------

    def num_external_tokens(self, seq: Sequence, num_cached_tokens: int) -> tuple[int, bool]:
        """(tokens after the first ``num_cached_tokens`` that can be loaded, whether asynchronously). At
        least one token of a synchronous admission is left to compute (the step samples from it)."""
        return 0, False

    def after_allocate(self, seq: Sequence, num_external_tokens: int) -> None:
        """``seq`` holds blocks for its tokens up to ``num_computed_tokens`` plus this step's chunk."""

    def finished_loads(self) -> list[FinishedLoad]:
        return []

    def request_finished(self, seq: Sequence) -> bool:
        """``seq`` ended; True keeps its blocks until ``LLMEngine.release``."""
        return False

    def preempt(self, seq: Sequence) -> None:
        """``seq``'s blocks are about to be freed by a preemption (their KV is still there)."""

    # -- runner side -------------------------------------------------------------------------------------

    def start_loads(self, admitted: list[Sequence]) -> None:
        """Fill the synchronous external tokens of ``admitted`` before the step reads them."""

    def save(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[Sequence]:
        """After the step computed ``num_new_tokens[i]`` tokens of ``seqs[i]``: the sequences it failed for."""
        return []


class ConnectorChain(KVConnector):
    """Several connectors as one, asked in order: each offers tokens after what those before it offered.

    An asynchronous offer ends the walk (it brings everything after it); those not asked get
    ``after_allocate(seq, 0)``. Every connector sees every other call.
    """

    def __init__(self, connectors: list[KVConnector]) -> None:
        self.connectors = connectors
        self.brings_logits = any(c.brings_logits for c in connectors)
        self._offers: dict[str, list[int]] = {}  # seq id -> what each connector offered at this admission

    def num_external_tokens(self, seq: Sequence, num_cached_tokens: int) -> tuple[int, bool]:
        offers: list[int] = []
        total, later = 0, False
        for connector in self.connectors:
            if seq.wants_prompt_logprobs and not connector.brings_logits:
                offers.append(0)
                continue
            n, later = connector.num_external_tokens(seq, num_cached_tokens + total)
            offers.append(n)
            total += n
            if later:
                break
        self._offers[seq.seq_id] = offers
        return total, later

    def after_allocate(self, seq: Sequence, num_external_tokens: int) -> None:
        offers = self._offers.pop(seq.seq_id, [num_external_tokens])
        for i, connector in enumerate(self.connectors):
            connector.after_allocate(seq, offers[i] if i < len(offers) else 0)

    def finished_loads(self) -> list[FinishedLoad]:
        return [load for connector in self.connectors for load in connector.finished_loads()]

    def request_finished(self, seq: Sequence) -> bool:
        self._offers.pop(seq.seq_id, None)
        keeps = [connector.request_finished(seq) for connector in self.connectors]  # every one hears it
        return any(keeps)

    def preempt(self, seq: Sequence) -> None:
        for connector in self.connectors:
            connector.preempt(seq)

    def start_loads(self, admitted: list[Sequence]) -> None:
        for connector in self.connectors:
            connector.start_loads(admitted)

    def save(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[Sequence]:
        failed: dict[str, Sequence] = {}
        for connector in self.connectors:
            for seq in connector.save(seqs, num_new_tokens):
                failed[seq.seq_id] = seq
        return list(failed.values())
