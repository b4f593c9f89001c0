"""Tenants (``router.tenants``, ``router.fair_queue``) on a real ``python -m router`` process with a keys file, in
front of a real decode worker, over loopback: each tenant's key on both doors (a wrong one gets 401), a tenant
over its requests in flight gets 429 with Retry-After (RESOURCE_EXHAUSTED with retry-after over gRPC) while
another tenant is served, SIGHUP revokes a key and keeps the table through a bad file, and with one slot a
tenant's request is sent on before a flooding tenant's queued ones; and a tenant below its share is sent on at
once, past the slots, and the worker (``--scheduling-policy priority``) preempts a flood stream past its share
for it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from cluster_utils import prometheus_values
from router_utils import RouterStack
from service_utils import TEST_SECURITY
from waiting import wait_until

from kvserve.client import Client
from router.tenants import hash_key
from rpc.requests import API_KEY_ENV
from security.auth import TOKEN_ENV

KEYS = {"solo": "key-of-solo-0123456789", "flood": "key-of-flood-0123456789", "steady": "key-of-steady-0123456789"}
LONG = dict(max_tokens=40, temperature=0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_keys(path: Path, tenants: dict[str, str]) -> None:
    path.write_text("".join(f'[tenants.{name}]\nkey_sha256 = ["{hash_key(KEYS[name])}"]\n{bounds}\n\n'
                            for name, bounds in tenants.items()))  # fmt: skip
    path.chmod(0o600)


@contextmanager
def _router_process(stack: RouterStack, keys: Path, slots: int):
    """A ``python -m router`` in front of ``stack``'s decode worker, with the keys file and fair-queue slots."""
    ports = {name: _free_port() for name in ("grpc", "http", "metrics")}
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {TOKEN_ENV: TEST_SECURITY.token}
    cmd = [sys.executable, "-m", "router", "--port", str(ports["grpc"]), "--http-port", str(ports["http"]),
           "--metrics-port", str(ports["metrics"]), "--decode-address", stack.decode.address,
           "--api-keys-file", str(keys), "--fair-queue-slots", str(slots)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).parents[2])
    address, url = f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['http']}"
    try:
        wait_until(lambda: proc.poll() is None and _post(url + "/health", None)[0] == 200, 120,
                   "the router serving", interval_s=0.2)  # fmt: skip
        yield address, url, keys, proc, f"http://127.0.0.1:{ports['metrics']}/metrics"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        stack.stop()


@pytest.fixture(scope="module")
def router(model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("tenants") / "keys.toml"
    _write_keys(keys, {"solo": "max_concurrency = 1", "flood": "", "steady": ""})
    with _router_process(RouterStack(model_dir, num_blocks=256), keys, slots=1) as running:
        yield running


def _post(url: str, body: dict | None, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, {}, dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), dict(err.headers)
    except (urllib.error.URLError, ConnectionError):
        return 0, {}, {}


def test_keys_bounds_and_reloads(router):
    address, url, keys, proc, metrics_url = router
    completion = {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2}
    for tenant in KEYS:
        with Client(address, timeout_s=60, api_key=KEYS[tenant]) as client:
            assert client.generate("hi", max_tokens=2).finish_reason
        assert _post(url + "/v1/completions", completion, KEYS[tenant])[0] == 200
    assert _post(url + "/v1/completions", completion, "not-a-tenants-key")[0] == 401
    with Client(address, timeout_s=60, api_key="not-a-tenants-key") as client, pytest.raises(grpc.RpcError) as err:
        client.generate("hi", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # solo may have one request in flight: a second one is refused, naming the bound, while others are served
    with Client(address, timeout_s=60, api_key=KEYS["solo"]) as solo:
        stream = solo.stream("Once upon a time", **LONG)
        next(stream)
        status, body, headers = _post(url + "/v1/completions", completion, KEYS["solo"])
        assert status == 429 and headers.get("retry-after") == "1", (status, headers)
        assert "tenant solo has its limit of 1 requests in flight" in body["error"]["message"]
        with pytest.raises(grpc.RpcError) as err:
            solo.generate("hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant solo" in err.value.details()
        assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
        assert _post(url + "/v1/completions", completion, KEYS["steady"])[0] == 200
        list(stream)
    refused = prometheus_values(metrics_url, "kvserve_tenant_refused_total")
    assert refused['reason="concurrency",tenant="solo"'] == 2

    # SIGHUP: a bad file keeps the table; a good one without flood's key revokes it
    keys.write_text("[tenants.solo]\nkey_sha256 = ['not-a-hash']\n")
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: prometheus_values(metrics_url, "kvserve_tenant_reloads_total").get('result="refused"'), 10,
               "the refused reload")  # fmt: skip
    assert _post(url + "/v1/completions", completion, KEYS["flood"])[0] == 200
    _write_keys(keys, {"solo": "max_concurrency = 1", "steady": ""})
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: _post(url + "/v1/completions", completion, KEYS["flood"])[0] == 401, 10, "flood revoked")
    assert _post(url + "/v1/completions", completion, KEYS["steady"])[0] == 200
    _write_keys(keys, {"solo": "max_concurrency = 1", "flood": "", "steady": ""})
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: _post(url + "/v1/completions", completion, KEYS["flood"])[0] == 200, 10, "flood restored")


def test_a_flooding_tenant_does_not_hold_back_another(router):
    """One slot: flood's four streams run one at a time (the rest wait in the router's fair queue); steady's
    request, sent after them, is the next sent on, so it ends before flood's third does."""
    address = router[0]
    ended: list[str] = []
    lock = threading.Lock()

    def send(tenant: str) -> None:
        with Client(address, timeout_s=120, api_key=KEYS[tenant]) as client:
            client.generate("Once upon a time", **LONG)
        with lock:
            ended.append(tenant)

    floods = [threading.Thread(target=send, args=("flood",)) for _ in range(4)]
    for thread in floods:
        thread.start()
        time.sleep(0.1)  # (in order)
    time.sleep(0.5)
    steady = threading.Thread(target=send, args=("steady",))
    steady.start()
    for thread in [*floods, steady]:
        thread.join(180)
    assert sorted(ended) == ["flood"] * 4 + ["steady"]
    assert ended.index("steady") <= 2, ended  # FIFO would put it last


def test_a_tenant_below_its_share_preempts_a_flood_stream_past_its_share(model_dir, tmp_path, llm):
    """Two slots, two tenants of equal weight (a share of one slot each), a worker that runs two sequences under
    the priority policy. Flood's first stream is within its share, its second past it, its third waits in the
    router. Steady's stream, sent last, is sent on at once and takes the second's place in the worker (at one
    rank it would wait for a slot, and end third or later): it ends second, the preempted stream is
    recomputed, and every stream gives the offline engine's tokens."""
    from engine import SamplingParams

    keys = tmp_path / "keys.toml"
    _write_keys(keys, {"flood": "", "steady": ""})
    want = llm.generate(["Once upon a time"], SamplingParams(**LONG))[0].token_ids
    stack = RouterStack(model_dir, num_blocks=256, scheduling_policy="priority", max_num_seqs=2)
    ended, tokens, lock = [], [], threading.Lock()
    with _router_process(stack, keys, slots=2) as (address, *_):
        def send(tenant: str) -> None:
            with Client(address, timeout_s=120, api_key=KEYS[tenant]) as client:
                out = client.generate("Once upon a time", **LONG)
            with lock:
                ended.append(tenant)
                tokens.append(out.token_ids)

        send("steady")  # (seen: its share is counted from now on)
        ended.clear()
        threads = [threading.Thread(target=send, args=(tenant,)) for tenant in ("flood",) * 3 + ("steady",)]
        for thread in threads:
            thread.start()
            time.sleep(0.3)  # (in order; the flood streams under way)
        for thread in threads:
            thread.join(180)
        preemptions = stack.engine.scheduler.num_preemptions
    assert sorted(ended) == ["flood"] * 3 + ["steady"] and ended.index("steady") == 1, ended
    assert preemptions >= 1 and all(t == want for t in tokens)
