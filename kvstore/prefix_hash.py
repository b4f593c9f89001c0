"""Chained hashes of full KV blocks: the names a prefix cache, the Redis prefix index and the router share.

``h_i = xxh3_128(h_{i-1} || salt || token ids of block i)``, hex. The salt is the KV layout's fingerprint
(``kvstore.layout.fingerprint``: architecture, dtypes incl. ``kv_cache_dtype``, layer/head counts, block
size), so two workers share a hash only when their blocks hold interchangeable bytes. A hash names a
whole prefix: equal hashes at block ``i`` mean (barring a collision, which the engine rules out by comparing
token ids) equal tokens in blocks ``0..i``. Only full blocks are hashed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str, parent: str = "") -> list[str]:
    """The chained hashes of every full block of ``token_ids`` (a trailing partial block has none).

    ``parent`` is the hash of the block before ``token_ids[0]`` ('' at the start of a sequence).
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    hashes = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = xxhash.xxh3_128_hexdigest(parent.encode() + salt.encode() + ids[start : start + block_size].tobytes())
        hashes.append(parent)
    return hashes
