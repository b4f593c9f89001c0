"""The Triton Gumbel-max draw against ``reference.gumbel_argmax``: the same tokens, row for row.

The kernel runs interpreted on the CPU (compiled on a GPU) in float32, at vocabularies that are and are not a
multiple of its tile, with small tiles too so that a row spans several tiles and the tile reduction is used.
"""

import importlib

import pytest
import torch
from paged_kv_testing import DEVICE, interpreted_triton, triton_ops  # noqa: F401  (autouse fixture, found by name)

import kvkernels
from kvkernels import reference

SEEDS = [0, -1, 1 << 62, -(1 << 63), 12345, 7, 99]
POSITIONS = [0, 1, 10**9, 4095, 3, 1 << 40, 17]


def _sampling(monkeypatch: pytest.MonkeyPatch, block: int | None):
    """``kvkernels.sampling`` with interpreted kernels on the CPU, its tile width set to ``block`` if given."""
    triton_ops()  # skips unless Triton runs interpreted; reloads kernel modules imported compiled
    module = importlib.import_module("kvkernels.sampling")
    if block is not None:
        monkeypatch.setattr(module, "_BLOCK", block)
    return module


def _rows(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``(7, vocab)`` float32 scaled logits covering what the sampler hands over."""
    logits = torch.randn(len(SEEDS), vocab, generator=generator) * 3
    logits[1, torch.rand(vocab, generator=generator) < 0.5] = float("-inf")  # top-p/top-k filtered half
    logits[2, 3:] = float("-inf")  # only tokens 0, 1, 2 left
    logits[3, vocab - 1] = 100.0  # one token dominates, the last one (alone in its tile at vocab 4097)
    logits[4] = 0.0  # uniform: the winner is the token with the largest uniform, the noise bits alone decide
    logits[5, 1:] = float("-inf")  # top-k 1
    logits[6, 3] = logits[6, vocab - 2] = float("inf")  # a tie, across tiles: the lowest id wins, as torch.argmax
    return logits


@pytest.mark.parametrize("vocab", [1000, 4097])
@pytest.mark.parametrize("block", [None, 256], ids=["default-tile", "tile-256"])
def test_draws_the_reference_tokens(monkeypatch, vocab, block):
    generator = torch.Generator().manual_seed(vocab)
    logits = _rows(vocab, generator)
    seeds, positions = torch.tensor(SEEDS), torch.tensor(POSITIONS)
    sampling = _sampling(monkeypatch, block)

    tokens = sampling.gumbel_argmax(logits.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)).cpu()

    expected = reference.gumbel_argmax(logits, seeds, positions)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(SEEDS),)
    # The kernel hashes the very same noise bits, so the only difference from the reference is the rounding of
    # the two float32 logs (Triton's log against PyTorch's). That could flip a near-tie between the two best
    # scores, and nothing else: a different token must score within that rounding of the reference's. (With
    # these inputs every token is equal; a wrong bit in the hash would move most winners by far more.)
    scores = logits - reference.uniform_noise(seeds, positions, vocab).log().neg().log()  # (rows, vocab)
    best, drawn = scores.gather(1, expected[:, None]).squeeze(1), scores.gather(1, tokens[:, None]).squeeze(1)
    assert torch.all((tokens == expected) | ((best - drawn).abs() <= 1e-5 * best.abs()))
    assert tokens[2] in (0, 1, 2) and tokens[3] == vocab - 1 and tokens[5] == 0 and tokens[6] == 3
    assert logits[1, tokens[1]] > float("-inf")


def test_rows_draw_independently_and_differently_per_position(monkeypatch):
    sampling = _sampling(monkeypatch, None)
    logits = torch.zeros(64, 500, device=DEVICE)
    seeds = torch.full((64,), 5, device=DEVICE)
    positions = torch.arange(64, device=DEVICE)

    tokens = sampling.gumbel_argmax(logits, seeds, positions)

    # a flat distribution over 500 tokens: 64 positions of one stream hardly ever repeat a token
    assert len(set(tokens.tolist())) > 50
    alone = sampling.gumbel_argmax(logits[9:10], seeds[9:10], positions[9:10])
    assert alone.tolist() == tokens[9:10].tolist()


def test_rejects_other_layouts_and_takes_empty_batches(monkeypatch):
    sampling = _sampling(monkeypatch, None)
    seeds = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    wide = torch.zeros(3, 200, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        sampling.gumbel_argmax(wide.half(), seeds, seeds)
    with pytest.raises(ValueError, match="contiguous"):
        sampling.gumbel_argmax(wide[:, ::2], seeds, seeds)
    assert sampling.gumbel_argmax(wide[:0], seeds[:0], seeds[:0]).shape == (0,)
    strided_rows = sampling.gumbel_argmax(wide[:, :100], seeds, seeds)  # row stride 200
    assert strided_rows.tolist() == reference.gumbel_argmax(wide[:, :100].cpu(), seeds.cpu(), seeds.cpu()).tolist()


def test_public_entry_point_dispatches_to_the_kernel(monkeypatch):
    sampling = _sampling(monkeypatch, None)
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 300, generator=generator) * 2).to(DEVICE)
    seeds, positions = torch.tensor([1, 2, 3, 4], device=DEVICE), torch.tensor([9, 8, 7, 6], device=DEVICE)

    assert kvkernels.use_triton(logits.device)
    expected = sampling.gumbel_argmax(logits, seeds, positions)
    assert torch.equal(kvkernels.gumbel_argmax(logits, seeds, positions), expected)
