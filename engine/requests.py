"""What a request may ask of this engine: its prompt's token ids, checked against the model and the pool,
and the window it attends through (``kvstore.ring``). ``LLMEngine`` holds one ``RequestValidator``; the
workers check a request through the engine before they queue it."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams, check_token_ids
from engine.tokenizer import Tokenizer
from kvstore.ring import UNBOUNDED, RingSpec, check_streaming

Prompt = str | list[int]


class RequestValidator:
    """Checks requests against one engine's model, tokenizer and pool: ``max_model_len`` tokens at most
    (``num_blocks`` blocks hold the pool), and ``model_ring`` the model's own sliding window (None: none)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer | None,
                 max_model_len: int, num_blocks: int, model_ring: RingSpec | None) -> None:  # fmt: skip
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.model_ring = model_ring

    def tokenize(self, prompt: Prompt, max_len: int | None = None) -> list[int]:
        """Token ids of a prompt given as text or ids, validated against the model and the pool (or, with
        ``max_len``, against that length: ``max_len_for``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: send at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this engine runs with skip_tokenizer_init: send token ids, not text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty: send at least one character or token id")
            check_token_ids(ids, self.model_config.vocab_size, "prompt token ids")
        if len(ids) >= (max_len or self.max_model_len):
            raise ValueError(
                f"prompt has {len(ids)} tokens but at most {self.max_model_len - 1} fit "
                f"(model context {self.model_config.max_context} tokens, KV pool "
                f"{self.num_blocks * self.config.block_size} tokens; one slot is kept for the answer)"
            )
        return ids

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Check a request without queueing it; return its prompt's token ids."""
        params.validate(self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine runs with skip_tokenizer_init")
        if params.structured_output is not None and self.tokenizer is None:
            raise ValueError("a structured output needs a tokenizer, and this engine runs with skip_tokenizer_init")
        return self.tokenize(prompt, self.max_len_for(params))

    def ring_for(self, params: SamplingParams) -> RingSpec | None:
        """The ring a request attends through: StreamingLLM's sinks + window when it (or, unset, the engine)
        asks for a ``streaming_window``, else the model's own sliding window; None: a full cache.
        ``ValueError`` when its options make no ring, or one the pool cannot hold."""
        window = self.config.streaming_window if params.streaming_window is None else params.streaming_window
        sinks = self.config.streaming_sinks if params.streaming_sinks is None else params.streaming_sinks
        if not window:
            return self.model_ring
        if self.model_ring is not None:
            raise ValueError(f"this model attends over a sliding window of {self.model_config.sliding_window} "
                             "tokens already: send no streaming_window (or 0)")  # fmt: skip
        check_streaming(window, sinks, self.config.block_size)
        ring = RingSpec(sinks, window, self.config.block_size)
        if ring.max_blocks > self.num_blocks:
            raise ValueError(f"streaming_window={window} with {sinks} sinks needs {ring.max_blocks} KV blocks "
                             f"(window, sinks, one step's chunk); the pool has {self.num_blocks}")  # fmt: skip
        return ring

    def max_len_for(self, params: SamplingParams) -> int:
        """The longest sequence a request may grow to: ``max_model_len``, except that a streaming one
        (``streaming_window``) has no bound but its positions' integers."""
        ring = self.ring_for(params)
        return self.max_model_len if ring is None or ring == self.model_ring else UNBOUNDED
