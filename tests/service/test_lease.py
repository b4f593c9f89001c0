"""The lease (cluster_state/lease.py) from grant to deletion: the signed grant a prefill worker checks, the
record in Redis (a real Redis for those tests), the writer's end of it and the holder's deletion."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import redis
from waiting import wait_until

from cluster_state import lease
from cluster_state.lease import LeaseRecord, end_signature
from cluster_state.registry import Registry
from kvserve.launcher.redis_server import EmbeddedRedis
from kvstore.prefix_hash import block_hashes
from protos.kvserve.v1 import kvserve_pb2 as pb
from security.auth import Security
from security.keys import PURPOSE_KEYS

SECURITY = Security(token="lease-test-token")
TOKENS = list(range(100, 116))


@pytest.fixture
def registry(redis_server: EmbeddedRedis, raw: redis.Redis) -> Iterator[Registry]:
    reg = Registry(redis_server.url, security=SECURITY, ttl_s=5.0)
    yield reg
    reg.stop()


def _granted(request_id: str = "r", ttl_s: float = 30, signer: Security = SECURITY, **fields) -> pb.KVDestination:
    dest = pb.KVDestination(**{"worker_id": "decode-0", "backend": "grpc", "fingerprint": "fp", "block_ids": [2, 3],
                               "num_blocks": 8, **fields})  # fmt: skip
    lease.grant(signer, request_id, dest, "prefill-0", ttl_s)
    return dest


# ---- the grant -------------------------------------------------------------------------------------------------


def test_a_grant_is_accepted_once_and_only_by_the_worker_it_names(tmp_path) -> None:
    nonces = lease.NonceBook()

    def refusal(dest: pb.KVDestination, worker_id: str = "prefill-0", request_id: str = "r") -> str:
        return lease.grant_refusal(SECURITY, request_id, dest, worker_id, tmp_path, nonces)

    dest = _granted()
    assert "is for prefill worker 'prefill-0', not 'prefill-1'" in refusal(dest, worker_id="prefill-1")
    assert refusal(dest) == ""
    assert "used already" in refusal(dest)
    assert "no valid lease" in refusal(_granted(), request_id="another-request")
    assert "no valid lease" in refusal(_granted(signer=Security(token="another-cluster")))
    assert "expired" in refusal(_granted(ttl_s=0.05))
    assert "outside the destination pool" in refusal(_granted(cached_block_ids=[8]))


def test_a_shm_grant_maps_only_a_private_pool_file_of_its_decode_worker(tmp_path) -> None:
    pools, elsewhere = tmp_path / "pools", tmp_path / "elsewhere"
    pools.mkdir(), elsewhere.mkdir()
    for path, mode in ((pools / "kvserve-decode-0-1", 0o600), (pools / "kvserve-decode-0-2", 0o644),
                       (pools / "kvserve-decode-9-1", 0o600), (elsewhere / "kvserve-decode-0-1", 0o600)):  # fmt: skip
        path.write_bytes(b"\0" * 64)
        os.chmod(path, mode)

    def refusal(path) -> str:
        dest = _granted(backend="shm", shm_path=str(path))
        return lease.grant_refusal(SECURITY, "r", dest, "prefill-0", pools, lease.NonceBook())

    assert refusal(pools / "kvserve-decode-0-1") == ""
    assert "private (0600)" in refusal(pools / "kvserve-decode-0-2")
    assert "not a KV pool of decode worker 'decode-0'" in refusal(pools / "kvserve-decode-9-1")
    assert "not a KV pool" in refusal(elsewhere / "kvserve-decode-0-1")
    assert "cannot open" in refusal(pools / "missing")


def test_the_write_deadline_is_the_expiry_less_the_margin() -> None:
    dest = _granted(ttl_s=10)
    expected = time.monotonic() + 10 - lease.WRITE_MARGIN_S
    assert abs(lease.write_deadline(dest) - expected) < 0.05


def test_a_grant_names_the_tokens_its_cached_blocks_hold() -> None:
    dest = pb.KVDestination(worker_id="decode-0", fingerprint="fp", block_ids=[3], cached_block_ids=[1], num_blocks=8)
    lease.grant(SECURITY, "r", dest, "prefill-0", 30, TOKENS, num_cached_tokens=16)
    assert dest.cached_prefix_hash == block_hashes(TOKENS, 16, "fp")[-1]
    assert lease.confirms_prefix(dest, TOKENS)
    assert not lease.confirms_prefix(dest, TOKENS[::-1])
    assert not lease.confirms_prefix(dest, [])
    bare = _granted()  # no cached blocks: nothing to confirm
    assert bare.cached_prefix_hash == "" and not lease.confirms_prefix(bare, TOKENS)


# ---- signatures per record kind --------------------------------------------------------------------------------


def test_each_kind_of_lease_record_signs_for_a_purpose_of_its_own() -> None:
    purposes = (lease.GRANT_PURPOSE, lease.RECORD_PURPOSE, lease.END_PURPOSE)
    assert len(set(purposes)) == 3 and {PURPOSE_KEYS[p] for p in purposes} == {"lease"}
    parts = ("r", "decode-0", "prefill-0", "[1]")
    for purpose in purposes:  # the same parts signed for one purpose verify for no other
        signature = SECURITY.sign(purpose, *parts)
        assert [SECURITY.verify(signature, other, *parts) for other in purposes] == [p == purpose for p in purposes]

    fields = LeaseRecord("r", "decode-0", "prefill-0", [1]).to_redis(SECURITY)
    ended = fields | {"state": "success", "state_signature": fields["signature"]}  # the holder's, posing as an end
    assert LeaseRecord.from_redis("r", ended, SECURITY).state == "pending"


def test_a_record_reads_back_and_only_its_writer_can_end_it() -> None:
    record = LeaseRecord("r", "decode-0", "prefill-0", [7, 3, 9])
    fields = record.to_redis(SECURITY)
    assert LeaseRecord.from_redis("r", fields, SECURITY) == record and not record.ended
    with pytest.raises(ValueError, match="does not verify"):
        LeaseRecord.from_redis("other-request", fields, SECURITY)
    with pytest.raises(ValueError, match="does not verify"):
        LeaseRecord.from_redis("r", fields | {"block_ids": "[7, 3, 9, 10]"}, SECURITY)

    for writer, state, read in (("prefill-0", "failed", "failed"), ("prefill-1", "success", "pending")):
        signature = end_signature(SECURITY, "r", writer, state)
        back = LeaseRecord.from_redis("r", fields | {"state": state, "state_signature": signature}, SECURITY)
        assert (back.state, back.ended) == (read, read != "pending")
    with pytest.raises(ValueError, match="lease ends"):
        end_signature(SECURITY, "r", "prefill-0", "pending")


# ---- the record in Redis ---------------------------------------------------------------------------------------


def test_lease_lifecycle_and_expiry(registry: Registry, raw: redis.Redis) -> None:
    assert registry.put_lease("req-1", decode_id="d0", prefill_id="p0", block_ids=[7, 3, 9], ttl_s=0.4)
    record = registry.get_lease("req-1")
    assert record is not None
    assert (record.decode_id, record.prefill_id, record.block_ids, record.state) == ("d0", "p0", [7, 3, 9], "pending")

    assert registry.end_lease("req-1", "p0", "success")  # the writer's final state, signed by the writer
    assert registry.get_lease("req-1").state == "success"
    with pytest.raises(ValueError, match="lease ends"):
        registry.end_lease("req-1", "p0", "pending")

    wait_until(lambda: registry.get_lease("req-1") is None, timeout_s=1.0)
    assert not registry.end_lease("req-1", "p0", "failed")
    assert not raw.exists("kvserve:lease:req-1")  # the late update did not recreate a TTL-less hash

    registry.put_lease("req-2", decode_id="d0", prefill_id="p0", block_ids=[1], ttl_s=30)
    registry.delete_lease("req-2")
    assert registry.get_lease("req-2") is None


def test_only_the_writer_can_end_its_lease(registry: Registry, raw: redis.Redis) -> None:
    registry.put_lease("req-1", decode_id="d0", prefill_id="p0", block_ids=[4], ttl_s=30)
    raw.hset("kvserve:lease:req-1", "state", "failed")  # forged in Redis: no writer's signature
    assert registry.get_lease("req-1").state == "pending"
    registry.end_lease("req-1", "p1", "failed")  # signed, but by a worker the lease does not name
    assert registry.get_lease("req-1").state == "pending"
    registry.end_lease("req-1", "p0", "failed")
    assert registry.get_lease("req-1").state == "failed"
    registry.delete_lease("req-1", "p1")  # a retry's new lease is not deleted by an old holder's cleanup
    assert registry.get_lease("req-1") is not None
    registry.delete_lease("req-1", "p0")
    assert registry.get_lease("req-1") is None


def test_a_restarted_writer_ends_the_leases_its_predecessor_left(registry: Registry) -> None:
    for rid, writer in (("a", "p0"), ("b", "p0"), ("c", "p1")):
        registry.put_lease(rid, decode_id="d0", prefill_id=writer, block_ids=[1, 2], ttl_s=30)
    registry.end_lease("b", "p0", "success")
    assert registry.end_leases_of("p0") == 1  # "b" had already ended
    assert [registry.get_lease(rid).state for rid in "abc"] == ["failed", "success", "pending"]
    for rid in "abc":
        registry.delete_lease(rid)


def test_lease_records_written_without_the_lease_key_are_ignored(registry: Registry, raw: redis.Redis) -> None:
    registry.put_lease("req-1", decode_id="d0", prefill_id="p0", block_ids=[1, 2], ttl_s=30)
    raw.hset("kvserve:lease:req-1", "block_ids", "[1, 2, 3]")  # grant one more block
    assert registry.get_lease("req-1") is None
    raw.hset("kvserve:lease:req-2", mapping={"decode_id": "d0", "prefill_id": "p0", "block_ids": "[1]",
                                             "state": "pending", "signature": "00" * 32})  # fmt: skip
    assert registry.get_lease("req-2") is None
    raw.set("kvserve:lease:req-3", "not a hash")  # keys of the wrong type do not break a caller either
    assert registry.get_lease("req-3") is None
