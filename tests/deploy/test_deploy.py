"""The Kubernetes manifests in deploy/: they render, they are valid Kubernetes objects, and every flag, variable
and port in them is one the code really has (a renamed flag or a moved port fails here, not in a cluster).

Two renderers: ``kubectl kustomize`` where kubectl is installed, and a small one here (``render``) that knows
what deploy/ uses (``resources``; an overlay's strategic-merge ``patches`` and ``images``) and refuses
anything else, so the checks run without kubectl; where kubectl exists the two must agree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from decode_service.settings import DecodeSettings
from prefill_service.settings import PrefillSettings
from router.settings import RouterSettings
from rpc.settings import env_name, settings_parser, validate_settings
from rpc.worker_options import WORKER_SET_FIELDS
from security.auth import TOKEN_ENV
from security.keys import CALLERS, ROLE_KEYS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LAYOUTS = ("base", "overlays/gpu")
# what `python -m MODULE` parses (its __main__): settings model, fields it sets itself, and its cluster role
PROCESSES = {"router": (RouterSettings, (), "router"),
             "decode_service": (DecodeSettings, WORKER_SET_FIELDS, "decode"),
             "prefill_service": (PrefillSettings, WORKER_SET_FIELDS, "prefill")}  # fmt: skip
DOWNWARD_API_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.name": "kvserve-pod-7d9f8"}

Obj = dict[str, Any]


# -- the in-test renderer ----------------------------------------------------------------------------------


def _merge(target: Obj, patch: Obj) -> None:
    """Strategic merge as deploy/ uses it: maps merge, lists of named maps merge by name (new items first, as
    kustomize puts them), other lists replace."""
    for key, value in patch.items():
        old = target.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and all(isinstance(v, dict) and "name" in v
                                                                        for v in [*value, *old]):  # fmt: skip
            by_name = {item["name"]: item for item in old}
            for item in value:
                if item["name"] in by_name:
                    _merge(by_name[item["name"]], item)
            old[:0] = [item for item in value if item["name"] not in by_name]
        else:
            target[key] = value


def _containers(obj: Obj, init: bool = True) -> list[Obj]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*(spec.get("initContainers", []) if init else []), *spec.get("containers", [])]


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` makes, for the subset of kustomize that deploy/ uses."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unknown, f"{directory}: the in-test renderer knows no {sorted(unknown)}: keep kustomization simple"
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch_ref in spec.get("patches", []):
        assert set(patch_ref) == {"path"}, f"only file patches: {patch_ref}"
        for patch in yaml.safe_load_all((directory / patch_ref["path"]).read_text()):
            key = (patch["kind"], patch["metadata"]["name"])
            targets = [o for o in objects if (o["kind"], o["metadata"]["name"]) == key]
            assert len(targets) == 1, f"patch {patch['kind']}/{patch['metadata']['name']} has no single target"
            _merge(targets[0], patch)
    for image in spec.get("images", []):
        for container in (c for o in objects for c in _containers(o)):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return objects


def _kubectl_render(directory: Path) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def _by_key(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    keyed = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(keyed) == len(objects), "two objects of one kind and name"
    return keyed


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, render(DEPLOY / request.param)


@pytest.mark.parametrize("name", LAYOUTS)
def test_kubectl_kustomize_renders_what_the_in_test_renderer_does(name: str) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the other tests check the in-test rendering only")
    assert _by_key(_kubectl_render(DEPLOY / name)) == _by_key(render(DEPLOY / name))


def test_every_object_is_valid_against_the_kubernetes_schemas(layout: tuple[str, list[Obj]]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the dev extra: pip install -e '.[dev]')"
    )
    # 1.27: the oldest Kubernetes whose grpc probes are GA; the newest the package knows
    for version in ("1.27.0", kubernetes_validate.latest_version()):
        for obj in layout[1]:
            kubernetes_validate.validate(obj, version, strict=True)


# -- the processes' real flags, variables and ports -----------------------------------------------------------


def _process(container: Obj) -> str | None:
    command = container.get("command", [])
    return command[2] if command[:2] == ["python", "-m"] and command[2] in PROCESSES else None


def _resolved_args(container: Obj) -> list[str]:
    """The container's args with ``$(VAR)`` replaced as the kubelet does: each must be a variable it defines."""
    values = {}
    for var in container.get("env", []):
        field_ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        values[var["name"]] = var.get("value", DOWNWARD_API_SAMPLES.get(field_ref, f"<{var['name']}>"))

    def substitute(match: re.Match[str]) -> str:
        assert match.group(1) in values, f"{container['name']}: $({match.group(1)}) is no variable it defines"
        return values[match.group(1)]

    return [re.sub(r"\$\((\w+)\)", substitute, arg) for arg in container.get("args", [])]


def _settings(container: Obj, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings the container's process would start with: its flags, then its literal KVSERVE_* values."""
    model, exclude, _ = PROCESSES[_process(container)]
    parser = settings_parser(model, exclude=exclude)
    args = _resolved_args(container)
    unknown = [a for a in args if a.startswith("--") and a not in parser._option_string_actions]
    assert not unknown, f"{container['name']}: no such flag in its --help: {unknown}"
    given = vars(parser.parse_args(args))
    fields = {env_name(model, name): name for name in model.model_fields if name not in exclude}
    for var in container.get("env", []):
        if var["name"].startswith("KVSERVE_"):
            assert var["name"] in fields or var["name"] == TOKEN_ENV, f"{var['name']} is no setting's variable"
        if var["name"] in fields and "value" in var:
            given.setdefault(fields[var["name"]], var["value"])  # a flag wins over its variable
    for name in list(fields) + [TOKEN_ENV]:
        monkeypatch.delenv(name, raising=False)  # this test process's own environment must not count
    return validate_settings(model, given)


def _kvserve_deployments(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    found = [(o, c) for o in objects if o["kind"] == "Deployment" for c in _containers(o, init=False) if _process(c)]
    assert sorted(_process(c) for _, c in found) == sorted(PROCESSES), "one Deployment per kvserve process"
    return found


def test_flags_variables_and_ports_are_the_processes_real_ones(layout: tuple[str, list[Obj]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    objects = layout[1]
    services = _by_key(objects)
    for deployment, container in _kvserve_deployments(objects):
        settings = _settings(container, monkeypatch)
        ports = {settings.port, settings.metrics_port, getattr(settings, "http_port", 0)} - {0}
        assert {p["containerPort"] for p in container["ports"]} == ports, container["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == settings.port, f"{container['name']} {probe}"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(settings.metrics_port)
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        if getattr(settings, "advertise", None):
            assert settings.advertise == f"{DOWNWARD_API_SAMPLES['status.podIP']}:{settings.port}"
        redis = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", settings.redis_url)
        assert redis, settings.redis_url
        redis_ports = [p["port"] for p in services[("Service", redis.group(1))]["spec"]["ports"]]
        assert int(redis.group(2)) in redis_ports
        if getattr(settings, "threads", None) is not None:  # torch's threads: the cores the pod asked for
            assert str(settings.threads) == container["resources"]["requests"]["cpu"]
        _check_model_init(deployment, container, settings.model, monkeypatch)


def _check_model_init(deployment: Obj, container: Obj, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The init container prepares, with the real ``kvserve`` command line, the model the process loads, into
    the directory the process reads (the image's KVSERVE_CACHE, from the Dockerfile)."""
    import kvserve.cli

    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    prepared: list[str] = []
    monkeypatch.setattr(kvserve.cli, "_model_prepare", lambda args: prepared.append(args.model))
    kvserve.cli.main(init["command"][1:] + init.get("args", []))
    assert init["command"][0] == "kvserve" and prepared == [model]
    cache = re.search(r"KVSERVE_CACHE=(\S+)", (ROOT / "Dockerfile").read_text()).group(1)
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (init, container)]
    assert mounts[0][cache] == mounts[1][cache] == "model-cache"
    assert init["image"] == container["image"]


def test_services_and_policies_reach_the_ports_their_pods_open(layout: tuple[str, list[Obj]]) -> None:
    objects = layout[1]
    pods = [(o["spec"]["template"]["metadata"]["labels"], c) for o in objects if o["kind"] == "Deployment"
            for c in _containers(o, init=False)]  # fmt: skip
    for obj in objects:
        if obj["kind"] == "Service":
            selected = [c for labels, c in pods if obj["spec"]["selector"].items() <= labels.items()]
            assert selected, f"Service {obj['metadata']['name']} selects no pod"
            for port in obj["spec"]["ports"]:
                numbers = {p["containerPort"] for c in selected for p in c["ports"]
                           if port["targetPort"] in (p.get("name"), p["containerPort"])}  # fmt: skip
                assert numbers == {port["port"]}, f"Service {obj['metadata']['name']} port {port['name']}"
        if obj["kind"] == "NetworkPolicy":
            open_ports = {p["containerPort"] for _, c in pods for p in c["ports"] if p.get("name") == "metrics"}
            for rule in obj["spec"]["ingress"]:
                assert {p["port"] for p in rule.get("ports", [])} <= open_ports


def test_topology_credentials_resources_and_gpus(layout: tuple[str, list[Obj]]) -> None:
    name, objects = layout
    assert not [o for o in objects if o["kind"] == "Secret"], "no secret in the repository: kubectl creates it"
    assert "grpc.health.v1.Health" not in CALLERS, "the kubelet's grpc probes carry no token"
    workers = {}
    for deployment, container in _kvserve_deployments(objects):
        role = PROCESSES[_process(container)][2]
        pod = deployment["spec"]["template"]["spec"]
        token = next(v for v in container["env"] if v["name"] == TOKEN_ENV)["valueFrom"]["secretKeyRef"]
        assert token["key"] == role and role in ROLE_KEYS and not token.get("optional"), "its role's credential"
        assert pod["enableServiceLinks"] is False, "service links would set KVSERVE_* variables"
        assert pod["terminationGracePeriodSeconds"] > float(_option(container, "--drain-timeout", "30"))
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        is_worker = role != "router"
        assert gpus == (1 if name == "overlays/gpu" and is_worker else None), f"{container['name']} GPUs"
        assert container["image"] == ("kvserve:cuda" if name == "overlays/gpu" else "kvserve:cpu")
        if is_worker:
            workers[role] = deployment
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        for container in _containers(deployment):
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
            assert "memory" in container["resources"]["limits"], container["name"]
    for role, other in (("decode", "prefill"), ("prefill", "decode")):
        assert workers[role]["spec"]["replicas"] >= 1  # each its own Deployment, scaled on its own
        (term,) = workers[role]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]  # fmt: skip
        other_labels = workers[other]["spec"]["template"]["metadata"]["labels"]
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= other_labels.items()
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def _option(container: Obj, flag: str, default: str) -> str:
    args = container.get("args", [])
    return args[args.index(flag) + 1] if flag in args else default


def test_the_cuda_image_the_overlay_names_is_the_dockerfiles_build_argument() -> None:
    overlay = (DEPLOY / "overlays/gpu/kustomization.yaml").read_text()
    assert "ARG TORCH_INDEX=" in (ROOT / "Dockerfile").read_text()
    assert re.search(r"--build-arg TORCH_INDEX=\S+/cu\d+ -t kvserve:cuda", overlay)
