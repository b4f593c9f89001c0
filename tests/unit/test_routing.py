"""Cache-aware routing decisions (router.routing.choose): prefix against load, the balance threshold."""

from __future__ import annotations

import pytest

from cluster_state.prefix_index import Held
from cluster_state.workers import WorkerInfo
from router.routing import RoutingWeights, choose


def _workers(role: str, loads: dict[str, int]) -> tuple[list[WorkerInfo], dict[str, int]]:
    workers = [WorkerInfo(worker_id=w, role=role, address=f"127.0.0.1:{9000 + i}", free_blocks=10, total_blocks=10)
               for i, w in enumerate(loads)]  # fmt: skip
    return workers, loads


def test_with_equal_load_the_request_goes_where_its_prefix_lives():
    decode, load = _workers("decode", {"d0": 1, "d1": 1})
    prefill, pload = _workers("prefill", {"p0": 0, "p1": 0})
    loads = {**load, **pload}
    owners = {"d1": Held(60), "p1": Held(20)}
    choice = choose(decode, prefill, owners, 64, lambda w: loads[w.worker_id], RoutingWeights())
    assert [w.worker_id for w in choice.decode] == ["d1", "d0"]
    assert choice.reason == "prefix" and choice.cached_blocks == 60
    # d1 lacks 4 blocks; p1's 20 cached blocks do not help with those, so the tie goes to the lower id
    assert choice.prefill == "p0"
    cold = choose(decode, prefill, {}, 64, lambda w: loads[w.worker_id], RoutingWeights())
    assert cold.decode[0].worker_id == "d0" and cold.reason == "load" and cold.prefill == "p0"


def test_a_prefill_worker_holding_more_than_the_decode_worker_is_preferred():
    decode, load = _workers("decode", {"d0": 0})
    prefill, pload = _workers("prefill", {"p0": 0, "p1": 1})
    loads = {**load, **pload}
    owners = {"d0": Held(2), "p1": Held(50)}
    choice = choose(decode, prefill, owners, 64, lambda w: loads[w.worker_id], RoutingWeights())
    assert choice.prefill == "p1"  # 48 blocks it need not compute outweigh one request of load (8 blocks)


@pytest.mark.parametrize(("loads", "winner", "reason"), [
    ({"d0": 0, "d1": 3}, "d1", "prefix"),  # 3 requests (24 blocks of cost) < 60 cached blocks
    ({"d0": 0, "d1": 9}, "d0", "load"),  # 9 requests cost more than the 60 blocks it would save
    ({"d0": 0, "d1": 17}, "d0", "load"),  # past the balance threshold: load alone decides
])  # fmt: skip
def test_past_the_imbalance_threshold_load_wins(loads, winner, reason):
    decode, load = _workers("decode", loads)
    choice = choose(decode, [], {"d1": Held(60)}, 64, lambda w: load[w.worker_id], RoutingWeights())
    assert choice.decode[0].worker_id == winner and choice.reason == reason and choice.prefill == ""


def test_a_block_held_in_a_lower_tier_costs_between_a_device_hit_and_a_recompute():
    decode, load = _workers("decode", {"d0": 0, "d1": 0, "d2": 0})
    weights = RoutingWeights()
    owners = {"d0": Held(device=40), "d1": Held(device=20, host=20), "d2": Held(device=20, disk=20)}
    choice = choose(decode, [], owners, 64, lambda w: load[w.worker_id], weights)
    assert [w.worker_id for w in choice.decode] == ["d0", "d1", "d2"] and choice.cached_blocks == 40
    # 60 blocks in the host tier beat 40 in the device pool: 20 recomputed blocks cost more than 60 copies
    owners = {"d0": Held(device=40), "d1": Held(host=60)}
    choice = choose(decode[:2], [], owners, 64, lambda w: load[w.worker_id], weights)
    assert choice.decode[0].worker_id == "d1" and choice.reason == "prefix" and choice.cached_blocks == 60
    # with a host block priced like a recompute, the device pool's 40 win
    pricey = RoutingWeights(host_block_weight=1.0)
    assert choose(decode[:2], [], owners, 64, lambda w: load[w.worker_id], pricey).decode[0].worker_id == "d0"


def test_weights_are_validated():
    with pytest.raises(ValueError, match="routing weights"):
        RoutingWeights(load_weight=-1)
    with pytest.raises(ValueError, match="routing weights"):
        RoutingWeights(disk_block_weight=-0.1)
