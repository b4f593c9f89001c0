"""Prefix caching across a real cluster (1 prefill + 2 decode processes, a real Redis): a shared prefix is
served from cache on the decode worker that holds it, the Redis index says so and forgets a dead worker,
and routing goes on while Redis is paused."""

from __future__ import annotations

import os
import signal

import pytest
import redis
from cluster_utils import cluster, discard, hf_reference
from waiting import wait_until

from cluster_state.registry import Registry
from kvserve.client import Client
from kvstore.prefix_hash import block_hashes

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def one_by_two(tmp_path_factory):
    c = cluster(1, 2, tmp_path_factory.mktemp("logs-prefix"))
    yield c
    discard(c)


@pytest.mark.slow
def test_a_shared_prefix_is_served_from_cache_where_it_lives(one_by_two, engine_prompts, hf_model):
    c = one_by_two
    prefix = engine_prompts[6][:160]  # ten full blocks
    first, second = prefix + engine_prompts[0], prefix + engine_prompts[1][:9]
    registry = Registry(c.redis_url, security=c.security)
    try:
        with Client(c.endpoint, timeout_s=120) as client:
            cold = client.generate(first, **GREEDY)
            assert cold.usage["cached_prompt_tokens"] == 0 and cold.token_ids == hf_reference(hf_model, first)
            decode = [w for w in registry.workers("decode") if w.worker_id == cold.decode_worker][0]
            chain = block_hashes(first, decode.block_size, decode.fingerprint)
            # the index learns the blocks from the decode worker (and the prefill worker, which cached them too)
            wait_until(lambda: registry.prefix_index.owners(chain).get(decode.worker_id) == len(chain), 10,
                  f"the decode worker's blocks in Redis: {registry.prefix_index.owners(chain)}")  # fmt: skip
            assert registry.prefix_index.owners(chain).get("prefill-0") == len(chain)
            warm = client.generate(second, **GREEDY)
        assert warm.decode_worker == cold.decode_worker  # routed to where its prefix lives
        assert warm.usage["cached_prompt_tokens"] == 160
        assert warm.token_ids == hf_reference(hf_model, second)  # and exact
        # the decode worker dies: within its heartbeat TTL its entries are gone from the index
        os.kill(c.child(decode.worker_id).pid, signal.SIGKILL)
        wait_until(lambda: decode.worker_id not in {w.worker_id for w in registry.workers()}, registry.ttl_s + 5,
              "the killed worker left the registry")  # fmt: skip
        assert decode.worker_id not in registry.prefix_index.owners(chain)
        raw = redis.Redis.from_url(c.redis_url)
        assert raw.keys("kvserve:prefix:*")  # the live workers' entries stay
        raw.close()
    finally:
        registry.stop()


@pytest.mark.slow
def test_routing_goes_on_while_redis_is_paused(one_by_two, engine_prompts, hf_model):
    c = one_by_two
    os.kill(c.redis.pid, signal.SIGSTOP)
    try:
        with Client(c.endpoint, timeout_s=120) as client:
            result = client.generate(engine_prompts[5], **GREEDY)
    finally:
        os.kill(c.redis.pid, signal.SIGCONT)
    assert result.token_ids == hf_reference(hf_model, engine_prompts[5])
