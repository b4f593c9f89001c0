"""KV hand-off cost of one prompt's KV, per transport: ``shm``, ``grpc`` and ``nixl``, both ends in this run.

    kvserve bench transfer [--transport shm|grpc|nixl ...] [--tokens 2048] [--repeats 5] [--model M]
                           [--device cpu|cuda] [--netns]

Each transport moves the prompt's blocks from a prefill pool into a decode pool, as the workers do, and the
figure is the time until the decode side holds them and knows it (median of ``--repeats``); every run is
checked by the checksum of the destination blocks:

* shm (CPU only): the prefill worker's KV connector (``prefill_service.handoff``) copies the blocks, layer by
  layer, into the decode worker's mapped pool file: that copy is the whole transfer;
* grpc: the ``grpc`` transport (``transfer.grpc_stream``) reads the blocks out of the prefill pool and streams
  them over loopback to a real ``PushKV`` receiver, which verifies each chunk and writes it into its pool;
  the sender has an event loop of its own, as the prefill worker has;
* nixl: the ``nixl`` transport (``transfer.nixl``) writes the blocks from the prefill worker's agent into the
  decode pool registered with another agent (UCX; on a GPU VRAM to VRAM), until the decode side's agent has
  the write's notification;
* tcp (``--netns`` only): no transport, the link's reference: the same bytes through a plain socket.

Default: every transport available here (shm on a CPU, nixl when NIXL is installed). With ``--netns`` the
two ends are processes on two test hosts (network namespaces on a bridge, each with its own /dev/shm:
``kvserve.bench.transfer_hosts``), so grpc and nixl cross a real network link, and shm cannot run.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.bench.report import median

TRANSPORTS = ("shm", "grpc", "nixl", "tcp")  # tcp: the link's reference with --netns (transfer_hosts)


def _shm(source, spec, num_blocks, blocks, repeats: int) -> list[float]:
    from kvstore.kv_cache import copy_blocks
    from kvstore.shared_pool import create_shared_pool, map_pool_file
    from transfer.blocks import checksum_blocks

    _, path = create_shared_pool(spec, num_blocks, "bench")
    try:
        mapped = map_pool_file(spec, num_blocks, path)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            copy_blocks(source.layers, blocks, mapped.layers, blocks)
            times.append(time.perf_counter() - start)
        assert checksum_blocks(mapped, blocks) == checksum_blocks(source, blocks)
    finally:
        path.unlink()
    return times


def _grpc(source, dest, fp: str, blocks, repeats: int) -> list[float]:
    from rpc.loop import AsyncioThread
    from rpc.server import add_service, new_server, start_server
    from security.auth import Security
    from transfer.blocks import checksum_blocks
    from transfer.grpc_stream import GrpcTransport, KVReceiver
    from transfer.interface import Origin

    receiver = KVReceiver(dest, fp, lease_holder=lambda request_id: (blocks, "bench"))  # every block leased
    security = Security(token="bench")  # the interceptor's token check is part of every real hand-off
    aio = AsyncioThread()

    async def serve():
        server = new_server(security)
        port, _ = await start_server(server, [add_service(server, "KVTransfer", receiver)], "127.0.0.1:0", security)
        return server, port

    server, port = aio.run(serve())
    transport = GrpcTransport("bench-decode", f"127.0.0.1:{port}", Origin(source.spec, fp, "bench", security))
    sender = AsyncioThread()  # the prefill worker's event loop: in a cluster the two ends are two processes
    times = []
    try:
        for i in range(repeats):
            start = time.perf_counter()
            digest = sender.run(transport.finish(f"bench-{i}", blocks, transport.take(source, blocks)))
            times.append(time.perf_counter() - start)
            assert digest == checksum_blocks(source, blocks) == checksum_blocks(dest, blocks)
    finally:
        transport.close()
        sender.stop()
        aio.run(server.stop(0))
        aio.stop()
    return times


def _nixl(source, dest, fp: str, blocks, repeats: int) -> list[float]:
    from protos.kvserve.v1 import kvserve_pb2 as pb
    from security.auth import Security
    from transfer import nixl, nixl_agent
    from transfer.blocks import checksum_blocks
    from transfer.interface import Origin

    pool = nixl_agent.NixlPool(dest, "bench-decode")  # the agents start before the clock does, as in a worker
    lease = pb.KVDestination(worker_id="bench-decode", backend="nixl", block_ids=blocks, num_blocks=dest.num_blocks,
                             nixl_metadata=pool.metadata, nixl_pool=pool.pool)  # fmt: skip
    transport = nixl.NixlTransport.open(lease, Origin(source.spec, fp, "bench-prefill", Security(token="bench")))
    times = []
    try:
        for i in range(repeats):
            start = time.perf_counter()
            written = transport.take(source, blocks, f"bench-{i}", blocks)
            while ("bench-prefill", f"bench-{i}") not in pool.arrived():  # the decode side learns it is done
                time.sleep(0.0001)
            times.append(time.perf_counter() - start)
            assert not written.error, written.error
            assert written.checksum == checksum_blocks(source, blocks) == checksum_blocks(dest, blocks)
            dest.buffer.zero_()
    finally:
        transport.close()
        pool.close()
    return times


def main(argv: list[str] | None = None) -> None:
    from transfer.backend import nixl_installed

    parser = argparse.ArgumentParser(prog="kvserve bench transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--transport", action="append", choices=TRANSPORTS,
                        help="measure this one (repeat the flag for more); default: all available here")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="default", help="whose KV layout (a model directory or name)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both pools live")
    parser.add_argument("--netns", action="store_true",
                        help="each end on a test host of its own (network namespaces: root, `ip`)")  # fmt: skip
    args = parser.parse_args(argv)
    here = {"shm": args.device == "cpu" and not args.netns, "grpc": True, "nixl": nixl_installed(),
            "tcp": args.netns and args.device == "cpu"}  # fmt: skip
    available = [t for t in TRANSPORTS if here[t]]
    chosen = args.transport or available
    if missing := [t for t in chosen if t not in available]:
        parser.error(f"not available here: {', '.join(missing)} (shm: CPU only, one host; nixl: pip install "
                     "'kvserve[nixl]'; tcp: the link's reference, --netns on the CPU)")  # fmt: skip
    if args.netns:
        from kvserve.bench.transfer_hosts import across_hosts

        times, nbytes = across_hosts(args.model, args.tokens, args.device, chosen, args.repeats)
        _report({name: median(seconds) for name, seconds in times.items()}, nbytes)
        return

    from engine import LLMEngine
    from kvstore import KVCache
    from kvstore.layout import fingerprint

    block_size = 16
    num_blocks = args.tokens // block_size + 8
    decode = LLMEngine(model=args.model, num_blocks=num_blocks, block_size=block_size, device=args.device,
                       skip_tokenizer_init=True)  # the KV layout is all it is for
    spec = decode.runner.kv_spec
    fp = fingerprint(decode.model_config.architecture, spec)
    blocks = list(range(args.tokens // block_size))
    nbytes = len(blocks) * spec.bytes_per_block()
    print(f"{args.tokens} tokens of {decode.model_config.architecture} KV on {args.device}: {nbytes / 2**20:.1f} MiB "
          f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}, {spec.dtype})")  # fmt: skip
    source = KVCache(spec, num_blocks, args.device)  # the prefill worker's own pool, holding the prompt's blocks
    source.buffer.copy_(torch.randint(0, 255, source.buffer.shape, dtype=torch.uint8))
    dest = decode.runner.kv_cache
    results = {}
    for name in chosen:
        if name == "shm":
            results[name] = median(_shm(source, spec, num_blocks, blocks, args.repeats))
        else:
            try:
                results[name] = median((_grpc if name == "grpc" else _nixl)(source, dest, fp, blocks, args.repeats))
            except RuntimeError as error:  # NixlPool's: this machine's NIXL cannot register the pool
                print(f"{name}: not measured: {error}")
    _report(results, nbytes)


def _report(results: dict[str, float], nbytes: int) -> None:
    print(f"{'transport':10}{'latency ms':>12}{'GB/s':>8}")
    for name, seconds in results.items():
        print(f"{name:10}{seconds * 1e3:12.1f}{nbytes / seconds / 1e9:8.2f}")
    if "grpc" in results:
        for name in (n for n in results if n not in ("grpc", "tcp")):
            print(f"{name} is {results['grpc'] / results[name]:.1f}x as fast as grpc for this hand-off")
    if "tcp" in results:  # the link's reference (kvserve.bench.transfer_hosts)
        for name in (n for n in results if n != "tcp"):
            print(f"{name} moves at {results['tcp'] / results[name]:.0%} of a plain TCP copy's speed over this link")


if __name__ == "__main__":
    main()
