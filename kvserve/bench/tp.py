"""Tensor parallelism against one rank on this host: ``kvserve bench tp``.

    kvserve bench tp [--model default] [--tp 2] [--batch-sizes 1,16] [--prompt-len 128] [--max-tokens 32]
        [--rounds 2]
    kvserve bench tp --handoff 16,128 [--tp 2]     (the shm hand-off's copy between splits; ``handoff``)

Two engines of the same model in one process: one rank with every core's thread, and ``--tp`` ranks (rank 0
here, the others processes of their own) with cores / tp threads each, so both sides use the same cores.
Each round runs both sides on the same greedy requests, alternating which goes first (this machine drifts).
Reported per batch size: output tokens/s of each side (median over rounds), their ratio, the share of rank
0's generate time spent in collectives (the all-reduces and the logits' gather, waiting for the slower rank
included: the bundled model's 3 KV heads split 2 + 1; under CUDA graphs the replayed decode steps' collectives
are not seen from the host, so only the eager steps' count), how the split side decoded (each rank's CUDA
graphs on a GPU, eager on the CPU) and whether the tokens were the same. On a CPU this is a
correctness platform, not a speed claim: the ranks share the memory bandwidth that bounds a decode step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvserve.bench import report


def run(model: str, tp: int, batch_sizes: list[int], prompt_len: int, max_tokens: int, rounds: int) -> list[dict]:
    from engine import LLM, SamplingParams

    cores = torch.get_num_threads()
    common = dict(num_blocks=max(64, 2 * max(batch_sizes) * -(-(prompt_len + max_tokens) // 16)),
                  skip_tokenizer_init=True, host_kv_cache_gb=0)  # fmt: skip
    sides = {"1 rank": LLM(model, **common)}
    sides[f"{tp} ranks"] = LLM(model, tensor_parallel_size=tp, **common)
    threads = {"1 rank": cores, f"{tp} ranks": max(1, cores // tp)}
    graphs = sides[f"{tp} ranks"].engine.runner.graphs  # (``ShardedDecode``: each rank's CUDA graphs on a GPU)
    decode = "CUDA graphs" if graphs is not None and graphs.steps.graphs is not None else "eager"
    group = sides[f"{tp} ranks"].engine.runner.model.part.group
    vocab = sides["1 rank"].engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    try:
        for batch in batch_sizes:
            rng = random.Random(batch)
            prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]
            speeds, outputs, shares = {side: [] for side in sides}, {}, []
            for r in range(rounds):
                for side in list(sides) if r % 2 == 0 else list(reversed(sides)):
                    torch.set_num_threads(threads[side])  # (the engines share this process's pool)
                    salted = [[r * 7 + 1, *p] for p in prompts]  # each round misses the prefix cache
                    before, began = group.seconds, time.perf_counter()
                    outs = sides[side].generate(salted, params)
                    seconds = time.perf_counter() - began
                    speeds[side].append(sum(len(o.token_ids) for o in outs) / seconds)
                    outputs[side] = [o.token_ids for o in outs]
                    if side != "1 rank":
                        shares.append((group.seconds - before) / seconds)
            one, split = (statistics.median(speeds[side]) for side in sides)
            rows.append({"batch": batch, "1 rank tok/s": one, f"{tp} ranks tok/s": split, "ratio": split / one,
                         "collectives share": statistics.median(shares), "split decode": decode,
                         "same tokens": outputs["1 rank"] == outputs[f"{tp} ranks"]})  # fmt: skip
    finally:
        torch.set_num_threads(cores)
        for llm in sides.values():
            llm.engine.close()
    return rows


def handoff(model: str, tp: int, num_blocks: list[int], rounds: int) -> list[dict]:
    """The shm hand-off's copy (``kvstore.split_pool.copy_blocks``, what a prefill worker does into a decode
    worker's mapped pool) of ``num_blocks`` scattered blocks of ``model``'s KV, between each pair of splits (one
    rank, or ``tp`` ranks' parts as ``Shard`` splits the heads), against the same-TP copy of one rank, the two
    alternated; milliseconds are the median over ``rounds``."""
    import dataclasses

    from engine.bundled import resolve_model
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.models.tensor_parallel import Shard
    from engine.tensor_parallel_ranks import kv_spec
    from kvstore import KVCache
    from kvstore.split_pool import SplitPool, copy_blocks

    config = ModelConfig.from_dir(resolve_model(model))
    spec = kv_spec(config, EngineConfig(model=model), torch.float32)
    pool_blocks = 4 * max(num_blocks)

    def pool(ranks: int) -> SplitPool:
        heads = [Shard.of(config, rank, ranks).config().num_kv_heads for rank in range(ranks)]
        parts = [KVCache(dataclasses.replace(spec, num_kv_heads=h), pool_blocks, "cpu") for h in heads]
        for part in parts:
            part.buffer.fill_(1)  # (every page touched before timing)
        return SplitPool(parts)

    pairs = {"1 -> 1": (1, 1), f"{tp} -> 1": (tp, 1), f"1 -> {tp}": (1, tp), f"{tp} -> {tp}": (tp, tp)}
    pools = {name: (pool(a), pool(b)) for name, (a, b) in pairs.items()}
    rows = []
    for n in num_blocks:
        rng = random.Random(n)
        times: dict[str, list[float]] = {name: [] for name in pairs}
        for r in range(rounds):
            src, dst = rng.sample(range(pool_blocks), n), rng.sample(range(pool_blocks), n)
            for name in list(pairs) if r % 2 == 0 else list(reversed(pairs)):
                source, target = pools[name]
                began = time.perf_counter()
                copy_blocks(source, src, target, dst)
                times[name].append((time.perf_counter() - began) * 1e3)
        same = statistics.median(times["1 -> 1"])
        mib = n * spec.bytes_per_block() / 2**20
        rows.append({"blocks": n, "MiB": round(mib, 1)} | {
            f"{name} ms": f"{statistics.median(t):.2f} ({statistics.median(t) / same:.2f}x)"
            for name, t in times.items()})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="default")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the split side")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--handoff", default="", metavar="BLOCKS",
                        help="instead: the shm hand-off's copy of these many blocks (comma-separated) between "
                        "splits, against the same-TP copy")  # fmt: skip
    args = parser.parse_args(argv)
    if args.handoff:
        rows = handoff(args.model, args.tp, [int(b) for b in args.handoff.split(",")], max(3, args.rounds))
        print(f"shm hand-off copy between KV splits ({args.tp} ranks as Shard splits the heads), scattered blocks, "
              f"{torch.get_num_threads()} threads; in brackets: against the same-TP copy of one rank")  # fmt: skip
        print(report.table(list(rows[0]), [list(row.values()) for row in rows]))
        return
    rows = run(args.model, args.tp, [int(b) for b in args.batch_sizes.split(",")], args.prompt_len,
               args.max_tokens, args.rounds)  # fmt: skip
    print(f"tensor parallel: {args.tp} ranks against 1 on this host ({torch.get_num_threads()} threads in all), "
          f"{args.prompt_len}-token prompts, {args.max_tokens} new tokens, median of {args.rounds} rounds")  # fmt: skip
    print(report.table(list(rows[0]), [list(row.values()) for row in rows]))


if __name__ == "__main__":
    main()
