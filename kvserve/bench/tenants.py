"""``kvserve bench tenants``: what one tenant's flood costs another, with the router's fair queue and without.

    kvserve bench tenants [--max-num-seqs 4] [--flood 10] [--steady 12] [--prompt-len 128] [--max-tokens 32]

One decode worker behind the router (``kvserve up --prefill 0 --max-num-seqs N``), two tenants of equal weight
in a keys file (``--api-keys-file``). Solo: tenant ``steady`` sends ``--steady`` requests one after another.
Flooded: tenant ``flood`` runs ``flood x N/2`` users (``--flood`` times its half of the worker's slots), each
sending its next request as soon as the last ends, and meanwhile ``steady`` sends the same requests again.
The same two sides run on a cluster without the keys file (no tenants: every request goes straight to the
worker's queue). Reported: steady's TTFT p50 and p90 solo and flooded, and their ratio, on each cluster; and the
flood's requests done a second while steady's ran (what fairness cost it).
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path

from kvserve.bench import report
from kvserve.bench.priority import percentile


def _ttft(client, prompt: list[int], max_tokens: int) -> float:
    began, first = time.perf_counter(), None
    for _ in client.stream(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True):
        first = first or time.perf_counter() - began
    return first


def run(endpoint: str, keys: dict[str, str | None], vocab: int, num_flood: int, num_steady: int, prompt_len: int,
        max_tokens: int, fill_s: float = 2.0) -> dict:  # fmt: skip
    """Steady's TTFTs solo and beside ``num_flood`` flooding users, on the cluster at ``endpoint``; ``keys``: each
    tenant's API key (None: none is sent)."""
    from engine.heap import freeze_startup_heap
    from kvserve.client import Client

    freeze_startup_heap()  # (this process holds torch too: its own full collections would count as latency)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(prompt_len)]

    steady_prompts = [prompt() for _ in range(num_steady)]
    with Client(endpoint, timeout_s=600, api_key=keys["steady"] or "") as steady, \
            Client(endpoint, timeout_s=600, api_key=keys["flood"] or "") as flood:  # fmt: skip
        _ttft(steady, prompt(), 2)  # warm-up
        solo = [_ttft(steady, p, max_tokens) for p in steady_prompts]
        stop, flooded = threading.Event(), []

        def user() -> None:
            while not stop.is_set():
                _ttft(flood, prompt(), max_tokens)
                flooded.append(1)

        users = [threading.Thread(target=user) for _ in range(num_flood)]
        for thread in users:
            thread.start()
        time.sleep(fill_s)  # the flood fills the worker and its queue
        began, done = time.perf_counter(), len(flooded)
        loaded = [_ttft(steady, [7, *p[1:]], max_tokens) for p in steady_prompts]  # (not the cached prefix)
        flood_rate = (len(flooded) - done) / (time.perf_counter() - began)
        stop.set()
        for thread in users:
            thread.join()
    return {"solo p50 ms": statistics.median(solo) * 1e3, "solo p90 ms": percentile(solo, 90) * 1e3,
            "flooded p50 ms": statistics.median(loaded) * 1e3, "flooded p90 ms": percentile(loaded, 90) * 1e3,
            "p50 ratio": statistics.median(loaded) / statistics.median(solo), "flood requests": len(flooded),
            "flood req/s": flood_rate}  # (while steady's ran: how much the flood still got done)


def keys_file(directory: Path) -> tuple[Path, dict[str, str]]:
    """A keys file of two tenants of equal weight, and their keys."""
    from router.tenants import hash_key

    keys = {name: secrets.token_urlsafe(24) for name in ("steady", "flood")}
    path = directory / "keys.toml"
    path.write_text("".join(f'[tenants.{name}]\nkey_sha256 = ["{hash_key(key)}"]\n\n' for name, key in keys.items()))
    path.chmod(0o600)
    return path, keys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench tenants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--flood", type=float, default=10.0, help="the flood's users per slot of its share")
    parser.add_argument("--steady", type=int, default=12, help="steady's requests on each side")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    vocab = ModelConfig.from_dir(resolve_model("default")).vocab_size
    num_flood = round(args.flood * args.max_num_seqs / 2)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        path, keys = keys_file(Path(scratch))
        for name, extra, side_keys in (("tenants", ["--api-keys-file", str(path)], keys),
                                       ("none", [], {"steady": None, "flood": None})):  # fmt: skip
            base = free_base_port(4)
            cluster = start_cluster(parse_up(["--port", str(base), "--http-port", "0", "--prefill", "0",
                                              "--max-num-seqs", str(args.max_num_seqs), *extra]))  # fmt: skip
            try:
                row = run(cluster.endpoint, side_keys, vocab, num_flood, args.steady, args.prompt_len, args.max_tokens)
            finally:
                cluster.stop()
            rows.append([name, *(f"{v:.2f}" if isinstance(v, float) else v for v in row.values())])
    print(f"tenants: steady's {args.steady} requests one after another, solo and beside {num_flood} flooding users "
          f"({args.flood:g}x the flood's half of {args.max_num_seqs} slots), {args.prompt_len}-token prompts, "
          f"{args.max_tokens} new tokens")  # fmt: skip
    print(report.table(["fair queue", *row], rows))


if __name__ == "__main__":
    main()
