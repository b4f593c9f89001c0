"""Internal traffic that authenticates both ends (issue 21, item 3), over real gRPC on loopback.

A real prefill worker (``prefill-0``) serves ``Prefill`` over mutual TLS with the certificate ``kvserve certs``
made for it; the test process calls it as the router and as ``decode-0``, with their certificates and role
credentials. The destination names the ``grpc`` backend at an address where nothing listens, so a lease that
passes every check leads to a prefill whose KV push fails (UNAVAILABLE) and nothing is ever written anywhere.
The last tests start real ``kvserve up`` clusters without internal TLS (``--insecure-internal``, and the
token-only mode). The impostor probe, against whole clusters, is ``test_impostor.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import signal
import stat
import subprocess
import sys

import grpc
import pytest
from cluster_utils import free_base_port
from service_utils import InProcessServer

from cluster_state import lease
from engine import LLMEngine
from kvserve.cli import main as kvserve_main
from kvserve.client import Client
from kvserve.launcher.scratch import cluster_shm_dir
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.server import wait_healthy
from security.auth import Security
from security.certs import make_cluster_dir
from security.identity import Identity, read_member_dir
from security.keys import Keyring

NUM_BLOCKS = 32
NOWHERE = "127.0.0.1:1"  # the destination's PushKV address: refused at once
PREFILL = Identity("prefill", "prefill-0")


class _Unreachable:
    """A servicer whose methods say they were reached (the interceptor let the call through)."""

    async def Generate(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "reached")
        yield  # pragma: no cover

    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "reached")


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """``kvserve certs`` for a router, a decode and a prefill worker: each one's ``Security`` as it would load it,
    and (``member``) that of a process given the cluster secret itself, without a certificate."""
    out = tmp_path_factory.mktemp("certs") / "cluster"
    kvserve_main(["certs", "--out", str(out), "--names", "router", "decode-0", "prefill-0"])
    members = {name: Security(token=(out / name / "token").read_text().strip(), **read_member_dir(out / name))
               for name in ("router", "decode-0", "prefill-0")}  # fmt: skip
    return members | {"member": Security(token=(out / "ca" / "cluster-secret").read_text().strip())}


@pytest.fixture(scope="module")
def prefill(members):
    engine = LLMEngine(model="default", num_blocks=NUM_BLOCKS, block_size=16)
    worker = PrefillWorker(engine, "prefill-0", "", members["prefill-0"])
    worker.loop.start()
    server = InProcessServer({"Prefill": worker}, security=members["prefill-0"])
    yield worker, server.address
    server.stop()
    worker.stop()
    engine.close()


def _destination(prefill_worker: PrefillWorker, signer: Security, request_id: str, **fields) -> pb.KVDestination:
    dest = pb.KVDestination(**{"worker_id": "decode-0", "backend": "grpc", "address": NOWHERE,
                               "fingerprint": prefill_worker.fingerprint, "block_ids": [0, 1, 2, 3],
                               "num_blocks": NUM_BLOCKS, **fields})  # fmt: skip
    lease.grant(signer, request_id, dest, "prefill-0", 30)
    return dest


def _call(caller: Security, name: str, address: str, request_id: str, dest: pb.KVDestination,
          peer: Identity = PREFILL, num_cached_tokens: int = 0) -> grpc.RpcError | None:  # fmt: skip
    request = pb.PrefillRequest(request_id=request_id, prompt_token_ids=list(range(100, 164)),
                                sampling=pb.SamplingOptions(temperature=0), destination=dest,
                                num_cached_tokens=num_cached_tokens)  # fmt: skip
    with caller.channel(address, peer) as channel:
        try:
            pb_grpc.PrefillStub(channel).Prefill(request, timeout=60, metadata=caller.metadata(name))
        except grpc.RpcError as err:
            return err
    return None


def test_kvserve_certs_makes_private_directories_of_each_roles_keys(tmp_path, capsys):
    out = tmp_path / "cluster"
    kvserve_main(["certs", "--out", str(out), "--names", "router", "decode-0"])
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for name in ("ca", "router", "decode-0"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o700
        assert {stat.S_IMODE(f.stat().st_mode) for f in (out / name).iterdir()} == {0o600}
    router = Keyring.from_token((out / "router" / "token").read_text().strip())
    decode = Keyring.from_token((out / "decode-0" / "token").read_text().strip())
    assert (router.role, sorted(router.keys)) == ("router", ["call-router", "registry"])
    assert decode.role == "decode" and "lease" in decode.keys and decode.keys["registry"] == router.keys["registry"]
    assert read_member_dir(out / "decode-0")["identity"] == Identity("decode", "decode-0")
    capsys.readouterr()
    kvserve_main(["certs", "--out", str(out), "--names", "decode-0", "prefill:prefill-x"])  # adds the new one only
    assert capsys.readouterr().out.split() == [str(out / "prefill-x")]
    assert Keyring.from_token((out / "prefill-x" / "token").read_text().strip()).keys["lease"] == decode.keys["lease"]


def test_the_routers_credential_cannot_call_prefill_nor_sign_a_lease_a_prefill_worker_accepts(members, prefill):
    worker, address = prefill
    router, decode = members["router"], members["decode-0"]
    valid = _destination(worker, decode, "r1")
    err = _call(router, "router", address, "r1", valid)  # its certificate says router: Prefill is not for it
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, err
    assert "a router may not call kvserve.v1.Prefill" in err.details()
    with pytest.raises(PermissionError, match="no lease key"):
        lease.grant(router, "r2", pb.KVDestination(worker_id="decode-0"), "prefill-0", 30)
    for kind, key in router.keyring.keys.items():  # a lease signed with any key the router holds...
        forged = _destination(worker, decode, "r3")
        parts = ["lease-grant", *lease._grant_parts("r3", forged)]
        forged.lease_signature = hmac.new(key, "\x1f".join(parts).encode(), hashlib.sha256).hexdigest()
        err = _call(decode, "decode-0", address, "r3", forged)  # ... handed over by a real decode worker
        assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, kind
        assert "no valid lease" in err.details()
    assert worker.batch_sizes == []  # nothing was ever prefilled


def test_without_certificates_the_routers_call_token_calls_decode_only(members):
    """Token-only mode: the same roles, told by each role's own call token."""
    server = InProcessServer({"Decode": _Unreachable(), "Prefill": _Unreachable()}, security=members["member"])
    router = Security(members["router"].token)  # its credential, without its certificate
    try:
        with router.channel(server.address) as channel:
            request = pb.DecodeRequest(request_id="t", prompt_token_ids=[1, 2, 3])
            with pytest.raises(grpc.RpcError) as reached:
                list(pb_grpc.DecodeStub(channel).Generate(request, timeout=10, metadata=router.metadata()))
            assert reached.value.code() == grpc.StatusCode.UNIMPLEMENTED  # let through to the servicer
            with pytest.raises(grpc.RpcError) as denied:
                pb_grpc.PrefillStub(channel).Prefill(pb.PrefillRequest(), timeout=10, metadata=router.metadata())
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop()


def test_a_replayed_prefill_request_is_refused(members, prefill):
    worker, address = prefill
    decode = members["decode-0"]
    dest = _destination(worker, decode, "once")
    first = _call(decode, "decode-0", address, "once", dest)  # accepted: prefilled, then the push finds nobody
    assert first is not None and first.code() == grpc.StatusCode.UNAVAILABLE and "pushing the KV" in first.details()
    replayed = _call(decode, "decode-0", address, "once", dest)
    assert replayed is not None and replayed.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "used already" in replayed.details()
    assert worker.batch_sizes == [1]


def _altered(dest: pb.KVDestination, name: str) -> pb.KVDestination:
    changed = pb.KVDestination()
    changed.CopyFrom(dest)
    value = getattr(changed, name)
    if isinstance(value, bytes):
        setattr(changed, name, value + b"1")
    elif isinstance(value, str):
        setattr(changed, name, value + "1")
    elif isinstance(value, int):
        setattr(changed, name, value + 1)
    else:  # repeated
        first = value[0] if value else 1
        value.append(b"1" if isinstance(first, bytes) else "1" if isinstance(first, str) else 1)
    return changed


def test_a_lease_with_any_field_altered_is_refused(members, prefill, tmp_path):
    worker, address = prefill
    decode = members["decode-0"]
    dest = _destination(worker, decode, "edit", shm_path="/nowhere", cuda_ipc_handle=b"handle", cached_block_ids=[5],
                        nixl_metadata=b"agent", nixl_pool="DRAM:0:4096", kv_heads="2,1",
                        part_shm_paths=["/nowhere-r1"], part_cuda_ipc_handles=[b"handle-r1"])  # fmt: skip
    lease.grant(decode, "edit", dest, "prefill-0", 30, list(range(100, 116)), 16)  # every field set
    names = [f.name for f in pb.KVDestination.DESCRIPTOR.fields if f.name != "lease_signature"]
    assert {"cuda_ipc_handle", "fingerprint", "num_cached_tokens", "cached_prefix_hash", "lease_nonce"} <= set(names)
    assert set(names) <= {field.name for field, _ in dest.ListFields()}
    for name in names:
        changed = _altered(dest, name)
        why = lease.grant_refusal(decode, "edit", changed, "prefill-0", tmp_path, lease.NonceBook())
        assert "no valid lease" in why, (name, why)
        err = _call(decode, "decode-0", address, "edit", changed, num_cached_tokens=16)
        expected = grpc.StatusCode.FAILED_PRECONDITION if name == "fingerprint" else grpc.StatusCode.PERMISSION_DENIED
        assert err is not None and err.code() == expected, (name, err)
    assert lease.grant_refusal(decode, "edit", dest, "prefill-0", tmp_path, lease.NonceBook()) == ""  # unaltered: valid


def test_clients_reach_only_the_member_they_meant_and_servers_admit_only_the_clusters(members, prefill, tmp_path):
    worker, address = prefill
    decode = members["decode-0"]
    dest = _destination(worker, decode, "meant")
    err = _call(decode, "decode-0", address, "meant", dest, peer=Identity("prefill", "prefill-1"))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE  # TLS: not the worker we meant
    [stranger_dir] = make_cluster_dir(tmp_path / "other", ["decode-0"])  # the same name, another cluster's CA
    stranger = Security(token=decode.token, **read_member_dir(stranger_dir))
    err = _call(stranger, "decode-0", address, "meant", dest)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE  # neither end trusts the other's CA
    other_pool = _destination(worker, decode, "meant", worker_id="decode-1")  # a lease on another decode's pool
    err = _call(decode, "decode-0", address, "meant", other_pool)
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "comes from that worker only" in err.details()
    assert worker.batch_sizes.count(1) <= 1  # nothing prefilled here (the replay test's one prefill aside)



# ~14 s each, on demand: pytest -m soak tests/cluster/test_internal_tls.py (in-process, test_auth.py checks the role
# tokens of the token-only mode; test_up.py starts kvserve up with its default, internal TLS)
@pytest.mark.parametrize("mode", [pytest.param(["--insecure-internal"], marks=pytest.mark.soak),
                                  pytest.param(["--internal-tls", "false"], marks=pytest.mark.soak)],
                         ids=["insecure", "token"])  # fmt: skip
def test_kvserve_up_without_internal_tls_still_serves(tmp_path, mode):
    """``--insecure-internal`` (no token, no certificates; it warns) and the token-only mode (each child's role
    credential, no certificates): internal ports are plain, and requests are served through both workers."""
    port = free_base_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "up", *mode, "--port", str(port), "--http-port", "0",
           "--num-blocks", "64", "--log-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "serving kvserve.v1.Inference" in line:
                break
        assert "serving kvserve.v1.Inference" in lines[-1], "".join(lines)
        with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
            result = client.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4 and result.prefill_worker == "prefill-0"
        assert wait_healthy(f"127.0.0.1:{port + 10}", 5.0)  # the decode worker's port: plaintext, no certificate
        assert not list(cluster_shm_dir(port).glob("tls-*"))  # no certificates were made
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    warning = "--insecure-internal: internal RPCs accept any caller"
    logged = "".join(lines) + (tmp_path / "decode-0.log").read_text()
    assert (warning in logged) == (mode == ["--insecure-internal"])
