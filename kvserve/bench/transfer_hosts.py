"""``kvserve bench transfer --netns``: the hand-off with its two ends on two test hosts (``kvserve.testing.netns``).

Each end is a process of its own on a host of its own (a network namespace with a /dev/shm of its own), so
the KV crosses a veth pair, a bridge and another veth pair, as between machines, and shm is impossible:

* the decode end (``python -m kvserve.bench.transfer_hosts decode``) holds the pool the blocks go into: it
  serves a real ``PushKV`` receiver (``grpc``) and registers the pool with a NIXL agent (``nixl``), then
  prints how to reach both, and its KV layout, as one JSON line;
* the prefill end (``... prefill``) holds the prompt's blocks (random bytes) in a pool of that layout and
  opens both transports to the decode end, as a prefill worker does from a lease.

``tcp`` is the link's reference, no transport: the same number of bytes sent from the prefill end's pool
buffer with one ``sendall`` on a plain socket and received with ``recv_into`` straight into the decode end's,
acknowledged by one byte: what any transport over TCP can at best do here.

This process drives them over their stdin and stdout, one hand-off at a time, alternating the transports
so that both see the machine in the same state. A hand-off's time runs from the prefill end's start until
the decode end holds the blocks and knows it: for grpc, when the receiver's answer is back at the sender;
for nixl, when the decode end's agent has the write's notification (both ends read the same monotonic
clock: namespaces share it). Every hand-off is checked by the checksum of the decode end's blocks.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvserve.testing import netns

SECURITY_TOKEN = "bench"  # what both ends' gRPC interceptors check: this run's processes only
RECEIVER_PORT = 50100


def _spec_json(spec) -> dict:
    return {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "block_size": spec.block_size, "dtype": str(spec.dtype).removeprefix("torch."),
            "kv_cache_dtype": spec.kv_cache_dtype}  # fmt: skip


_answers = sys.stdout  # an end's answers; what its libraries print goes to stderr (see ``__main__``)


def _say(message: dict) -> None:
    print(json.dumps(message), file=_answers, flush=True)


def decode_end(model: str, tokens: int, device: str, address: str, transports: list[str]) -> None:
    from engine import LLMEngine
    from kvstore.layout import fingerprint
    from rpc.loop import AsyncioThread
    from rpc.server import add_service, new_server, start_server
    from security.auth import Security
    from transfer.blocks import checksum_blocks
    from transfer.grpc_stream import KVReceiver

    block_size = 16
    blocks = list(range(tokens // block_size))
    engine = LLMEngine(model=model, num_blocks=len(blocks) + 8, block_size=block_size, device=device,
                       skip_tokenizer_init=True)  # fmt: skip
    spec, dest = engine.runner.kv_spec, engine.runner.kv_cache
    fp = fingerprint(engine.model_config.architecture, spec)
    receiver = KVReceiver(dest, fp, lease_holder=lambda request_id: (blocks, "bench-prefill"))
    security, aio = Security(token=SECURITY_TOKEN), AsyncioThread()

    async def serve():
        server = new_server(security)
        await start_server(server, [add_service(server, "KVTransfer", receiver)], f"{address}:{RECEIVER_PORT}",
                           security)  # fmt: skip
        return server

    server = aio.run(serve())
    nbytes = len(blocks) * spec.bytes_per_block()
    listener = socket.create_server((address, RECEIVER_PORT + 1))
    threading.Thread(target=_tcp_sink, args=(listener, dest.buffer, nbytes), daemon=True).start()
    pool = None
    if "nixl" in transports:
        from transfer import nixl_agent

        pool = nixl_agent.NixlPool(dest, "bench-decode")
    _say({"address": f"{address}:{RECEIVER_PORT}", "fingerprint": fp, "spec": _spec_json(spec),
          "num_blocks": dest.num_blocks, "bytes_per_block": spec.bytes_per_block(),
          "architecture": engine.model_config.architecture,
          "nixl_metadata": base64.b64encode(pool.metadata).decode() if pool else "",
          "nixl_pool": pool.pool if pool else ""})  # fmt: skip
    for line in sys.stdin:  # "expect RID": wait for a nixl write's notification; "check": the blocks' checksum
        command, rid = line.split()
        if command == "expect":
            while ("bench-prefill", rid) not in pool.arrived():
                time.sleep(0.001)
        digest = _raw_checksum(dest.buffer, nbytes) if command == "raw" else checksum_blocks(dest, blocks)
        answer = {"arrived": time.monotonic(), "checksum": digest}
        dest.buffer.zero_()  # the next hand-off must bring every byte again
        _say(answer)
    aio.run(server.stop(0))
    aio.stop()
    if pool is not None:
        pool.close()


def _raw_checksum(buffer, nbytes: int) -> str:  # noqa: ANN001 - a CPU tensor
    import xxhash

    return xxhash.xxh3_128_hexdigest(buffer.numpy()[:nbytes])


def _tcp_sink(listener: socket.socket, buffer, nbytes: int) -> None:  # noqa: ANN001 - a CPU tensor
    """The ``tcp`` reference's receiving side: ``nbytes`` into ``buffer``, then one byte back, until closed."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(buffer.numpy())[:nbytes]
    while True:
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if not n:
                return
            got += n
        conn.sendall(b"\x01")


def prefill_end(device: str, transports: list[str]) -> None:
    import torch

    from kvstore import KVCache, KVCacheSpec
    from protos.kvserve.v1 import kvserve_pb2 as pb
    from rpc.loop import AsyncioThread
    from security.auth import Security
    from transfer.blocks import checksum_blocks
    from transfer.grpc_stream import GrpcTransport
    from transfer.interface import Origin

    ready = json.loads(sys.stdin.readline())
    s = ready["spec"]
    spec = KVCacheSpec(s["num_layers"], s["num_kv_heads"], s["head_dim"], s["block_size"], getattr(torch, s["dtype"]),
                       s["kv_cache_dtype"])  # fmt: skip
    source = KVCache(spec, ready["num_blocks"], device)
    source.buffer.copy_(torch.randint(0, 255, source.buffer.shape, dtype=torch.uint8))
    blocks = list(range(ready["tokens"] // spec.block_size))
    origin = Origin(spec, ready["fingerprint"], "bench-prefill", Security(token=SECURITY_TOKEN))
    sender = AsyncioThread()  # the prefill worker's event loop
    opened = {}
    if "grpc" in transports:
        opened["grpc"] = GrpcTransport("bench-decode", ready["address"], origin)
    if "nixl" in transports:
        from transfer import nixl

        lease = pb.KVDestination(worker_id="bench-decode", backend="nixl", block_ids=blocks,
                                 num_blocks=ready["num_blocks"], nixl_metadata=base64.b64decode(ready["nixl_metadata"]),
                                 nixl_pool=ready["nixl_pool"])  # fmt: skip
        opened["nixl"] = nixl.NixlTransport.open(lease, origin)
    nbytes = len(blocks) * spec.bytes_per_block()
    if "tcp" in transports:
        host, port = ready["address"].rsplit(":", 1)
        opened["tcp"] = socket.create_connection((host, int(port) + 1))
        opened["tcp"].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _say({"source_checksum": checksum_blocks(source, blocks), "source_raw": _raw_checksum(source.buffer, nbytes)})
    for line in sys.stdin:  # "TRANSPORT RID": one hand-off
        name, rid = line.split()
        transport = opened[name]
        start = time.monotonic()
        if name == "grpc":
            digest, error = sender.run(transport.finish(rid, blocks, transport.take(source, blocks))), ""
        elif name == "tcp":
            transport.sendall(memoryview(source.buffer.numpy())[:nbytes])
            digest, error = "", "" if transport.recv(1) == b"\x01" else "the receiving end closed"
        else:
            written = transport.take(source, blocks, rid, blocks)
            digest, error = written.checksum, written.error
        _say({"start": start, "end": time.monotonic(), "checksum": digest, "error": error})
    for transport in opened.values():
        transport.close()
    sender.stop()


class _End:
    """One end's process on its host, spoken to in lines of text, answering in JSON lines."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True)  # fmt: skip

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a bench end exited ({self.proc.wait()}): {self.log.read_text()[-3000:]}")
        return json.loads(line)


def across_hosts(model: str, tokens: int, device: str, transports: list[str],
                 repeats: int) -> tuple[dict[str, list[float]], int]:  # fmt: skip
    """Seconds per hand-off by transport, the two ends on two test hosts (see the module's docstring), and
    the bytes each hand-off moves."""
    if reason := netns.unavailable():
        raise SystemExit(f"kvserve bench transfer --netns: {reason}")
    me = [sys.executable, "-m", "kvserve.bench.transfer_hosts"]
    times: dict[str, list[float]] = {name: [] for name in transports}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as logs, netns.Hosts(2) as hosts:
        decode_host, prefill_host = hosts.hosts
        decode = _End(hosts.command(decode_host, [*me, "decode", model, str(tokens), device, decode_host.address,
                                                  *transports]), Path(logs) / "decode.log")  # fmt: skip
        prefill = _End(hosts.command(prefill_host, [*me, "prefill", device, *transports]), Path(logs) / "prefill.log")
        ready = decode.read()
        spec = ready["spec"]
        nbytes = ready["bytes_per_block"] * (tokens // spec["block_size"])
        print(f"{tokens} tokens of {ready['architecture']} KV on {device}: {nbytes / 2**20:.1f} MiB "
              f"({spec['num_layers']} layers, {spec['num_kv_heads']} KV heads x {spec['head_dim']}, {spec['dtype']}); "
              f"decode end on {decode_host.address}, prefill end on {prefill_host.address}: two network namespaces "
              "on a bridge, each with a /dev/shm of its own")  # fmt: skip
        prefill.send(json.dumps(ready | {"tokens": tokens}))
        sources = prefill.read()
        for i in range(repeats + 1):  # the first round warms both ends up and is not counted
            for name in transports:
                rid = f"bench-{name}-{i}"
                if name == "nixl":  # the decode end watches for the notification from before the write starts
                    decode.send(f"expect {rid}")
                prefill.send(f"{name} {rid}")
                sent = prefill.read()
                if name != "nixl":  # the receiver answered after its last write
                    decode.send(f"{'raw' if name == 'tcp' else 'check'} {rid}")
                arrived = decode.read()
                source = sources["source_raw" if name == "tcp" else "source_checksum"]
                if sent["error"] or sent["checksum"] not in ("", source) or arrived["checksum"] != source:
                    raise RuntimeError(f"{name} hand-off {i} failed: {sent['error'] or 'checksums differ'}")
                end = arrived["arrived"] if name == "nixl" else sent["end"]
                if i:
                    times[name].append(max(end, sent["end"]) - sent["start"])
        for end in (decode, prefill):
            end.proc.stdin.close()
            end.proc.wait(timeout=30)
    return times, nbytes


if __name__ == "__main__":
    _answers = os.fdopen(os.dup(1), "w")  # the answers keep the pipe; NIXL's and UCX's own prints go to the log
    os.dup2(2, 1)
    role, rest = sys.argv[1], sys.argv[2:]
    if role == "decode":
        decode_end(rest[0], int(rest[1]), rest[2], rest[3], rest[4:])
    else:
        prefill_end(rest[0], rest[1:])
