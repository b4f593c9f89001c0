"""Rotary position embeddings: one float32 table of every position's cosines and sines per kind of layer.

The variants the supported families use are all a choice of inverse frequencies (and, for LongRoPE, a scale
on the cosines and sines), fixed when the table is built:

* the base (``rope_theta``), scaled ``linear``-ly or as ``llama3`` does;
* ``longrope`` (Phi-3's long-context variants, Phi-4-mini): short factors for the positions below the
  pre-training length and long factors from it on. transformers switches to the long factors once a
  forward pass reaches a position past that length; with keys cached from earlier steps that is exactly
  a choice by position, whenever the prompt itself fits in the pre-training length;
* partial rotary (Phi-4-mini): only a head's leading ``rotary_dim`` dims turn, so the table is that wide;
* one table per kind of layer (Gemma 3: its local layers turn with their own, unscaled base).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import ModelConfig


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``(dim / 2,)`` of a ``dim``-wide rotation with the config's scaling applied
    (``long``: LongRoPE's long factors instead of its short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3, longrope)")


def longrope_attention_factor(scaling: dict, max_positions: int) -> float:
    """LongRoPE's scale on the cosines and sines: the config's, else sqrt(1 + ln(s) / ln(original))."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE: a float32 table of every position's cosines and sines, looked up once per step."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        """``local``: the table of Gemma 3's local layers (their own base, no scaling)."""
        super().__init__()
        theta = config.local_rope_theta if local else config.rope_theta
        scaling = None if local else config.rope_scaling
        dim, num_positions = config.rotary_dim, config.max_position_embeddings
        with torch.device("cpu"):  # also inside the loader's meta device, where arange would import torch._dynamo
            positions = torch.arange(num_positions, dtype=torch.float32)
            inv_freq = rope_inv_freq(dim, theta, scaling)
            freqs = torch.outer(positions, inv_freq)  # (positions, dim / 2)
            self.scale = 1.0
            if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
                self.scale = longrope_attention_factor(scaling, num_positions)
                inv_freq = rope_inv_freq(dim, theta, scaling, long=True)
                original = scaling["original_max_position_embeddings"]
                freqs[original:] = torch.outer(positions[original:], inv_freq)
            cos_sin = self._cos_sin(freqs)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # the frequencies past the table

    def _cos_sin(self, angles: torch.Tensor) -> torch.Tensor:
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return cos_sin if self.scale == 1.0 else cos_sin * self.scale

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions (tokens,)`` -> ``cos_sin (tokens, rotary_dim)``, the layout ``kvkernels.rotary_embedding``
        takes."""
        return self.cos_sin[positions]

    def at(self, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """``forward`` for positions that may lie past the table (a streaming sequence outlives the model's
        context), ``max_position`` their largest: those rows are computed here, their angles in float64 so
        that a key rotated far out still scores by its distance alone. The table stays as it is (a captured
        decode graph reads it)."""
        if max_position < self.cos_sin.shape[0]:
            return self.cos_sin[positions]
        last = self.cos_sin.shape[0] - 1
        angles = positions.double()[:, None] * self.inv_freq.double()[None, :]  # (tokens, rotary_dim / 2)
        computed = self._cos_sin(angles).float()
        return torch.where((positions > last)[:, None], computed, self.cos_sin[positions.clamp(max=last)])


def rotary_embeddings(config: ModelConfig) -> nn.ModuleDict:
    """The model's tables by layer kind: ``global`` for every layer, and ``local`` for Gemma 3's local layers."""
    tables = {"global": RotaryEmbedding(config)}
    if config.local_rope_layers:
        tables["local"] = RotaryEmbedding(config, local=True)
    return nn.ModuleDict(tables)
