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
from kvserve.cluster import Cluster, free_base_port, start_cluster
from kvserve.supervisor import RestartPolicy, Supervisor

ENGINE_ARGV = ["--model", "default", "--num-blocks", "256", "--block-size", "16"]


def cluster(num_prefill: int, num_decode: int, log_dir, decode_argv=None, prefill_argv=None,
            http: bool = False) -> Cluster:  # fmt: skip
    """``http``: the router also serves the OpenAI-compatible API (``Cluster.http_endpoint``)."""
    port = free_base_port()
    return start_cluster(
        num_prefill=num_prefill,
        num_decode=num_decode,
        port=port,
        http_port=port + 1 if http else 0,
        engine_argv=ENGINE_ARGV,
        decode_argv=decode_argv,
        prefill_argv=prefill_argv,
        log_dir=str(log_dir),
    )


def hf_reference(hf_model, prompt: list[int], max_new_tokens: int = 8) -> list[int]:
    """Hugging Face's greedy continuation of ``prompt``: what every cluster's answer must equal."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prometheus_values(metrics_url: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` a worker's ``/metrics`` serves now, by their label string."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    prefix = name + "{"
    return {line[len(prefix) : line.index("}")]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}  # fmt: skip


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def supervised(c: Cluster, policy: RestartPolicy) -> Iterator[tuple[Supervisor, list[str]]]:
    """Supervise ``c`` on a background thread; yields the supervisor and the messages it logs. On exit the
    supervisor stops (its restarted processes die with its thread) and ``c`` is stopped."""
    records = _Records()
    logger = logging.getLogger("kvserve.supervisor")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    supervisor, stop, errors = Supervisor(c, policy), threading.Event(), []

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
        c.stop()
        logger.removeHandler(records)
        logger.setLevel(level)
    if errors:
        raise errors[0]


@dataclass
class Load:
    """Client threads sending short greedy requests until ``stop``: counts completions, and each failure's
    status code with how many tokens it had streamed before it failed."""

    endpoint: str
    threads: int = 3
    max_tokens: int = 8
    completed: int = 0
    failures: list[tuple[grpc.StatusCode, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(self.threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        with Client(self.endpoint, timeout_s=60) as client:
            while not self._stop.is_set():
                tokens = 0
                try:
                    for chunk in client.stream(f"Count to ten, take {index}:", max_tokens=self.max_tokens,
                                               temperature=0, ignore_eos=True):  # fmt: skip
                        tokens += len(chunk.token_ids)
                    with self._lock:
                        self.completed += 1
                except grpc.RpcError as err:
                    with self._lock:
                        self.failures.append((err.code(), tokens))

    def done_since(self, count: int) -> int:
        with self._lock:
            return self.completed - count

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
