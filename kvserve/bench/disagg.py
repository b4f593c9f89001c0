"""``kvserve bench disagg``: a prompt's TTFT through a prefill worker against the decode worker alone, by prompt
length, to choose ``--disagg-min-uncached-tokens`` (``decode_service.disaggregation``).

    kvserve bench disagg [--lengths 8,32,128,256,512,1024,2048] [--rounds 4] [--prompts 3]

Three clusters side by side, one user, alternating which goes first each round (this machine drifts):
* ``handoff``: 1P1D handing off every prompt (``--disagg-min-uncached-tokens 0``);
* ``default``: 1P1D with the decode worker's default policy;
* ``decode-only``: one decode worker (``--prefill 0``).

Each round sends each cluster ``--prompts`` cold prompts (random tokens, none cached) of each length, for two
new tokens. Reported per length: the median TTFT on each side, the two 1P1D sides over decode-only, and where
the default's prompts were prefilled (``remote``: by the prefill worker).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.bench import report


def _ttft(client, prompt: list[int]) -> tuple[float, str]:
    """The TTFT of ``prompt`` and where its KV came from (``local``: the decode worker prefilled it)."""
    began, first, backend = time.perf_counter(), None, ""
    for chunk in client.stream(prompt, temperature=0, max_tokens=2, ignore_eos=True):
        first = first or time.perf_counter() - began
        backend = chunk.transfer_backend or backend
    return first, backend


def run(endpoints: dict[str, str], vocab: int, lengths: list[int], rounds: int, prompts: int) -> list[list]:
    """The table's rows: per length, each side's median TTFT (ms), the ratios, and where the default's went."""
    from kvserve.client import Client

    rng = random.Random(0)
    clients = {name: Client(endpoint, timeout_s=600) for name, endpoint in endpoints.items()}
    ttft: dict[tuple[str, int], list[float]] = {}
    placed: dict[int, set[str]] = {n: set() for n in lengths}
    try:
        for client in clients.values():
            _ttft(client, [rng.randrange(100, vocab) for _ in range(8)])  # warm-up
        for r in range(rounds):
            order = list(clients) if r % 2 == 0 else list(clients)[::-1]
            for n in lengths:
                for name in order:
                    for _ in range(prompts):
                        seconds, backend = _ttft(clients[name], [rng.randrange(100, vocab) for _ in range(n)])
                        ttft.setdefault((name, n), []).append(seconds * 1e3)
                        if name == "default":
                            placed[n].add("local" if backend == "local" else "remote")
    finally:
        for client in clients.values():
            client.close()
    rows = []
    for n in lengths:
        ms = {name: statistics.median(ttft[(name, n)]) for name in clients}
        rows.append([n, *(f"{ms[name]:.0f}" for name in clients), f"{ms['handoff'] / ms['decode-only']:.2f}x",
                     f"{ms['default'] / ms['decode-only']:.2f}x", ",".join(sorted(placed[n]))])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench disagg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--lengths", default="8,32,128,256,512,1024,2048", help="prompt lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per length, side and round")
    args = parser.parse_args(argv)
    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = ModelConfig.from_dir(resolve_model("default")).vocab_size
    sides = {"handoff": ["--disagg-min-uncached-tokens", "0"], "default": [], "decode-only": ["--prefill", "0"]}
    clusters = {}
    try:
        for name, flags in sides.items():
            base = free_base_port(4)
            clusters[name] = start_cluster(parse_up(["--port", str(base), "--http-port", "0",
                                                     "--max-model-len", str(max(lengths) + 64), *flags]))  # fmt: skip
        rows = run({name: c.endpoint for name, c in clusters.items()}, vocab, lengths, args.rounds, args.prompts)
    finally:
        for c in clusters.values():
            c.stop()
    print(f"disagg: one user, cold prompts, median TTFT (ms) over {args.rounds} rounds of {args.prompts} prompts")
    print(report.table(["prompt tokens", "handoff", "default", "decode-only", "handoff/decode-only",
                        "default/decode-only", "default prefilled"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
