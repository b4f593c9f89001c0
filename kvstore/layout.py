"""The identity of a KV layout: which pools hold interchangeable bytes.

Two workers exchange KV, and share prefix-block hashes (``kvstore.prefix_hash`` salts them with it), only
when their fingerprints are equal: same architecture, dtypes (``kv_cache_dtype`` included), layer and head
counts and block size.
"""

from __future__ import annotations

import hashlib

from kvstore.kv_cache import KVCacheSpec


def fingerprint(architecture: str, spec: KVCacheSpec, extra: str = "") -> str:
    """16 hex digits naming the KV layout of ``spec`` under ``architecture``; equal fingerprints mean two
    pools hold interchangeable bytes. ``extra`` distinguishes layouts the spec alone does not."""
    parts = [architecture, str(spec.dtype), spec.kv_cache_dtype, str(spec.num_layers), str(spec.num_kv_heads),
             str(spec.head_dim), str(spec.block_size), extra]  # fmt: skip
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
