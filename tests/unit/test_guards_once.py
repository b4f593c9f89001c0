"""``engine.models.guards_once.GuardsOnce``: dynamo's guards run once per kind of call, and each call still runs
the graph compiled for inputs like its own. Dynamo's ``eager`` backend keeps this free of the C++ compiler: its
guards and cache entries are the same as inductor's."""

from __future__ import annotations

import torch

from engine.models import guards_once
from engine.models.guards_once import GuardsOnce


def _step(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.sum(0, keepdim=True) if x.shape[0] > 1 else x * 3  # a size of 1 specializes: an entry of its own
    return y if bias is None else y + bias


def _kind(x: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return x.shape[0] == 1, bias is None


def _other_step(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _step(x, bias)  # (a code object of its own: dynamo keeps its cache entries on the code object)


def _guards_once(function) -> GuardsOnce:
    return GuardsOnce(function, torch.compile(function, backend="eager", dynamic=True, fullgraph=True), _kind)


def test_each_call_gets_the_graph_for_its_inputs_and_the_guards_run_once_per_kind(monkeypatch):
    step = _guards_once(_step)
    checks = []
    real = guards_once.GuardsOnce._entry_for
    monkeypatch.setattr(guards_once.GuardsOnce, "_entry_for", lambda self, args: checks.append(1) or real(self, args))
    bias = torch.tensor([0.5, -1.0])
    calls = [(torch.ones(1, 2), None), (torch.ones(3, 2), None), (torch.ones(1, 2), bias), (torch.ones(5, 2), bias)]
    for _ in range(3):  # the first round compiles each kind; the next two run its code directly
        for x, b in calls:
            torch.testing.assert_close(step(x, b), _step(x, b), rtol=0, atol=0)
    assert len(step.direct) == 4
    assert len(checks) == 8  # each kind: no entry before its first call compiles one, then found once


def test_a_torch_without_readable_cache_entries_runs_every_call_through_dynamo(monkeypatch):
    step = _guards_once(_other_step)
    monkeypatch.delattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list")
    for n in (1, 4, 1):
        x = torch.arange(2.0 * n).view(n, 2)
        torch.testing.assert_close(step(x, None), _step(x, None), rtol=0, atol=0)
    assert step.direct is None
