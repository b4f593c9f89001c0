"""KV hand-off cost for one prompt's KV: ``shm`` (stores into a mapped pool) and ``grpc`` (chunks to PushKV).

    kvserve bench transfer [--tokens 2048] [--repeats 5]

shm: the prefill worker's attention layers store every new token's K and V into the decode worker's
mapped pool file: the time of those stores for all layers is the whole transfer. grpc: read the
blocks out of the prefill pool, stream them to a real decode worker's ``PushKV`` over loopback, which
verifies each chunk and writes it into its pool. Both on the bundled model's KV layout.
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

    import kernels
    from decode_service.kv_receiver import KVReceiver
    from engine import LLMEngine
    from kvstore import KVCache
    from kvstore.transfer import (
        checksum,
        checksum_blocks,
        chunked,
        create_shared_pool,
        fingerprint,
        open_shared_pool,
        read_blocks,
    )
    from protos.kvserve.v1 import kvserve_pb2 as pb
    from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
    from rpc.auth import Security
    from rpc.loop import AsyncioThread
    from rpc.server import add_service, new_server, start_server

    block_size = 16
    num_blocks = args.tokens // block_size + 8
    decode = LLMEngine(model="default", num_blocks=num_blocks, block_size=block_size)
    spec = decode.runner.kv_spec
    blocks = list(range(args.tokens // block_size))
    nbytes = len(blocks) * spec.bytes_per_block()
    print(f"{args.tokens} tokens of {decode.model_config.architecture} KV: {nbytes / 2**20:.1f} MiB "
          f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}, {spec.dtype})")  # fmt: skip

    # shm: one store per layer of this prompt's K and V into a mapped pool file
    pool, path = create_shared_pool(spec, num_blocks, "bench")
    try:
        mapped = open_shared_pool(spec, num_blocks, path)
        k = torch.randn(args.tokens, spec.num_kv_heads, spec.head_dim)
        v = torch.randn_like(k)
        slots = torch.arange(args.tokens)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for layer in mapped.layers:
                kernels.store_kvcache(k, v, layer.k_cache, layer.v_cache, slots)
            times.append(time.perf_counter() - start)
        shm = median(times)
    finally:
        path.unlink()

    # grpc: the decode worker's PushKV receiver on loopback, every block leased to the request and "bench"
    source = KVCache(spec, num_blocks, "cpu")
    source.buffer.copy_(torch.randint(0, 255, source.buffer.shape, dtype=torch.uint8))
    fp = fingerprint(decode.model_config.architecture, spec)
    receiver = KVReceiver(decode.runner.kv_cache, fp, lease_holder=lambda request_id: (blocks, "bench"))
    security = Security(token="bench")  # the interceptor's token check is part of every real hand-off
    aio = AsyncioThread()

    async def serve():
        server = new_server(security)
        port, _ = await start_server(server, [add_service(server, "KVTransfer", receiver)], "127.0.0.1:0", security)
        return server, port

    server, port = aio.run(serve())
    times = []
    try:
        with security.channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KVTransferStub(channel)
            for i in range(args.repeats):
                rid = f"bench-{i}"
                start = time.perf_counter()
                parts = [(chunk, read_blocks(source, chunk)) for chunk in chunked(blocks)]
                chunks = [pb.KVChunk(request_id=rid, fingerprint=fp, block_ids=chunk, data=data,
                                     checksum=checksum(data)) for chunk, data in parts]  # fmt: skip
                reply = stub.PushKV(iter(chunks), timeout=60, metadata=security.metadata("bench"))
                times.append(time.perf_counter() - start)
                assert (
                    reply.checksum == checksum_blocks(source, blocks) == checksum_blocks(decode.runner.kv_cache, blocks)
                )
    finally:
        aio.run(server.stop(0))
        aio.stop()
    rpc = median(times)
    print(f"{'backend':8}{'latency ms':>12}{'GB/s':>8}")
    print(f"{'shm':8}{shm * 1e3:12.1f}{nbytes / shm / 1e9:8.2f}")
    print(f"{'grpc':8}{rpc * 1e3:12.1f}{nbytes / rpc / 1e9:8.2f}")
    print(f"shm is {rpc / shm:.1f}x faster than grpc for this hand-off")


if __name__ == "__main__":
    main()
