"""Issue 21's probe "impostor on a dead worker's port", as a test against a real local cluster (``kvserve up``'s
defaults: internal gRPC over mutual TLS).

A prefill worker and a decode worker are SIGKILLed; at once another user's process (uid nobody, when the tests
run as root) binds each one's port, answers every gRPC call (health included: SERVING) and records every byte
it receives (``impostor.py``). While the registry still lists the dead workers, clients keep asking. Before
internal mutual TLS, the decode workers sent the prefill impostor their Prefill calls in the clear (the
cluster token, the prompt) and the router sent the decode impostor whole Generate calls; now a client
insists on a server certificate of its cluster CA that names the worker it meant, so an impostor gets a
TLS ClientHello and nothing else, and every request is served by the workers still alive.
"""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
from cluster_utils import cluster, discard, tiny_engine_argv
from impostor import impostor, wait_port_free
from redis_probe import NOBODY

from kvserve.client import Client
from protos.kvserve.v1 import kvserve_pb2 as pb

PROMPT = list(range(980, 1020))  # token ids no other request here sends: their bytes name this prompt
LISTED_S = 6.0  # a dead worker stays in the registry for up to its TTL (5 s) after its last heartbeat


def _ask_until(endpoint: str, deadline: float, answers: list, errors: list) -> None:
    with Client(endpoint, timeout_s=120) as client:
        while time.monotonic() < deadline:
            try:
                answers.append(client.generate(PROMPT, max_tokens=4, temperature=0).token_ids)
            except Exception as err:  # noqa: BLE001 - counted and reported below
                errors.append(err)


# soak (15 s): the refusal it probes is unit-tested in test_internal_tls.py (clients reach only the member they meant)
@pytest.mark.soak
def test_impostors_on_dead_workers_ports_get_no_token_and_no_prompt(tmp_path, tiny_model_dir):
    c = cluster(1, 2, tmp_path, decode_argv=["--prefill-timeout-s", "3"], engine_argv=tiny_engine_argv(tiny_model_dir))
    try:
        _check_private(getattr(c, "tls_dir", None))
        with Client(c.endpoint, timeout_s=120) as client:
            expected = client.generate(PROMPT, max_tokens=4, temperature=0).token_ids
        dead = [c.child("prefill-0"), c.child("decode-1")]
        for child in dead:
            child.proc.kill()
            child.proc.wait()
        ports = [int(child.address.rsplit(":", 1)[1]) for child in dead]
        for port in ports:
            wait_port_free(port)
        uid = NOBODY if os.geteuid() == 0 else None
        answers, errors = [], []
        with impostor(ports[0], uid) as on_prefill, impostor(ports[1], uid) as on_decode:
            deadline = time.monotonic() + LISTED_S
            threads = [threading.Thread(target=_ask_until, args=(c.endpoint, deadline, answers, errors))
                       for _ in range(3)]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        prompt_bytes = pb.PrefillRequest(prompt_token_ids=PROMPT).SerializeToString()
        for name, recording in (("prefill-0", on_prefill), ("decode-1", on_decode)):
            received = recording.received
            assert recording.connections >= 1, f"nobody dialled {name}'s port: the probe did not run"
            assert b"x-kvserve-token" not in received, f"{name}'s impostor received call metadata with a token"
            assert c.security.token.encode() not in received, f"{name}'s impostor received the cluster token"
            assert prompt_bytes not in received, f"{name}'s impostor received the prompt"
            assert received.startswith(b"\x16\x03"), f"{name}'s callers did not insist on TLS"
        assert not errors, errors[:3]
        assert len(answers) >= 3 and all(answer == expected for answer in answers)
    finally:
        discard(c)
    assert getattr(c, "tls_dir", None) is None or not c.tls_dir.exists()  # the keys went with the cluster


def _check_private(tls_dir) -> None:
    """The children's certificates and keys: a directory each (0700) of files (0600) in one of the launcher's."""
    if tls_dir is None:  # a kvserve without cluster certificates: the probe below decides
        return
    assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    assert sorted(d.name for d in tls_dir.iterdir()) == ["decode-0", "decode-1", "prefill-0", "router"]
    for member in tls_dir.iterdir():
        assert stat.S_IMODE(member.stat().st_mode) == 0o700
        assert {(f.name, stat.S_IMODE(f.stat().st_mode)) for f in member.iterdir()} == {
            ("ca.pem", 0o600), ("cert.pem", 0o600), ("key.pem", 0o600)}
