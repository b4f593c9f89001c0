"""Request priorities through the router and a decode worker (``--scheduling-policy priority``, one sequence
slot): a request sent at priority -1 while a priority-5 stream is running takes the slot and finishes first; the
stream is preempted, recomputed, and goes on; both give the offline engine's tokens. And (on demand) ``kvserve
bench priority`` runs on such a cluster."""

from __future__ import annotations

import threading
import time

import pytest
from cluster_utils import ENGINE_ARGV, cluster, discard

from engine import SamplingParams
from kvserve.client import Client


@pytest.mark.soak  # 17 s; tests/engine/test_priority.py preempts for a higher priority on the real model
def test_a_high_priority_request_overtakes_a_running_low_priority_stream(tmp_path, llm, engine_prompts):
    low_prompt, high_prompt = engine_prompts[5][:40], engine_prompts[6][:30]
    want_low, want_high = (o.token_ids for o in llm.generate(
        [low_prompt, high_prompt], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 8)]))
    c = cluster(0, 1, tmp_path, engine_argv=[*ENGINE_ARGV, "--scheduling-policy", "priority", "--max-num-seqs", "1"])
    try:
        with Client(c.endpoint, timeout_s=120) as client:
            low_tokens, low_done, started = [], [], threading.Event()

            def stream_low() -> None:
                for chunk in client.stream(low_prompt, temperature=0, max_tokens=60, ignore_eos=True, priority=5):
                    low_tokens.extend(chunk.token_ids)
                    started.set()
                low_done.append(time.monotonic())

            thread = threading.Thread(target=stream_low)
            thread.start()
            assert started.wait(60)
            high = client.generate(high_prompt, temperature=0, max_tokens=8, ignore_eos=True, priority=-1)
            high_done = time.monotonic()
            thread.join(120)
    finally:
        discard(c)
    assert high.token_ids == want_high and low_tokens == want_low
    assert low_done and high_done < low_done[0]  # (at one priority it would wait for the stream to end)


@pytest.mark.soak  # 8 s
def test_bench_priority_runs(tmp_path, llm):
    from kvserve.bench.priority import run

    c = cluster(0, 1, tmp_path, engine_argv=[*ENGINE_ARGV, "--scheduling-policy", "priority", "--max-num-seqs", "1"])
    try:  # one slot: the users queue
        row = run(c.endpoint, llm.engine.model_config.vocab_size, num_users=2, num_high=2, prompt_len=8, max_tokens=2,
                  fill_s=0.3)  # fmt: skip
    finally:
        discard(c)
    assert row["low finished"] >= 1 and 0 < row["unloaded p99 ms"] and 0 < row["loaded p99 ms"]
