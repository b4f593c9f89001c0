"""Output processing: the tokens a step sampled for a request become its ``RequestOutput``.

For each request that got tokens, ``OutputProcessor.append`` adds them one at a time to its sequence and
its incremental detokenizer, and after each checks whether that token ends the request: a stop token
(``stop_token_ids``, or an end-of-sequence token unless ``ignore_eos``), the end of its structured output
(``engine.structured_output``: "stop"; a token its grammar refuses: "abort"), a stop string in the text (the
text is cut where the string starts), ``max_tokens``, or the longest sequence the engine admits. Nothing
after the token that ends a request is appended, so a stop inside a run of accepted speculative tokens
ends the output there.

Text goes out in deltas (``RequestOutput.new_text``). While a request runs, its last characters that could
still turn out to be the start of a stop string are held back, so that the deltas always add up to the
final text.

The processor only says that a request ends and why; the engine ends it (the scheduler frees its blocks)
before asking for its output, which then reads finished.
"""

from __future__ import annotations

from engine.logprobs import TokenLogprob
from engine.outputs import RequestOutput
from engine.sequence import Sequence
from kvstore.ring import RingSpec


class OutputProcessor:
    """Appends sampled tokens, checks stop conditions and builds each request's output (module docstring)."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int, model_ring: RingSpec | None) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.model_ring = model_ring  # the model's own sliding window, which max_model_len still bounds

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None
               ) -> tuple[list[int], str | None]:  # fmt: skip
        """Append ``tokens`` (and, where the request asked, their ``logprobs``) one by one until one ends the
        request: (the tokens appended, the reason it finished or None). A request with ``max_tokens=0`` only
        scored its prompt: it ends before its first token."""
        if seq.params.max_tokens == 0:
            return [], "length"
        appended = []
        for i, token in enumerate(tokens):
            if seq.params.logprobs is not None:
                seq.logprobs.append(None if logprobs is None else logprobs[i])
            seq.token_ids.append(token)
            appended.append(token)
            new_text = seq.detokenizer.add([token])
            reason = self._check_stop(seq, token, new_text)
            if reason is not None:
                return appended, reason
        return appended, None

    def _check_stop(self, seq: Sequence, token: int, new_text: str) -> str | None:
        params = seq.params
        if seq.grammar is not None and (reason := seq.grammar.advance(seq)) is not None:
            return reason
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if params.stop and new_text:
            # only the tail can hold a new match: the new text plus the longest stop string before it
            detok = seq.detokenizer
            tail = detok.tail(len(new_text) + max(len(s) for s in params.stop))
            hits = [i for s in params.stop if (i := tail.find(s)) != -1]
            if hits:
                detok.truncate(detok.num_chars - len(tail) + min(hits))
                return "stop"
        num_tokens = len(seq.token_ids)
        if num_tokens - len(seq.prompt_token_ids) >= params.max_tokens:
            return "length"
        if num_tokens >= self.max_model_len and (seq.ring is None or seq.ring == self.model_ring):
            return "length"  # (a streaming sequence goes on: its ring holds the same blocks however long it runs)
        return None

    def output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """What ``seq`` gained since its last output (``new_token_ids``, and the text they make that can be
        emitted now) and where it stands."""
        detok = seq.detokenizer
        # While running, hold back text that could still turn out to be the start of a stop string,
        # so that the concatenated deltas always equal the final text.
        stop, finished = seq.params.stop, seq.is_finished
        holdback = max(map(len, stop)) - 1 if stop else 0
        upto = detok.num_chars if finished else max(seq.num_emitted_chars, detok.num_chars - holdback)
        new_text = detok.slice(seq.num_emitted_chars, upto)
        seq.num_emitted_chars = upto
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
            num_external_tokens=seq.num_external_tokens,
            num_output_tokens=len(seq.token_ids) - len(seq.prompt_token_ids),
            new_logprobs=seq.logprobs[len(seq.logprobs) - len(new_token_ids) :]
            if seq.params.logprobs is not None
            else None,
            _seq=seq,
            _num_chars=detok.num_chars,
        )
