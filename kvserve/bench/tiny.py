"""The decode step of a tiny model, where host work dominates: the engine's against transformers', same run.

    kvserve bench offline --tiny [--batch-sizes 1,64,256] [--tiny-prompt-len 16 --tiny-steps 48 --tiny-rounds 5]

The model is ``kvserve.testing.random_model``'s ``qwen2-tiny`` (2 layers, width 64, fp32): its arithmetic takes well
under a millisecond at batch 64, so what a step costs beyond that is Python per sequence (scheduling, block
bookkeeping, staging inputs, outputs), the cost that caps a GPU's throughput when its step takes a few ms.

* the engine's step: ``batch`` prompts of ``prompt_len`` tokens decode greedily; after the prefill and one
  untimed decode step, ``steps`` decode steps are timed (``LLMEngine.add_request``/``step`` and
  ``SamplingParams`` only: ``scripts/step_time.py`` loads this file into an older tree's engine too);
* transformers' step: the same prompts through the same checkpoint with its dynamic cache, one token per
  step fed back by argmax (``generate``'s loop without its logits processors: the stricter peer);
* the engine's *host work*: its step minus the time inside its model's forward and logits (a wrapper on
  ``runner.model`` adds them up), per sequence;
* the attention line: ``kvkernels.reference.paged_decode_attention`` against SDPA over K/V already gathered
  contiguously (what transformers attends over), at the largest batch.

Timings read ``CLOCK`` (wall time, or CPU time). The two sides alternate every round, first one then the
other, to cancel the machine's drift; each figure is the median over rounds. This module imports nothing from
``kvserve``.
"""

from __future__ import annotations

import inspect
import random
import statistics
import time
from pathlib import Path

import torch

TINY_PRESET = "qwen2-tiny"
# What every timing here reads. ``time.process_time`` (``--tiny-cpu-time``) counts this one thread's CPU
# time: on a machine other jobs share, the work done rather than the waiting for a core.
CLOCK = time.perf_counter


def write_tiny_model(out_dir: str | Path) -> Path:
    from kvserve.testing.random_model import write_random_model

    return write_random_model(out_dir, TINY_PRESET, dtype=torch.float32)


def make_engine(model_dir: str | Path, max_batch: int, max_len: int):
    """An engine on the CPU in fp32 with blocks for ``max_batch`` sequences of ``max_len`` tokens."""
    from engine import LLMEngine

    blocks_per_seq = -(-max_len // 16)
    return LLMEngine(model=str(model_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
                     block_size=16, num_blocks=max_batch * blocks_per_seq + 8, max_num_seqs=max_batch,
                     max_num_batched_tokens=max(4096, max_batch * max_len))  # fmt: skip


def make_prompts(batch: int, prompt_len: int, vocab: int = 1024, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def engine_step_s(engine, prompts: list[list[int]], steps: int, timer: ForwardTimer | None = None
                  ) -> tuple[float, float]:  # fmt: skip
    """(seconds of one decode step, seconds of it inside the model when ``timer`` wraps the engine's model,
    else 0), means over ``steps`` steps with all of ``prompts`` decoding; they are drained afterwards."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while len(engine.step()) < len(prompts):  # prefill (chunks) until every sequence decodes
        pass
    engine.step()  # one untimed decode step
    in_model = timer.seconds if timer else 0.0
    start = CLOCK()
    for _ in range(steps):
        engine.step()
    elapsed = CLOCK() - start
    in_model = (timer.seconds if timer else 0.0) - in_model
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps, in_model / steps


def transformers_step_s(model, prompts: list[list[int]], steps: int) -> float:
    """Mean seconds of one greedy decode step of a transformers causal LM with its dynamic cache."""
    from transformers import DynamicCache

    # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns, then goes)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache()}
    with torch.inference_mode():
        out = model(input_ids=torch.tensor(prompts), use_cache=True, **cache)
        next_ids = out.logits[:, -1:].argmax(-1)
        for step in range(steps + 1):  # the first decode step untimed, as the engine's
            if step == 1:
                start = CLOCK()
            out = model(input_ids=next_ids, use_cache=True, **cache)
            next_ids = out.logits[:, -1:].argmax(-1)
        return (CLOCK() - start) / steps


class ForwardTimer:
    """Wraps an engine model: adds up the seconds spent in its forward and ``compute_logits`` calls."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        return self._timed(self.model, *args, **kwargs)

    def compute_logits(self, hidden):
        return self._timed(self.model.compute_logits, hidden)

    def _timed(self, fn, *args, **kwargs):
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += CLOCK() - start

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def attention_vs_sdpa_s(batch: int, length: int, repeats: int = 20) -> tuple[float, float]:
    """(reference paged decode attention, SDPA over the same tokens gathered contiguously) seconds per call,
    with the tiny model's heads (4 query, 2 KV, dim 16) and 16-token blocks, each sequence ``length`` long."""
    import torch.nn.functional as F

    from kvkernels import reference

    heads, kv_heads, dim, block = 4, 2, 16, 16
    blocks_per_seq = -(-length // block)
    k_cache = torch.randn(batch * blocks_per_seq, block, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch, heads, dim)
    k = k_cache[tables.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()  # (batch, kv, len, dim)
    v = v_cache[tables.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()

    def paged():
        reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)

    def sdpa():
        F.scaled_dot_product_attention(q[:, :, None], k, v, scale=dim**-0.5, enable_gqa=True)

    times = {paged: [], sdpa: []}
    for _ in range(repeats):
        for fn in times:
            start = CLOCK()
            fn()
            times[fn].append(CLOCK() - start)
    return statistics.median(times[paged]), statistics.median(times[sdpa])


def run(model_dir: str | Path, batch_sizes: list[int], prompt_len: int, steps: int, rounds: int
        ) -> list[dict[str, float]]:  # fmt: skip
    """Per batch size, medians over ``rounds`` alternating rounds: engine and transformers seconds per step,
    the engine's seconds per step inside its model, and its host seconds per sequence per step."""
    from transformers import AutoModelForCausalLM

    engine = make_engine(model_dir, max(batch_sizes), prompt_len + steps + 3)
    timer = engine.runner.model = ForwardTimer(engine.runner.model)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = []
    for batch in batch_sizes:
        prompts = make_prompts(batch, prompt_len, seed=batch)
        engine_s, model_s, host_s, hf_s = [], [], [], []
        for r in range(rounds):
            for side in ("engine", "hf") if r % 2 == 0 else ("hf", "engine"):
                if side == "hf":
                    hf_s.append(transformers_step_s(hf, prompts, steps))
                    continue
                step, in_model = engine_step_s(engine, prompts, steps, timer)
                engine_s.append(step)
                model_s.append(in_model)
                host_s.append((step - in_model) / batch)
        med = statistics.median
        rows.append(dict(batch=batch, engine_s=med(engine_s), hf_s=med(hf_s), model_s=med(model_s),
                         host_per_seq_s=med(host_s)))  # fmt: skip
    return rows
