"""The host KV tier in a real cluster (1 prefill + 1 decode process, a real Redis): a decode worker whose
pool evicted a prompt loads it back from its host tier, asks the prefill worker for none of it, answers
exactly, and Redis and its metrics say which tier served it."""

from __future__ import annotations

import pytest
from cluster_utils import cluster, hf_reference, prometheus_values
from waiting import wait_until

from cluster_state.prefix_index import Held
from cluster_state.registry import Registry
from kvserve.client import Client
from kvstore.prefix_hash import block_hashes

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    c = cluster(1, 1, tmp_path_factory.mktemp("logs-tiers"),
                decode_argv=["--num-blocks", "24", "--host-kv-cache-gb", "0.05"])  # fmt: skip
    yield c
    c.stop()


@pytest.mark.soak  # 13 s; tests/engine/test_tiers.py runs the same eviction and reload in one process
def test_a_prompt_the_decode_pool_evicted_comes_back_from_its_host_tier(tiered, engine_prompts, hf_model):
    c = tiered
    text = engine_prompts[6] + engine_prompts[5]
    prompts = [text[i : i + 9 * BLOCK_SIZE + 1] for i in (0, 30, 60, 90)]  # 10 blocks each, a 24-block pool
    registry = Registry(c.redis_url, security=c.security)
    try:
        with Client(c.endpoint, timeout_s=120) as client:
            for prompt in prompts:
                client.generate(prompt, **GREEDY)
            decode = registry.workers("decode")[0]
            chain = block_hashes(prompts[0], decode.block_size, decode.fingerprint)
            # the first prompt's blocks left the decode pool for its host tier, and Redis heard of it
            held = lambda: registry.prefix_index.holdings(chain).get(decode.worker_id, Held())  # noqa: E731
            wait_until(lambda: held().host and held().total == len(chain), 10, "the decode worker's host tier in Redis")
            in_host = held().host
            again = client.generate(prompts[0], **GREEDY)
        assert again.token_ids == hf_reference(hf_model, prompts[0])
        assert again.usage["cached_prompt_tokens"] == 9 * BLOCK_SIZE  # held by the decode worker, none sent
        hits = prometheus_values(c.child(decode.worker_id).metrics_url, "kvserve_kv_tier_hit_tokens_total")
        assert hits['role="decode",tier="host"'] == in_host * BLOCK_SIZE
    finally:
        registry.stop()
