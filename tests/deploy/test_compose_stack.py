"""The docker-compose stack for real, under load (``make test-compose``; ``make test`` leaves it out).

It runs where a Docker engine answers (``docker info``) with Compose (``docker compose``, v2, else
``docker-compose``, v1) and ports 8000, 50051 and 9090 free. Elsewhere a plain ``pytest -m compose`` skips with
the reason, and ``make test-compose`` (which sets ``KVSERVE_COMPOSE_REQUIRED=1``) fails with it: that target
runs the stack or fails, it never passes on nothing. It builds the image, imports every service's modules in it
(a package missing from the image fails here in seconds, named), brings the stack up under a project name of its
own and waits until every service is healthy; a service that exits or stays unhealthy fails the test with
``ps`` and the last 50 lines of its log. Then:

1. distinct prompts of about 400 tokens (greedy, 8 new tokens, ``ignore_eos``) until their KV adds up past
   256 MiB. SmolLM2-135M keeps 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (float32) = 46,080 bytes
   per token: 5,826 tokens, 15 such prompts. A decode pool in the container's 64 MiB /dev/shm died of SIGBUS
   after about 1,450 tokens, 3 or 4 prompts;
2. a crash: every process of the decode container but its init is killed with SIGKILL (``exec decode kill -9
   -1``; the services run under ``init: true``). The restart policy brings it back: the seconds from the kill
   to the first 200 from ``/v1/completions`` (target: 15);
3. a manual stop: ``kill decode`` counts as one, so the container stays down until ``start decode``;
4. more prompts (``KVSERVE_COMPOSE_PROMPTS`` sets the total; the issue's target is 500).

Every answer must equal the offline engine's (``engine.LLM`` on this host, same prompt and sampling), and no
container may have died on its own (Docker's restart count: decode's is the one crash). ``down -v``
always ends it.
``KVSERVE_COMPOSE_BUILD_ARGS`` passes build arguments, shell-quoted, e.g. where PyTorch's index is not reachable:
``"TORCH_INDEX= 'TORCH=torch @ http://HOST:PORT/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl'"``.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvserve-compose-test"
BASE_URL = "http://127.0.0.1:8000"
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, layers, KV heads, head_dim, float32
KV_TARGET_BYTES = 256 << 20
PROMPT_TOKENS = 400
MAX_TOKENS = 8
PROMPTS_AFTER_RESTART = 8
RECOVERY_TARGET_S = 15.0
MANUAL_STOP_WAIT_S = 10.0
WORDS = ("river mountain garden window lantern harbor meadow engine circuit signal orbit planet comet forest "
         "library archive ledger market bridge tunnel valley canyon desert island glacier thunder whisper "
         "copper silver marble granite velvet canvas pigment melody rhythm chorus verse fable legend riddle "
         "compass anchor sail rudder beacon tower castle village city kingdom empire council senate treaty "
         "harvest orchard vineyard wheat barley honey cedar maple willow birch falcon sparrow heron otter "
         "badger lynx salmon coral reef tide current breeze ember flame frost snow rain cloud storm dawn dusk "
         "noon midnight season winter summer autumn spring journey voyage quest story").split()  # fmt: skip


def _compose_command() -> list[str] | None:
    """``docker compose`` (v2, what Docker ships today) where it answers, else ``docker-compose`` (v1)."""
    for command in (["docker", "compose"], ["docker-compose"]):
        try:
            if subprocess.run([*command, "version"], capture_output=True, timeout=60).returncode == 0:
                return command
        except (OSError, subprocess.SubprocessError):
            continue
    return None


COMPOSE = _compose_command()


def _compose(*args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([*COMPOSE, "-p", PROJECT, *args], cwd=ROOT, capture_output=True, text=True,
                          check=check, timeout=timeout)  # fmt: skip


def _why_not_here() -> str | None:
    fix = "here: bash ../shared/tools/docker-standins.sh (installs and starts dockerd and docker-compose)"
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
            return f"no Docker engine answers `docker info`; start one ({fix})"
    except (OSError, subprocess.SubprocessError):
        return f"the docker command is not installed ({fix})"
    if COMPOSE is None:
        return f"neither `docker compose` (v2) nor `docker-compose` (v1) answers `version` ({fix})"
    for port in (8000, 50051, 9090):  # the stack publishes these on 127.0.0.1
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return (f"port {port} on 127.0.0.1 is taken and the stack publishes it: stop what listens there "
                        f"(ss -ltnp 'sport = :{port}'), e.g. a `kvserve up` or an earlier stack (down -v)")
    return None


def _import_every_service_module() -> None:
    """Import the services' modules in the built image: a package the image lacks fails here, named."""
    script = ("import importlib, pkgutil\n"
              "names = ['kvserve.cli', 'kvserve.healthcheck']\n"
              "for package in ('router', 'prefill_service', 'decode_service'):\n"
              "    names += [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__,"
              " package + '.')]\n"
              "for name in names:\n"
              "    importlib.import_module(name)\n"
              "print(len(names), 'modules import')\n")  # fmt: skip
    result = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python", "kvserve", "-c", script],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, f"the image cannot import its own services:\n{result.stderr[-3000:]}"
    print(f"\nimage: {result.stdout.strip()}")


def _prometheus_image() -> None:
    """Where ``prom/prometheus:v3`` is neither here nor pullable (no registry), docker-standins.sh's stand-in
    (``prom/prometheus:latest``, Prometheus 2.x, which loads the same config) is tagged in its place, and said."""
    pinned, standin = "prom/prometheus:v3", "prom/prometheus:latest"
    def have(image: str) -> bool:
        return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0

    if have(pinned) or subprocess.run(["docker", "pull", pinned], capture_output=True, timeout=600).returncode == 0:
        return
    assert have(standin), f"{pinned} is not here and cannot be pulled (nor is a stand-in {standin} here)"
    subprocess.run(["docker", "tag", standin, pinned], check=True)
    print(f"{pinned} cannot be pulled here: the local {standin} (a stand-in) is tagged as {pinned}")


def _service_report(service: str) -> str:
    """``ps`` and the last 50 lines of ``service``'s log, for a failure message."""
    ps = _compose("ps", check=False).stdout
    logs = _compose("logs", "--no-color", "--tail", "50", service, check=False)
    return f"{ps}\n--- last 50 lines of {service}'s log ---\n{logs.stdout}{logs.stderr}"


def _prompts(tokenizer, count: int) -> list[str]:
    """``count`` distinct prompts of at least ``PROMPT_TOKENS`` tokens, the same ones on every run."""
    prompts = []
    for i in range(count):
        words = random.Random(i).choices(WORDS, k=PROMPT_TOKENS)
        lo, hi = PROMPT_TOKENS // 4, PROMPT_TOKENS  # the fewest words that reach PROMPT_TOKENS tokens
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if len(tokenizer.encode(_text(i, words[:mid]))) >= PROMPT_TOKENS else (mid + 1, hi)
        prompts.append(_text(i, words[:lo]))
    return prompts


def _text(i: int, words: list[str]) -> str:
    return f"Record {i}. " + " ".join(words)


def _complete(prompt: str, timeout: float = 600) -> tuple[int, dict]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(f"{BASE_URL}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        return 0, {"error": repr(err)}


def _state(service: str) -> str:
    """``healthy``, ``starting``, ``unhealthy``, ``exited`` (a container that stopped), or ``absent``."""
    cid = _compose("ps", "-q", service).stdout.strip()
    if not cid:
        return "absent"
    inspect = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}", cid],
                             capture_output=True, text=True)  # fmt: skip
    status, _, health = inspect.stdout.strip().partition(" ")
    return health if status == "running" else status or "absent"


def _wait_healthy(timeout_s: float, services: tuple[str, ...] = ("redis", "decode", "prefill", "router")) -> None:
    """Until every service is healthy; a service that exited or turned unhealthy fails at once, with its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {service: _state(service) for service in services}
        if all(state == "healthy" for state in states.values()):
            return
        broken = [s for s, state in states.items() if state in ("unhealthy", "exited", "dead", "absent")]
        if broken or time.monotonic() > deadline:
            waited = next((s for s, state in states.items() if state != "healthy"), services[0])
            raise AssertionError(f"the stack is not healthy ({states}) after "
                                 f"{timeout_s - (deadline - time.monotonic()):.0f} s\n"
                                 f"{_service_report(broken[0] if broken else waited)}")  # fmt: skip
        time.sleep(2)


def _restarts() -> dict[str, str]:
    """Each container's restart count, state and exit code: a worker that died shows here even once restarted."""
    found = {}
    for service in ("redis", "decode", "prefill", "router", "prometheus"):
        cid = _compose("ps", "-q", service).stdout.strip()
        found[service] = subprocess.run(
            ["docker", "inspect", "-f", "restarts={{.RestartCount}} {{.State.Status}} exit={{.State.ExitCode}}", cid],
            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return found


def _logged_serving_s(service: str, since: float) -> float | None:
    """Seconds from ``since`` (``time.time()``) to the first "serving on" line ``service`` logged after it."""
    cid = _compose("ps", "-q", service).stdout.strip()
    logs = subprocess.run(["docker", "logs", "-t", "--since", f"{since:.3f}", cid], capture_output=True, text=True)
    for line in (logs.stdout + logs.stderr).splitlines():
        if "serving on" in line:  # "2026-01-01T12:00:00.123456789Z decode INFO ... serving on ..."
            whole, _, fraction = line.split()[0].rstrip("Z").partition(".")  # RFC 3339, up to 9 digits
            return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{fraction or 0}") - since
    return None


def _seconds(value: float | None) -> str:
    return "(no log line)" if value is None else f"{value:.1f} s"


def _first_answer(prompt: str, started: float, after: str) -> dict:
    """Poll ``/v1/completions`` with ``prompt`` until it answers 200 (at most 300 s from ``started``)."""
    while True:
        status, body = _complete(prompt, timeout=120)
        if status == 200:
            return body
        assert time.monotonic() - started < 300, (f"no 200 within 300 s of {after}: {status} {body}\n"
                                                  f"{_service_report('decode')}")  # fmt: skip
        time.sleep(0.25)


def _send(prompts: list[str], expected: list[str], concurrency: int = 4) -> tuple[list[str], int]:
    """Send ``prompts``; returns the mismatches (with their reason) and the KV tokens the answers held."""
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(_complete, prompts))
    mismatches, kv_tokens = [], 0
    for i, ((status, body), want) in enumerate(zip(replies, expected, strict=True)):
        if status != 200:
            mismatches.append(f"prompt {i}: HTTP {status} {body}")
            continue
        got = body["choices"][0]["text"]
        kv_tokens += body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1  # last: never stored
        if got != want:
            mismatches.append(f"prompt {i}: {got!r} != offline {want!r}")
    return mismatches, kv_tokens


@pytest.fixture(scope="module")
def stack():
    """Build and start the stack; yields build seconds and image size; always ``down -v``."""
    if (reason := _why_not_here()) is not None:
        if os.environ.get("KVSERVE_COMPOSE_REQUIRED") == "1":
            pytest.fail(f"make test-compose cannot run the stack: {reason}", pytrace=False)
        pytest.skip(reason)
    print(f"\ncompose: {' '.join(COMPOSE)} ({_compose('version', '--short', check=False).stdout.strip()})")
    token = ROOT / "cluster-token"
    made = not token.exists()
    if made:
        token.touch(mode=0o600)
        token.write_text(f"KVSERVE_CLUSTER_TOKEN={os.urandom(24).hex()}\n")
    _compose("down", "-v", check=False)  # a run that was interrupted
    build_args = [f"--build-arg={arg}" for arg in shlex.split(os.environ.get("KVSERVE_COMPOSE_BUILD_ARGS", ""))]
    try:
        started = time.monotonic()
        build = _compose("build", *build_args, check=False, timeout=3600)
        assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
        build_s = time.monotonic() - started
        size = subprocess.run(["docker", "images", "kvserve", "--format", "{{.Size}}"], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        _import_every_service_module()
        _prometheus_image()
        _compose("up", "-d")
        _wait_healthy(600)
        yield {"build_s": build_s, "image_size": size}
    finally:
        logs = _compose("logs", "--no-color", "--tail", "30", check=False).stdout
        print(f"\n--- last log lines ---\n{logs}")
        _compose("down", "-v", check=False)
        if made:
            token.unlink()


def test_the_stack_serves_past_256_mib_of_kv_and_a_killed_decode_worker_recovers(stack):
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(min(2, os.cpu_count() or 1))  # the stack's containers share these cores
    llm = LLM(model="default")
    num_before = -(-KV_TARGET_BYTES // ((PROMPT_TOKENS + MAX_TOKENS - 1) * KV_BYTES_PER_TOKEN))  # 15
    total = int(os.environ.get("KVSERVE_COMPOSE_PROMPTS", num_before + PROMPTS_AFTER_RESTART))
    floor = num_before + 2  # the prompts before the kill, and one after each of the two restarts
    assert total > floor, f"KVSERVE_COMPOSE_PROMPTS must exceed {floor}"
    prompts = _prompts(llm.tokenizer, total)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    started = time.monotonic()
    expected = [out.text for out in llm.generate(prompts, params)]
    offline_s = time.monotonic() - started
    del llm

    started = time.monotonic()
    mismatches, kv_tokens = _send(prompts[:num_before], expected[:num_before])
    before_s = time.monotonic() - started
    kv_bytes = kv_tokens * KV_BYTES_PER_TOKEN

    # A manual stop: `kill` (as `stop`) tells the restart policy to leave the container down until `start`.
    _compose("kill", "decode")
    time.sleep(MANUAL_STOP_WAIT_S)
    state_after_kill = _state("decode")
    started, started_at = time.monotonic(), time.time()
    _compose("start", "decode")
    body = _first_answer(prompts[num_before], started, "`start decode`")
    start_s = time.monotonic() - started
    start_serving_s = _logged_serving_s("decode", started_at)
    if body["choices"][0]["text"] != expected[num_before]:
        mismatches.append(f"first answer after `start decode`: {body['choices'][0]['text']!r}")

    # A crash: every process but the container's init (docker-init, `init: true`) killed by SIGKILL, as the
    # kernel's OOM killer would; init exits with it, and the restart policy starts the container again.
    started, started_at = time.monotonic(), time.time()
    _compose("exec", "-T", "decode", "python", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)", check=False)
    body = _first_answer(prompts[num_before + 1], started, "the crash")
    recovery_s = time.monotonic() - started
    serving_s = _logged_serving_s("decode", started_at)
    if body["choices"][0]["text"] != expected[num_before + 1]:
        mismatches.append(f"first answer after the crash: {body['choices'][0]['text']!r}")

    started = time.monotonic()
    after, after_tokens = _send(prompts[num_before + 2 :], expected[num_before + 2 :])
    after_s = time.monotonic() - started
    mismatches += after
    restarts = _restarts()
    print(f"\ncompose stack: image kvserve {stack['image_size']}, build {stack['build_s']:.0f} s; offline "
          f"expected outputs {offline_s:.0f} s\n{num_before} prompts before the kill: {kv_tokens} KV tokens = "
          f"{kv_bytes / (1 << 20):.1f} MiB ({KV_BYTES_PER_TOKEN} B/token) in {before_s:.0f} s\n"
          f"decode `kill`: {state_after_kill} after {MANUAL_STOP_WAIT_S:.0f} s; `start`: first 200 after "
          f"{start_s:.1f} s, its log says serving after {_seconds(start_serving_s)}\n"
          f"decode crash (SIGKILL): restarted by the policy, first 200 after {recovery_s:.1f} s "
          f"(target {RECOVERY_TARGET_S:.0f} s); its log says serving after {_seconds(serving_s)}\n"
          f"{total - num_before - 2} more prompts in {after_s:.0f} s ({after_tokens} KV tokens); "
          f"{total} prompts in all, {total - len(mismatches)} answers equal the offline engine's\n"
          f"containers: {restarts}")  # fmt: skip
    assert kv_bytes > KV_TARGET_BYTES
    assert not mismatches, "\n".join(mismatches[:10])
    assert state_after_kill == "exited", "a killed container came back before `start`"
    crashed_once = {s: "restarts=1 running" if s == "decode" else "restarts=0 running" for s in restarts}
    assert {s: state[: len(crashed_once[s])] for s, state in restarts.items()} == crashed_once, restarts
    assert recovery_s <= RECOVERY_TARGET_S
