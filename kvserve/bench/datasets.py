"""The load tool's prompts, as ``BenchRequest``s with known prompt lengths:

* ``random``: random token ids; input and output lengths drawn uniformly from ``len * (1 ± range_ratio)``
  (vLLM's random dataset does the same); sent as token ids, so the input length is exact;
* ``shared-prefix``: ``num_prefixes`` random "system prompts" of ``prefix_len`` tokens, each followed by
  ``questions_per_prefix`` random questions of ``input_len`` tokens, shuffled: what prefix caching serves;
* ``copy``: prompts that ask to repeat a passage of prose or code word for word (those of ``kvserve bench
  offline --speculative``), ``output_len`` tokens each: what n-gram speculative decoding speeds up;
* ``jsonl``: one JSON object per line, ``{"prompt": ...}`` (or ``"text"``), or a ShareGPT conversation
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`` (a JSON array
  of those is read too): the first human turn is the prompt and, when the reply follows, its token count
  is the output length (else ``output_len``); prompt lengths are counted with the model's tokenizer.

Token ids are drawn from ``[100, vocab_size)``, clear of the special tokens at the bottom of the vocabulary.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engine.tokenizer import Tokenizer
from kvserve.bench.loadgen import BenchRequest

DATASETS = ("random", "shared-prefix", "copy", "jsonl")
_FIRST_ID = 100


def _length(mean: int, range_ratio: float, rng: random.Random) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def _ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab_size) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:  # fmt: skip
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt = _ids(_length(input_len, range_ratio, rng), vocab_size, rng)
        requests.append(BenchRequest(prompt, _length(output_len, range_ratio, rng), len(prompt)))
    return requests


def shared_prefix_requests(num_prefixes: int, questions_per_prefix: int, prefix_len: int, input_len: int,
                           output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:  # fmt: skip
    if num_prefixes < 1 or questions_per_prefix < 1:
        raise ValueError("shared-prefix needs at least one prefix and one question per prefix")
    rng = random.Random(seed)
    prefixes = [_ids(prefix_len, vocab_size, rng) for _ in range(num_prefixes)]
    requests = []
    for prefix in prefixes:
        for _ in range(questions_per_prefix):
            prompt = prefix + _ids(input_len, vocab_size, rng)
            requests.append(BenchRequest(prompt, output_len, len(prompt)))
    rng.shuffle(requests)
    return requests


def copy_requests(num: int, tokenizer: Tokenizer, output_len: int) -> list[BenchRequest]:
    from kvserve.bench.speculative import copy_prompts

    return [BenchRequest(prompt, output_len, len(tokenizer.encode(prompt))) for prompt in copy_prompts(num)]


def jsonl_requests(path: str | Path, tokenizer: Tokenizer, output_len: int) -> list[BenchRequest]:
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    requests = []
    for i, item in enumerate(items):
        prompt, reply = _prompt_and_reply(item)
        if not prompt:
            raise ValueError(f"{path}: entry {i} has no prompt (expected 'prompt', 'text' or 'conversations')")
        max_tokens = len(tokenizer.encode(reply)) if reply else output_len
        requests.append(BenchRequest(prompt, max(1, max_tokens), len(tokenizer.encode(prompt))))
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    return requests


def _prompt_and_reply(item: dict) -> tuple[str, str]:
    if "conversations" in item:
        turns = item["conversations"]
        for i, turn in enumerate(turns):
            if turn.get("from") in ("human", "user"):
                following = turns[i + 1] if i + 1 < len(turns) else {}
                reply = following.get("value", "") if following.get("from") in ("gpt", "assistant") else ""
                return turn.get("value", ""), reply
        return "", ""
    return item.get("prompt") or item.get("text") or "", ""
