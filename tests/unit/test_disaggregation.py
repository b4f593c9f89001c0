"""``DisaggPolicy.decide``: where a decode worker has a queued prompt prefilled, at each rule's boundary."""

from __future__ import annotations

from cluster_state.workers import WorkerInfo
from decode_service.disaggregation import Decision, DisaggPolicy


def prefill_worker(running: int = 0, waiting: int = 0) -> WorkerInfo:
    return WorkerInfo("prefill-0", "prefill", "127.0.0.1:9000", num_running=running, num_waiting=waiting)


def test_a_prompt_with_fewer_uncached_tokens_than_the_threshold_is_computed_here():
    policy = DisaggPolicy(min_uncached_tokens=48)
    assert policy.decide(47, prefill_worker(), 0, 0) is Decision.SHORT
    assert policy.decide(48, prefill_worker(), 0, 0) is Decision.REMOTE
    assert DisaggPolicy().decide(1, prefill_worker(), 0, 0) is Decision.REMOTE  # the constructor's: all handed off
    assert policy.decide(1000, None, 0, 0) is Decision.NO_WORKER


def test_a_long_prefill_queue_keeps_a_prompt_here_only_while_nothing_is_prefilled_here():
    policy = DisaggPolicy(max_prefill_queue=4)
    assert policy.decide(500, prefill_worker(running=2, waiting=2), 0, 0) is Decision.REMOTE  # 4: not over
    assert policy.decide(500, prefill_worker(running=2, waiting=3), 0, 0) is Decision.BUSY
    assert policy.decide(500, prefill_worker(running=2, waiting=3), 0, 1) is Decision.REMOTE  # no room here
    # the heartbeat is stale: our own calls in flight there count when they are more
    assert policy.decide(500, prefill_worker(), 5, 0) is Decision.BUSY
    assert DisaggPolicy().decide(500, prefill_worker(waiting=100), 100, 0) is Decision.REMOTE  # 0: no bound


def test_the_flags_reach_the_decode_workers_through_kvserve_up(monkeypatch):
    from decode_service.settings import DecodeSettings
    from kvserve.settings import parse_up
    from rpc.options import DISAGG_MIN_UNCACHED_TOKENS
    from rpc.settings import parse_settings

    for name in ("KVSERVE_DISAGG_MIN_UNCACHED_TOKENS", "KVSERVE_DISAGG_MAX_PREFILL_QUEUE"):
        monkeypatch.delenv(name, raising=False)  # (tests/conftest.py sets both to 0)
    assert parse_up([]).decode_argv() == []  # the workers' own defaults
    decode = parse_settings(DecodeSettings, [])
    assert (decode.disagg_min_uncached_tokens, decode.disagg_max_prefill_queue) == (DISAGG_MIN_UNCACHED_TOKENS, 8)
    argv = parse_up(["--disagg-min-uncached-tokens", "64", "--disagg-max-prefill-queue", "0"]).decode_argv()
    decode = parse_settings(DecodeSettings, argv)
    assert (decode.disagg_min_uncached_tokens, decode.disagg_max_prefill_queue) == (64, 0)
