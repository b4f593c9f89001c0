"""``compile_decode``: one sequence's decode steps run through ``torch.compile`` (``engine.models.compiled_decode``'s
``CompiledDecode``). Here, not in tests/engine/, because inductor starts the C++ compiler.

The compiled step sums in other orders than the eager one (fused loops, its own reductions), so its greedy
tokens are compared with transformers', as every engine path's are; and once compiled at start, growing
sequences never compile again (a recompile would stall a request for seconds)."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE, greedy
from torch._dynamo.utils import counters

from engine import LLMEngine


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """One engine for the module: compiling takes 10-40 s."""
    return LLMEngine(model="default", device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=256,
                     max_num_seqs=8, compile_decode=True)  # fmt: skip


def _run_alone(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request(prompt, greedy())
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.finished), tokens)
    return tokens


def test_one_sequence_decodes_compiled_and_gives_transformers_tokens(engine, engine_prompts, hf_greedy):
    compiled = engine.runner.model.compiled
    assert compiled is not None and compiled.compile_s > 0
    frames = counters["stats"]["unique_graphs"]
    calls, heads = [], []
    real_layer, real_logits = compiled.layer, compiled.logits
    compiled.layer = lambda *args: calls.append(1) or real_layer(*args)
    compiled.logits = lambda *args: heads.append(1) or real_logits(*args)
    try:
        for prompt, want in zip(engine_prompts, hf_greedy, strict=True):
            assert _run_alone(engine, prompt) == want, f"prompt of {len(prompt)} tokens"
    finally:
        compiled.layer, compiled.logits = real_layer, real_logits
    layers = engine.model_config.num_layers
    decode_steps = sum(len(w) - 1 for w in hf_greedy)  # (each first token comes from the prefill)
    assert len(calls) == decode_steps * layers  # every decode step ran compiled
    assert len(heads) == sum(len(w) for w in hf_greedy)  # every token's logits too, the prefill's first included
    assert counters["stats"]["unique_graphs"] == frames, "a decode step compiled again after the start"


def test_decode_steps_run_the_compiled_code_past_dynamos_guards(engine, engine_prompts):
    """``GuardsOnce``: once each layer's kinds of call are known (the start's warm-up steps and the test above),
    a decode step evaluates no guards; the tokens are checked against transformers above."""
    engine.add_request(engine_prompts[0], greedy())
    for _ in range(3):  # the prefill, then decode steps
        engine.step()
    with torch.profiler.profile() as profile:
        engine.step()
    names = [event.name for event in profile.events()]
    assert any(name.startswith("## Call CompiledFxGraph") for name in names)  # (the step did run compiled)
    assert "TorchDynamo Cache Lookup" not in names
    while engine.has_unfinished_requests():
        engine.step()


def test_a_batch_of_several_decodes_eagerly_with_the_same_tokens(engine, engine_prompts, hf_greedy, monkeypatch):
    def refuse(*args):
        raise AssertionError("a batch of 4 ran compiled")

    monkeypatch.setattr(engine.runner.model.compiled, "layer", refuse)
    monkeypatch.setattr(engine.runner.model.compiled, "logits", refuse)
    ids = [engine.add_request(p, greedy()) for p in engine_prompts[:4]]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [done[i] for i in ids] == hf_greedy[:4]
