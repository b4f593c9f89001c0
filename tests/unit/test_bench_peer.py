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


def test_the_openai_client_counts_token_events_and_reads_usage_wherever_it_comes():
    import asyncio
    import json

    from kvserve.bench.backends import _read_events

    def stream(*events):
        async def lines():
            for event in events:
                yield b"data: " + json.dumps(event).encode() + b"\n"
            yield b"data: [DONE]\n"

        return lines()

    usage = {"completion_tokens": 2, "prompt_tokens": 5}
    kvserve = Record(start=0.0)  # held-back text is an empty token event; the usage comes alone
    asyncio.run(_read_events(stream({"choices": [{"text": "", "finish_reason": None}]},
                                    {"choices": [{"text": "ab", "finish_reason": "length"}]},
                                    {"choices": [], "usage": usage}), kvserve, 0.0))  # fmt: skip
    llama = Record(start=0.0)  # the last event: a finish reason, no text, and the usage
    asyncio.run(_read_events(stream({"choices": [{"text": "a", "finish_reason": None}]},
                                    {"choices": [{"text": "b", "finish_reason": None}]},
                                    {"choices": [{"text": "", "finish_reason": "length"}], "usage": usage}), llama,
                             0.0))  # fmt: skip
    assert len(kvserve.chunk_s) == len(llama.chunk_s) == 2 and kvserve.num_tokens == llama.num_tokens == 2
