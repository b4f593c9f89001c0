"""How a request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# The smallest positive temperature. The sampler divides float32 logits by the temperature; far below this
# the quotients overflow to inf and softmax turns them into NaN (1e-38 did), and long before that the result
# is greedy anyway. vLLM clamps such values to 0.01 with a warning; we refuse them instead, so a request is
# never served with settings other than those it sent, and the message names 0 as the way to ask for greedy.
MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingParams:
    """Per-request sampling and stop settings; defaults follow vLLM's.

    ``temperature=0`` is greedy; otherwise it is at least ``MIN_TEMPERATURE``. ``top_k=0`` and ``top_p=1``
    disable those filters. A ``seed`` gives the request its own random stream, so its tokens
    are the same whatever else shares its batch. ``stop`` strings end the
    output before the matched string; ``stop_token_ids`` and EOS end it after
    the token (the token id is kept in the output); ``ignore_eos`` keeps going
    past EOS until ``max_tokens``. Every float is finite once ``validate`` has passed.

    ``streaming_window`` and ``streaming_sinks`` (StreamingLLM, ``kvstore.ring``) override the engine's
    options of the same names for this request; None keeps the engine's (``streaming_window=0``: off).
    ``speculative=False`` turns the engine's speculative decoding off for this request (``engine.speculative``;
    its tokens are the same either way).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    streaming_window: int | None = None
    streaming_sinks: int | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad setting; with ``vocab_size``, stop token ids must be in it."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        # (isclose: the wire's float32 turns 0.01 into 0.0099999998)
        if 0 < self.temperature < MIN_TEMPERATURE and not math.isclose(self.temperature, MIN_TEMPERATURE, rel_tol=1e-6):
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                             f"{self.temperature}: smaller values overflow the sampler's arithmetic; "
                             "send 0 for the greedy answer")  # fmt: skip
        if not 0 < self.top_p <= 1:  # also refuses NaN, which fails every comparison
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                             f"got {self.repetition_penalty}")  # fmt: skip
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids[:5]}")
        for name in ("streaming_window", "streaming_sinks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if vocab_size is not None:
            check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_token_ids(ids: Iterable[int], vocab_size: int, what: str) -> None:
    """Raise ``ValueError`` unless every id is an integer token of a ``vocab_size`` vocabulary."""
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} must be integers in [0, {vocab_size}); got {bad[:5]}")
