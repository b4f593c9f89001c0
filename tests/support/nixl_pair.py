"""Two NIXL agents in this process (NIXL allows it; UCX moves DRAM between them as between hosts): a decode
pool and a prefill worker's transport. Run by tests/cluster/test_transfer_nixl.py in a process of its own (see there);
writes each passed check's name to the file named by its argument (NIXL's threads log to stdout) and exits
non-zero at the first failed one."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time

import torch

from cluster_state import lease
from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.split_pool import SplitPool
from protos.kvserve.v1 import kvserve_pb2 as pb
from security.auth import Security
from transfer import nixl, nixl_agent
from transfer.backend import Backend
from transfer.blocks import checksum_blocks, read_blocks
from transfer.interface import Origin, TransferFailed

SPEC = KVCacheSpec(2, 2, 16, 4, torch.float32)


def _destination(pool: nixl_agent.NixlPool, worker_id: str, num_blocks: int, block_ids: list[int]) -> pb.KVDestination:
    return pb.KVDestination(worker_id=worker_id, backend=Backend.NIXL, fingerprint="fp", block_ids=block_ids,
                            num_blocks=num_blocks, nixl_metadata=pool.metadata, nixl_pool=pool.pool)  # fmt: skip


def _arrived(pool: nixl_agent.NixlPool, timeout_s: float = 5.0) -> list[tuple[str, str]]:
    deadline, got = time.monotonic() + timeout_s, []
    while not got and time.monotonic() < deadline:
        got = pool.arrived()
        time.sleep(0.01)
    return got


def write() -> None:
    """The leased blocks (not consecutive, in another order) arrive intact, read back through the pool itself
    rather than through NIXL; nothing else is written; the notification names the writer and the request; a
    write whose blocks do not pair up fails in ``finish``."""
    decode, source = KVCache(SPEC, 32, "cpu"), KVCache(SPEC, 24, "cpu")
    source.buffer.copy_(torch.randint(0, 255, source.buffer.shape, dtype=torch.uint8))
    pool = nixl_agent.NixlPool(decode, "decode-n")
    src, dst = [3, 4, 5, 11, 0], [20, 21, 7, 8, 30]
    transport = nixl.NixlTransport.open(_destination(pool, "decode-n", 32, dst),
                                        Origin(SPEC, "fp", "prefill-n", Security(token="t")))  # fmt: skip
    taken = transport.take(source, src, "req-1", dst, time.monotonic() + 10)
    digest = asyncio.run(transport.finish("req-1", dst, taken))
    assert digest == checksum_blocks(source, src) != "", taken
    assert checksum_blocks(decode, dst) == digest
    untouched = [b for b in range(32) if b not in dst]  # still zeros
    assert checksum_blocks(decode, untouched) == checksum_blocks(KVCache(SPEC, 32, "cpu"), untouched)
    assert _arrived(pool) == [("prefill-n", "req-1")]
    mismatched = transport.take(source, src, "req-2", dst[:2])
    try:
        asyncio.run(transport.finish("req-2", dst[:2], mismatched))
        raise AssertionError("a write of 5 blocks into 2 leased ones was not refused")
    except TransferFailed:
        pass
    transport.close()
    pool.close()


def metadata() -> None:
    """A prefill worker loads only the agent of the worker the destination names, and only a destination
    whose lease verifies: the signature covers the metadata and the pool's address."""
    pool = nixl_agent.NixlPool(KVCache(SPEC, 8, "cpu"), "decode-m")
    origin = Origin(SPEC, "fp", "prefill-m", Security(token="t"))
    for dest, refusal in [(_destination(pool, "decode-other", 8, [1]), "not decode worker"),
                          (pb.KVDestination(worker_id="decode-m", backend=Backend.NIXL, num_blocks=8), "no NIXL")]:
        try:
            nixl.NixlTransport.open(dest, origin)
            raise AssertionError(f"opened {dest.worker_id}'s pool with {refusal!r} metadata")
        except ValueError as err:
            assert refusal in str(err), err
    security = Security(token="cluster")
    dest = _destination(pool, "decode-m", 8, [1, 2])
    lease.grant(security, "req", dest, "prefill-m", 30.0)
    assert lease.grant_refusal(security, "req", dest, "prefill-m", None, lease.NonceBook()) == ""
    for field, value in (("nixl_pool", pool.pool.rsplit(":", 1)[0] + ":4096"), ("nixl_metadata", b"forged")):
        forged = pb.KVDestination()
        forged.CopyFrom(dest)
        setattr(forged, field, value)
        assert "no valid lease" in lease.grant_refusal(security, "req", forged, "prefill-m", None, lease.NonceBook())
    pool.close()


def split() -> None:
    """Pools split over tensor-parallel ranks otherwise on each side (3 KV heads: 1 + 2 into 2 + 1): each
    destination part gets its heads from the source parts that hold them, read back through the decode
    worker's parts rather than through NIXL (``read_blocks``: the bytes of the unsplit pool), and the
    notification and checksum are those of an unsplit write."""
    spec = KVCacheSpec(2, 3, 16, 4, torch.float32)

    def parts(heads: list[int], num_blocks: int) -> SplitPool:
        return SplitPool([KVCache(dataclasses.replace(spec, num_kv_heads=h), num_blocks, "cpu") for h in heads])

    decode, source = parts([2, 1], 32), parts([1, 2], 24)
    for part in source.parts:
        part.buffer.copy_(torch.randint(0, 255, part.buffer.shape, dtype=torch.uint8))
    pool = nixl_agent.NixlPool(decode, "decode-s")
    src, dst = [3, 4, 5, 11, 0], [20, 21, 7, 8, 30]
    dest = _destination(pool, "decode-s", 32, dst)
    dest.kv_heads = decode.layout
    transport = nixl.NixlTransport.open(dest, Origin(spec, "fp", "prefill-s", Security(token="t")))
    taken = transport.take(source, src, "req-s", dst, time.monotonic() + 10)
    assert asyncio.run(transport.finish("req-s", dst, taken)) == checksum_blocks(source, src) != "", taken
    assert read_blocks(decode, dst) == read_blocks(source, src)
    assert _arrived(pool) == [("prefill-s", "req-s")]
    transport.close()
    pool.close()


def idle() -> None:
    """Agents that move nothing cost next to no CPU: NIXL's own progress thread polls without pause (a whole
    core per agent, 1 s of CPU per second), ours rest between rounds (``transfer.nixl_agent``)."""
    agents = [nixl_agent.new_agent(f"idle-{i}") for i in range(2)]
    for agent in agents:
        agent.register_memory(torch.zeros(1 << 20, dtype=torch.uint8))
    before, start = time.process_time(), time.monotonic()
    time.sleep(2.0)
    cpu_s, wall_s = time.process_time() - before, time.monotonic() - start
    assert cpu_s < 0.25 * wall_s, f"two idle agents took {cpu_s:.2f} s of CPU in {wall_s:.2f} s"


if __name__ == "__main__":
    with open(sys.argv[1], "w") as passed:
        for check in (write, metadata, split, idle):
            check()
            passed.write(check.__name__ + "\n")
            passed.flush()
