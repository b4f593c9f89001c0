"""A draft model for speculative decoding: a second, smaller ``CausalLM`` in the same process, with its own
paged KV pool, that proposes each speculating sequence's next k tokens (``engine.speculative``).

The draft keeps, per target sequence, a ``Sequence`` of its own: the target's tokens, how many of them have
KV in the draft's pool, and its blocks. Before a target step it first catches up on the tokens the target
appended since (the last step's accepted run and the target's own token; the whole prompt the first time),
which samples its first proposal, then runs k - 1 one-token steps, one batch for all sequences each. Its
sampler draws each proposal with the target request's settings and seed at that position, so a proposal is
the draft's sample under the same noise the target uses there (the Gumbel-max coupling that makes a draft
equal to the target always accepted). After verification the draft's KV stays valid up to the last proposal
the target kept; the rest is recomputed at the next catch-up, and a sequence that leaves the running batch
(finished, aborted, preempted) gives its draft blocks back at the next step.

Same tokenizer: the draft must have the target's vocabulary size, and where both directories carry a
tokenizer, the same token-to-id map and special tokens; otherwise the engine refuses to start, naming
``speculative_config.model``. (A draft without tokenizer files, such as ``kvserve model random``'s, is held
to the vocabulary size alone: token ids are all the two exchange.)
"""

from __future__ import annotations

import numpy as np

from engine.bundled import resolve_model
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import Tokenizer
from kvstore import BlockManager


def check_same_tokenizer(draft_dir, draft_config: ModelConfig, target_config: ModelConfig,
                         target_tokenizer: Tokenizer | None) -> None:  # fmt: skip
    """``ValueError`` naming ``speculative_config.model`` unless the draft's token ids mean the target's."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft_config.vocab_size} "
                         f"tokens, the target's {target_config.vocab_size}; a draft must use the target's "
                         "tokenizer")  # fmt: skip
    if target_tokenizer is None or not (draft_dir / "tokenizer.json").is_file():
        return
    draft, target = Tokenizer(draft_dir).hf, target_tokenizer.hf
    if draft.get_vocab() != target.get_vocab():
        raise ValueError("speculative_config.model: the draft's tokenizer maps tokens to other ids than the "
                         "target's; a draft must use the target's tokenizer")  # fmt: skip
    if (draft.bos_token_id, draft.eos_token_id) != (target.bos_token_id, target.eos_token_id):
        raise ValueError("speculative_config.model: the draft's special tokens (BOS, EOS) differ from the target's")


class DraftProposer:
    def __init__(self, model: str, k: int, target: EngineConfig, target_config: ModelConfig,
                 target_tokenizer: Tokenizer | None, num_blocks: int) -> None:  # fmt: skip
        path = resolve_model(model)
        draft_config = ModelConfig.from_dir(path)
        check_same_tokenizer(path, draft_config, target_config, target_tokenizer)
        config = EngineConfig(model=str(path), device=target.device, dtype=target.dtype,
                              block_size=target.block_size, num_blocks=num_blocks, enforce_eager=True,
                              max_num_seqs=target.max_num_seqs, max_num_batched_tokens=target.max_num_batched_tokens,
                              skip_tokenizer_init=True, seed=target.seed, step_diagnosis=False)  # fmt: skip
        self.runner = ModelRunner(path, draft_config, config, scores=False)
        self.block_manager = BlockManager(self.runner.num_blocks, target.block_size)
        self.k = k
        self.budget = target.max_num_batched_tokens  # catch-up tokens per step, all sequences together
        self.max_len = self.runner.max_model_len
        self._seqs: dict[str, Sequence] = {}

    def forget_all_but(self, seq_ids: set[str]) -> None:
        for seq_id in [s for s in self._seqs if s not in seq_ids]:
            del self._seqs[seq_id]
            self.block_manager.free(seq_id)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set ``spec_token_ids`` (up to k tokens) of each target sequence in ``wanted`` (with its own cap)."""
        drafting, first_rows, budget = [], [], self.budget
        for target, k in wanted:
            own = self._sync(target)
            if own.num_tokens + k > self.max_len:
                continue
            if not self.block_manager.allocate(own.seq_id, own.num_tokens + k):
                continue  # the draft's pool is full: this sequence decodes plainly this step
            own.block_table = self.block_manager.block_table_array(own.seq_id)
            behind = own.num_tokens - own.num_computed_tokens
            if behind > budget:  # (a long prompt's first catch-up): a chunk now, proposals in a later step
                if budget > 0:
                    first_rows.append((own, budget))
                    budget = 0
                continue
            budget -= behind
            drafting.append((target, own, k))
            first_rows.append((own, behind))
        # the catch-up step samples each first proposal; then one token per step while a sequence wants more
        rows = first_rows
        while rows:
            seqs = [own for own, _ in rows]
            counts = [n for _, n in rows]
            ordered = sorted(range(len(seqs)), key=lambda i: counts[i] != 1)  # decodes first, as the runner wants
            batch = ScheduledBatch([seqs[i] for i in ordered], [counts[i] for i in ordered],
                                   sum(counts[i] == 1 for i in ordered))  # fmt: skip
            sampled = self.runner.execute(batch).tokens
            for own, n, tokens in zip(batch.seqs, batch.num_new_tokens, sampled, strict=True):
                own.num_computed_tokens += n
                own.token_ids.extend(tokens)
            rows = [(own, 1) for target, own, k in drafting if own.num_tokens - target.num_tokens < k]
        for target, own, _ in drafting:
            target.spec_token_ids = own.token_ids[target.num_tokens :]

    def _sync(self, target: Sequence) -> Sequence:
        """The draft's sequence for ``target``, its tokens set to the target's and its computed count cut to the
        KV still right (the tokens both agree on)."""
        own = self._seqs.get(target.seq_id)
        if own is None:
            own = self._seqs[target.seq_id] = Sequence(
                seq_id=target.seq_id, prompt_token_ids=target.prompt_token_ids, params=target.params,
                detokenizer=None, sampling_seed=target.sampling_seed, token_ids=list(target.token_ids),
                status=SequenceStatus.RUNNING)  # fmt: skip
            return own
        start = min(own.num_computed_tokens, target.num_tokens)
        # past the last verification, both hold the kept proposals and then differ (or one ends)
        tail = min(own.num_computed_tokens, len(own.token_ids), target.num_tokens)
        lo = max(0, start - 2 * self.k - 2)
        mine = np.asarray(own.token_ids[lo:tail], dtype=np.int64)
        theirs = np.asarray(target.token_ids[lo:tail], dtype=np.int64)
        differ = np.flatnonzero(mine != theirs)
        agreed = lo + int(differ[0]) if differ.size else tail
        own.num_computed_tokens = min(own.num_computed_tokens, agreed)
        own.token_ids = list(target.token_ids)
        if self.block_manager.has(own.seq_id):
            self.block_manager.truncate(own.seq_id, own.num_tokens)
            own.block_table = self.block_manager.block_table_array(own.seq_id)
        return own
