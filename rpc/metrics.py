"""Prometheus metrics of every kvserve process, all named ``kvserve_*``, and the HTTP endpoint that serves them.

Workers serve ``/metrics`` on their own ``--metrics-port`` (``start_metrics_server``); the router serves it on
its HTTP port, or on its own ``--metrics-port`` when given. Counters and histograms are updated where things
happen (off the model's critical path: a histogram observation is about a microsecond); gauges that mirror a
worker's state (queue depths, KV blocks) are read at scrape time from the ``load`` function the worker
registers, so nothing updates them per step; so is ``kvserve_registry_up``, from the outage state of the
process's Redis link (``export_registry_health``: no Redis call of its own), and so is
``kvserve_step_utilization``, from the engine's running step diagnosis (``engine.step_diagnosis``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cluster_state.registry import Registry
    from engine import LLMEngine
    from engine.step_diagnosis import StepDiagnosis

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)

REQUESTS = Counter("kvserve_requests", "Requests that ended on this worker, by outcome", ["role", "outcome"])
PREFIX_QUERIES = Counter("kvserve_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                         ["role"])  # fmt: skip
PREFIX_HITS = Counter("kvserve_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", ["role"])
PREFILL_TOKENS = Counter("kvserve_prefill_prompt_tokens", "Prompt tokens of finished prefills, by where their KV "
                         "came from: computed, own_cache (this worker's prefix cache) or destination (read in "
                         "place from the decode worker's cached prefix)", ["source"])  # fmt: skip
PREFILL_BATCH = Histogram("kvserve_prefill_batch_requests", "Requests per prefill batch",
                          buckets=(1, 2, 4, 8, 16, 32, 64))  # fmt: skip
TTFT = Histogram("kvserve_time_to_first_token_seconds", "Request received to first token", buckets=_LATENCY_BUCKETS)
TPOT = Histogram("kvserve_time_per_output_token_seconds", "Mean time per output token after the first",
                 buckets=_TOKEN_BUCKETS)  # fmt: skip
ITL = Histogram("kvserve_inter_token_latency_seconds", "Time between two tokens of a stream", buckets=_TOKEN_BUCKETS)
E2E = Histogram("kvserve_e2e_request_latency_seconds", "Request received to last token", buckets=_LATENCY_BUCKETS)
TRANSFER_BYTES = Counter("kvserve_kv_transfer_bytes", "Prompt KV bytes handed from prefill to decode", ["backend"])
DISAGG_DECISIONS = Counter("kvserve_disagg_decisions", "Where a decode worker had a queued prompt prefilled: remote "
                           "or local_short, local_busy, local_no_worker, local_score (decode_service.disaggregation)",
                           ["decision"])  # fmt: skip
HANDOFF = Histogram("kvserve_kv_handoff_seconds", "Prefill call: sent to KV verified, on the decode worker",
                    ["backend"], buckets=_LATENCY_BUCKETS)  # fmt: skip
ROUTER_REQUESTS = Counter("kvserve_router_requests", "Requests the router answered, by gRPC status", ["status"])
STALLED_STREAMS = Counter("kvserve_stalled_streams", "Streams cancelled because their client read nothing for "
                          "the stream idle timeout")
MIGRATIONS = Counter("kvserve_router_stream_migrations", "Streams moved to another decode worker after theirs failed "
                     "mid-stream (it died or drained)")
# tenants (router.tenants, router.fair_queue): labelled by name, at most router.tenants.MAX_TENANTS of them
TENANT_REQUESTS = Counter("kvserve_tenant_requests", "Requests that ended at the router, by tenant and gRPC status",
                          ["tenant", "status"])  # fmt: skip
TENANT_REFUSED = Counter("kvserve_tenant_refused", "Requests refused for a tenant's bound (concurrency, "
                         "tokens_per_minute)", ["tenant", "reason"])  # fmt: skip
TENANT_TOKENS = Counter("kvserve_tenant_tokens", "Tokens of finished requests by tenant: prompt, completion",
                        ["tenant", "kind"])  # fmt: skip
TENANT_IN_FLIGHT = Gauge("kvserve_tenant_requests_in_flight", "A tenant's requests at the router now", ["tenant"])
TENANT_QUEUED = Gauge("kvserve_tenant_requests_queued", "A tenant's requests waiting in the router's fair queue",
                      ["tenant"])  # fmt: skip
TENANT_RELOADS = Counter("kvserve_tenant_reloads", "Keys file reloads (SIGHUP): loaded, or refused (the old table "
                         "kept)", ["result"])  # fmt: skip
RESUMED = Counter("kvserve_router_resumed_streams", "Streams a client resumed through this router after another "
                  "router failed mid-way (GenerateRequest.resume, kvserve.failover)")  # fmt: skip
ROUTING = Counter("kvserve_router_decisions", "Decode worker choices, by what decided them", ["reason"])
ROUTER_REFUSED = Counter("kvserve_router_refused", "Requests the router's front door refused before validating "
                         "them: unauthenticated (API key), too_large (HTTP body) or busy (concurrency limit)",
                         ["reason"])  # fmt: skip

TRACE_SPANS_DROPPED = Counter("kvserve_trace_spans_dropped", "Spans the OTLP collector did not take (unreachable or "
                              "refusing); requests go on untraced")  # fmt: skip

_STATE = Gauge("kvserve_worker_state", "A worker's queue depths and KV blocks now", ["role", "field"])
_REGISTRY_UP = Gauge("kvserve_registry_up", "1 while this process's last Redis call (a worker's heartbeat, the "
                     "router's registry reads) succeeded, 0 while Redis is unreachable", ["role"])  # fmt: skip
_UTILIZATION = Gauge("kvserve_step_utilization", "Over a worker's last 64 steps or so, the fraction of the device's "
                     "peak memory bandwidth (bytes moved: weights, KV read and written) and of its peak compute "
                     "(FLOPs) the steps used, and the host's share of their time (step time minus device time); "
                     "each in [0, 1], 0 before the first step", ["role", "resource"])  # fmt: skip


def export_state(role: str, load: Callable[[], dict[str, int]], engine: LLMEngine) -> None:
    """Expose a worker's queue depths (from ``load()``) and its engine's KV blocks (used, free, holding cached
    prefixes) as gauges, the engine's preemptions as ``kvserve_preemptions_total`` and its step utilisation
    (``export_step_utilization``); read at scrape time."""
    pool = engine.block_manager.pool
    fields = {
        "requests_waiting": lambda: load()["num_waiting"],
        "requests_running": lambda: load()["num_running"],
        "kv_blocks_free": lambda: pool.num_free_blocks,
        "kv_blocks_used": lambda: pool.num_blocks - pool.num_free_blocks,
        "kv_blocks_cached": lambda: len(pool.cached),
    }
    for name, read in fields.items():
        _STATE.labels(role, name).set_function(read)
    REGISTRY.register(_PreemptionCount(role, lambda: engine.scheduler.num_preemptions))
    if engine.tiers is not None:
        host = engine.tiers.host
        _STATE.labels(role, "kv_host_blocks_cached").set_function(lambda: len(host.entries))
        _STATE.labels(role, "kv_host_blocks_free").set_function(lambda: host.num_free_slots)
        REGISTRY.register(_TierCounts(role, engine.tiers.stats))
    if engine.speculator is not None:
        REGISTRY.register(_SpecCounts(role, engine.speculator.stats))
    if engine.diagnosis is not None:
        export_step_utilization(role, engine.diagnosis)


def export_step_utilization(role: str, diagnosis: StepDiagnosis) -> None:
    """Expose ``kvserve_step_utilization{role, resource}`` for each resource (memory_bandwidth, compute, host),
    read at scrape time from ``diagnosis.recent()``."""
    from engine.step_diagnosis import RESOURCES  # (here: the router imports this module and never loads torch)

    for resource in RESOURCES:
        _UTILIZATION.labels(role, resource).set_function(lambda r=resource: getattr(diagnosis.recent(), r))


def export_registry_health(role: str, registry: Registry) -> None:
    """Expose ``kvserve_registry_up{role}``, read at scrape time from ``registry.redis_down``: a worker's heartbeat
    calls Redis every ``ttl_s / 3``, so its value is at most that old; the router's dates from its last request."""
    _REGISTRY_UP.labels(role).set_function(lambda: 0 if registry.redis_down else 1)


class _PreemptionCount(Collector):
    def __init__(self, role: str, count: Callable[[], int]) -> None:
        self.role, self.count = role, count

    def collect(self):
        family = CounterMetricFamily("kvserve_preemptions", "Sequences preempted (recomputed later) for lack of "
                                     "KV blocks", labels=["role"])  # fmt: skip
        family.add_metric([self.role], self.count())
        yield family


class _TierCounts(Collector):
    """The memory tiers' counters (``engine.tier_connector.TierStats``), read at scrape time."""

    def __init__(self, role: str, stats) -> None:
        self.role, self.stats = role, stats

    def collect(self):
        stats = self.stats
        hits = CounterMetricFamily("kvserve_kv_tier_hit_tokens", "Prompt tokens whose KV a first admission "
                                   "found, by memory tier (device pool, host tier, disk tier)",
                                   labels=["role", "tier"])  # fmt: skip
        for tier, n in list(stats.hit_tokens.items()):
            hits.add_metric([self.role, tier], n)
        moved = CounterMetricFamily("kvserve_kv_tier_blocks", "KV blocks copied between the device pool and the host "
                                    "tier: saved (evicted, swapped out) or loaded (hits, swap-ins)",
                                    labels=["role", "direction"])  # fmt: skip
        moved.add_metric([self.role, "saved"], stats.blocks_saved)
        moved.add_metric([self.role, "loaded"], stats.blocks_loaded)
        preempted = CounterMetricFamily("kvserve_kv_preemptions_by_mode", "Preemptions by what became of the "
                                        "KV: swapped to the host tier or dropped to recompute",
                                        labels=["role", "mode"])  # fmt: skip
        preempted.add_metric([self.role, "swap"], stats.swapped_out)
        preempted.add_metric([self.role, "recompute"], stats.recomputed)
        yield from (hits, moved, preempted)


class _SpecCounts(Collector):
    """Speculative decoding's counters and ratios (``engine.speculative.SpecStats``), read at scrape time."""

    def __init__(self, role: str, stats) -> None:
        self.role, self.stats = role, stats

    def collect(self):
        stats, labels = self.stats, [self.role, self.stats.method]
        for name, value, help_text in (
            ("kvserve_spec_verify_steps", stats.num_verify_steps, "Sequences' proposals verified, one per step"),
            ("kvserve_spec_proposed_tokens", stats.num_proposed, "Tokens proposed for verification"),
            ("kvserve_spec_accepted_tokens", stats.num_accepted, "Proposed tokens the target model accepted"),
        ):  # fmt: skip
            family = CounterMetricFamily(name, help_text, labels=["role", "method"])
            family.add_metric(labels, value)
            yield family
        for name, value, help_text in (
            ("kvserve_spec_acceptance_rate", stats.acceptance_rate, "Accepted / proposed tokens so far"),
            ("kvserve_spec_mean_accepted_length", stats.mean_accepted_length,
             "Proposed tokens accepted per verify step so far (each also emits the target's own next token)"),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, help_text, labels=["role", "method"])
            family.add_metric(labels, value)
            yield family


def count_prefill_tokens(num_prompt: int, num_own_cached: int, num_dest_read: int) -> None:
    """Count a finished prefill's prompt tokens: prefix-cache queries and hits, and where each token's KV came
    from (as of its first admission: a preempted prefill computes more than it reports)."""
    PREFIX_QUERIES.labels("prefill").inc(num_prompt)
    PREFIX_HITS.labels("prefill").inc(num_own_cached)
    for source, n in [("computed", num_prompt - num_own_cached - num_dest_read), ("own_cache", num_own_cached),
                      ("destination", num_dest_read)]:  # fmt: skip
        PREFILL_TOKENS.labels(source).inc(n)


def start_metrics_server(host: str, port: int) -> int:
    """Serve ``/metrics`` over HTTP on a daemon thread; returns the port (``port`` 0 picks a free one)."""
    server, _ = start_http_server(port, addr=host)
    return server.server_address[1]
