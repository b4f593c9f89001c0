"""Faults under ``kvserve up``'s supervision, with real processes, a real Redis and gRPC on loopback: SIGKILLed
workers, Redis and launcher; a process that can never start. The restart policy on its own (backoff, giving up)
is tested in tests/cluster/test_supervisor.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from cluster_utils import (
    Load,
    cluster,
    free_base_port,
    offline_answers,
    prometheus_values,
    supervised,
    tiny_engine_argv,
)
from waiting import wait_until

from cluster_state.registry import Registry
from kvserve.client import Client
from kvserve.launcher.cluster import Cluster, cluster_shm_dir
from kvserve.launcher.supervisor import RestartPolicy, State
from kvstore.shared_pool import pool_file_name

POLICY = RestartPolicy(initial_delay_s=0.2, startup_timeout_s=120.0)
CONCURRENCY, MAX_TOKENS = 8, 24  # half greedy, half seeded sampling (cluster_utils.load_request)
KILL_MAX_TOKENS, DRAIN_MAX_TOKENS = 2 * MAX_TOKENS, 64  # the killed workers' and the draining worker's loads


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """One prefill worker (while it restarts, prompts are prefilled locally) and two decode workers (a stream
    on one that dies or drains moves to the other): on 2 cores a fourth worker only slows the load down."""
    logs = tmp_path_factory.mktemp("logs-faults")
    c = cluster(1, 2, logs, decode_argv=["--prefill-timeout-s", "8", "--drain-timeout", "3"])
    c.log_dir = logs
    with supervised(c, POLICY) as (supervisor, messages):
        yield c, supervisor, messages


@pytest.fixture(scope="module")
def expected(llm) -> Callable[[int], list[list[int]]]:
    """``expected(max_tokens)``: the offline engine's answers to the load threads' requests for ``max_tokens``,
    the first tokens of its answers for the longest load here, computed once (every request runs to its
    max_tokens, and neither a greedy nor a seeded sequence's tokens depend on how many it asked for)."""
    longest = offline_answers(llm, CONCURRENCY, DRAIN_MAX_TOKENS)
    return lambda max_tokens: [answer[:max_tokens] for answer in longest]


def _tokens_streamed(c: Cluster, name: str) -> float:
    """How many tokens decode worker ``name`` has streamed since it started (its inter-token latency count)."""
    buckets = prometheus_values(c.child(name).metrics_url, "kvserve_inter_token_latency_seconds_bucket")
    return buckets.get('le="+Inf"', 0.0)


def _await_streaming(c: Cluster, name: str, num_tokens: int) -> None:
    """Wait until decode worker ``name`` has streamed ``num_tokens`` more tokens: the load runs there now, and
    its streams have sent some tokens but not most (a fault then catches them mid-way)."""
    before = _tokens_streamed(c, name)
    wait_until(lambda: _tokens_streamed(c, name) >= before + num_tokens, 120, f"{name} streaming tokens")


def _kill(c: Cluster, name: str) -> tuple[int, float]:
    """SIGKILL ``name``; returns its pid and when it was killed."""
    pid = c.child(name).pid
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def _await_restart(c: Cluster, name: str, old_pid: int, killed: float) -> float:
    """The seconds from ``name``'s SIGKILL until its restarted process answers health."""
    child = c.child(name)
    wait_until(lambda: child.pid != old_pid and child.answers(), 90, f"{name} restarted and answering")
    return time.monotonic() - killed


@pytest.mark.slow
def test_killed_workers_are_restarted_while_serving_goes_on(two_by_two, expected):
    """Streams running on the SIGKILLed decode worker move to the other one (the router resends the prompt and
    the tokens already streamed); the prefill worker is SIGKILLed right after it, so the two restart together
    and meanwhile the live decode worker prefills everything itself: no request fails, and every answer is
    still the offline engine's."""
    c, supervisor, messages = two_by_two
    # longer answers than the other faults' (most of a stream's life is decoding), and the kill comes while
    # decode-0 is streaming tokens (its inter-token count grows), so it catches streams that already sent some
    load = Load(c.endpoint, threads=CONCURRENCY, max_tokens=KILL_MAX_TOKENS, expected=expected(KILL_MAX_TOKENS))
    try:
        _await_streaming(c, "decode-0", 8)
        decode_pid, decode_killed = _kill(c, "decode-0")
        prefill_pid, prefill_killed = _kill(c, "prefill-0")
        decode_recovery_s = _await_restart(c, "decode-0", decode_pid, decode_killed)
        prefill_recovery_s = _await_restart(c, "prefill-0", prefill_pid, prefill_killed)
        restarted_pid = c.child("decode-0").pid
        assert not (c.shm_dir / pool_file_name("decode-0", decode_pid)).exists(), "the dead worker's pool is left"
        assert (c.shm_dir / pool_file_name("decode-0", restarted_pid)).exists()
        count = load.completed
        wait_until(lambda: load.done_since(count) >= 3, 60, "requests completed after both workers' restarts")
    finally:
        load.stop()
    print(f"\ndecode-0: serving again {decode_recovery_s:.1f} s after SIGKILL; prefill-0: {prefill_recovery_s:.1f} s;"
          f" {load.completed} requests completed, {len(load.failures)} failed: {load.failures}")  # fmt: skip
    moved = (c.log_dir / "router.log").read_text().count("moving the stream to another")
    print(f"{moved} streams moved off decode-0; {len(load.wrong)} answers differ from the offline engine's")
    assert load.failures == [] and load.wrong == []
    assert moved > 0  # the kill did catch streams mid-way
    assert any(f"decode decode-0 (pid {decode_pid}) killed by SIGKILL" in m for m in messages), messages
    assert any(f"prefill prefill-0 (pid {prefill_pid}) killed by SIGKILL" in m for m in messages), messages
    assert sum("serves again" in m for m in messages) >= 2, messages
    assert supervisor.state("decode-0") is State.UP and supervisor.state("prefill-0") is State.UP


@pytest.mark.soak  # on demand (pytest -m soak): make test's budget; a killed Redis is tested below
def test_paused_redis_costs_no_request(two_by_two, expected):
    """Paused for 6 s (an entry lives 5 s unrefreshed), Redis comes back with every worker's entry expired: the
    router keeps routing to the workers it knows while they answer their health checks."""
    c, _, _ = two_by_two
    load = Load(c.endpoint, threads=CONCURRENCY, max_tokens=MAX_TOKENS, expected=expected(MAX_TOKENS))
    try:
        wait_until(lambda: load.completed >= 1, 120, "the load got going")  # the other streams are mid-way
        os.kill(c.redis.pid, signal.SIGSTOP)
        try:
            before = load.completed
            time.sleep(6)
            during = load.done_since(before)
        finally:
            os.kill(c.redis.pid, signal.SIGCONT)
        after = load.completed
        wait_until(lambda: load.done_since(after) >= CONCURRENCY, 120, "requests completing after Redis resumed")
    finally:
        load.stop()
    print(f"\nRedis paused 6 s at concurrency {CONCURRENCY}: {during} requests completed meanwhile, "
          f"{load.completed} in all, {len(load.failures)} failed, {len(load.wrong)} wrong")  # fmt: skip
    assert load.failures == [] and load.wrong == [] and during > 0


@pytest.mark.slow
def test_killed_redis_costs_no_request_and_workers_register_again(two_by_two, expected):
    """Redis SIGKILLed mid-load comes back empty: no request fails while the workers register again."""
    c, supervisor, messages = two_by_two
    load = Load(c.endpoint, threads=CONCURRENCY, max_tokens=MAX_TOKENS, expected=expected(MAX_TOKENS))
    try:
        wait_until(lambda: load.completed >= 1, 120, "the load got going")  # the other streams are mid-way
        old_pid = c.redis.pid
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: c.redis.pid != old_pid and c.redis.alive, 30, "Redis restarted")
        restarted_s = time.monotonic() - killed
        names = {"decode-0", "decode-1", "prefill-0"}
        registry = Registry(c.redis_url, security=c.security)  # a fresh reader: its fallback view is empty
        wait_until(lambda: names <= {w.worker_id for w in registry.workers()}, 30, "every worker registered again")
        registered_s = time.monotonic() - killed
        after = load.completed
        wait_until(lambda: load.done_since(after) >= CONCURRENCY, 120, "requests completing after the restart")
    finally:
        load.stop()
    print(f"\nRedis restarted {restarted_s:.1f} s after SIGKILL; workers registered again after {registered_s:.1f} s;"
          f" {load.completed} requests at concurrency {CONCURRENCY}, {len(load.failures)} failed, "
          f"{len(load.wrong)} wrong")  # fmt: skip
    assert load.failures == [] and load.wrong == []
    assert any(f"redis redis (pid {old_pid}) died" in m for m in messages), messages
    assert supervisor.state("redis") is State.UP


@pytest.mark.slow
def test_no_blocks_leak_after_the_faults(two_by_two):
    c, _, _ = two_by_two
    registry = Registry(c.redis_url, security=c.security)

    def all_free() -> bool:
        workers = registry.workers("decode")
        return len(workers) == 2 and all(w.free_blocks == w.total_blocks for w in workers)

    # after the killed workers and Redis's faults: blocks a killed prefill worker was writing are held until its
    # restarted successor ends its leases
    took_s = wait_until(all_free, 20, f"every decode worker idle with all blocks free: {registry.workers('decode')}")
    print(f"\nall decode blocks free {took_s:.1f} s after the load")
    raw = redis.Redis.from_url(c.redis_url)
    wait_until(lambda: not raw.keys("kvserve:lease:*"), 20, "no lease left in Redis")
    raw.close()


@pytest.mark.slow
def test_a_draining_decode_worker_hands_its_streams_over_and_gets_traffic_once_restarted(two_by_two, expected):
    """SIGTERM: decode-1 stops admitting, and what still runs at its drain timeout (3 s here) moves to decode-0
    as a continuation instead of being cut; restarted, it gets requests as soon as it serves again."""
    c, _, _ = two_by_two
    # SIGTERM comes as decode-1's streams send their first tokens: the rest, most of 64, outlive its drain timeout
    # (2 cores stream each of 8 streams at well under 20 tokens/s), and decode-0 still runs the load when
    # decode-1 serves again
    load = Load(c.endpoint, threads=CONCURRENCY, max_tokens=DRAIN_MAX_TOKENS, expected=expected(DRAIN_MAX_TOKENS))
    router_log = c.log_dir / "router.log"
    moved_before = router_log.read_text().count("moving the stream to another")
    child = c.child("decode-1")
    try:
        _await_streaming(c, "decode-1", 4)
        old_pid = child.pid
        os.kill(old_pid, signal.SIGTERM)
        wait_until(lambda: child.pid != old_pid and child.answers(), 90, "decode-1 restarted and answering")
        registry = Registry(c.redis_url, security=c.security)
        wait_until(lambda: "decode-1" in {w.worker_id for w in registry.workers()}, 10, "decode-1 registered again")
        registry.stop()
        serving, served_by = time.monotonic(), []
        with Client(c.endpoint, timeout_s=60) as client:  # decode-0 runs the load: an idle decode-1 should win
            while "decode-1" not in served_by and time.monotonic() - serving < 60:
                served_by.append(client.generate([7, 8, 9], max_tokens=1, temperature=0).decode_worker)
        first_request_s = time.monotonic() - serving
    finally:
        load.stop()
    moved = router_log.read_text().count("moving the stream to another") - moved_before
    print(f"\ndrain: {moved} streams moved off decode-1 at its drain timeout; the restarted decode-1 answered "
          f"request {len(served_by)} sent after it served again, {first_request_s:.1f} s after; "
          f"{load.completed} requests, {len(load.failures)} failed, {len(load.wrong)} wrong")  # fmt: skip
    assert load.failures == [] and load.wrong == []
    assert moved > 0
    assert served_by == ["decode-1"]  # no bench, no reconnect backoff: the first request after it serves


def _child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _start_up(port: int, log: Path, engine_argv: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """``kvserve up`` in its own session; returns it once serving, with the lines it printed."""
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--port", str(port), "--http-port", str(port + 1), "--prefill",
           "0", *engine_argv]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "a"), text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if "serving kvserve.v1.Inference" in line:
            return proc, lines
    proc.wait()
    raise AssertionError(f"kvserve up exited with {proc.returncode}: {lines}\n{log.read_text()}")


@pytest.mark.soak  # about 35 s: on demand (pytest -m soak), outside make test's 15 minutes
def test_killed_launcher_leaves_no_orphans_and_the_next_start_cleans_up(tmp_path, tiny_model_dir):
    port = free_base_port()
    launcher, lines = _start_up(port, tmp_path / "up.log", tiny_engine_argv(tiny_model_dir))
    try:
        assert f"decode-0 decode grpc=127.0.0.1:{port + 10} metrics=http://127.0.0.1:{port + 1010}/metrics" in lines
        assert f"router router grpc=127.0.0.1:{port} metrics=http://127.0.0.1:{port + 1}/metrics" in lines
        children = _child_pids(launcher.pid)
        assert len(children) == 3  # Redis, the decode worker, the router
        shm_dir = cluster_shm_dir(port)
        left = list(shm_dir.iterdir())  # the decode worker's pool, Redis's socket, the children's certificates
        pools = [p for p in left if p.name.startswith("kvserve-decode-0-")]
        redis_dirs = [d for d in Path(tempfile.gettempdir()).glob("kvserve-redis-*")
                      if (d / "server.pid").read_text() in map(str, children)]  # fmt: skip
        assert len(pools) == 1 and len(redis_dirs) == 1
    finally:  # the kill is the test, and a failed check must not leave a cluster running either
        launcher.kill()
    launcher.wait()
    gone_s = wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 5, "children died with it")
    print(f"\nthe SIGKILLed launcher's children were gone after {gone_s:.2f} s")
    for child_port in (port, port + 10):
        with socket.socket() as s:  # nobody listens there any more; SO_REUSEADDR lets the bind past the dead
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections' TIME_WAIT, never past a listener
            s.bind(("127.0.0.1", child_port))
    second = free_base_port()  # a start on another port cleans up too: any start removes dead clusters' files
    while second == port:
        second = free_base_port()
    # before it starts anything; this start then fails (a worker that cannot load its model, the case of
    # test_up_exits_non_zero_when_a_process_cannot_start), and it leaves nothing of its own either
    _up_with_a_model_no_worker_can_load(second, tmp_path)
    assert not shm_dir.exists() and not any(p.exists() for p in left) and not redis_dirs[0].exists()
    assert not cluster_shm_dir(second).exists()


def _up_command(port: int, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", "up", "--port", str(port), "--http-port", str(port + 1),
            "--prefill", "0", "--log-dir", str(log_dir)]  # fmt: skip


def _up_with_a_model_no_worker_can_load(port: int, tmp_path: Path) -> None:
    """``kvserve up`` exits 1, naming the worker that exited during start-up."""
    broken = tmp_path / "weightless"  # passes the launcher's check, but no worker can load it
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    cmd = [*_up_command(port, tmp_path), "--model", str(broken)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "decode decode-0 exited with code 1 during start-up" in done.stderr


def test_up_exits_non_zero_when_a_process_cannot_start(tmp_path):
    """A port in use and a missing model here; a worker exiting during start-up in the killed launcher's test
    (its next start, ``_up_with_a_model_no_worker_can_load``)."""
    port = free_base_port()
    cmd = _up_command(port, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 10))
        taken.listen()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and f"port {port + 10} on 127.0.0.1 is in use" in done.stderr, done.stderr
    missing = subprocess.run([*cmd, "--model", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 2 and "not a model directory" in missing.stderr
