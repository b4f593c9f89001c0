"""KV hand-off cost for one prompt's KV: ``shm`` (a copy into a mapped pool) and ``grpc`` (chunks to PushKV).

    kvserve bench transfer [--tokens 2048] [--repeats 5]

shm: the prefill worker's KV connector (``prefill_service.handoff``) copies the prompt's blocks, layer by
layer, from its own pool into the decode worker's mapped pool file: that copy is the whole transfer. grpc: the ``grpc``
transport (``transfer.grpc_stream``) reads the blocks out of the prefill pool and streams them to a real
decode worker's ``PushKV`` over loopback, which verifies each chunk and writes it into its pool. Both on
the bundled model's KV layout.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.bench.report import median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from engine import LLMEngine
    from kvstore import KVCache
    from kvstore.kv_cache import copy_blocks
    from kvstore.layout import fingerprint
    from kvstore.shared_pool import create_shared_pool
    from rpc.auth import Security
    from rpc.loop import AsyncioThread
    from rpc.server import add_service, new_server, start_server
    from transfer.blocks import checksum_blocks
    from transfer.grpc_stream import GrpcTransport, KVReceiver
    from transfer.shm import open_shared_pool
    from transfer.transport import Origin

    block_size = 16
    num_blocks = args.tokens // block_size + 8
    decode = LLMEngine(model="default", num_blocks=num_blocks, block_size=block_size)
    spec = decode.runner.kv_spec
    blocks = list(range(args.tokens // block_size))
    nbytes = len(blocks) * spec.bytes_per_block()
    print(f"{args.tokens} tokens of {decode.model_config.architecture} KV: {nbytes / 2**20:.1f} MiB "
          f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}, {spec.dtype})")  # fmt: skip

    source = KVCache(spec, num_blocks, "cpu")  # the prefill worker's own pool, holding the prompt's blocks
    source.buffer.copy_(torch.randint(0, 255, source.buffer.shape, dtype=torch.uint8))

    # shm: the blocks copied, layer by layer, into a mapped pool file
    pool, path = create_shared_pool(spec, num_blocks, "bench")
    try:
        mapped = open_shared_pool(spec, num_blocks, path)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            copy_blocks(source.layers, blocks, mapped.layers, blocks)
            times.append(time.perf_counter() - start)
        shm = median(times)
        assert checksum_blocks(mapped, blocks) == checksum_blocks(source, blocks)
    finally:
        path.unlink()

    # grpc: the decode worker's PushKV receiver on loopback, every block leased to the request and "bench"
    fp = fingerprint(decode.model_config.architecture, spec)
    receiver = KVReceiver(decode.runner.kv_cache, fp, lease_holder=lambda request_id: (blocks, "bench"))
    security = Security(token="bench")  # the interceptor's token check is part of every real hand-off
    aio = AsyncioThread()

    async def serve():
        server = new_server(security)
        port, _ = await start_server(server, [add_service(server, "KVTransfer", receiver)], "127.0.0.1:0", security)
        return server, port

    server, port = aio.run(serve())
    transport = GrpcTransport("bench-decode", f"127.0.0.1:{port}", Origin(spec, fp, "bench", security))
    sender = AsyncioThread()  # the prefill worker's event loop: in a cluster the two ends are two processes
    times = []
    try:
        for i in range(args.repeats):
            start = time.perf_counter()
            digest = sender.run(transport.finish(f"bench-{i}", blocks, transport.take(source, blocks)))
            times.append(time.perf_counter() - start)
            assert digest == checksum_blocks(source, blocks) == checksum_blocks(decode.runner.kv_cache, blocks)
    finally:
        transport.close()
        sender.stop()
        aio.run(server.stop(0))
        aio.stop()
    rpc = median(times)
    print(f"{'backend':8}{'latency ms':>12}{'GB/s':>8}")
    print(f"{'shm':8}{shm * 1e3:12.1f}{nbytes / shm / 1e9:8.2f}")
    print(f"{'grpc':8}{rpc * 1e3:12.1f}{nbytes / rpc / 1e9:8.2f}")
    print(f"shm is {rpc / shm:.1f}x faster than grpc for this hand-off")


if __name__ == "__main__":
    main()
