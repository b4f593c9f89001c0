"""Speculative decoding: a cheap proposer guesses a sequence's next tokens, one target step scores them all, and
the longest run the target agrees with is kept, plus the target's own next token.

Its options are ``engine.config.SpeculativeConfig`` (``speculative_config``, spelled as vLLM spells it).

Verification. A speculating sequence brings its last token and its k proposals d1..dk to one step, which
computes their KV like a prefill chunk and keeps the logits of all k+1 rows. Row j is sampled exactly as a
plain decode step would sample the token at its position (``engine.sampler``: penalty, temperature, top-k,
top-p, then the Gumbel-max draw whose noise is a function of the request's seed and the position alone); the
proposals are accepted while d(j+1) equals row j's token, and the first row that disagrees gives the next
token. So every emitted token is the token the target samples at that position given the tokens before it:
greedy output, and seeded sampled output, equal the output without speculation token for token, and the
sampled tokens keep exactly the target's distribution. For a proposal that is a single token (n-gram) this is
Leviathan et al.'s rule itself: d is accepted with probability p(d), and on rejection the token is drawn from
p without d, renormalised. A draft model samples its proposals with the same noise at the same positions
(a Gumbel-max coupling), so a draft equal to the target is always accepted; for a draft that differs, the
coupling accepts a little less often than Leviathan's min(1, p/q) would (at least (1 - TV)/(1 + TV) per
token, TV the total variation distance between the two distributions), in exchange for outputs that never
depend on what was proposed.

A step's life, as ``LLMEngine`` drives it: ``Speculator.propose`` before scheduling; after the step,
``Speculator.accepted_in`` says how many proposals each sequence keeps, and ``keep_accepted`` counts only
their KV as computed and gives the rejected proposals' blocks back to the pool in the same step.

The off-switch (``AcceptanceTracker``): a sequence whose last ``WINDOW`` verify steps accepted on average
fewer than ``MIN_MEAN_ACCEPTED`` tokens stops proposing for ``backoff`` decode steps, then tries again; each
failure in a row doubles the backoff (up to ``MAX_BACKOFF``), and a window that pays resets it. A verify step
that accepts nothing still emits one token, so the price of a wrong guess is the step's extra rows, which
the back-off keeps rare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.draft_model import DraftProposer
    from engine.model_config import ModelConfig
    from engine.sequence import Sequence
    from engine.tokenizer import Tokenizer
    from kvstore import BlockManager

WINDOW = 8  # verify steps a sequence's acceptance is judged over
MIN_MEAN_ACCEPTED = 0.5  # tokens accepted per verify step, on average, below which speculating does not pay
FIRST_BACKOFF, MAX_BACKOFF = 16, 512  # decode steps without proposals after a window that did not pay


def ngram_proposal(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Prompt lookup: for n from ``max_n`` down to ``min_n``, the last n tokens' most recent earlier occurrence in
    ``tokens`` (int64, the sequence so far), and the up-to-``k`` tokens that followed it; empty when no n-gram
    recurs. One vectorised comparison per n, no loop over positions."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-n-1: every n-gram but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


def accepted_lengths(proposals: np.ndarray, num_proposed: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """``proposals (seqs, k)`` (padded past ``num_proposed (seqs,)``), ``sampled (seqs, k + 1)`` the target's
    token at each row: how many proposals each sequence keeps (the leading run equal to the target's tokens)."""
    k = proposals.shape[1]
    agree = (proposals == sampled[:, :k]) & (np.arange(k) < num_proposed[:, None])
    # the first disagreement (or the padding after the proposals) ends the run
    return np.where(agree.all(axis=1), k, np.argmin(agree, axis=1)).astype(np.int64)


@dataclass
class AcceptanceTracker:
    """One sequence's recent acceptance and its back-off (see the module docstring)."""

    accepted: list[int] = field(default_factory=list)  # tokens accepted per verify step, the last WINDOW
    paused_steps: int = 0
    backoff: int = FIRST_BACKOFF
    num_proposed: int = 0  # over the sequence's life (its trace's decode summary)
    num_accepted: int = 0

    def wants_proposals(self) -> bool:
        """Called once per decode step: whether to propose this step."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True

    def record(self, num_accepted: int, num_proposed: int) -> None:
        self.num_accepted += num_accepted
        self.num_proposed += num_proposed
        self.accepted.append(num_accepted)
        if len(self.accepted) < WINDOW:
            return
        mean = sum(self.accepted) / WINDOW
        self.accepted.clear()
        if mean < MIN_MEAN_ACCEPTED:
            self.paused_steps = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        else:
            self.backoff = FIRST_BACKOFF


@dataclass
class SpecStats:
    """What one engine's speculation did (``kvserve_spec_*`` metrics)."""

    method: str
    num_verify_steps: int = 0  # a sequence's proposals verified in one step
    num_proposed: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Proposals accepted per verify step (each verify step also emits the target's own next token)."""
        return self.num_accepted / self.num_verify_steps if self.num_verify_steps else 0.0


class Speculator:
    """Proposes tokens for decoding sequences before a step and verifies them after it (module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftProposer | None = None) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("a draft proposer goes with method 'draft', and only with it")
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecStats(config.method)

    def propose(self, running: list) -> None:
        """Set ``spec_token_ids`` of each sequence in ``running`` that decodes this step and speculates."""
        config = self.config
        wanted = []  # (sequence, how many tokens it may take)
        for seq in running:
            seq.spec_token_ids.clear()  # (one the last step's budget left out still holds its old guesses)
            if seq.num_computed_tokens + 1 != seq.num_tokens or seq.ring is not None or not seq.params.speculative:
                continue
            if seq.spec_tracker is None:
                seq.spec_tracker = AcceptanceTracker()
            if not seq.spec_tracker.wants_proposals():
                continue
            # no proposal past max_tokens (a verify step emits one token more than it accepts) or the context
            k = min(config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens)  # fmt: skip
            if k > 0:
                wanted.append((seq, k))
        if self.draft is not None:
            self.draft.forget_all_but({seq.seq_id for seq in running})  # finished and preempted ones
            if wanted:
                self.draft.propose(wanted)
            return
        for seq, k in wanted:
            tokens = np.fromiter(seq.token_ids, np.int64, seq.num_tokens)
            seq.spec_token_ids = ngram_proposal(tokens, k, config.prompt_lookup_min,
                                                config.prompt_lookup_max).tolist()  # fmt: skip

    def accepted_in(self, seqs: list[Sequence], sampled: list[list[int]]) -> dict[int, int]:
        """Batch index -> proposals kept, for each sequence of a step's batch that speculated and is still
        running (``verify``)."""
        speculating = [i for i, seq in enumerate(seqs) if seq.spec_token_ids and not seq.is_finished]
        if not speculating:
            return {}
        kept = self.verify([seqs[i] for i in speculating], [sampled[i] for i in speculating])
        return dict(zip(speculating, kept, strict=True))

    def verify(self, seqs: list, sampled: list[list[int]]) -> list[int]:
        """For speculating ``seqs`` and the target's tokens at each of their rows: how many proposals each
        keeps. Records the acceptance (stats, each sequence's tracker)."""
        k = max(len(seq.spec_token_ids) for seq in seqs)
        proposals = np.zeros((len(seqs), k), dtype=np.int64)
        targets = np.zeros((len(seqs), k + 1), dtype=np.int64)
        for i, (seq, tokens) in enumerate(zip(seqs, sampled, strict=True)):
            proposals[i, : len(seq.spec_token_ids)] = seq.spec_token_ids
            targets[i, : len(tokens)] = tokens
        num_proposed = np.fromiter((len(seq.spec_token_ids) for seq in seqs), np.int64, len(seqs))
        accepted = accepted_lengths(proposals, num_proposed, targets).tolist()
        stats = self.stats
        stats.num_verify_steps += len(seqs)
        stats.num_proposed += int(num_proposed.sum())
        stats.num_accepted += sum(accepted)
        for seq, a, proposed in zip(seqs, accepted, num_proposed.tolist(), strict=True):
            seq.spec_tracker.record(a, proposed)
        return accepted


def build_speculator(config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer | None,
                     num_blocks: int, max_model_len: int) -> Speculator | None:  # fmt: skip
    """The speculator ``config.speculative_config`` asks for (a draft model's with a pool of ``num_blocks``
    blocks), or None."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None
    draft = None
    if spec.method == "draft":
        from engine.draft_model import DraftProposer

        draft = DraftProposer(spec.model, spec.num_speculative_tokens, config, model_config, tokenizer, num_blocks)
    return Speculator(spec, max_model_len, draft)


def keep_accepted(seq: Sequence, num_new_tokens: int, tokens: list[int], num_accepted: int,
                  block_manager: BlockManager) -> list[int]:  # fmt: skip
    """After a verify step that computed ``num_new_tokens`` of ``seq`` (its last token and its proposals) and
    sampled ``tokens``, keep its first ``num_accepted`` proposals: only their KV counts as computed, the
    rejected proposals' blocks go back to the pool at once, and full blocks of kept tokens are cached. Returns
    the tokens to append: the accepted run and the target's own token after it."""
    seq.num_computed_tokens += num_new_tokens - (len(seq.spec_token_ids) - num_accepted)
    held = [*seq.token_ids, *tokens[:num_accepted]]  # (== its token ids once the run is appended)
    seq.spec_token_ids.clear()
    block_manager.truncate(seq.seq_id, len(held) + 1)
    seq.block_table = block_manager.block_table_array(seq.seq_id)
    block_manager.cache_full_blocks(seq.seq_id, held, seq.num_computed_tokens)
    return tokens[: num_accepted + 1]
