"""The transports by name, and the one choice of transport for a pair of workers."""

from __future__ import annotations

import pytest

from transfer.backend import LOCAL, Backend, Endpoint, choose_backend


def test_backends_are_their_wire_strings():
    """The values travel in KVDestination.backend, usage's transfer_backend and metric labels."""
    assert [str(b) for b in Backend] == ["shm", "cuda_ipc", "grpc"]
    assert Backend("cuda_ipc") is Backend.CUDA_IPC and Backend.GRPC == "grpc"
    assert LOCAL == "local" and LOCAL not in set(Backend)  # a local prefill is no transport
    with pytest.raises(ValueError):
        Backend(LOCAL)


def test_only_transports_that_map_the_pool_write_in_place():
    assert Backend.SHM.writes_in_place and Backend.CUDA_IPC.writes_in_place
    assert not Backend.GRPC.writes_in_place  # every write goes through PushKV, which checks the lease


CPU_WITH_SHM = Endpoint("host-a", "cpu", shm_pool=True)


@pytest.mark.parametrize(
    ("prefill", "decode", "forced", "expected"),
    [
        (Endpoint("host-a", "cpu"), CPU_WITH_SHM, None, Backend.SHM),  # same host, CPU pool in a shm file
        (Endpoint("host-a", "cpu"), Endpoint("host-a", "cpu"), None, Backend.GRPC),  # same host, private pool
        (Endpoint("host-a", "cuda"), Endpoint("host-a", "cuda:1"), None, Backend.CUDA_IPC),  # same host, GPU
        (Endpoint("host-b", "cpu"), CPU_WITH_SHM, None, Backend.GRPC),  # another host: no shared memory
        (Endpoint("host-b", "cuda"), Endpoint("host-a", "cuda"), None, Backend.GRPC),
        (Endpoint("host-a", "cpu"), CPU_WITH_SHM, Backend.GRPC, Backend.GRPC),  # forced by a flag
        (Endpoint("host-b", "cpu"), Endpoint("host-a", "cpu"), Backend.SHM, Backend.SHM),  # even where it fails
    ],
)
def test_choice_of_transport(prefill, decode, forced, expected):
    assert choose_backend(prefill, decode, forced) is expected
