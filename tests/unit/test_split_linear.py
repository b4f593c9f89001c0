"""``engine.models.linear``: a few rows times a weight as one ``bmm`` over blocks of the weight's rows gives
``F.linear``'s product (checked against float64), bias included; it is used only for few rows on a CPU with
threads to spare, with a block count that divides the weight's rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import linear


@pytest.mark.parametrize("rows, out_features, blocks, bias", [(1, 960, 8, False), (3, 576, 4, True),
                                                              (8, 49152, 8, False), (5, 3072, 2, True)])  # fmt: skip
def test_the_split_product_is_the_linear_product(rows, out_features, blocks, bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=gen), torch.randn(out_features, 576, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    got = linear.split_linear(x, weight, b, blocks)
    exact = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    # float32 dot products of 576 terms of size ~1: the same rounding error as F.linear's own
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=0, atol=1e-4)


def test_only_few_rows_on_a_cpu_with_threads_to_spare_are_split(monkeypatch):
    weight = torch.empty(960, 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert linear.split_blocks(torch.empty(1, 64), weight) == 8  # 2 threads x 4 blocks, 960 = 8 x 120
    assert linear.split_blocks(torch.empty(linear.SPLIT_MAX_ROWS + 1, 64), weight) == 1  # a prefill's rows
    assert linear.split_blocks(torch.empty(1, 64), torch.empty(7 * 5, 64)) == 1  # no block count divides 35
    assert linear.split_blocks(torch.empty(1, 64), torch.empty(4 * 3, 64)) == 4
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert linear.split_blocks(torch.empty(1, 64), weight) == 1


@pytest.mark.parametrize("rows", [1, 16, linear.SPLIT_MAX_ROWS + 1])
def test_packed_layers_go_to_onednn_and_give_the_linear_product(monkeypatch, rows):
    gen = torch.Generator().manual_seed(1)
    layer = linear.Linear(576, 960, bias=True)
    assert linear.pack_for_onednn(layer) == 960 * 576 * 4
    x = torch.randn(rows, 576, generator=gen)
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(args[1]) or onednn(*args),
                        raising=False)  # fmt: skip
    with torch.inference_mode():
        got = layer(x)
    assert len(calls) == 1 and calls[0] is layer.packed
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-4)  # float32 sums of 576 terms, as F.linear's
    double = linear.Linear(576, 960, dtype=torch.float64)
    assert linear.pack_for_onednn(double) == 0 and double.packed is None  # float32 only
