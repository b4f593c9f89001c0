"""A process that takes over a dead worker's port, as issue 21's probe did, and records what callers send it.

It speaks just enough plaintext HTTP/2 (the standard library only, so that it also runs in a child that
dropped to another uid, which cannot read this repository's virtual environment): it sends its SETTINGS,
acknowledges the client's SETTINGS and PINGs, and answers every call with status OK and the message bytes
``08 01`` (a health check: SERVING). Everything any client sends it, before and after, is recorded: a
client that trusts it gives away its call metadata (the cluster token) and request (the prompt) in the
clear; one that insists on a certificate of its cluster CA sends a TLS ClientHello and gives up.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS, _PING = 0, 1, 4, 6
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_STATUS_200 = b"\x88"  # HPACK: static table entry 8, ":status: 200"
_CONTENT_TYPE = b"\x0f\x10\x10application/grpc"  # literal, name: static entry 31 (content-type)
_GRPC_OK = b"\x00\x0bgrpc-status\x010"  # literal with a new name


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _answers(buffer: bytearray) -> bytes:
    """What to send for the complete frames at the start of ``buffer`` (the preface already removed); consumes them."""
    out = b""
    while len(buffer) >= 9:
        length = int.from_bytes(buffer[:3], "big")
        if len(buffer) < 9 + length:
            break
        kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
        payload = bytes(buffer[9 : 9 + length])
        del buffer[: 9 + length]
        if kind == _SETTINGS and not flags & _ACK:
            out += _frame(_SETTINGS, _ACK, 0)
        elif kind == _PING and not flags & _ACK:
            out += _frame(_PING, _ACK, 0, payload)
        elif kind == _HEADERS and stream % 2:
            out += _frame(_HEADERS, _END_HEADERS, stream, _STATUS_200 + _CONTENT_TYPE)
            out += _frame(_DATA, 0, stream, b"\x00\x00\x00\x00\x02\x08\x01")
            out += _frame(_HEADERS, _END_HEADERS | _END_STREAM, stream, _GRPC_OK)
    return out


def serve(listener: socket.socket, stop_fd: int) -> tuple[int, bytes]:
    """Accept and answer connections on ``listener`` until ``stop_fd`` is readable; (connections, bytes received)."""
    connections: dict[socket.socket, bytearray] = {}
    received, accepted = bytearray(), 0
    while True:
        readable, _, _ = select.select([listener, stop_fd, *connections], [], [], 0.5)
        if stop_fd in readable:
            return accepted, bytes(received)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                conn.sendall(_frame(_SETTINGS, 0, 0))  # a server's preface
                connections[conn], accepted = bytearray(), accepted + 1
                continue
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                connections.pop(sock).clear()
                sock.close()
                continue
            received += data
            buffer = connections[sock]
            buffer += data
            if buffer.startswith(PREFACE):
                del buffer[: len(PREFACE)]
            elif len(buffer) < len(PREFACE) and PREFACE.startswith(bytes(buffer)):
                continue
            elif buffer[:1] == b"\x16":  # a TLS ClientHello: nothing here can answer it
                continue
            try:
                sock.sendall(_answers(buffer))
            except OSError:
                pass


@dataclass
class Recording:
    connections: int = 0
    received: bytes = b""


@contextmanager
def impostor(port: int, uid: int | None = None):
    """Listen on 127.0.0.1:``port`` from a forked child (as ``uid``, and its group, when given: needs root)
    while the ``with`` block runs; yields a ``Recording``, filled in when the block ends."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, then _exit without running the parent's clean-ups
        code = 1
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead worker's TIME_WAITs
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            os.write(ready_w, b"L")
            accepted, received = serve(listener, stop_r)
            os.write(result_w, struct.pack(">I", accepted) + received)
            code = 0
        finally:
            os._exit(code)
    for fd in (ready_w, stop_r, result_w):
        os.close(fd)
    recording = Recording()
    try:
        if os.read(ready_r, 1) != b"L":
            raise RuntimeError(f"the impostor could not listen on port {port}")
        yield recording
    finally:
        with suppress(OSError):  # a child that could not listen is gone already
            os.write(stop_w, b"x")
        os.close(stop_w)
        with os.fdopen(result_r, "rb") as out:
            answer = out.read()
        os.close(ready_r)
        os.waitpid(pid, 0)
    recording.connections, recording.received = struct.unpack(">I", answer[:4])[0], answer[4:]


def wait_port_free(port: int, timeout_s: float = 5.0) -> None:
    """Until nothing listens on 127.0.0.1:``port`` (a killed process's socket closes as it is reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.01)
    raise RuntimeError(f"port {port} still taken")
