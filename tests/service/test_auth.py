"""Trust boundaries: the cluster token on every internal service, leases on every KV write, mutual TLS.

Real servers on loopback (decode and prefill workers in this process, a real Redis for the registry);
the victim's KV is read back through a second mapping of its pool file, not through the worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import grpc
import pytest
from engine_testing import NUM_NEW_TOKENS
from service_utils import TEST_SECURITY, InProcessServer
from waiting import wait_until

from cluster_state import lease
from cluster_state.registry import Registry
from decode_service.worker import DecodeWorker
from engine import LLMEngine
from kvserve.launcher.redis_server import EmbeddedRedis
from kvstore.shared_pool import map_pool_file, pool_dir
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.loop import AsyncioThread
from security.auth import Security
from transfer.blocks import checksum, checksum_blocks

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def cluster():
    """One prefill and one decode worker (shm pool), registered in a real Redis, served in this process."""
    with EmbeddedRedis() as redis:
        prefill_engine = LLMEngine(model="default", num_blocks=NUM_BLOCKS, block_size=16)
        prefill = PrefillWorker(prefill_engine, "prefill-a", "", TEST_SECURITY)
        prefill.loop.start()
        prefill_server = InProcessServer({"Prefill": prefill})
        prefill.address = prefill_server.address
        registry = Registry(redis.url, security=TEST_SECURITY)
        registry.register(prefill.info())
        registry.start_heartbeat(prefill.load)
        engine = LLMEngine(model="default", num_blocks=NUM_BLOCKS, block_size=16, shared_kv_name="decode-a")
        aio = AsyncioThread()
        decode = DecodeWorker(engine, "decode-a", "", aio, TEST_SECURITY, Registry(redis.url, security=TEST_SECURITY),
                              shm_path=str(engine.runner.kv_pool_path))  # fmt: skip
        decode.loop.start()
        decode_server = InProcessServer({"Decode": decode, "KVTransfer": decode.receiver}, aio=aio)
        decode.address = decode_server.address
        # the decode worker's view of the registry is refreshed every second
        wait_until(lambda: decode.prefills.workers, 10, "the decode worker seeing the prefill worker")
        yield decode, prefill
        decode_server.stop()
        decode.stop()
        aio.stop()
        prefill_server.stop()
        prefill.stop()
        engine.close()
        registry.stop()


def _destination(decode: DecodeWorker, blocks: list[int], **fields) -> pb.KVDestination:
    dest = pb.KVDestination(worker_id=decode.worker_id, backend="shm", fingerprint=decode.fingerprint, block_ids=blocks,
                            shm_path=decode.connector.pool.shm_path, num_blocks=NUM_BLOCKS)  # fmt: skip
    for name, value in fields.items():
        if name in ("block_ids", "cached_block_ids"):
            dest.ClearField(name)
            getattr(dest, name).extend(value)
        else:
            setattr(dest, name, value)
    return dest


def _prefill(prefill: PrefillWorker, request_id: str, dest: pb.KVDestination, metadata,
             num_cached_tokens: int = 0) -> grpc.RpcError | None:  # fmt: skip
    request = pb.PrefillRequest(request_id=request_id, prompt_token_ids=list(range(100, 164)),
                                sampling=pb.SamplingOptions(temperature=0), destination=dest,
                                num_cached_tokens=num_cached_tokens)  # fmt: skip
    with grpc.insecure_channel(prefill.address) as channel:
        try:
            pb_grpc.PrefillStub(channel).Prefill(request, timeout=30, metadata=metadata)
        except grpc.RpcError as err:
            return err
    return None


def _hostile_prefills(decode: DecodeWorker, prefill: PrefillWorker, tmp_path) -> list[tuple[str, grpc.RpcError]]:
    """Every way an authenticated caller might aim a prefill at blocks it was not given."""
    member = TEST_SECURITY.metadata("intruder")
    blocks = list(range(NUM_BLOCKS - 4, NUM_BLOCKS))
    foreign = tmp_path / f"kvserve-{decode.worker_id}-1"  # a file of the right name, outside the pool directory
    shutil.copyfile(decode.connector.pool.shm_path, foreign)
    os.chmod(foreign, 0o600)
    cases = {"unsigned": _destination(decode, blocks)}
    for name, ttl, holder, signer, fields in [
        ("other prefill worker", 30, "prefill-b", TEST_SECURITY, {}),
        ("expired", -1, "prefill-a", TEST_SECURITY, {}),
        ("signed with another token", 30, "prefill-a", Security(token="not-the-cluster-token"), {}),
        ("foreign pool file", 30, "prefill-a", TEST_SECURITY, {"shm_path": str(foreign)}),
        ("blocks outside the pool", 30, "prefill-a", TEST_SECURITY, {"block_ids": [10**6, 1, 2, 3]}),
        ("cached blocks outside the pool", 30, "prefill-a", TEST_SECURITY, {"cached_block_ids": [-1]}),
    ]:
        dest = _destination(decode, blocks, **fields)
        lease.grant(signer, "steal", dest, holder, ttl)
        cases[name] = dest
    tampered = _destination(decode, blocks)
    lease.grant(TEST_SECURITY, "steal", tampered, "prefill-a", 30)
    tampered.block_ids[0] = 0  # a valid grant for other blocks, edited after signing
    cases["edited after signing"] = tampered
    reader = _destination(decode, blocks)
    lease.grant(TEST_SECURITY, "steal", reader, "prefill-a", 30)
    reader.cached_block_ids.append(0)  # a grant to write some blocks, edited into one to read another's too
    cases["cached blocks added after signing"] = reader
    return [(name, _prefill(prefill, "steal", dest, member)) for name, dest in cases.items()]


def test_internal_services_refuse_callers_without_the_token(cluster):
    decode, prefill = cluster
    sampling = pb.SamplingOptions(temperature=0, max_tokens=2)
    for metadata in [(), Security(token="wrong-token").metadata("decode-a")]:
        with grpc.insecure_channel(decode.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                request = pb.DecodeRequest(request_id="x", prompt_token_ids=[1, 2, 3], sampling=sampling)
                list(pb_grpc.DecodeStub(channel).Generate(request, timeout=10, metadata=metadata))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            chunk = pb.KVChunk(request_id="x", fingerprint=decode.fingerprint, block_ids=[0], data=b"",
                               checksum=checksum(b""))  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVTransferStub(channel).PushKV(iter([chunk]), timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        dest = _destination(decode, [0, 1, 2, 3])
        lease.grant(TEST_SECURITY, "x", dest, "prefill-a", 30)
        err = _prefill(prefill, "x", dest, metadata)
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "cluster members only" in err.details()


def test_kv_writes_need_a_lease_and_a_concurrent_request_stays_exact(cluster, engine_prompts, hf_greedy, tmp_path):
    decode, prefill = cluster
    targets = list(range(NUM_BLOCKS - 4, NUM_BLOCKS))  # what the hostile calls aim at; the victim uses low blocks
    # an independent read of the victim's pool
    victim_view = map_pool_file(decode.engine.runner.kv_spec, NUM_BLOCKS, decode.connector.pool.shm_path)
    before = checksum_blocks(victim_view, targets)
    served: list[int] = []
    request = pb.DecodeRequest(request_id="victim", prompt_token_ids=engine_prompts[6],
                               sampling=pb.SamplingOptions(temperature=0, max_tokens=NUM_NEW_TOKENS,
                                                           ignore_eos=True))  # fmt: skip
    replies = []

    def victim() -> None:  # its own connection: the intruders' calls are not multiplexed onto it
        with grpc.insecure_channel(decode.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            for msg in pb_grpc.DecodeStub(channel).Generate(request, timeout=120, metadata=TEST_SECURITY.metadata()):
                served.extend(msg.token_ids)
                replies.append(msg)

    thread = threading.Thread(target=victim)
    thread.start()
    outcomes = []
    while thread.is_alive():  # keep attacking for as long as the victim is prefilled and decoded
        outcomes += _hostile_prefills(decode, prefill, tmp_path)
        data = bytes(4 * 16 * 4096)
        for request_id in [*list(decode._active), "victim-0"]:  # in flight (leased to prefill-a) or unknown
            chunk = pb.KVChunk(request_id=request_id, fingerprint=decode.fingerprint, block_ids=targets, data=data,
                               checksum=checksum(data))  # fmt: skip
            with grpc.insecure_channel(decode.address) as channel:
                try:
                    metadata = TEST_SECURITY.metadata("intruder")
                    pb_grpc.KVTransferStub(channel).PushKV(iter([chunk]), timeout=10, metadata=metadata)
                    outcomes.append(("push", None))
                except grpc.RpcError as err:
                    outcomes.append(("push", err))
    thread.join()
    assert served == hf_greedy[6]
    assert replies[-1].transfer_backend == "shm" and replies[-1].prefill_worker == "prefill-a"
    for name, err in outcomes:
        assert err is not None, f"{name}: accepted"
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, f"{name}: {err.code()} {err.details()}"
    assert {name for name, _ in outcomes} >= {"unsigned", "expired", "foreign pool file", "push"}
    assert checksum_blocks(victim_view, targets) == before  # not one byte written where the intruders aimed
    assert prefill.batch_sizes == [1]  # only the victim's prefill ever ran
    assert decode.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_cached_block_ids_must_name_exactly_the_cached_prefix_blocks(cluster):
    decode, prefill = cluster
    for cached, held, backend in [([1], 0, "shm"), ([1], 32, "shm"), ([1, 2], 16, "shm"), ([1], 16, "grpc")]:
        dest = _destination(decode, [NUM_BLOCKS - 3, NUM_BLOCKS - 2, NUM_BLOCKS - 1], cached_block_ids=cached,
                            backend=backend)  # fmt: skip
        lease.grant(TEST_SECURITY, "misread", dest, "prefill-a", 30, num_cached_tokens=held)
        err = _prefill(prefill, "misread", dest, TEST_SECURITY.metadata("decode-a"), held)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (cached, held, backend)
        assert "cached block ids" in err.details()


def test_cached_blocks_are_read_only_when_the_lease_names_the_prompts_tokens(cluster):
    """Blocks offered for reading must hold this prompt's prefix by the lease's signed prefix hash: blocks named
    for other tokens, or for none, are never read (nor cached under this prompt's hashes)."""
    decode, prefill = cluster
    for named in (list(range(200, 216)), []):  # _prefill's prompt starts with 100..115
        dest = _destination(decode, [NUM_BLOCKS - 3, NUM_BLOCKS - 2, NUM_BLOCKS - 1], cached_block_ids=[1])
        lease.grant(TEST_SECURITY, "misnamed", dest, "prefill-a", 30, named, 16)
        err = _prefill(prefill, "misnamed", dest, TEST_SECURITY.metadata("decode-a"), 16)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, named
        assert "prefix hash" in err.details()


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA, and a certificate for 127.0.0.1 it signed (used by both ends, as in a small cluster)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=kvserve-test-ca", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    return {name: (d / f"{name}").read_bytes() for name in ("ca.pem", "node.pem", "node.key")}


def test_mutual_tls_admits_only_peers_with_a_certificate_of_the_cluster_ca(cluster, tls_files):
    decode, _ = cluster
    secure = Security(token=TEST_SECURITY.token, tls_cert=tls_files["node.pem"], tls_key=tls_files["node.key"],
                      tls_ca=tls_files["ca.pem"])  # fmt: skip
    server = InProcessServer({"Decode": decode}, security=secure, aio=AsyncioThread())
    request = pb.DecodeRequest(request_id="tls", prompt_token_ids=[5, 6, 7],
                               sampling=pb.SamplingOptions(temperature=0, max_tokens=2, ignore_eos=True))  # fmt: skip
    try:
        with secure.channel(server.address) as channel:
            replies = list(pb_grpc.DecodeStub(channel).Generate(request, timeout=30, metadata=secure.metadata()))
        assert sum(len(r.token_ids) for r in replies) == 2
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=tls_files["ca.pem"])
        for channel in [grpc.insecure_channel(server.address),
                        grpc.secure_channel(server.address, no_client_cert)]:  # fmt: skip
            with channel, pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.DecodeStub(channel).Generate(request, timeout=10, metadata=secure.metadata()))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_pool_files_are_private_to_the_cluster(cluster):
    decode, _ = cluster
    assert os.stat(decode.connector.pool.shm_path).st_mode & 0o777 == 0o600
    assert os.stat(pool_dir()).st_mode & 0o777 == 0o700


def test_a_router_with_the_wrong_token_tells_its_client_unavailable_not_unauthenticated(cluster, model_dir):
    """The public client did nothing wrong: the internal auth error stays inside, the router's log names it."""
    from router_utils import new_router

    from router.server import Router

    decode, _ = cluster
    router: Router = new_router(model_dir, [decode.address])
    router.security = Security(token="not-the-cluster-token")
    front = InProcessServer({"Inference": router})
    try:
        with grpc.insecure_channel(front.address) as channel:
            request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingOptions(max_tokens=2))
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.InferenceStub(channel).Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "UNAUTHENTICATED" in err.value.details()
    finally:
        front.aio.run(router.close())
        front.stop()
