"""Cache-aware routing: which decode worker and which prefill worker serve a prompt.

Each candidate costs ``block_weight`` per prompt block it would have to compute or receive (the full blocks
it does not already hold, by the Redis prefix index, plus the partial tail), ``host_block_weight`` and
``disk_block_weight`` per leading block it holds only in its host or disk tier (a copy back, cheaper than a
recompute, dearer than a device hit) and ``load_weight`` per request it is already running or holding in
queue. The cheapest wins; with equal cost, the first as given. Past a
load imbalance of ``balance_threshold`` requests between the busiest and the idlest candidate, load alone
decides, so one hot prefix cannot pin all traffic to one worker (SGLang's cache-aware policy does the same).

For the prefill worker the blocks that count are those the decode worker lacks and the prefill worker
cannot take from its own cache (any tier): it writes only what the decode worker lacks, computing from its
own cached point. The index is a hint: a stale entry costs speed, never correctness (workers confirm hits against
their own token ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cluster_state.prefix_index import Held
from cluster_state.workers import WorkerInfo

_NONE = Held()


@dataclass(frozen=True)
class RoutingWeights:
    block_weight: float = 1.0  # one prompt block to compute or move
    host_block_weight: float = 0.1  # one held in the host tier only: copied back (~1/10 of a recompute or less)
    disk_block_weight: float = 0.3  # one held in the disk tier only: read from disk and copied back
    load_weight: float = 8.0  # one request running or queued there: about 8 blocks (128 tokens) of prefill
    balance_threshold: int = 16  # requests of imbalance past which load alone decides

    def __post_init__(self) -> None:
        if min(self.block_weight, self.host_block_weight, self.disk_block_weight, self.load_weight,
               self.balance_threshold) < 0:  # fmt: skip
            raise ValueError(f"routing weights must be >= 0, got {self}")


@dataclass(frozen=True)
class Choice:
    decode: list[WorkerInfo]  # best first
    prefill: str  # worker id, or '' to let the decode worker choose
    reason: str  # "prefix" (the chosen decode worker holds some of the prompt) or "load"
    cached_blocks: int  # of the prompt's full blocks, how many the chosen decode worker holds (any tier)
    costs: dict[str, float] = field(default_factory=dict)  # each candidate's (decode and prefill workers) cost

    def attributes(self, owners: dict[str, Held], num_blocks: int) -> dict[str, object]:
        """The decision as a trace span's attributes: each candidate's cost, the chosen workers, why, and what
        the chosen decode worker holds of the prompt's ``num_blocks`` blocks, by tier."""
        held = owners.get(self.decode[0].worker_id, _NONE) if self.decode else _NONE
        return {"candidates": [f"{worker}: {cost:g}" for worker, cost in sorted(self.costs.items())],
                "decode_worker": self.decode[0].worker_id if self.decode else None,
                "prefill_worker": self.prefill or None, "reason": self.reason, "prompt_blocks": num_blocks,
                "cached_blocks_device": held.device, "cached_blocks_host": held.host, "cached_blocks_disk": held.disk}


def choose(decode: list[WorkerInfo], prefill: list[WorkerInfo], owners: dict[str, Held], num_blocks: int,
           load: Callable[[WorkerInfo], int], weights: RoutingWeights) -> Choice:  # fmt: skip
    """Rank ``decode`` and pick from ``prefill`` for a prompt of ``num_blocks`` blocks (partial tail included);
    ``owners`` maps worker id -> leading full blocks of the prompt it holds, by tier (``PrefixIndex.holdings``);
    ``load`` is a worker's load."""
    if not decode:
        return Choice([], "", "load", 0)
    loads = {w.worker_id: load(w) for w in decode + prefill}
    by_load = _imbalanced([loads[w.worker_id] for w in decode], weights)

    def decode_cost(w: WorkerInfo) -> tuple:
        held = owners.get(w.worker_id, _NONE)
        blocks = 0 if by_load else (weights.block_weight * (num_blocks - held.total) + weights.host_block_weight
                                    * held.host + weights.disk_block_weight * held.disk)  # fmt: skip
        return blocks + weights.load_weight * loads[w.worker_id], -w.free_blocks / max(1, w.total_blocks)

    ranked = sorted(decode, key=decode_cost)
    costs = {w.worker_id: decode_cost(w)[0] for w in decode}
    held = owners.get(ranked[0].worker_id, _NONE).total
    reason = "prefix" if held and not by_load else "load"
    if not prefill:
        return Choice(ranked, "", reason, held, costs)
    prefill_by_load = _imbalanced([loads[w.worker_id] for w in prefill], weights)

    def prefill_cost(w: WorkerInfo) -> tuple:
        lacking = num_blocks - max(held, owners.get(w.worker_id, _NONE).total)
        blocks = 0 if prefill_by_load else weights.block_weight * lacking
        return blocks + weights.load_weight * loads[w.worker_id]

    costs |= {w.worker_id: prefill_cost(w) for w in prefill}
    return Choice(ranked, min(prefill, key=prefill_cost).worker_id, reason, held, costs)


def _imbalanced(loads: list[int], weights: RoutingWeights) -> bool:
    return bool(loads) and max(loads) - min(loads) > weights.balance_threshold
