"""``python -m router --port 50051 [--redis-url URL] [--decode-address HOST:PORT ...] [--model default]``"""

from __future__ import annotations

import argparse
import logging

from engine.bundled import resolve_model
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from kvserve.serving import new_server, serve_until_signal, start_server
from kvstore.registry import Registry
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.server import Router


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--model", default="default")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--decode-address", action="append", default=[], help="static decode workers (no Redis)")
    args, _ = parser.parse_known_args(argv)  # engine flags meant for workers are accepted and ignored
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    path = resolve_model(args.model)
    config = ModelConfig.from_dir(path)
    registry = Registry(args.redis_url) if args.redis_url else None
    router = Router(Tokenizer(path), config.vocab_size, config.max_context, registry, args.decode_address)
    server = new_server(64)
    pb_grpc.add_InferenceServicer_to_server(router, server)
    address = f"{args.host}:{args.port}"
    start_server(server, ["kvserve.v1.Inference"], address)
    logging.info("router serving kvserve.v1.Inference on %s", address)
    serve_until_signal(server, [])


if __name__ == "__main__":
    main()
