"""A mixture-of-experts MLP (Qwen3-MoE) without a Python loop over experts.

A step's tokens go through four stages, none of which reads anything back to the host:

1. route: the router's logits, softmax in float32, the top ``k`` experts per token, their probabilities
   renormalised to sum to 1 when the model says so (``norm_topk_prob``), in the model's dtype;
2. group: each token's ``k`` choices are ordered by expert id, and all ``tokens * k`` (token, expert) pairs
   are sorted by expert (stable), so that each expert's tokens form one contiguous run of rows; the runs'
   ends are the cumulative per-expert counts;
3. the experts: two grouped GEMMs over those runs (``torch._grouped_mm``: row run ``e`` times expert ``e``'s
   matrix), SiLU-and-mul between them, each row then scaled by its routing weight;
4. combine: every row goes back to its (token, choice) place and each token sums its ``k`` rows in
   ascending expert order, the order transformers' loop over experts adds them in, so that float32 results
   are the same bits.

The weights are stored as transformers 5 holds them: ``experts.gate_up_proj (experts, 2 * I, hidden)`` and
``experts.down_proj (experts, hidden, I)``; checkpoints with one tensor per expert are stacked by the loader.
"""

from __future__ import annotations

import torch
from torch import nn

import kvkernels
from engine.model_config import ModelConfig
from engine.models.tensor_parallel import Group, all_reduce


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits (tokens, experts)`` -> (weights, expert ids), each ``(tokens, top_k)``, ids ascending
    within each token."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts, order = experts.sort(dim=-1)
    return weights.gather(-1, order).to(router_logits.dtype), experts


class Experts(nn.Module):
    """Every expert's SwiGLU MLP as two stacked weights, run on rows already grouped by expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        num, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inner))

    def forward(self, rows: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
        """``rows (pairs, hidden)`` sorted by expert, expert ``e``'s ending at ``group_ends[e]`` (int32)
        -> ``(pairs, hidden)``."""
        # (a transposed view: the GEMM reads each expert's matrix as F.linear does, so the bits are the same)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=group_ends)  # (pairs, 2 * I)
        return torch._grouped_mm(kvkernels.silu_and_mul(gate_up), self.down_proj.transpose(1, 2), offs=group_ends)


class SparseMoE(nn.Module):
    """Qwen3-MoE's MLP: ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts per token, weighted."""

    def __init__(self, config: ModelConfig, group: Group | None = None) -> None:
        super().__init__()
        self.group = group  # tensor parallel: every expert's slice of its intermediate, the sums all-reduced
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (tokens, hidden)`` -> ``(tokens, hidden)``."""
        tokens, hidden = x.shape
        weights, experts = route(self.gate(x), self.top_k, self.normalize)  # (tokens, top_k) each
        flat = experts.flatten()  # (pairs,), pair p = token p // top_k, its (p % top_k)-th choice
        order = flat.argsort(stable=True)  # pairs grouped by expert, in token order inside a group
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # (experts,) (bincount would read its max back)
        group_ends = counts.cumsum(0).to(torch.int32)
        rows = self.experts(x[order // self.top_k], group_ends)  # (pairs, hidden)
        rows = rows * weights.flatten()[order, None]
        by_choice = torch.empty_like(rows).index_copy_(0, order, rows).view(tokens, self.top_k, hidden)
        out = by_choice[:, 0]
        for choice in range(1, self.top_k):  # k adds (not a loop over experts), in ascending expert order
            out = out + by_choice[:, choice]
        return all_reduce(self.group, out)
