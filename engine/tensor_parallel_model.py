"""Rank 0's model under tensor parallelism: ``ShardedModel`` sends each call to every rank; ``ShardedDecode`` runs
padded decode steps, every rank the same bucket, from CUDA graphs of its own.

A one-device engine replays a decode step's CUDA graph (``engine.cuda_graph``): the graph reads fixed input
buffers that the runner stages (``input_batch.PaddedDecodeInputs``). Under tensor parallelism a step's kernels
are spread over the ranks' processes, and the all-reduces and the logits' gather pair them up, so:

* at start-up rank 0 tells every rank to build the same padded inputs (``decode_steps``), and every rank
  captures its own graphs, bucket by bucket in the same order, in step: the warm-up forward before each
  capture runs the collectives eagerly, and the captured graph holds them (NCCL records them like kernels);
* at each padded decode step rank 0 stages the batch as on one device, sends the staged arrays to the
  ranks (``decode``: a few hundred bytes), and every rank writes them into its own buffers and replays.

On the CPU nothing is captured and the same plan runs each rank's padded forward eagerly, so the protocol
(staging, buckets, the collectives' order) is what the CPU tests run; only the capture needs a GPU.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graph import DecodeGraphs, decode_forward
from engine.input_batch import PaddedDecodeInputs
from engine.models.attention import AttentionMetadata, RingMetadata
from engine.models.model import CausalLM
from engine.models.tensor_parallel import RankLost, Shard, gather_logits
from kvstore import LayerKV

if TYPE_CHECKING:
    from engine.tensor_parallel_ranks import Ranks


# -- plans: what crosses the pipes (host arrays, not tensors: a tensor would travel as a shared-memory file) --


def to_host(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.cpu().numpy())
    if isinstance(value, (AttentionMetadata, RingMetadata)):
        return ("meta", type(value).__name__, {f.name: to_host(getattr(value, f.name))
                                               for f in dataclasses.fields(value)})  # fmt: skip
    return ("value", value)


def from_host(value, device: torch.device):
    if value[0] == "tensor":
        return torch.from_numpy(value[1]).to(device)
    if value[0] == "meta":
        kind = {"AttentionMetadata": AttentionMetadata, "RingMetadata": RingMetadata}[value[1]]
        return kind(**{name: from_host(v, device) for name, v in value[2].items()})
    return value[1]


class ShardedModel:
    """Rank 0's model under tensor parallelism: what the runner calls is sent to every rank, then run on rank
    0's part; ``compute_logits`` returns the whole vocabulary's logits, gathered. Anything else (``config``,
    ``modules``) is rank 0's part's."""

    def __init__(self, part: CausalLM, shard: Shard, ranks: Ranks) -> None:
        self.part, self.ranks = part, ranks
        self.gathered = GatheredModel(part, shard)  # (what each call runs here, once the ranks have it)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers, meta: AttentionMetadata):
        self.ranks.send("forward", tuple(to_host(v) for v in (input_ids, positions, meta)))
        return self.part(input_ids, positions, kv_layers, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.ranks.send("logits", to_host(hidden))
        return self.gathered.compute_logits(hidden)

    def __getattr__(self, name: str):
        return getattr(self.part, name)


class GatheredModel:
    """A rank's part of the model, whose ``compute_logits`` gathers the whole vocabulary's logits on rank 0
    (None on the other ranks): the same calls and collectives on every rank, as a graph captures them."""

    def __init__(self, part: CausalLM, shard: Shard) -> None:
        self.part, self.shard = part, shard

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_layers, meta) -> torch.Tensor:
        return self.part(input_ids, positions, kv_layers, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_logits(self.part.group, self.part.compute_logits(hidden), self.shard)


class DecodeSteps:
    """One rank's padded decode steps over ``inputs``: its CUDA graphs when ``capture`` (captured now, in step
    with the other ranks), else its eager forward."""

    def __init__(self, model: GatheredModel, kv_layers: list[LayerKV], inputs: PaddedDecodeInputs,
                 device: torch.device, capture: bool) -> None:  # fmt: skip
        self.model, self.kv_layers, self.inputs = model, kv_layers, inputs
        self.graphs = DecodeGraphs(model, kv_layers, inputs, device) if capture else None

    def run(self, bucket: int) -> torch.Tensor | None:
        """The step staged in ``bucket``: its logits on rank 0, None on the others."""
        if self.graphs is not None:
            return self.graphs.replay(bucket)
        return decode_forward(self.model, self.kv_layers, self.inputs, bucket)


class ShardedDecode:
    """Rank 0's padded decode steps under tensor parallelism: what the runner replays as it would a
    ``DecodeGraphs`` (``replay(bucket)`` after staging ``inputs``). Built after the ranks hold their KV."""

    def __init__(self, model: ShardedModel, kv_layers: list[LayerKV], inputs: PaddedDecodeInputs,
                 device: torch.device, timeout_s: float) -> None:  # fmt: skip
        capture = device.type == "cuda"
        self.ranks, self.inputs, self.timeout_s = model.ranks, inputs, timeout_s
        model.ranks.send("decode_steps", (inputs.buckets, inputs.max_blocks_per_seq, capture))
        self.steps = DecodeSteps(model.gathered, kv_layers, inputs, device, capture)

    def summary(self) -> str:
        graphs = self.steps.graphs
        ranks = f"on each of {self.ranks.size} tensor-parallel ranks"
        return f"{graphs.summary()} {ranks}" if graphs is not None else f"decode steps run eagerly {ranks}"

    def replay(self, bucket: int) -> torch.Tensor:
        self.ranks.send("decode", (bucket, self.inputs.host_arrays(bucket)))
        logits = self.steps.run(bucket)
        if self.steps.graphs is not None:
            wait_for_device(self.timeout_s)
        return logits


def wait_for_device(timeout_s: float) -> None:
    """Returns once this device's work so far is done; ``RankLost`` past ``timeout_s``. A collective replayed in
    a CUDA graph has no timeout of its own (the process group's watchdog never sees it), so a rank hung or gone
    would hold the step, and the worker, for good; this wait is its timeout."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise RankLost(f"a tensor parallel decode step did not finish within {timeout_s:g} s "
                           "(tensor_parallel_timeout_s): a rank is hung or gone")  # fmt: skip
        time.sleep(50e-6)


def rank_decode_steps(model: CausalLM, shard: Shard, kv_layers: list[LayerKV], buckets: list[int],
                      max_blocks_per_seq: int, capture: bool, device: torch.device) -> DecodeSteps:  # fmt: skip
    """A rank's side of ``ShardedDecode``: inputs of the same buckets as rank 0's, and its steps over them."""
    inputs = PaddedDecodeInputs(buckets, max_blocks_per_seq, device)
    return DecodeSteps(GatheredModel(model, shard), kv_layers, inputs, device, capture)


def run_rank_step(steps: DecodeSteps, bucket: int, arrays: dict[str, np.ndarray]) -> None:
    """A rank's ``decode`` plan: rank 0's staged arrays into this rank's buffers, then the step."""
    steps.inputs.stage_arrays(bucket, arrays)
    steps.run(bucket)
