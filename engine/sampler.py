"""Choose each sequence's next token from its logits row, the whole batch at once on the device.

One step: greedy rows without a repetition penalty take one argmax (the all-greedy batch does nothing else).
Otherwise the per-row settings travel to the device as one packed int64 array, the penalty rows are
penalized, and the sampling rows are scaled by their temperature, filtered (top-k, then the top-p nucleus,
with one batched sort shared by every row when any row asks for a filter) and drawn by the Gumbel-max trick
(``kernels.gumbel_argmax``: one fused pass over the logits on a GPU, its noise made in registers).
Nothing here waits for the device: the caller makes the one device-to-host copy of the token ids.

Randomness is counter-based. The noise for token ``t`` of a row is a hash of (the request's stream seed, the
position it samples, ``t``), splitmix64 as ``kernels.reference.uniform_noise`` defines it, so a row's draw never
depends on which other requests share its batch, and a worker that continues a request at position ``P + 1``
continues the same stream as the one that sampled ``P``. A request that brought no seed gets a stream seed
drawn from the sampler's own seeded RNG when it is created (``stream_seed``), so a whole engine run is
reproducible too.
"""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Sequence as SequenceOf
from typing import Protocol

import numpy as np
import torch

import kernels
from engine.input_batch import StagingBuffer
from engine.sampling_params import SamplingParams

_MOD64 = 1 << 64


def to_int64(value: int) -> int:
    """``value`` modulo 2**64, as the signed 64-bit integer with those bits."""
    return (value + (1 << 63)) % _MOD64 - (1 << 63)


class SampledSequence(Protocol):
    """What the sampler reads of a ``Sequence``; it must be hashable by identity and weak-referenceable."""

    params: SamplingParams
    token_ids: list[int]
    sampling_seed: int

    @property
    def num_tokens(self) -> int: ...


class _SeenTokens:
    """The tokens each penalized sequence has seen so far (prompt and output), as rows of a device bool table.

    A sequence gets a row the first time it is penalized and keeps it for its life; each step adds only the
    tokens appended since the last (token ids are only ever appended, preemption included). A row returns to
    the free list when its sequence is garbage-collected and is cleared when it is handed out again.
    Invariant: ``table[slot, t]`` is True iff token ``t`` is among the first ``num_recorded`` tokens of the
    sequence holding ``slot``.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.table = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._rows: weakref.WeakKeyDictionary[SampledSequence, list[int]] = weakref.WeakKeyDictionary()
        self._free: list[int] = []

    def plan(self, seqs: list[SampledSequence]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Slots for ``seqs`` and the host side of this step's update: (slots, slots to clear, then the
        (slot, token) pairs to set). Grows the table when every row is taken."""
        slots, cleared, pair_slots, pair_tokens = [], [], [], []
        for seq in seqs:
            row = self._rows.get(seq)
            if row is None:
                slot = self._free.pop() if self._free else self._grow()
                row = self._rows[seq] = [slot, 0]
                weakref.finalize(seq, self._free.append, slot)
                cleared.append(slot)
            slot, num_recorded = row
            new = seq.token_ids[num_recorded:]
            pair_slots.extend([slot] * len(new))
            pair_tokens.extend(new)
            row[1] = num_recorded + len(new)
            slots.append(slot)
        return slots, cleared, pair_slots, pair_tokens

    def update(self, cleared: torch.Tensor, pair_slots: torch.Tensor, pair_tokens: torch.Tensor) -> None:
        """The device side of ``plan``, with its lists as int64 tensors. (A step that fails between the two
        leaves its sequences' rows stale; the engine aborts the sequences of a failed step.)"""
        self.table.index_fill_(0, cleared, False)
        self.table[pair_slots, pair_tokens] = True

    def _grow(self) -> int:
        old = self.table.shape[0]
        table = torch.zeros((max(2 * old, 8), self.table.shape[1]), dtype=torch.bool, device=self.table.device)
        table[:old] = self.table
        self.table = table
        self._free.extend(range(table.shape[0] - 1, old, -1))  # hand out low slots first
        return old


class Sampler:
    """One token per row of a step's logits, for any mix of greedy, temperature, top-k, top-p, repetition
    penalty and seeds, without a host sync. ``seed`` seeds the stream seeds of requests that bring none."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self._seeds = random.Random(seed)
        self._seen = _SeenTokens(vocab_size, device)
        self._staging = StagingBuffer(4096, device)  # the per-row settings' one copy per step (grows on demand)

    def stream_seed(self, seed: int | None) -> int:
        """The int64 stream seed of a new request: its own ``seed`` (modulo 2**64) or, without one, the next
        draw of this sampler's RNG."""
        return to_int64(self._seeds.getrandbits(64) if seed is None else seed)

    def __call__(self, logits: torch.Tensor, seqs: list[SampledSequence], positions: list[int] | None = None,
                 seen_after: list[list[int]] | None = None) -> torch.Tensor:  # fmt: skip
        """``logits (rows, vocab)`` float32, row i for ``seqs[i]`` -> ``(rows,)`` int64 on ``logits.device``.
        Row i samples token number ``positions[i]`` (default ``seqs[i].num_tokens``), having seen
        ``seqs[i].token_ids`` and then ``seen_after[i]`` (default nothing more): a speculative verify step
        (``engine.speculative``) samples several rows of one sequence, each after more of its proposals.
        ``logits`` is left unchanged."""
        params = [s.params for s in seqs]
        penalized = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        sampling = [i for i, p in enumerate(params) if p.temperature != 0]
        if not penalized and not sampling:
            return logits.argmax(-1)
        packed = _Packed()
        if penalized:
            slots, cleared, pair_slots, pair_tokens = self._seen.plan([seqs[i] for i in penalized])
            packed.add_ints(penalized, slots, cleared, pair_slots, pair_tokens)
            packed.add_floats([params[i].repetition_penalty for i in penalized])
            after = [] if seen_after is None else [seen_after[i] for i in penalized]
            packed.add_ints([r for r, tokens in enumerate(after) for _ in tokens], [t for ts in after for t in ts])
        filtered = False
        if sampling:
            rows, settings = [seqs[i] for i in sampling], [params[i] for i in sampling]
            # top-k 0, or past the vocabulary, keeps every token
            top_k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in settings]
            filtered = any(k < self.vocab_size or p.top_p < 1.0 for k, p in zip(top_k, settings, strict=True))
            sampled_at = [s.num_tokens for s in rows] if positions is None else [positions[i] for i in sampling]
            packed.add_ints(sampling, [s.sampling_seed for s in rows], sampled_at, top_k)
            packed.add_floats([p.temperature for p in settings], [p.top_p for p in settings])
        on_device = iter(packed.send(self._staging))

        if penalized:
            rows_idx, slots_t, cleared_t, pair_slots_t, pair_tokens_t, penalties, after_rows, after_tokens = (
                itertools.islice(on_device, 8))  # fmt: skip
            self._seen.update(cleared_t, pair_slots_t, pair_tokens_t)
            seen = self._seen.table[slots_t]  # (penalized rows, vocab), a copy
            seen[after_rows, after_tokens] = True
            penalized_logits = _penalize(logits[rows_idx], seen, penalties)
            logits = logits.index_copy(0, rows_idx, penalized_logits)
        if not sampling:
            return logits.argmax(-1)
        rows_idx, seeds, positions, top_k_t, temperatures, top_p_t = on_device
        scaled = logits[rows_idx] / temperatures[:, None]  # (sampling rows, vocab)
        if filtered:
            scaled = _filter_top_k_top_p(scaled, top_k_t, top_p_t)
        drawn = kernels.gumbel_argmax(scaled, seeds, positions)
        if len(sampling) == len(seqs):
            return drawn
        tokens = logits.argmax(-1)
        tokens[rows_idx] = drawn
        return tokens


def _penalize(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """``logits (rows, vocab)``, ``seen (rows, vocab)`` bool, ``penalties (rows,)``: seen tokens become less
    likely (positive logits divided by the penalty, negative ones multiplied)."""
    penalty = penalties[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits (rows, vocab)``; ``top_k (rows,)`` in [1, vocab] (vocab keeps all), ``top_p (rows,)`` in (0, 1]
    (1 keeps all). Tokens below a row's k-th largest logit become -inf (ties with it stay), then those past
    its top-p nucleus of what is left: a token goes when the tokens before it already reach ``top_p``, so
    the most likely token always stays."""
    ordered, order = logits.sort(-1, descending=True)  # (rows, vocab), order[r, j] = vocab id of rank j
    kth = ordered.gather(1, (top_k - 1)[:, None])  # (rows, 1)
    outside_k = ordered < kth
    probs = ordered.masked_fill(outside_k, float("-inf")).softmax(-1)
    # (a row with top_p == 1 keeps everything even where float rounding lets the cumulative sum reach 1 early)
    outside_p = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.empty_like(outside_k).scatter_(1, order, outside_k | outside_p)
    return logits.masked_fill(drop, float("-inf"))


class _Packed:
    """Per-row settings gathered on the host and sent to the device as one int64 array (floats travel as
    float64 bits), then cut into one tensor per list in the order they were added."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._is_float: list[bool] = []

    def add_ints(self, *lists: SequenceOf[int]) -> None:
        for values in lists:
            self._parts.append(np.asarray(values, dtype=np.int64).reshape(-1))
            self._is_float.append(False)

    def add_floats(self, *lists: SequenceOf[float]) -> None:
        for values in lists:
            self._parts.append(np.asarray(values, dtype=np.float64).reshape(-1).view(np.int64))
            self._is_float.append(True)

    def send(self, staging: StagingBuffer) -> list[torch.Tensor]:
        """Copy the parts to the device through ``staging`` (pinned on CUDA: one asynchronous copy); the
        device tensors stay valid until the next send through it, i.e. for this step."""
        host, device, nbytes = staging.views([("packed", np.int64, (sum(len(p) for p in self._parts),))])
        np.concatenate(self._parts, out=host["packed"])
        staging.send(nbytes)
        parts = device["packed"].split([len(p) for p in self._parts])
        return [p.view(torch.float64).float() if f else p for p, f in zip(parts, self._is_float, strict=True)]
