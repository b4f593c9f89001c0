"""Is a step bound by compute, by memory bandwidth or by the host? Each step's bytes, FLOPs and host time against
the device's peaks (``engine.device_peaks``).

What a step must do, counted from the batch before it runs (``StepCostModel.count``). For sequence i of the
batch, ``s_i`` tokens already have KV, ``n_i`` are computed now, ``c_i = s_i + n_i``; ``T = sum n_i``; ``R`` rows
are sampled (a sequence that reaches its end samples one row, a speculating one a row per proposal more); ``L``
layers; ``H`` query heads of ``D`` dims; ``b_kv`` the bytes of one token's K and V in one layer (INT8 scales
included):

* bytes = weights + KV read + KV written (activations and logits are not counted):

  - weights: every parameter but the embedding table, read once per step (a mixture of experts: the experts at
    most ``T * k`` of ``E`` can pick), plus the LM head's ``vocab * hidden`` when ``R > 0``, plus the ``T``
    embedding rows looked up; each at its own dtype's size;
  - KV read: ``L * b_kv * sum c_i`` (each sequence's whole context, K and V, every layer);
  - KV written: ``L * b_kv * T``;

* FLOPs = ``2 * P * T`` (``P``: the non-embedding parameters one token goes through: the decoder layers and the
  final norm; of a mixture of experts, the ``k`` experts a token uses) + ``4 * L * H * D * sum a_i`` (QK^T and
  PV) + ``2 * hidden * vocab * R`` (the LM head), where ``a_i = n_i * s_i + n_i (n_i + 1) / 2`` is the
  query-key pairs of sequence i under the causal mask (a decode: ``a_i = c_i``).

A sequence attending through a window (``kvstore.ring``: a streaming request, or the model's sliding window)
reads and scores at most its window plus sinks in the layers that slide; the counts above cap ``c_i`` and the
keys of each query there.

Time. The step is ``LLMEngine.step`` from its first line to its last (scheduling, inputs, the model, sampling,
outputs); its device time is the time inside the model's forward with its logits and inside the sampler
(``DeviceClock``): CUDA events around each on a GPU, read once they completed (so no sync is added); on the
CPU, where torch runs every operator on the calling thread, the wall time inside them: there the CPU is the
device, and what lies outside them (scheduling, block bookkeeping, staging inputs with NumPy, picking the rows
to sample, appending tokens, detokenizing) is the Python a GPU would sit idle through. host = step - device.
(The Python between torch operators inside the forward counts as device time here; on a GPU it overlaps the
kernels it launches.)

Utilisation: memory bandwidth = bytes / step time / peak bandwidth; compute = FLOPs / step time / peak FLOP/s;
host = host time / step time; each clipped to [0, 1]. Over many steps the sums are divided, so a long step
weighs more than a short one: ``recent()`` over an exponential moving window of about ``WINDOW_STEPS`` steps
(the Prometheus gauges), ``totals()`` since the start by kind of step (the bench's lines, as differences).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, fields

import torch
from torch import nn

from engine.device_peaks import DevicePeaks
from engine.model_config import ModelConfig
from engine.models.moe import Experts
from engine.scheduler import ScheduledBatch
from kvstore import KVCacheSpec

WINDOW_STEPS = 64
RESOURCES = ("memory_bandwidth", "compute", "host")


@dataclass(frozen=True)
class StepCost:
    """What one step must move and compute (the module's docstring gives the formulas)."""

    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


class StepCostModel:
    """A model's per-step constants, counted once from the loaded weights and the KV layout."""

    def __init__(self, model: nn.Module, config: ModelConfig, kv_spec: KVCacheSpec) -> None:
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        experts = {id(p): p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
        body = [p for p in model.parameters() if p is not embed and p is not head and id(p) not in experts]
        self.body_params = sum(p.numel() for p in body)
        self.body_bytes = sum(p.numel() * p.element_size() for p in body)
        self.expert_params = sum(p.numel() for p in experts.values())
        self.expert_bytes = sum(p.numel() * p.element_size() for p in experts.values())
        self.num_experts, self.experts_per_token = config.num_experts, config.num_experts_per_tok
        self.head_bytes = head.numel() * head.element_size()
        self.embed_row_bytes = config.hidden_size * embed.element_size()
        self.head_flops_per_row = 2 * config.hidden_size * config.vocab_size
        self.num_layers = config.num_layers
        # the layers a ring caps (``engine.models.model.Attention.windowed``)
        self.num_windowed = config.num_layers if config.sliding_window is None else len(config.sliding_window_layers)
        per_head = kv_spec.head_dim * (kv_spec.k_dtype.itemsize + kv_spec.v_dtype.itemsize)
        scales = 4 * ((kv_spec.k_dtype == torch.int8) + (kv_spec.v_dtype == torch.int8))
        self.kv_token_layer_bytes = kv_spec.num_kv_heads * (per_head + scales)
        self.attention_flops_per_pair = 4 * config.num_heads * config.head_dim

    @property
    def flops_per_token(self) -> int:
        """2 * the parameters one token goes through (``P`` in the module's docstring)."""
        active = self.expert_params * self.experts_per_token // self.num_experts if self.num_experts else 0
        return 2 * (self.body_params + active)

    def count(self, batch: ScheduledBatch) -> StepCost:
        """The cost of ``batch``, before it runs (O(batch) integer arithmetic)."""
        num_layers, windowed = self.num_layers, self.num_windowed
        num_tokens = context = pairs = rows = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            num_tokens += n
            if seq.ring is None:
                context += num_layers * end
                pairs += num_layers * (n * start + n * (n + 1) // 2)
            else:
                cap = seq.ring.num_sinks + seq.ring.window
                full = num_layers - windowed
                context += full * end + windowed * min(end, cap)
                pairs += full * (n * start + n * (n + 1) // 2) + windowed * _capped_pairs(start, n, cap)
            proposed = len(seq.spec_token_ids)
            if end == seq.num_tokens + proposed:
                rows += 1 + proposed
        weights = self.body_bytes + num_tokens * self.embed_row_bytes + (self.head_bytes if rows else 0)
        if self.num_experts:
            touched = min(self.num_experts, num_tokens * self.experts_per_token)
            weights += self.expert_bytes * touched // self.num_experts
        flops = (self.flops_per_token * num_tokens + self.attention_flops_per_pair * pairs
                 + self.head_flops_per_row * rows)  # fmt: skip
        kv = self.kv_token_layer_bytes
        return StepCost(weights, kv * context, kv * num_layers * num_tokens, flops)


def _capped_pairs(start: int, n: int, cap: int) -> int:
    """sum over k in start+1..start+n of min(k, cap): the keys the queries of a chunk score through a window."""
    below = max(0, min(start + n, cap) - start)  # queries that still see every earlier key
    return below * start + below * (below + 1) // 2 + (n - below) * cap


class DeviceClock:
    """The device's share of a step: ``with clock:`` around each device part of it (the forward with its logits,
    the sampler), ``take()`` at the step's end. On the CPU the parts' wall time; on a GPU a pair of CUDA events per
    part (reused once read), which ``StepDiagnosis`` reads after they completed. Disabled, it does nothing."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0
        self._began = 0.0

    def __enter__(self) -> DeviceClock:
        if not self.enabled:
            return self
        if self.cuda:
            span = self._free.pop() if self._free else (torch.cuda.Event(enable_timing=True),
                                                         torch.cuda.Event(enable_timing=True))  # fmt: skip
            span[0].record()
            self._spans.append(span)
        else:
            self._began = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if not self.enabled:
            return
        if exc_type is not None:  # the step failed: its parts are nobody's
            self.take()
        elif self.cuda:
            self._spans[-1][1].record()
        else:
            self._seconds += time.perf_counter() - self._began

    def take(self) -> float | list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """The parts timed since the last call: seconds (CPU), or their event pairs (GPU)."""
        if self.cuda:
            spans, self._spans = self._spans, []
            return spans
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def give_back(self, spans: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> None:
        self._free.extend(spans)


@dataclass
class StepTotals:
    """Sums over steps: how many, their bytes, FLOPs, wall and device seconds."""

    num_steps: float = 0
    bytes: float = 0
    flops: float = 0
    wall_s: float = 0
    device_s: float = 0

    def add(self, cost: StepCost, wall_s: float, device_s: float, keep: float = 1.0) -> None:
        """Add a step, after weighing the sums so far by ``keep`` (an exponential moving window below 1)."""
        self.num_steps = self.num_steps * keep + 1
        self.bytes = self.bytes * keep + cost.bytes
        self.flops = self.flops * keep + cost.flops
        self.wall_s = self.wall_s * keep + wall_s
        self.device_s = self.device_s * keep + device_s

    def __sub__(self, other: StepTotals) -> StepTotals:
        return StepTotals(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def copy(self) -> StepTotals:
        return StepTotals(*(getattr(self, f.name) for f in fields(self)))


@dataclass(frozen=True)
class Utilization:
    """Fractions in [0, 1] of the peak memory bandwidth and compute a span of steps used, and the host's share
    of its time."""

    memory_bandwidth: float
    compute: float
    host: float

    @classmethod
    def of(cls, totals: StepTotals, peaks: DevicePeaks) -> Utilization:
        if totals.wall_s <= 0:
            return cls(0.0, 0.0, 0.0)
        wall = totals.wall_s
        return cls(_clip(totals.bytes / wall / peaks.memory_bandwidth), _clip(totals.flops / wall / peaks.flops),
                   _clip((wall - totals.device_s) / wall))  # fmt: skip

    def line(self) -> str:
        """``memory bandwidth 71% | compute 9% | host 20%``."""
        return f"memory bandwidth {self.memory_bandwidth:.0%} | compute {self.compute:.0%} | host {self.host:.0%}"


def _clip(value: float) -> float:
    return min(1.0, max(0.0, value))


class StepDiagnosis:
    """Per engine: each step's cost and times folded into running sums, read at any time without touching the
    device. ``record`` runs on the engine's thread; ``recent`` and ``totals`` may be read from another (a
    scrape), which sees the sums of some recent step."""

    def __init__(self, cost_model: StepCostModel, peaks: DevicePeaks, clock: DeviceClock) -> None:
        self.cost_model, self.peaks, self.clock = cost_model, peaks, clock
        self._recent = StepTotals()
        self._totals = {"decode": StepTotals(), "prefill": StepTotals()}
        self._keep = 1 - 1 / WINDOW_STEPS
        self._pending: deque[tuple[str, StepCost, float, list]] = deque()  # GPU steps whose events are not done

    @classmethod
    def of(cls, runner, model_config: ModelConfig, peaks: DevicePeaks) -> StepDiagnosis:
        """The diagnosis of ``runner``'s (an ``engine.model_runner.ModelRunner``) steps against ``peaks``."""
        return cls(StepCostModel(runner.model, model_config, runner.kv_spec), peaks, runner.clock)

    def count(self, batch: ScheduledBatch) -> StepCost:
        return self.cost_model.count(batch)

    def record(self, batch: ScheduledBatch, cost: StepCost, wall_s: float) -> None:
        """Fold in a step that ran ``batch`` (a decode step when every sequence computed one token, else a
        prefill step: prefill, mixed or a speculative verify) in ``wall_s``; on a GPU, once its events completed
        (at once after a sampling step, whose tokens were read back; else at a later step)."""
        kind = "decode" if batch.num_decodes == len(batch.seqs) else "prefill"
        device = self.clock.take()
        if not isinstance(device, list):
            self._fold(kind, cost, wall_s, device)
            return
        self._pending.append((kind, cost, wall_s, device))
        while self._pending and all(end.query() for _, end in self._pending[0][3][-1:]):
            kind, cost, wall_s, spans = self._pending.popleft()
            self._fold(kind, cost, wall_s, sum(start.elapsed_time(end) for start, end in spans) / 1e3)
            self.clock.give_back(spans)

    def _fold(self, kind: str, cost: StepCost, wall_s: float, device_s: float) -> None:
        self._recent.add(cost, wall_s, device_s, self._keep)
        self._totals[kind].add(cost, wall_s, device_s)

    def recent(self) -> Utilization:
        """Over the last ``WINDOW_STEPS`` steps or so (each older step weighs ``1 - 1/WINDOW_STEPS`` less); all
        zero before the first step."""
        return Utilization.of(self._recent.copy(), self.peaks)

    def totals(self) -> dict[str, StepTotals]:
        """Since the start, by kind ("decode", "prefill"): copies, to subtract one reading from a later one."""
        return {kind: totals.copy() for kind, totals in self._totals.items()}

    def utilization(self, totals: StepTotals) -> Utilization:
        return Utilization.of(totals, self.peaks)
