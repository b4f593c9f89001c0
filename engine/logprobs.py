"""Log-probabilities of tokens: of each sampled token (``SamplingParams.logprobs``) and of the prompt's tokens
(``prompt_logprobs``), with the ``k`` most likely alternatives at each position.

They are ``log_softmax`` of the model's raw logits in float32, before temperature, penalties, bias or any
filter (``SamplingParams``' docstring says why). A sampled token's log-probability comes from the same rows
the sampler drew it from, so with speculative decoding it is the target's verify pass that gives it, and
the values are those of decoding without it (up to the schedules' last bits).

The device computes a whole step's rows at once (``LogprobTensors``); ``to_host`` brings them back in one
copy per tensor and cuts each row's alternatives to its own ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Prompt positions scored per model call: bounds the (rows, vocab) float32 logits a long prompt makes at once.
PROMPT_ROWS_PER_CALL = 256


@dataclass(slots=True)
class TokenLogprob:
    """One position's token, its log-probability, and the ``k`` most likely tokens there, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class LogprobTensors:
    """Device tensors of a step's rows: ``token (rows,)`` the chosen token's log-probability, ``top_ids`` and
    ``top_logprobs (rows, k)`` the ``k`` most likely, ``k`` the widest any row asked for."""

    token: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
        """``logits (rows, vocab)`` raw, ``token_ids (rows,)`` int64 on the same device."""
        logprobs = logits.float().log_softmax(-1)
        top_logprobs, top_ids = logprobs.topk(k, -1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return cls(logprobs.gather(1, token_ids[:, None]).squeeze(1), top_ids, top_logprobs)

    def to_host(self, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
        """Row i as a ``TokenLogprob`` of ``token_ids[i]`` with its first ``ks[i]`` alternatives."""
        token = self.token.cpu().tolist()
        top_ids, top_logprobs = self.top_ids.cpu().tolist(), self.top_logprobs.cpu().tolist()
        return [TokenLogprob(t, lp, list(zip(ids[:k], lps[:k], strict=True)))
                for t, lp, ids, lps, k in zip(token_ids, token, top_ids, top_logprobs, ks, strict=True)]  # fmt: skip


def prompt_logprobs(
    compute_logits, hidden: torch.Tensor, next_token_ids: list[int], k: int
) -> list[TokenLogprob]:  # fmt: skip
    """The log-probabilities of ``next_token_ids`` (row i's next token) from ``hidden (rows, hidden)``,
    ``compute_logits`` turning hidden states into logits, ``PROMPT_ROWS_PER_CALL`` rows at a time."""
    out: list[TokenLogprob] = []
    targets = torch.tensor(next_token_ids, dtype=torch.int64, device=hidden.device)
    for start in range(0, len(next_token_ids), PROMPT_ROWS_PER_CALL):
        end = start + PROMPT_ROWS_PER_CALL
        tensors = LogprobTensors.of(compute_logits(hidden[start:end]), targets[start:end], k)
        out.extend(tensors.to_host(next_token_ids[start:end], [k] * len(next_token_ids[start:end])))
    return out
