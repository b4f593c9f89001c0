"""The cluster on one GPU: each worker keeps to its share of the GPU's total memory, and the KV goes from the
prefill worker to the decode worker through cuda_ipc with the offline engine's greedy tokens.

The memory arithmetic and the shares are checked on the CPU; the cluster itself on a CUDA device (``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from engine.memory import kv_cache_budget
from kvserve.launcher.plan import gpu_memory_shares

GIB = 1 << 30


def test_kv_budget_is_the_share_of_total_memory_less_what_the_process_holds():
    # an H200's 141 GiB, a 0.5 share: 70.5 GiB, less 1 GiB of weights and 1.75 GiB of headroom
    budget = kv_cache_budget(total=141 * GIB, free=100 * GIB, utilization=0.5, used=GIB, headroom=7 * GIB // 4)
    assert budget == int(141 * GIB * 0.5) - GIB - 7 * GIB // 4


def test_kv_budget_does_not_depend_on_who_started_first():
    # the second process on the GPU gets the same budget as the first, whatever the first took
    first = kv_cache_budget(total=80 * GIB, free=79 * GIB, utilization=0.4, used=GIB, headroom=GIB)
    second = kv_cache_budget(total=80 * GIB, free=45 * GIB, utilization=0.4, used=GIB, headroom=GIB)
    assert first == second == int(80 * GIB * 0.4) - 2 * GIB


def test_kv_budget_refuses_a_share_that_leaves_nothing():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 leaves no room for the KV cache"):
        kv_cache_budget(total=16 * GIB, free=15 * GIB, utilization=0.1, used=GIB, headroom=GIB)


def test_kv_budget_refuses_more_than_is_free():
    with pytest.raises(ValueError, match=r"only 10.00 GiB free .*lower gpu_memory_utilization"):
        kv_cache_budget(total=80 * GIB, free=10 * GIB, utilization=0.5, used=GIB, headroom=GIB)


def test_gpu_shares_split_each_role_between_its_workers():
    assert gpu_memory_shares(0.35, 0.5, 1, 1) == {"prefill": 0.35, "decode": 0.5}
    assert gpu_memory_shares(0.4, 0.5, 2, 4) == {"prefill": 0.2, "decode": 0.125}


REFUSED_SHARES = [(0.6, 0.5, "add up to more than the whole GPU"), (0, 0.5, "prefill GPU memory utilization must be"),
                  (0.3, 1.5, "decode GPU memory utilization must be")]  # fmt: skip


@pytest.mark.parametrize(("prefill", "decode", "message"), REFUSED_SHARES)
def test_gpu_shares_refuse_what_does_not_fit(prefill, decode, message):
    with pytest.raises(ValueError, match=message):
        gpu_memory_shares(prefill, decode, 1, 1)


PROMPT_LENGTHS = (5, 16, 40, 100, 300)
NEW_TOKENS = 16


@pytest.mark.gpu
def test_1p1d_on_one_gpu_hands_off_by_cuda_ipc_with_the_offline_engines_tokens(tmp_path):
    import random

    from cluster_utils import free_base_port

    from engine import LLM, SamplingParams
    from kvserve.client import Client
    from kvserve.launcher.cluster import start_cluster
    from kvserve.settings import parse_up
    from kvserve.testing.random_model import write_random_model

    model = write_random_model(tmp_path / "qwen2", "qwen2-0.5b", num_layers=4, device="cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(model), device="cuda", skip_tokenizer_init=True, num_blocks=256, max_num_seqs=8)
    expected = [llm.generate([p], params)[0].token_ids for p in prompts]  # one at a time, like the cluster
    torch.cuda.empty_cache()  # the workers' shares are of the whole GPU: leave them the free memory
    cluster = start_cluster(parse_up(["--model", str(model), "--device", "cuda", "--skip-tokenizer-init", "true",
                                      "--max-num-seqs", "8", "--port", str(free_base_port(2)), "--http-port", "0",
                                      "--prefill-gpu-memory-utilization", "0.2",
                                      "--decode-gpu-memory-utilization", "0.3",
                                      "--log-dir", str(tmp_path)]))  # fmt: skip
    try:
        with Client(cluster.endpoint, timeout_s=120) as client:
            results = [client.generate(p, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]
    finally:
        cluster.stop()
    assert [r.transfer_backend for r in results] == ["cuda_ipc"] * len(prompts)
    assert {r.prefill_worker for r in results} == {"prefill-0"}
    assert [r.token_ids for r in results] == expected
