"""A cluster over three hosts: Redis and the router on one, a prefill worker on another, a decode worker on a third.

The hosts are network namespaces with a /dev/shm each (kvserve/testing/netns.py), so shared memory between the workers
is impossible, as between machines: KV crosses over a real network link, through the transport the test
names, and each worker registers the address it can be reached at (``--advertise``). Every process is the
real entry point (``python -m router``, ``prefill_service``, ``decode_service``, the embedded Redis's server
binary), with a credential of its role from one cluster token, as ``kvserve up`` runs them.

For each transport (``grpc``; ``nixl`` where NIXL is installed; its kill case with ``KVSERVE_MULTIHOST_ALL=1``):
concurrent requests give the offline engine's tokens; then the prefill host is frozen while it holds a
request, and torn down (every process SIGKILLed, its namespace and link deleted): the request ends by local
prefill with the same tokens, and the decode worker's blocks all come back. The module's hosts are removed
at the end, and nothing of them may be left. Without root or ``ip`` the module skips, saying why.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from cluster_utils import tiny_engine_argv
from waiting import wait_until

from engine import LLM, SamplingParams
from kvserve.client import Client
from kvserve.testing import netns
from kvserve.testing.multihost import multihost_cluster
from transfer.backend import nixl_installed

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # test helpers, run as scripts here
PREFILL_TIMEOUT_S = 10.0  # the decode worker's deadline for a prefill: the most a silent dead prefill host costs
NUM_REQUESTS, MAX_TOKENS = 8, 16
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# a sitecustomize that makes NIXL's modules unimportable: the workers of the grpc cluster run as without NIXL
WITHOUT_NIXL = {"PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT / "without_nixl"),
                                                          os.environ.get("PYTHONPATH")]))}  # fmt: skip


def prompt(index: int) -> list[int]:
    return [1, 504, 345, 288, 234, 28, 195, 216 + index, 42]


@pytest.fixture(scope="module", params=["grpc", "nixl"])
def multihost(request, tmp_path_factory, tiny_model_dir):
    """The tiny model: what crosses the hosts is KV blocks, the same path whatever the model's size."""
    # grpc: neither worker has NIXL and nothing is forced (across hosts that chooses grpc); nixl: forced
    if reason := netns.unavailable():
        pytest.skip(reason)
    if request.param == "nixl" and not nixl_installed():
        pytest.skip("NIXL is not installed here: pip install '.[nixl]' (make test does)")
    logs = tmp_path_factory.mktemp(f"multihost-{request.param}")
    forced = ["--kv-transport", "nixl"] if request.param == "nixl" else []
    decode_argv = [*forced, "--prefill-timeout-s", str(PREFILL_TIMEOUT_S)]
    with multihost_cluster(tiny_engine_argv(tiny_model_dir), logs, decode_argv=decode_argv,
                           worker_env=WITHOUT_NIXL if request.param == "grpc" else None) as cluster:  # fmt: skip
        yield cluster
    assert not netns.ours(), "namespaces or links of this test are left"


@pytest.fixture(scope="module")
def offline_tokens(tiny_model_dir) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), skip_tokenizer_init=True, block_size=16, num_blocks=256)
    outs = llm.generate([prompt(i) for i in range(NUM_REQUESTS + 1)], SamplingParams(**GREEDY))
    return [out.token_ids for out in outs]


def test_concurrent_requests_cross_hosts_and_equal_the_offline_engine(multihost, offline_tokens, request):
    transport = request.node.callspec.params["multihost"]
    with Client(multihost.endpoint, timeout_s=120) as client, ThreadPoolExecutor(NUM_REQUESTS) as pool:
        results = list(pool.map(lambda i: client.generate(prompt(i), **GREEDY), range(NUM_REQUESTS)))
    assert [r.token_ids for r in results] == offline_tokens[:NUM_REQUESTS]
    assert {r.transfer_backend for r in results} == {transport}  # shm is impossible between these hosts
    assert {(r.prefill_worker, r.decode_worker) for r in results} == {("prefill-0", "decode-0")}
    [decode] = multihost.registry.workers("decode")
    [prefill] = multihost.registry.workers("prefill")
    assert decode.host_id != prefill.host_id and decode.address.startswith(multihost.hosts.hosts[2].address)
    offered = {"grpc": "", "nixl": "nixl"}[transport]  # without NIXL a worker offers grpc alone
    assert (decode.transports, prefill.transports) == (offered, offered)


def test_a_prefill_host_torn_down_mid_request_costs_neither_the_request_nor_blocks(multihost, offline_tokens,
                                                                                   request):  # fmt: skip
    if request.node.callspec.params["multihost"] != "grpc" and not os.environ.get("KVSERVE_MULTIHOST_ALL"):
        # a nixl writer writes our memory itself: its blocks wait out the lease (10 s) and the grace
        pytest.skip("over nixl this takes ~14 s: KVSERVE_MULTIHOST_ALL=1 pytest tests/cluster/test_multihost.py")
    hosts, children = multihost.hosts, multihost.children
    prefill_host = hosts.hosts[1]
    for pid in netns.pids_in(prefill_host.name):  # frozen: it takes the request and never answers
        os.kill(pid, signal.SIGSTOP)
    leases = redis.Redis.from_url(multihost.redis_url)
    with Client(multihost.endpoint, timeout_s=120) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.generate, prompt(NUM_REQUESTS), **GREEDY)
        wait_until(lambda: leases.keys("kvserve:lease:*"), 30)  # the decode worker has handed it over
        hosts.kill(prefill_host)
        result = pending.result(timeout=60)
    leases.close()
    children["prefill-0"].proc.wait(timeout=10)
    assert result.token_ids == offline_tokens[NUM_REQUESTS] and result.transfer_backend == "local"

    def all_blocks_free() -> bool:
        [decode] = multihost.registry.workers("decode")
        return decode.num_running == 0 and decode.free_blocks == decode.total_blocks

    wait_until(all_blocks_free, 20)
    assert not netns.pids_in(prefill_host.name) and prefill_host.name not in netns.ours()
