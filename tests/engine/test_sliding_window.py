"""Sliding-window models (Mistral v0.1, Qwen2 with ``use_sliding_window``) attend exactly over their window
through the ring of blocks (``kvstore.ring``, no sinks), token for token as transformers does, past the window
and with flat memory; their context is the model's positions, no longer capped at the window."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from kvserve.testing.random_model import write_random_model
from kvstore.ring import RingSpec

BLOCK = 4


def _write(tmp_path_factory, like: str, **overrides):
    path = tmp_path_factory.mktemp(like)
    return write_random_model(path, like, dtype=torch.float32, overrides={"initializer_range": 0.1, **overrides})


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """Mistral's layout with a window of 16 in both layers."""
    return _write(tmp_path_factory, "mistral-tiny")


@pytest.fixture(scope="module")
def qwen2_mixed_dir(tmp_path_factory):
    """Qwen2 with use_sliding_window: a window of 12 from layer max_window_layers=1 on (layer 0 sees everything)."""
    return _write(tmp_path_factory, "qwen2-tiny", use_sliding_window=True, sliding_window=12, max_window_layers=1)


@torch.inference_mode()
def hf_greedy(path, prompt: list[int], num_new_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a forward over the whole sequence (no cache of any kind)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = list(prompt)
    for _ in range(num_new_tokens):
        tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_the_config_names_the_sliding_layers_and_the_context_is_not_capped(mistral_dir, qwen2_mixed_dir, model_dir):
    mistral, mixed = ModelConfig.from_dir(mistral_dir), ModelConfig.from_dir(qwen2_mixed_dir)
    assert (mistral.sliding_window, mistral.sliding_window_layers, mistral.slides_every_layer) == (16, (0, 1), True)
    assert (mixed.sliding_window, mixed.sliding_window_layers, mixed.slides_every_layer) == (12, (1,), False)
    assert mistral.max_context == mixed.max_context == 4096  # was min(positions, window)
    assert ModelConfig.from_dir(model_dir).sliding_window is None


@pytest.mark.parametrize("budget", [4096, 10], ids=["one-chunk", "chunked"])
def test_mistral_matches_transformers_past_its_window_with_flat_memory(mistral_dir, budget):
    llm = LLM(str(mistral_dir), skip_tokenizer_init=True, block_size=BLOCK, num_blocks=64,
              max_num_batched_tokens=budget)  # fmt: skip
    engine, ring = llm.engine, RingSpec(0, 16, BLOCK)
    prompts = [_prompt(30, 1), _prompt(50, 2)]
    ids = [engine.add_request(p, _greedy(30)) for p in prompts]
    final, held = {}, 0
    while engine.has_unfinished_requests():
        held = max([held] + [len(engine.block_manager.block_table(i)) for i in ids])
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    assert held == ring.max_blocks  # 80 tokens, 6 blocks of 4 (window 16, chunks of 4)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert final[rid].token_ids == hf_greedy(mistral_dir, prompt, 30)


def test_qwen2_slides_only_from_max_window_layers(qwen2_mixed_dir):
    """Layer 0 attends over every token and layer 1 over its window, so no block is reused (layer 0 needs
    them all) and the answer is transformers'."""
    llm = LLM(str(qwen2_mixed_dir), skip_tokenizer_init=True, block_size=BLOCK, num_blocks=64)
    prompt = _prompt(40, 3)
    [out] = llm.generate([prompt], _greedy(20))
    assert out.token_ids == hf_greedy(qwen2_mixed_dir, prompt, 20)
    assert llm.engine.ring_for(_greedy(1)).max_blocks > 64  # a window over a full table: nothing recycled


def test_streaming_options_on_a_sliding_window_model_are_refused(mistral_dir):
    llm = LLM(str(mistral_dir), skip_tokenizer_init=True, block_size=BLOCK, num_blocks=64)
    with pytest.raises(ValueError, match="sliding window of 16 tokens already"):
        llm.generate([[1, 2, 3]], SamplingParams(streaming_window=32))
    with pytest.raises(ValueError, match="sliding window of 16 tokens already"):
        LLM(str(mistral_dir), skip_tokenizer_init=True, block_size=BLOCK, num_blocks=64, streaming_window=32)
