"""Offline throughput: the engine's ``LLM.generate`` against transformers' batched ``generate``, same run.

    kvserve bench offline [--num-prompts 64] [--min-len 16] [--max-len 256] [--max-tokens 64]

Both sides get the same prompts (random token ids of random lengths, seeded),
produce exactly ``max_tokens`` new tokens each (EOS ignored), run in the same
dtype with the same number of threads, and are timed after a warm-up.
Transformers gets all prompts in one left-padded batch.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def run_engine(llm, prompts, max_tokens) -> tuple[float, list[list[int]]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def run_transformers(model_dir, prompts, max_tokens, dtype, device) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # same work as ignore_eos
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench offline", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="share of free GPU memory for the KV pool (transformers needs the rest)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="time only the engine")
    args = parser.parse_args(argv)

    from engine import LLM

    # Token-id prompts in, token ids out: no tokenizer needed (random models of real shapes have none).
    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, skip_tokenizer_init=True,
              gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, llm.engine.model_config.vocab_size)
    new_tokens = args.num_prompts * args.max_tokens
    print(
        f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.max_tokens} new tokens each, "
        f"dtype {llm.engine.runner.dtype}, device {llm.engine.runner.device}, {torch.get_num_threads()} threads"
    )
    engine_s, engine_tokens = run_engine(llm, prompts, args.max_tokens)
    print(f"kvserve engine : {engine_s:7.2f} s  {new_tokens / engine_s:8.1f} output tokens/s")
    if args.skip_hf:
        return
    from engine.bundled import resolve_model

    runner = llm.engine.runner
    hf_s, hf_tokens = run_transformers(resolve_model(args.model), prompts, args.max_tokens, runner.dtype, runner.device)
    print(f"transformers   : {hf_s:7.2f} s  {new_tokens / hf_s:8.1f} output tokens/s")
    print(f"speed-up       : {hf_s / engine_s:.2f}x")
    same = sum(a == b for a, b in zip(engine_tokens, hf_tokens, strict=True))
    print(f"identical greedy outputs: {same}/{len(prompts)} (padding changes transformers' numerics slightly)")


if __name__ == "__main__":
    main()
