"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regular expression,
one of a list of strings or an EBNF grammar, with xgrammar.

A request's life with one: ``StructuredOutput.validate`` (through ``SamplingParams.validate``) parses the
grammar without a tokenizer, so a bad schema, regex or grammar is a ``ValueError`` naming it before anything
is queued, at the router and the workers alike. ``add_request`` asks the engine's ``GrammarCompiler`` for it:
compiling against the tokenizer's vocabulary runs on a thread of its own, once per distinct (kind, text)
(later requests share the first one's result), so the engine thread never waits for it. The sequence gets a
``GrammarState`` and stays in the waiting queue, passed over by admission, until its grammar is compiled
(``GrammarState.ready``); the batch runs on meanwhile. Each step the sampler asks every constrained row's
matcher which tokens may come next (``fill_bitmask``: one bit per token, sent with the step's other per-row
settings) and makes the others -inf before the draw (``apply_bitmask``), greedy and sampled rows alike; a
verify row of speculative decoding is masked after its proposals, which the matcher accepts and rolls back.
Each appended token advances the matcher (``GrammarState.advance``, from ``engine.output_processor``); once
it accepts a stop token (EOS) after a complete output it is terminated and the request ends with "stop".

The matcher is fed the sequence's output tokens it has not seen yet, whenever it is asked for anything, so
tokens that arrive by other ways are replayed into it too: a continuation's resumed output
(``engine.continuation``) and the first token a prefill worker sampled under the same grammar.
Preemption recomputes KV only and appends nothing, so the matcher is kept as it is.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept for later requests, least recently asked for dropped first
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. ``kind``: "json" (``text``: a JSON schema), "json_object" (any JSON
    object; no text), "regex" (``text``: the expression), "choice" (``text``: a JSON array of the strings
    allowed) or "grammar" (``text``: an EBNF grammar, xgrammar's dialect, whose start rule is ``root``).

    JSON is written with ", " and ": " between items and no other whitespace (xgrammar's ``any_whitespace``
    off, vLLM's ``disable_any_whitespace``): free whitespace lets a small model loop on newlines until
    ``max_tokens``. A schema's properties come in the order it lists them."""

    kind: str
    text: str = ""

    @classmethod
    def json(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))

    def validate(self) -> None:
        """``ValueError`` naming what is wrong: an unknown kind, or a schema, regex, choice list or grammar that
        does not parse."""
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        _grammar(self.kind, self.text)

    def grammar(self) -> xgrammar.Grammar:
        return _grammar(self.kind, self.text)


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "EBNF grammar"}


@functools.lru_cache(maxsize=64)
def _grammar(kind: str, text: str) -> xgrammar.Grammar:
    """The parsed grammar (validation and compiling both ask for it, so it is parsed once)."""
    import xgrammar as xgr  # (imports torch: only processes that serve a structured output pay for it)

    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "choice":
        choices = _choices(text)
        text = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON schema: it is not JSON ({err})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"invalid JSON schema: a schema is an object or a boolean, got {text[:64]}")
    build = {"json": functools.partial(xgr.Grammar.from_json_schema, any_whitespace=False),
             "regex": xgr.Grammar.from_regex,
             "choice": xgr.Grammar.from_ebnf, "grammar": xgr.Grammar.from_ebnf}[kind]  # fmt: skip
    try:
        return build(text)
    except RuntimeError as err:  # xgrammar's parse errors, prefixed with where in its C++ they were raised
        message = _XGRAMMAR_PREFIX.sub("", str(err).strip().splitlines()[0])
        raise ValueError(f"invalid {_WHAT[kind]}: {message}") from None


def _choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"invalid choice list: it must be a non-empty list of non-empty strings, got {text[:64]}")
    return choices


class GrammarCompiler:
    """Compiles grammars against one tokenizer on a thread of its own, each distinct ``StructuredOutput`` once
    while it stays among the ``MAX_CACHED_GRAMMARS`` most recently asked for. ``hf_tokenizer``: a transformers
    tokenizer; ``vocab_size``: the model's (its logits' width, which may exceed the tokenizer's);
    ``stop_token_ids``: the tokens that end a request (EOS), which end a complete output.
    ``num_compiled`` counts the compilations started."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.num_compiled = 0
        self.num_failed = 0
        self._tokenizer = hf_tokenizer
        self._stop_token_ids = stop_token_ids
        self._compiler: xgrammar.GrammarCompiler | None = None  # made on the compile thread: ~0.2 s
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # num_failed is counted on the compile thread

    def compile(self, spec: StructuredOutput) -> Future:
        """The compiled grammar of ``spec``, as a future (shared by every request that asks for it)."""
        future = self._cache.get(spec)
        if future is None or (future.done() and future.exception() is not None):  # (a failure is tried again)
            future = self._cache[spec] = self._executor.submit(self._compile, spec)
            future.add_done_callback(self._count_failure)
            self.num_compiled += 1
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return future

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_token_ids)  # fmt: skip
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(spec.grammar())

    def _count_failure(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            with self._lock:
                self.num_failed += 1


class ConstrainedSequence(Protocol):
    """What a grammar reads of a ``Sequence``."""

    token_ids: list[int]
    grammar: GrammarState | None

    @property
    def num_prompt_tokens(self) -> int: ...


class GrammarState:
    """One sequence's matcher, made once its grammar is compiled. Invariant: the matcher has accepted the
    sequence's first ``num_accepted`` output tokens; ``sync`` feeds it the rest."""

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher: xgrammar.GrammarMatcher | None = None
        self.num_accepted = 0
        self.rejected = False  # an output token the grammar does not allow (then the request is ended)

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled, so the sequence may be scheduled (one that failed to compile,
        ``failed``, never is: the engine ends it)."""
        return self._compiled.done() and self._compiled.exception() is None

    @property
    def failed(self) -> bool:
        return self._compiled.done() and self._compiled.exception() is not None

    def sync(self, seq: ConstrainedSequence) -> xgrammar.GrammarMatcher:
        """The matcher, having accepted every output token of ``seq`` (a rejected one sets ``rejected``)."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        for token in seq.token_ids[seq.num_prompt_tokens + self.num_accepted :]:
            if not self.rejected and not self._matcher.accept_token(token):
                self.rejected = True
            self.num_accepted += 1
        return self._matcher

    def advance(self, seq: ConstrainedSequence) -> str | None:
        """After a token was appended to ``seq``: "stop" when the grammar is complete and ended (terminated),
        "abort" when the token broke it, else None."""
        matcher = self.sync(seq)
        if self.rejected:
            return "abort"
        return "stop" if matcher.is_terminated() else None


def fill_bitmask(seqs: list[ConstrainedSequence], seen_after: list[list[int]], vocab_size: int) -> np.ndarray:
    """Bit t of row i (int32 word t // 32, bit t % 32) set when ``seqs[i]`` may take token t next, after its
    output and then the tokens ``seen_after[i]`` (a verify row's proposals: accepted, then rolled back). A row
    whose proposals the grammar refuses, or that come after its end, allows every token: the row before it
    could not draw that proposal, so verification never reaches it. Returns the rows as int64 (flat)."""
    words = torch.full((len(seqs), -(-vocab_size // 32)), -1, dtype=torch.int32)  # (rows, words), as xgrammar
    for row, (seq, after) in enumerate(zip(seqs, seen_after, strict=True)):
        matcher = seq.grammar.sync(seq)
        accepted = 0
        while accepted < len(after) and not matcher.is_terminated() and matcher.accept_token(after[accepted]):
            accepted += 1
        if accepted == len(after) and not matcher.is_terminated() and not seq.grammar.rejected:
            matcher.fill_next_token_bitmask(words, row)
        if accepted:
            matcher.rollback(accepted)
    host = words.numpy()
    if host.shape[1] % 2:  # whole int64s for the sampler's packed copy (the padding's bits are past the vocab)
        host = np.pad(host, ((0, 0), (0, 1)), constant_values=-1)
    return host.view(np.int64).reshape(-1)


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits (rows, vocab)``, a copy the caller owns, with -inf where ``words`` (``fill_bitmask``'s rows,
    on the logits' device as int64) has a 0 bit: xgrammar's kernel, native on a CPU, Triton on CUDA."""
    import xgrammar as xgr

    rows, vocab = logits.shape
    xgr.apply_token_bitmask_inplace(logits, words.view(torch.int32).view(rows, -1), vocab_size=vocab)
    return logits
