"""How a request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.structured_output import StructuredOutput

# The smallest positive temperature. The sampler divides float32 logits by the temperature; far below this
# the quotients overflow to inf and softmax turns them into NaN (1e-38 did), and long before that the result
# is greedy anyway. vLLM clamps such values to 0.01 with a warning; we refuse them instead, so a request is
# never served with settings other than those it sent, and the message names 0 as the way to ask for greedy.
MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty is [-2, 2]
MAX_LOGIT_BIAS = 100.0  # and [-100, 100] for a logit_bias value
MAX_N = 16  # choices one request may sample (``n``, engine.parallel_sampling)


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

    Logits processing (``engine.logits_processors``), in this order: ``logit_bias`` (token id -> a value
    added to its logit), ``min_tokens`` (EOS and ``stop_token_ids`` cannot be drawn before that many output
    tokens), ``repetition_penalty`` (vLLM's: over prompt and output), ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's: over the output only, ``logit -= presence * (count > 0) + frequency *
    count``); then temperature, and the filters ``top_k``, ``top_p`` and ``min_p`` (a token stays when its
    probability is at least ``min_p`` times the most likely one's).

    ``logprobs=k`` returns each output token's log-probability and its ``k`` most likely alternatives
    (``k <= 20``; 0: the token's own only); ``prompt_logprobs=k`` the same for every prompt token after the
    first. Both come from the model's raw distribution, ``log_softmax`` of its logits before any processing
    above, as vLLM returns by default: they say what the model thinks, whatever the request then drew.
    ``max_tokens=0`` is allowed with ``prompt_logprobs`` only: the prompt is scored and nothing generated.

    ``n`` (at most ``MAX_N``) samples that many choices of the prompt, which is computed once
    (``engine.parallel_sampling``); with a ``seed``, choice ``i`` draws from ``seed + i``, as vLLM's do.
    ``structured_output`` constrains the output to a JSON schema, any JSON object, a regex, a choice of
    strings or an EBNF grammar (``engine.structured_output``); the request ends with "stop" once the output
    is complete. A bad schema, regex or grammar fails ``validate``.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad setting; with ``vocab_size``, stop token ids must be in it."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be a positive integer, got 0 (0 only scores the prompt, so it "
                             "needs prompt_logprobs, as echo with logprobs asks)")  # fmt: skip
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
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}] (choices to sample), got {self.n!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids[:5]}")
        self._validate_processing()
        if self.structured_output is not None:
            self.structured_output.validate()
        for name in ("streaming_window", "streaming_sinks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if vocab_size is not None:
            check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
            check_token_ids(self.logit_bias, vocab_size, "logit_bias keys")

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")  # fmt: skip
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool):
                raise ValueError(f"logit_bias keys must be token ids (integers), got {token!r}")
            if not (isinstance(bias, int | float) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias!r} for token {token}")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor other than temperature and the filters applies to this request."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.logit_bias))  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_token_ids(ids: Iterable[int], vocab_size: int, what: str) -> None:
    """Raise ``ValueError`` unless every id is an integer token of a ``vocab_size`` vocabulary."""
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} must be integers in [0, {vocab_size}); got {bad[:5]}")
