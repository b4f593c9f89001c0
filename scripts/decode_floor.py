"""One user's decode step on this CPU against the memory-bandwidth floor, compiled and eager, in one run.

    .venv/bin/python scripts/decode_floor.py [--prompt-len 256] [--steps 48] [--rounds 4]

The floor is the bytes a decode step must read (every weight once, and the sequence's KV) divided by this
host's read bandwidth, measured here as ``torch.sum`` over a 256 MiB float32 tensor on every thread (a
STREAM-style read, the median of ten). Two engines on the bundled model, one with ``compile_decode`` and one
without, decode the same greedy prompt; rounds alternate which goes first, against this machine's drift, and
each figure is the median of the rounds. The two must give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLMEngine, SamplingParams


def read_gbs(repeats: int = 10) -> float:
    """The median of ``repeats`` reads of 256 MiB of random floats, in GB/s (a tensor of ones read at nearly
    twice that here, and so does the best of several reads: neither is what a step's weights get)."""
    data = torch.randn(64 << 20)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(seconds) / 1e9


def decode_ms(engine: LLMEngine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Milliseconds per decode step of ``prompt`` alone after its prefill, and its tokens."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # the prefill and the first token
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        outputs = engine.step()
    elapsed = time.perf_counter() - start
    return elapsed / steps * 1e3, outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    options = dict(model="default", device="cpu", dtype="float32", num_blocks=64, max_num_seqs=4,
                   enable_prefix_caching=False, skip_tokenizer_init=True)  # fmt: skip
    engines = {"compiled": LLMEngine(compile_decode=True, **options), "eager": LLMEngine(**options)}
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            ms, tokens[name] = decode_ms(engines[name], prompt, args.steps)
            times[name].append(ms)
    assert tokens["compiled"] == tokens["eager"], "compiled and eager decoding gave different tokens"
    model = engines["eager"].runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = engines["eager"].model_config
    length = args.prompt_len + args.steps // 2 + 2  # the sequence's mean length over the timed steps
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * length
    gbs = read_gbs()
    floor_ms = (weight_bytes + kv_bytes) / gbs / 1e6
    print(f"read bandwidth {gbs:.1f} GB/s on {torch.get_num_threads()} threads; a step reads "
          f"{weight_bytes / 1e6:.0f} MB of weights and {kv_bytes / 1e6:.1f} MB of KV: floor {floor_ms:.1f} ms")
    for name, runs in times.items():
        ms = statistics.median(runs)
        print(f"{name:>9}: {ms:.1f} ms a token (rounds: {' '.join(f'{t:.1f}' for t in runs)}), "
              f"{ms / floor_ms:.2f}x the floor, {weight_bytes / ms / 1e6:.1f} GB/s of weights")
    print(f"compiled/eager: {statistics.median(times['compiled']) / statistics.median(times['eager']):.2f}x")


if __name__ == "__main__":
    main()
