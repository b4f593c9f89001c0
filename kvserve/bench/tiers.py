"""What the host KV tier buys: multi-turn TTFT with a device pool too small for the conversations, and the
time to resume a preempted sequence, swapped against recomputed.

    kvserve bench tiers [--users 8] [--turns 6] [--turn-tokens 300] [--device-fraction 0.25]
                        [--resume-tokens 2000] [--plot tiers.png] [--save-result tiers.json]
    kvserve bench tiers --bandwidth-only [--device cuda] [--model DIR]

**Multi-turn** (SGLang HiCache's benchmark shape): ``users`` conversations of ``turns`` turns each; a turn
sends the whole history plus ``turn-tokens`` new tokens (the user's message and the last answer), one
request at a time, turn-major (every user's turn 1, then every user's turn 2, ...). Three engines run the
same requests, taking turns request by request: one with a host tier (L2) big enough for every conversation
and one without, both with a device pool of ``device-fraction`` of the final working set, so most of a
user's history has been evicted by the others before they speak again; and the floor, a device pool that
holds every conversation, which computes only each turn's new tokens and copies nothing (no tier can beat
it). Reported: TTFT p50/p99 (request added to first token) and throughput (prompt and answer tokens per
second of engine time) for each, their ratios, and that all answered every turn with the same tokens.
Target: TTFT p50 with L2 <= 0.33x without.

**Resume**: a ``resume-tokens`` prompt is preempted by a shorter sequence admitted before it that grows
into the last free block; when that one ends it comes back, either swapped back from the host tier or
recomputed (prefix caching off on both, so the pool's own cache cannot serve it). Reported: the step that
resumes it, each way (median of ``repeats`` alternating runs). Target: swap <= 0.2x recompute.

**Bandwidth** (``--bandwidth-only``, in ``scripts/gpu_check.sh``): GB/s of the host tier's store (device
pool -> host rows) and load (host rows -> device pool) for batches of blocks of a model's KV layout, against
one plain copy of the same bytes between a contiguous pinned host tensor and the device, alternating.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.bench import report

_ANSWER_TOKENS = 8  # each turn's answer: short, so the bench measures prefills (TTFT), not decoding
FLOOR = "all in device"  # a pool that holds every conversation: what any lower tier could at best reach


def _first_token_s(engine, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT, whole request, tokens) of one request run alone to its end."""
    from engine import SamplingParams

    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    ttft = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - start
                if out.finished:
                    tokens = out.token_ids
    return ttft, time.perf_counter() - start, tokens


def multi_turn(users: int, turns: int, turn_tokens: int, device_fraction: float, host_gb: float,
               block_size: int = 16, seed: int = 0) -> dict:  # fmt: skip
    from engine import LLM

    working_set = users * turns * turn_tokens
    num_blocks = max(8, int(working_set * device_fraction) // block_size)
    common = {"block_size": block_size, "num_blocks": num_blocks, "gpu_memory_utilization": 0.4}
    everything = {**common, "num_blocks": -(-(working_set + users * block_size) // block_size)}
    engines = {"without": LLM("default", host_kv_cache_gb=0, **common).engine,
               "with L2": LLM("default", host_kv_cache_gb=host_gb, **common).engine,
               FLOOR: LLM("default", host_kv_cache_gb=0, **everything).engine}  # fmt: skip
    vocab = engines["without"].model_config.vocab_size
    rng = random.Random(seed)
    history = [[] for _ in range(users)]
    rows = []
    answers = {name: [] for name in engines}
    for turn in range(turns):
        for user in range(users):
            message = [rng.randrange(100, vocab) for _ in range(turn_tokens - _ANSWER_TOKENS)]
            prompt = history[user] + message
            row = {"turn": turn + 1, "user": user, "prompt_tokens": len(prompt)}
            shift = (turn * users + user) % len(engines)  # each side goes first, second, ... in turn
            order = list(engines)[shift:] + list(engines)[:shift]
            for name in order:
                ttft, total, tokens = _first_token_s(engines[name], prompt, _ANSWER_TOKENS)
                row[f"{name} ttft_s"], row[f"{name} total_s"] = ttft, total
                answers[name].append(tokens)
            rows.append(row)
            history[user] = prompt + answers["without"][-1]
    result = {"rows": rows, "num_blocks": num_blocks, "working_set_tokens": working_set,
              "same_tokens": answers["without"] == answers["with L2"] == answers[FLOOR],
              "host_hits": engines["with L2"].tiers.stats.hit_tokens["host"]}  # fmt: skip
    for name in engines:
        ttfts = [r[f"{name} ttft_s"] for r in rows]
        tokens = sum(r["prompt_tokens"] + _ANSWER_TOKENS for r in rows)
        result[name] = {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": _p99(ttfts),
                        "tokens_per_s": tokens / sum(r[f"{name} total_s"] for r in rows)}  # fmt: skip
    for engine in engines.values():
        engine.close()
    return result


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def resume(resume_tokens: int, repeats: int, block_size: int = 16, seed: int = 0) -> dict:
    """Seconds of the step that brings a preempted ``resume_tokens`` sequence back, swap and recompute."""
    from engine import LLM, SamplingParams

    rng = random.Random(seed)
    blocks = -(-(resume_tokens + 1) // block_size)
    engines = {}
    for mode in ("swap", "recompute"):  # room for the long one and the short one's first block, no more
        engines[mode] = LLM("default", block_size=block_size, num_blocks=blocks + 1, enable_prefix_caching=False,
                            host_kv_cache_gb=blocks * 2.5e-3, preemption_mode=mode, gpu_memory_utilization=0.4,
                            max_num_batched_tokens=max(4096, resume_tokens + 64)).engine  # fmt: skip
    vocab = engines["swap"].model_config.vocab_size
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    tokens: dict[str, list[list[int]]] = {mode: [] for mode in engines}
    for rep in range(repeats):
        long_prompt = [rng.randrange(100, vocab) for _ in range(resume_tokens)]
        short_prompt = [rng.randrange(100, vocab) for _ in range(block_size - 2)]
        for mode in (("swap", "recompute") if rep % 2 == 0 else ("recompute", "swap")):
            engine = engines[mode]
            short = engine.add_request(short_prompt, SamplingParams(temperature=0, max_tokens=3 * block_size,
                                                                    ignore_eos=True))  # fmt: skip
            engine.step()  # the short one is admitted first, so the long one is the preemption's victim
            rid = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            resumed_s, out_tokens = None, []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                outs = engine.step()
                elapsed = time.perf_counter() - start
                for out in outs:
                    if out.request_id == rid:
                        if out.num_preemptions and resumed_s is None and out.new_token_ids:
                            resumed_s = elapsed  # its first token since it was preempted: the resuming step
                        if out.finished:
                            out_tokens = out.token_ids
            if resumed_s is None:
                raise RuntimeError(f"the {resume_tokens}-token sequence was never preempted: the bench's pool is off")
            times[mode].append(resumed_s)
            tokens[mode].append(out_tokens)
            del short
    stats = engines["swap"].tiers.stats
    for engine in engines.values():
        engine.close()
    swap, recompute = statistics.median(times["swap"]), statistics.median(times["recompute"])
    return {"swap_s": swap, "recompute_s": recompute, "ratio": swap / recompute, "times": times,
            "same_tokens": tokens["swap"] == tokens["recompute"], "swapped_out": stats.swapped_out}  # fmt: skip


def bandwidth(model: str, device: str, batches: list[int], repeats: int = 5) -> list[dict]:
    """GB/s of ``BlockCopier`` each way against a plain contiguous copy of the same bytes."""
    import torch

    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvstore import KVCache, KVCacheSpec
    from kvstore.block_copier import BlockCopier
    from kvstore.host_tier import HostTier

    dev = torch.device(device)
    config = ModelConfig.from_dir(resolve_model(model))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, 16, dtype)
    most = max(batches)
    pool = KVCache(spec, 2 * most, dev)
    pool.buffer.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8))
    pin = dev.type == "cuda"
    host, copier = HostTier(spec, 2 * most, pin_memory=pin), BlockCopier(dev)
    plain_host = torch.empty(most * spec.bytes_per_block(), dtype=torch.uint8, pin_memory=pin)
    plain_dev = torch.empty_like(plain_host, device=dev)

    operations = {  # each (block ids, host rows, bytes)
        "store": lambda b, r, n: copier.to_host(pool.layers, b, host.views, r),
        "plain d2h": lambda b, r, n: plain_host[:n].copy_(plain_dev[:n], non_blocking=pin),
        "load": lambda b, r, n: copier.to_device(host.views, r, pool.layers, b),
        "plain h2d": lambda b, r, n: plain_dev[:n].copy_(plain_host[:n], non_blocking=pin),
    }

    def timed(side: str, blocks: list[int], slots: list[int], nbytes: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        operations[side](blocks, slots, nbytes)
        copier.synchronize()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    rows = []
    rng = random.Random(0)
    for n in batches:
        nbytes = n * spec.bytes_per_block()
        blocks = rng.sample(range(2 * most), n)  # scattered, as an LRU leaves them
        slots = rng.sample(range(2 * most), n)
        sides: dict[str, list[float]] = {side: [] for side in operations}
        for _ in range(repeats):  # the sides alternate, so drift hits them alike
            for side in operations:
                sides[side].append(timed(side, blocks, slots, nbytes))
        row = {"blocks": n, "mib": nbytes / 2**20}
        row.update({f"{side} GB/s": nbytes / statistics.median(t) / 1e9 for side, t in sides.items()})
        rows.append(row)
    back = KVCache(spec, 2 * most, dev)
    copier.to_device(host.views, slots, back.layers, blocks)  # the last batch, read back through the tier
    copier.synchronize()
    for layer_src, layer_back in zip(pool.layers, back.layers, strict=True):  # bytes: random ones hold NaNs
        if not torch.equal(layer_src.v_cache[blocks].view(torch.uint8), layer_back.v_cache[blocks].view(torch.uint8)):
            raise RuntimeError("blocks loaded back from the host tier differ from the pool's")
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    turns = sorted({r["turn"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("without", "s--"), ("with L2", "o-"), (FLOOR, "^:")):
        means = [statistics.mean(r[f"{name} ttft_s"] for r in rows if r["turn"] == t) * 1e3 for t in turns]
        ax.plot(turns, means, style, label=name)
    ax.set(xlabel="turn", ylabel="mean TTFT (ms)", title=f"multi-turn TTFT, device pool {result['num_blocks']} blocks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=300, help="tokens each turn adds to the history")
    parser.add_argument("--device-fraction", type=float, default=0.25,
                        help="the device pool as a fraction of the final working set")  # fmt: skip
    parser.add_argument("--host-gb", type=float, default=1.0, help="the host tier of the 'with L2' engine (GiB)")
    parser.add_argument("--resume-tokens", type=int, default=2000, help="the preempted sequence's prompt")
    parser.add_argument("--repeats", type=int, default=4, help="resume runs per side (alternating)")
    parser.add_argument("--skip-resume", action="store_true")
    parser.add_argument("--bandwidth-only", action="store_true", help="only the host tier's copy bandwidth")
    parser.add_argument("--device", default="cpu", help="--bandwidth-only: cpu or cuda")
    parser.add_argument("--model", default="default", help="--bandwidth-only: whose KV layout (a model dir)")
    parser.add_argument("--blocks", default="16,128,1024", help="--bandwidth-only: blocks per copy")
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument("--plot", default="tiers.png", help="the PNG of TTFT per turn")
    parser.add_argument("--save-result", default=None, help="write everything as JSON")
    args = parser.parse_args(argv)
    if args.turn_tokens <= _ANSWER_TOKENS:
        parser.error(f"--turn-tokens must be more than the {_ANSWER_TOKENS}-token answer")
    saved: dict = {"args": vars(args)}
    if args.bandwidth_only:
        rows = saved["bandwidth"] = bandwidth(args.model, args.device, [int(n) for n in args.blocks.split(",")])
        sides = ("store GB/s", "plain d2h GB/s", "load GB/s", "plain h2d GB/s")
        print(f"host tier copies on {args.device} (median of 5, alternating; blocks at scattered ids and rows)")
        print(report.table(("blocks", "MiB", *sides, "store/plain", "load/plain"), [
            (r["blocks"], r["mib"], *(r[s] for s in sides), r["store GB/s"] / r["plain d2h GB/s"],
             r["load GB/s"] / r["plain h2d GB/s"]) for r in rows]))  # fmt: skip
        if args.save_result:
            report.save_json(args.save_result, saved)
        return
    if not args.skip_multi_turn:
        mt = saved["multi_turn"] = multi_turn(args.users, args.turns, args.turn_tokens, args.device_fraction,
                                              args.host_gb)  # fmt: skip
        without, with_l2, floor = mt["without"], mt["with L2"], mt[FLOOR]
        print(f"multi-turn: {args.users} users x {args.turns} turns, +{args.turn_tokens} tokens a turn; device pool "
              f"{mt['num_blocks']} blocks = {args.device_fraction:.0%} of {mt['working_set_tokens']} tokens")
        print(report.table(("", "TTFT p50 ms", "TTFT p99 ms", "tokens/s"), [
            (name, d["ttft_p50_s"] * 1e3, d["ttft_p99_s"] * 1e3, d["tokens_per_s"])
            for name, d in (("without L2", without), ("with L2", with_l2), (FLOOR, floor))]))  # fmt: skip
        print(f"with/without: TTFT p50 {with_l2['ttft_p50_s'] / without['ttft_p50_s']:.2f}x, p99 "
              f"{with_l2['ttft_p99_s'] / without['ttft_p99_s']:.2f}x, throughput "
              f"{with_l2['tokens_per_s'] / without['tokens_per_s']:.2f}x; host-tier hits {mt['host_hits']} tokens; "
              f"same tokens: {mt['same_tokens']}")
        print(f"floor (a pool for every conversation, no copies): TTFT p50 {floor['ttft_p50_s'] * 1e3:.1f} ms = "
              f"{floor['ttft_p50_s'] / without['ttft_p50_s']:.2f}x without; with L2 is "
              f"{with_l2['ttft_p50_s'] / floor['ttft_p50_s']:.2f}x the floor")
        plot(mt, args.plot)
        print(f"saved {args.plot}")
    if not args.skip_resume:
        res = saved["resume"] = resume(args.resume_tokens, args.repeats)
        print(f"resume a preempted {args.resume_tokens}-token sequence (median of {args.repeats}): swap "
              f"{res['swap_s'] * 1e3:.1f} ms, recompute {res['recompute_s'] * 1e3:.1f} ms: {res['ratio']:.3f}x; "
              f"same tokens: {res['same_tokens']}")
    if args.save_result:
        report.save_json(args.save_result, saved)


if __name__ == "__main__":
    main()
