"""A prefill worker reads the decode worker's cached prefix in place (real processes, a real Redis, ``shm``):
with no prefix cache of its own it computes only the tail of a prompt whose prefix the decode worker holds,
its metrics say so, and the answer stays exact."""

from __future__ import annotations

import pytest
from cluster_utils import cluster, discard, hf_reference, prometheus_values

from kvserve.client import Client

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
TOKENS = "kvserve_prefill_prompt_tokens_total"


@pytest.fixture(scope="module")
def uncached_prefill(tmp_path_factory):
    """1P+1D; only the decode worker caches prefixes (it offers them to the prefill worker: the default)."""
    c = cluster(1, 1, tmp_path_factory.mktemp("logs-inplace"), prefill_argv=["--enable-prefix-caching", "false"])
    yield c
    discard(c)


def _tokens_by_source(c) -> dict[str, float]:
    samples = prometheus_values(c.child("prefill-0").metrics_url, TOKENS)
    return {source: samples.get(f'source="{source}"', 0.0) for source in ("computed", "own_cache", "destination")}


@pytest.mark.slow
def test_the_prefill_worker_computes_only_what_the_decode_worker_lacks(uncached_prefill, engine_prompts, hf_model):
    c = uncached_prefill
    prefix = engine_prompts[6][:160]  # ten full blocks
    first, second = prefix + engine_prompts[0], prefix + engine_prompts[1][:9]
    with Client(c.endpoint, timeout_s=120) as client:
        cold = client.generate(first, **GREEDY)
        before = _tokens_by_source(c)
        warm = client.generate(second, **GREEDY)
    after = _tokens_by_source(c)
    assert before == {"computed": len(first), "own_cache": 0, "destination": 0}
    assert cold.token_ids == hf_reference(hf_model, first)
    assert warm.token_ids == hf_reference(hf_model, second)  # exact over the prefix it read
    assert warm.transfer_backend == "shm" and warm.usage["cached_prompt_tokens"] == 160
    delta = {source: after[source] - before[source] for source in after}
    assert delta == {"computed": len(second) - 160, "own_cache": 0, "destination": 160}
