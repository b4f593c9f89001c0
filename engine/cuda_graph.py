"""CUDA graphs of the decode step: one per batch-size bucket, replayed instead of launching every kernel.

A decode step of a small model launches a dozen kernels per layer, each costing more host time than GPU
time; replaying a captured graph launches them all at once. A graph fixes its tensors' addresses and
shapes, so each bucket's graph reads its inputs from ``PaddedDecodeInputs``' fixed views and the batch is
padded up to the bucket. Capture runs largest bucket first with one shared memory pool: every smaller graph
fits in the memory the largest one's activations already took. Sampling stays outside the graphs.

Under tensor parallelism every rank captures its own graphs of its part, in step with the others, so each
graph holds its rank's all-reduces and the logits' gather (NCCL collectives are captured like kernels); rank 0
sends each step's staged inputs to the ranks before it replays (``engine.tensor_parallel_model.ShardedDecode``).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine.input_batch import PaddedDecodeInputs
from kvstore import LayerKV

log = logging.getLogger(__name__)

# Larger decode batches run eagerly: their launch overhead is small next to their GPU time, and each
# bucket's graph costs capture time and memory for its logits.
MAX_BUCKET = 512


def decode_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Batch sizes 1, 2, 4, 8, then every multiple of 8, up to the largest decode batch the scheduler can
    form (capped at ``MAX_BUCKET``), which is always a bucket itself."""
    cap = min(max_num_seqs, max_num_batched_tokens, MAX_BUCKET)
    sizes = [b for b in (1, 2, 4, *range(8, cap + 1, 8)) if b <= cap]
    return sizes if sizes[-1] == cap else [*sizes, cap]


def decode_forward(model: nn.Module, kv_layers: list[LayerKV], inputs: PaddedDecodeInputs, bucket: int) -> torch.Tensor:
    """The padded decode forward of ``bucket`` rows over ``inputs``' fixed views: logits ``(bucket, vocab)``
    float32 (padding rows' logits are meaningless)."""
    input_ids, positions, meta = inputs.device_inputs(bucket)
    return model.compute_logits(model(input_ids, positions, kv_layers, meta))


class DecodeGraphs:
    """The captured graphs, by bucket. ``replay(bucket)`` runs on whatever ``inputs`` staged for it."""

    def __init__(
        self, model: nn.Module, kv_layers: list[LayerKV], inputs: PaddedDecodeInputs, device: torch.device
    ) -> None:
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        began, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        self._logits: torch.Tensor | None = None  # (largest bucket, vocab) float32, written by every graph
        for bucket in sorted(inputs.buckets, reverse=True):
            # Padding rows only: nothing is stored in the pool and attention reads no KV.
            inputs.stage_padding(bucket)
            # Warm-up outside capture: Triton compiles its kernels and cuBLAS picks its own before recording.
            logits = decode_forward(model, kv_layers, inputs, bucket)  # (None on tensor-parallel ranks 1..)
            if self._logits is None and logits is not None:
                self._logits = torch.empty_like(logits)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                # One logits buffer for all graphs: each graph's own output would stay allocated for good
                # (at 256 rows of a 152k vocabulary that is 150 MiB per bucket); the copy costs microseconds.
                logits = decode_forward(model, kv_layers, inputs, bucket)
                if logits is not None:
                    self._logits[:bucket].copy_(logits)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - began
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("%s", self.summary())

    def summary(self) -> str:
        buckets = sorted(self._graphs)
        return (f"captured {len(buckets)} decode CUDA graphs (batch {buckets[0]}..{buckets[-1]}) in "
                f"{self.capture_s:.1f} s, {self.memory_bytes / 2**20:.0f} MiB of GPU memory")  # fmt: skip

    def replay(self, bucket: int) -> torch.Tensor | None:
        """Run ``bucket``'s graph; its logits ``(bucket, vocab)``, overwritten by the next replay (None on a
        tensor-parallel rank other than 0, whose logits rank 0 gathered)."""
        self._graphs[bucket].replay()
        return None if self._logits is None else self._logits[:bucket]
