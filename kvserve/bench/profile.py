"""Where a decode step's time goes: kernel launches per step and per layer, and how busy the GPU is.

``profile_decode_steps(llm, batch_size, prompt_len, num_steps)`` queues ``batch_size`` random prompts,
steps the engine until every one of them has its first token (so the batch is decode-only from then on),
runs two more steps to settle, times ``num_steps`` decode steps, then runs ``num_steps`` more under
``torch.profiler`` and reads its trace:

* launches: the kernels the device ran (CUPTI reports those inside a replayed CUDA graph too), and the
  host's launch calls (``cudaLaunchKernel``, ``cuLaunchKernel*``, ``cudaGraphLaunch``...);
* per layer: the kernels whose launch call lies inside a decoder layer's forward, which the profile marks
  with a ``record_function`` range. Only an eager engine (``enforce_eager=True``) runs the layers' Python
  code; under CUDA graphs nothing is marked, and the figure is all of a step's kernels over the layers
  (embedding, logits and sampling included: an upper bound), as it is when the trace lacks the launch
  call of some kernel;
* GPU busy: the union of the kernel intervals over the wall time of the same number of unprofiled steps
  (the profiler slows the host down, not the kernels).

Without CUDA the profiler sees no kernels: launches are 0 and GPU busy is ``None``. The requests are
aborted at the end, so the engine is left empty.
"""

from __future__ import annotations

import bisect
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LAYER_RANGE = "kvserve.decoder_layer"
_SETTLE_STEPS = 2
_LAUNCH_CALLS = ("LaunchKernel", "GraphLaunch", "LaunchCooperativeKernel")  # parts of runtime/driver API names


@dataclass(frozen=True)
class DecodeProfile:
    """Per decode step of the profiled batch; ``gpu_busy`` is ``kernel_ms / wall_ms`` (None without CUDA)."""

    launches_per_step: float  # kernels the device ran
    launches_per_layer: float
    gpu_busy: float | None
    wall_ms: float
    kernel_ms: float  # union of kernel intervals
    host_launches_per_step: float = 0.0  # launch API calls: one per kernel when eager, one per graph replayed


@dataclass(frozen=True)
class TraceCounts:
    """What ``count_trace`` reads from a Chrome trace of the profiled steps (totals, not per step)."""

    num_kernels: int
    num_layer_kernels: int  # kernels launched inside a ``LAYER_RANGE`` range
    num_unattributed: int  # kernels whose launch call the trace does not hold
    num_host_launches: int
    kernel_us: float  # union of the kernel intervals


def count_trace(events: list[dict]) -> TraceCounts:
    """Count kernels, kernels launched from inside a layer range, host launch calls, and kernel busy time.

    ``events`` are a Chrome trace's ``traceEvents`` as ``torch.profiler`` writes them: complete events
    (``ph`` ``X``) with ``cat`` ``kernel`` (device, with ``args.correlation``), ``cuda_runtime`` /
    ``cuda_driver`` (host API calls, the same ``args.correlation`` as the kernel they launched) and
    ``user_annotation`` (``record_function`` ranges); ``ts`` and ``dur`` in microseconds.
    """
    kernels, launch_ts, layers = [], {}, []
    for event in events:
        if event.get("ph") != "X":
            continue
        cat, name = event.get("cat", ""), event.get("name", "")
        if cat == "kernel":
            kernels.append(event)
        elif cat in ("cuda_runtime", "cuda_driver") and any(call in name for call in _LAUNCH_CALLS):
            launch_ts[event.get("args", {}).get("correlation")] = float(event["ts"])
        elif cat == "user_annotation" and name == LAYER_RANGE:
            layers.append((float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))))
    layers.sort()
    starts = [start for start, _ in layers]

    def in_layer(ts: float | None) -> bool:
        if ts is None:
            return False
        i = bisect.bisect_right(starts, ts) - 1
        return i >= 0 and ts <= layers[i][1]

    launches = [launch_ts.get(k.get("args", {}).get("correlation")) for k in kernels]
    num_layer_kernels = sum(in_layer(ts) for ts in launches)
    busy_us, end = 0.0, float("-inf")
    for start, stop in sorted((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels):
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return TraceCounts(len(kernels), num_layer_kernels, launches.count(None), len(launch_ts), busy_us)


def decoding_batch(engine, batch_size: int, prompt_len: int, num_steps: int) -> list[str]:
    """Queue ``batch_size`` random ``prompt_len``-token prompts and step until every one decodes, then
    ``_SETTLE_STEPS`` more: their request ids, each with at least ``2 * num_steps`` decode steps left (the caller
    aborts them when done; they are aborted here if stepping fails)."""
    from engine import SamplingParams

    if not 1 <= batch_size <= engine.config.max_num_seqs:
        raise ValueError(f"batch_size must be in 1..max_num_seqs ({engine.config.max_num_seqs}), got {batch_size}")
    if prompt_len < 1 or num_steps < 1:
        raise ValueError(f"prompt_len and num_steps must be positive, got {prompt_len} and {num_steps}")
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(100, vocab, (batch_size, prompt_len), generator=torch.Generator().manual_seed(7))
    # Requests that finish their prompts in an earlier step decode while the others still prefill: enough new
    # tokens that none finishes before the last profiled step, whichever step its prompt ended in.
    prefill_steps = -(-batch_size * prompt_len // engine.config.max_num_batched_tokens)
    max_tokens = prefill_steps + _SETTLE_STEPS + 2 * num_steps + 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts.tolist()]
    try:
        _step_until_decoding(engine, set(ids))
        for _ in range(_SETTLE_STEPS):
            engine.step()
    except BaseException:
        for request_id in ids:
            engine.abort(request_id)
        raise
    return ids


def profile_decode_steps(llm, batch_size: int, prompt_len: int, num_steps: int) -> DecodeProfile:
    """Profile ``num_steps`` decode-only steps of ``batch_size`` sequences after ``prompt_len``-token prompts."""
    engine = llm.engine
    device = engine.runner.device
    ids = decoding_batch(engine, batch_size, prompt_len, num_steps)
    try:
        wall_s = _timed_steps(engine, num_steps, device)
        counts = _profiled_counts(engine, num_steps, device, _decoder_layers(engine.runner.model))
    finally:
        for request_id in ids:
            engine.abort(request_id)
    num_layers = engine.model_config.num_layers
    # Under graphs nothing is marked; a kernel of unknown launch may be a layer's: count all kernels then.
    attributed = counts.num_layer_kernels and not counts.num_unattributed
    per_layer = counts.num_layer_kernels if attributed else counts.num_kernels
    wall_ms, kernel_ms = wall_s * 1e3 / num_steps, counts.kernel_us / 1e3 / num_steps
    return DecodeProfile(
        launches_per_step=counts.num_kernels / num_steps,
        launches_per_layer=per_layer / (num_steps * num_layers),
        gpu_busy=kernel_ms / wall_ms if device.type == "cuda" else None,
        wall_ms=wall_ms,
        kernel_ms=kernel_ms,
        host_launches_per_step=counts.num_host_launches / num_steps,
    )


def _step_until_decoding(engine, request_ids: set[str]) -> None:
    """Step until every request has its first token: from then on each step decodes one token for all."""
    started: set[str] = set()
    while started != request_ids:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the profiled requests finished before they all reached their decode phase")
        started.update(out.request_id for out in engine.step() if out.request_id in request_ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(engine, num_steps: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    _sync(device)
    return time.perf_counter() - start


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the children of the model's ``layers`` module list."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise ValueError("the model has no 'layers' module list to mark")


def _profiled_counts(engine, num_steps: int, device: torch.device, layers: list[torch.nn.Module]) -> TraceCounts:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    open_ranges: list[torch.profiler.record_function] = []

    def enter(module, args) -> None:
        open_ranges.append(torch.profiler.record_function(LAYER_RANGE).__enter__())

    def leave(module, args, output) -> None:
        open_ranges.pop().__exit__(None, None, None)

    hooks = [hook for layer in layers for hook in (layer.register_forward_pre_hook(enter),
                                                   layer.register_forward_hook(leave))]  # fmt: skip
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(num_steps):
                engine.step()
            _sync(device)
    finally:
        for hook in hooks:
            hook.remove()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return count_trace(events)


@dataclass(frozen=True)
class MoEShare:
    """Per decode step of a mixture-of-experts model (``engine.models.moe``), in ms of wall time."""

    step_ms: float
    moe_ms: float  # in the MoE MLPs, all of them
    experts_ms: float  # of which in the experts' grouped GEMMs

    @property
    def routing_share(self) -> float:
        """The share of a step spent routing and grouping: router, top-k, sorting by expert, gathering the
        rows, weighting and summing them back (the MoE MLPs' time outside the experts' GEMMs)."""
        return (self.moe_ms - self.experts_ms) / self.step_ms


def moe_routing_share(llm, batch_size: int, prompt_len: int, num_steps: int) -> MoEShare:
    """Time ``num_steps`` decode steps of ``batch_size`` sequences, and inside them the MoE MLPs and their
    experts, by forward hooks that synchronise the device (so the step is slower than unobserved on a GPU)."""
    from engine import SamplingParams
    from engine.models.moe import Experts, SparseMoE

    engine = llm.engine
    device = engine.runner.device
    modules = [m for m in engine.runner.model.modules() if isinstance(m, (SparseMoE, Experts))]
    if not modules:
        raise ValueError("the model has no mixture-of-experts layer")
    spent = {SparseMoE: 0.0, Experts: 0.0}
    started: list[float] = []

    def enter(module, args) -> None:
        _sync(device)
        started.append(time.perf_counter())

    def leave(module, args, output) -> None:
        _sync(device)
        spent[type(module)] += time.perf_counter() - started.pop()

    prompts = torch.randint(100, engine.model_config.vocab_size, (batch_size, prompt_len),
                            generator=torch.Generator().manual_seed(7))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=num_steps + _SETTLE_STEPS + 2, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts.tolist()]
    hooks = []
    try:
        _step_until_decoding(engine, set(ids))
        for _ in range(_SETTLE_STEPS):
            engine.step()
        hooks = [hook for m in modules for hook in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        wall_s = _timed_steps(engine, num_steps, device)
    finally:
        for hook in hooks:
            hook.remove()
        for request_id in ids:
            engine.abort(request_id)
    per_step = 1e3 / num_steps
    return MoEShare(wall_s * per_step, spent[SparseMoE] * per_step, spent[Experts] * per_step)
