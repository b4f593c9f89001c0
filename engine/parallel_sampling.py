"""Parallel sampling: one request, ``n`` choices of one prompt, the prompt computed once.

A request with ``SamplingParams.n > 1`` becomes ``n`` sequences, its choices: choice 0 keeps the request's
id (``choice_id``), so that whatever handles the prompt's KV for the request (a decode worker's remote
prefill, ``decode_service.remote_prefill``) sees one request and hands its prompt over once; choice ``i``
is ``"<id>#i"``. Only choice 0 enters the scheduler at first; the others are held here until its prompt's
KV is computed (``num_computed_tokens >= num_prompt_tokens``, locally or loaded), then queued at the front.
When the scheduler admits such a choice it shares choice 0's blocks of the prompt's full blocks by
reference count (``BlockManager.shared_prefix``: the block manager's sharing, with or without prefix
caching) and computes only the rest of the prompt, fewer than ``block_size`` tokens, itself: its own last
partial block, which each choice then fills with its own output. Should choice 0 have let go of its blocks
by then (it finished, or was preempted), a choice takes the prefix cache's hit instead, or without prefix
caching computes the prompt itself.

Seeds: choice ``i`` of a seeded request draws from ``seed + i`` (as vLLM does), so each choice is
reproducible, and is the same as a request of ``n=1`` with that seed; unseeded choices each draw their own
stream seed. Only choice 0 scores the prompt (``prompt_logprobs``): the others would only repeat it.
"""

from __future__ import annotations

from dataclasses import replace

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of a request's choice ``index``: the request's own for choice 0."""
    return request_id if index == 0 else f"{request_id}#{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling of choice ``index`` of a request sampled with ``params`` (``n`` of them): one choice each."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class HeldChoices:
    """Choices 1..n-1 of requests whose choice 0 has not computed its prompt's KV yet, by choice 0.

    Invariant: a held sequence is WAITING but in no scheduler queue and holds no blocks; it leaves through
    ``ready`` (then it is queued) or ``drop`` (its request ended).
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[Sequence, list[Sequence]]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, first: Sequence, others: list[Sequence]) -> None:
        if others:
            self._held[first.seq_id] = (first, others)

    def ready(self) -> list[Sequence]:
        """The held choices whose choice 0 now has its prompt's KV (or ended): release them, in order."""
        done = [key for key, (first, _) in self._held.items()
                if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens]  # fmt: skip
        return [seq for key in done for seq in self._held.pop(key)[1]]

    def drop(self, first: Sequence) -> list[Sequence]:
        """Forget the choices held behind ``first`` (its request ended); returns them."""
        return self._held.pop(first.seq_id, (first, []))[1]
