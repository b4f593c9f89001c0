"""``kvserve up``'s plan, read without starting a process: the start order, each child's ports and flags, who
gets which option, the checks made before anything starts, and the settle time the launcher waits out."""

from __future__ import annotations

import sys

import pytest

from decode_service.prefill_client import REFRESH_S
from kvserve.launcher.cluster import WORKER_VIEWS_SETTLE_S
from kvserve.launcher.plan import ExtraArgv, plan_cluster, threads_per_worker
from kvserve.settings import UpSettings, parse_up
from router.settings import RouterSettings
from rpc.settings import parse_settings
from rpc.threads import host_cores


def _flag(argv: tuple[str, ...], name: str) -> list[str]:
    """Every value of ``name`` in ``argv``, in order (the last one wins when argparse reads it)."""
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == name]


def test_children_start_in_order_on_the_documented_ports():
    plan = plan_cluster(parse_up(["--prefill", "2", "--decode", "1", "--port", "40000", "--http-port", "40001"]))
    assert [(c.name, c.role, c.port, c.metrics_port) for c in plan.children] == [
        ("decode-0", "decode", 40010, 41010), ("prefill-0", "prefill", 40030, 41030),
        ("prefill-1", "prefill", 40031, 41031), ("router", "router", 40000, 40001)]  # fmt: skip
    assert plan.ports == [40000, 40001, 40010, 40030, 40031, 41010, 41030, 41031]
    assert plan.worker_ids == {"decode-0", "prefill-0", "prefill-1"}
    assert plan.http_endpoint == "http://127.0.0.1:40001"
    for child in plan.children:
        assert child.argv[:3] == (sys.executable, "-m", {"router": "router"}.get(child.role, f"{child.role}_service"))
        assert _flag(child.argv, "--port") == [str(child.port)]


def test_each_role_gets_its_options_and_nothing_else():
    up = parse_up(["--prefill", "1", "--decode", "2", "--port", "40000", "--http-port", "0", "--model", "default",
                   "--num-blocks", "64", "--kv-transport", "grpc", "--threads", "3", "--drain-timeout", "7",
                   "--stream-idle-timeout", "4", "--decode-gpu-memory-utilization", "0.4"])  # fmt: skip
    plan = plan_cluster(up, ExtraArgv(decode=("--prefill-timeout-s", "3"), prefill=("--max-wait-ms", "9")))
    decode, _, prefill, router = plan.children
    for worker in (decode, prefill):
        assert _flag(worker.argv, "--num-blocks") == ["64"] and _flag(worker.argv, "--model") == ["default"]
        assert _flag(worker.argv, "--threads") == ["3"] and _flag(worker.argv, "--drain-timeout") == ["7.0"]
        assert "--stream-idle-timeout" not in worker.argv  # a router option
    assert _flag(decode.argv, "--gpu-memory-utilization") == ["0.2"]  # 0.4 between the two decode workers
    assert _flag(prefill.argv, "--gpu-memory-utilization") == ["0.35"]  # UpSettings' default, whole
    assert _flag(decode.argv, "--kv-transport") == ["grpc"] and "--kv-transport" not in prefill.argv
    assert decode.argv[-2:] == ("--prefill-timeout-s", "3") and prefill.argv[-2:] == ("--max-wait-ms", "9")
    assert _flag(router.argv, "--model") == ["default"] and _flag(router.argv, "--stream-idle-timeout") == ["4.0"]
    assert "--num-blocks" not in router.argv and _flag(router.argv, "--http-port") == ["0"]
    assert plan.http_endpoint is None


def test_the_router_gets_the_served_names_and_the_workers_context():
    up = parse_up(["--max-model-len", "512", "--served-model-name", "smol", "smol-instruct"])
    decode, prefill, router = plan_cluster(up).children
    settings = parse_settings(RouterSettings, list(router.argv[3:]))
    assert settings.served_model_name == ["smol", "smol-instruct"] and settings.max_model_len == 512
    for worker in (decode, prefill):
        assert _flag(worker.argv, "--max-model-len") == ["512"] and "--served-model-name" not in worker.argv


def test_tls_flags_serve_the_routers_public_port_only(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    plan = plan_cluster(parse_up(["--port", "40000", "--tls-cert", str(cert), "--tls-key", str(key)]))
    *workers, router = plan.children
    assert _flag(router.argv, "--tls-cert") == [str(cert)] and plan.http_endpoint == "https://127.0.0.1:8000"
    assert all("--tls-cert" not in w.argv for w in workers)


def test_the_defaults_are_up_settings_own():
    plan = plan_cluster(parse_up([]))
    fields = UpSettings.model_fields
    assert plan.up.port == fields["port"].default == 50051 and plan.ports[:2] == [50051, fields["http_port"].default]
    assert [c.role for c in plan.children] == ["decode", "prefill", "router"]  # one of each
    shares = [_flag(c.argv, "--gpu-memory-utilization") for c in plan.children[:2]]
    defaults = fields["decode_gpu_memory_utilization"].default, fields["prefill_gpu_memory_utilization"].default
    assert shares == [[str(defaults[0])], [str(defaults[1])]]
    assert _flag(plan.children[0].argv, "--threads") == [str(host_cores())]  # this host has no GPU: the lease
    leases = [_flag(c.argv, "--compute-lease") for c in plan.children[:2]]
    assert leases[0] == leases[1] and len(leases[0]) == 1 and "50051" in leases[0][0]


def test_threads_given_or_a_single_worker_split_the_cores_without_a_lease():
    for argv, threads in ((["--threads", "1"], 1), (["--prefill", "0"], threads_per_worker(1)),
                          (["--device", "cpu", "--decode", "3", "--threads", "2"], 2)):  # fmt: skip
        plan = plan_cluster(parse_up(argv))
        workers = [c for c in plan.children if c.role != "router"]
        assert all(_flag(c.argv, "--threads") == [str(threads)] and "--compute-lease" not in c.argv for c in workers)


def test_decode_workers_of_a_cpu_host_compile_one_users_decode_unless_told(monkeypatch):
    monkeypatch.delenv("KVSERVE_COMPILE_DECODE", raising=False)  # (tests/conftest.py sets it off for test clusters)
    for argv, decode, prefill in ((["--device", "cpu"], ["true"], []), (["--device", "cpu", "--compile-decode",
                                  "false"], ["false"], ["false"]), (["--device", "cuda"], [], [])):  # fmt: skip
        plan = plan_cluster(parse_up(argv))
        roles = {c.role: _flag(c.argv, "--compile-decode") for c in plan.children}
        assert (roles["decode"], roles["prefill"], roles["router"]) == (decode, prefill, []), argv


@pytest.mark.parametrize("argv, message", [
    (["--redis-tcp", "true", "--redis-url", "redis://127.0.0.1:1"], "--redis-tcp is for the embedded Redis"),
    (["--prefill-gpu-memory-utilization", "0.6", "--decode-gpu-memory-utilization", "0.5"], "add up to more than"),
])  # fmt: skip
def test_options_that_cannot_work_together_are_refused_before_anything_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        plan_cluster(parse_up(argv))


def test_the_launcher_waits_out_one_refresh_of_the_decode_workers_views():
    assert REFRESH_S < WORKER_VIEWS_SETTLE_S < 2 * REFRESH_S
