"""How a request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stop settings; defaults follow vLLM's.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those
    filters. A ``seed`` gives the request its own random stream, so its tokens
    are the same whatever else shares its batch. ``stop`` strings end the
    output before the matched string; ``stop_token_ids`` and EOS end it after
    the token (the token id is kept in the output); ``ignore_eos`` keeps going
    past EOS until ``max_tokens``.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
