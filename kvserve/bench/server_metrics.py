"""Server-side figures for a load run: the kvserve processes' Prometheus ``/metrics``, scraped before and after."""

from __future__ import annotations

import urllib.request
from collections import defaultdict


def scrape(urls: list[str]) -> dict[str, float]:
    """Every sample of every URL, summed across URLs by name and labels (``name{labels}`` -> value)."""
    totals: dict[str, float] = defaultdict(float)
    for url in urls:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                totals[name] += float(value)
    return dict(totals)


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the servers counted during the run: requests by outcome (workers) and status (router), prefix-cache
    hit rate, preemptions, KV bytes handed over, the mean TTFT/TPOT the decode workers measured, and speculative
    decoding's proposals, acceptance rate and accepted tokens per verify step (none where nothing speculated)."""
    delta = {name: after[name] - before.get(name, 0.0) for name in after}

    def total(prefix: str) -> float:
        return sum(v for name, v in delta.items() if name.startswith(prefix))

    def labelled(prefix: str) -> dict[str, float]:
        return {name[len(prefix) :].strip("{}"): v for name, v in delta.items() if name.startswith(prefix) and v}

    def mean_ms(histogram: str) -> float | None:
        count = total(f"{histogram}_count")
        return total(f"{histogram}_sum") / count * 1000 if count else None

    queries = total("kvserve_prefix_cache_queries_tokens_total")
    proposed, accepted = total("kvserve_spec_proposed_tokens_total"), total("kvserve_spec_accepted_tokens_total")
    steps = total("kvserve_spec_verify_steps_total")
    return {
        "worker_requests": labelled("kvserve_requests_total"),
        "router_requests": labelled("kvserve_router_requests_total"),
        "routing_decisions": labelled("kvserve_router_decisions_total"),
        "prefix_hit_rate": total("kvserve_prefix_cache_hits_tokens_total") / queries if queries else None,
        "preemptions": total("kvserve_preemptions_total"),
        "kv_transfer_bytes": total("kvserve_kv_transfer_bytes_total"),
        "server_ttft_ms_mean": mean_ms("kvserve_time_to_first_token_seconds"),
        "server_tpot_ms_mean": mean_ms("kvserve_time_per_output_token_seconds"),
        "spec_proposed_tokens": proposed,
        "spec_acceptance_rate": accepted / proposed if proposed else None,
        "spec_mean_accepted_length": accepted / steps if steps else None,
    }
