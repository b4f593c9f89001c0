"""The sampler's reference: a counter-based uniform per (seed, position, token) (splitmix64) and the
Gumbel-max draw it feeds (``gumbel_argmax``), which ``kvkernels.sampling`` must match token for token."""

from __future__ import annotations

import torch

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; int64 wraps with the same bits)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` is arithmetic on int64 and would copy the sign bit in)."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place: a bijection of 64-bit values whose every output bit depends on every
    input bit. ``x`` int64, any shape."""
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``seeds (rows,)``, ``positions (rows,)`` int64 -> ``(rows, vocab_size)`` float32 uniforms in (0, 1).

    Entry ``[r, t]`` is a function of ``(seeds[r], positions[r], t)`` alone: the ``t + 1``-th output of a
    splitmix64 generator whose state starts at ``mix(mix(seed) + position)``. The top 23 bits make the
    uniform ``(k + 0.5) / 2**23``, exact in float32 and never 0 or 1.
    """
    keys = _mix64_(_mix64_(seeds.clone()) + positions)  # (rows,)
    counters = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN  # (vocab,)
    bits = _mix64_(keys[:, None] + counters)  # (rows, vocab)
    return (_shr(bits, 41).float() + 0.5) * 2.0**-23


def gumbel_argmax(scaled_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of ``scaled_logits (rows, vocab)`` float32, drawn with probability
    ``softmax(row)[t]`` by the noise of ``(seeds[r], positions[r])`` (``(rows,)`` int64 each) -> ``(rows,)`` int64.

    Gumbel-max: ``argmax(logit - log(-log(u)))``. It is the exponential race ``argmax(p / E)`` with
    ``E = -log(u)`` taken in logs, where ``log(p)`` differs from the logit by a per-row constant, so no
    softmax is needed; ``-inf`` logits stay ``-inf`` and are never drawn. Ties go to the lowest token id.
    """
    u = uniform_noise(seeds, positions, scaled_logits.shape[-1])
    return (scaled_logits - u.log_().neg_().log_()).argmax(-1)
