"""Plain-PyTorch references for the kernels: paged attention (``attention``, with its windows in ``window``),
the KV pool's layout (``paged_kv``), the decoder layer's fused element-wise ops (``layer_ops``) and the
sampler's Gumbel-max draw (``sampling``).

These define the semantics that the Triton kernels in this package must match,
and they are what runs on the CPU. Layouts (shared with the Triton kernels):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (one layer's slice of the KV pool).
* ``k_scale`` / ``v_scale`` (INT8 KV only): ``[num_blocks, block_size, num_kv_heads]``
  float32, one scale per token and head; the stored value is
  ``round(x / scale)`` clamped to [-127, 127].
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a
  sequence's last block are never read (their value does not matter).
* ``slot_mapping``: int ``[num_tokens]``, ``block_id * block_size + offset``;
  ``-1`` means "do not store this token".
* ``ring`` (windowed attention only): int32 ``[num_seqs, 4]``, per sequence ``(num_sinks S, window W,
  sink_blocks, ring_blocks)``. A query at position ``t`` sees keys ``0..S-1`` (the sinks, scored with
  ``q_sink``: the same query rotated at its position inside the cache) and ``t-W+1..t`` (scored with ``q``),
  nothing else; logical block ``j`` of the sequence is table column ``j`` below ``sink_blocks`` and
  ``sink_blocks + (j - sink_blocks) % ring_blocks`` from there (``kvstore.ring``). ``FULL_RING_ROW`` sees
  every key through the plain table: a sequence without a window in a batch that has windowed ones, computed
  exactly as without ``ring``.

The names below are the references' public face: ``kvkernels`` dispatches to them by name on the CPU.
"""

from kvkernels.reference.attention import paged_decode_attention, paged_prefill_attention
from kvkernels.reference.layer_ops import add_rms_norm, rotary_embedding, silu_and_mul
from kvkernels.reference.paged_kv import (
    FULL_RING_ROW,
    INT8_MAX,
    RING_BLOCKS,
    RING_SINK_BLOCKS,
    RING_SINKS,
    RING_WINDOW,
    UNBOUNDED,
    quantize_int8,
    store_kvcache,
)
from kvkernels.reference.sampling import gumbel_argmax, uniform_noise

__all__ = [
    "FULL_RING_ROW",
    "INT8_MAX",
    "RING_BLOCKS",
    "RING_SINKS",
    "RING_SINK_BLOCKS",
    "RING_WINDOW",
    "UNBOUNDED",
    "add_rms_norm",
    "gumbel_argmax",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_int8",
    "rotary_embedding",
    "silu_and_mul",
    "store_kvcache",
    "uniform_noise",
]
