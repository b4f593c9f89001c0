"""The step diagnosis' host share (``engine.step_diagnosis``) against torch.profiler's, on the same decode steps.

    kvserve bench offline --diagnose [--batch-sizes 1,16 --prompt-len 128 --diagnose-steps 32]

``compare_host_share(llm, batch_size, prompt_len, num_steps)`` brings ``batch_size`` random prompts to their decode
phase (``kvserve.bench.profile.decoding_batch``), then runs three times ``num_steps`` decode steps:

1. as they are: the diagnosis' host share of them (``unprofiled``);
2. under ``torch.profiler`` with its Python tracer (``with_stack``), a step being a call of ``LLMEngine.step``
   (the span the diagnosis times, from its first line to its return): the host share of those very steps by the
   engine's own counters (``diagnosis``), and by the same definition from the profiler's trace alone
   (``profiler``): the steps' time minus the time inside the runner's device calls, as Python function events:
   the model's call (``nn.Module: CausalLM_0``, its forward inside), ``compute_logits``, the padded decode path's
   ``decode_forward`` around both, and the sampler's ``__call__``;
3. under ``torch.profiler`` without the Python tracer, each step in a ``record_function`` range: a stricter
   reading (``outside_operators``), the steps' time minus the union of every torch operator's time, so that the
   Python between operators inside the forward counts as host too (the diagnosis counts it as device time), beside
   the diagnosis of the same steps (``operators_diagnosis``).

torch.profiler, not cProfile or py-spy: it times the Python calls and the torch operators on one clock, so the
same steps give the diagnosis' definition and the operators' reading; cProfile sees no operator, and py-spy
samples (a few dozen steps give it too few samples per function) and needs ptrace. The profiler slows what it
traces (the Python tracer every call, the operator profiler every operator), so profiled steps have larger host
shares than unprofiled ones: each comparison is between readings of the same steps.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.bench.profile import decoding_batch

STEP_RANGE = "kvserve.engine_step"


@dataclass(frozen=True)
class HostShares:
    """Host shares (0..1) of decode steps: see the module's docstring."""

    unprofiled: float
    diagnosis: float
    profiler: float
    operators_diagnosis: float
    outside_operators: float


def compare_host_share(llm, batch_size: int, prompt_len: int, num_steps: int) -> HostShares:
    from engine.cuda_graph import decode_forward

    engine = llm.engine
    if engine.diagnosis is None:
        raise ValueError("the engine runs without its step diagnosis (step_diagnosis=False)")
    traced, operators = [], []
    ids = decoding_batch(engine, batch_size, prompt_len, num_steps)
    try:
        unprofiled = _decode_host_share(engine, lambda: [engine.step() for _ in range(num_steps)])
        diagnosis = _decode_host_share(engine, lambda: traced.extend(_profiled_steps(engine, num_steps, True)))
        operators_diagnosis = _decode_host_share(
            engine, lambda: operators.extend(_profiled_steps(engine, num_steps, False)))
    finally:
        for request_id in ids:
            engine.abort(request_id)
    model, sampler = type(engine.runner.model), type(engine.runner.sampler)
    device_calls = (f"nn.Module: {model.__name__}_",
                    *(_traced_name(fn) for fn in (model.compute_logits, decode_forward, sampler.__call__)))  # fmt: skip
    profiler = device_call_host_share(traced, _traced_name(type(engine).step), device_calls)
    return HostShares(unprofiled, diagnosis, profiler, operators_diagnosis, operator_host_share(operators))


def _decode_host_share(engine, run) -> float:
    before = engine.diagnosis.totals()["decode"]
    run()
    return engine.diagnosis.utilization(engine.diagnosis.totals()["decode"] - before).host


def _profiled_steps(engine, num_steps: int, python: bool) -> list[dict]:
    """The Chrome trace events of ``num_steps`` steps, with the Python tracer or with each step in a
    ``STEP_RANGE``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=python) as prof:
        for _ in range(num_steps):
            if python:
                engine.step()
                continue
            with torch.profiler.record_function(STEP_RANGE):
                engine.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def _traced_name(fn) -> str:
    """The tail of the name torch's Python tracer gives a call of ``fn``: ``model.py(185): forward``."""
    code = fn.__code__
    return f"{Path(code.co_filename).name}({code.co_firstlineno}): {code.co_name}"


def device_call_host_share(events: list[dict], step_call: str, device_calls: tuple[str, ...]) -> float:
    """1 - (time inside the Python calls whose name starts or ends with one of ``device_calls``) / (the steps'
    time), the steps being the Python calls whose name ends with ``step_call``, in a Chrome trace."""
    steps = _spans(events, lambda e: e.get("cat") == "python_function" and e.get("name", "").endswith(step_call))
    thread = steps[0][2]
    calls = _spans(events, lambda e: e.get("cat") == "python_function" and e.get("tid") == thread
                   and (e.get("name", "").startswith(device_calls) or e.get("name", "").endswith(device_calls)))
    return _host_share(steps, calls)


def operator_host_share(events: list[dict]) -> float:
    """1 - (the union of the torch operators' intervals) / (the steps' time), the steps being the ``STEP_RANGE``
    ranges of a Chrome trace."""
    steps = _spans(events, lambda e: e.get("cat") == "user_annotation" and e.get("name") == STEP_RANGE)
    thread = steps[0][2]
    return _host_share(steps, _spans(events, lambda e: e.get("cat") == "cpu_op" and e.get("tid") == thread))


def _spans(events: list[dict], wanted) -> list[tuple[float, float, object]]:
    """(start, end, thread) of the complete events ``wanted`` selects, in start order; ValueError when none."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("tid"))
                   for e in events if e.get("ph") == "X" and wanted(e))  # fmt: skip
    if not spans:
        raise ValueError("the trace holds no step or no device work")
    return spans


def _host_share(steps: list[tuple], busy: list[tuple]) -> float:
    """1 - the length of the union of ``busy`` inside ``steps`` (disjoint, sorted) over the steps' length."""
    covered, end, w = 0.0, float("-inf"), 0
    for start, stop, _ in busy:
        while w < len(steps) and steps[w][1] <= start:
            w += 1
        if w == len(steps):
            break
        lo, hi = max(start, steps[w][0], end), min(stop, steps[w][1])
        if hi > lo:
            covered += hi - lo
        end = max(end, hi)
    return 1 - covered / sum(stop - start for start, stop, _ in steps)
