"""Disaggregate only when it pays (``decode_service.disaggregation``), through a 1P1D cluster whose decode worker
hands off prompts of at least 48 uncached tokens while the prefill worker has at most 2 requests: a short prompt
is prefilled on the decode worker, a long cold one on the prefill worker, and the long one again with a short
suffix (nearly all of it in the decode worker's prefix cache) on the decode worker; of 8 long prompts sent at
once, some are prefilled on the decode worker because the prefill worker's queue is long. Each gives the offline
engine's tokens, says where its KV came from, and is counted under its decision in the decode worker's metrics.
(The rest of the suite hands off every prompt: tests/conftest.py turns both rules off.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from cluster_utils import cluster, discard, prometheus_values

from engine import SamplingParams
from kvserve.client import Client

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
BURST = dict(temperature=0, max_tokens=2, ignore_eos=True)  # (where each is prefilled is what counts)


def test_the_decode_worker_prefills_what_a_hand_off_does_not_pay_for(tmp_path, llm, engine_prompts):
    long_prompt = engine_prompts[6][:80]
    prompts = {"short": engine_prompts[5][:20], "long": long_prompt, "cached": [*long_prompt, 11, 12, 13, 14, 15]}
    assert len(prompts["short"]) == 20 and len(long_prompt) == 80
    burst = [[100 + i, *engine_prompts[6][i : i + 59]] for i in range(8)]  # 60 tokens each, none cached
    offline = llm.generate(list(prompts.values()), SamplingParams(**GREEDY))
    offline_burst = llm.generate(burst, SamplingParams(**BURST))
    c = cluster(1, 1, tmp_path, decode_argv=["--disagg-min-uncached-tokens", "48", "--disagg-max-prefill-queue", "2"])
    try:
        url = c.child("decode-0").metrics_url
        before = prometheus_values(url, "kvserve_disagg_decisions_total")
        with Client(c.endpoint, timeout_s=120) as client:
            served = {name: client.generate(prompt, **GREEDY) for name, prompt in prompts.items()}
            after = prometheus_values(url, "kvserve_disagg_decisions_total")
            with ThreadPoolExecutor(len(burst)) as pool:
                burst_served = list(pool.map(lambda p: client.generate(p, **BURST), burst))
        after_burst = prometheus_values(url, "kvserve_disagg_decisions_total")
    finally:
        discard(c)
    for (name, result), want in zip(served.items(), offline, strict=True):
        assert result.token_ids == want.token_ids, name
    assert (served["short"].transfer_backend, served["short"].prefill_worker) == ("local", "")
    assert (served["long"].transfer_backend, served["long"].prefill_worker) == ("shm", "prefill-0")
    # 80 of its 85 tokens were cached (5 full blocks of 16: the long prompt's KV, handed over): 5 to compute
    assert (served["cached"].transfer_backend, served["cached"].prefill_worker) == ("local", "")
    assert served["cached"].usage["cached_prompt_tokens"] == 80
    counted = {key: after[key] - before.get(key, 0.0) for key in after}
    assert counted == {'decision="local_short"': 2, 'decision="remote"': 1}
    assert [r.token_ids for r in burst_served] == [o.token_ids for o in offline_burst]
    busy = after_burst.get('decision="local_busy"', 0.0)
    remote = after_burst['decision="remote"'] - after['decision="remote"']
    assert busy >= 1 and remote >= 3 and busy + remote == len(burst), after_burst  # (3: the queue's bound, + 1)
    assert sum(r.transfer_backend == "local" for r in burst_served) == busy
