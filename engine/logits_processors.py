"""Logits processing before the draw: ``logit_bias``, ``min_tokens`` and the three penalties, batched.

Each step the host lists what changes which logits (``plan``: index lists into the sampler's one packed
host-to-device copy) and the device applies it to a copy of the step's logits (``apply``), in
``SamplingParams``' order: bias, then the ``min_tokens`` ban, then the penalties. Nothing here syncs.

The penalties read two per-sequence token tables on the device (``_TokenTable``): which tokens the prompt
holds (bool) and how often each token occurs in the output so far (int32). A verify step
(``engine.speculative``) samples several rows of one sequence, each after more of its proposals; those
proposals count as output for the rows after them (``seen_after``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.sampler import Packed


class ProcessedSequence(Protocol):
    """What logits processing reads of a ``Sequence``; hashable by identity and weak-referenceable."""

    params: SamplingParams
    token_ids: list[int]
    prompt_token_ids: list[int]


class _TokenTable:
    """Per-sequence rows of a device table over the vocabulary, recording the tokens of one part of a
    sequence: its prompt (``output=False``, bool: present) or its output (``output=True``, int32: count).

    A sequence gets a row the first time it is processed and keeps it for its life; each step records only
    the tokens added since the last (token ids are only ever appended, preemption included). A row returns
    to the free list when its sequence is garbage-collected and is cleared when it is handed out again.
    Invariant: row ``slot`` holds exactly the first ``num_recorded`` tokens of its part of the sequence.
    """

    def __init__(self, vocab_size: int, device: torch.device, output: bool) -> None:
        self.output = output
        self.table = torch.zeros((0, vocab_size), dtype=torch.int32 if output else torch.bool, device=device)
        self._rows: weakref.WeakKeyDictionary[ProcessedSequence, list[int]] = weakref.WeakKeyDictionary()
        self._free: list[int] = []

    def plan(self, seqs: list[ProcessedSequence]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Slots for ``seqs`` and the host side of this step's update: (slots, slots to clear, then the
        (slot, token) pairs to record). Grows the table when every row is taken."""
        slots, cleared, pair_slots, pair_tokens = [], [], [], []
        for seq in seqs:
            row = self._rows.get(seq)
            if row is None:
                slot = self._free.pop() if self._free else self._grow()
                row = self._rows[seq] = [slot, len(seq.prompt_token_ids) if self.output else 0]
                weakref.finalize(seq, self._free.append, slot)
                cleared.append(slot)
            slot, num_recorded = row
            end = len(seq.token_ids) if self.output else len(seq.prompt_token_ids)
            new = seq.token_ids[num_recorded:end]
            pair_slots.extend([slot] * len(new))
            pair_tokens.extend(new)
            row[1] = num_recorded + len(new)
            slots.append(slot)
        return slots, cleared, pair_slots, pair_tokens

    def update(self, cleared: torch.Tensor, pair_slots: torch.Tensor, pair_tokens: torch.Tensor) -> None:
        """The device side of ``plan``, with its lists as int64 tensors. (A step that fails between the two
        leaves its sequences' rows stale; the engine aborts the sequences of a failed step.)"""
        self.table.index_fill_(0, cleared, 0)
        if self.output:
            ones = torch.ones_like(pair_tokens, dtype=torch.int32)
            self.table.index_put_((pair_slots, pair_tokens), ones, accumulate=True)
        else:
            self.table[pair_slots, pair_tokens] = True

    def _grow(self) -> int:
        old = self.table.shape[0]
        table = torch.zeros((max(2 * old, 8), self.table.shape[1]), dtype=self.table.dtype, device=self.table.device)
        table[:old] = self.table
        self.table = table
        self._free.extend(range(table.shape[0] - 1, old, -1))  # hand out low slots first
        return old


Apply = Callable[[torch.Tensor, Iterator[torch.Tensor]], torch.Tensor]


class LogitsProcessors:
    """Bias, ``min_tokens`` and penalties for a step's rows (module docstring). ``eos_token_ids`` are the
    tokens that end a request besides its ``stop_token_ids``: ``min_tokens`` bans both."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self._prompt = _TokenTable(vocab_size, device, output=False)
        self._output = _TokenTable(vocab_size, device, output=True)

    def plan(self, packed: Packed, seqs: list[ProcessedSequence], positions: list[int],
             seen_after: list[list[int]]) -> Apply:  # fmt: skip
        """Add this step's lists for rows ``seqs`` (row i samples token number ``positions[i]`` after
        ``seen_after[i]`` more tokens) to ``packed``; return what applies them on the device, reading the
        sent tensors from the iterator in the same order."""
        params = [s.params for s in seqs]
        bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias.items()]
        banned = [(r, t) for r, (s, p, at) in enumerate(zip(seqs, params, positions, strict=True))
                  if at - len(s.prompt_token_ids) < p.min_tokens for t in self._ends(p)]  # fmt: skip
        penalized = [r for r, p in enumerate(params)
                     if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]  # fmt: skip
        packed.add_ints([r for r, _, _ in bias], [t for _, t, _ in bias])
        packed.add_ints([r for r, _ in banned], [t for _, t in banned])
        packed.add_floats([b for _, _, b in bias])
        if penalized:
            rows = [seqs[r] for r in penalized]
            packed.add_ints(penalized, *self._prompt.plan(rows), *self._output.plan(rows))
            after = [seen_after[r] for r in penalized]
            packed.add_ints([i for i, tokens in enumerate(after) for _ in tokens], [t for ts in after for t in ts])
            names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
            packed.add_floats(*([getattr(params[r], name) for r in penalized] for name in names))

        def apply(logits: torch.Tensor, sent: Iterator[torch.Tensor]) -> torch.Tensor:
            bias_rows, bias_tokens, ban_rows, ban_tokens, biases = (next(sent) for _ in range(5))  # (added order)
            out = logits.index_put((bias_rows, bias_tokens), biases, accumulate=True)
            out[ban_rows, ban_tokens] = float("-inf")
            if penalized:
                out = self._penalize(out, sent)
            return out

        return apply

    def _ends(self, params: SamplingParams) -> list[int]:
        return [*params.stop_token_ids, *([] if params.ignore_eos else sorted(self.eos_token_ids))]

    def _penalize(self, logits: torch.Tensor, sent: Iterator[torch.Tensor]) -> torch.Tensor:
        rows = next(sent)
        prompt_slots, prompt_update = next(sent), [next(sent) for _ in range(3)]
        output_slots, output_update = next(sent), [next(sent) for _ in range(3)]
        after_rows, after_tokens, repetition, presence, frequency = (next(sent) for _ in range(5))
        self._prompt.update(*prompt_update)
        self._output.update(*output_update)
        counts = self._output.table[output_slots]  # (penalized rows, vocab) int32, a copy
        counts.index_put_((after_rows, after_tokens), torch.ones_like(after_tokens, dtype=torch.int32),
                          accumulate=True)  # fmt: skip
        in_output = counts > 0
        seen = self._prompt.table[prompt_slots] | in_output
        penalty = repetition[:, None]
        chosen = logits[rows]
        chosen = torch.where(seen, torch.where(chosen > 0, chosen / penalty, chosen * penalty), chosen)
        chosen = chosen - presence[:, None] * in_output - frequency[:, None] * counts
        return logits.index_copy(0, rows, chosen)
