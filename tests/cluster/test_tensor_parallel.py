"""Tensor parallelism on the CPU (gloo, two rank processes): the bundled model split 2 + 1 KV heads gives one
device's greedy tokens in mixed batches (chunked prefills beside decodes), within a stated logprob tolerance
(``tensor_parallel_testing``); a rank that does not join fails the start within the timeout, and a rank killed
fails the next step instead of hanging it. (Qwen3, Gemma 3, Phi-3 and Qwen3-MoE: ``test_architectures``.)"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from tensor_parallel_testing import assert_same_greedy

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def split():
    llm = LLM("default", tensor_parallel_size=2, num_blocks=96, max_num_batched_tokens=40)
    yield llm
    llm.engine.close()


def test_two_ranks_give_one_devices_greedy_tokens_in_mixed_batches(split, engine_prompts):
    runner = split.engine.runner
    assert runner.kv_spec.num_kv_heads == 2 and runner.model.part.config.num_heads == 6  # rank 0: 2 of 3 KV heads
    prompts = [engine_prompts[i][:n] for i, n in ((0, 7), (1, 30), (2, 55), (3, 18))]  # prefills in 40-token chunks
    one = LLM("default", num_blocks=96, max_num_batched_tokens=40)
    single = one.generate(prompts, PARAMS)
    buckets, replay = [], runner.graphs.replay  # (ShardedDecode: each rank stages rank 0's bucket)
    runner.graphs.replay = lambda bucket: buckets.append(bucket) or replay(bucket)
    try:
        ties = assert_same_greedy(single, split.generate(prompts, PARAMS))
    finally:
        runner.graphs.replay = replay
    assert 4 in buckets, buckets  # the decode-only steps of the four sequences ran padded
    assert not ties, ties  # (none on these prompts; a tie would be reported, not failed)
    # and again from the prefix cache, whose blocks every rank holds its heads of
    again, want = split.generate(prompts[1:3], PARAMS), one.generate(prompts[1:3], PARAMS)
    assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in want] and again[1].num_cached_tokens
    assert [o.token_ids for o in again] == [o.token_ids for o in single[1:3]]


def test_a_rank_that_does_not_join_in_time_fails_the_start_naming_the_timeout():
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor_parallel_timeout_s"):
        LLM("default", tensor_parallel_size=2, num_blocks=16, tensor_parallel_timeout_s=0.05)  # (a rank takes ~2 s)
    assert time.monotonic() - began < 30


def test_a_killed_rank_fails_the_next_step_instead_of_hanging_it(engine_prompts):
    llm = LLM("default", tensor_parallel_size=2, num_blocks=16, tensor_parallel_timeout_s=20)
    [rank] = llm.engine.runner.ranks._processes
    rank.kill()
    rank.wait()
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="rank process"):
        llm.generate([engine_prompts[0][:8]], PARAMS)
    assert time.monotonic() - began < 25
    llm.engine.close()


def test_bench_tp_runs_both_sides_on_the_same_requests():
    from kvserve.bench.tp import handoff, run

    [row] = run("default", 2, [2], prompt_len=8, max_tokens=4, rounds=1)
    assert row["same tokens"] and row["1 rank tok/s"] > 0 and row["2 ranks tok/s"] > 0
    assert 0 < row["collectives share"] < 1 and row["split decode"] == "eager"  # (CUDA graphs on a GPU)
    [copies] = handoff("default", 2, [2], rounds=3)
    assert list(copies) == ["blocks", "MiB", "1 -> 1 ms", "2 -> 1 ms", "1 -> 2 ms", "2 -> 2 ms"]
    assert copies["1 -> 1 ms"].endswith("(1.00x)")


def _cross_tp_cluster(tmp_path, engine_prompts, prefill_tp: int, decode_tp: int, transport: str) -> None:
    """1P + 1D at these TP sizes, ``transport`` forced: 12 concurrent greedy requests whose KV every one crosses
    from the prefill worker's split to the decode worker's (each decode rank's heads from the prefill ranks that
    hold them) get the offline engine's tokens (``assert_same_greedy``); the decode worker checks each
    hand-off's checksum (over every rank's part) before decoding, and a mismatch would fall back to prefilling
    locally, which this asserts never happened."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_utils import cluster, discard, prometheus_values

    from kvserve.client import Client

    text = engine_prompts[6]  # 170 tokens: 12 prompts of 5 to 70 from it, at different offsets
    prompts = [text[7 * i : 7 * i + n] for i, n in enumerate((9, 33, 20, 41, 12, 27, 60, 17, 35, 48, 5, 70))]
    want = LLM("default", num_blocks=160).generate(prompts, PARAMS)
    c = cluster(1, 1, tmp_path, decode_argv=["--kv-transport", transport],
                engine_argv=["--model", "default", "--num-blocks", "160", "--prefill-tp", str(prefill_tp),
                             "--decode-tp", str(decode_tp)])  # fmt: skip
    try:
        with Client(c.endpoint, timeout_s=90) as client, ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda p: client.generate(p, temperature=0, max_tokens=12, ignore_eos=True,
                                                              logprobs=2), prompts))  # fmt: skip
        handed = prometheus_values(c.child("decode-0").metrics_url, "kvserve_kv_transfer_bytes_total")
    finally:
        discard(c)
    assert_same_greedy(want, results)  # one side's sums split over ranks: the same tokens but at a near tie
    assert {r.transfer_backend for r in results} == {transport}, [r.transfer_backend for r in results]
    assert handed.get(f'backend="{transport}"', 0) > 0, handed
    for role, size in (("prefill", prefill_tp), ("decode", decode_tp)):
        log = (tmp_path / f"{role}-0.log").read_text()
        assert ("tensor parallel: 2 ranks (gloo)" in log) == (size == 2)
    assert "checksum" not in (tmp_path / "decode-0.log").read_text().lower()


# on demand (make test's 15 minutes; 19 s each): both directions over the shm copy between splits, which
# tests/unit/test_split_pool.py checks both ways: pytest -m soak tests/cluster/test_tensor_parallel.py -k hands
@pytest.mark.soak
def test_a_prefill_worker_at_tp2_hands_its_kv_to_a_decode_worker_at_tp1(tmp_path, engine_prompts):
    _cross_tp_cluster(tmp_path, engine_prompts, 2, 1, "shm")


@pytest.mark.soak
def test_a_prefill_worker_at_tp1_hands_its_kv_to_a_decode_worker_at_tp2(tmp_path, engine_prompts):
    _cross_tp_cluster(tmp_path, engine_prompts, 1, 2, "shm")


# on demand (~2 min, four clusters): pytest -m soak tests/cluster/test_tensor_parallel.py
@pytest.mark.soak
@pytest.mark.parametrize("transport", ["grpc", "nixl"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_crosses_tp_sizes_over_grpc_and_nixl(tmp_path, engine_prompts, prefill_tp, decode_tp, transport):
    from transfer.backend import nixl_installed

    if transport == "nixl" and not nixl_installed():
        pytest.skip("NIXL is not installed here")
    _cross_tp_cluster(tmp_path, engine_prompts, prefill_tp, decode_tp, transport)


def test_a_gpu_host_plans_split_workers_beside_prefill_workers(monkeypatch):
    """On a GPU host each rank exports its part of the KV pool through CUDA IPC, so split workers pair up with
    prefill workers at any sizes, as on the CPU (the hand-offs themselves run in scripts/gpu_check.sh)."""
    import torch

    from kvserve.launcher.plan import plan_cluster
    from kvserve.settings import parse_up

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for flags in (["--decode-tp", "2"], ["--prefill-tp", "2"], ["--prefill-tp", "2", "--decode-tp", "2"]):
        plan = plan_cluster(parse_up(flags))
        sizes = {child.role: child.argv[child.argv.index("--tensor-parallel-size") + 1]
                 for child in plan.children if "--tensor-parallel-size" in child.argv}  # fmt: skip
        assert sizes == {"prefill": flags[flags.index("--prefill-tp") + 1] if "--prefill-tp" in flags else "1",
                         "decode": flags[flags.index("--decode-tp") + 1] if "--decode-tp" in flags else "1"}, sizes


def _rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes a worker started (its children running ``_rank_main``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == worker_pid and b"_rank_main" in cmdline:
            pids.append(int(entry.name))
    return pids


# on demand (~35 s: two split decode workers, four model processes on two cores):
# pytest -m soak tests/cluster/test_tensor_parallel.py
@pytest.mark.soak
def test_a_killed_rank_ends_its_worker_which_restarts_whole_while_its_streams_move(tmp_path, llm):
    """Two decode workers split over two ranks each (``--prefill 0``), under the supervisor and a load of
    greedy and seeded streams: SIGKILL one worker's rank 1 mid-stream. That worker ends (no half-alive
    worker serves), the supervisor starts it again with its ranks, the router moves its streams to the other
    worker, and no request is lost or answered differently from the offline engine."""
    from cluster_utils import Load, cluster, offline_answers, prometheus_values, supervised
    from waiting import wait_until

    from kvserve.launcher.supervisor import RestartPolicy, State

    c = cluster(0, 2, tmp_path, engine_argv=["--model", "default", "--num-blocks", "256", "--decode-tp", "2"])
    threads, max_tokens = 4, 40
    with supervised(c, RestartPolicy(initial_delay_s=0.2, startup_timeout_s=120.0)) as (supervisor, messages):
        expected = offline_answers(llm, threads, max_tokens)
        load = Load(c.endpoint, threads=threads, max_tokens=max_tokens, expected=expected)
        try:
            worker = c.child("decode-0")

            def streamed() -> float:  # the tokens decode-0 has streamed
                buckets = prometheus_values(worker.metrics_url, "kvserve_inter_token_latency_seconds_bucket")
                return buckets.get('le="+Inf"', 0.0)

            before = streamed()
            wait_until(lambda: streamed() >= before + 8, 120, "decode-0 streaming")  # (the kill catches streams)
            old_pid = worker.pid
            [rank] = _rank_pids(old_pid)
            os.kill(rank, signal.SIGKILL)
            wait_until(lambda: worker.pid != old_pid and worker.answers(), 120, "decode-0 restarted and answering")
            assert len(_rank_pids(worker.pid)) == 1 and not Path(f"/proc/{rank}").exists()
            assert not list(c.shm_dir.glob(f"kvserve-decode-0*-{old_pid}"))  # its pool and its rank's part file
            assert list(c.shm_dir.glob(f"kvserve-decode-0-r1-{worker.pid}"))  # the new one's are there
            count = load.completed
            wait_until(lambda: load.done_since(count) >= 4, 120, "requests completed after the restart")
        finally:
            load.stop()
        assert supervisor.state("decode-0") is State.UP
    assert load.failures == [] and load.wrong == [], (load.failures, load.wrong)
    assert "this worker ends, to be restarted with all its ranks" in (tmp_path / "decode-0.log").read_text()
    assert (tmp_path / "router.log").read_text().count("moving the stream to another") > 0  # caught mid-stream
    assert any(f"decode decode-0 (pid {old_pid}) exited" in m for m in messages), messages


@pytest.mark.soak  # 9 s; the disk tier test below goes through both ranks' host tiers too
def test_the_host_tier_works_over_two_ranks(llm):
    """Every rank keeps a host tier for its heads, and each swap and prefix load is made on each: sequences
    swapped out and back, and prefixes brought back from the host tier, give the tokens of one device without
    preemption."""
    rng = random.Random(5)  # two sequences of 10 4-token blocks growing to 12: a pool of 20 must swap one out
    prompts = [[rng.randrange(100, 40000) for _ in range(38)] for _ in range(2)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, greedy)]  # (one device, a pool that holds everything)
    split = LLM("default", tensor_parallel_size=2, block_size=4, num_blocks=20, host_kv_cache_gb=0.01,
                preemption_mode="swap", max_num_batched_tokens=512)  # fmt: skip
    try:
        assert [o.token_ids for o in split.generate(prompts, greedy)] == want
        stats = split.engine.tiers.stats
        assert stats.swapped_out >= 1 and stats.recomputed == 0 and stats.blocks_loaded >= 1
        split.generate([[rng.randrange(100, 40000) for _ in range(38)]], greedy)  # pushes their blocks to host
        again = split.generate(prompts[:1], greedy)[0]  # its prefix comes back from the host tier
        assert again.token_ids == want[0] and stats.hit_tokens["host"] >= 4 * 6, stats
    finally:
        split.engine.close()


# on demand (~10 s): pytest -m soak tests/cluster/test_tensor_parallel.py
@pytest.mark.soak
def test_ngram_speculation_works_over_two_ranks(engine_prompts):
    """An n-gram speculating engine's verify steps (several rows per sequence) over two ranks: one device's
    tokens, with proposals accepted."""
    greedy = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    copy = [engine_prompts[2][:40] * 2]  # a passage twice: the n-gram finds what comes next
    want = LLM("default", num_blocks=64).generate(copy, greedy)[0].token_ids
    llm = LLM("default", tensor_parallel_size=2, num_blocks=64, speculative_config=spec)
    try:
        assert llm.generate(copy, greedy)[0].token_ids == want
        assert llm.engine.speculator.stats.num_accepted > 0
    finally:
        llm.engine.close()


def test_the_disk_tier_of_two_ranks_holds_whole_heads_that_one_device_reads_back(tmp_path, llm):
    """A disk tier below the host tiers of two ranks: rank 0 writes each block's every head (its own host slot
    and rank 1's, which it maps), so loaded back it gives one device's tokens, and an engine on one device
    started on the same directory (the fingerprint names all heads, not the split) finds the blocks and gives
    the same tokens."""
    rng = random.Random(9)
    prompts = [[rng.randrange(100, 40000) for _ in range(38)] for _ in range(5)]  # 11 blocks of 4 with answers
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, greedy)]
    options = {"block_size": 4, "num_blocks": 24, "disk_kv_cache_dir": str(tmp_path / "kv"), "disk_kv_cache_gb": 0.1,
               "host_kv_cache_gb": 6 * 30 * 2 * 4 * 3 * 64 * 4 / 2**30}  # 6 blocks of all heads (9 of rank 0's 2)
    split = LLM("default", tensor_parallel_size=2, **options)
    try:
        for prompt, tokens in zip(prompts, want, strict=True):  # each pushes those before it down: 24, 9, disk
            assert split.generate([prompt], greedy)[0].token_ids == tokens
        again = split.generate(prompts[:1], greedy)[0]
        assert again.token_ids == want[0] and split.engine.tiers.stats.hit_tokens["disk"] >= 4
    finally:
        split.engine.close()  # (its disk writes flushed)
    one = LLM("default", **options)
    try:
        out = one.generate(prompts[1:2], greedy)[0]
        assert out.token_ids == want[1] and one.engine.tiers.stats.hit_tokens["disk"] >= 4 * 4, one.engine.tiers.stats
    finally:
        one.engine.close()
