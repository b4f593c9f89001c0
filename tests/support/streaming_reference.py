"""An independent StreamingLLM: transformers' own modules, one token at a time, over a cache built by hand.

This is StreamingLLM as its paper describes it, not as the engine does it: the cache keeps each layer's keys
*before* rotation and its values, for the first ``sinks`` tokens and the last ``window`` ones (the token being
computed included); every step it rotates the kept keys at their positions *inside the cache* (0, 1, 2, ...)
and the query at the last one, with transformers' rotary embedding and ``apply_rotary_pos_emb``. No paged
pool, no ring of blocks, no absolute positions, no kernel of ours.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@torch.inference_mode()
def streaming_greedy(model, prompt: list[int], num_new_tokens: int, sinks: int, window: int) -> list[int]:
    """Greedy tokens of a Llama-family transformers ``model`` (float32) continuing ``prompt`` with a cache of
    ``sinks`` + ``window`` tokens (``sinks=0, window=W``: a plain sliding window, kept the same way)."""
    config = model.config
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    layers = model.model.layers
    keys: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer, per position: unrotated (kv_heads, dim)
    values: list[list[torch.Tensor]] = [[] for _ in layers]
    tokens, out = list(prompt), []
    for t in range(len(prompt) + num_new_tokens - 1):
        kept = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))
        cache_positions = torch.arange(len(kept))[None]  # (1, kept): where each kept token sits in the cache
        x = model.model.embed_tokens(torch.tensor([[tokens[t]]]))  # (1, 1, hidden)
        cos, sin = model.model.rotary_emb(x, cache_positions)  # (1, kept, dim)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, 1, num_heads, head_dim).transpose(1, 2)  # (1, heads, 1, dim)
            keys[i].append(attn.k_proj(h).view(num_kv_heads, head_dim))
            values[i].append(attn.v_proj(h).view(num_kv_heads, head_dim))
            k = torch.stack([keys[i][p] for p in kept], dim=1)[None]  # (1, kv_heads, kept, dim)
            v = torch.stack([values[i][p] for p in kept], dim=1)[None]
            q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])  # the query: the cache's last position
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
            probs = torch.softmax((q @ k.transpose(-1, -2)) * head_dim**-0.5, dim=-1)  # (1, heads, 1, kept)
            attended = (probs @ v).transpose(1, 2).reshape(1, 1, num_heads * head_dim)
            x = x + attn.o_proj(attended)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if t >= len(prompt) - 1:
            token = int(model.lm_head(model.model.norm(x))[0, -1].argmax())
            out.append(token)
            tokens.append(token)
    return out
