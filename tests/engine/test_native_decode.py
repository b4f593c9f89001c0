"""``NativeDecode`` (``engine.models.native_decode``): one sequence's decode step through every layer in one C
call, against the eager PyTorch layers (checked against transformers by every engine test) on the same KV.

Four layouts, each with the switch it tests drawn at random so that skipping it changes the answer: the bundled
Llama (SmolLM2), Qwen2's q/k/v biases, Qwen3's q and k head norms, and Phi-4-mini's partial rotary over a head
width and an MLP width that are no multiples of the kernel's 16 lanes. The weights are packed in three streams
(products split unevenly), read by one, two and three threads. The C step sums in other orders than the eager
one, so logits and the stored K/V are compared within a tolerance, the greedy token exactly; the rest of the
pool must be untouched, bit for bit."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE, KV_TOLERANCE, forward_tokens, token_meta

from engine import LLMEngine
from engine.models.native_decode import NativeDecode, refusal
from kvserve.testing.random_model import write_random_model

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)  # fmt: skip
LAYOUTS = {  # what each adds to the bundled Llama's layers
    "qwen2 (q/k/v biases)": ("qwen2-tiny", dict(TINY)),
    "qwen3 (q and k head norms)": ("qwen3-0.6b", dict(TINY, head_dim=32)),
    "phi3 (partial rotary, heads of 24)": ("phi-3-mini", dict(TINY, hidden_size=96, partial_rotary_factor=0.75,
                                                               sliding_window=None, rope_scaling=None,
                                                               intermediate_size=100)),  # (no multiple of 16)
}  # fmt: skip
TABLE = [5, 2, 9, 0, 12]  # blocks of 16, out of order


@pytest.fixture(scope="module", params=["llama (bundled)", *LAYOUTS])
def engine(request, tmp_path_factory) -> LLMEngine:
    model = "default"
    if request.param in LAYOUTS:
        like, overrides = LAYOUTS[request.param]
        model = str(write_random_model(tmp_path_factory.mktemp("native"), like, dtype=torch.float32,
                                       overrides=overrides))  # fmt: skip
    return LLMEngine(model=model, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=16,
                     max_num_seqs=2, skip_tokenizer_init=True)  # fmt: skip


def _built_on_three_threads(runner) -> NativeDecode:
    """A step whose weights are packed in three streams (a process of three threads): products split unevenly."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        native = NativeDecode(runner.model, runner.kv_cache.layers)
    finally:
        torch.set_num_threads(threads)
    assert len(native.streams) == 3
    return native


def _pool(engine: LLMEngine) -> list[torch.Tensor]:
    return [t.clone() for kv in engine.runner.kv_cache.layers for t in (kv.k_cache, kv.v_cache)]


def _restore(engine: LLMEngine, pool: list[torch.Tensor]) -> None:
    caches = [t for kv in engine.runner.kv_cache.layers for t in (kv.k_cache, kv.v_cache)]
    for cache, saved in zip(caches, pool, strict=True):
        cache.copy_(saved)


def _native_logits(engine: LLMEngine, native: NativeDecode, token: int, position: int) -> torch.Tensor:
    runner, model = engine.runner, engine.runner.model
    meta = token_meta(runner, position, position + 1, TABLE)
    x = model.model.embed_tokens.weight[torch.tensor([token])]
    cos_sin = model.ropes["global"](torch.tensor([position]))
    return model.compute_logits(native(x, cos_sin, runner.kv_cache.layers, meta))


@pytest.mark.parametrize("prompt_len", [0, 37, 70])  # attention over 1 token, 2 and 3 chunks of 32 (the last short)
def test_a_step_gives_the_eager_layers_logits_and_kv(engine, prompt_len):
    runner, vocab = engine.runner, engine.model_config.vocab_size
    assert refusal(runner.model, runner.kv_cache.layers) is None
    native = _built_on_three_threads(runner)
    prompt = torch.randint(3, vocab, (prompt_len + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        if prompt_len:
            forward_tokens(runner, prompt[:-1], 0, TABLE)
        before = _pool(engine)
        want = forward_tokens(runner, prompt[-1:], prompt_len, TABLE)[0]
        eager_pool = _pool(engine)
        _restore(engine, before)
        got = _native_logits(engine, native, prompt[-1], prompt_len)[0]
        native_pool = _pool(engine)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        assert int(got.argmax()) == int(want.argmax())
        slot = TABLE[prompt_len // BLOCK_SIZE], prompt_len % BLOCK_SIZE
        for saved, eager, written in zip(before, eager_pool, native_pool, strict=True):
            torch.testing.assert_close(written[slot], eager[slot], rtol=0,
                                       atol=KV_TOLERANCE * float(eager[slot].abs().max()))  # (engine_testing's)
            assert not torch.equal(eager[slot], saved[slot])  # (the eager step did write it)
            written[slot] = saved[slot]
            assert torch.equal(written, saved), "the C step wrote outside the new token's slot"
        _restore(engine, before)  # each thread count (one stream each or several) sums each row in one order
        threads = torch.get_num_threads()
        try:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                _restore(engine, before)
                assert torch.equal(_native_logits(engine, native, prompt[-1], prompt_len)[0], got), count
        finally:
            torch.set_num_threads(threads)


def test_a_slot_outside_the_pool_raises_and_writes_nothing(engine):
    runner = engine.runner
    native = NativeDecode(runner.model, runner.kv_cache.layers)
    before = _pool(engine)
    meta = token_meta(runner, 0, 1, TABLE)
    meta.slot_mapping.fill_(16 * BLOCK_SIZE)  # one past the last slot
    x = runner.model.model.embed_tokens.weight[:1]
    with pytest.raises(IndexError, match="outside the pool"):
        native(x, runner.model.ropes["global"](torch.tensor([0])), runner.kv_cache.layers, meta)
    assert all(torch.equal(a, b) for a, b in zip(_pool(engine), before, strict=True))


def test_it_runs_only_over_the_kv_layers_it_was_built_for(engine):
    runner = engine.runner
    native = NativeDecode(runner.model, runner.kv_cache.layers)
    with pytest.raises(ValueError, match="KV layers it was built for"):
        native(runner.model.model.embed_tokens.weight[:1], runner.model.ropes["global"](torch.tensor([0])),
               list(runner.kv_cache.layers), token_meta(runner, 0, 1, TABLE))  # fmt: skip
