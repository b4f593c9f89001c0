"""The ``kvserve`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvserve.launcher  # noqa: F401 - first: it switches gRPC's fork handlers off before grpc loads

if TYPE_CHECKING:
    import grpc

    from kvserve.launcher.cluster import Cluster
    from kvserve.settings import UpSettings
    from security.auth import Security


def _model_prepare(args: argparse.Namespace) -> None:
    from engine.bundled import resolve_model

    print(resolve_model(args.model))


def _model_random(args: argparse.Namespace) -> None:
    import torch

    from kvserve.testing.random_model import write_random_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = write_random_model(args.out, args.like, num_layers=args.layers, dtype=getattr(torch, args.dtype),
                             seed=args.seed, device=device)  # fmt: skip
    print(out)


def _demo(args: argparse.Namespace) -> None:
    from kvserve.demo import main as demo_main

    demo_main(args.model)


def _cluster_security(up: UpSettings) -> Security:
    """The launcher's credentials. Without a token (environment or file) a random one is made, so internal
    calls are authenticated unless ``--insecure-internal`` is given."""
    import secrets

    from security.auth import TOKEN_ENV, load_token, security_from_settings

    if up.cluster_certs:
        raise ValueError("kvserve up makes its children's cluster certificates itself: drop --cluster-certs")
    if not up.insecure_internal and load_token(up.cluster_token_file) is None:
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)  # reaches the children through their environment
    return security_from_settings(up)


def _up(up: UpSettings) -> None:
    """Start the cluster, print one line per process, then supervise it until SIGINT/SIGTERM/SIGHUP (exit 0
    after stopping everything) or until it cannot be kept running (``ClusterFailed``: exit 1)."""
    import logging
    import signal
    import threading

    from kvserve.launcher.cluster import launch
    from kvserve.launcher.plan import plan_cluster
    from kvserve.launcher.supervisor import Supervisor
    from rpc import tracing

    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvserve %(levelname)s %(message)s")
    plan = plan_cluster(up)
    tracing.setup("launcher", "kvserve-up", up)
    security = _cluster_security(up)
    _warn_of_a_password_on_the_command_line(up.redis_url)
    routers = "a router" if up.routers == 1 else f"{up.routers} routers"
    print(f"kvserve: starting {up.prefill} prefill + {up.decode} decode workers and {routers}...", flush=True)

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # during start-up, like Ctrl-C: launch stops what it began
        signal.signal(sig, interrupt)
    try:
        cluster = launch(plan, security)
    except KeyboardInterrupt:
        print("kvserve: interrupted during start-up; everything stopped", flush=True)
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print("\n".join(cluster.lines()), flush=True)
        redis = _describe_redis(cluster)
        print(f"kvserve: serving kvserve.v1.Inference on {','.join(cluster.endpoints)} (Redis: {redis}); Ctrl-C stops",
              flush=True)  # fmt: skip
        if cluster.http_endpoint:
            print(f"kvserve: OpenAI-compatible API on {cluster.http_endpoint}/v1", flush=True)
        Supervisor(cluster.units()).run(stop)
    finally:
        cluster.stop()
        tracing.shutdown()
    print("kvserve: cluster stopped", flush=True)


def _warn_of_a_password_on_the_command_line(redis_url: str | None) -> None:
    """The children get the URL through their environment, but ours is the command line the user typed."""
    from urllib.parse import urlsplit

    from rpc.options import REDIS_URL_ENV

    if redis_url and redis_url != os.environ.get(REDIS_URL_ENV) and urlsplit(redis_url).password:
        print(f"kvserve: warning: the Redis password in --redis-url is visible to every local user (ps) while "
              f"kvserve runs; set {REDIS_URL_ENV} instead", file=sys.stderr, flush=True)  # fmt: skip


def _describe_redis(cluster: Cluster) -> str:
    """Where the cluster's Redis is, without its password."""
    from cluster_state.redis_link import redact

    redis = cluster.redis
    if redis is None:
        return redact(cluster.redis_url)
    tcp = f" and 127.0.0.1:{redis.port}" if redis.port else ""
    return f"embedded, {redis.unix_socket}{tcp}; password in {redis.data_dir / 'redis.conf'}"


def _hash_key(args: argparse.Namespace) -> None:
    """Print the SHA-256 a keys file lists for an API key: a new random one (``--new``, printed too), else the
    key read from stdin (never from the command line, which ps shows)."""
    import secrets

    from router.tenants import hash_key

    if args.new:
        key = secrets.token_urlsafe(32)
        print(f"key: {key}")
    else:
        key = sys.stdin.readline().strip()
        if not key:
            raise SystemExit("kvserve hash-key: no key on stdin (or --new for a new one)")
    print(f"key_sha256: {hash_key(key)}")


def _certs(args: argparse.Namespace) -> None:
    """``kvserve certs``: see ``security.certs``; the cluster token, when one is set, is the cluster secret."""
    from security.auth import load_token
    from security.certs import make_cluster_dir

    made = make_cluster_dir(Path(args.out), args.names, tuple(args.hosts), secret=load_token())
    print("\n".join(map(str, made)) if made else f"kvserve: {args.out} holds every process named already")


def _tls_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS for a client of the router: verify it with ``--tls-ca``; present ``--tls-cert/--tls-key`` (mTLS)."""
    import grpc

    if not (args.tls_ca or args.tls_cert):
        return None
    files = [Path(path).read_bytes() if path else None for path in (args.tls_ca, args.tls_key, args.tls_cert)]
    return grpc.ssl_channel_credentials(*files)


def _generate(args: argparse.Namespace) -> None:
    from kvserve.client import Client

    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    with Client(args.address, credentials=_tls_credentials(args), api_key=args.api_key) as client:
        last = None
        for chunk in client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature):
            print(chunk.text, end="", flush=True)
            last = chunk
    if last is not None and last.finish_reason:
        t = last.timings
        print(
            f"\n[{last.finish_reason}; {last.usage.get('completion_tokens')} tokens; TTFT {t['ttft_ms']:.0f} ms; "
            f"total {t['total_ms']:.0f} ms; KV via {last.transfer_backend}]",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from kvserve.bench import BENCHES

    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:
        import importlib

        status = importlib.import_module(f"kvserve.bench.{argv[1].replace('-', '_')}").main(argv[2:])
        if status:  # a bench that found a problem (kernels: no GPU)
            sys.exit(status)
        return
    if argv[:1] == ["tune"]:
        from kvserve.bench.tune import main as tune

        sys.exit(tune(argv[1:]))
    if argv[:1] == ["up"]:  # its flags come from its settings model (``kvserve.settings``)
        from kvserve.settings import parse_up

        _run(_up, parse_up(argv[1:]))
        return
    parser = _parser(BENCHES)
    args = parser.parse_args(argv)
    if args.command in ("bench", "up"):
        parser.error(f"use 'kvserve bench {'|'.join(BENCHES)} [options]' or 'kvserve up [options]'")
    _run(args.func, args)


def _parser(benches: Sequence[str]) -> argparse.ArgumentParser:
    """The commands other than ``bench NAME`` and ``up``, which take their own flags (``main``)."""
    parser = argparse.ArgumentParser(prog="kvserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage model files").add_subparsers(dest="action", required=True)
    prepare = model.add_parser("prepare", help="convert the bundled model (or check a model directory) once")
    prepare.add_argument("--model", default="default", help="'default' or a local Hugging Face model directory")
    prepare.set_defaults(func=_model_prepare)
    from kvserve.testing.random_model import PRESETS

    rand = model.add_parser("random", help="write a randomly initialised model of a real model's shape")
    rand.add_argument("--like", required=True, choices=sorted(PRESETS), help="whose shape to copy")
    rand.add_argument("--out", required=True, help="the model directory to write")
    rand.add_argument("--layers", type=int, default=None, help="fewer layers than the real model (tests)")
    rand.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    rand.add_argument("--seed", type=int, default=0)
    rand.set_defaults(func=_model_random)

    demo = sub.add_parser("demo", help="start a local 1 prefill + 1 decode cluster, stream three chat answers at once "
                                       "with their TTFT, TPOT and KV path, then stop it")  # fmt: skip
    demo.add_argument("--model", default="default")
    demo.set_defaults(func=_demo)

    sub.add_parser("bench", help=f"benchmarks: 'kvserve bench {'|'.join(benches)} --help'")

    sub.add_parser("up", help="start a local cluster: Redis, prefill and decode workers, router ('kvserve up --help')")
    sub.add_parser("tune", help="sweep engine settings for goodput at your SLO; write the table and a --config file "
                   "('kvserve tune --help')")

    certs = sub.add_parser("certs", help="make a cluster CA, and certificates and credentials for its processes "
                                         "(containers: docker-compose.yml)")  # fmt: skip
    certs.add_argument("--out", required=True, help="the directory to write (mode 0700; DIR/ca keeps the CA)")
    certs.add_argument("--names", nargs="+", required=True, metavar="[ROLE:]NAME",
                       help="the processes: router, decode-0, prefill-0, ... (a worker's id is its name)")  # fmt: skip
    certs.add_argument("--hosts", nargs="*", default=[],
                       help="host names or IPs every certificate names too "
                            "(127.0.0.1 and localhost always do)")  # fmt: skip
    certs.set_defaults(func=_certs)

    hashed = sub.add_parser("hash-key", help="the SHA-256 of an API key (stdin), as --api-keys-file lists it")
    hashed.add_argument("--new", action="store_true", help="make a new random key and print it with its hash")
    hashed.set_defaults(func=_hash_key)

    gen = sub.add_parser("generate", help="stream an answer from a running cluster")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--tls-ca", default=None, help="PEM CA to verify a router that serves TLS")
    gen.add_argument("--tls-cert", default=None, help="PEM client certificate, when the router wants one (mTLS)")
    gen.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    gen.add_argument("--api-key", default=None, help="the router's API key (default: $KVSERVE_API_KEY)")
    gen.set_defaults(func=_generate)

    return parser


def _run(func: Callable[[Any], None], args: object) -> None:
    """Run a command; its errors end the process with one line: a wrong value exit 2, a failure exit 1."""
    import grpc

    try:
        func(args)
    except ValueError as err:
        print(f"kvserve: {err}", file=sys.stderr)
        sys.exit(2)
    except grpc.RpcError as err:
        print(f"kvserve: {err.code().name}: {err.details()}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as err:
        print(f"kvserve: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
