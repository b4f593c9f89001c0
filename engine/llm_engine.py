"""The engine loop: requests in, one scheduled step at a time, outputs out.

A request's life: ``add_request`` validates and tokenizes it (``engine.requests``,
which also picks the window it attends through), starts compiling its
structured output's grammar if it has one (``engine.structured_output``) and
queues a ``Sequence`` (WAITING). Each ``step`` is the loop's one turn: schedule a batch (after the
speculator's proposals, ``engine.speculative``), execute it, then process its
outputs: keep a verify step's accepted run, append the sampled tokens
(``engine.output_processor``, which says what ends a request) and free the
blocks of whatever finished. ``abort`` ends a request at once and frees its blocks. A request of ``n``
choices is ``n`` sequences whose outputs carry its id and their ``index``; its prompt is computed once
(``engine.parallel_sampling``).
Both workers drive an engine through exactly these three calls; what they do
with KV outside this engine's pool (a prefill worker's hand-off, a decode
worker's remote prefill) is their KV connector's business (``connect``,
``engine.kv_connector``), never the engine's.

Each step that runs a batch is counted (``engine.step_diagnosis``, unless ``step_diagnosis`` is off): the bytes
it moves, its FLOPs and its host time, against the device's peaks (``engine.device_peaks``), in ``diagnosis``.

Prefix caching: a request starts after the longest cached run of full blocks
of its tokens (``RequestOutput.num_cached_tokens``); every full block, output
blocks included, is cached once its KV is computed and stays until evicted
(least recently used first). ``take_prefix_events`` reports the changes.
"""

from __future__ import annotations

import itertools
import time

from engine.bundled import resolve_model
from engine.config import EngineConfig
from engine.continuation import Continuation, check_continuation, resume
from engine.device_peaks import engine_peaks
from engine.kv_connector import TRANSFER_EXPIRED, ConnectorChain, KVConnector
from engine.logprobs import TokenLogprob
from engine.model_config import ModelConfig
from engine.model_runner import ExecutedStep, ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, StepError
from engine.parallel_sampling import HeldChoices, choice_id, choice_params
from engine.priorities import check_priority
from engine.requests import Prompt, RequestValidator
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import build_speculator, keep_accepted
from engine.step_diagnosis import StepDiagnosis
from engine.structured_output import GrammarCompiler, GrammarState
from engine.tier_connector import build_tiers
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kvstore import BlockManager
from kvstore.layout import fingerprint
from kvstore.ring import RingSpec


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config or EngineConfig(**overrides)
        path = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_dir(path)
        self.tokenizer = None if self.config.skip_tokenizer_init else Tokenizer(path)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        peaks = engine_peaks(self.config, self.model_config)  # (before the model and the KV pool take memory)
        self.runner = ModelRunner(path, self.model_config, self.config, frozenset(self.eos_token_ids))
        self.diagnosis = StepDiagnosis.of(self.runner, self.model_config, peaks) if peaks is not None else None
        block_size = self.config.block_size
        if self.config.max_model_len and self.config.max_model_len > self.model_config.max_context:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the model's context of "
                f"{self.model_config.max_context} tokens"
            )
        self.max_model_len = self.runner.max_model_len  # within the pool too (see ModelRunner)
        self.requests = RequestValidator(self.config, self.model_config, self.tokenizer, self.max_model_len,
                                         self.runner.num_blocks, self.runner.model_ring)  # fmt: skip
        self.requests.ring_for(SamplingParams())  # the engine's own streaming options fit this model and pool
        # the KV layout of all heads, the same for every tensor-parallel split (hand-offs move whole heads)
        self.prefix_salt = fingerprint(self.model_config.architecture, self.runner.kv_pool_spec)
        caching, salt = self.config.enable_prefix_caching, self.prefix_salt
        self.block_manager = BlockManager(self.runner.num_blocks, block_size, enable_caching=caching, salt=salt)
        self.tiers = build_tiers(self.config, self.runner.kv_spec, self.runner.device, self.block_manager,
                                 self.runner.kv_cache.layers, self.prefix_salt, self.runner.ranks)  # fmt: skip
        self.connector = self.tiers or KVConnector()
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.connector, self.config.scheduling_policy,
                                   self.config.priority_chunk_tokens)  # fmt: skip
        self.speculator = build_speculator(self.config, self.model_config, self.tokenizer, self.runner.num_blocks,
                                           self.max_model_len)  # fmt: skip
        self.output_processor = OutputProcessor(self.eos_token_ids, self.max_model_len, self.runner.model_ring)
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its choices not finished yet
        self.held = HeldChoices()
        self.grammars = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer.hf, self.model_config.vocab_size, sorted(self.eos_token_ids))  # fmt: skip
        self._num_failed_grammars = 0
        self._ids = itertools.count()

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        if self.tiers is not None:
            self.tiers.close()
        self.runner.close()

    def connect(self, connector: KVConnector) -> None:
        """Route KV to and from outside through ``connector`` from now on (before the first request), after the
        engine's own memory tiers when it has them."""
        if self._requests:
            raise ValueError("connect a KV connector before adding requests")
        if self.tiers is not None:
            self.tiers.then_remote = True
            connector = ConnectorChain([self.tiers, connector])
        self.connector = self.scheduler.connector = connector

    # -- requests (engine.requests) -----------------------------------------------------------------------

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Check a request without queueing it; return its prompt's token ids (``RequestValidator.validate``)."""
        return self.requests.validate(prompt, params)

    def ring_for(self, params: SamplingParams) -> RingSpec | None:
        """The ring a request attends through, None for a full cache (``RequestValidator.ring_for``)."""
        return self.requests.ring_for(params)

    def max_len_for(self, params: SamplingParams) -> int:
        """The longest sequence a request may grow to (``RequestValidator.max_len_for``)."""
        return self.requests.max_len_for(params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
                    continuation: Continuation | None = None, kv_params: object = None,
                    priority: int = 0) -> str:  # fmt: skip
        """Queue a request; returns its id. ``params.n`` choices of it are sampled (``engine.parallel_sampling``);
        ``continuation`` goes on from output another worker already streamed (``engine.continuation``; one
        choice only); ``kv_params`` is the KV connector's data about it (``Sequence.kv_params``, every choice's);
        ``priority``: an int32, lower first (``engine.scheduler``)."""
        params = params or SamplingParams()
        check_priority(priority)
        if params.n > 1 and continuation is not None:
            raise ValueError(f"a continuation resumes one stream; it cannot have n={params.n} choices")
        seqs = [self._new_sequence(prompt, params, request_id, continuation)]
        first = seqs[0]
        seqs += [self._new_sequence(first.prompt_token_ids, params, first.request_id, index=i)
                 for i in range(1, params.n)]  # fmt: skip
        for seq in seqs:
            seq.kv_params, seq.priority = kv_params, priority
        self._requests[first.request_id] = seqs
        self.scheduler.add(first)
        self.held.hold(first, seqs[1:])
        return first.request_id

    def _new_sequence(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                      continuation: Continuation | None = None, index: int = 0) -> Sequence:  # fmt: skip
        """Choice ``index`` of a request (``engine.parallel_sampling``)."""
        params = params or SamplingParams()
        ids = self.requests.validate(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq_id = choice_id(request_id, index)
        if (index == 0 and request_id in self._requests) or self.block_manager.has(seq_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = choice_params(params, index)
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            index=index,
            prompt_token_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            sampling_seed=self.runner.sampler.stream_seed(params.seed),
            ring=self.requests.ring_for(params),
        )
        if params.structured_output is not None:  # (RequestValidator refused it without a tokenizer)
            seq.grammar = GrammarState(self.grammars.compile(params.structured_output))
        if continuation is not None:
            check_continuation(continuation, seq.num_tokens, params, self.model_config.vocab_size,
                               self.requests.max_len_for(params))  # fmt: skip
            resume(seq, continuation)
        return seq

    def release(self, request_id: str) -> None:
        """Free the blocks a finished request kept because its KV connector asked (``request_finished``)."""
        if request_id not in self._requests:
            self.block_manager.free(request_id)

    def abort(self, request_id: str) -> bool:
        """End a request now, every choice of it, and free its blocks; False when it is unknown or finished."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        held = self.held.drop(seqs[0]) if seqs[0].index == 0 else []
        for seq in seqs:
            if seq in held:  # in no queue, no blocks
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            else:
                self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.held)

    def has_running_requests(self) -> bool:
        """Whether a step would run a batch now (requests waiting for blocks or for remote KV run none)."""
        return bool(self.scheduler.running)

    # -- prefix cache events (for the cluster's prefix index) ---------------------------------------------

    def take_prefix_events(self) -> tuple[list[str], list[str]]:
        """(block hashes stored, block hashes evicted) since the last call: the net change, so a hash appears in
        at most one list (one stored and evicted again in between appears in neither)."""
        return self.block_manager.take_events()

    def cached_block_hashes(self) -> list[str]:
        """Every block hash this engine can serve from its prefix cache now (for a full resync)."""
        return self.block_manager.cached_block_hashes()

    def take_tier_events(self) -> dict[str, tuple[list[str], list[str]]]:
        """Per memory tier below the pool ("host", "disk"): (hashes stored, hashes evicted) since the last call,
        netted like ``take_prefix_events``; {} without tiers."""
        return self.tiers.take_events() if self.tiers is not None else {}

    def held_block_hashes(self) -> dict[str, list[str]]:
        """Every block hash this engine holds, by tier ("device" is the pool's prefix cache), for a resync."""
        held = {"device": self.cached_block_hashes()}
        if self.tiers is not None:
            held.update(self.tiers.held())
        return held

    # -- the loop -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch, then take in the KV loads that finished; an output for each request that got a token
        or ended (``kv_transfer_expired``). Raises StepError (the loads then wait for the next step)."""
        began = time.perf_counter()
        outputs, cost = [], None
        if self.grammars is not None and self.grammars.num_failed != self._num_failed_grammars:
            outputs = self._end_failed_grammars()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch.seqs:
            cost = self.diagnosis.count(batch) if self.diagnosis is not None else None
            outputs += self._run(batch)
        for seq, load in self.scheduler.finish_loads(self.connector.finished_loads()):
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if load.prompt_logprobs is not None:
                seq.prompt_logprobs[1:] = load.prompt_logprobs
            logprobs = None if load.logprob is None else [load.logprob]
            outputs.append(self._append_tokens(seq, [load.first_token], logprobs))
        for seq in self.held.ready():  # their choice 0's prompt KV is computed: they may share it now
            self.scheduler.add(seq, first=True)
        if cost is not None:
            self.diagnosis.record(batch, cost, time.perf_counter() - began)
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Execute ``batch``, then process what it sampled: each sequence's new KV is counted and its full blocks
        cached (of a verify step, the accepted run's only: ``keep_accepted``), and its tokens appended."""
        step, failed = self._execute(batch)
        outputs = []
        for seq in failed:  # its KV may be incomplete there, or was read past the right to: keep nothing
            self._finish(seq, TRANSFER_EXPIRED)
            outputs.append(self.output_processor.output(seq, []))
        accepted = self.speculator.accepted_in(batch.seqs, step.tokens) if self.speculator is not None else {}
        for i, (seq, n, tokens) in enumerate(zip(batch.seqs, batch.num_new_tokens, step.tokens, strict=True)):
            if seq.is_finished:
                continue
            seq.prompt_logprobs.extend(step.prompt_logprobs.get(i, ()))
            if i in accepted:  # a verify step: its last token and its first accepted[i] proposals have right KV
                tokens = keep_accepted(seq, n, tokens, accepted[i], self.block_manager)
            else:
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if tokens:
                outputs.append(self._append_tokens(seq, tokens, step.logprobs[i]))
        return outputs

    def _end_failed_grammars(self) -> list[RequestOutput]:
        """Abort the waiting requests whose grammar failed to compile (their schema parsed, so this is rare)."""
        self._num_failed_grammars = self.grammars.num_failed
        failed = [s for s in self.scheduler.waiting if s.grammar is not None and s.grammar.failed]
        for seq in failed:
            self._finish(seq, "abort")
        return [self.output_processor.output(seq, []) for seq in failed]

    def _execute(self, batch: ScheduledBatch) -> tuple[ExecutedStep, list[Sequence]]:
        """Run ``batch`` between the KV connector's loads and saves: (each sequence's sampled tokens, the
        sequences whose KV the connector failed to save). ``StepError`` when any of it raises."""
        try:
            self.connector.start_loads(batch.admitted)
            sampled = self.runner.execute(batch)
            failed = self.connector.save(batch.seqs, batch.num_new_tokens)
        except Exception as err:
            for seq in batch.seqs:
                seq.spec_token_ids.clear()
            raise StepError(list(dict.fromkeys(seq.request_id for seq in batch.seqs)), err) from err
        return sampled, failed

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None
                       ) -> RequestOutput:  # fmt: skip
        """Append ``tokens`` and their ``logprobs`` (``OutputProcessor.append``), end the request when one of
        them ends it, and return its output."""
        appended, reason = self.output_processor.append(seq, tokens, logprobs)
        if reason is not None:
            self._finish(seq, reason)
        return self.output_processor.output(seq, appended)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and seq in seqs:
            seqs.remove(seq)
            if not seqs:
                del self._requests[seq.request_id]
