"""Choose each sequence's next token from its logits row, the whole batch at once on the device.

One step: greedy rows without logits processing take one argmax (the all-greedy batch does nothing else).
Otherwise the per-row settings travel to the device as one packed int64 array, the rows that ask for it are
processed (``engine.logits_processors``: bias, ``min_tokens``, penalties), the rows with a structured output
lose the tokens their grammar does not allow next (``engine.structured_output``: a bitmask per row, filled on
the host and sent in the same copy), and the sampling rows are scaled
by their temperature, filtered (min-p, top-k, then the top-p nucleus, with one batched sort shared by every
row when any row asks for a filter) and drawn by the Gumbel-max trick (``kvkernels.gumbel_argmax``: one fused
pass over the logits on a GPU, its noise made in registers). Rows that ask for log-probabilities get them
from the unprocessed logits (``engine.logprobs``). Nothing here waits for the device: the caller makes the
device-to-host copies.

Randomness is counter-based. The noise for token ``t`` of a row is a hash of (the request's stream seed, the
position it samples, ``t``), splitmix64 as ``kvkernels.reference.uniform_noise`` defines it, so a row's draw never
depends on which other requests share its batch, and a worker that continues a request at position ``P + 1``
continues the same stream as the one that sampled ``P``. A request that brought no seed gets a stream seed
drawn from the sampler's own seeded RNG when it is created (``stream_seed``), so a whole engine run is
reproducible too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

import kvkernels
from engine.input_batch import StagingBuffer
from engine.logits_processors import LogitsProcessors
from engine.logprobs import LogprobTensors
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState, apply_bitmask, fill_bitmask

_MOD64 = 1 << 64


def to_int64(value: int) -> int:
    """``value`` modulo 2**64, as the signed 64-bit integer with those bits."""
    return (value + (1 << 63)) % _MOD64 - (1 << 63)


class SampledSequence(Protocol):
    """What the sampler reads of a ``Sequence``; it must be hashable by identity and weak-referenceable."""

    params: SamplingParams
    token_ids: list[int]
    prompt_token_ids: list[int]
    sampling_seed: int
    grammar: GrammarState | None

    @property
    def num_tokens(self) -> int: ...


def argmax_decides(seq: SampledSequence) -> bool:
    """Whether ``seq``'s next token is its logits' argmax and nothing else reads them: greedy, without logits
    processing, a grammar or log-probabilities."""
    params = seq.params
    return params.temperature == 0 and not params.processes_logits and seq.grammar is None and params.logprobs is None


@dataclass
class SamplerOutput:
    """A step's draws: ``tokens (rows,)`` int64 on the device, and their ``logprobs`` when a row asked."""

    tokens: torch.Tensor
    logprobs: LogprobTensors | None = None


class Sampler:
    """One token per row of a step's logits, for any mix of greedy, temperature, top-k, top-p, min-p, logits
    processing (``engine.logits_processors``) and seeds, without a host sync. ``seed`` seeds the stream seeds
    of requests that bring none; ``eos_token_ids`` are what ``min_tokens`` holds back besides stop tokens."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:  # fmt: skip
        self.vocab_size = vocab_size
        self._seeds = random.Random(seed)
        self.processors = LogitsProcessors(vocab_size, device, eos_token_ids)
        self._staging = StagingBuffer(4096, device)  # the per-row settings' one copy per step (grows on demand)

    def stream_seed(self, seed: int | None) -> int:
        """The int64 stream seed of a new request: its own ``seed`` (modulo 2**64) or, without one, the next
        draw of this sampler's RNG."""
        return to_int64(self._seeds.getrandbits(64) if seed is None else seed)

    def __call__(self, logits: torch.Tensor, seqs: list[SampledSequence], positions: list[int] | None = None,
                 seen_after: list[list[int]] | None = None) -> SamplerOutput:  # fmt: skip
        """``logits (rows, vocab)`` float32, row i for ``seqs[i]`` -> a token per row on ``logits.device``.
        Row i samples token number ``positions[i]`` (default ``seqs[i].num_tokens``), having seen
        ``seqs[i].token_ids`` and then ``seen_after[i]`` (default nothing more): a speculative verify step
        (``engine.speculative``) samples several rows of one sequence, each after more of its proposals.
        ``logits`` is left unchanged; log-probabilities come from it (``engine.logprobs``)."""
        tokens = self._draw(logits, seqs, positions, seen_after)
        k = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
        return SamplerOutput(tokens, None if k is None else LogprobTensors.of(logits, tokens, k))

    def _draw(self, logits: torch.Tensor, seqs: list[SampledSequence], positions: list[int] | None,
              seen_after: list[list[int]] | None) -> torch.Tensor:  # fmt: skip
        params = [s.params for s in seqs]
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        sampling = [i for i, p in enumerate(params) if p.temperature != 0]
        if not processed and not sampling and not constrained:
            return logits.argmax(-1)
        at = [s.num_tokens for s in seqs] if positions is None else positions
        packed = Packed()
        if processed:
            after = [[] if seen_after is None else seen_after[i] for i in processed]
            packed.add_ints(processed)
            apply = self.processors.plan(packed, [seqs[i] for i in processed], [at[i] for i in processed], after)
        if constrained:
            after = [[] if seen_after is None else seen_after[i] for i in constrained]
            packed.add_ints(constrained, fill_bitmask([seqs[i] for i in constrained], after, self.vocab_size))
        filtered = False
        if sampling:
            rows, settings = [seqs[i] for i in sampling], [params[i] for i in sampling]
            # top-k 0, or past the vocabulary, keeps every token
            top_k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in settings]
            filtered = any(k < self.vocab_size or p.top_p < 1.0 or p.min_p > 0
                           for k, p in zip(top_k, settings, strict=True))  # fmt: skip
            packed.add_ints(sampling, [s.sampling_seed for s in rows], [at[i] for i in sampling], top_k)
            packed.add_floats([p.temperature for p in settings], [p.top_p for p in settings],
                              [p.min_p for p in settings])  # fmt: skip
        on_device = iter(packed.send(self._staging))

        if processed:
            rows_idx = next(on_device)
            logits = logits.index_copy(0, rows_idx, apply(logits[rows_idx], on_device))
        if constrained:
            rows_idx, words = next(on_device), next(on_device)
            logits = logits.index_copy(0, rows_idx, apply_bitmask(logits[rows_idx], words))
        if not sampling:
            return logits.argmax(-1)
        rows_idx, seeds, sampled_at, top_k_t, temperatures, top_p_t, min_p_t = on_device
        scaled = logits[rows_idx] / temperatures[:, None]  # (sampling rows, vocab)
        if filtered:
            scaled = _filter(scaled, top_k_t, top_p_t, min_p_t)
        drawn = kvkernels.gumbel_argmax(scaled, seeds, sampled_at)
        if len(sampling) == len(seqs):
            return drawn
        tokens = logits.argmax(-1)
        tokens[rows_idx] = drawn
        return tokens


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits (rows, vocab)``; ``top_k (rows,)`` in [1, vocab] (vocab keeps all), ``top_p (rows,)`` in (0, 1]
    (1 keeps all), ``min_p (rows,)`` in [0, 1] (0 keeps all). Tokens less likely than ``min_p`` times the
    row's most likely one become -inf, then those below its k-th largest logit (ties with it stay), then
    those past its top-p nucleus of what is left: a token goes when the tokens before it already reach
    ``top_p``, so the most likely token always stays."""
    # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf drops nothing
    logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + min_p.log()[:, None], float("-inf"))
    ordered, order = logits.sort(-1, descending=True)  # (rows, vocab), order[r, j] = vocab id of rank j
    kth = ordered.gather(1, (top_k - 1)[:, None])  # (rows, 1)
    outside_k = ordered < kth
    probs = ordered.masked_fill(outside_k, float("-inf")).softmax(-1)
    # (a row with top_p == 1 keeps everything even where float rounding lets the cumulative sum reach 1 early)
    outside_p = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.empty_like(outside_k).scatter_(1, order, outside_k | outside_p)
    return logits.masked_fill(drop, float("-inf"))


class Packed:
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
