"""docker-compose.yml: compose accepts it, Prometheus scrapes what it runs, and it stays up where users deploy
it (restarts, gRPC healthchecks, no shared-memory pool, ports on 127.0.0.1, a private token file). Its
``observability`` profile (Grafana, Jaeger) is checked as configuration only: its images are not pulled here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from security.auth import TOKEN_ENV, TOKEN_FILE_ENV, TOKEN_METADATA, Security, load_token

ROOT = Path(__file__).resolve().parents[2]
KVSERVE_SERVICES = ("router", "router-2", "decode", "prefill")
ROUTERS = ("router", "router-2")  # replicas (kvserve.failover): the same command, each its own certificate and ports


def _compose() -> dict:
    """The compose file with ``${VAR:-default}`` read as its default, as compose does when VAR is unset."""
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", (ROOT / "docker-compose.yml").read_text())
    return yaml.safe_load(text)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _compose_config(*options: str) -> dict:
    """The services of ``docker compose [OPTIONS] config``: what compose itself makes of the file."""
    compose = next((c for c in (["docker", "compose"], ["docker-compose"])
                    if shutil.which(c[0]) and subprocess.run([*c, "version"], capture_output=True).returncode == 0),
                   None)  # fmt: skip
    if compose is None:
        pytest.skip("neither `docker compose` (v2) nor `docker-compose` (v1) is installed")
    token = ROOT / "cluster-token"
    made = not token.exists()
    if made:  # compose reads the token's env_file, so it must exist for `config` to accept the file
        token.write_text("KVSERVE_CLUSTER_TOKEN=compose-config-test\n")
    try:
        env = {**os.environ, "KVSERVE_PUBLISH_ADDRESS": ""}  # unset or empty: the default, 127.0.0.1
        result = subprocess.run([*compose, *options, "-f", str(ROOT / "docker-compose.yml"), "config"],
                                capture_output=True, text=True, cwd=ROOT, env=env)  # fmt: skip
    finally:
        if made:
            token.unlink()
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def _published(services: dict) -> list[str]:
    """Published ports as ``HOST_IP:PORT:TARGET...``: v1 prints them so, v2 in the long syntax (a mapping)."""
    return [f"{port.get('host_ip', '')}:{port['published']}:{port['target']}" if isinstance(port, dict) else str(port)
            for service in services.values() for port in service.get("ports", [])]  # fmt: skip


def test_docker_compose_config_validates_and_publishes_on_localhost_only():
    # v2 leaves a service of an inactive profile out of `config`; v1 lists it, with its profiles
    default = {name: s for name, s in _compose_config().items() if not s.get("profiles")}
    assert len(_published(default)) == 5 and all(p.startswith("127.0.0.1:") for p in _published(default))
    observability = _compose_config("--profile", "observability")
    published = _published(observability)
    assert {"grafana", "jaeger"} <= observability.keys() and len(published) == 7, published
    assert all(port.startswith("127.0.0.1:") for port in published), published


def test_prometheus_scrapes_every_process_on_its_metrics_port():
    compose = _compose()
    scrape = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    workers = ("decode", "prefill")
    expected = {f"{name}:{_flag(compose['services'][name]['command'], '--metrics-port')}" for name in workers}
    assert "127.0.0.1:8000:8000" in compose["services"]["router"]["ports"]
    assert "127.0.0.1:8001:8000" in compose["services"]["router-2"]["ports"]
    assert targets == expected | {"router:8000", "router-2:8000"}


def test_every_service_restarts_and_is_health_checked_on_its_own_port():
    services = {name: s for name, s in _compose()["services"].items() if name != "certs"}  # one-shot: it exits
    assert {name: s.get("restart") for name, s in services.items()} == dict.fromkeys(services, "unless-stopped")
    for name in KVSERVE_SERVICES:
        test = services[name]["healthcheck"]["test"]
        port = _flag(services[name]["command"], "--port")
        mtls = [] if name in ROUTERS else ["--cluster-certs", "/run/kvserve"]  # the router's port is public
        assert test == ["CMD", "python", "-m", "kvserve.healthcheck", f"127.0.0.1:{port}", *mtls], name
    assert "redis-cli ping" in services["redis"]["healthcheck"]["test"][1]
    # each router starts once Redis and both workers answer their health checks
    for name in ROUTERS:
        assert {dep: c["condition"] for dep, c in services[name]["depends_on"].items()} == {
            "certs": "service_completed_successfully", "redis": "service_healthy", "decode": "service_healthy",
            "prefill": "service_healthy"}  # fmt: skip
    assert services["router"]["command"] == services["router-2"]["command"]


def test_each_kvserve_service_mounts_only_its_own_certificate_and_credential():
    """Internal gRPC over mutual TLS (issue 21): ``certs`` makes a volume per service; the cluster token, from
    which every key derives, reaches that one-shot service only, and the router's volume holds the router's."""
    services = _compose()["services"]
    certs = services["certs"]
    volumes = dict(v.split(":")[:2] for v in certs["volumes"])
    assert set(volumes.values()) == {"/certs/ca", "/certs/router", "/certs/router-2", "/certs/decode-0",
                                     "/certs/prefill-0"}  # fmt: skip
    assert certs["environment"] == {} and certs["restart"] == "no"
    assert "kvserve certs --out /certs --names router router:router-2 decode-0 prefill-0" in certs["command"][2]
    for name in KVSERVE_SERVICES:
        service = services[name]
        assert _flag(service["command"], "--cluster-certs") == "/run/kvserve"
        mounted = [v for v in service["volumes"] if v.startswith("certs-")]
        member = name if name in ROUTERS else f"{name}-0"
        assert mounted == [f"{[k for k, path in volumes.items() if path == f'/certs/{member}'][0]}:/run/kvserve:ro"]
        assert service["environment"] == {TOKEN_ENV: "", TOKEN_FILE_ENV: "/run/kvserve/token"}
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"


def test_published_ports_bind_localhost_unless_told_otherwise():
    for name, service in _compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_the_decode_worker_keeps_its_kv_pool_out_of_the_containers_small_dev_shm():
    decode = _compose()["services"]["decode"]
    assert "--no-shm" in decode["command"] or "shm_size" in decode, "a 1 GiB pool in 64 MiB of /dev/shm dies of SIGBUS"


def test_the_documented_token_file_is_private_and_read_by_compose(tmp_path):
    """The README's command makes the file compose's env_file reads, mode 0600 whatever the shell's umask."""
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if "umask 077" in line and "> cluster-token" in line]
    assert commands, "the README's docker-compose section makes cluster-token under umask 077"
    assert commands[0] in (ROOT / "docker-compose.yml").read_text(), "compose's comment gives the same command"
    subprocess.run(["sh", "-c", f"umask 022; {commands[0]}"], cwd=tmp_path, check=True)
    made = tmp_path / "cluster-token"
    assert made.stat().st_mode & 0o777 == 0o600
    name, _, token = made.read_text().strip().partition("=")
    assert name == TOKEN_ENV and len(token) >= 32
    assert _compose()["x-kvserve"]["env_file"] == "cluster-token"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_other_users_can_read_is_refused(tmp_path, monkeypatch, mode):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(mode)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    with pytest.raises(ValueError, match=rf"mode {mode:04o}.*chmod 600"):
        load_token()
    path.chmod(0o600)
    assert load_token() == "s3cret"


class _Recorder(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.metadata: list[dict] = []

    def intercept_service(self, continuation, details):
        self.metadata.append(dict(details.invocation_metadata))
        return continuation(details)


def test_the_healthcheck_command_exits_0_only_on_serving_and_sends_the_cluster_token():
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[recorder])
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    env = {**os.environ, TOKEN_ENV: "the-cluster-token", "PYTHONPATH": str(ROOT)}
    env.pop(TOKEN_FILE_ENV, None)

    def check(target: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvserve.healthcheck", target, "--timeout", "1"],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)  # fmt: skip

    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        serving = check(address)
        assert serving.returncode == 0, serving.stderr
        sent_by_workers = dict(Security(token="the-cluster-token").metadata())[TOKEN_METADATA]
        assert recorder.metadata[-1].get(TOKEN_METADATA) == sent_by_workers
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
        draining = check(address)
        assert draining.returncode == 1 and ": NOT_SERVING, not SERVING" in draining.stderr
    finally:
        server.stop(0)
    gone = check(address)
    assert gone.returncode == 1 and "DEADLINE_EXCEEDED" in gone.stderr  # nothing listens there any more


def test_the_image_takes_a_cpu_torch_by_default_and_runs_as_a_non_root_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", dockerfile, re.MULTILINE))
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu" and args["TORCH"] == "torch==2.13.0"
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "[dev]" not in dockerfile and "--no-cache-dir" not in dockerfile and "PIP_NO_CACHE_DIR=1" in dockerfile
    # what the build context holds and keeps out: tests/deploy/test_docker_context.py


# ---- the `observability` profile: Grafana and a trace backend, config-checked only (no image is pulled here) ----

OBSERVABILITY = ("grafana", "jaeger")


def _mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts, container path -> path in this repository."""
    return {container: ROOT / host for host, container, *_ in (v.split(":") for v in service["volumes"])}


def test_the_observability_services_start_only_under_their_profile():
    services = _compose()["services"]
    profiled = {name: s["profiles"] for name, s in services.items() if s.get("profiles")}
    assert profiled == dict.fromkeys(OBSERVABILITY, ["observability"])
    default = {name for name in services if name not in profiled}
    assert default == {"certs", "redis", "decode", "prefill", "router", "router-2", "prometheus"}  # as before
    for name in default:  # a default service depending on a profiled one would pull it into a plain `up`
        assert not set(services[name].get("depends_on", [])) & set(OBSERVABILITY), name


def test_grafana_provisions_prometheus_and_the_dashboard_from_the_repository():
    services = _compose()["services"]
    mounts = _mounts(services["grafana"])
    assert all(path.exists() for path in mounts.values()), mounts
    provisioned = mounts["/etc/grafana/provisioning/datasources"]
    sources = [s for f in sorted(provisioned.glob("*.yml")) for s in yaml.safe_load(f.read_text())["datasources"]]
    prometheus_port = services["prometheus"]["ports"][0].rsplit(":", 1)[1]
    jaeger_ui_port = services["jaeger"]["ports"][0].rsplit(":", 1)[1]
    by_type = {s["type"]: s for s in sources}
    assert len(by_type) == len(sources)  # one of each: the dashboard's ${datasource} finds the only Prometheus
    assert by_type["prometheus"]["url"] == f"http://prometheus:{prometheus_port}" and by_type["prometheus"]["isDefault"]
    assert by_type["jaeger"]["url"] == f"http://jaeger:{jaeger_ui_port}"
    providers = [p for f in sorted(mounts["/etc/grafana/provisioning/dashboards"].glob("*.yml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]  # fmt: skip
    [provider] = providers
    assert provider["type"] == "file"
    assert mounts[provider["options"]["path"] + "/kvserve.json"] == ROOT / "deploy/observability/grafana/kvserve.json"
    assert {"prometheus", "jaeger"} <= set(services["grafana"]["depends_on"])
    for name in ("prometheus", "jaeger"):  # on a network with each service it asks
        assert set(services["grafana"]["networks"]) & set(services[name]["networks"]), name


def test_the_trace_backend_takes_otlp_on_4317_from_the_kvserve_containers_only():
    services = _compose()["services"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")  # v2: the all-in-one takes OTLP itself
    assert _flag(jaeger["command"], "--set") == "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317"
    for name in KVSERVE_SERVICES:
        assert "internal" in services[name]["networks"] and "internal" in jaeger["networks"], name
    assert [port.rsplit(":", 1)[1] for port in jaeger["ports"]] == ["16686"]  # the UI; OTLP is not published


def test_prometheus_finds_the_alert_rules_where_its_config_names_them():
    prometheus = _compose()["services"]["prometheus"]
    [config_file] = [arg.removeprefix("--config.file=") for arg in prometheus["command"] if "--config.file=" in arg]
    config_dir = Path(config_file).parent
    mounts = _mounts(prometheus)
    rule_files = yaml.safe_load((ROOT / "prometheus.yml").read_text())["rule_files"]
    assert rule_files == ["deploy/observability/prometheus/alerts.yml"]
    for rule_file in rule_files:  # relative to the config file, there and here
        assert mounts[str(config_dir / rule_file)] == ROOT / rule_file and (ROOT / rule_file).is_file()
