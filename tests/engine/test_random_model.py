"""Random models of real shapes (what the GPU machine runs) and token-id-only engines (skip_tokenizer_init).

The engine's outputs on such a model are checked against transformers in ``test_engine_device.py``.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def qwen2_llm(random_qwen2_dir):
    return LLM(str(random_qwen2_dir), skip_tokenizer_init=True, block_size=16, num_blocks=64)


def test_random_qwen2_has_the_real_shape(qwen2_llm):
    config = qwen2_llm.engine.model_config
    assert (config.architecture, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "Qwen2ForCausalLM", 896, 14, 2, 64,
    )  # fmt: skip
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings, config.attention_bias) == (
        151936, 1e6, True, True,
    )  # fmt: skip
    assert config.num_layers == 2


def test_without_tokenizer_text_inputs_are_refused(random_qwen2_dir, qwen2_llm):
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLM(str(random_qwen2_dir), block_size=16, num_blocks=64)
    with pytest.raises(ValueError, match="send token ids, not text"):
        qwen2_llm.generate("hello")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        qwen2_llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        qwen2_llm.chat([{"role": "user", "content": "hi"}])
    assert qwen2_llm.engine.block_manager.num_free_blocks == qwen2_llm.engine.runner.num_blocks


def test_skip_tokenizer_init_gives_the_same_tokens(llm, engine_prompts):
    """The bundled model with and without its tokenizer: same tokens, no text."""
    bare = LLM("default", skip_tokenizer_init=True, block_size=16, num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=8)
    for prompt in engine_prompts[:3]:
        (with_text,) = llm.generate([prompt], params)
        (without,) = bare.generate([prompt], params)
        assert without.token_ids == with_text.token_ids
        assert with_text.text and without.text == ""


def test_unknown_shape_is_refused(tmp_path):
    from kvserve.testing.random_model import write_random_model

    with pytest.raises(ValueError, match="unknown model shape 'gpt-9'"):
        write_random_model(tmp_path, "gpt-9")
