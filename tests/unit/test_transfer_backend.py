"""The transports by name, and the one choice of transport for a pair of workers."""

from __future__ import annotations

import pytest

from transfer.backend import LOCAL, Backend, Endpoint, choose_backend


def test_backends_are_their_wire_strings():
    """The values travel in KVDestination.backend, usage's transfer_backend and metric labels."""
    assert [str(b) for b in Backend] == ["shm", "cuda_ipc", "grpc", "nixl"]
    assert Backend("cuda_ipc") is Backend.CUDA_IPC and Backend.GRPC == "grpc"
    assert LOCAL == "local" and LOCAL not in set(Backend)  # a local prefill is no transport
    with pytest.raises(ValueError):
        Backend(LOCAL)


def test_only_grpc_writes_through_the_decode_workers_check():
    assert Backend.SHM.writes_in_place and Backend.CUDA_IPC.writes_in_place
    assert Backend.NIXL.writes_in_place  # a NIXL write lands in the pool directly: the writer ends its lease
    assert not Backend.GRPC.writes_in_place  # every write goes through PushKV, which checks the lease


def test_only_transports_that_map_the_pool_read_cached_blocks():
    assert Backend.SHM.maps_pool and Backend.CUDA_IPC.maps_pool
    assert not Backend.NIXL.maps_pool and not Backend.GRPC.maps_pool


CPU_WITH_SHM = Endpoint("host-a", "cpu", shm_pool=True)
NIXL = frozenset({"nixl"})


@pytest.mark.parametrize(
    ("prefill", "decode", "forced", "expected"),
    [
        (Endpoint("host-a", "cpu"), CPU_WITH_SHM, None, Backend.SHM),  # same host, CPU pool in a shm file
        (Endpoint("host-a", "cpu"), Endpoint("host-a", "cpu"), None, Backend.GRPC),  # same host, private pool
        (Endpoint("host-a", "cuda"), Endpoint("host-a", "cuda:1"), None, Backend.CUDA_IPC),  # same host, GPU
        (Endpoint("host-b", "cpu"), CPU_WITH_SHM, None, Backend.GRPC),  # another host: no shared memory
        (Endpoint("host-b", "cuda"), Endpoint("host-a", "cuda"), None, Backend.GRPC),
        (Endpoint("host-b", "cpu", transports=NIXL), Endpoint("host-a", "cpu", True, NIXL), None, Backend.NIXL),
        (Endpoint("host-b", "cuda", transports=NIXL), Endpoint("host-a", "cuda", transports=NIXL), None, Backend.NIXL),
        (Endpoint("host-b", "cpu"), Endpoint("host-a", "cpu", transports=NIXL), None, Backend.GRPC),  # P lacks it
        (Endpoint("host-b", "cpu", transports=NIXL), Endpoint("host-a", "cpu"), None, Backend.GRPC),  # D lacks it
        (Endpoint("host-a", "cpu", transports=NIXL), Endpoint("host-a", "cpu", True, NIXL), None, Backend.SHM),
        (Endpoint("host-a", "cuda", transports=NIXL), Endpoint("host-a", "cuda", transports=NIXL), None,
         Backend.CUDA_IPC),  # fmt: skip
        (Endpoint("host-a", "cpu"), CPU_WITH_SHM, Backend.NIXL, Backend.NIXL),  # --kv-transport nixl, one host
        (Endpoint("host-a", "cpu"), CPU_WITH_SHM, Backend.GRPC, Backend.GRPC),  # forced by a flag
        (Endpoint("host-b", "cpu"), Endpoint("host-a", "cpu"), Backend.SHM, Backend.SHM),  # even where it fails
    ],
)
def test_choice_of_transport(prefill, decode, forced, expected):
    assert choose_backend(prefill, decode, forced) is expected


def test_offered_transports_travel_signed_in_the_registration():
    """A worker's ``transports`` is read back as written, cannot be stripped or added unnoticed, and a record
    written before the field existed (signed without it) still reads, offering nothing beyond grpc."""
    from cluster_state.workers import LOAD_FIELDS, WorkerInfo
    from security.auth import Security

    security, load = Security(token="cluster"), dict.fromkeys(LOAD_FIELDS, 0)
    offering = WorkerInfo("prefill-0", "prefill", "h:1", transports="nixl").to_redis(security)
    assert WorkerInfo.from_redis(offering, security, load).transports == "nixl"
    for forged in ({k: v for k, v in offering.items() if k != "transports"}, offering | {"transports": "nixl,x"}):
        with pytest.raises(ValueError):
            WorkerInfo.from_redis(forged, security, load)
    old = WorkerInfo("decode-0", "decode", "h:2").to_redis(security)
    assert "transports" in old and old.pop("transports") == ""  # as an older worker wrote it
    assert WorkerInfo.from_redis(old, security, load).transports == ""
    with pytest.raises(ValueError):
        WorkerInfo.from_redis(old | {"transports": "nixl"}, security, load)  # added to a record signed without


def test_kv_transport_flag_forces_one_on_decode_workers_and_through_kvserve_up():
    from decode_service.settings import DecodeSettings
    from kvserve import settings as up
    from rpc.settings import parse_settings

    assert parse_settings(DecodeSettings, ["--kv-transport", "nixl"]).kv_transport == "nixl"
    assert parse_settings(DecodeSettings, []).kv_transport is None  # the table chooses
    with pytest.raises(SystemExit):
        parse_settings(DecodeSettings, ["--kv-transport", "rdma"])
    given = parse_settings(up.UpSettings, ["--kv-transport", "nixl"], "kvserve up", up.__doc__, up.UP_SET_FIELDS)
    assert given.decode_argv()[:2] == ["--kv-transport", "nixl"]  # (then the --disagg-* tests/conftest.py sets)
    assert "--kv-transport" not in parse_settings(up.UpSettings, [], "kvserve up", up.__doc__,
                                                  up.UP_SET_FIELDS).decode_argv()  # fmt: skip
