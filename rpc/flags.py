"""Command-line flags the worker processes share: engine options, where to listen, the registry, compute threads."""

from __future__ import annotations

import argparse
import logging
import os

import torch

from engine import EngineConfig
from rpc.auth import add_security_args

log = logging.getLogger(__name__)

# The registry's URL, which may hold a password: a process's environment is private to its user, while its
# command line is not (``ps``, /proc/PID/cmdline), so ``kvserve up`` hands it to its children here.
REDIS_URL_ENV = "KVSERVE_REDIS_URL"


def boolean_flag(text: str) -> bool:
    """A flag value of ``true`` or ``false`` (any case; ``str(bool)`` round-trips)."""
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


_ENGINE_FLAGS = {
    "dtype": str,
    "device": str,
    "block_size": int,
    "num_blocks": int,
    "kv_cache_memory_bytes": int,
    "kv_cache_dtype": str,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "enable_prefix_caching": boolean_flag,
    "skip_tokenizer_init": boolean_flag,
    "enforce_eager": boolean_flag,
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (bundled SmolLM2-135M) or a model directory")
    for name, kind in _ENGINE_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    given = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name) is not None}
    if getattr(args, "gpu_memory_utilization", None) is not None:  # a worker's own share (``add_worker_args``)
        given["gpu_memory_utilization"] = args.gpu_memory_utilization
    return EngineConfig(model=args.model, **given)


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` again as command-line words, to pass on to worker processes."""
    argv = ["--model", args.model]
    for name in _ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def add_worker_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags of both worker roles: listening, identity, registry, threads, draining, security, engine."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--advertise", default=None, help="host:port peers should dial (default: --host:--port)")
    add_redis_url_arg(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch compute threads (default: this host's cores / its compute workers)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="HTTP port of this worker's Prometheus /metrics (0: any free port, logged)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for running requests before ending them")
    # not an engine flag of ``kvserve up``: workers sharing a GPU each get their own (see kvserve.cluster)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of the GPU's total memory this worker may use, weights included (default 0.9)")
    add_security_args(parser)
    add_engine_args(parser)


def add_redis_url_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV) or None,
                        help="the registry: redis://, rediss:// (TLS) or unix://, with user and password "
                             f"(default: ${REDIS_URL_ENV}, where a password belongs: every local user can read a "
                             "command line)")  # fmt: skip


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_compute_threads(threads: int | None, num_workers_on_host: int) -> int:
    """Give torch ``threads`` intra-op threads, by default this process's share of the host's cores.

    Every worker process would otherwise start one OpenMP thread per core; four workers on two cores
    then spend their time preempting each other (measured: 7-16x slower under load).
    """
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    share = threads or max(1, host_cores() // max(1, num_workers_on_host))
    torch.set_num_threads(share)
    log.info("torch compute threads: %d (%d cores, %d compute workers on this host)", share, host_cores(),
             num_workers_on_host)  # fmt: skip
    return share
