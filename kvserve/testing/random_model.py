"""Randomly initialised models of real shapes: ``kvserve model random --like qwen2-0.5b --out DIR``.

The GPU machine cannot download weights, and the bundled model's shape is not
what GPU serving is tuned for. A random model with a real model's config is
enough to check the engine's kernels on a device (the same arithmetic runs
whatever the weights) and to time it, and Hugging Face transformers loads the
same directory as the peer to compare with. There is no tokenizer: run the
engine with ``skip_tokenizer_init=True`` and token-id prompts.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes from the published config.json of Qwen2-0.5B-Instruct and Llama-3.2-1B; ``qwen2-tiny`` is a Qwen2 of
# width 64 and 2 layers whose step is mostly host work (``kvserve bench offline --tiny``).
PRESETS: dict[str, dict] = {
    "qwen2-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),  # fmt: skip
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}
# The newer families, from the published config.json of Qwen3-0.6B, gemma-3-1b-it, Phi-3-mini-4k-instruct and
# Qwen3-30B-A3B (the smallest Qwen3-MoE: 30B parameters in 48 layers; ``num_layers`` makes it fit a machine).
PRESETS.update({
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "gemma-3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       max_position_embeddings=32768, query_pre_attn_scalar=256, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0, sliding_window=512, sliding_window_pattern=6,
                       rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                       pad_token_id=0, bos_token_id=2, eos_token_id=[1, 106]),
    "phi-3-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0,
                       sliding_window=2047, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=32000,
                       bos_token_id=1, eos_token_id=32000),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
})  # fmt: skip
PRESETS["qwen2-tiny"] = {  # Qwen2's layout, shrunk; no special token ids (those would be past its vocabulary)
    **{key: value for key, value in PRESETS["qwen2-0.5b"].items() if not key.endswith("token_id")},
    **dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=4096),
}  # fmt: skip
# Mistral v0.1's layout (a sliding window in every layer), shrunk: the window is what it tests
PRESETS["mistral-tiny"] = dict(model_type="mistral", vocab_size=1024, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                               sliding_window=16, tie_word_embeddings=False)  # fmt: skip


def write_random_model(
    out_dir: str | Path,
    like: str,
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str | torch.device = "cpu",
    overrides: dict | None = None,
) -> Path:
    """Write a safetensors model directory shaped like preset ``like`` with seeded random weights.

    ``num_layers`` overrides the depth (tests use a few layers; every layer has
    the real width); ``overrides`` sets any other config.json field (a sliding window, a shorter context).
    Matrices are drawn with transformers' own initialisation on
    ``device`` (a GPU makes the draw fast); norm weights ~ N(1, 0.1) and biases
    ~ N(0, 0.1), so that neither is a no-op. Saved in ``dtype``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if like not in PRESETS:
        raise ValueError(f"unknown model shape {like!r}; choose one of {', '.join(PRESETS)}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    settings = dict(PRESETS[like])
    if num_layers is not None:
        settings["num_hidden_layers"] = num_layers
    settings.update(overrides or {})
    config = AutoConfig.for_model(**settings)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0, which would hide their code paths
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
