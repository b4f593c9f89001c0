"""Tensor parallelism: one model split across ``size`` ranks, Megatron-style, as vLLM and SGLang split it.

What a rank holds (``Shard``):

* attention: the KV heads of a contiguous range and the query heads of their groups, so that grouped-query
  attention needs no communication; ``qkv_proj`` is column-parallel (its rows), ``o_proj`` row-parallel (its
  columns) and its partial sums are all-reduced;
* the MLP: a contiguous slice of the intermediate dimension, the rows of gate and up and the columns of
  down; a mixture of experts likewise, every expert on its own intermediate dimension, the router whole;
  one all-reduce after it;
* the vocabulary: a contiguous slice of the embedding's rows (a token of another rank's slice embeds to
  zeros there, and the all-reduce sums the one rank's row with zeros: exact) and of the LM head's rows,
  whose logits rank 0 gathers for sampling.

So a layer costs two all-reduces of ``(tokens, hidden)``. The sums run in another order than one rank's
matrix product, so logits differ from a single device's in the last bits (tokens only where two candidates
tie that closely: ``tests/cluster/test_tensor_parallel.py`` shows where).

Splits are as even as possible and need not be equal: the bundled model's 3 KV heads (9 query heads) go
2 + 1 over two ranks, its 1,536-wide MLP 768 + 768. More ranks than KV heads is refused at start-up: a rank
would hold no head (vLLM replicates KV heads then; not done here).

The model's modules hold their rank's ``Group`` (None on one device) and call ``all_reduce`` and
``vocab_embedding`` with it; ``engine.tensor_parallel_ranks`` starts the ranks and makes their group.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.model_config import ModelConfig


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone, or a collective waited past the timeout: the ranks are out of step, and
    the engine cannot go on. A worker ends its process on it, to be restarted whole (``StepError.fatal``)."""


class Group:
    """A rank's process group (gloo on the CPU, NCCL on CUDA) and the collectives the model makes on it."""

    def __init__(self, rank: int, size: int, process_group: dist.ProcessGroup) -> None:
        self.rank, self.size, self.process_group = rank, size, process_group
        self.seconds = 0.0  # spent in collectives so far, waiting for the other ranks included (``bench tp``)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place where ``x`` is contiguous)."""
        began = time.perf_counter()
        x = x.contiguous()
        _wait(self.process_group.allreduce([x]), "all-reduce")
        self.seconds += time.perf_counter() - began
        return x

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        _wait(self.process_group.barrier(), "barrier")

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (all of one shape), in rank order, on rank 0; None on the others."""
        options = dist.GatherOptions()
        options.rootRank = 0
        began = time.perf_counter()
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        _wait(self.process_group.gather(parts, [x.contiguous()], options), "gather")
        self.seconds += time.perf_counter() - began
        return parts[0] if self.rank == 0 else None


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as error:  # (gloo and NCCL: a peer gone, or the timeout)
        raise RankLost(f"tensor parallel {what} failed: {error}") from error


def all_reduce(group: Group | None, x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``x``, or ``x`` itself without a group (one device)."""
    return x if group is None else group.all_reduce(x)


def vocab_embedding(group: Group | None, weight: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Rows of ``ids`` from a slice of the embedding that begins at token ``start`` (the whole of it without a
    group): tokens outside the slice embed to zeros here, and the all-reduce adds the rank that holds them."""
    if group is None:
        return F.embedding(ids, weight)
    local = ids - start
    held = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(torch.where(held, local, 0), weight) * held[:, None].to(weight.dtype)
    return group.all_reduce(rows)


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` of ``n`` things in ``parts`` parts as even as possible, the larger
    parts first."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``'s part of a model: ranges of KV heads, query heads, the MLP's (and the
    experts') intermediate dimension and the vocabulary."""

    rank: int
    size: int
    full: ModelConfig
    kv_heads: tuple[int, int]
    heads: tuple[int, int]
    intermediate: tuple[int, int]
    moe_intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> Shard:
        check(config, size)
        kv = split(config.num_kv_heads, size, rank)
        group = config.num_heads // config.num_kv_heads
        return cls(rank, size, config, kv, (kv[0] * group, kv[1] * group),
                   split(config.intermediate_size, size, rank), split(config.moe_intermediate_size, size, rank),
                   split(config.vocab_size, size, rank))  # fmt: skip

    @property
    def vocab_slice(self) -> int:
        """The widest rank's vocabulary slice: every rank's logits are padded to it for the gather."""
        return -(-self.full.vocab_size // self.size)

    def config(self) -> ModelConfig:
        """The shape of this rank's model: its heads, intermediate width and vocabulary slice."""
        width = lambda r: r[1] - r[0]  # noqa: E731
        return dataclasses.replace(
            self.full, num_heads=width(self.heads), num_kv_heads=width(self.kv_heads),
            intermediate_size=width(self.intermediate), moe_intermediate_size=width(self.moe_intermediate),
            vocab_size=width(self.vocab),
        )  # fmt: skip

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of checkpoint tensor ``name`` (Hugging Face's names; a fused tensor is cut part
        by part). A row-parallel bias stays on rank 0 alone (the all-reduce adds it once)."""
        c, d = self.full, self.full.head_dim
        heads, kv = (self.heads[0] * d, self.heads[1] * d), (self.kv_heads[0] * d, self.kv_heads[1] * d)
        q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
        rule = next((r for pattern, r in _RULES if pattern.search(name)), None)
        if rule is None:
            return tensor
        if rule == "q":
            return tensor[heads[0] : heads[1]]
        if rule == "kv":
            return tensor[kv[0] : kv[1]]
        if rule == "qkv":  # (q + 2 kv, ...) fused
            q, k, v = tensor.split([q_size, kv_size, kv_size])
            return torch.cat([q[heads[0] : heads[1]], k[kv[0] : kv[1]], v[kv[0] : kv[1]]])
        if rule == "o":
            return tensor[:, heads[0] : heads[1]]
        if rule == "row-bias":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if rule in ("up", "gate_up", "down"):
            moe = ".experts." in name
            lo, hi = self.moe_intermediate if moe else self.intermediate
            if rule == "up":  # (I, hidden) or an expert's
                return tensor[lo:hi]
            if rule == "down":  # (hidden, I), or (experts, hidden, I) stacked
                return tensor[..., lo:hi]
            # gate then up, fused: (2 I, hidden), or (experts, 2 I, hidden) stacked
            gate, up = tensor.chunk(2, dim=-2)
            return torch.cat([gate[..., lo:hi, :], up[..., lo:hi, :]], dim=-2)
        assert rule == "vocab"
        return tensor[self.vocab[0] : self.vocab[1]]


# checkpoint tensor name -> how it is cut (first match); names of no rule are held whole by every rank (norms,
# the MoE router ``mlp.gate.weight``)
_RULES = tuple((re.compile(pattern), rule) for pattern, rule in (
    (r"\.q_proj\.(weight|bias)$", "q"),
    (r"\.[kv]_proj\.(weight|bias)$", "kv"),
    (r"\.qkv_proj\.(weight|bias)$", "qkv"),
    (r"\.o_proj\.weight$", "o"),
    (r"\.(o_proj|down_proj)\.bias$", "row-bias"),
    (r"\.(gate_proj|up_proj)\.(weight|bias)$", "up"),
    (r"\.gate_up_proj(\.weight|\.bias)?$", "gate_up"),
    (r"\.down_proj(\.weight)?$", "down"),
    (r"(embed_tokens|lm_head)\.weight$", "vocab"),
))  # fmt: skip


def check(config: ModelConfig, size: int) -> None:
    """Refuse a ``tensor_parallel_size`` this model cannot be split into, naming the option."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if size > config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is more than this model's {config.num_kv_heads} KV heads: "
                         "a rank would hold no attention head (use at most that many ranks)")  # fmt: skip
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"this model's {config.num_heads} query heads are not whole groups of its "
                         f"{config.num_kv_heads} KV heads: it cannot be split by heads")  # fmt: skip


def gather_logits(group: Group, local: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """Every rank's logits ``(rows, its vocabulary slice)`` joined on rank 0 into ``(rows, vocab)`` (None
    on the other ranks)."""
    width = shard.vocab_slice
    parts = group.gather(local if local.shape[1] == width else F.pad(local, (0, width - local.shape[1])))
    if parts is None:
        return None
    widths = [hi - lo for lo, hi in (split(shard.full.vocab_size, shard.size, r) for r in range(shard.size))]
    return torch.cat([part[:, :width] for part, width in zip(parts, widths, strict=True)], dim=1)
