"""Why a KV cache: decode tokens/s and KV memory against sequence length, with the cache against none.

    kvserve bench kv-curve [--lengths 64,128,256,512,1024] [--steps 16] [--plot kv_curve.png]

For each length L, one greedy request of an L-token prompt generates ``steps`` tokens two ways, alternating:
with the paged KV cache (each step computes one token and reads the cached K/V of all earlier ones), and
without one (each step recomputes the whole sequence so far, as a model without a cache must). Both produce
the same tokens (checked). KV memory is what the cache holds for L tokens (every layer's K and V), against
none for the recomputing side, which instead does O(L) work per token.
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve.bench import report


def _with_cache(engine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds per decode step (the prefill step excluded) and the tokens."""
    from engine import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    engine.step()  # the prefill and the first token
    start, tokens = time.perf_counter(), []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = out.token_ids
    return (time.perf_counter() - start) / max(1, steps - 1), tokens


def _recomputing(engine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds per token when every token is a fresh pass over the whole sequence (no cache to reuse)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sequence, tokens, elapsed = list(prompt), [], 0.0
    for i in range(steps):
        start = time.perf_counter()
        [out] = engine.generate([sequence], params)
        if i:  # like the cached side, the first token (a prefill on both sides) is not counted
            elapsed += time.perf_counter() - start
        tokens.append(out.token_ids[0])
        sequence.append(out.token_ids[0])
    return elapsed / max(1, steps - 1), tokens


def measure(lengths: list[int], steps: int, seed: int = 0) -> list[dict]:
    from engine import LLM

    share = {"gpu_memory_utilization": 0.4}  # two engines in one process: each its share of a GPU (unused on CPU)
    cached = LLM("default", enable_prefix_caching=False, **share)  # a fresh cache per request: no reuse across lengths
    recompute = LLM("default", enable_prefix_caching=False, **share)
    spec = cached.engine.runner.kv_spec
    kv_bytes_per_token = spec.bytes_per_block() / spec.block_size
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        prompt = [rng.randrange(100, cached.engine.model_config.vocab_size) for _ in range(length)]
        with_s, with_tokens = _with_cache(cached.engine, prompt, steps)
        without_s, without_tokens = _recomputing(recompute, prompt, steps)
        rows.append({"length": length, "cache_tok_s": 1 / with_s, "recompute_tok_s": 1 / without_s,
                     "speedup": without_s / with_s, "kv_mib": length * kv_bytes_per_token / 2**20,
                     "same_tokens": with_tokens == without_tokens})  # fmt: skip
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["length"] for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    speed.plot(lengths, [r["cache_tok_s"] for r in rows], "o-", label="paged KV cache")
    speed.plot(lengths, [r["recompute_tok_s"] for r in rows], "s--", label="no cache (recompute the prefix)")
    speed.set(xlabel="sequence length (tokens)", ylabel="decode tokens/s", xscale="log", yscale="log",
              title="decode speed")  # fmt: skip
    speed.legend()
    memory.plot(lengths, [r["kv_mib"] for r in rows], "o-", label="KV cache")
    memory.plot(lengths, [0 for _ in rows], "s--", label="no cache")
    memory.set(xlabel="sequence length (tokens)", ylabel="KV memory (MiB)", title="memory the cache holds")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench kv-curve", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="64,128,256,512,1024", help="comma-separated prompt lengths")
    parser.add_argument("--steps", type=int, default=16, help="tokens generated per length and side")
    parser.add_argument("--plot", default="kv_curve.png", help="the PNG to write")
    parser.add_argument("--save-result", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first token is a prefill on both sides)")
    rows = measure([int(n) for n in args.lengths.split(",")], args.steps)
    print(report.table(("length", "cache tok/s", "no-cache tok/s", "speedup", "KV MiB", "same tokens"),
                       [(r["length"], r["cache_tok_s"], r["recompute_tok_s"], r["speedup"], r["kv_mib"],
                         r["same_tokens"]) for r in rows]))  # fmt: skip
    plot(rows, args.plot)
    print(f"saved {args.plot}")
    if args.save_result:
        report.save_json(args.save_result, {"rows": rows, "args": vars(args)})
