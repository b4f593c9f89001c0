"""``kvserve bench peer``'s figures: a server that sends no usage is counted by its streamed events (an empty one,
text held back, is a token arrival too), and the ITL percentiles pool every request's gaps."""

from __future__ import annotations

from kvserve.bench.loadgen import LoadResult, Record
from kvserve.bench.peer import figures


def test_tokens_come_from_usage_or_else_from_the_events_and_itl_pools_the_gaps():
    with_usage = Record(start=0.0, num_tokens=3, chunk_s=[0.1, 0.2, 0.3])
    without = Record(start=0.0, chunk_s=[0.5, 0.6, 0.9, 1.0])  # 4 events: gaps 0.1, 0.3, 0.1
    failed = Record(start=0.0, status="UNAVAILABLE", chunk_s=[0.1, 5.0])
    tokens_per_s, p50, p90 = figures(LoadResult([with_usage, without, failed], duration_s=2.0))
    assert tokens_per_s == (3 + 4) / 2.0
    assert round(p50) == 100 and round(p90) == 300  # gaps 0.1 0.1 0.1 0.1 0.3 (ms): the failed one's not among them
