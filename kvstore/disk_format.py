"""The disk tier's files (``kvstore.disk_tier``): one KV block each.

Files live in ``<directory>/<fingerprint>/<hash[:2]>/<hash>``: a header (``MAGIC``, ``FORMAT_VERSION``, the
layout fingerprint, the block's hash, its parent's hash, its token ids, the payload's length and xxh3-128), then
the payload: the block laid out as a one-block pool of ``spec`` (``KVCache(spec, 1)``: every layer's K, V and
INT8 scales, each padded like the pool). A file is written to a temp file beside it and renamed over its name,
so a crash leaves a whole file or a temp file that the next start deletes. There is no fsync: after a power loss
a renamed file may be short or hold garbage, which the start-up scan (length) or ``load`` (checksum) catches;
either costs a recompute, never a wrong token, and the writer does not stall on the disk's flushes.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvstore.kv_cache import KVCacheSpec

log = logging.getLogger(__name__)

MAGIC = b"KVSDISK\x00"
FORMAT_VERSION = 1
# magic, version, lengths of the fingerprint, hash and parent hash (ASCII), number of tokens (int64 each),
# payload length, xxh3-128 digest of the payload
HEADER = struct.Struct("<8sIHHHIQ16s")
TMP_PREFIX = ".tmp-"
BLOCK_NAME = re.compile(r"[0-9a-f]{3,128}")
FINGERPRINT_NAME = re.compile(r"[0-9A-Za-z_-]{1,64}")
HASH_CHARS = 32  # xxh3-128 in hex (kvstore.prefix_hash): the parent hash of all but a sequence's first block
MAX_TOKENS = 1 << 20


def header_bytes(fingerprint: str, block_hash: str, parent_hash: str, num_tokens: int) -> int:
    return HEADER.size + len(fingerprint) + len(block_hash) + len(parent_hash) + 8 * num_tokens


def bytes_per_file(fingerprint: str, spec: KVCacheSpec) -> int:
    """The size of one block's file (at most: every block but a sequence's first names a parent hash)."""
    return header_bytes(fingerprint, "0" * HASH_CHARS, "0" * HASH_CHARS, spec.block_size) + spec.bytes_per_block()


@dataclass(frozen=True)
class BlockHeader:
    fingerprint: str
    block_hash: str
    parent_hash: str
    token_ids: tuple[int, ...]
    payload_bytes: int
    checksum: bytes

    @property
    def nbytes(self) -> int:
        return header_bytes(self.fingerprint, self.block_hash, self.parent_hash, len(self.token_ids))

    def encode(self) -> bytes:
        names = [self.fingerprint.encode(), self.block_hash.encode(), self.parent_hash.encode()]
        fixed = HEADER.pack(MAGIC, FORMAT_VERSION, *map(len, names), len(self.token_ids), self.payload_bytes,
                             self.checksum)  # fmt: skip
        return fixed + b"".join(names) + np.asarray(self.token_ids, dtype="<i8").tobytes()

    @classmethod
    def read(cls, f) -> BlockHeader:
        """The header at the start of the open file ``f``; ``ValueError`` when it is not one."""
        fixed = f.read(HEADER.size)
        if len(fixed) < HEADER.size:
            raise ValueError("shorter than a header")
        magic, version, n_fp, n_hash, n_parent, n_tokens, payload_bytes, checksum = HEADER.unpack(fixed)
        if magic != MAGIC:
            raise ValueError("not a kvserve disk KV block (bad magic)")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version}, this build reads {FORMAT_VERSION}")
        if n_tokens > MAX_TOKENS:
            raise ValueError(f"{n_tokens} tokens in one block")
        rest = f.read(n_fp + n_hash + n_parent + 8 * n_tokens)
        if len(rest) < n_fp + n_hash + n_parent + 8 * n_tokens:
            raise ValueError("header cut short")
        text = rest[: n_fp + n_hash + n_parent].decode("ascii")  # UnicodeDecodeError is a ValueError
        tokens = np.frombuffer(rest[n_fp + n_hash + n_parent :], dtype="<i8")
        return cls(text[:n_fp], text[n_fp : n_fp + n_hash], text[n_fp + n_hash :], tuple(tokens.tolist()),
                   payload_bytes, checksum)  # fmt: skip


def checksum(payload: bytes | bytearray) -> bytes:
    """The payload's digest a header carries: xxh3-128."""
    return xxhash.xxh3_128_digest(payload)


def read_payload(f, header: BlockHeader) -> bytearray:
    """The payload after ``header`` in the open file ``f``; ``ValueError`` when its length or checksum is wrong."""
    payload = bytearray(header.payload_bytes)
    if f.readinto(payload) != len(payload) or f.read(1):
        raise ValueError("payload length differs from its header")
    if checksum(payload) != header.checksum:
        raise ValueError("checksum mismatch")
    return payload


def write_block_file(path: Path, header: BlockHeader, payload: bytearray) -> None:
    """``header`` and ``payload`` as the file ``path``: written to a temp file beside it, renamed over it."""
    path.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.encode())
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def scan(root: Path, check: Callable[[BlockHeader, str], None]) -> list[tuple[BlockHeader, int]]:
    """(header, file size) of every block file under ``root``, least recently touched first. Temp files, and
    files whose header ``check`` (the header, the file's name) refuses or whose length is wrong, are deleted;
    names that are not block names are left alone."""
    found = []
    for shard in root.iterdir():
        if not (shard.is_dir() and re.fullmatch(r"[0-9a-f]{2}", shard.name)):
            continue
        for path in shard.iterdir():
            if path.name.startswith(TMP_PREFIX):
                path.unlink(missing_ok=True)
                continue
            if not (BLOCK_NAME.fullmatch(path.name) and path.name.startswith(shard.name)):
                continue  # not ours to judge
            try:
                with open(path, "rb") as f:
                    header = BlockHeader.read(f)
                    stat = os.fstat(f.fileno())
                check(header, path.name)
                if stat.st_size != header.nbytes + header.payload_bytes:
                    raise ValueError(f"{stat.st_size} B, its header says {header.nbytes + header.payload_bytes}")
            except (OSError, ValueError) as e:
                log.warning("deleting disk KV block %s left by an earlier run: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, path.name, header, stat.st_size))
    return [(header, size) for *_, header, size in sorted(found, key=lambda f: f[:2])]


def check_writable(root: Path) -> None:
    """Create ``root`` and write a probe file there; ``ValueError`` saying what to change when it fails."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"disk KV cache directory {root} cannot be created ({e}): set disk_kv_cache_dir to a "
                         f"directory this user can write") from e  # fmt: skip
    try:
        with tempfile.TemporaryFile(prefix=TMP_PREFIX, dir=root) as f:
            f.write(b"probe")
    except OSError as e:
        raise ValueError(f"disk KV cache directory {root} is not writable ({e}): set disk_kv_cache_dir to a "
                         f"directory this user can write") from e  # fmt: skip
