"""One user's decode step on this CPU against the memory-bandwidth floor, compiled and eager, in one run.

    .venv/bin/python scripts/decode_floor.py [--prompt-len 256] [--steps 48] [--rounds 4]

The floor is the bytes a decode step must read (every float32 weight once, and the sequence's KV; the compiled
greedy step reads the LM head's bfloat16 copy instead, and the floor of those bytes is printed too) over this
host's read bandwidth, measured here as ``torch.sum`` over a 256 MiB float32 tensor on every thread (a
STREAM-style read, the median of ten). Two engines on the bundled model, one with ``compile_decode`` and one
without, decode the same greedy prompt; rounds alternate which goes first, against this machine's drift, and
each figure is the median of the rounds. The two must give the same tokens.

The bandwidth is measured right before each engine's decode in every round, and each decode is divided by
the floor of its own moment: this machine's read bandwidth moves by a third over minutes (31 to 54 GB/s in one
session), so a floor from one probe at the end of the run misstates the ratio by as much.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLMEngine, SamplingParams
from engine.heap import freeze_startup_heap, keep_freed_memory


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


def weights_read_ms(model: torch.nn.Module, repeats: int = 5) -> float:
    """The median milliseconds that ``torch.sum`` takes to read every parameter of ``model`` once, one tensor
    at a time in the model's order: the same bytes as a step's, in reads of the sizes a step makes (a layer's
    matrices are 1.3 to 7 MB). What a step takes over this is the step's own cost: its products' kernels, the
    rest of each layer, the calls between."""
    params = [p.detach() for p in model.parameters()]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for param in params:
            param.sum()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


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
    freeze_startup_heap()  # as a worker does once started (engine.heap)
    keep_freed_memory()
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    model = engines["eager"].runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = engines["eager"].model_config
    length = args.prompt_len + args.steps // 2 + 2  # the sequence's mean length over the timed steps
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * length
    times: dict[str, list[float]] = {name: [] for name in engines}
    ratios: dict[str, list[float]] = {name: [] for name in engines}
    bandwidths, reads = [], []
    tokens = {}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            bandwidths.append(read_gbs())
            reads.append(weights_read_ms(model))
            ms, tokens[name] = decode_ms(engines[name], prompt, args.steps)
            times[name].append(ms)
            ratios[name].append(ms / ((weight_bytes + kv_bytes) / bandwidths[-1] / 1e6))
    assert tokens["compiled"] == tokens["eager"], "compiled and eager decoding gave different tokens"
    gbs = statistics.median(bandwidths)
    floor_ms = (weight_bytes + kv_bytes) / gbs / 1e6
    print(
        f"read bandwidth {gbs:.1f} GB/s on {torch.get_num_threads()} threads (probes: "
        f"{' '.join(f'{b:.0f}' for b in bandwidths)}); a step reads {weight_bytes / 1e6:.0f} MB of weights and "
        f"{kv_bytes / 1e6:.1f} MB of KV: floor {floor_ms:.1f} ms at the median"
    )
    for name, runs in times.items():
        ms = statistics.median(runs)
        print(
            f"{name:>9}: {ms:.1f} ms a token (rounds: {' '.join(f'{t:.1f}' for t in runs)}), "
            f"{statistics.median(ratios[name]):.2f}x its moment's floor (rounds: "
            f"{' '.join(f'{x:.2f}' for x in ratios[name])}), {weight_bytes / ms / 1e6:.1f} GB/s of weights"
        )
    greedy = engines["compiled"].runner.model.compiled.greedy
    if greedy is not None:  # the float32 head's bytes are the floor's; the step reads its bfloat16 copy
        head = greedy.weight
        read_bytes = weight_bytes - head.numel() * (head.element_size() - greedy.shadow.element_size())
        own = statistics.median(ratios["compiled"]) * (weight_bytes + kv_bytes) / (read_bytes + kv_bytes)
        print(
            f"the compiled greedy step reads the LM head in bfloat16 (GreedyHead): {read_bytes / 1e6:.0f} MB of "
            f"weights, {own:.2f}x the floor of what it reads"
        )
    read_ms = statistics.median(reads)
    print(
        f"reading the weights tensor by tensor (torch.sum): {read_ms:.1f} ms (rounds: "
        f"{' '.join(f'{t:.1f}' for t in reads)}); compiled/that: "
        f"{statistics.median(times['compiled']) / read_ms:.2f}x"
    )
    print(f"compiled/eager: {statistics.median(times['compiled']) / statistics.median(times['eager']):.2f}x")


if __name__ == "__main__":
    main()
