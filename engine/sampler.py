"""Choose each sequence's next token from its logits row."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make tokens already in the sequence less likely (divide positive logits, multiply negative ones)."""
    picked = logits.gather(0, seen)
    logits.scatter_(0, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set everything outside the top-k tokens, then outside the top-p nucleus, to -inf (``logits (vocab,)``)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p; the first token always stays
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    seen_token_ids: list[int],
) -> int:
    """One row ``(vocab,)`` float32 -> token id. Sampling uses only ``generator``'s random stream."""
    if params.repetition_penalty != 1.0 and seen_token_ids:
        seen = torch.tensor(sorted(set(seen_token_ids)), device=logits.device)
        logits = apply_repetition_penalty(logits.clone(), seen, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    logits = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one random draw per vocabulary entry.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def skip_draw(params: SamplingParams, generator: torch.Generator, vocab_size: int, device: torch.device) -> None:
    """Advance ``generator`` past the draw ``sample_token`` would make for one token of ``params``.

    A request whose first token was sampled by another worker continues from the same point of its seed's
    stream, so its answer is the one a single engine would give.
    """
    if not params.greedy:
        torch.empty(vocab_size, device=device).exponential_(generator=generator)


class Sampler:
    """One token per row of a step's logits. (Interface for the batched device sampler; the body still samples
    row by row.)"""

    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """``logits (rows, vocab)`` float32, row i for ``seqs[i]`` (which samples its token number
        ``seqs[i].num_tokens``) -> ``(rows,)`` int64 on ``logits.device``."""
        rows = [(s.params, s.generator or self.generator, s.token_ids) for s in seqs]
        return torch.tensor(sample(logits, rows), device=logits.device, dtype=torch.int64)


def sample(logits: torch.Tensor, rows: list[tuple[SamplingParams, torch.Generator | None, list[int]]]) -> list[int]:
    """``logits (seqs, vocab)`` -> one token per row; greedy rows without penalty share one argmax."""
    simple = [i for i, (p, _, _) in enumerate(rows) if p.greedy and p.repetition_penalty == 1.0]
    tokens = [0] * len(rows)
    if simple:
        argmax = logits[simple].argmax(-1).tolist()
        for i, t in zip(simple, argmax, strict=True):
            tokens[i] = t
    for i, (params, generator, seen) in enumerate(rows):
        if not (params.greedy and params.repetition_penalty == 1.0):
            tokens[i] = sample_token(logits[i], params, generator, seen)
    return tokens
