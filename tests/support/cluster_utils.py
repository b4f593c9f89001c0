"""Starting real local clusters for the service tests, supervising them, and loading them with requests."""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from kvserve.client import Client
from kvserve.launcher.cluster import Cluster, free_base_port, start_cluster
from kvserve.launcher.plan import ExtraArgv, threads_per_worker
from kvserve.launcher.supervisor import RestartPolicy, Supervised, Supervisor
from kvserve.settings import parse_up

ENGINE_ARGV = ["--model", "default", "--num-blocks", "256", "--block-size", "16"]


def tiny_engine_argv(model_dir) -> list[str]:
    """Engine flags for the ``tiny_model_dir`` fixture's model: for tests of plumbing (faults, trust, routing),
    where no real text matters; prompts are token ids below 1,024."""
    return ["--model", str(model_dir), "--skip-tokenizer-init", "true", "--num-blocks", "256", "--block-size", "16"]


def cluster(num_prefill: int, num_decode: int, log_dir, decode_argv=None, prefill_argv=None,
            http: bool = False, engine_argv: list[str] = ENGINE_ARGV, routers: int = 1) -> Cluster:  # fmt: skip
    """``http``: the router also serves the OpenAI-compatible API (``Cluster.http_endpoint``); ``routers``: how
    many (``Cluster.endpoints``).

    The workers split the cores statically (``--threads``, each its share): with ``kvserve up``'s default on a
    CPU host, the compute lease, each would run on every core while the other pytest-xdist worker computes on
    one of them (tests/cluster/test_compute_lease.py and test_cluster_plan.py test the lease)."""
    port = free_base_port()
    threads = threads_per_worker(num_prefill + num_decode)
    up = parse_up(["--prefill", str(num_prefill), "--decode", str(num_decode), "--port", str(port),
                   "--http-port", str(port + 1 if http else 0), "--log-dir", str(log_dir), "--threads", str(threads),
                   "--routers", str(routers), *engine_argv])  # fmt: skip
    return start_cluster(up, ExtraArgv(decode=tuple(decode_argv or ()), prefill=tuple(prefill_argv or ())))


def discard(c: Cluster) -> None:
    """End a test's cluster without waiting for a clean stop: SIGKILL every child, then ``Cluster.stop`` removes
    what is left (Redis, pool files, certificates). A child exits ~2 s after SIGTERM even when idle; the tests
    of stopping cleanly (test_up.py, test_worker_faults.py) wait for that themselves."""
    for child in c.children:
        child.kill()
    for child in c.children:
        if child.proc is not None:
            child.proc.wait()
    c.stop()


def hf_reference(hf_model, prompt: list[int], max_new_tokens: int = 8) -> list[int]:
    """Hugging Face's greedy continuation of ``prompt``: what every cluster's answer must equal."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prometheus_values(metrics_url: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` a worker's ``/metrics`` serves now, by their label string ('' for a metric
    without labels)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    prefix = name + "{"
    samples = {line[len(prefix) : line.index("}")]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix)}  # fmt: skip
    for line in text.splitlines():
        if line.startswith(name + " "):
            samples[""] = float(line.split()[1])
    return samples


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def supervising(units: list[Supervised], policy: RestartPolicy) -> Iterator[tuple[Supervisor, list[str]]]:
    """Supervise ``units`` on a background thread; yields the supervisor and the messages it logs. On exit the
    supervisor stops (the processes it restarted die with its thread), and what it raised is raised here."""
    records = _Records()
    logger = logging.getLogger("kvserve.launcher.supervisor")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    supervisor, stop, errors = Supervisor(units, policy), threading.Event(), []

    def run() -> None:
        try:
            supervisor.run(stop)
        except BaseException as err:  # re-raised on the test's thread below
            errors.append(err)

    thread = threading.Thread(target=run, name="supervisor")
    thread.start()
    try:
        yield supervisor, records.messages
    finally:
        stop.set()
        thread.join()
        logger.removeHandler(records)
        logger.setLevel(level)
    if errors:
        raise errors[0]


@contextmanager
def supervised(c: Cluster, policy: RestartPolicy) -> Iterator[tuple[Supervisor, list[str]]]:
    """``supervising`` the cluster's units; ``c`` is discarded on exit."""
    try:
        with supervising(c.units(), policy) as supervisor_and_messages:
            yield supervisor_and_messages
    finally:
        discard(c)


def load_request(index: int, max_tokens: int) -> tuple[list[int], dict]:
    """Load thread ``index``'s request: a prompt of token ids and its sampling options, greedy for even
    threads and seeded sampling for odd ones (both must survive a hand-over token for token)."""
    prompt = [1, 504, 3458, 288, 2343, 28, 1953, 216 + index, 42]  # "Count to ten, take N:"-like ids
    options = {"max_tokens": max_tokens, "ignore_eos": True}
    options |= {"temperature": 0} if index % 2 == 0 else {"temperature": 0.8, "seed": 1000 + index}
    return prompt, options


def offline_answers(llm, threads: int, max_tokens: int) -> list[list[int]]:
    """What every load thread's request must return: the offline engine's tokens for it."""
    from engine import SamplingParams

    requests = [load_request(i, max_tokens) for i in range(threads)]
    outs = llm.generate([p for p, _ in requests], [SamplingParams(**o) for _, o in requests])
    return [out.token_ids for out in outs]


@dataclass
class Load:
    """Client threads, each sending its request (``load_request``) until ``stop``: counts completions, each
    failure's status code with how many tokens it had streamed before it failed, and every completed answer
    that differs from ``expected`` (the offline engine's, ``offline_answers``) as (thread, got)."""

    endpoint: str | list[str]  # a router, or several (the client fails over between them)
    threads: int = 3
    max_tokens: int = 8
    expected: list[list[int]] | None = None
    completed: int = 0
    failures: list[tuple[grpc.StatusCode, int]] = field(default_factory=list)
    wrong: list[tuple[int, list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._received = [0] * self.threads  # tokens each thread's request in flight has received
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(self.threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        prompt, options = load_request(index, self.max_tokens)
        with Client(self.endpoint, timeout_s=120) as client:
            while not self._stop.is_set():
                tokens = []
                try:
                    for chunk in client.stream(prompt, **options):
                        tokens += chunk.token_ids
                        self._received[index] = len(tokens)
                    self._received[index] = 0
                    with self._lock:
                        self.completed += 1
                        if self.expected is not None and tokens != self.expected[index]:
                            self.wrong.append((index, tokens))
                except grpc.RpcError as err:
                    with self._lock:
                        self.failures.append((err.code(), len(tokens)))

    def mid_stream(self) -> int:
        """Requests in flight that have received some of their tokens, not all."""
        return sum(0 < n < self.max_tokens for n in self._received)

    def done_since(self, count: int) -> int:
        with self._lock:
            return self.completed - count

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
