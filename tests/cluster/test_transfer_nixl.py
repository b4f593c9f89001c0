"""The ``nixl`` transport: how it addresses a pool's blocks; a NIXL WRITE of leased blocks between two agents,
verified through another path (``nixl_pair.py``); a cluster forced to nixl."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from transfer import nixl
from transfer.backend import nixl_installed
from transfer.blocks import _regions

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # test helpers, run as scripts here
ROOT = Path(__file__).resolve().parents[2]
needs_nixl = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install 'kvserve[nixl]')")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_region_layout_is_the_pools(kv_cache_dtype):
    """The addresses the writer computes for a remote pool of another size are those of its real regions."""
    spec = KVCacheSpec(3, 2, 8, 4, torch.float16, kv_cache_dtype)
    cache = KVCache(spec, 7, "cpu")
    base = cache.buffer.data_ptr()
    expected = [(part.data_ptr() - base, part.shape[1] * part.shape[2]) for (part,) in _regions(cache)]
    assert nixl.region_layout(spec, 7) == expected


def test_runs_pair_consecutive_blocks():
    src, dst, lengths = nixl._runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 7, 8])
    assert (src.tolist(), dst.tolist(), lengths.tolist()) == ([4, 9, 10, 2], [0, 3, 7, 8], [3, 1, 1, 1])


@needs_nixl
def test_two_agents_move_leased_blocks_refuse_unsigned_metadata_and_rest_when_idle(tmp_path):
    """In a process of its own (``nixl_pair.py``): NIXL's bundled C++ protobuf and grpc_tools' protoc
    (tests/unit/test_protos.py) crash one process that loads both, so this one never loads NIXL. The checks
    that passed come back in a file: NIXL's threads log to the same stdout and can split a line of it."""
    passed_file = tmp_path / "passed"
    run = subprocess.run([sys.executable, str(SUPPORT / "nixl_pair.py"), str(passed_file)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert passed_file.read_text().split() == ["write", "metadata", "split", "idle"]


@pytest.mark.parametrize("command", [["-m", "decode_service"], ["-m", "kvserve.cli", "up"]])
def test_without_nixl_forcing_it_is_refused_before_anything_starts(command):
    """Run as if NIXL were not installed (``without_nixl``): ``--kv-transport nixl`` is one line naming the
    flag and the fix, exit status 2; the multi-host grpc cluster runs whole without NIXL
    (``test_multihost.py``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT / "without_nixl"), str(ROOT)]))
    code = "from transfer.backend import nixl_installed; print(nixl_installed())"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert probe.stdout.strip() == "False", probe.stderr
    run = subprocess.run([sys.executable, *command, "--kv-transport", "nixl"], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].endswith(
        "argument --kv-transport: invalid value 'nixl': nixl needs NIXL, which is not installed here "
        "(pip install 'kvserve[nixl]')")  # fmt: skip


@pytest.mark.soak  # ~27 s with its cluster: pytest -m soak tests/cluster/test_transfer_nixl.py (test_multihost.py runs
# a nixl cluster across hosts in make test)
@needs_nixl
def test_kvserve_up_kv_transport_nixl_hands_every_prompt_over_nixl(tmp_path, engine_prompts, hf_greedy):
    """A 1P1D cluster on one host, forced to nixl: every hand-off is a NIXL write, and the tokens are the
    offline reference's."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_utils import cluster

    from kvserve.client import Client

    c = cluster(1, 1, tmp_path, decode_argv=["--kv-transport", "nixl"])
    try:
        prompts = engine_prompts[::2]  # shorter than a block to many blocks long
        with Client(c.endpoint, timeout_s=120) as client, ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: client.generate(p, temperature=0, max_tokens=8, ignore_eos=True),
                                    prompts))  # fmt: skip
        assert [r.token_ids for r in results] == [greedy[:8] for greedy in hf_greedy[::2]]
        assert {r.transfer_backend for r in results} == {"nixl"}
    finally:
        c.stop()


def _request(backend: str, outcome: object = "reply", deadline_in_s: float = 30.0):
    """What the connector reads of a request in flight: a finished call (``outcome``: its reply, or the
    exception it raised; None: still running)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    future = Future()
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    elif outcome is not None:
        future.set_result(outcome)
    return SimpleNamespace(request_id="r1", prefill_worker="prefill-0", backend=backend, future=future,
                           lease_deadline=time.monotonic() + deadline_in_s, tried=["prefill-0"])  # fmt: skip


def _connector(forced=None):
    from decode_service.remote_prefill import RemotePrefillConnector

    return RemotePrefillConnector(None, None, 16, None, None, None, lambda: None, None, forced)


def test_a_nixl_load_is_over_once_the_reply_and_the_notification_are_both_in():
    connector, now = _connector(), time.monotonic()
    done = _request("nixl")
    assert not connector._settled(done, now, set())  # the reply came first: its checksum is not trusted yet
    assert connector._settled(done, now, {("r1", "prefill-0")})
    assert not connector._settled(done, now, {("r1", "prefill-1")})  # another writer's notification
    assert connector._settled(_request("nixl", RuntimeError("refused")), now, set())  # a failure needs none
    assert not connector._settled(_request("nixl", None), now, {("r1", "prefill-0")})  # the call runs on
    assert connector._settled(_request("nixl", None, deadline_in_s=-1), now, set())  # the lease ran out
    assert connector._settled(_request("grpc"), now, set())


def test_a_failed_nixl_hand_off_we_chose_falls_back_to_grpc_for_that_peer_once():
    from transfer.backend import Backend

    connector, req = _connector(), _request("nixl")
    connector._nixl_failed(req)
    assert connector.no_nixl == {"prefill-0"} and req.tried == []  # tried again there, over grpc
    again = _request("nixl")
    connector._nixl_failed(again)
    assert again.tried == ["prefill-0"]  # once per peer: a second failure is an ordinary one
    forced, req = _connector(Backend.NIXL), _request("nixl")
    forced._nixl_failed(req)  # --kv-transport nixl: no fallback, the request goes elsewhere or local
    assert forced.no_nixl == set() and req.tried == ["prefill-0"]
