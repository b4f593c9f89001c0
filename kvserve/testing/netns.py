"""Hosts for multi-host tests on one machine: network namespaces joined by a bridge, each with a private /dev/shm.

``Hosts(n)`` makes ``n`` test hosts. Each is a network namespace with loopback up and one address on a private
/24 (host *i* at ``.{i + 2}``); their veth pairs meet on a bridge that lives in a namespace of its own, so the
root namespace's firewall (Docker's ``FORWARD DROP``) never sees their traffic. One more veth pair joins the
root namespace to the bridge at ``.1``, so the test itself can reach every host (and only through that link:
nothing is routed or forwarded further).

``Hosts.command`` wraps a command so that it runs inside a host: ``ip netns exec`` into its namespace, then
new mount, UTS and PID namespaces (``unshare``): a fresh tmpfs on /dev/shm, the host's name as hostname, and
its own process ids, the command being its init. Processes on different test hosts can therefore never
share memory, as on different machines: their ``cluster_state.workers.local_host_id`` differs, and UCX
(under NIXL) cannot reach the other process with cross-memory attach (``process_vm_writev``, which it picks
whenever the peer's pid is visible, network namespaces notwithstanding), so it moves KV over TCP.

Every name carries ``PREFIX`` and the owning test process's pid (``kvsn<pid>-h0``, root link ``kvsn<pid>``).
Leaving ``Hosts`` (a context manager; exceptions included) SIGKILLs every process inside its namespaces,
deletes its root link and namespaces and waits until the kernel shows none of them. ``remove_leftovers``
does the same for names whose owner died (a SIGKILLed test run), and runs before every ``Hosts`` is made.

Namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's ``ip`` and util-linux's ``unshare``:
``unavailable()`` says why they cannot be made here by trying to make one, for a ``pytest.skip``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from types import TracebackType

PREFIX = "kvsn"
_OWNED = re.compile(rf"^{PREFIX}(\d+)(?:-|$)")
# inside a host: its own mount namespace (mounts private, so nothing leaks out) with a new tmpfs on /dev/shm
_PRIVATE_SHM = 'mount -t tmpfs -o mode=1777 kvserve-netns /dev/shm && hostname "$0" && exec "$@"'
_SETTLE_S = 5.0  # the kernel destroys a deleted namespace's links asynchronously


@dataclass(frozen=True)
class Host:
    """One test host: its namespace's name and its address on the test subnet."""

    name: str
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _root_links() -> list[str]:
    names = (line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines())
    return [name for name in names if _OWNED.match(name)]


def ours(pid: int | None = None) -> list[str]:
    """The namespaces and root links of the test process ``pid`` (default: this one) that exist now."""
    pid = os.getpid() if pid is None else pid
    return [name for name in [*_namespaces(), *_root_links()] if (m := _OWNED.match(name)) and int(m[1]) == pid]


def pids_in(namespace: str) -> list[int]:
    """The processes whose network namespace is ``namespace``."""
    return [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]


def _kill_all_in(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``namespace`` until none is left (a process may fork while we kill)."""
    deadline = time.monotonic() + timeout_s
    while pids := pids_in(namespace):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {namespace} outlived SIGKILL")
        time.sleep(0.05)


def _delete(names: list[str]) -> None:
    """Kill the processes of the namespaces among ``names``, delete root links (both veth ends go at once) and
    then namespaces, and wait until the kernel lists none of ``names``."""
    namespaces = set(_namespaces())
    for name in names:
        if name in namespaces:
            _kill_all_in(name)
    for name in names:
        if name not in namespaces:
            _ip("link", "del", name, check=False)
    for name in names:
        if name in namespaces:
            _ip("netns", "del", name, check=False)
    deadline = time.monotonic() + _SETTLE_S
    while left := set(names) & {*_namespaces(), *_root_links()}:
        if time.monotonic() > deadline:
            raise RuntimeError(f"still present after deletion: {sorted(left)}")
        time.sleep(0.05)


def remove_leftovers() -> list[str]:
    """Delete the namespaces and root links of test processes that no longer exist; returns their names."""
    dead = [name for name in [*_namespaces(), *_root_links()]
            if (m := _OWNED.match(name)) and not os.path.exists(f"/proc/{m[1]}")]  # fmt: skip
    _delete(dead)
    return dead


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can), found by making and deleting one."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the tests as root)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "util-linux")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (install {package})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _delete([probe])
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no address or route of the root namespace touches."""
    used = re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", _ip("-4", "route").stdout + _ip("-4", "addr").stdout)
    taken = [ipaddress.ip_network(u, strict=False) for u in used]
    start = os.getpid() % 2048  # concurrent test runs start at different places
    for i in range(2048):
        n = (start + i) % 2048
        subnet = ipaddress.ip_network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(subnet.overlaps(t) for t in taken if t.prefixlen > 0):
            return subnet
    raise RuntimeError("no free /24 in 10.200.0.0/13 for the test hosts")


class Hosts:
    """``n`` test hosts (see the module docstring); made on ``__enter__``, removed on ``__exit__``."""

    def __init__(self, n: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}-br"
        self.root_link = self.tag
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])  # the root namespace's end
        self.hosts = [Host(f"{self.tag}-h{i}", str(addresses[i + 1])) for i in range(n)]

    def __enter__(self) -> Hosts:
        remove_leftovers()
        if ours():
            raise RuntimeError(f"this process already has test hosts: {ours()}")
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.remove()

    def _make(self) -> None:
        prefix = f"/{self.subnet.prefixlen}"
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", "root", "netns", self.bridge)
        _ip("addr", "add", self.gateway + prefix, "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        _ip("-n", self.bridge, "link", "set", "root", "master", "br0", "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.name)
            _ip("-n", host.name, "link", "set", "lo", "up")
            _ip("-n", host.name, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", self.bridge)
            _ip("-n", host.name, "addr", "add", host.address + prefix, "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")
            _ip("-n", self.bridge, "link", "set", f"h{i}", "master", "br0", "up")

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` as it runs on ``host`` (see the module's docstring). Started with ``subprocess.Popen``, the
        process is ``unshare``'s, whose child ``argv`` is; killing it kills ``argv`` (``--kill-child``)."""
        return ["ip", "netns", "exec", host.name, "unshare", "--mount", "--uts", "--pid", "--kill-child",
                "--mount-proc", "--propagation", "private", "sh", "-c", _PRIVATE_SHM, host.name, *argv]  # fmt: skip

    def kill(self, host: Host) -> None:
        """Take ``host`` off the network as a crashed machine leaves it: SIGKILL every process on it, delete its
        namespace (and with it its veth pair)."""
        _delete([host.name])

    def remove(self) -> None:
        """SIGKILL every process on every host and delete every namespace and link made here (idempotent)."""
        _delete([*(h.name for h in self.hosts), self.root_link, self.bridge])
