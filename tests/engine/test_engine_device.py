"""The engine on each device, on a random model of Qwen2-0.5B's width (14:2 heads, d 64, q/k/v biases).

On CUDA the attention runs in the Triton kernels (``kvkernels.use_triton``), on the
CPU in the PyTorch references; the CUDA cases are marked ``gpu`` and run on the
GPU machine, which cannot download real weights. The CPU cases check the same
test code in the normal suite. Checks: fp32 greedy equals transformers; batched
equals one at a time and chunked prefill (a paged prefix) equals whole; and the
logits of every cached decode step stay within a stated relative error of
transformers' fp32 logits for bf16, ``int8_v`` and ``int8`` KV.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_testing import forward_tokens

import kvkernels
from engine import LLM, SamplingParams

NEW_TOKENS = 16
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.gpu,
    ),  # fmt: skip
]
# Relative L2 error of the last position's logits against transformers in fp32, per (model dtype, KV dtype).
# Measured on the CPU references (2 layers): bf16 ~1e-2; the GPU run records its own figures.
LOGIT_ERROR_BOUND = {("float32", "auto"): 1e-4, ("bfloat16", "auto"): 0.05, ("bfloat16", "int8_v"): 0.06,
                     ("bfloat16", "int8"): 0.08}  # fmt: skip


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


# On the CPU, 2 layers and a vocabulary of 8,192: Qwen2's 151,936-token LM head alone would cost as much per token
# as the whole bundled model. The GPU case has the real vocabulary and 4 layers.
VOCAB_SIZE = {"cpu": 8192, "cuda": 151936}


@pytest.fixture(scope="module")
def model_dir(device, tmp_path_factory):
    from kvserve.testing.random_model import write_random_model

    cpu = device == "cpu"
    return write_random_model(tmp_path_factory.mktemp(f"qwen2-{device}"), "qwen2-0.5b", num_layers=2 if cpu else 4,
                              dtype=torch.float32, device=device,
                              overrides={"vocab_size": VOCAB_SIZE[device]})  # fmt: skip


@pytest.fixture(scope="module")
def hf_model(model_dir, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()


@pytest.fixture(scope="module")
def prompts(device) -> list[list[int]]:
    rng = random.Random(0)
    lengths = (1, 5, 16, 17, 100, 300, 1000) if device == "cuda" else (1, 5, 16, 17, 100)
    return [[rng.randrange(VOCAB_SIZE[device]) for _ in range(n)] for n in lengths]


def _llm(model_dir, device, **options) -> LLM:
    # 16 sequences at most: 5 decode graphs to capture on CUDA instead of 35 (the batches here are smaller)
    options = {"block_size": 16, "num_blocks": 256, "dtype": "float32", "max_num_seqs": 16} | options
    return LLM(str(model_dir), device=device, skip_tokenizer_init=True, **options)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@torch.inference_mode()
def test_fp32_greedy_equals_transformers(model_dir, hf_model, prompts, device):
    llm = _llm(model_dir, device)
    assert kvkernels.use_triton(llm.engine.runner.device) == (device == "cuda")
    for prompt in prompts:
        (out,) = llm.generate([prompt], GREEDY)
        ids = torch.tensor([prompt], device=device)
        expected = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)  # fmt: skip
        assert out.token_ids == expected[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


def test_batched_and_chunked_equal_one_at_a_time(model_dir, prompts, device):
    llm = _llm(model_dir, device)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    chunked_llm = _llm(model_dir, device, max_num_batched_tokens=48)  # prompts cross chunks: a paged prefix
    chunked = [o.token_ids for o in chunked_llm.generate(prompts, GREEDY)]
    assert batched == alone
    assert chunked == alone
    assert llm.engine.block_manager.num_free_blocks == llm.engine.runner.num_blocks


@pytest.mark.parametrize("dtype, kv_cache_dtype", list(LOGIT_ERROR_BOUND))
@torch.inference_mode()
def test_cached_decode_logits_track_transformers(model_dir, hf_model, prompts, device, dtype, kv_cache_dtype):
    """Prefill a prompt, then decode 8 steps from the cache; compare each step's logits with transformers'."""
    runner = _llm(model_dir, device, dtype=dtype, kv_cache_dtype=kv_cache_dtype).engine.runner
    block_table = list(range(runner.num_blocks - 1, runner.num_blocks - 1 - 80, -1))  # reversed: not contiguous
    tokens = list(prompts[4])
    logits = forward_tokens(runner, tokens, 0, block_table)[-1]
    worst = 0.0
    for _ in range(8):
        expected = hf_model(torch.tensor([tokens], device=device)).logits[0, -1]
        error = float((logits.float() - expected).norm() / expected.norm())
        worst = max(worst, error)
        tokens.append(int(expected.argmax()))  # teacher forcing: both sides see the same tokens
        logits = forward_tokens(runner, tokens[-1:], len(tokens) - 1, block_table)[-1]
    print(f"{device} {dtype} kv {kv_cache_dtype}: worst relative logit error {worst:.2e}")
    assert worst <= LOGIT_ERROR_BOUND[(dtype, kv_cache_dtype)]
