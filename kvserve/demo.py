"""``make demo``: start a local cluster on the bundled model, stream a few chat answers, shut it down.

Three questions go out at once (they share the decode worker's batch); each answer is printed with
its time to first token (TTFT), time per output token (TPOT) and how its KV reached the decode worker.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing readable Python code.",
]


def _ask(address: str, question: str) -> tuple[str, str, object, float]:
    from kvserve.client import Client

    with Client(address, timeout_s=300) as client:
        start = time.perf_counter()
        chunks = list(client.stream([{"role": "user", "content": question}], max_tokens=96, temperature=0))
        return question, "".join(c.text for c in chunks), chunks[-1], time.perf_counter() - start


def main(model: str = "default") -> None:
    from kvserve.launcher.cluster import start_cluster
    from kvserve.settings import UpSettings

    print("starting the cluster: embedded Redis, 1 prefill worker, 1 decode worker, router ...", flush=True)
    cluster = start_cluster(UpSettings(model=model, port=50051, http_port=0))
    try:
        print(f"serving on {cluster.endpoint}\n", flush=True)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(lambda q: _ask(cluster.endpoint, q), QUESTIONS))
        for question, text, last, _ in answers:
            n = last.usage["completion_tokens"]
            ttft = last.timings["ttft_ms"]
            tpot = (last.timings["total_ms"] - ttft) / max(1, n - 1)
            print(f">>> {question}\n{text.strip()}")
            print(f"    [{n} tokens, {last.finish_reason}; TTFT {ttft:.0f} ms, TPOT {tpot:.0f} ms; "
                  f"KV via {last.transfer_backend} from {last.prefill_worker or 'local prefill'}]\n")  # fmt: skip
        total = sum(a[2].usage["completion_tokens"] for a in answers)
        wall = max(a[3] for a in answers)
        print(f"{total} tokens in {wall:.2f} s ({total / wall:.1f} tokens/s, 3 concurrent requests)")
    finally:
        cluster.stop()
        print("cluster stopped")
