"""What every kvserve gRPC process shares: server set-up with health and reflection, engine flags,
and the mapping between the wire's sampling options and the engine's ``SamplingParams``."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine import EngineConfig, SamplingParams
from protos.kvserve.v1 import kvserve_pb2 as pb

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def sampling_from_proto(opts: pb.SamplingOptions) -> SamplingParams:
    """Unset fields take ``SamplingParams``' defaults; invalid values raise ``ValueError`` with the reason."""
    kwargs = {}
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty"):
        if opts.HasField(name):
            kwargs[name] = getattr(opts, name)
    return SamplingParams(
        stop=list(opts.stop), stop_token_ids=list(opts.stop_token_ids), ignore_eos=opts.ignore_eos, **kwargs
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    """Inverse of ``sampling_from_proto``: every field set, so the receiver sees exactly these settings."""
    opts = pb.SamplingOptions(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              max_tokens=params.max_tokens, repetition_penalty=params.repetition_penalty,
                              stop=params.stop, stop_token_ids=params.stop_token_ids,
                              ignore_eos=params.ignore_eos)  # fmt: skip
    if params.seed is not None:
        opts.seed = params.seed
    return opts


def new_server(max_workers: int = 32) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)


def start_server(server: grpc.Server, service_names: list[str], address: str) -> tuple[int, health.HealthServicer]:
    """Add health checking and reflection, bind ``address`` and start; returns (port, health servicer)."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    server.start()
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return port, health_servicer


class Loop:
    """Calls ``body`` over and over until ``stop``: on the calling thread (``run``) or on a new one (``start``).

    Worker processes ``run`` their engine loop on the main thread. PyTorch's CPU
    ops run on OpenMP, which keeps a separate thread pool for every thread that
    calls it; the main thread already owns one from loading the model, and as
    soon as a second exists on a machine with few cores, libgomp stops idle pool
    threads from spinning, so every parallel op waits for a wake-up (measured
    here on 2 cores: elementwise ops 2.5x slower, a 256-token prefill ~15% slower
    on a second thread). The gRPC threads stay off OpenMP for the same reason.
    """

    def __init__(self, body: Callable[[], None], name: str) -> None:
        self._body = body
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        while not self._stop.is_set():
            self._body()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def serve_until_signal(server: grpc.Server, cleanups: list, main_loop: Loop | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then stop the server and run ``cleanups`` in order.

    ``main_loop`` runs on this (the main) thread meanwhile; a signal stops it.
    """
    done = threading.Event()

    def on_signal(*_) -> None:
        done.set()
        if main_loop is not None:
            main_loop.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if main_loop is not None:
        main_loop.run()
    done.wait()
    server.stop(grace=1).wait()
    for cleanup in cleanups:
        cleanup()


def wait_healthy(address: str, timeout_s: float) -> bool:
    """True once ``address`` answers SERVING to a health check within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


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
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (bundled SmolLM2-135M) or a model directory")
    for name, kind in _ENGINE_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    given = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name) is not None}
    return EngineConfig(model=args.model, **given)


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` again as command-line words, to pass on to worker processes."""
    argv = ["--model", args.model]
    for name in _ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
