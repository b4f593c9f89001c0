"""Load a Hugging Face safetensors checkpoint into ``CausalLM``, fusing q/k/v and gate/up on the way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model import CausalLM

# checkpoint name part -> (our fused parameter, index of the shard inside it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    return files


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the checkpoint."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = type(model.rope)(config).to(device)  # buffers were left empty on the meta device
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target, shard = _target(name)
                if target not in params:
                    if "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.architecture} model")
                _copy_into(params[target], f.get_tensor(name), shard, config)
                loaded.add(target)
    missing = set(params) - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {path} lacks {sorted(missing)[:5]}")
    return model.eval()


def _target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, config: ModelConfig) -> None:
    with torch.no_grad():
        if shard is None:
            param.copy_(tensor)
            return
        if param.shape[0] == 2 * config.intermediate_size:  # gate_up
            sizes = [config.intermediate_size] * 2
        else:  # qkv
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            sizes = [q, kv, kv]
        start = sum(sizes[:shard])
        param[start : start + sizes[shard]].copy_(tensor)
