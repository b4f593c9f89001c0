"""What a step gives back: each request's progress (``RequestOutput``), or the failure of a batch (``StepError``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.models.tensor_parallel import RankLost
from engine.sequence import Sequence


@dataclass
class RequestOutput:
    """A request's progress after a step: what this step added and everything so far.

    ``token_ids`` and ``text`` (everything so far) are built when read, O(length), so that producing an
    output costs O(new tokens) per step. They show the request as of this step, except that a stop string
    found later also shortens ``text`` of earlier outputs.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_external_tokens: int = 0  # tokens whose KV the KV connector loaded from outside (first admission)
    num_output_tokens: int = 0
    new_logprobs: list[TokenLogprob | None] | None = None  # of new_token_ids, when the request asked
    index: int = 0  # which of the request's ``n`` choices this is (``engine.parallel_sampling``)
    _seq: Sequence | None = field(default=None, repr=False, compare=False)
    _num_chars: int = 0

    @property
    def spec_tokens(self) -> tuple[int, int]:
        """(proposed, accepted) speculative tokens of this choice so far; (0, 0) without speculation."""
        tracker = self._seq.spec_tracker if self._seq is not None else None
        return (tracker.num_proposed, tracker.num_accepted) if tracker is not None else (0, 0)

    @property
    def token_ids(self) -> list[int]:
        start = len(self.prompt_token_ids)
        return self._seq.token_ids[start : start + self.num_output_tokens]

    @property
    def logprobs(self) -> list[TokenLogprob | None] | None:
        """Of ``token_ids``, when the request asked for ``logprobs`` (None for tokens another worker sent
        before a continuation)."""
        if self._seq.params.logprobs is None:
            return None
        return self._seq.logprobs[: self.num_output_tokens]

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Of the prompt's tokens (None for the first), when the request asked for ``prompt_logprobs``: all of
        them once the prompt has been computed, and every output has them from then on."""
        if self._seq.params.prompt_logprobs is None:
            return None
        return list(self._seq.prompt_logprobs)

    @property
    def text(self) -> str:
        return self._seq.detokenizer.text[: self._num_chars]


class StepError(RuntimeError):
    """A step's model run failed. ``request_ids`` are the requests of that batch: abort them (their KV is
    suspect); the engine itself stays usable for the others, unless ``fatal``."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"model step failed for {len(request_ids)} requests: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        # not this batch's fault but the engine's: a tensor-parallel rank is lost, and no later step can run
        self.fatal = isinstance(cause, RankLost)
