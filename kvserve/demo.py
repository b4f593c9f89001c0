"""``make demo``: prepare the bundled model and answer three chat prompts with the offline engine."""

from __future__ import annotations

import time

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing readable Python code.",
]


def main(model: str = "default") -> None:
    from engine import LLM, SamplingParams

    llm = LLM(model)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=128))
    elapsed = time.perf_counter() - start
    for question, out in zip(QUESTIONS, outputs, strict=True):
        print(f"\n>>> {question}\n{out.text.strip()}\n    [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    device = llm.engine.runner.device
    print(f"\n{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s (3 prompts batched, {device})")
