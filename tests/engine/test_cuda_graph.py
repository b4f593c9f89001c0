"""The decode fast path: padded, fixed-address decode steps (CUDA graphs on a GPU) give the eager path's tokens.

On the CPU the padded path runs eagerly by default (``enforce_eager`` turns it off), so these tests pin it
token for token against the plain path on the bundled model in fp32: batches that land in several buckets,
sequences that finish at different steps (the batch shrinks through the buckets), preemption and prefix-cache
hits. The GPU cases (marked ``gpu``) check the captured graphs the same way on a random Qwen2-shaped model.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_testing import BLOCK_SIZE, greedy

from engine import LLM
from engine.cuda_graph import decode_buckets, decode_forward

MAX_NUM_SEQS = 16  # buckets 1, 2, 4, 8, 16


def _pair(model: str = "default", **options) -> tuple[LLM, LLM]:
    """(padded decode path, enforce_eager) engines with the same options."""
    options = {"block_size": BLOCK_SIZE, "max_num_seqs": MAX_NUM_SEQS, "dtype": "float32"} | options
    return LLM(model, **options), LLM(model, enforce_eager=True, **options)


def _staggered(n: int, longest: int = 10) -> list:
    """Greedy params whose answers end at different steps, so the decode batch shrinks through the buckets."""
    return [greedy(max_tokens=longest - 3 * (i % 3)) for i in range(n)]


def _nine_prompts(engine_prompts: list[list[int]]) -> list[list[int]]:
    return [*engine_prompts, engine_prompts[5][10:30]]


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    return _pair(num_blocks=256, device="cpu")


def test_buckets_cover_every_decode_batch_the_scheduler_can_form():
    assert decode_buckets(256, 4096) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert decode_buckets(20, 4096) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(3, 4096) == [1, 2, 3]
    assert decode_buckets(64, 12) == [1, 2, 4, 8, 12]  # a decode batch never exceeds the token budget
    assert decode_buckets(4096, 1 << 20)[-1] == 512  # larger decode batches run eagerly


@pytest.mark.parametrize("num_seqs", [1, 3, 9])
def test_padded_decode_equals_eager(engines, engine_prompts, num_seqs):
    padded, eager = engines
    assert padded.engine.runner.decode_inputs is not None and eager.engine.runner.decode_inputs is None
    prompts = _nine_prompts(engine_prompts)[:num_seqs]
    outs = padded.generate(prompts, _staggered(num_seqs))
    expected = eager.generate(prompts, _staggered(num_seqs))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in _staggered(num_seqs)]
    for llm in engines:
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_padded_decode_equals_eager_with_prefix_cache_hits(engines, engine_prompts):
    padded, eager = engines
    long = engine_prompts[6]  # 170 tokens: 10 full blocks to find again
    prompts = [long + [11, 12], engine_prompts[1], long[:100]]
    for llm in engines:
        llm.generate([long], greedy(max_tokens=2))
    outs = padded.generate(prompts, _staggered(3))
    expected = eager.generate(prompts, _staggered(3))
    assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in expected]
    assert outs[0].num_cached_tokens >= 10 * BLOCK_SIZE and outs[2].num_cached_tokens >= 6 * BLOCK_SIZE
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def test_padded_decode_equals_eager_under_preemption(engine_prompts):
    # 14 blocks hold 224 tokens; five prompts (~380 tokens) and their answers (~40) need far more.
    padded, eager = _pair(num_blocks=14, max_num_batched_tokens=64, device="cpu")
    prompts = engine_prompts[3:8]
    outs = padded.generate(prompts, _staggered(5, longest=10))
    expected = eager.generate(prompts, _staggered(5, longest=10))
    assert padded.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert padded.engine.block_manager.num_free_blocks == 14


# -- on a GPU: the captured graphs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_cuda_dir(tmp_path_factory):
    from kvserve.testing.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("qwen2-graphs"), "qwen2-0.5b", num_layers=4,
                              dtype=torch.float32, device="cuda")  # fmt: skip


def _random_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(151936) for _ in range(n)] for n in lengths]


def _cuda_pair(model_dir) -> tuple[LLM, LLM]:
    return _pair(str(model_dir), num_blocks=512, device="cuda", skip_tokenizer_init=True)


@pytest.mark.gpu
def test_graphs_greedy_equals_eager(qwen2_cuda_dir):
    graphs, eager = _cuda_pair(qwen2_cuda_dir)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    prompts = _random_prompts((1, 5, 16, 17, 100, 300, 7, 33, 64))
    for n in (1, 3, 9):
        outs = graphs.generate(prompts[:n], _staggered(n, longest=16))
        expected = eager.generate(prompts[:n], _staggered(n, longest=16))
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected], f"batch of {n}"


@pytest.mark.gpu
def test_graphs_batched_equals_one_at_a_time(qwen2_cuda_dir):
    llm, _ = _cuda_pair(qwen2_cuda_dir)
    prompts = _random_prompts((3, 16, 40, 130, 250))
    alone = [llm.generate([p], greedy(max_tokens=16))[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, greedy(max_tokens=16))]
    assert batched == alone
    assert llm.engine.block_manager.num_free_blocks == llm.engine.runner.num_blocks


@pytest.mark.gpu
@torch.inference_mode()
def test_graph_replay_matches_its_eager_forward(qwen2_cuda_dir):
    """One decode batch, staged once: the replayed graph's logits are the padded forward's, run eagerly."""
    llm, _ = _cuda_pair(qwen2_cuda_dir)
    engine, runner = llm.engine, llm.engine.runner
    for prompt in _random_prompts((5, 20, 70)):
        engine.add_request(prompt, greedy(max_tokens=8))
    engine.step()  # the three prompts' prefill
    batch = engine.scheduler.schedule()
    assert batch.num_decodes == len(batch.seqs) == 3
    bucket = runner.decode_inputs.bucket_for(3)
    assert runner.decode_inputs.stage(bucket, batch.seqs, runner.block_size)
    replayed = runner.graphs.replay(bucket)[:3].clone()
    eager = decode_forward(runner.model, runner.kv_cache.layers, runner.decode_inputs, bucket)[:3]
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
