"""Load a Hugging Face safetensors checkpoint into ``CausalLM``, fusing tensors on the way.

Our fused parameters and the checkpoint tensors that fill them (a checkpoint may hold the fused tensor
itself, as Phi-3's and transformers 5's do):

* ``self_attn.qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj`` (weights and biases), stacked by rows;
* ``mlp.gate_up_proj``: ``gate_proj`` then ``up_proj``;
* ``mlp.experts.gate_up_proj (experts, 2 * I, hidden)`` and ``mlp.experts.down_proj (experts, hidden, I)``:
  ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``, one per expert (Qwen3-MoE's checkpoints).

Every parameter must be filled whole and every tensor must have a place: a checkpoint tensor of no place,
of the wrong shape, or a part no tensor filled is a ``ValueError`` that names it. Gemma's norm weights are
stored as ``w`` for a scale of ``1 + w``: the loader adds the model's ``norm_weight_offset`` (in float32).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models.model import CausalLM
from engine.models.rotary import rotary_embeddings
from engine.models.tensor_parallel import Group, Shard

# a checkpoint tensor that fills part of a fused parameter: its name's pattern (groups: module, expert or "",
# part) -> the parameter's name
_PARTS = (
    (re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj)\.weight$"), r"\1.experts.gate_up_proj"),
    (re.compile(r"(.*)\.experts\.(\d+)\.(down_proj)\.weight$"), r"\1.experts.down_proj"),
    (re.compile(r"(.*)\.()(q_proj|k_proj|v_proj)\.(weight|bias)$"), r"\1.qkv_proj.\4"),
    (re.compile(r"(.*)\.()(gate_proj|up_proj)\.(weight|bias)$"), r"\1.gate_up_proj.\4"),
)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    return files


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               shard: Shard | None = None, group: Group | None = None) -> CausalLM:  # fmt: skip
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the checkpoint; with ``shard``,
    this tensor-parallel rank's part only (``shard.cut`` of each tensor: a rank never holds the whole)."""
    if shard is not None:
        config = shard.config()
    with torch.device("meta"):
        model = CausalLM(config, group, shard.vocab[0] if shard is not None else 0)
    # Storage without initial values, every float tensor in ``dtype``. (``Module.to_empty`` does the same through
    # the meta device's reference ops, which import sympy: 0.4-0.8 s of every worker's start.)
    model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.ropes = rotary_embeddings(config).to(device)  # buffers were left empty on the meta device
    params = dict(model.named_parameters())
    filled: dict[str, set[str]] = {}  # parameter -> the parts of it filled ("" for the whole)
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target, part = _target(name, params)
                if target is None:
                    if "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.architecture} model")
                slices = _part_slices(target, config)
                if part and part not in slices:  # (an expert past the model's)
                    raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.architecture} model")
                tensor = f.get_tensor(name) if shard is None else shard.cut(name, f.get_tensor(name))
                if config.norm_weight_offset and name.endswith("norm.weight"):
                    tensor = tensor.float() + config.norm_weight_offset
                _copy_into(params[target][slices[part] if part else ()], tensor, name, config)
                filled.setdefault(target, set()).add(part)
    missing = [name for target in params for name in _unfilled(target, filled.get(target), config)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint in {path} lacks {', '.join(missing[:5])}{more}")
    return model.eval()


def _target(name: str, params: dict) -> tuple[str | None, str]:
    """(our parameter, the part of it ``name`` fills: "" for all of it, else e.g. "k_proj" or "3.up_proj")."""
    if name in params:
        return name, ""
    for pattern, fused in _PARTS:
        match = pattern.match(name)
        if match and match.expand(fused) in params:
            expert, part = match.group(2), match.group(3)
            return match.expand(fused), f"{expert}.{part}" if expert else part
    return None, ""


def _part_slices(target: str, config: ModelConfig) -> dict[str, tuple]:
    """Index into fused parameter ``target`` of each of its parts (empty for a plain parameter)."""
    if target.endswith(".experts.gate_up_proj"):  # (experts, 2 * I, hidden)
        size = config.moe_intermediate_size
        return {f"{e}.{part}": (e, slice(j * size, (j + 1) * size)) for e in range(config.num_experts)
                for j, part in enumerate(("gate_proj", "up_proj"))}  # fmt: skip
    if target.endswith(".experts.down_proj"):  # (experts, hidden, I)
        return {f"{e}.down_proj": (e,) for e in range(config.num_experts)}
    if ".qkv_proj." in target:  # (q + 2 * kv, hidden)
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return {"q_proj": (slice(0, q),), "k_proj": (slice(q, q + kv),), "v_proj": (slice(q + kv, q + 2 * kv),)}
    if ".gate_up_proj." in target:  # (2 * I, hidden)
        size = config.intermediate_size
        return {"gate_proj": (slice(0, size),), "up_proj": (slice(size, 2 * size),)}
    return {}


def _unfilled(target: str, parts: set[str] | None, config: ModelConfig) -> list[str]:
    """Checkpoint names of what no tensor filled of ``target``."""
    if parts is not None and "" in parts:
        return []
    slices = _part_slices(target, config)
    if not slices or not parts:
        return [target]
    if ".experts." in target:
        return [f"{target.rsplit('.', 1)[0]}.{part}.weight" for part in slices if part not in parts]
    module, _, suffix = target.rsplit(".", 2)
    return [f"{module}.{part}.{suffix}" for part in slices if part not in parts]


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str, config: ModelConfig) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; this "
                         f"{config.architecture} model needs {tuple(param.shape)}")  # fmt: skip
    with torch.no_grad():
        param.copy_(tensor)
