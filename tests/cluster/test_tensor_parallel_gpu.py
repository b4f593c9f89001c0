"""Tensor parallelism over two GPUs (NCCL), run by scripts/gpu_check.sh's ``tp-tests`` step on a machine of two
or more GPUs (``two_gpus``; skipped elsewhere, and left out of its one-GPU ``gpu-tests`` step):

* every rank captures its decode CUDA graphs, all-reduces and the logits' gather inside them
  (``engine.tensor_parallel_model.ShardedDecode``), and greedy tokens equal one GPU's eager engine's and the
  split engine's own eager steps', within ``tensor_parallel_testing``'s tolerance (float32: sums in other orders);
* a rank hung in a replayed collective fails the step within ``tensor_parallel_timeout_s`` (``RankLost``);
* rank 0 reaches rank 1's part of the KV pool through CUDA IPC (``kvstore.ipc_pool``): the KV it reads there
  is what one GPU computes for those heads, and what it writes there the rank's next step reads;
* 1P+1D clusters at TP 2 -> 1 and 1 -> 2 hand every prompt's KV over ``cuda_ipc``, each decode rank's heads
  from the prefill ranks that hold them, with the offline engine's tokens.

The protocol of the decode steps and of the split hand-offs is tested on the CPU (gloo, pool files):
tests/cluster/test_tensor_parallel.py and tests/unit/test_split_pool.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensor_parallel_testing import assert_same_greedy

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.two_gpus,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="two_gpus: tensor parallelism over NCCL needs two or more GPUs"),  # fmt: skip
]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
LENGTHS = (5, 16, 40, 100, 7, 33, 64, 17, 250)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvserve.testing.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("qwen2"), "qwen2-0.5b", num_layers=4, dtype=torch.float32,
                              device="cuda")  # fmt: skip


def _prompts(lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 150000) for _ in range(n)] for n in lengths]


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cuda", dtype="float32", skip_tokenizer_init=True, num_blocks=256,
               max_num_seqs=16, **kwargs)  # fmt: skip


def test_split_decode_graphs_give_one_gpus_tokens_and_their_own_eager_steps(model_dir):
    split = _llm(model_dir, tensor_parallel_size=2)
    graphs = split.engine.runner.graphs
    assert graphs.steps.graphs is not None, "the ranks captured no decode graph"
    replays, replay = [], graphs.replay
    graphs.replay = lambda bucket: replays.append(bucket) or replay(bucket)
    prompts = _prompts()
    outputs = [split.generate(prompts[:n], PARAMS) for n in (1, 3, 9)]  # buckets 1, 4 and 16
    split.engine.close()
    assert {1, 4, 16} <= set(replays), replays
    for enforce_eager, tensor_parallel_size in ((True, 2), (True, 1)):
        eager = _llm(model_dir, tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager)
        for n, got in zip((1, 3, 9), outputs, strict=True):
            ties = assert_same_greedy(eager.generate(prompts[:n], PARAMS), got)
            print(f"TP={tensor_parallel_size} eager against TP=2 graphs, batch {n}: near ties {ties}")
        eager.engine.close()
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_rank_zero_reaches_rank_ones_kv_through_cuda_ipc(model_dir):
    from kvstore.split_pool import SplitPool
    from transfer.blocks import read_blocks, write_blocks

    split, one = _llm(model_dir, tensor_parallel_size=2), _llm(model_dir)
    runner = split.engine.runner
    assert [p.buffer.device for p in runner.kv_pool.parts] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert len(runner.kv_part_handles) == 1
    [prompt] = _prompts((48,))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    first = split.generate([prompt], params)[0]
    one.generate([prompt], params)  # the prompt's 3 full blocks stay cached on both
    blocks = [b.block_id for b in split.engine.block_manager.match_prefix(prompt)]
    theirs = [b.block_id for b in one.engine.block_manager.match_prefix(prompt)]
    assert len(blocks) == len(theirs) == 3
    # layer 0's K and V of every head, rank 1's read through the IPC mapping, against one GPU's own pool
    layer0 = runner.kv_pool.spec.bytes_per_block() // runner.kv_pool.spec.num_layers  # (region-major: K, V)
    for mine, want in zip(blocks, theirs, strict=True):
        got = torch.frombuffer(bytearray(read_blocks(runner.kv_pool, [mine])[:layer0]), dtype=torch.float32)
        ref = torch.frombuffer(bytearray(read_blocks(one.engine.runner.kv_cache, [want])[:layer0]), dtype=torch.float32)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    one.engine.close()
    # what rank 0 writes into rank 1's part is what rank 1 reads: the cached prompt again gives the same
    # log-probability, and with rank 1's heads of its blocks zeroed here another one
    again = split.generate([prompt], params)[0]
    assert again.num_cached_tokens >= 32, again.num_cached_tokens
    (token, logprob), before = again.logprobs[0].top[0], first.logprobs[0].top[0]
    assert token == before[0] and abs(logprob - before[1]) < 1e-4, (again.logprobs[0].top, first.logprobs[0].top)
    rank_one = runner.kv_pool.parts[1]
    write_blocks(SplitPool([rank_one]), blocks, bytes(len(blocks) * rank_one.spec.bytes_per_block()))
    zeroed = split.generate([prompt], params)[0].logprobs[0].top[0]
    assert zeroed[0] != before[0] or abs(zeroed[1] - before[1]) > 1e-3, (zeroed, before)
    split.engine.close()


def _cross_tp_cluster_on_gpus(tmp_path, prefill_tp: int, decode_tp: int) -> None:
    from cluster_utils import free_base_port

    from kvserve.client import Client
    from kvserve.launcher.cluster import start_cluster
    from kvserve.settings import parse_up

    model = tmp_path / "qwen2"
    from kvserve.testing.random_model import write_random_model

    write_random_model(model, "qwen2-0.5b", num_layers=4, dtype=torch.float32, device="cuda")
    prompts = _prompts((9, 33, 20, 41, 12, 27, 60, 17, 35, 48, 5, 70))
    offline = _llm(model)
    want = [offline.generate([p], PARAMS)[0] for p in prompts]
    offline.engine.close()
    torch.cuda.empty_cache()  # the workers' shares are of the whole GPU: leave them the free memory
    cluster = start_cluster(parse_up(["--model", str(model), "--device", "cuda", "--dtype", "float32",
                                      "--skip-tokenizer-init", "true", "--max-num-seqs", "16",
                                      "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                                      "--port", str(free_base_port(2)), "--http-port", "0",
                                      "--prefill-gpu-memory-utilization", "0.2",
                                      "--decode-gpu-memory-utilization", "0.3",
                                      "--log-dir", str(tmp_path)]))  # fmt: skip
    try:
        with Client(cluster.endpoint, timeout_s=180) as client:
            results = [client.generate(p, temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
                       for p in prompts]  # fmt: skip
    finally:
        cluster.stop()
    assert [r.transfer_backend for r in results] == ["cuda_ipc"] * len(prompts)
    print(f"TP {prefill_tp} -> {decode_tp} over cuda_ipc: near ties {assert_same_greedy(want, results)}")
    for role, size in (("prefill", prefill_tp), ("decode", decode_tp)):
        log = (tmp_path / f"{role}-0.log").read_text()
        assert ("tensor parallel: 2 ranks (NCCL)" in log) == (size == 2)
    assert "checksum" not in (tmp_path / "decode-0.log").read_text().lower()


def test_a_prefill_worker_at_tp2_hands_its_kv_to_a_decode_worker_at_tp1_over_cuda_ipc(tmp_path):
    _cross_tp_cluster_on_gpus(tmp_path, 2, 1)


def test_a_prefill_worker_at_tp1_hands_its_kv_to_a_decode_worker_at_tp2_over_cuda_ipc(tmp_path):
    _cross_tp_cluster_on_gpus(tmp_path, 1, 2)


HUNG_RANK = """
import os, signal, sys, time
from engine import LLM, SamplingParams
from engine.models.tensor_parallel import RankLost
llm = LLM(sys.argv[1], device="cuda", dtype="float32", skip_tokenizer_init=True, num_blocks=64, max_num_seqs=4,
          tensor_parallel_size=2, tensor_parallel_timeout_s=10)
engine = llm.engine
engine.add_request(list(range(100, 120)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
engine.step(), engine.step()  # the prefill, then a decode step replayed on both ranks
rank = engine.runner.ranks._processes[0]
os.kill(rank.pid, signal.SIGSTOP)
began = time.monotonic()
try:
    while engine.has_unfinished_requests():
        engine.step()
    print("every step finished", flush=True)
except RankLost as error:
    print(f"RankLost after {time.monotonic() - began:.1f} s: {error}", flush=True)
os.kill(rank.pid, signal.SIGKILL)
os._exit(0)  # (the stuck collective holds this process's stream: no clean exit)
"""


def test_a_hung_rank_fails_a_replayed_decode_step_within_the_timeout(model_dir):
    """A graph's collectives have no watchdog: ``ShardedDecode`` waits for each replayed step with
    ``tensor_parallel_timeout_s`` (``wait_for_device``). In a process of its own, whose stream stays stuck."""
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", HUNG_RANK, str(model_dir)], capture_output=True, text=True,
                         timeout=180, env=env)  # fmt: skip
    found = re.search(r"RankLost after ([\d.]+) s: .*tensor_parallel_timeout_s", run.stdout)
    assert found, (run.stdout[-2000:], run.stderr[-2000:])
    assert float(found.group(1)) < 30
