"""Offline batch inference: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.priorities import check_priority
from engine.requests import Prompt
from engine.sampling_params import SamplingParams


class LLM:
    """Runs a whole list of prompts through the continuous-batching engine and returns them in order.

    ``LLM(model="default", dtype="auto", block_size=16, num_blocks=None, max_num_seqs=256,
    max_num_batched_tokens=4096, ...)``: any ``EngineConfig`` field may be passed; ``LLM(**load_config(FILE))``
    takes them from the configuration file the cluster's processes read (``engine.config_file``).
    """

    def __init__(self, model: str = "default", **engine_options) -> None:
        self.engine = LLMEngine(model=model, **engine_options)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in the prompts' order, a prompt sampled
        with ``n > 1`` giving its ``n`` choices one after another (``RequestOutput.index``). ``priority``: one per
        prompt (lower first, as vLLM's ``LLM.generate`` takes it); none: all 0."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        for p in priority:
            check_priority(p)
        # Validate everything first, so a bad prompt leaves nothing half-queued.
        for prompt, p in zip(prompts, params, strict=True):
            self.engine.validate(prompt, p)
        ids = [self.engine.add_request(prompt, p, priority=rank)
               for prompt, p, rank in zip(prompts, params, priority, strict=True)]  # fmt: skip
        wanted = [(rid, i) for rid, p in zip(ids, params, strict=True) for i in range(p.n)]
        finished: dict[tuple[str, int], RequestOutput] = {}
        while len(finished) < len(wanted):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id, out.index] = out
        return [finished[key] for key in wanted]

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Like ``generate`` for chat messages, rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine runs with skip_tokenizer_init")
        prompts = [self.tokenizer.encode_chat(messages) for messages in conversations]
        return self.generate(prompts, params)
