"""Every ``kvserve_*`` series the shipped dashboard or alert rules name is exported by a real cluster's ``/metrics``
(router, decode and prefill worker), with a sample their label matchers select: a renamed metric, a dropped
``_total`` or a misspelt ``field`` fails here instead of drawing an empty panel or an alert that never fires."""

from __future__ import annotations

import urllib.request

from cluster_utils import cluster, discard, tiny_engine_argv
from observability import dashboard_exprs, rule_exprs, selectors
from prometheus_client.parser import text_string_to_metric_families

from kvserve.client import Client

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
PROMPT = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]  # repeats: n-gram speculation proposes


def _samples(url: str) -> dict[str, list[dict[str, str]]]:
    """The label sets of every sample ``url`` serves, by sample name (``_total``, ``_bucket``... included)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def test_every_series_the_dashboard_and_the_alerts_name_is_exported(tmp_path, tiny_model_dir):
    # the decode worker with a host tier and n-gram speculation, so that their series exist too
    c = cluster(1, 1, tmp_path, http=True, engine_argv=tiny_engine_argv(tiny_model_dir),
                decode_argv=["--host-kv-cache-gb", "0.01", "--speculative-config", NGRAM])  # fmt: skip
    try:
        with Client(c.endpoint, timeout_s=120) as client:  # one request through the prefill worker's hand-off
            assert len(client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids) == 8
        exported: dict[str, list[dict[str, str]]] = {}
        for child in c.children:  # the router's on its HTTP port
            for name, label_sets in _samples(child.metrics_url).items():
                exported.setdefault(name, []).extend(label_sets)
    finally:
        discard(c)
    named = {where: selectors(expr) for where, expr in {**dashboard_exprs(), **rule_exprs()}.items()}
    assert sum(map(len, named.values())) > 30  # the parse found the series
    missing = []
    for where, found in named.items():
        for selector in (alternative for s in found for alternative in s.each_alternative()):
            if not any(selector.selects(labels) for labels in exported.get(selector.name, [])):
                have = sorted({str(labels) for labels in exported.get(selector.name, [])})
                missing.append(f"{where}: {selector} selects nothing; exported: {have or 'no such series'}")
    assert not missing, "\n".join(missing)
    # the "bound by" panel's series comes from both kinds of worker, every resource of each
    diagnosed = {(labels["role"], labels["resource"]) for labels in exported["kvserve_step_utilization"]}
    assert diagnosed == {(role, resource) for role in ("decode", "prefill")
                         for resource in ("memory_bandwidth", "compute", "host")}  # fmt: skip
